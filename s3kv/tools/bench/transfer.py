"""``s3kv bench transfer``: save / load throughput of s3kv's pipelines, side by side with two baselines.

For each object size, ``total_mib`` of KV pages (``page_mib`` each, random bytes, CPU host
tensors standing in for the device cache) are moved three ways on the same store:

* **s3kv** -- save: one ``WorkerCore`` executes a plan of ``StageOp``s + ``SealOp``s (pages copied
  into host staging, objects = verified header + pages, uploaded by the worker's upload threads,
  write-once), timed from ``bind`` to ``flush``. Load: a second ``WorkerCore`` (another cluster,
  zeroed cache) executes ``LoadOp``s for every object (ranged GETs on the download threads,
  header and every page checksum verified, pages placed into the slots), timed across the sync
  ``start_load_kv``. The loaded cache is then compared byte for byte with the saved one.
  s3kv runs on every S3 client it ships (``s3kv``: the factory's default, obstore where
  installed; ``s3kv_boto3``: the boto3 store).
* **raw** -- the same number and size of objects with each client library's plainest put / get
  (boto3 ``put_object`` / ``get_object``, obstore ``put`` / ``get``, awscrt's ``S3Client``) from a
  ``ThreadPoolExecutor`` as wide as s3kv's upload (resp. download) threads: what the network path
  can do with that concurrency and no s3kv work at all (no header, no checksums, no copies).
* **upstream example** -- the upstream example's shape on S3: one object per block per group,
  written and read one page at a time, synchronously (the example did ``torch.save`` /
  ``torch.load`` of one page per block per group to local disk; here plain bytes with raw boto3,
  so this baseline is, if anything, faster than the example would be). JSON keys ``seed_*``.

Throughput is payload bytes (pages) over wall time; CPU is the process's CPU time over the same
interval (every thread, native ones too) per GB of payload. Best of ``--repeats`` (odd repeats
run the baselines before s3kv, even ones after). Headline numbers add up every object size
(total bytes / total seconds per method). The targets compare s3kv with the *fastest* raw client
of the run. The ``*_paired`` ratios pair each repeat's s3kv run with that repeat's raw runs
and take the median over repeats: steadier where the server's own speed drifts between runs.

Why this is one module: one benchmark -- its set-up, the runs it compares and the table and plot
that report them.
"""

from __future__ import annotations

import gc
import hashlib
import math
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...config import Settings
from ...core.cost import Prefill
from .clients import fan_out, raw_clients, s3kv_stores, shaped, timed_cpu
from .common import BenchStore, MiB, machine_info, progress, rnd

#: Around what s3kv makes (objects of ~target_object_mib = 32 MiB; smaller at prompt ends).
DEFAULT_OBJECT_MIB = (8.0, 16.0, 32.0)
TARGET_RATIO_VS_RAW = 0.9
TARGET_SPEEDUP_VS_SEED = 5.0


@dataclass(frozen=True)
class TransferConfig:
    object_mib: Sequence[float] = DEFAULT_OBJECT_MIB
    total_mib: int = 256
    page_mib: float = 1.0
    repeats: int = 1
    upload_threads: int = Settings().upload_threads
    download_threads: int = Settings().download_threads
    #: Where the stand-in KV cache lives: "cuda" on a GPU host (the engine's own path: DMA
    #: between the cache and pinned staging), else "cpu" (the copies are host memcpys).
    device: str = "cpu"


def default_device() -> str:
    """cuda where a GPU is visible, else cpu: the bench measures the path an engine there takes."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no torch, no CUDA: a CPU run
        return "cpu"


def default_total_mib(cores: int) -> int:
    """Bytes per object size: enough that the fastest method runs for a good fraction of a second
    (256 MiB on a small box; on a many-core host the raw client moves that in ~50 ms, where fixed
    costs and timer noise would decide the ratios)."""
    return 256 if cores <= 4 else 1024


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16, person=b"s3kv-bench").digest()


class _Size:
    """One object size: the two caches, the plan, and the baselines' bodies."""

    def __init__(self, bs: BenchStore, cfg: TransferConfig, object_mib: float):
        import torch

        from ...core.objects import header_len
        from ...sim.layouts import GroupSpec, make_layout
        from ...transfer.staging import host_memoryview

        self.bs = bs
        self.cfg = cfg
        self.page = int(cfg.page_mib * MiB)
        self.bpo = max(1, round(object_mib * MiB / self.page))
        self.objects = max(1, round(cfg.total_mib * MiB / (self.bpo * self.page)))
        self.pages = self.objects * self.bpo
        self.payload = self.pages * self.page
        self.object_bytes = header_len(self.bpo) + self.bpo * self.page
        self.object_mib = self.bpo * self.page / MiB
        self.root = bs.key(f"transfer/{self.object_mib:g}m")
        groups = [GroupSpec((0,), None, (self.page,))]
        self.src = make_layout(groups, num_slots=self.pages, tokens_per_block=32, fill_seed=None, device=cfg.device)
        region = self.src.group(0).regions[0]
        gen = torch.Generator().manual_seed(int(object_mib * 1000))
        # Random int64 words are ~8x cheaper to make than random bytes; same entropy per byte.
        words = torch.randint(-(2**62), 2**62, (self.payload // 8,), dtype=torch.int64, generator=gen)
        region.as_tensor().copy_(words.view(torch.uint8).view(self.pages, self.page))
        del words
        flat = host_memoryview(region.as_tensor().contiguous().view(-1).cpu())
        self.page_views = [flat[i * self.page : (i + 1) * self.page] for i in range(self.pages)]
        pad = b"\0" * (self.object_bytes - self.bpo * self.page)
        # Raw objects: the same bytes and the same size as s3kv's objects (header length of zeros).
        self.raw_bodies = [
            bytes(flat[o * self.bpo * self.page : (o + 1) * self.bpo * self.page]) + pad
            for o in range(self.objects)
        ]
        self.seed_bodies = [bytes(v) for v in self.page_views]
        self.settings = Settings(
            # The objects this bench writes, so the worker's staging check sizes those (not the
            # default 64 MiB target) against the staging it is given.
            blocks_per_object=self.bpo,
            staging_mib=math.ceil(self.payload * 1.5 / MiB) + 64,
            upload_threads=cfg.upload_threads,
            download_threads=cfg.download_threads,
            load_timeout_s=600.0,
        )

    def _worker(self, layout: Any, prefix: str, store: Any = None) -> Any:
        from ...engine.worker import WorkerCore

        core = WorkerCore(
            self.settings, store if store is not None else self.bs.store, prefix, 0, 1,
            model_id="s3kv-bench/transfer", kv_dtype="bfloat16",
        )
        core.register_layout(layout)
        return core

    # -- s3kv ----------------------------------------------------------------
    def _warm(self, saver: Any, loader: Any, prefix: str) -> None:
        """Untimed, so the timed run sees a long-running engine's steady state: staging arenas
        touched (a pinned CUDA arena is, at allocation), worker threads and connections up."""
        from ...core.plan import BufferId, ConnectorMetadata, LoadOp, ObjectRef, SealOp, StageOp
        from ...transfer.staging import LOAD

        for core in (saver, loader):
            pool = core.staging
            buf = pool.try_acquire(pool.stats().capacity, LOAD)
            if buf is not None:
                buf.tensor.fill_(0)
                buf.release()
        n = min(self.pages, max(self.cfg.upload_threads, self.cfg.download_threads))
        digests = [_digest("warm", prefix, i) for i in range(n)]
        bids = [BufferId(10**6 + i, 0, i, 1) for i in range(n)]
        saver.bind(
            ConnectorMetadata(
                iteration=1,
                stages=tuple(StageOp(b, i, i) for i, b in enumerate(bids)),
                seals=tuple(SealOp(b, 1, d, True) for b, d in zip(bids, digests, strict=True)),
            )
        )
        saver.start_load_kv(None)
        saver.wait_for_save(None)
        saver.flush(120)
        loader.bind(
            ConnectorMetadata(
                iteration=1,
                loads=tuple(
                    LoadOp(10**6 + i, ObjectRef(0, d, ((i, 1),)), (i,), (i,)) for i, d in enumerate(digests)
                ),
            )
        )
        loader.start_load_kv(None)
        loader.wait_for_save(None)
        loader.get_finished([], [])

    def s3kv(self, rep: int, store: Any = None, tag: str = "s3kv") -> tuple[float, float, bool, float, float]:
        """(save s, load s, bit exact, save CPU s, load CPU s) of s3kv's pipelines on ``store``."""
        from ...core.plan import BufferId, ConnectorMetadata, LoadOp, ObjectRef, SealOp, StageOp
        from ...sim.layouts import GroupSpec, make_layout

        prefix = f"{self.root}/{tag}-r{rep}"
        digests = [_digest(self.object_mib, rep, o) for o in range(self.objects)]
        stages: list[StageOp] = []
        seals: list[SealOp] = []
        loads: list[LoadOp] = []
        for o in range(self.objects):
            first = o * self.bpo
            bid = BufferId(o, 0, first, self.bpo)
            ords = tuple(range(first, first + self.bpo))
            stages += [StageOp(bid, k, k) for k in ords]
            seals.append(SealOp(bid, self.bpo, digests[o], True))
            loads.append(LoadOp(o, ObjectRef(0, digests[o], ((first, self.bpo),)), ords, ords))
        saver = self._worker(self.src, prefix, store)
        dst = make_layout(
            [GroupSpec((0,), None, (self.page,))], num_slots=self.pages, tokens_per_block=32, fill_seed=None,
            device=self.cfg.device,
        )
        loader = self._worker(dst, prefix, store)
        try:
            self._warm(saver, loader, prefix)
            base_up = saver.stats().objects_uploaded
            base_down = loader.stats().objects_loaded

            def save() -> None:
                saver.bind(ConnectorMetadata(iteration=2, stages=tuple(stages), seals=tuple(seals)))
                saver.start_load_kv(None)
                saver.wait_for_save(None)
                if not saver.flush(600):
                    raise RuntimeError("uploads did not finish within 600 s")

            save_s, save_cpu = timed_cpu(save)
            st = saver.stats()
            if st.objects_uploaded - base_up != self.objects:
                raise RuntimeError(
                    f"s3kv saved {st.objects_uploaded - base_up} of {self.objects} objects "
                    f"(dropped: staging {st.saves_dropped_staging_full}, store "
                    f"{st.saves_dropped_store_error}, other {st.saves_dropped_other})"
                )

            def load() -> None:
                loader.bind(ConnectorMetadata(iteration=2, loads=tuple(loads)))
                loader.start_load_kv(None)

            load_s, load_cpu = timed_cpu(load)
            loader.wait_for_save(None)
            loader.get_finished([], [])
            lst = loader.stats()
            if lst.objects_loaded - base_down != self.objects or lst.loads_failed_objects:
                raise RuntimeError(
                    f"s3kv loaded {lst.objects_loaded - base_down} of {self.objects} objects "
                    f"({lst.loads_failed_objects} failed)"
                )
            exact = bool(
                (self.src.group(0).regions[0].as_tensor() == dst.group(0).regions[0].as_tensor()).all().item()
            )
        finally:
            saver.close()
            loader.close()
        return save_s, load_s, exact, save_cpu, load_cpu

    # -- baselines -------------------------------------------------------------
    def raw(self, rep: int, rc: Any = None, tag: str = "raw") -> tuple[float, float, float, float]:
        """(save s, load s, save CPU s, load CPU s) of one client's plain parallel put / get."""
        rc = rc or self.bs.raw_client
        keys = [f"{self.root}/{tag}-r{rep}/{o}" for o in range(self.objects)]
        with ThreadPoolExecutor(self.cfg.upload_threads) as ex:
            # Connections up (untimed), on a key of its own: every timed object is timed whole.
            list(ex.map(rc.put, [f"{self.root}/{tag}-r{rep}/warm"], self.raw_bodies[:1]))
            save_s, save_cpu = timed_cpu(lambda: list(ex.map(rc.put, keys, self.raw_bodies)))
        with ThreadPoolExecutor(self.cfg.download_threads) as ex:
            got: list[Any] = []
            load_s, load_cpu = timed_cpu(lambda: got.extend(ex.map(rc.get, keys)))
        if [len(b) for b in got] != [len(b) for b in self.raw_bodies]:
            raise RuntimeError(f"raw {tag} baseline read back objects of the wrong size")
        return save_s, load_s, save_cpu, load_cpu

    def seed(self, rep: int) -> tuple[float, float]:
        rc = self.bs.raw_client
        keys = [f"{self.root}/seed-r{rep}/{i}" for i in range(self.pages)]

        def save() -> None:
            for k, body in zip(keys, self.seed_bodies, strict=True):
                rc.put(k, body)

        def load() -> None:
            for k in keys:
                rc.get(k)

        return timed_cpu(save)[0], timed_cpu(load)[0]

    def warm_clients(self, raws: dict[str, Any], stores: dict[str, Any]) -> None:
        """Untimed: every client's connections up, and the server's volumes allocated."""
        body = self.raw_bodies[0]
        n = max(self.cfg.upload_threads, self.cfg.download_threads)
        # Raw clients and s3kv's stores alike: put(key, body) and get(key).
        for name, c in [*raws.items(), *((f"s-{k}", v) for k, v in stores.items())]:
            keys = [f"{self.root}/warmup-{name}/{i}" for i in range(n)]
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda k, c=c: c.put(k, body), keys))
                list(ex.map(c.get, keys))

    def cleanup(self) -> None:
        self.bs.delete_prefix(self.root + "/")


def run_transfer(bs: BenchStore, cfg: TransferConfig) -> dict[str, Any]:
    t_start = time.perf_counter()
    raws, raw_missing = raw_clients(bs)
    plain = s3kv_stores(bs)
    # s3kv on each client it ships; "s3kv" is the factory's default (obstore when installed).
    s3kv_on: dict[str, Any] = {}
    for name, st in plain.items():
        tag = "s3kv" if name == ("obstore" if "obstore" in plain else next(iter(plain))) else f"s3kv_{name}"
        s3kv_on[tag] = shaped(bs, st, fan_out(name, bs, st))[0] if name != "store" else bs.store
    default_client = "obstore" if "obstore" in plain else next(iter(plain))
    methods = [*s3kv_on, *(f"raw_{c}" for c in raws), "seed"]
    rows: list[dict[str, Any]] = []
    totals = {f"{m}_{w}": 0.0 for m in methods for w in ("save", "load")}
    cpu_totals = {f"{m}_{w}": 0.0 for m in methods if m != "seed" for w in ("save", "load")}
    payload_total = 0
    exact_all = True
    #: Per repeat: seconds by method, summed over object sizes (for the paired ratios).
    run_totals: list[dict[str, float]] = []
    try:
        for mib in cfg.object_mib:
            progress(f"transfer: {mib:g} MiB objects, preparing {cfg.total_mib} MiB of pages ...")
            sz = _Size(bs, cfg, mib)
            try:
                sz.warm_clients(raws, {"bench": bs.store, **plain})
                runs: list[dict[str, float]] = []
                best, cpu, exact = _measure(sz, cfg, raws, s3kv_on, list(totals), list(cpu_totals), runs)
                exact_all &= exact
            finally:
                sz.cleanup()
            rows.append(_row(sz, best, cpu, raws, runs))
            for i, r in enumerate(runs):
                if i == len(run_totals):
                    run_totals.append({})
                for k, v in r.items():
                    run_totals[i][k] = run_totals[i].get(k, 0.0) + v
            for k, v in best.items():
                totals[k] += v
            for k, v in cpu.items():
                cpu_totals[k] += v
            payload_total += sz.payload
            r = rows[-1]
            progress(
                f"transfer: {sz.object_mib:g} MiB x {sz.objects}: save s3kv {r['save_mib_s']:.0f} / fastest raw "
                f"{r['fastest_raw_save_mib_s']:.0f} ({r['fastest_raw_save_client']}) / example {r['seed_save_mib_s']:.0f} "
                f"MiB/s; load s3kv {r['load_mib_s']:.0f} / fastest raw {r['fastest_raw_load_mib_s']:.0f} "
                f"({r['fastest_raw_load_client']}) / example {r['seed_load_mib_s']:.0f} MiB/s"
            )
            del sz
            gc.collect()
    finally:
        for st in plain.values():
            if st is not bs.raw:
                st.close()
    mb = payload_total / MiB
    agg = {k: mb / v for k, v in totals.items()}
    res_cpu = {k: v / (payload_total / 1e9) for k, v in cpu_totals.items()}
    save_vs_seed = agg["s3kv_save"] / agg["seed_save"]
    load_vs_seed = agg["s3kv_load"] / agg["seed_load"]
    res: dict[str, Any] = {
        "bench": "transfer",
        "store": bs.info(),
        "latency_ms_injected": bs.latency_ms,
        "machine": machine_info(),
        "total_mib": cfg.total_mib,
        "page_mib": cfg.page_mib,
        "device": cfg.device,
        "repeats": cfg.repeats,
        "concurrency": {"save": cfg.upload_threads, "load": cfg.download_threads},
        "s3kv_client": default_client,
        **_figures(agg, raws, run_totals, mib_s=False),
        # The weaker direction: the number a reader can rely on for both.
        "speedup_vs_seed_path": rnd(min(save_vs_seed, load_vs_seed), 2),
        "clients": _clients(agg, res_cpu, methods),
        "clients_missing": raw_missing,
        "bit_exact": exact_all,
        "results": rows,
    }
    res["targets"] = {
        "save_ratio_ge_0.9": f"s3kv save >= {TARGET_RATIO_VS_RAW} x the fastest raw client at the same concurrency",
        "load_ratio_ge_0.9": f"s3kv load >= {TARGET_RATIO_VS_RAW} x the fastest raw client at the same concurrency",
        "speedup_vs_seed_ge_5x": f"s3kv >= {TARGET_SPEEDUP_VS_SEED:g}x the upstream example's path (save and load)",
        "bit_exact": "every loaded page equals the saved one",
    }
    res["targets_met"] = {
        "save_ratio_ge_0.9": res["save_ratio_vs_fastest_raw"] >= TARGET_RATIO_VS_RAW,
        "load_ratio_ge_0.9": res["load_ratio_vs_fastest_raw"] >= TARGET_RATIO_VS_RAW,
        "speedup_vs_seed_ge_5x": res["speedup_vs_seed_path"] >= TARGET_SPEEDUP_VS_SEED,
        "bit_exact": exact_all,
    }
    res["worth"] = _worth(bs, cfg, agg["s3kv_load"] * MiB)
    res["seconds"] = rnd(time.perf_counter() - t_start, 1)
    return res


def _worth(bs: BenchStore, cfg: TransferConfig, load_bytes_per_s: float) -> dict[str, Any]:
    """Where a hit of Gemma-3-27B beats recomputing it, per tier, at the speeds measured here
    (``crossover.py``)."""
    from ...transfer.tiers import TierSpeed
    from .common import GEMMA3_27B
    from .crossover import crossover, host_speed, store_round_trip_s

    s3 = TierSpeed(latency_s=store_round_trip_s(bs.store), bytes_per_s=load_bytes_per_s)
    return crossover(GEMMA3_27B, 32, Prefill.from_settings(Settings()).tokens_per_s, {"host": host_speed(cfg.device), "s3": s3})


def _measure(
    sz: _Size,
    cfg: TransferConfig,
    raws: dict[str, Any],
    s3kv_on: dict[str, Any],
    keys: list[str],
    cpu_keys: list[str],
    runs: list[dict[str, float]],
) -> tuple[dict[str, float], dict[str, float], bool]:
    """Best wall seconds (and the CPU seconds of that run) of every method at one object size;
    every repeat's seconds are appended to ``runs``."""
    best = {k: math.inf for k in keys}
    cpu = {k: math.inf for k in cpu_keys}
    exact_all = True

    def keep(m: str, save_s: float, load_s: float, save_cpu: float, load_cpu: float) -> None:
        runs[-1][f"{m}_save"], runs[-1][f"{m}_load"] = save_s, load_s
        if save_s < best[f"{m}_save"]:
            best[f"{m}_save"], cpu[f"{m}_save"] = save_s, save_cpu
        if load_s < best[f"{m}_load"]:
            best[f"{m}_load"], cpu[f"{m}_load"] = load_s, load_cpu

    def baselines(rep: int) -> None:
        for c, rc in raws.items():
            keep(f"raw_{c}", *sz.raw(rep, rc, f"raw_{c}"))
        d_save, d_load = sz.seed(rep)
        best["seed_save"] = min(best["seed_save"], d_save)
        best["seed_load"] = min(best["seed_load"], d_load)

    for rep in range(cfg.repeats):
        runs.append({})
        # Odd repeats run the baselines first, so neither side always meets a fresher server.
        if rep % 2:
            baselines(rep)
        for tag, st in s3kv_on.items():
            s_save, s_load, exact, c_save, c_load = sz.s3kv(rep, st, tag)
            exact_all &= exact
            keep(tag, s_save, s_load, c_save, c_load)
        if not rep % 2:
            baselines(rep)
    return best, cpu, exact_all


def paired_ratios(runs: Sequence[dict[str, float]], raws: Sequence[str]) -> dict[str, float]:
    """Median over repeats of s3kv's speed / the fastest raw client's speed *in that repeat*.

    The best-of ratios compare bests that may come from different repeats; on a loopback server
    whose own speed drifts by 20% from run to run, the ratio of two runs made back to back is
    the steadier number. ``runs``: per repeat, seconds by method key (``s3kv_save``, ...).
    """
    out: dict[str, float] = {}
    for w in ("save", "load"):
        ratios = [
            min(r[f"raw_{c}_{w}"] for c in raws) / r[f"s3kv_{w}"]
            for r in runs
            if r.get(f"s3kv_{w}") and all(f"raw_{c}_{w}" in r for c in raws)
        ]
        out[w] = float(statistics.median(ratios)) if ratios else math.nan
    return out


def _clients(agg: dict[str, float], cpu: dict[str, float], methods: list[str]) -> dict[str, Any]:
    """Per method: GB/s and CPU s per GB, save and load."""
    out: dict[str, Any] = {}
    for m in methods:
        d = {
            "save_gb_s": rnd(agg[f"{m}_save"] * MiB / 1e9),
            "load_gb_s": rnd(agg[f"{m}_load"] * MiB / 1e9),
        }
        if f"{m}_save" in cpu:
            d["save_cpu_s_per_gb"] = rnd(cpu[f"{m}_save"])
            d["load_cpu_s_per_gb"] = rnd(cpu[f"{m}_load"])
        out["upstream_example" if m == "seed" else m] = d
    return out


def _figures(
    thr: dict[str, float], raws: dict[str, Any], runs: list[dict[str, float]], *, mib_s: bool
) -> dict[str, Any]:
    """s3kv's MiB/s against boto3's, the seed path's and the fastest raw client's (``mib_s``:
    with the fastest raw clients' own MiB/s), from ``thr`` (MiB/s by path) and ``runs`` (seconds
    by path, per repeat)."""
    fast_save = max(raws, key=lambda c: thr[f"raw_{c}_save"])
    fast_load = max(raws, key=lambda c: thr[f"raw_{c}_load"])
    paired = paired_ratios(runs, list(raws))
    return {
        "save_mib_s": rnd(thr["s3kv_save"], 1),
        "load_mib_s": rnd(thr["s3kv_load"], 1),
        "raw_save_mib_s": rnd(thr["raw_boto3_save"], 1),
        "raw_load_mib_s": rnd(thr["raw_boto3_load"], 1),
        "seed_save_mib_s": rnd(thr["seed_save"], 1),
        "seed_load_mib_s": rnd(thr["seed_load"], 1),
        "save_ratio_vs_raw": rnd(thr["s3kv_save"] / thr["raw_boto3_save"]),
        "load_ratio_vs_raw": rnd(thr["s3kv_load"] / thr["raw_boto3_load"]),
        "save_speedup_vs_seed": rnd(thr["s3kv_save"] / thr["seed_save"], 2),
        "load_speedup_vs_seed": rnd(thr["s3kv_load"] / thr["seed_load"], 2),
        "fastest_raw_save_client": fast_save,
        "fastest_raw_load_client": fast_load,
        **({"fastest_raw_save_mib_s": rnd(thr[f"raw_{fast_save}_save"], 1),
            "fastest_raw_load_mib_s": rnd(thr[f"raw_{fast_load}_load"], 1)} if mib_s else {}),
        "save_ratio_vs_fastest_raw": rnd(thr["s3kv_save"] / thr[f"raw_{fast_save}_save"]),
        "load_ratio_vs_fastest_raw": rnd(thr["s3kv_load"] / thr[f"raw_{fast_load}_load"]),
        # Median over repeats of s3kv / the fastest raw client of the same repeat (paired_ratios).
        "save_ratio_vs_fastest_raw_paired": rnd(paired["save"]),
        "load_ratio_vs_fastest_raw_paired": rnd(paired["load"]),
    }


def _row(
    sz: _Size, best: dict[str, float], cpu: dict[str, float], raws: dict[str, Any], runs: list[dict[str, float]]
) -> dict[str, Any]:
    mb = sz.payload / MiB
    thr = {k: mb / v for k, v in best.items()}
    gb = sz.payload / 1e9
    return {
        "object_mib": sz.object_mib,
        "objects": sz.objects,
        "pages": sz.pages,
        "total_mib": mb,
        **_figures(thr, raws, runs, mib_s=True),
        "mib_s": {k: rnd(v, 1) for k, v in thr.items()},
        "cpu_s_per_gb": {k: rnd(v / gb) for k, v in cpu.items()},
        "seconds": {k: rnd(v) for k, v in best.items()},
        "seconds_by_repeat": [{k: rnd(v) for k, v in r.items()} for r in runs],
    }


def table(res: dict[str, Any]) -> str:
    from .common import header, targets_line

    c = res["concurrency"]
    lines = [
        f"s3kv bench transfer -- {res['total_mib']} MiB per object size, {res['page_mib']:g} MiB pages, "
        f"{c['save']} upload / {c['load']} download threads (raw clients use the same), best of {res['repeats']}; "
        f"s3kv on {res['s3kv_client']}; KV cache on {res['device']}",
        header(res),
        "",
        f"{'object':>8} {'n':>4} | {'save MiB/s':^30} | {'load MiB/s':^30} | {'vs fastest':^11} | {'vs example':^11}",
        f"{'':>8} {'':>4} | {'s3kv':>8} {'fastest raw':>12} {'example':>8} | {'s3kv':>8} {'fastest raw':>12} "
        f"{'example':>8} | {'save':>5} {'load':>5} | {'save':>5} {'load':>5}",
    ]

    def line(name: str, n: str, r: dict[str, Any]) -> str:
        fs = r.get("fastest_raw_save_mib_s") or r["raw_save_mib_s"]
        fl = r.get("fastest_raw_load_mib_s") or r["raw_load_mib_s"]
        return (
            f"{name:>8} {n:>4} | {r['save_mib_s']:>8.0f} {fs:>12.0f} {r['seed_save_mib_s']:>8.0f} | "
            f"{r['load_mib_s']:>8.0f} {fl:>12.0f} {r['seed_load_mib_s']:>8.0f} | "
            f"{r['save_ratio_vs_fastest_raw']:>5.2f} {r['load_ratio_vs_fastest_raw']:>5.2f} | "
            f"{r['save_speedup_vs_seed']:>4.1f}x {r['load_speedup_vs_seed']:>4.1f}x"
        )

    for r in res["results"]:
        lines.append(line(f"{r['object_mib']:g} MiB", str(r["objects"]), r))
    agg = dict(res)
    agg["fastest_raw_save_mib_s"] = res["clients"][f"raw_{res['fastest_raw_save_client']}"]["save_gb_s"] * 1e9 / MiB
    agg["fastest_raw_load_mib_s"] = res["clients"][f"raw_{res['fastest_raw_load_client']}"]["load_gb_s"] * 1e9 / MiB
    lines.append(line("all", "", agg))
    lines += ["", f"{'client':>18} | {'save GB/s':>9} {'CPU s/GB':>9} | {'load GB/s':>9} {'CPU s/GB':>9}"]
    for name, d in res["clients"].items():
        lines.append(
            f"{name:>18} | {d['save_gb_s']:>9.3f} {d.get('save_cpu_s_per_gb', float('nan')):>9.2f} | "
            f"{d['load_gb_s']:>9.3f} {d.get('load_cpu_s_per_gb', float('nan')):>9.2f}"
        )
    for name, why in res.get("clients_missing", {}).items():
        lines.append(f"{name:>18} | not measured: {why}")
    lines.append(
        f"paired (median over repeats of s3kv / the fastest raw client of the same repeat): "
        f"save {res['save_ratio_vs_fastest_raw_paired']:.2f}, load {res['load_ratio_vs_fastest_raw_paired']:.2f}"
    )
    lines.append(f"loaded bytes identical to saved: {res['bit_exact']}")
    if res.get("worth"):
        from .crossover import table as worth_table

        lines += ["", *worth_table(res["worth"])]
    lines.append(targets_line(res))
    return "\n".join(lines)
