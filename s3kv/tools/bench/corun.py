"""``s3kv bench corun``: what lookups cost the decode streams running beside them.

TensorRT-LLM asks for a lookup on its executor thread, inside scheduling (issue 41): while it
waits on S3 no request advances. This bench runs ``streams`` decode streams on the simulated engine
(TensorRT-LLM's overlap loop, the real adapter) while requests arrive one after another -- each
admitted as the one before it finishes, so a lookup happens every few passes -- and measures
the time between passes as every stream sees it (its inter-token latency), p50 / p99:

* **without**: a connector that never finds anything and asks nothing (TensorRT-LLM alone);
* **probe**: s3kv with no fleet index (HEAD waves on the scheduler's time, within the budget);
* **index**: s3kv with the fleet index published, unsigned (a miss is local, a hit one HEAD wave);
* **signed**: the same with an integrity key, the index signed (a hit is local too).

The GPU is modelled, the rest is real: a pass's forward takes ``decode_ms`` plus its prompt
tokens at ``prefill_tokens_per_s``, queued behind the previous forward as on a GPU stream; the
overlap loop launches it, then waits for the previous one (so scheduling is hidden behind at most
one forward). S3 is the embedded server behind s3kv's fault proxy, ``s3_latency_ms`` on every
request. Half the arrivals repeat a prompt a warm engine stored beforehand (hits: their prefill
is skipped), half are new (misses: prefilled in ``chunk_tokens`` chunks, saved).

The acceptance (issue 41): iteration p99 with s3kv at most 1.5x without, at 30 ms per request.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from .common import BenchStore, SharedStore, machine_info, pct, progress, rnd

#: Request ids of the arrivals (the streams count from 0).
ARRIVAL_IDS = 1000
MODES = ("without", "probe", "index", "signed")
#: The integrity key of the "signed" mode (a bench's own, never a deployment's).
_BENCH_SECRET = "s3kv-bench-corun-integrity-key-0123456789"


def _one_prefill_figure() -> float:
    from ...config import Settings
    from ...core.cost import Prefill

    return Prefill.from_settings(Settings(check_access=False)).tokens_per_s


@dataclass(frozen=True)
class CorunConfig:
    streams: int = 16
    arrivals: int = 48
    prompt_tokens: int = 2048
    decode_ms: float = 25.0
    #: The package's one prefill-speed figure (s3kv.core.cost.Prefill) unless told otherwise.
    prefill_tokens_per_s: float = field(default_factory=lambda: _one_prefill_figure())
    chunk_tokens: int = 512
    tokens_per_block: int = 32
    #: Share of arrivals that repeat a stored prompt.
    hit_share: float = 0.5
    modes: tuple[str, ...] = ("without", "probe", "index", "signed")
    seed: int = 1


def _null_connector() -> tuple[type, type]:
    """A connector that finds nothing and saves nothing: the engine without s3kv."""
    from ...trtllm.api import KvCacheConnectorScheduler, KvCacheConnectorWorker

    class NullLeader(KvCacheConnectorScheduler):  # type: ignore[misc]
        def __init__(self, llm_args: Any, **_: Any):
            super().__init__(llm_args)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc_by_layer_group(self, request: Any, *a: Any, **k: Any) -> None:
            pass

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return None

        def request_finished_by_layer_group(self, request: Any, *a: Any, **k: Any) -> bool:
            return False

    class NullWorker(KvCacheConnectorWorker):  # type: ignore[misc]
        def __init__(self, llm_args: Any, **_: Any):
            super().__init__(llm_args)

        def register_kv_cache_layout(self, layout: Any) -> None:
            pass

        def start_load_kv(self, stream: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
            pass

        def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
            pass

        def wait_for_save(self, stream: Any) -> None:
            pass

        def get_finished(self, finished_gen_req_ids: Any, started_loading_req_ids: Any) -> tuple[list, list]:
            return [], []

    return NullLeader, NullWorker


def _timed_engine(cfg: CorunConfig, leader_cls: Any, worker_cls: Any, kwargs: dict[str, Any], max_len: int) -> Any:
    """A simulated engine whose forwards take modelled GPU time on a stream (module docstring)."""
    from ...sim import SimCacheConfig, SimEngine, gemma3_like

    class TimedEngine(SimEngine):
        def __init__(self, *a: Any, **k: Any):
            super().__init__(*a, **k)
            self.gpu_free = 0.0
            self.prev_done = 0.0
            #: When each forward ended (what every running stream's next token waits for), and
            #: when the last arrival finished.
            self.token_times: list[float] = []
            self.arrivals_done = 0.0

        def _finish(self, st: Any, *a: Any, **k: Any) -> None:
            super()._finish(st, *a, **k)
            if st.rid >= ARRIVAL_IDS:
                self.arrivals_done = max(self.arrivals_done, time.perf_counter())

        def _run_forward(self, scheduled: list, stream: Any) -> bool:
            ran = super()._run_forward(scheduled, stream)
            if not ran:
                return ran
            ctx = sum(n for _, n, is_ctx in scheduled if is_ctx)
            gpu = cfg.decode_ms / 1000.0 + ctx / cfg.prefill_tokens_per_s
            now = time.perf_counter()
            done = max(now, self.gpu_free) + gpu
            self.gpu_free = done
            self.token_times.append(done)
            # The overlap loop queues this forward, then waits for the previous one's tokens.
            wait = self.prev_done - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            self.prev_done = done
            return ran

    return TimedEngine(
        gemma3_like(64, kv_heads=2),
        SimCacheConfig(tokens_per_block=cfg.tokens_per_block, max_seq_len=max_len),
        leader_cls,
        worker_cls,
        max_batch=cfg.streams + 1,
        chunk_size=cfg.chunk_tokens,
        overlap=True,
        connector_kwargs=kwargs,
    )


def _prompts(cfg: CorunConfig) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(decode streams' prompts, prompts stored beforehand, arrivals in order)."""
    rng = random.Random(cfg.seed)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(32000) for _ in range(n))

    streams = [prompt(cfg.tokens_per_block * 2 + 1) for _ in range(cfg.streams)]
    hits = round(cfg.arrivals * cfg.hit_share)
    stored = [prompt(cfg.prompt_tokens) for _ in range(hits)]
    arrivals = stored + [prompt(cfg.prompt_tokens) for _ in range(cfg.arrivals - hits)]
    rng.shuffle(arrivals)
    return streams, stored, arrivals


def run_corun(bs: BenchStore, cfg: CorunConfig) -> dict[str, Any]:
    from ...config import Settings
    from ...core.integrity import IntegrityKeys
    from ...engine.fleetindex import Publisher
    from ...sim import SimRequestSpec
    from ...trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    streams, stored, arrivals = _prompts(cfg)
    iterations = (cfg.arrivals * (cfg.prompt_tokens // cfg.chunk_tokens + 3)) + 50
    max_len = cfg.prompt_tokens + iterations + 4 * cfg.tokens_per_block
    max_len = -(-max_len // cfg.tokens_per_block) * cfg.tokens_per_block
    prefix = bs.key("corun")
    base = dict(check_access=False, staging_mib=64, upload_threads=2, download_threads=2,
                prefill_tokens_per_s=cfg.prefill_tokens_per_s, warm_up_s=0.0)

    def s3kv(name: str, **settings: Any) -> tuple[Any, Any, dict[str, Any]]:
        s = Settings(**{**base, **settings})
        return S3KvConnectorLeader, S3KvConnectorWorker, dict(
            settings=s, store=SharedStore(bs.store), key_prefix=prefix, engine_key=f"corun-{name}-{time.time_ns()}"
        )

    keyed: dict[str, Any] = {"integrity_key": _BENCH_SECRET}
    # The warm cache: another engine stored half the arrivals' prompts; the publisher indexed them.
    for signed in sorted({m == "signed" for m in cfg.modes if m != "without"}):
        progress(f"corun: storing {len(stored)} prompts of {cfg.prompt_tokens} tokens{' (signed)' if signed else ''}")
        lc, wc, kw = s3kv("writer", fleet_index_s=0, **(keyed if signed else {}))
        writer = _timed_engine(cfg, lc, wc, kw, max_len)
        with writer:
            writer.run([SimRequestSpec(10_000 + i, p, max_new_tokens=1) for i, p in enumerate(stored)])
            for w in writer.workers:
                w.flush(120)
            core = writer.leader.core
        # The publisher of that deployment: with the key (it refuses unsigned objects), or without.
        integrity = IntegrityKeys.from_secrets(_BENCH_SECRET) if signed else None
        Publisher(bs.store, prefix + "/", integrity=integrity, every_s=3600,
                  namespaces=[core.scheme.namespace_prefix]).publish(namespace=core.namespace.hex())

    out: dict[str, Any] = {}
    for mode in cfg.modes:
        if mode == "without":
            lc, wc = _null_connector()
            kw = {}
        else:
            lc, wc, kw = s3kv(mode, fleet_index_s=0 if mode == "probe" else 3600,
                              **(keyed if mode == "signed" else {}))
        eng = _timed_engine(cfg, lc, wc, kw, max_len)
        if mode in ("index", "signed"):
            fleet = eng.leader.core.fleet_index()
            if fleet is not None:
                fleet.refresh()  # (its own thread may have taken it at layout registration already)
            if fleet is None or fleet.current() is None:
                raise RuntimeError(f"corun: {mode}: the published fleet index was not picked up")
        specs = [SimRequestSpec(i, p, max_new_tokens=iterations) for i, p in enumerate(streams)]
        specs += [SimRequestSpec(ARRIVAL_IDS + i, p, max_new_tokens=2) for i, p in enumerate(arrivals)]
        progress(f"corun: {mode}: {cfg.streams} decode streams, {len(arrivals)} arrivals")
        t0 = time.perf_counter()
        # The streams come first (admitted at once); each arrival when the one before it finished.
        out[mode] = _measure(eng, specs, cfg, mode)
        out[mode]["wall_s"] = rnd(time.perf_counter() - t0, 1)
    res: dict[str, Any] = {
        "bench": "corun",
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "store": bs.info(),
        "latency_ms_injected": bs.latency_ms,
        "machine": machine_info(),
        "modes": out,
    }
    base_p99 = out.get("without", {}).get("iteration_ms", {}).get("p99")
    for mode, r in out.items():
        if base_p99 and mode != "without":
            r["p99_vs_without"] = rnd(r["iteration_ms"]["p99"] / base_p99, 3)
    res["targets"] = {
        "p99_le_1_5x_without": "iteration p99 with s3kv (the fleet index published) at most 1.5x without s3kv",
        "kv_mismatches_zero": "no page served differs from recomputation",
    }
    best = [r["p99_vs_without"] for m, r in out.items() if m in ("index", "signed") and "p99_vs_without" in r]
    res["targets_met"] = {
        "p99_le_1_5x_without": bool(best) and max(best) <= 1.5,
        "kv_mismatches_zero": all(r["kv_mismatches"] == 0 for r in out.values()),
    }
    return res


def _measure(eng: Any, specs: list, cfg: CorunConfig, mode: str) -> dict[str, Any]:
    """Run ``specs`` on ``eng``; the pass intervals while the last arrival had not finished."""
    with eng:
        rep = eng.run(specs)
        for w in eng.workers:
            flush = getattr(w, "flush", None)
            if flush is not None:
                flush(120)
        leader = getattr(eng.leader, "core", None)
    times = eng.token_times
    arrivals = [r for r in rep.requests if r.request_id >= ARRIVAL_IDS]
    # Only while arrivals came: afterwards the streams decode alone, in every mode alike.
    ms = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False) if b <= eng.arrivals_done + 1e-3]
    out: dict[str, Any] = {
        "iteration_ms": {"p50": rnd(statistics.median(ms), 2), "p99": rnd(pct(ms, 0.99), 2),
                         "max": rnd(max(ms), 2), "passes": len(ms)},
        "served_tokens": sum(r.matched_tokens for r in arrivals),
        "kv_mismatches": rep.kv_mismatches,
    }
    if leader is not None:
        st = leader.stats
        stalls = [x.stall_s * 1000 for x in st.recent_lookups]
        out["lookup_stall_ms"] = {"p50": rnd(statistics.median(stalls), 2) if stalls else 0.0,
                                  "p99": rnd(pct(stalls, 0.99), 2), "lookups": len(stalls)}
        out["added_latency_s"] = rnd(st.lookup_added_latency_s, 3)
        out["unhidden_stall_s"] = rnd(st.lookup_unhidden_stall_s, 3)
        out["decisions"] = dict(st.lookup_decisions)
    return out


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"corun: {c['streams']} decode streams, {c['arrivals']} arrivals of {c['prompt_tokens']} tokens "
        f"({c['hit_share']:.0%} stored), decode {c['decode_ms']:g} ms/pass, store {res['store'].get('where')}",
        f"{'mode':10s} {'iter p50':>9s} {'iter p99':>9s} {'vs without':>10s} {'stall p50':>9s} {'stall p99':>9s} "
        f"{'served':>8s}",
    ]
    for mode, r in res["modes"].items():
        it, st = r["iteration_ms"], r.get("lookup_stall_ms", {})
        lines.append(
            f"{mode:10s} {it['p50']:8.1f}  {it['p99']:8.1f}  {r.get('p99_vs_without', 1.0):9.2f}x "
            f"{st.get('p50', 0):8.1f}  {st.get('p99', 0):8.1f}  {r['served_tokens']:8d}"
        )
    lines.append("iteration: time between passes as each decode stream sees it (ms); stall: per lookup (ms)")
    return "\n".join(lines)


def plot_corun(res: dict[str, Any], path: str) -> None:
    from .plot import _plt, _save

    plt = _plt()
    modes = list(res["modes"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, q in enumerate(("p50", "p99")):
        ax.bar([m + i * 0.4 for m in range(len(modes))], [res["modes"][m]["iteration_ms"][q] for m in modes],
               width=0.4, label=q)
    ax.set_xticks([m + 0.2 for m in range(len(modes))], modes)
    ax.set_ylabel("ms between passes")
    ax.legend()
    _save(fig, path)
