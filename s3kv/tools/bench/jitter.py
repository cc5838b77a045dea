"""``s3kv bench jitter``: what s3kv's I/O costs the engine's executor loop, per S3 client.

TensorRT-LLM's executor is a Python loop in the same process as s3kv. Every millisecond
another thread holds the GIL (or a core) is a millisecond that loop - and with it every
request of the batch - waits. The stand-in here is a thread that does a fixed chunk of pure
Python work (about 1 ms on an idle machine), then waits 1 ms (the GPU step), over and over,
timing each chunk. Its p50 / p99 are measured:

* **idle** - nothing else running;
* **lookups** - another thread does cold lookups of a 16k-token prompt back to back (probe
  path, each on a fresh leader: every HEAD goes to the store);
* **download** - s3kv's load path at full speed: ``download_threads`` threads reading 8 MiB
  objects with ``get_ranges_into`` into preallocated (staging-like) buffers;
* **upload** - s3kv's save path at full speed: ``upload_threads`` threads writing objects
  (header + page views, write-once).

per client s3kv ships (boto3's ``S3Store``, obstore's ``ObstoreS3Store``; ``obstore_helpers``: the
same with its HEAD waves in helper processes, s3kv's default where there are cores for them,
see s3kv/store/headprocs.py). The target: the
loop's p99 during full-speed transfer at most twice its idle p99.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...config import Settings
from ...engine.runtime import s3_options
from .clients import s3kv_stores
from .common import BenchStore, MiB, machine_info, pct, progress, rnd

TARGET_P99_RATIO = 2.0


@dataclass(frozen=True)
class JitterConfig:
    phase_s: float = 3.0
    object_mib: float = 8.0
    objects: int = 16
    upload_threads: int = Settings().upload_threads
    download_threads: int = Settings().download_threads
    prompt_tokens: int = 16384


class Loop:
    """The stand-in executor loop (module doc)."""

    def __init__(self, work: int):
        self.work = work
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def chunk(n: int) -> int:
        x = 0
        for i in range(n):
            x += i * i % 7
        return x

    @classmethod
    def calibrate(cls, target_s: float = 0.001) -> int:
        """Iterations of ``chunk`` that take ``target_s`` on this machine when nothing competes
        (the fastest of several tries: a busy moment must not shrink the unit of work)."""
        n = 20_000
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            cls.chunk(n)
            best = min(best, time.perf_counter() - t0)
        return max(1, int(n * target_s / best))

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.chunk(self.work)
            self.times.append(time.perf_counter() - t0)
            time.sleep(0.001)

    def __enter__(self) -> Loop:
        self._thread = threading.Thread(target=self._run, name="stand-in-executor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def stats(self) -> dict[str, float]:
        s = sorted(self.times)
        if not s:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "iterations": 0}
        return {
            "p50_ms": rnd(pct(s, 0.5) * 1e3, 3),
            "p99_ms": rnd(pct(s, 0.99) * 1e3, 3),
            "iterations": len(s),
        }


def _during(work: int, phase_s: float, load: Callable[[threading.Event], Any]) -> tuple[dict[str, float], Any]:
    """Loop stats while ``load(stop)`` runs (it must return soon after ``stop`` is set)."""
    stop = threading.Event()
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(load(stop)), daemon=True)
    with Loop(work) as loop:
        t.start()
        time.sleep(phase_s)
        stop.set()
        t.join()
    return loop.stats(), out[0] if out else None


def _pump(threads: int, stop: threading.Event, size: int, one: Callable[[int, int], None]) -> float:
    """GB/s while ``threads`` threads each repeat ``one(thread, n)`` (its n-th transfer of ``size``
    bytes) until ``stop`` is set."""
    moved = [0]
    lock = threading.Lock()

    def worker(i: int) -> None:
        n = 0
        while not stop.is_set():
            one(i, n)
            n += 1
            with lock:
                moved[0] += size

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(worker, range(threads)))
    return moved[0] / (time.perf_counter() - t0) / 1e9


def run_jitter(bs: BenchStore, cfg: JitterConfig) -> dict[str, Any]:
    from .lookup import LookupConfig, _leader, geometry, populate, real_sizing

    t_start = time.perf_counter()
    work = Loop.calibrate()
    size = int(cfg.object_mib * MiB)
    body = random.Random(7).randbytes(size)
    root = bs.key("jitter")
    keys = [f"{root}/obj-{i}" for i in range(cfg.objects)]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda k: bs.raw.put(k, body), keys))
    # A stored 16k-token prompt for the lookup phase (Gemma-3-27B's block structure).
    lcfg = LookupConfig(prompts=(cfg.prompt_tokens,), seq_cap=1)
    settings = Settings(max_concurrency=bs.concurrency, lookup_timeout_s=0.0)
    geom = geometry(lcfg)
    sizing = real_sizing(lcfg.model, lcfg.tokens_per_block)
    rng = random.Random("s3kv-bench/jitter")
    prompt = [rng.randrange(32000) for _ in range(cfg.prompt_tokens)]
    populate(bs, lcfg, settings, geom, prompt, sizing)
    # obstore twice: HEAD waves in this process, and in helper processes as s3kv's default runs them.
    stores = s3kv_stores(bs, head_processes=s3_options(settings).head_processes)
    clients: dict[str, Any] = {}
    try:
        for name, store in stores.items():
            progress(f"jitter: {name} ...")
            r: dict[str, Any] = {}
            with Loop(work) as loop:
                time.sleep(cfg.phase_s)
            r["idle"] = loop.stats()

            def lookups(stop: threading.Event, store: Any = store) -> int:
                n = 0
                while not stop.is_set():
                    leader = _leader(settings, store, bs.key("s3kv"), geom, sizing)
                    leader.get_num_new_matched_tokens(n, prompt, len(prompt), 0)
                    n += 1
                return n

            r["lookups"], n = _during(work, cfg.phase_s, lookups)
            r["lookups"]["lookups_per_s"] = rnd(n / cfg.phase_s, 1)

            def download(stop: threading.Event, store: Any = store) -> float:
                from ...store.base import ByteRange

                t = cfg.download_threads
                views = [memoryview(bytearray(size)) for _ in range(t)]
                return _pump(t, stop, size, lambda i, m: store.get_ranges_into(
                    keys[(i + m * t) % len(keys)], [ByteRange(0, size)], [views[i]]))

            r["download"], gbs = _during(work, cfg.phase_s, download)
            r["download"]["gb_s"] = rnd(gbs)

            def upload(stop: threading.Event, store: Any = store, name: str = name) -> float:
                parts = [b"h" * 4096, *(memoryview(body)[k * MiB : (k + 1) * MiB] for k in range(size // MiB))]
                return _pump(cfg.upload_threads, stop, size,
                             lambda i, m: store.put(f"{root}/up-{name}/{i}-{m}", parts))

            r["upload"], gbs = _during(work, cfg.phase_s, upload)
            r["upload"]["gb_s"] = rnd(gbs)
            idle = max(r["idle"]["p99_ms"], 1e-6)
            for phase in ("lookups", "download", "upload"):
                r[phase]["p99_vs_idle"] = rnd(r[phase]["p99_ms"] / idle, 2)
            clients[name] = r
            progress(
                f"jitter: {name}: idle p99 {r['idle']['p99_ms']:.2f} ms; lookups {r['lookups']['p99_ms']:.2f}; "
                f"download {r['download']['p99_ms']:.2f} ms at {r['download']['gb_s']:.2f} GB/s; "
                f"upload {r['upload']['p99_ms']:.2f} ms at {r['upload']['gb_s']:.2f} GB/s"
            )
    finally:
        for st in stores.values():
            if st is not bs.raw:
                st.close()
        bs.delete_prefix(root + "/")
    default = next((c for c in ("obstore_helpers", "obstore") if c in clients), next(iter(clients)))
    d = clients[default]
    res: dict[str, Any] = {
        "bench": "jitter",
        "store": bs.info(),
        "latency_ms_injected": bs.latency_ms,
        "machine": machine_info(),
        "loop": {"work_ms_idle": clients[default]["idle"]["p50_ms"], "wait_ms": 1.0},
        "phase_s": cfg.phase_s,
        "object_mib": cfg.object_mib,
        "concurrency": {"save": cfg.upload_threads, "load": cfg.download_threads},
        "s3kv_client": default,
        "clients": clients,
        "targets": {
            "transfer_p99_le_2x_idle": f"executor p99 during full-speed transfer (download and upload, "
            f"s3kv's default client) <= {TARGET_P99_RATIO:g} x its idle p99",
        },
        "targets_met": {
            "transfer_p99_le_2x_idle": max(d["download"]["p99_vs_idle"], d["upload"]["p99_vs_idle"])
            <= TARGET_P99_RATIO,
        },
        "seconds": rnd(time.perf_counter() - t_start, 1),
    }
    return res


def table(res: dict[str, Any]) -> str:
    from .common import header, targets_line

    lines = [
        f"s3kv bench jitter -- stand-in executor loop (~1 ms of Python work, 1 ms wait) per {res['phase_s']:g} s "
        f"phase; {res['object_mib']:g} MiB objects, {res['concurrency']['load']} download / "
        f"{res['concurrency']['save']} upload threads",
        header(res),
        "",
        f"{'client':>8} {'phase':>9} | {'p50 ms':>7} {'p99 ms':>7} {'p99/idle':>8} | {'GB/s':>6}",
    ]
    for name, r in res["clients"].items():
        for phase in ("idle", "lookups", "download", "upload"):
            x = r[phase]
            ratio = f"{x['p99_vs_idle']:.2f}" if "p99_vs_idle" in x else ""
            extra = f"{x['gb_s']:.3f}" if "gb_s" in x else (f"{x['lookups_per_s']:g}/s" if "lookups_per_s" in x else "")
            lines.append(f"{name:>8} {phase:>9} | {x['p50_ms']:>7.3f} {x['p99_ms']:>7.3f} {ratio:>8} | {extra:>6}")
    lines.append(targets_line(res))
    return "\n".join(lines)
