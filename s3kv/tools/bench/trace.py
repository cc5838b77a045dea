"""``s3kv bench trace FILE``: replay a request trace through the engine simulator and the real adapter.

Every request of the trace, in arrival order, goes through ``SimEngine`` driving the real
``S3KvConnectorLeader`` / ``S3KvConnectorWorker`` on one store, once per storage policy, from an
empty bucket each time. Its prompt is synthesised from the trace's hash ids (``s3kv.tools.bench.tracefile``:
equal ids give equal tokens; a request that continues an earlier one re-sends that request's
prompt tail and the answer the engine really generated). The simulator's checker compares
every page the connector served with what recomputation writes (``kv_mismatches``).

Order and what counts as a hit: requests run one after another -- each one's uploads land
before the next is looked up -- and the simulated engine has no prefix cache of its own, so
S3 is the only source of reuse. This is the regime the "ideal" below describes exactly: each
request could be served every block an earlier request computed (prompt or answer). Per
request: served tokens (the S3 hit), as a share of its prompt, of that ideal, and of what
storing every block serves.

Scale: the whole trace in minutes on two cores, so --

* the model is the chosen one's *geometry* (window, page sizes, object sizes, FLOPs): s3kv sizes
  objects from the real model's page bytes (``LeaderCore(sizing_page_bytes=...)``, as the lookup
  bench does), so every key, object boundary, HEAD, PUT and GET is the real one, but the pages
  it moves are tiny (``sim_page_bytes``): 1 sliding and 1 full-attention layer. Bytes stored
  and requests are reported at the real page sizes (multipart parts and range splits included,
  ``s3kv.core.cost``);
* tokens per block is ``--tokens-per-block`` (default 64; TensorRT-LLM's default is 32): the
  hit granularity, the sliding tail (window + one block) and the blocks per object follow it;
* answers: a request that a later one continues generates its whole answer (it is re-read);
  every other request generates only up to the first block its answer completes (or its
  whole answer if shorter) -- enough for the window policy to store the same history-end tail
  the full answer would. What that leaves out is reported (``answer_tokens_not_replayed``),
  and their full-attention pages are added to the stored bytes by arithmetic. ``--full-outputs``
  generates every answer (about twice as slow).

The bill (``s3kv.tools.bench.billing``): requests and bytes at the real sizes, storage as
byte-hours under ``--retention-h`` on the trace's clock (objects expire; hits refresh), and the
``value`` object: S3 dollars next to the prefill GPU dollars the served tokens saved, and their ratio.

The upstream example's rule (the VSWA connector example in TensorRT-LLM) is counted, not
replayed: every group stores every full prompt block as its own object, a lookup HEADs block by
block until the first miss, and the hit is capped by the smallest window.

Why this is one module: one benchmark -- the replay, the store model it prices, the ideal it
compares with and the table and plot that report them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.cost import (
    Gpu,
    Prices,
    Usage,
    cost,
    expiry_age_s,
    get_requests,
    put_requests,
    value,
)
from ...store.base import StoreWrapper
from .. import models as _models
from .billing import BilledStore
from .common import (
    GEMMA3_27B,
    GPU_NAME,
    GPU_PEAK_TFLOPS,
    BenchStore,
    ModelSpec,
    machine_info,
    progress,
    rnd,
)
from .tracefile import (
    TokenSynth,
    TraceRequest,
    duration_hours,
    find_continuations,
    read_trace,
    trace_reuse_tokens,
)

#: Geometries ``--model`` names (the one registry, s3kv.tools.models).
MODELS = _models.MODELS
#: Storage-policy runs: name -> (S3KV_STORAGE_POLICY, S3KV_BRANCH_TAILS).
RUNS: dict[str, tuple[str, bool]] = {
    "window": ("window", True),
    "window-no-branch": ("window", False),
    "all": ("all", False),
}
#: Token ids in [0, 2^16): a synthesised block is 2 bytes a token of a hash, no arithmetic.
SIM_VOCAB = 1 << 16
#: Bytes of K and V per token and layer in the simulator (kv_heads 1, head_dim 2, bf16).
SIM_HEAD_DIM = 2


@dataclass(frozen=True)
class TraceConfig:
    path: str
    fmt: str = "mooncake"
    model: ModelSpec = GEMMA3_27B
    runs: tuple[str, ...] = ("window", "window-no-branch", "all")
    limit: int | None = None
    tokens_per_block: int = 64
    full_outputs: bool = False
    checkpoint_tokens: int = 4096
    prices: Prices = field(default_factory=Prices)
    gpu: Gpu = field(default_factory=Gpu)
    #: ``s3kv gc --watch`` period: an expired object lives on half of it on average.
    gc_period_s: float = 600.0
    #: Re-verify every page when the engine frees it (catches stray writes; doubles the model's cost).
    audit: bool = False
    #: Chunked prefill: tokens per forward pass (TensorRT-LLM's max_num_tokens default).
    chunk_tokens: int = 8192
    #: Replays run at once, each in its own process (1: in this process).
    jobs: int = 1
    #: Store each replay runs on (None: its own in-process memory:// store).
    url: str | None = None
    #: Settings the replay's connector gets (S3KV_* names, lower case): the levers under test.
    settings: Mapping[str, Any] = field(default_factory=dict)
    #: Put per-request served tokens (each run, the ideal, the upstream rule) into the result.
    per_request: bool = False
    #: Replay on the embedded S3 server (or ``url``) behind the fault proxy, this many ms added to
    #: every request, lookups under the engine's default time budget (None: in-process, no budget).
    s3_latency_ms: float | None = None

    def replace(self, **kw: Any) -> TraceConfig:
        return dataclasses.replace(self, **kw)


# --------------------------------------------------------------------------- the ideal and the upstream rule


class _Oracle:
    """What storing every block would serve, and what the upstream example's rule serves.

    Its own arithmetic over token blocks (a chained blake2b of each block's tokens), sharing
    nothing with s3kv's keys, policy or lookup.
    """

    def __init__(self, tpb: int, window: int, page_real: Sequence[int]):
        self.tpb = tpb
        self.window_blocks = window // tpb
        self.page_real = list(page_real)
        self.kv: set[bytes] = set()  # every block any earlier request computed (prompt + answer)
        self.prompt: set[bytes] = set()  # the upstream example stores prompt blocks only
        self.ideal: list[int] = []
        self.upstream: list[int] = []
        self.up = {"head": 0, "put": 0, "get": 0, "real_put": 0, "real_get": 0}
        self.up_bytes = [0] * len(self.page_real)
        self.up_objects = 0

    def _digests(self, tokens: Sequence[int], n: int) -> list[bytes]:
        raw = array("i", tokens[: n * self.tpb]).tobytes()
        step = 4 * self.tpb
        out, prev = [], b""
        for k in range(n):
            prev = hashlib.blake2b(prev + raw[k * step : (k + 1) * step], digest_size=12).digest()
            out.append(prev)
        return out

    def __getstate__(self) -> dict[str, Any]:
        # Sent back from a replay process: the counts, not the block sets.
        return {k: v for k, v in self.__dict__.items() if k not in ("kv", "prompt")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.kv, self.prompt = set(), set()

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        tpb, groups = self.tpb, len(self.page_real)
        plen = len(prompt)
        hmax = (plen - 1) // tpb
        full = plen // tpb
        kv_blocks = (plen + len(output) - 1) // tpb
        d = self._digests(list(prompt) + list(output[: max(0, kv_blocks * tpb - plen)]), kv_blocks)
        k = 0
        while k < hmax and d[k] in self.kv:
            k += 1
        self.ideal.append(k * tpb)
        m = 0  # the upstream lookup: block by block, every group, until the first miss
        while m < full and d[m] in self.prompt:
            m += 1
        served = min(m, hmax, self.window_blocks)
        self.upstream.append(served * tpb)
        self.up["head"] += groups * m + (1 if m < full else 0)
        self.up["get"] += groups * served
        self.up["real_get"] += sum(served * get_requests(p) for p in self.page_real)
        for b in range(served, full):  # saved after the served blocks: exists-check, then PUT if new
            self.up["head"] += groups
            if d[b] not in self.prompt:
                self.up["put"] += groups
                self.up["real_put"] += sum(put_requests(p) for p in self.page_real)
                self.up_objects += groups
                for gi, p in enumerate(self.page_real):
                    self.up_bytes[gi] += p
                self.prompt.add(d[b])
        self.kv.update(d)


# --------------------------------------------------------------------------- one replay


def _sim_model(cfg: TraceConfig) -> Any:
    from ...sim import FULL_ATTENTION, SimModel

    return SimModel(
        num_layers=2,
        kv_heads=1,
        head_dim=SIM_HEAD_DIM,
        max_attention_window=(cfg.model.window, FULL_ATTENTION),
        vocab_size=SIM_VOCAB,
        name=f"s3kv-trace/{cfg.model.name}",
    )


def real_page_bytes(model: ModelSpec, tpb: int) -> list[int]:
    """The real model's page bytes (TP 1) in the simulator's group order: full attention, sliding."""
    p = model.page_bytes(tpb)
    return [p["full"], p["sliding"]]


def _leader_class(sizing: Sequence[int]) -> Any:
    from ...trtllm import S3KvConnectorLeader

    class SizedLeader(S3KvConnectorLeader):
        """The real adapter, told to size objects from the real model's pages (it moves tiny ones)."""

        def __init__(self, llm_args: Any, **kw: Any):
            super().__init__(llm_args, **kw)
            self.core._sizing_page_bytes = list(sizing)  # read when the geometry arrives

    return SizedLeader


class _Shared(StoreWrapper):
    def close(self) -> None:  # the bench owns the store
        pass


@functools.cache
def _spec_class() -> Any:
    from ...sim import SimRequestSpec

    class TraceSpec(SimRequestSpec):
        """Its tokens are ints already: skips the per-token conversion (~20 s of a whole-trace replay)."""

        def __post_init__(self) -> None:
            if not self.prompt or self.max_new_tokens < 1:
                raise ValueError(f"request {self.request_id}: empty prompt or no answer")

    return TraceSpec


def _answer_tokens(cfg: TraceConfig, r: TraceRequest, continued: bool) -> int:
    """Tokens the replay generates for ``r`` (module doc): all of them if it is continued."""
    if cfg.full_outputs or continued:
        return r.output_length
    tpb = cfg.tokens_per_block
    return min(r.output_length, tpb - r.input_length % tpb + 1)


def replay(
    cfg: TraceConfig,
    bs: BenchStore,
    reqs: Sequence[TraceRequest],
    block_tokens: int,
    conts: Mapping[int, int],
    run: str,
    oracle: _Oracle | None = None,
) -> dict[str, Any]:
    """One policy over the whole trace, from an empty prefix; per-request served tokens and totals."""
    from ...config import Settings
    from ...sim import SimCacheConfig, SimEngine
    from ...trtllm import S3KvConnectorWorker

    policy, branch = RUNS[run]
    tpb = cfg.tokens_per_block
    continued = set(conts.values())
    max_len = max(r.input_length + _answer_tokens(cfg, r, r.index in continued) for r in reqs)
    max_len = -(-(max_len + 1) // tpb) * tpb
    settings = Settings(
        check_access=False,
        storage_policy=policy,
        branch_tails=branch,
        checkpoint_tokens=cfg.checkpoint_tokens,
        **cfg.settings,
        staging_mib=64,
        upload_threads=2,
        download_threads=2,
        # No time budget in-process: a slow moment on a busy machine must not turn a hit into a
        # miss. At --s3-latency-ms the engine's default budget: what that latency costs is the point.
        lookup_timeout_s=-1 if cfg.s3_latency_ms is not None else 0,
        # Refresh on hit runs on the trace's clock in BilledStore (the engine's runs on wall time).
        refresh_on_hit=False,
        # Positives the index remembers would outlive an expiry on the trace's clock.
        index_ttl_s=600.0 if cfg.prices.retention_h * 3600 >= 600 else 1e-6,
    )
    sizing = real_page_bytes(cfg.model, tpb)
    counter = BilledStore(
        bs.store,
        settings.multipart_threshold_mib << 20,
        settings.multipart_part_mib << 20,
        retention_s=cfg.prices.retention_h * 3600,
        # gc deletes later than the retention: what an engine may still believe must outlive it.
        expire_after_s=expiry_age_s(dataclasses.replace(settings, retention_h=cfg.prices.retention_h)),
        gc_period_s=cfg.gc_period_s,
        range_split=settings.range_split_mib << 20,
    )
    before = bs.store.snapshot()
    synth = TokenSynth(block_tokens, SIM_VOCAB)
    history: dict[int, list[int]] = {}
    served: list[int] = []
    generated = not_generated = 0
    totals = {"kv_mismatches": 0, "pages_checked": 0, "guard_violations": 0}
    fingerprint = hashlib.blake2b(digest_size=16)
    t0 = time.perf_counter()
    engine = SimEngine(
        _sim_model(cfg),
        SimCacheConfig(
            tokens_per_block=tpb, max_seq_len=max_len, audit=cfg.audit, slot_padding=0, seed=1
        ),
        _leader_class(sizing),
        S3KvConnectorWorker,
        max_batch=1,
        chunk_size=cfg.chunk_tokens,
        connector_kwargs=dict(
            settings=settings, store=_Shared(counter), key_prefix=bs.key(f"trace-{run}"), engine_key=f"trace-{run}"
        ),
    )
    stalls: list[Any] = []  # LookupRecord of every lookup
    with engine:
        counter.bind(engine.workers[0].core.geometry, sizing)
        counter.checkpoint_blocks = engine.leader.core.policy.checkpoint_blocks
        t_first = reqs[0].timestamp_ms
        step = max(1, len(reqs) // 10)
        for r in reqs:
            a = conts.get(r.index)
            if a is not None:
                hist = history[a]
                prompt = synth.prompt(r, hist, reqs[a].full_blocks(block_tokens) * block_tokens)
            else:
                prompt = synth.prompt(r)
            n_out = _answer_tokens(cfg, r, r.index in continued)
            counter.now = (r.timestamp_ms - t_first) / 1000
            counter.prompt_blocks = len(prompt) // tpb
            rep = engine.run([_spec_class()(r.index, tuple(prompt), max_new_tokens=n_out)])
            for w in engine.workers:
                w.flush(120)
            rr = rep.requests[0]
            recent = engine.leader.core.stats.recent_lookups
            stalls += [x for x in recent if not stalls or x.seq > stalls[-1].seq]
            served.append(rr.matched_tokens)
            counter.credit(rr.matched_tokens)
            totals["kv_mismatches"] += rep.kv_mismatches
            totals["pages_checked"] += rep.pages_checked
            totals["guard_violations"] += rep.guard_violations
            generated += n_out
            not_generated += r.output_length - n_out
            out = list(rr.output_tokens)
            fingerprint.update(array("i", prompt + out).tobytes())
            if r.index in continued:
                history[r.index] = prompt[r.full_blocks(block_tokens) * block_tokens :] + out
            if oracle is not None:
                oracle.add(prompt, out)
            if (r.index + 1) % step == 0:
                progress(
                    f"trace: {run}: {r.index + 1}/{len(reqs)} requests, {sum(served) / 1e6:.2f}M tokens served, "
                    f"{time.perf_counter() - t0:.0f} s"
                )
        counter.finish()
        lstats = engine.leader.core.stats
        wstats = [w.core.stats() for w in engine.workers]
    wall = time.perf_counter() - t0
    io = bs.store.snapshot() - before
    bs.delete_prefix(bs.key(f"trace-{run}") + "/")
    return {
        "run": run,
        "storage_policy": policy,
        "branch_tails": branch,
        "served_per_request": served,
        "served_tokens": sum(served),
        **totals,
        "load_failures": sum(s.loads_failed_objects for s in wstats),
        "saves_dropped": sum(
            s.saves_dropped_staging_full + s.saves_dropped_store_error + s.saves_dropped_other for s in wstats
        ),
        "lookups": lstats.lookups,
        "lookup_waves": lstats.lookup_waves,
        "hits": lstats.hits,
        "promises_broken": lstats.promises_broken,
        # Offers a failed grow would break (pressure.py), and what the guard cut (all of them under
        # --set offer_guard=always: the price of memory pressure that never lets up).
        "offers_exposed": lstats.offers_exposed,
        "offers_cut": lstats.offers_cut,
        "tokens_cut": lstats.tokens_cut,
        "branch_tails_stored": lstats.branch_tails,
        "branch_tail_pages": lstats.branch_tail_pages,
        "requests_sim": {"head": io.head, "put": io.put, "get": io.get},
        "requests_real": {"head": counter.heads, "put": counter.real_put, "get": counter.real_get},
        "refreshes": counter.refreshes,
        "get_requests_by_split_mib": counter.get_by_split,
        "expired_objects": counter.expired,
        "storage_gib_hours": rnd(counter.byte_seconds / 2**30 / 3600, 1),
        "storage_usd": counter.storage_usd(cfg.prices.gb_month),
        "by_kind": counter.kinds,
        "stored_by_group": {
            g: {**v, "distinct_pages": len(counter.distinct.get(g, ()))} for g, v in sorted(counter.groups.items())
        },
        "generated_tokens": generated,
        "answer_tokens_not_replayed": not_generated,
        "tokens_fingerprint": fingerprint.hexdigest(),
        "lookup_stall": stall_summary(stalls, sum(served)),
        "wall_s": rnd(wall, 1),
    }


def stall_summary(records: Sequence[Any], served_tokens: int) -> dict[str, Any]:
    """What the lookups held the scheduler: per lookup (p50, p99, max, ms), per token served
    (microseconds), and how the lookups ended."""
    import statistics

    ms = sorted(x.stall_s * 1e3 for x in records)
    decisions: dict[str, int] = {}
    for x in records:
        decisions[x.decision] = decisions.get(x.decision, 0) + 1

    def pct(q: float) -> float:
        return rnd(ms[min(len(ms) - 1, int(q * len(ms)))], 2) if ms else 0.0

    return {
        "lookups": len(ms),
        "p50_ms": rnd(statistics.median(ms), 2) if ms else 0.0,
        "p99_ms": pct(0.99),
        "max_ms": rnd(ms[-1], 2) if ms else 0.0,
        "total_s": rnd(sum(ms) / 1e3, 3),
        "us_per_token_served": rnd(sum(ms) * 1e3 / served_tokens, 3) if served_tokens else None,
        "decisions": decisions,
    }


# --------------------------------------------------------------------------- the whole bench


def _unreplayed_blocks(cfg: TraceConfig, reqs: Sequence[TraceRequest], continued: set[int]) -> int:
    """Answer blocks the replay did not generate (their KV would have been stored)."""
    tpb = cfg.tokens_per_block
    n = 0
    for r in reqs:
        g = _answer_tokens(cfg, r, r.index in continued)
        n += (r.input_length + r.output_length - 1) // tpb - (r.input_length + g - 1) // tpb
    return n


DEFAULT_URL = "memory://s3kv-bench-trace"


def _replay_job(
    cfg: TraceConfig, reqs: Sequence[TraceRequest], bt: int, conts: Mapping[int, int], run: str, oracle: _Oracle | None
) -> tuple[dict[str, Any], _Oracle | None]:
    """One replay in a process of its own, on a store of its own."""
    import torch

    from .common import bench_store

    torch.set_num_threads(1)  # tiny tensors; the other replay process needs the other core
    url = cfg.url or (None if cfg.s3_latency_ms is not None else DEFAULT_URL)
    with bench_store(url, name=f"trace-{run}", s3_latency_ms=cfg.s3_latency_ms) as bs:
        return replay(cfg, bs, reqs, bt, conts, run, oracle), oracle


def _replay_all(
    cfg: TraceConfig, bs: BenchStore, reqs: Sequence[TraceRequest], bt: int, conts: Mapping[int, int], oracle: _Oracle
) -> tuple[dict[str, dict[str, Any]], _Oracle]:
    """Every run of ``cfg.runs``; the first also feeds the oracle (the token streams are the same)."""
    if cfg.jobs <= 1 or len(cfg.runs) == 1:
        runs = {name: replay(cfg, bs, reqs, bt, conts, name, oracle if i == 0 else None) for i, name in enumerate(cfg.runs)}
        return runs, oracle
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: this process has torch (OpenMP) and thread pools.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(cfg.jobs, len(cfg.runs)), mp_context=ctx) as pool:
        # Store-everything writes the most objects and takes longest: start it first.
        order = sorted(cfg.runs, key=lambda n: RUNS[n][0] != "all")
        futs = {
            name: pool.submit(_replay_job, cfg, reqs, bt, conts, name, oracle if name == cfg.runs[0] else None)
            for name in order
        }
        results = {name: futs[name].result() for name in cfg.runs}
    fed = results[cfg.runs[0]][1]
    assert fed is not None
    return {name: r for name, (r, _) in results.items()}, fed


def run_trace(bs: BenchStore, cfg: TraceConfig) -> dict[str, Any]:
    t_start = time.perf_counter()
    reqs, bt = read_trace(cfg.path, cfg.fmt, cfg.limit)
    conts = find_continuations(reqs, bt)
    continued = set(conts.values())
    tpb = cfg.tokens_per_block
    m = cfg.model
    pages = real_page_bytes(m, tpb)
    hours = duration_hours(reqs)
    prompt_tokens = sum(r.input_length for r in reqs)
    progress(
        f"trace: {len(reqs)} requests, {prompt_tokens / 1e6:.1f}M prompt tokens, {len(conts)} continuations, "
        f"{hours * 60:.1f} min of traffic; runs {', '.join(cfg.runs)}"
    )
    runs, oracle = _replay_all(cfg, bs, reqs, bt, conts, _Oracle(tpb, m.window, pages))
    fps = {r["tokens_fingerprint"] for r in runs.values()}
    if len(fps) != 1:
        raise RuntimeError("the replays saw different token streams: the replay is not deterministic")

    ideal = sum(oracle.ideal)
    unreplayed = _unreplayed_blocks(cfg, reqs, continued)
    def prefill(per_request: Sequence[int]) -> dict[str, float]:
        flops = sum(m.prefill_flops(t) for t in per_request)
        return {
            "prefill_pflops_saved": rnd(flops / 1e15, 3),
            "gpu_seconds_saved": rnd(cfg.gpu.seconds(flops), 1),
            "gpu_usd_saved": rnd(cfg.gpu.usd(flops), 6),
        }

    def money(
        put: int, get: int, head: int, stored: int, served: int, storage_usd: float | None = None
    ) -> dict[str, Any]:
        """Requests at list prices; storage as replayed (``storage_usd``: byte-seconds under
        retention) or, for the counted upstream rule, every byte kept for the retention."""
        usage = Usage(put, get, head, stored, served)
        c = cost(usage, cfg.prices)
        if storage_usd is not None:
            c = dataclasses.replace(c, storage_usd=storage_usd)
        per_h = (lambda x: rnd(x / hours, 4)) if hours > 0 else (lambda x: None)
        return {
            "requests_usd": rnd(c.requests_usd, 6),
            "storage_usd": rnd(c.storage_usd, 6),
            "s3_usd": rnd(c.total_usd, 6),
            "usd_per_trace_hour": per_h(c.total_usd),
            "requests_usd_per_trace_hour": per_h(c.requests_usd),
            "storage_usd_per_trace_hour": per_h(c.storage_usd),
            "usd_per_1m_tokens_served": None if served <= 0 else rnd(c.total_usd * 1e6 / served, 4),
        }

    def priced(row: dict[str, Any]) -> dict[str, Any]:
        v = value(row["s3_usd"], row["gpu_usd_saved"])
        row["ratio"] = None if v["ratio"] is None else rnd(v["ratio"], 4)
        return row

    page_of = {"full": pages[0], f"sliding{m.window}": pages[1]}
    table: dict[str, dict[str, Any]] = {}
    for name, r in runs.items():
        stored_real = sum(g["bytes"] for g in r["stored_by_group"].values())
        # Answer blocks not replayed: their full-attention pages (every group's under "all").
        extra = unreplayed * (pages[0] + (pages[1] if r["storage_policy"] == "all" else 0))
        rq = r["requests_real"]
        table[name] = {
            "served_tokens": r["served_tokens"],
            "served_pct_of_prompt": rnd(100 * r["served_tokens"] / prompt_tokens, 2),
            "served_pct_of_ideal": rnd(100 * r["served_tokens"] / ideal, 2) if ideal else None,
            "stored_bytes": stored_real,
            "stored_bytes_incl_unreplayed_answers": stored_real + extra,
            # Each page once: objects repeat some (a prompt-end snapshot and then the whole chunk;
            # a history-end tail over the prompt-end one), which S3 bills but a hit never needs.
            "distinct_page_bytes": sum(
                v["distinct_pages"] * page_of[g] for g, v in r["stored_by_group"].items()
            ),
            "stored_bytes_by_group": {g: v["bytes"] for g, v in r["stored_by_group"].items()},
            "pages_by_group": {g: v["pages"] for g, v in r["stored_by_group"].items()},
            "distinct_pages_by_group": {g: v["distinct_pages"] for g, v in r["stored_by_group"].items()},
            "objects_by_group": {g: v["objects"] for g, v in r["stored_by_group"].items()},
            "per_1k_prompt_tokens": {k: rnd(1000 * v / prompt_tokens, 4) for k, v in rq.items()},
            "per_1k_served_tokens": {k: rnd(1000 * v / r["served_tokens"], 4) for k, v in rq.items()}
            if r["served_tokens"]
            else None,
            # HEAD waves that went to the store, per lookup: each is a round trip on the scheduler's path.
            "round_trips_per_lookup": rnd(r["lookup_waves"] / r["lookups"], 3) if r["lookups"] else 0.0,
            # The unreplayed answers' pages live as long as their request's other objects.
            **money(
                rq["put"], rq["get"], rq["head"], stored_real + extra, r["served_tokens"],
                r["storage_usd"] * (stored_real + extra) / stored_real if stored_real else 0.0,
            ),
            **prefill(r["served_per_request"]),
            "refreshes": r["refreshes"],
            "expired_objects": r["expired_objects"],
            "get_requests_by_split_mib": r["get_requests_by_split_mib"],
            # What the store itself counted (calls, not billed requests): the accounting's cross-check.
            "store_calls": r["requests_sim"],
            "requests": dict(rq),
            "by_kind": r["by_kind"],
            "kv_mismatches": r["kv_mismatches"],
            "branch_tails_stored": r["branch_tails_stored"],
            "offer_guard": {k: r[k] for k in ("offers_exposed", "offers_cut", "tokens_cut")},
            "lookup_stall": r["lookup_stall"],
            "wall_s": r["wall_s"],
        }
    up_stored = sum(oracle.up_bytes)
    table["upstream-example"] = {
        "served_tokens": sum(oracle.upstream),
        "served_pct_of_prompt": rnd(100 * sum(oracle.upstream) / prompt_tokens, 2),
        "served_pct_of_ideal": rnd(100 * sum(oracle.upstream) / ideal, 2) if ideal else None,
        "stored_bytes": up_stored,
        "stored_bytes_by_group": {"full": oracle.up_bytes[0], f"sliding{m.window}": oracle.up_bytes[1]},
        "objects_by_group": {"full": oracle.up_objects // 2, f"sliding{m.window}": oracle.up_objects // 2},
        "per_1k_prompt_tokens": {
            "head": rnd(1000 * oracle.up["head"] / prompt_tokens, 4),
            "put": rnd(1000 * oracle.up["real_put"] / prompt_tokens, 4),
            "get": rnd(1000 * oracle.up["real_get"] / prompt_tokens, 4),
        },
        **money(oracle.up["real_put"], oracle.up["real_get"], oracle.up["head"], up_stored, sum(oracle.upstream),
                cost(Usage(bytes_stored=up_stored), cfg.prices).storage_usd),
        **prefill(oracle.upstream),
        "modelled": "counted from its rule, not replayed",
    }
    for row in table.values():
        priced(row)
    from ...config import Settings

    first = table[cfg.runs[0]]
    res_value = {
        "policy": cfg.runs[0],
        "s3_usd": first["s3_usd"],
        "requests_usd": first["requests_usd"],
        "storage_usd": first["storage_usd"],
        "gpu_usd_saved": first["gpu_usd_saved"],
        "ratio": first["ratio"],
        "prices": dataclasses.asdict(cfg.prices),
        "retention_h": cfg.prices.retention_h,
        "gc_period_s": cfg.gc_period_s,
        "gpu": dataclasses.asdict(cfg.gpu),
        "settings": {
            k: getattr(Settings(**cfg.settings), k)
            for k in ("multipart_threshold_mib", "multipart_part_mib", "range_split_mib", "target_object_mib")
        },
        "note": "ratio = S3 $ (requests + storage from write until gc deletes: the retention plus what engines "
        "may still believe, after the last write or refresh) / "
        "prefill GPU $ the served tokens saved; below 1 s3kv pays for itself",
    }
    res: dict[str, Any] = {
        "value": res_value,
        "bench": "trace",
        "store": bs.info(),
        "latency_ms_injected": bs.latency_ms,
        "machine": machine_info(),
        "trace": {
            "path": cfg.path,
            "format": cfg.fmt,
            "requests": len(reqs),
            "prompt_tokens": prompt_tokens,
            "output_tokens": sum(r.output_length for r in reqs),
            "continuations": len(conts),
            "duration_hours": rnd(hours, 4),
            "hash_block_tokens": bt,
            "reuse_by_hash_ids_tokens": sum(trace_reuse_tokens(reqs, bt)),
        },
        "sim": {
            "tokens_per_block": tpb,
            "layers": "1 sliding + 1 full-attention (2 layer groups)",
            "window": m.window,
            "sim_page_bytes": {g: 4 * tpb * SIM_HEAD_DIM for g in ("full", "sliding")},
            "real_page_bytes": {"full": pages[0], "sliding": pages[1]},
            "checkpoint_tokens": cfg.checkpoint_tokens,
            "engine": f"one request at a time (uploads land before the next lookup), chunked prefill of "
            f"{cfg.chunk_tokens} tokens, no device prefix cache",
            "answers": "full answers generated" if cfg.full_outputs else (
                "continued requests generate their whole answer; others up to the first block it completes"
            ),
            "generated_tokens": next(iter(runs.values()))["generated_tokens"],
            "answer_tokens_not_replayed": next(iter(runs.values()))["answer_tokens_not_replayed"],
            "answer_blocks_not_replayed": unreplayed,
            "audit": cfg.audit,
            "replay_processes": min(max(1, cfg.jobs), len(cfg.runs)),
            "sizing_note": "objects sized from the real model's page bytes; tiny pages moved; bytes and "
            "requests reported at real sizes",
        },
        "model": {
            "name": m.name,
            "layers": m.layers,
            "sliding_window": m.window,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "gpu": GPU_NAME if cfg.gpu.peak_tflops == GPU_PEAK_TFLOPS else "user-given",
            "gpu_peak_tflops": cfg.gpu.peak_tflops,
            "mfu": cfg.gpu.mfu,
        },
        "prices": dataclasses.asdict(cfg.prices),
        "ideal_tokens": ideal,
        "ideal_pct_of_prompt": rnd(100 * ideal / prompt_tokens, 2),
        "policies": table,
        "kv_mismatches": sum(r["kv_mismatches"] for r in runs.values()),
        "guard_violations": sum(r["guard_violations"] for r in runs.values()),
        "load_failures": sum(r["load_failures"] for r in runs.values()),
        "curves": _curves(reqs, runs, oracle),
    }
    if cfg.per_request:
        res["per_request"] = {
            **{name: r["served_per_request"] for name, r in runs.items()},
            "ideal": list(oracle.ideal),
            "upstream-example": list(oracle.upstream),
        }
        res["tokens_fingerprint"] = next(iter(fps))
    if "window" in runs and "all" in runs:
        w, a = table["window"], table["all"]
        res["window_vs_all"] = {
            "served": rnd(w["served_tokens"] / a["served_tokens"], 4) if a["served_tokens"] else None,
            "served_vs_ideal": rnd(w["served_tokens"] / ideal, 4) if ideal else None,
            "stored_bytes": rnd(w["stored_bytes_incl_unreplayed_answers"] / a["stored_bytes_incl_unreplayed_answers"], 4)
            if a["stored_bytes"]
            else None,
            "distinct_page_bytes": rnd(w["distinct_page_bytes"] / a["distinct_page_bytes"], 4)
            if a["distinct_page_bytes"]
            else None,
        }
    if "window" in runs and "window-no-branch" in runs:
        w, nb = table["window"], table["window-no-branch"]
        res["branch_tails"] = {
            "served_tokens_added": w["served_tokens"] - nb["served_tokens"],
            "served_pct_points_added": rnd(w["served_pct_of_prompt"] - nb["served_pct_of_prompt"], 2),
            "stored_bytes_added": w["stored_bytes"] - nb["stored_bytes"],
            "stored_bytes_added_pct": rnd(100 * (w["stored_bytes"] / nb["stored_bytes"] - 1), 2)
            if nb["stored_bytes"]
            else None,
            "tails_stored": w["branch_tails_stored"],
        }
    res["targets"] = {
        "kv_mismatches_zero": "no page served differs from recomputation, in every run",
        "no_failed_loads": "no promised load failed",
        "no_saves_dropped": "every planned save reached the store (else the policy comparison is off)",
    }
    res["targets_met"] = {
        "kv_mismatches_zero": res["kv_mismatches"] == 0 and res["guard_violations"] == 0,
        "no_failed_loads": res["load_failures"] == 0,
        "no_saves_dropped": all(r["saves_dropped"] == 0 for r in runs.values()),
    }
    res["seconds"] = rnd(time.perf_counter() - t_start, 1)
    return res


def _curves(reqs: Sequence[TraceRequest], runs: Mapping[str, Mapping[str, Any]], oracle: _Oracle) -> dict[str, Any]:
    """Cumulative served tokens against cumulative prompt tokens, ~200 points (for the plot)."""
    n = len(reqs)
    idx = sorted({min(n - 1, int(i * n / 200)) for i in range(200)} | {n - 1})

    def cum(xs: Sequence[int]) -> list[int]:
        out, s, j = [], 0, 0
        for i, x in enumerate(xs):
            s += x
            if j < len(idx) and i == idx[j]:
                out.append(s)
                j += 1
        return out

    series = {name: cum(r["served_per_request"]) for name, r in runs.items()}
    series["ideal"] = cum(oracle.ideal)
    series["upstream-example"] = cum(oracle.upstream)
    return {"prompt_tokens": cum([r.input_length for r in reqs]), "served": series}


# --------------------------------------------------------------------------- output


def table(res: dict[str, Any]) -> str:
    from .common import header, targets_line

    t, s = res["trace"], res["sim"]
    lines = [
        f"s3kv bench trace -- {t['path']} ({t['format']}): {t['requests']} requests, "
        f"{t['prompt_tokens'] / 1e6:.2f}M prompt tokens, {t['continuations']} continuations, "
        f"{t['duration_hours'] * 60:.1f} min of traffic",
        f"model {res['model']['name']} (window {s['window']}); simulator: {s['tokens_per_block']} tokens/block, "
        f"{s['layers']}, tiny pages ({s['sim_page_bytes']['full']} B) -- objects sized and bytes/requests reported "
        f"for the real pages ({s['real_page_bytes']['full'] / 2**20:.2f} MiB full, "
        f"{s['real_page_bytes']['sliding'] / 2**20:.2f} MiB sliding); checkpoints every {s['checkpoint_tokens']} tok",
        f"engine: {s['engine']}; answers: {s['answers']} ({s['answer_tokens_not_replayed']} answer tokens not "
        "replayed, their full-attention pages added by arithmetic)",
        header(res),
        "",
        f"ideal (every block an earlier request computed): {res['ideal_tokens'] / 1e6:.2f}M tokens = "
        f"{res['ideal_pct_of_prompt']:.1f}% of prompt tokens; the trace's own hash-id reuse: "
        f"{t['reuse_by_hash_ids_tokens'] / 1e6:.2f}M",
        "",
        f"{'policy':>18} | {'served':>8} {'%prompt':>7} {'%ideal':>7} | {'stored GiB':>10} | "
        f"{'PUT/1k':>7} {'GET/1k':>7} {'HEAD/1k':>7} | {'S3 $':>7} {'GPU $':>7} {'ratio':>6} | {'GPU-s saved':>11} | "
        f"{'mism':>4}",
    ]
    for name, p in res["policies"].items():
        per = p["per_1k_prompt_tokens"]
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.3f}"
        lines.append(
            f"{name:>18} | {p['served_tokens'] / 1e6:>7.2f}M {p['served_pct_of_prompt']:>6.1f}% "
            f"{(p['served_pct_of_ideal'] or 0):>6.1f}% | "
            f"{p.get('stored_bytes_incl_unreplayed_answers', p['stored_bytes']) / 2**30:>10.1f} | "
            f"{per['put']:>7.3f} {per['get']:>7.3f} {per['head']:>7.3f} | "
            f"{p['s3_usd']:>7.3f} {p['gpu_usd_saved']:>7.3f} {ratio:>6} | "
            f"{p['gpu_seconds_saved']:>11.0f} | {p.get('kv_mismatches', '-'):>4}"
        )
    lines.append("")
    lines.append("scheduler stall per lookup (ms; the lookup's wall time, hashing included) and per token served:")
    for name, p in res["policies"].items():
        st = p.get("lookup_stall")
        if st:
            lines.append(
                f"  {name:>18}: p50 {st['p50_ms']:.2f}, p99 {st['p99_ms']:.2f}, max {st['max_ms']:.1f} ms over "
                f"{st['lookups']} lookups; {st['us_per_token_served'] or 0:.2f} us per token served; "
                + ", ".join(f"{k} {v}" for k, v in sorted(st["decisions"].items()))
            )
    lines.append("stored bytes per layer group (GiB, real page sizes):")
    for name, p in res["policies"].items():
        parts = ", ".join(f"{g} {b / 2**30:.1f}" for g, b in p["stored_bytes_by_group"].items())
        lines.append(f"  {name:>18}: {parts}")
    if "window_vs_all" in res:
        w = res["window_vs_all"]
        lines.append(
            f"window policy vs store-everything: served {w['served']:.4f} of its tokens "
            f"({w['served_vs_ideal']:.4f} of the ideal), stored {w['stored_bytes']:.4f} of its bytes "
            f"({w['distinct_page_bytes']:.4f} counting each page once)"
        )
    if "branch_tails" in res:
        b = res["branch_tails"]
        lines.append(
            f"branch-point tails: {b['served_tokens_added'] / 1e6:+.3f}M tokens served "
            f"({b['served_pct_points_added']:+.2f} pp of prompt tokens), {b['stored_bytes_added'] / 2**30:+.1f} GiB "
            f"stored ({b['stored_bytes_added_pct']:+.1f}%: a hit also stores less), {b['tails_stored']} tails"
        )
    for name, p in res["policies"].items():
        kinds = p.get("by_kind")
        if kinds:
            parts = ", ".join(
                f"{k} {int(d['objects'])} ({100 * d['objects_read'] / d['objects']:.0f}% read, "
                f"{d['served_tokens'] / 1e6:.2f}M served)"
                for k, d in kinds.items()
                if d["objects"]
            )
            lines.append(f"objects by kind, {name}: {parts}")
    pr, v = res["prices"], res["value"]
    lines.append(
        f"prices: PUT ${pr['put_per_1k']}/1k, GET/HEAD ${pr['get_per_1k']}/1k, storage ${pr['gb_month']}/GB-month, "
        f"kept {pr['retention_h']:g} h after the last write or refresh (+ half a {v['gc_period_s']:g} s gc period); "
        f"GPU ${v['gpu']['usd_per_hour']:g}/h at {v['gpu']['peak_tflops']:g} TFLOP/s x MFU {v['gpu']['mfu']:g}"
    )
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
    lines.append(
        f"value ({v['policy']}): S3 ${v['s3_usd']:.3f} (requests ${v['requests_usd']:.3f}, storage "
        f"${v['storage_usd']:.3f}) for ${v['gpu_usd_saved']:.3f} of prefill GPU time saved: ratio {ratio} "
        "(below 1: s3kv pays for itself)"
    )
    lines.append(f"took {res['seconds']:.0f} s")
    lines.append(targets_line(res))
    return "\n".join(lines)


def plot_trace(res: dict[str, Any], path: str) -> None:
    from .plot import BASELINE, RAW, S3KV, WARM, _plt, _save

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    colors = {"window": S3KV, "window-no-branch": "#9467bd", "all": RAW, "upstream-example": BASELINE, "ideal": WARM}
    ax = axes[0]
    c = res["curves"]
    x = [v / 1e6 for v in c["prompt_tokens"]]
    for name, ys in c["served"].items():
        ax.plot(x, [y / 1e6 for y in ys], label=name, color=colors.get(name), lw=1.5,
                ls="--" if name in ("ideal", "upstream-example") else "-")
    ax.set_xlabel("prompt tokens so far (M)")
    ax.set_ylabel("tokens served from S3 so far (M)")
    ax.set_title("Served over the trace")
    ax.legend(fontsize=8)

    names = list(res["policies"])
    ax = axes[1]
    groups = sorted({g for p in res["policies"].values() for g in p["stored_bytes_by_group"]})
    width = 0.8 / max(1, len(groups))
    for gi, g in enumerate(groups):
        vals = [res["policies"][n]["stored_bytes_by_group"].get(g, 0) / 2**30 for n in names]
        ax.bar([i + gi * width for i in range(len(names))], vals, width, label=g)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(names))], names, fontsize=8, rotation=15)
    ax.set_ylabel("stored (GiB, real page sizes)")
    ax.set_title("Bytes stored per layer group")
    ax.legend(fontsize=8)

    ax = axes[2]
    served = [res["policies"][n]["served_pct_of_prompt"] for n in names]
    usd = [res["policies"][n]["usd_per_trace_hour"] or 0 for n in names]
    bars = ax.bar(names, served, color=[colors.get(n, RAW) for n in names])
    for b, u in zip(bars, usd, strict=True):
        ax.annotate(f"${u:.2f}/h", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.axhline(res["ideal_pct_of_prompt"], color=WARM, ls="--", lw=1, label="ideal")
    ax.set_ylabel("prompt tokens served from S3 (%)")
    ax.set_title("Served (bars) and S3 $ per hour of trace")
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"{res['trace']['requests']} requests, {res['model']['name']}; kv_mismatches {res['kv_mismatches']}", fontsize=10
    )
    _save(fig, path)
