"""One run of ``s3kv bench trace``: every request of the trace, in arrival order, through simulated engines.

Each engine is a ``SimEngine`` driving the real ``S3KvConnectorLeader`` / ``S3KvConnectorWorker``;
all of them share one store, wrapped in ``billing.BilledStore`` (what S3 would bill at the real
sizes, retention on the trace's clock). ``--clusters N`` runs N engines behind a router, each with
its own device prefix cache (``fleet``): a request is routed, its device match passed to its
engine as ``device_match_tokens`` (the engine fills those pages itself and asks the connector
only beyond them), and its blocks enter that engine's cache when it ends. With one engine and
the device cache off (``--device-cache-tokens 0``) this is the regime the bench always ran: S3
the only source of reuse, so each request could be served every block an earlier request computed.

Requests run one after another -- each one's uploads land before the next is routed -- and the
clock (``BilledStore.now``, the fleet's ``on_clock`` hooks) is the trace's.

Scale (the whole trace in minutes on two cores):

* the model is the chosen one's *geometry* (window, page sizes, object sizes, FLOPs): s3kv sizes
  objects from the real model's page bytes (``LeaderCore(sizing_page_bytes=...)``), so every key,
  object boundary, HEAD, PUT and GET is the real one, but the pages it moves are tiny
  (1 sliding and 1 full-attention layer);
* tokens per block is ``--tokens-per-block`` (default 64; TensorRT-LLM's default is 32);
* answers: a request a later one continues generates its whole answer (it is re-read); every
  other request generates only up to the first block its answer completes (or its whole answer
  if shorter) -- enough for the window policy to store the same history-end tail the full answer
  would. What that leaves out is reported, its full-attention pages added to the stored bytes by
  arithmetic, and its blocks charged to the device cache as the engine would keep them.
  ``--full-outputs`` generates every answer (about twice as slow).

Why this is one module: one run -- its configuration, the engines it builds, the loop that routes,
replays and checks every request, and the counts it hands back -- reads top to bottom in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...config import Settings
from ...core.cost import Gpu, Prices, expiry_age_s
from ...core.value import GC_WATCH_S
from .. import models as _models
from .billing import BilledStore
from .common import GEMMA3_27B, BenchStore, ModelSpec, SharedStore, pct, progress, rnd
from .fleet import Fleet, FleetConfig, block_chain, decode_forward_s, full_kv_bytes_per_token
from .oracle import Oracle
from .tracefile import TokenSynth, TraceRequest

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
    #: The connector's own default (``Settings.checkpoint_tokens``): the replay bills what it ships.
    checkpoint_tokens: int = Settings().checkpoint_tokens
    prices: Prices = field(default_factory=Prices)
    gpu: Gpu = field(default_factory=Gpu)
    #: ``s3kv gc --watch`` period: an expired object lives on half of it on average. Where the
    #: fleet index learns the retention (the default), its publisher deletes in each pass instead
    #: (``engine.fleetindex``, expiring in each pass): ``index_every_s``.
    gc_period_s: float = GC_WATCH_S
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
    #: Clusters, router, device prefix cache, host tier (``fleet``).
    fleet: FleetConfig = field(default_factory=FleetConfig)
    #: Called with (now s, the Fleet) before each request, on the trace's clock: where a fleet-index
    #: publisher runs (``Fleet.on_clock``). Module-level callables (a replay may run in a process of its own).
    on_clock: tuple[Callable[[float, Fleet], None], ...] = ()
    #: The fleet index's publisher (``s3kv gc --index``) every this many seconds of the trace's clock,
    #: the engines picking each index up at once (``indexhook.ReplayIndex``); 0: no publisher.
    index_every_s: float = 10.0
    #: Seconds gc had learnt the retention before the trace's first request, with no reads of this
    #: traffic (``core.retention.settled``): 0, a fleet that starts with the window.
    gc_learnt_s: float = 0.0

    def replace(self, **kw: Any) -> TraceConfig:
        return dataclasses.replace(self, **kw)


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


@functools.cache
def _spec_class() -> Any:
    from ...sim import SimRequestSpec

    class TraceSpec(SimRequestSpec):
        """Its tokens are ints already: skips the per-token conversion (~20 s of a whole-trace replay)."""

        def __post_init__(self) -> None:
            if not self.prompt or self.max_new_tokens < 1:
                raise ValueError(f"request {self.request_id}: empty prompt or no answer")

    return TraceSpec


def answer_tokens(cfg: TraceConfig, r: TraceRequest, continued: bool) -> int:
    """Tokens the replay generates for ``r`` (module doc): all of them if it is continued."""
    if cfg.full_outputs or continued:
        return r.output_length
    tpb = cfg.tokens_per_block
    return min(r.output_length, tpb - r.input_length % tpb + 1)


def host_cache_gb(cfg: TraceConfig) -> float:
    """Each engine's host tier in GiB: ``--host-cache-tokens`` tokens of the real model's
    full-attention KV (the tier charges every object, sliding tails included, at its real size:
    ``BilledStore.weigh``). 0: no tier. Set explicitly: the simulator turns the engine's automatic
    size (-1) into 0."""
    return cfg.fleet.host_cache_tokens * full_kv_bytes_per_token(cfg.model) / 2**30


def _sum_stats(stats: Sequence[Any], names: Sequence[str]) -> dict[str, int]:
    return {n: sum(int(getattr(s, n)) for s in stats) for n in names}


def replay(
    cfg: TraceConfig,
    bs: BenchStore,
    reqs: Sequence[TraceRequest],
    block_tokens: int,
    conts: Mapping[int, int],
    run: str,
    oracle: Oracle | None = None,
) -> dict[str, Any]:
    """One policy over the whole trace, from an empty prefix; per-request served tokens and totals."""
    from ...sim import SimCacheConfig, SimEngine
    from ...trtllm import S3KvConnectorWorker

    policy, branch = RUNS[run]
    tpb = cfg.tokens_per_block
    continued = set(conts.values())
    max_len = max(r.input_length + answer_tokens(cfg, r, r.index in continued) for r in reqs)
    max_len = -(-(max_len + 1) // tpb) * tpb
    # How long a HEAD's answer is believed: the engines' setting (the default, or ``--set``), unless
    # the retention is shorter -- positives the index remembers would outlive an expiry on the
    # trace's clock.
    ttl = float(cfg.settings.get("index_ttl_s", Settings().index_ttl_s))
    settings = Settings(
        check_access=False,
        storage_policy=policy,
        branch_tails=branch,
        checkpoint_tokens=cfg.checkpoint_tokens,
        # The engines believe their own uploads for the retention (``KeyIndex.from_settings``): the
        # retention gc expires by on the trace's clock, as one S3KV_RETENTION_H serves both in production.
        **{**cfg.settings, "host_cache_gb": host_cache_gb(cfg), "retention_h": cfg.prices.retention_h,
           "index_ttl_s": ttl if cfg.prices.retention_h * 3600 >= ttl else 1e-6},
        staging_mib=64,
        upload_threads=2,
        # The production default: a load's objects share the store's connections by it
        # (``stream_share``), which decides the GETs billed.
        download_threads=Settings().download_threads,
        # No time budget in-process: a slow moment on a busy machine must not turn a hit into a
        # miss. At --s3-latency-ms the engine's default budget: what that latency costs is the point.
        lookup_timeout_s=-1 if cfg.s3_latency_ms is not None else 0,
        # Refresh on hit runs on the trace's clock in BilledStore (the engine's runs on wall time).
        refresh_on_hit=False,
    )
    sizing = real_page_bytes(cfg.model, tpb)
    learns = cfg.index_every_s > 0 and settings.retention_auto
    counter = BilledStore(
        bs.store,
        settings.multipart_threshold_mib << 20,
        settings.multipart_part_mib << 20,
        retention_s=cfg.prices.retention_h * 3600,
        # gc deletes later than the retention: what an engine may still believe must outlive it.
        expire_after_s=expiry_age_s(dataclasses.replace(settings, retention_h=cfg.prices.retention_h)),
        gc_period_s=cfg.index_every_s if learns else cfg.gc_period_s,
        range_split=settings.range_split_mib << 20,
    )
    fleet = Fleet(cfg.fleet, cfg.model, tpb, cfg.gpu)
    fleet.on_clock.extend(cfg.on_clock)
    if cfg.index_every_s > 0:
        from .indexhook import ReplayIndex

        cap = cfg.prices.retention_h * 3600
        fleet.on_clock.append(ReplayIndex(
            cfg.index_every_s, learn=(cap, counter.expire_after_s - cap) if learns else None,
            learnt_s=cfg.gc_learnt_s))
    fleet.store = counter
    before = bs.store.snapshot()
    synth = TokenSynth(block_tokens, SIM_VOCAB)
    history: dict[int, list[int]] = {}
    served: list[int] = []
    device: list[int] = []
    s3_served: list[int] = []
    engine_of: list[int] = []
    generated = not_generated = 0
    totals = {"kv_mismatches": 0, "pages_checked": 0, "guard_violations": 0}
    fingerprint = hashlib.blake2b(digest_size=16)
    fleet_fp = hashlib.blake2b(digest_size=16)  # routes and device matches: the same in every run
    t0 = time.perf_counter()
    prefix = bs.key(f"trace-{run}")
    engines = []
    # The host tier (one per engine: the worker makes it in front of the shared store) charges each
    # object at the real model's size, not the simulator's tiny pages.
    tier_kw = {"host_weigh": counter.weigh} if cfg.fleet.host_cache_tokens else {}
    for i in range(cfg.fleet.clusters):
        store: Any = SharedStore(counter)
        engines.append(
            SimEngine(
                _sim_model(cfg),
                SimCacheConfig(tokens_per_block=tpb, max_seq_len=max_len, audit=cfg.audit, slot_padding=0, seed=1),
                _leader_class(sizing),
                S3KvConnectorWorker,
                max_batch=1,
                chunk_size=cfg.chunk_tokens,
                # One namespace for every engine (they share what they store); one engine key each.
                connector_kwargs=dict(settings=settings, store=store, key_prefix=prefix, engine_key=f"trace-{run}-{i}",
                                      **tier_kw),
            )
        )
    fleet.engines = engines
    stalls: list[Any] = []  # LookupRecord of every lookup, every engine
    last_seq = [-1] * len(engines)
    with contextlib.ExitStack() as stack:
        for engine in engines:
            stack.enter_context(engine)
            # The engine's key index believes a HEAD for index_ttl_s and a miss for negative_ttl_s: on
            # the trace's clock, as gc's cutoff assumes (expiry_age_s) -- on the wall clock a replay
            # that runs hours of traffic in a minute would promise objects the billed store expired.
            engine.leader.core.index._clock = lambda: counter.now
            engine.leader.core._lookups.listings.wall = lambda: counter.now  # what HEADs' dates are read against
            engine.leader.core.writes.clock = lambda: counter.now  # the value policy's lags and half-life
        counter.bind(engines[0].workers[0].core.geometry, sizing)
        counter.checkpoint_blocks = engines[0].leader.core.policy.checkpoint_blocks
        t_first = reqs[0].timestamp_ms
        step = max(1, len(reqs) // 10)
        for r in reqs:
            a = conts.get(r.index)
            if a is not None:
                hist = history[a]
                prompt = synth.prompt(r, hist, reqs[a].full_blocks(block_tokens) * block_tokens)
            else:
                prompt = synth.prompt(r)
            n_out = answer_tokens(cfg, r, r.index in continued)
            plen = len(prompt)
            now = (r.timestamp_ms - t_first) / 1000
            counter.now = now
            counter.prompt_blocks = plen // tpb
            chain = block_chain(prompt, tpb, plen // tpb)
            e, d = fleet.route(now, chain, plen, r.output_length)
            engine = engines[e]
            spec = _spec_class()(r.index, tuple(prompt), max_new_tokens=n_out, device_match_tokens=d)
            rep = engine.run([spec])
            for w in engine.workers:
                w.flush(120)
                if w.core.host_tier is not None:  # what it evicted and owes S3 lands before the next request
                    w.core.host_tier.flush_write_backs(120)
            rr = rep.requests[0]
            recent = engine.leader.core.stats.recent_lookups
            stalls += [x for x in recent if x.seq > last_seq[e]]
            if recent:
                last_seq[e] = max(last_seq[e], max(x.seq for x in recent))
            served.append(rr.matched_tokens)
            device.append(d)
            engine_of.append(e)
            s3_served.append(min(rr.matched_tokens, counter.full_pages_now * tpb))
            counter.credit(rr.matched_tokens)
            totals["kv_mismatches"] += rep.kv_mismatches
            totals["pages_checked"] += rep.pages_checked
            totals["guard_violations"] += rep.guard_violations
            generated += n_out
            not_generated += r.output_length - n_out
            out = list(rr.output_tokens)
            fingerprint.update(array("i", prompt + out).tobytes())
            fleet_fp.update(b"%d:%d;" % (e, d))
            if r.index in continued:
                history[r.index] = prompt[r.full_blocks(block_tokens) * block_tokens :] + out
            if oracle is not None:
                oracle.add(prompt, out)
            if fleet.device_tokens:
                # What the engine keeps: every block of prompt + answer whose KV exists; the blocks of
                # an answer the replay did not generate are unique (never re-read) but take room.
                kv_len = plen + r.output_length - 1
                have = (plen + len(out) - 1) // tpb
                kv_chain = chain + block_chain(prompt + out, tpb, have, chain[-1] if chain else b"", len(chain))
                kv_chain += [b"u%d/%d" % (r.index, k) for k in range(have, kv_len // tpb)]
                fleet.finish(e, kv_chain, plen, kv_len)
            if (r.index + 1) % step == 0:
                progress(
                    f"trace: {run}: {r.index + 1}/{len(reqs)} requests, {sum(device) / 1e6:.2f}M tokens from "
                    f"device caches, {sum(served) / 1e6:.2f}M served by s3kv, {time.perf_counter() - t0:.0f} s"
                )
        for hook in fleet.on_clock:  # what gc learns next from the last reads decides the objects' end
            if hasattr(hook, "flush"):
                hook.flush(fleet)
        counter.finish()
        lstats = [engine.leader.core.stats for engine in engines]
        tiers = [w.core.host_tier.stats() for engine in engines for w in engine.workers if w.core.host_tier]
        wstats = [w.core.stats() for engine in engines for w in engine.workers]
    wall = time.perf_counter() - t0
    io = bs.store.snapshot() - before
    bs.delete_prefix(prefix + "/")
    ls = _sum_stats(lstats, (
        "lookups", "lookup_waves", "hits", "promises_broken", "offers_exposed", "offers_cut", "tokens_cut",
        "branch_tails", "branch_tail_pages",
    ))
    return {
        "run": run,
        "storage_policy": policy,
        "branch_tails": branch,
        "served_per_request": served,
        "served_tokens": sum(served),
        "device_per_request": device,
        "s3_per_request": s3_served,
        "engine_per_request": engine_of,
        "fleet": fleet.describe(),
        "host_tier": _tier_summary(tiers, host_cache_gb(cfg)),
        # What each engine's value policy believes at the end (its estimates per kind, and its decisions).
        "value_model": [engine.leader.core.writes.model.snapshot() for engine in engines],
        "retention_learnt": _learnt(fleet, [engine.leader.core.writes.model for engine in engines]),
        "fleet_fingerprint": fleet_fp.hexdigest(),
        **totals,
        "load_failures": sum(s.loads_failed_objects for s in wstats),
        "saves_dropped": sum(s.saves_dropped for s in wstats),
        "lookups": ls["lookups"],
        "lookup_waves": ls["lookup_waves"],
        "hits": ls["hits"],
        "promises_broken": ls["promises_broken"],
        # Offers a failed grow would break (pressure.py), and what the guard cut (all of them under
        # --set offer_guard=always: the price of memory pressure that never lets up).
        "offers_exposed": ls["offers_exposed"],
        "offers_cut": ls["offers_cut"],
        "tokens_cut": ls["tokens_cut"],
        "branch_tails_stored": ls["branch_tails"],
        "branch_tail_pages": ls["branch_tail_pages"],
        "requests_sim": {"head": io.head, "put": io.put, "get": io.get},
        "requests_real": {"head": counter.heads, "put": counter.real_put, "get": counter.real_get},
        "refreshes": counter.refreshes,
        "get_requests_by_split_mib": counter.get_by_split,
        "expired_objects": counter.expired,
        "gc_period_s": counter.gc_period_s,
        "storage_gib_hours": rnd(counter.byte_seconds / 2**30 / 3600, 1),
        "storage_usd": counter.storage_usd(cfg.prices.gb_month),
        "unread_write_usd": counter.hindsight_usd(cfg.prices.put_per_1k, cfg.prices.gb_month),
        "by_kind": counter.kinds,
        "stored_by_group": {
            g: {**v, "distinct_pages": len(counter.distinct.get(g, ()))} for g, v in sorted(counter.groups.items())
        },
        "generated_tokens": generated,
        "answer_tokens_not_replayed": not_generated,
        "tokens_fingerprint": fingerprint.hexdigest(),
        "lookup_stall": stall_summary(stalls, sum(served), decode_forward_s(cfg.model)),
        "wall_s": rnd(wall, 1),
    }


def _learnt(fleet: Fleet, models: Sequence[Any]) -> dict[str, Any] | None:
    """What gc learnt of the retention over the replay (``s3kv.core.retention``): its last choice,
    its range, how often it changed, and the ghost reads the engines reported (lookups that missed
    an own object gc had deleted); None where it did not learn."""
    from .indexhook import ReplayIndex

    hook = next((h for h in fleet.on_clock if isinstance(h, ReplayIndex) and h.learn), None)
    if hook is None or hook.learn is None or not hook.retention_s:
        return None
    rs = [r for _, r in hook.retention_s]
    return {"retention_s": rs[-1], "min_s": min(rs), "max_s": max(rs), "ceiling_s": hook.learn[0],
            "changes": sum(a != b for a, b in zip(rs, rs[1:], strict=False)),
            "ghost_reads": sum(m.ghosts for m in models)}


def _tier_summary(tiers: Sequence[Any], gib: float) -> dict[str, Any] | None:
    """The engines' host tiers together (``HostTierStats``; sizes at the real model's bytes)."""
    if not tiers:
        return None
    names = ("inserted", "evicted", "hits", "write_backs", "write_back_failed", "too_big", "no_room", "failed",
             "promoted_read", "promoted_unread")
    return {
        "gib_per_engine": rnd(gib, 2),
        "high_water_gib": rnd(max(t.high_water for t in tiers) / 2**30, 2),
        "over_capacity": any(t.high_water > t.capacity for t in tiers),
        **{n: sum(getattr(t, n) for t in tiers) for n in names},
    }


def stall_summary(records: Sequence[Any], served_tokens: int, hidden_s: float = 0.0) -> dict[str, Any]:
    """What the lookups held the scheduler: per lookup (p50, p99, max, ms), per token served
    (microseconds), and how the lookups ended. ``hidden_s``: what the overlap loop hides of each
    (one decode forward, ``fleet.decode_forward_s``); the rest is GPU time lost -- the whole batch
    waits -- and the inter-token latency it adds to every co-running request (p50/p99 over lookups)."""
    import statistics

    ms = sorted(x.stall_s * 1e3 for x in records)
    added = sorted(max(0.0, x.stall_s - hidden_s) * 1e3 for x in records)
    decisions: dict[str, int] = {}
    for x in records:
        decisions[x.decision] = decisions.get(x.decision, 0) + 1

    return {
        "lookups": len(ms),
        "p50_ms": rnd(statistics.median(ms), 2) if ms else 0.0,
        "p99_ms": rnd(pct(ms, 0.99), 2),
        "max_ms": rnd(ms[-1], 2) if ms else 0.0,
        "total_s": rnd(sum(ms) / 1e3, 3),
        "us_per_token_served": rnd(sum(ms) * 1e3 / served_tokens, 3) if served_tokens else None,
        "decisions": decisions,
        "hidden_ms": rnd(hidden_s * 1e3, 2),
        "lost_s": rnd(sum(added) / 1e3, 4),
        "itl_added_p50_ms": rnd(statistics.median(added), 2) if added else 0.0,
        "itl_added_p99_ms": rnd(pct(added, 0.99), 2),
    }
