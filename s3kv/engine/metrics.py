"""Prometheus metrics for one connector instance (one engine, one rank) in its own registry.

Nothing here touches prometheus_client's global default registry: several engines, ranks of a
simulator, or tests in one process each own a :class:`Metrics` and never collide. Export with
:func:`start_http_server`, or read values with :meth:`Metrics.snapshot` /
:meth:`Metrics.value`.

Feeding it:

* store traffic: wrap the store in :class:`MetricsStore` (requests, bytes, latency, errors);
* the circuit breaker: ``CircuitBreakerStore(..., on_transition=metrics.on_breaker_transition)``;
* leader and worker: their stats objects hold cumulative counters; call
  :meth:`Metrics.observe_leader` / :meth:`Metrics.observe_worker` now and then (each scrape, each
  iteration - it is cheap) and the deltas since the last call are added to the counters;
* prompt tokens: the leader stats' cumulative ``prompt_tokens`` field, so that
  ``hit_tokens_total / prompt_tokens_total`` is the share of prompt tokens served from the store.

Export: :func:`serve_for_rank` serves rank ``r`` of a tensor-parallel engine on ``port + r``
(each rank is its own process with its own registry), bound to 127.0.0.1 unless told otherwise.
:func:`read_endpoint` and :func:`figures` turn a scrape back into the few numbers a person asks
for (examples/trtllm_vswa.py prints them).

Metric names (all prefixed ``s3kv_``)::

    lookups_total, lookup_hits_total, lookup_misses_total, lookup_errors_total,
    lookup_waves_total, lookup_not_cacheable_total, lora_unidentified_total, hit_tokens_total, hit_blocks_total{group},
    lookup_timeouts_total, lookup_busy_total, lookups_finished_late_total,
    lookup_cpu_seconds_total, lookup_hash_cpu_seconds_total, prompt_tokens_total, rank_info{rank,tp_size}
    lookup_stall_seconds{decision} (histogram: what each lookup held the scheduler),
    lookup_budget_seconds (histogram), lookup_saveable_tokens_total{decision},
    lookup_decisions_total{decision}  (hit, miss, ran_out, busy, error, skipped, not_worth), warm_up_seconds
    lookup_unhidden_stall_seconds_total, lookup_added_latency_seconds_total,
    lookup_added_itl_seconds (histogram: the inter-token latency one lookup added to each co-running request),
    lookup_listed_total{source} (index, list), lookup_trusted_hits_total, listing_trust_lost_total,
    lookup_old_objects_total
    store_requests_total{op}, store_bytes_total{op,direction}, store_request_seconds{op},
    store_retries_total{op}, store_errors_total{op,type}
    breaker_state (0 closed, 1 half-open, 2 open), breaker_transitions_total{from_state,to_state}
    saves_dropped_total{reason}  (staging_full, store_error, breaker_open, other)
    staging_bytes_in_use, staging_capacity_bytes, staging_high_water_bytes
    pages_staged_total, objects_saved_total, saved_bytes_total, objects_already_present_total,
    objects_loaded_total, pages_loaded_total, loaded_bytes_total, load_failures_total,
    objects_rejected_total{reason}  (foreign, corrupt)
    tier_loads_total{tier}, tier_loaded_bytes_total{tier}  (host, s3: where each object load came from)
    host_tier_bytes, host_tier_capacity_bytes, host_tier_objects, host_tier_register_seconds,
    host_tier_events_total{event}  (inserted, kept_from_s3, evicted, write_back, write_back_failed,
    divergence, bad, host_only_save)
    value_gpu_usd_total{kind}, value_s3_usd_total{kind,part}, value_tokens_total{kind},
    value_reads_total{kind}, value_objects_total{kind}, value_decisions_total{kind,decision},
    value_reads_per_write{kind}, value_marginal_share{kind}, value_s3_share{kind}, value_fleet_writes{kind}, prefill_tokens_per_second
      (the value line: what each kind of object saved and cost, s3kv.core.value; kind is chain,
      checkpoint, prompt-end, history-end or branch; value_line() adds the lookups' HEADs)

Why this is one module: every metric name is defined once here; the exporter, the store wrapper that
feeds it and the reader that parses an endpoint must agree on each name.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import start_http_server as _prom_start_http_server
from prometheus_client.parser import text_string_to_metric_families

from ..core.errors import PARK_CAUSES
from ..core.value import LAG_BINS, lag_bin, lag_bin_edge
from ..store.base import (
    Buffer,
    ByteRange,
    Fetched,
    HeadBatch,
    ObjectInfo,
    ObjectStore,
    SpanExpect,
    StoreError,
    StoreWrapper,
    total_size,
)
from ..store.retrying import retries_by_op

_T = TypeVar("_T")

PREFIX = "s3kv"
#: Where the metrics server binds unless told otherwise: metrics name buckets and key prefixes,
#: so they are not for the whole network by default (``S3KV_METRICS_ADDR`` opens them up).
DEFAULT_ADDR = "127.0.0.1"
STORE_OPS = ("head", "put", "get", "delete", "list", "fetch")
DROP_REASONS = ("staging_full", "store_error", "breaker_open", "other")
REJECT_REASONS = ("foreign", "corrupt")
BREAKER_LEVELS = {"closed": 0, "half_open": 1, "open": 2}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Worker stats fields (``s3kv.engine.worker.WorkerStats``), by the metric they feed; a missing
# one is simply not observed.
_WORKER_COUNTERS = {
    "pages_staged": "pages_staged",
    "objects_saved": "objects_uploaded",
    "saved_bytes": "bytes_uploaded",
    "objects_already_present": "objects_already_present",
    "objects_loaded": "objects_loaded",
    "pages_loaded": "pages_loaded",
    "loaded_bytes": "bytes_loaded",
    "load_failures": "loads_failed_objects",
    "uploads_dropped_at_exit": "uploads_dropped_at_exit",
    "verdicts_unshared": "verdicts_unshared",
}
# ... and by the gauge they set.
_WORKER_GAUGES = {
    "parked_requests": "parked_now",
    "staging_in_use": "staging_in_use",
    "staging_capacity": "staging_capacity",
    "staging_high_water": "staging_high_water",
    "host_tier_bytes": "host_used",
    "host_tier_capacity": "host_capacity",
    "host_tier_objects": "host_objects",
    "host_tier_register": "host_register_s",
}
_WORKER_DROPS = {
    "staging_full": "saves_dropped_staging_full",
    "store_error": "saves_dropped_store_error",
    "breaker_open": "saves_dropped_breaker_open",
    "other": "saves_dropped_other",  # e.g. an unexpected exception on an upload thread
}


def _field(stats: Any, name: str) -> Any:
    if isinstance(stats, Mapping):
        return stats.get(name)
    return getattr(stats, name, None)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _num(stats: Any, name: str) -> float | None:
    return _number(_field(stats, name))


def _mapping(stats: Any, name: str) -> Mapping[Any, Any]:
    v = _field(stats, name)
    return v if isinstance(v, Mapping) else {}


def _state_name(state: Any) -> str:
    name = str(getattr(state, "value", state)).lower().replace("-", "_")
    if name not in BREAKER_LEVELS:
        raise ValueError(f"unknown breaker state {state!r}")
    return name


class Metrics:
    """All s3kv metrics, in a registry owned by this object."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}

        # -- leader / lookups ----------------------------------------------------------
        self.lookups = Counter(f"{p}_lookups", "Lookups (requests asked about).", registry=r)
        self.lookup_stall = Histogram(
            f"{p}_lookup_stall_seconds",
            "Wall time one lookup held the scheduler (hashing included), by how it ended.",
            ["decision"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lookup_budget = Histogram(
            f"{p}_lookup_budget_seconds",
            "Time budget of one lookup: a share of the prefill its best hit saves, within the cap.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lookup_saveable = Counter(
            f"{p}_lookup_saveable_tokens",
            "Prompt tokens the lookups' best possible hits would have saved, by how each ended.",
            ["decision"],
            registry=r,
        )
        # -- the value line (s3kv.core.value) -------------------------------------------
        self.value_gpu_usd = Counter(
            f"{p}_value_gpu_usd",
            "Prefill GPU dollars hits saved (tokens past the device match, at the one prefill figure), by the "
            "kind of object that ended the hit.",
            ["kind"],
            registry=r,
        )
        self.value_s3_usd = Counter(
            f"{p}_value_s3_usd",
            "S3 dollars by kind of object: PUT-class requests and storage for its billed life as written "
            "(part put, storage), GETs as read (get).",
            ["kind", "part"],
            registry=r,
        )
        self.value_tokens = Counter(
            f"{p}_value_tokens", "Prompt tokens hits served past the device match, by kind of object that ended them.",
            ["kind"], registry=r,
        )
        self.value_reads = Counter(f"{p}_value_reads", "Hits, by kind of object that ended them.", ["kind"], registry=r)
        self.value_device_reuses = Counter(
            f"{p}_value_device_reuses",
            "Reuses of this engine's own boundaries its device cache served (no S3 read), by kind.", ["kind"],
            registry=r,
        )
        self.value_objects = Counter(f"{p}_value_objects", "Objects written to S3, by kind.", ["kind"], registry=r)
        self.value_read_lag = Counter(
            f"{p}_value_read_lag_reads", "S3 reads dated by the age of the object they read (own objects by "
            "their write, others' by the fleet index; ghost reads -- lookups that would have gone on to an "
            "object gc had deleted -- at its age), by the upper edge of its age bin in seconds: what "
            "the retention advice (s3kv stats --engine) weighs.", ["lag_le_s"], registry=r,
        )
        self.value_decisions = Counter(
            f"{p}_value_decisions", "The write policy's boundary decisions (write, explore, refuse), by kind.",
            ["kind", "decision"], registry=r,
        )
        self.value_reads_per_write = Gauge(
            f"{p}_value_reads_per_write", "The write policy's estimate of hits per boundary written, by kind.",
            ["kind"], registry=r,
        )
        self.value_marginal_share = Gauge(
            f"{p}_value_marginal_share",
            "The write policy's estimate of the share of a hit's history past the device match, by kind.",
            ["kind"], registry=r,
        )
        self.value_s3_share = Gauge(
            f"{p}_value_s3_share",
            "The write policy's estimate of the share of a kind's reuses S3 served (the rest the device did).",
            ["kind"], registry=r,
        )
        self.value_fleet_writes = Gauge(
            f"{p}_value_fleet_writes",
            "Boundaries of the kind the other engines wrote, as the fleet index pools them (decayed, matured).",
            ["kind"], registry=r,
        )
        self.prefill_tokens_per_second = Gauge(
            f"{p}_prefill_tokens_per_second",
            "The one prefill-speed figure: prompt tokens the engine prefills per second (s3kv.core.cost.Prefill).",
            registry=r,
        )
        self.lookup_decisions = Counter(
            f"{p}_lookup_decisions", "Lookups by how they ended (hit, miss, ran_out, busy, error, skipped, not_worth).",
            ["decision"], registry=r,
        )
        self._lookup_seq: dict[str, int] = {}
        # Stall priced as latency (engine/leader/pace.py).
        self.lookup_unhidden_stall = Counter(
            f"{p}_lookup_unhidden_stall_seconds",
            "Lookup stall beyond what the overlap loop hides, while other requests ran: GPU time lost.",
            registry=r,
        )
        self.lookup_added_latency = Counter(
            f"{p}_lookup_added_latency_seconds",
            "Inter-token latency lookups added to the requests running beside them, summed over them.",
            registry=r,
        )
        self.lookup_added_latency_each = Histogram(
            f"{p}_lookup_added_itl_seconds",
            "Inter-token latency one lookup added to each request running beside it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lookup_listed = Counter(
            f"{p}_lookup_listed", "Lookups answered from a listing of the namespace, by source (index, list).",
            ["source"], registry=r,
        )
        self.lookup_trusted_hits = Counter(
            f"{p}_lookup_trusted_hits", "Hits a trusted listing vouched for (no request).", registry=r
        )
        self.lookup_old_objects = Counter(
            f"{p}_lookup_old_objects",
            "Objects a HEAD found older than gc must keep them (served to the lookup that asked, not remembered).", registry=r
        )
        self.listing_trust_lost = Counter(
            f"{p}_listing_trust_lost",
            "Failed loads of objects a trusted listing vouched for (its hits are verified again).",
            registry=r,
        )
        self.warm_up_seconds = Gauge(
            f"{p}_warm_up_seconds",
            "Seconds the store client's warm-up took at layout registration (helpers, connections).",
            registry=r,
        )
        self.hits = Counter(f"{p}_lookup_hits", "Lookups that found servable KV.", registry=r)
        self.misses = Counter(f"{p}_lookup_misses", "Lookups that found nothing servable.", registry=r)
        self.lookup_errors = Counter(
            f"{p}_lookup_errors", "Lookups that met a store error (answered as a miss).", registry=r
        )
        self.lookup_waves = Counter(f"{p}_lookup_waves", "Batched HEAD waves sent by lookups.", registry=r)
        self.lookup_timeouts = Counter(
            f"{p}_lookup_timeouts",
            "Lookups that ran out of their budget (a miss; finished in the background when the backlog allows).",
            registry=r,
        )
        self.lookup_busy = Counter(
            f"{p}_lookup_busy",
            "Lookups answered 'miss' at once because earlier timed-out waves still ran (the backlog bound).",
            registry=r,
        )
        self.lookups_finished_late = Counter(
            f"{p}_lookups_finished_late",
            "Timed-out lookups finished in the background, warming the index for the next of that prefix.",
            registry=r,
        )
        self.lookup_cpu = Counter(
            f"{p}_lookup_cpu_seconds",
            "CPU time lookups took on the calling (scheduler) thread, hashing the prompt included.",
            registry=r,
        )
        self.lookup_hash_cpu = Counter(
            f"{p}_lookup_hash_cpu_seconds",
            "Of lookup_cpu_seconds: hashing the prompts' block chains.",
            registry=r,
        )
        self.not_cacheable = Counter(
            f"{p}_lookup_not_cacheable", "Requests whose KV cannot be keyed (skipped).", registry=r
        )
        self.lora_unidentified = Counter(
            f"{p}_lora_unidentified",
            "LoRA requests whose adapter identity could not be established (neither served nor saved).",
            registry=r,
        )
        self.hit_tokens = Counter(f"{p}_hit_tokens", "Prompt tokens served from the store.", registry=r)
        self.saved_tokens = Counter(f"{p}_saved_tokens", "Tokens whose KV was saved to the store.", registry=r)
        self.requests_freed_silently = Counter(
            f"{p}_requests_freed_silently",
            "Requests the engine freed with no connector call (a page of theirs went to another request).",
            registry=r,
        )
        self.finished_after_release = Counter(
            f"{p}_requests_finished_after_release",
            "Requests told finished after the engine freed their pages (a failed forward, a cancel in "
            "flight): nothing more of them is saved.",
            registry=r,
        )
        self.finish_plans_dropped = Counter(
            f"{p}_finish_plans_dropped",
            "Finish plans dropped, never run: the engine listed fewer pages at request_finished than the "
            "plan copies (its sliding-window page rule differs from s3kv's).",
            registry=r,
        )
        self.branch_tails = Counter(
            f"{p}_branch_tails", "Sliding-window tails stored at a branch point a lookup found.", registry=r
        )
        self.offers_exposed = Counter(
            f"{p}_offers_exposed",
            "Offers a failed allocation grow (KV memory pressure) would cut to a point no stored tail "
            "serves: a broken promise if the grow fails (engine/leader/pressure.py).",
            registry=r,
        )
        self.offers_cut = Counter(
            f"{p}_offers_cut",
            "Exposed offers cut to a point inside the request's first chunk while the engine showed "
            "KV memory pressure (S3KV_OFFER_GUARD).",
            registry=r,
        )
        self.tokens_cut = Counter(
            f"{p}_offer_tokens_cut", "Tokens those cuts left to prefill instead of loading.", registry=r
        )
        self.billed_requests = Counter(
            f"{p}_billed_requests",
            "S3 requests as S3 bills them (multipart parts, split ranged GETs), by op; with HEADs from "
            "store_requests_total they price the traffic (see docs/sizing.md).",
            ["op"],
            registry=r,
        )
        self.refreshes = Counter(
            f"{p}_refresh",
            "Refreshes on hit (self-copies that keep a loaded object young under s3kv gc), by outcome.",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens",
            "Prompt tokens of the requests looked up (the denominator of the share served from the store).",
            registry=r,
        )
        self.rank_info = Gauge(
            f"{p}_rank_info", "1 for the tensor-parallel rank this endpoint belongs to.", ["rank", "tp_size"],
            registry=r,
        )
        self.hit_blocks = Counter(
            f"{p}_hit_blocks", "Blocks a hit needed from each layer group.", ["group"], registry=r
        )

        # -- store traffic -------------------------------------------------------------
        self.store_requests = Counter(
            f"{p}_store_requests",
            "Store requests (HEAD keys, GET ranges, PUTs, DELETE keys, LIST calls).",
            ["op"],
            registry=r,
        )
        self.store_bytes = Counter(
            f"{p}_store_bytes",
            "Bytes moved to (up) and from (down) the store.",
            ["op", "direction"],
            registry=r,
        )
        self.store_latency = Histogram(
            f"{p}_store_request_seconds",
            "Latency of one store call (a HEAD batch is one call).",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.store_retries = Counter(f"{p}_store_retries", "Store request retries.", ["op"], registry=r)
        self.store_errors = Counter(
            f"{p}_store_errors",
            "Store calls (HEAD: keys) that ended in an error, by error type.",
            ["op", "type"],
            registry=r,
        )

        # -- lookup helper processes (s3kv/store/headprocs.py) --------------------------
        self.head_helpers_ready = Gauge(
            f"{p}_lookup_helpers_ready", "HEAD helper processes ready now (0 with none configured).", registry=r
        )
        self.head_helper_starts = Counter(
            f"{p}_lookup_helper_starts", "HEAD helper processes started (restarts included).", registry=r
        )
        self.head_helper_shares = Counter(
            f"{p}_lookup_helper_shares", "Shares of HEAD waves sent to helper processes.", registry=r
        )
        self.head_helper_cpu = Counter(
            f"{p}_lookup_helper_cpu_seconds", "CPU time of the HEAD helper processes.", registry=r
        )

        # -- breaker -------------------------------------------------------------------
        self.breaker_state = Gauge(
            f"{p}_breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.", registry=r
        )
        self.breaker_transitions = Counter(
            f"{p}_breaker_transitions",
            "Circuit breaker state changes.",
            ["from_state", "to_state"],
            registry=r,
        )

        # -- worker --------------------------------------------------------------------
        self.saves_dropped = Counter(
            f"{p}_saves_dropped", "Saves given up (best effort), by reason.", ["reason"], registry=r
        )
        self.staging_in_use = Gauge(f"{p}_staging_bytes_in_use", "Host staging bytes held now.", registry=r)
        self.staging_capacity = Gauge(f"{p}_staging_capacity_bytes", "Host staging pool size.", registry=r)
        self.staging_high_water = Gauge(
            f"{p}_staging_high_water_bytes", "Most host staging bytes held at once.", registry=r
        )
        self.pages_staged = Counter(f"{p}_pages_staged", "Pages copied to staging for saving.", registry=r)
        self.objects_saved = Counter(f"{p}_objects_saved", "Objects written to the store.", registry=r)
        self.saved_bytes = Counter(f"{p}_saved_bytes", "Object bytes written to the store.", registry=r)
        self.objects_already_present = Counter(
            f"{p}_objects_already_present", "Saves that found the object already written.", registry=r
        )
        self.objects_loaded = Counter(f"{p}_objects_loaded", "Objects read and verified.", registry=r)
        self.pages_loaded = Counter(f"{p}_pages_loaded", "Pages loaded into the KV cache.", registry=r)
        self.loaded_bytes = Counter(f"{p}_loaded_bytes", "Page bytes loaded into the KV cache.", registry=r)
        self.load_failures = Counter(f"{p}_load_failures", "Promised loads that failed.", registry=r)
        self.failed_load_rungs = Counter(
            f"{p}_failed_load_rungs",
            "Requests whose promised load failed, by the outcome taken (docs/failures.md): "
            "engine_recompute (the engine's failed-load path ends the request: recomputed or failed), "
            "parked_retry (parked while retried).",
            ["rung"],
            registry=r,
        )
        self.parked_loads_ended = Counter(
            f"{p}_parked_loads_ended",
            "Parked (retried) loads that ended: recovered (served from the store) or cancelled.",
            ["outcome"],
            registry=r,
        )
        self.parked_by_cause = Counter(
            f"{p}_parked_requests_by_cause",
            "Requests that parked while their failed load is retried (no failed-load path), by cause: "
            "broken_promise (the engine honoured a point no stored object serves), missing, corrupt, "
            "unusable, timeout, store_error.",
            ["cause"],
            registry=r,
        )
        self.parked_requests = Gauge(
            f"{p}_parked_requests", "Requests parked right now while their failed load is retried.", registry=r
        )
        self.uploads_dropped_at_exit = Counter(
            f"{p}_uploads_dropped_at_exit", "Uploads still queued when the exit drain ran out of time.", registry=r
        )
        self.verdicts_unshared = Counter(
            f"{p}_verdicts_unshared",
            "Verdicts a rank past 0 could not hand to the leader (its verdict directory is on another host).",
            registry=r,
        )
        self.objects_rejected = Counter(
            f"{p}_objects_rejected",
            "Objects refused on HEAD or load (foreign or corrupt).",
            ["reason"],
            registry=r,
        )

        # -- host tier (s3kv/transfer/hosttier.py) -----------------------------------------
        self.tier_loads = Counter(f"{p}_tier_loads", "Object loads by the tier that served them.", ["tier"],
                                  registry=r)
        self.tier_loaded_bytes = Counter(f"{p}_tier_loaded_bytes", "Page bytes loaded, by the tier that served them.",
                                         ["tier"], registry=r)
        self.host_tier_bytes = Gauge(f"{p}_host_tier_bytes", "Bytes the host tier holds (charged).", registry=r)
        self.host_tier_capacity = Gauge(f"{p}_host_tier_capacity_bytes", "Host tier size.", registry=r)
        self.host_tier_objects = Gauge(f"{p}_host_tier_objects", "Objects the host tier holds.", registry=r)
        self.host_tier_register = Gauge(f"{p}_host_tier_register_seconds",
                                        "Seconds allocating (and pinning) the host tier took.", registry=r)
        self.host_tier_events = Counter(
            f"{p}_host_tier_events", "Host tier events: inserted (a save), kept_from_s3 (a whole-object read), "
            "evicted, write_back (an evicted 'evict' object written to the store), write_back_failed, divergence "
            "(rank 0's tier held an object this rank's did not), bad (a copy that failed a check), "
            "host_only_save (a seal kept out of the store).", ["event"], registry=r)

        # Labelled series that should read 0 before anything happens.
        for op in STORE_OPS:
            self.store_requests.labels(op)
            self.store_retries.labels(op)
        for op, direction in (("put", "up"), ("get", "down")):
            self.store_bytes.labels(op, direction)
        for reason in DROP_REASONS:
            self.saves_dropped.labels(reason)
        for reason in REJECT_REASONS:
            self.objects_rejected.labels(reason)
        self.breaker_state.set(0)

    # -- direct recording --------------------------------------------------------------
    def record_request(
        self,
        op: str,
        seconds: float,
        *,
        requests: int = 1,
        bytes_up: int = 0,
        bytes_down: int = 0,
        errors: Mapping[str, int] | None = None,
    ) -> None:
        self.store_requests.labels(op).inc(requests)
        self.store_latency.labels(op).observe(seconds)
        if bytes_up:
            self.store_bytes.labels(op, "up").inc(bytes_up)
        if bytes_down:
            self.store_bytes.labels(op, "down").inc(bytes_down)
        for etype, n in (errors or {}).items():
            self.store_errors.labels(op, etype).inc(n)

    def set_rank(self, rank: int, tp_size: int) -> None:
        """Label this registry's endpoint with its tensor-parallel rank (``s3kv_rank_info``)."""
        self.rank_info.labels(str(rank), str(tp_size)).set(1)

    def on_breaker_transition(self, old: Any, new: Any) -> None:
        """A ``CircuitBreakerStore(on_transition=...)`` callback."""
        o, n = _state_name(old), _state_name(new)
        self.breaker_state.set(BREAKER_LEVELS[n])
        self.breaker_transitions.labels(o, n).inc()

    def on_refresh(self, outcome: str) -> None:
        """A ``RefreshOnHit(on_outcome=...)`` callback."""
        self.refreshes.labels(outcome).inc()

    # -- cumulative stats -> counters ---------------------------------------------------
    def _delta(self, source: str, name: str, value: float) -> float:
        """Increase of a cumulative value since the last observation (a reset counts from 0)."""
        key = (source, name)
        with self._lock:
            last = self._last.get(key, 0.0)
            self._last[key] = value
        return value - last if value >= last else value

    def _feed(self, counter: Any, source: str, name: str, value: float | None) -> None:
        if value is None:
            return
        d = self._delta(source, name, value)
        if d > 0:
            counter.inc(d)

    def observe_leader(self, stats: Any, source: str = "leader") -> None:
        """Copy a :class:`s3kv.engine.leader.LeaderStats` (or any object / mapping with those fields)."""
        for metric, name in (
            (self.lookups, "lookups"),
            (self.hits, "hits"),
            (self.misses, "misses"),
            (self.lookup_errors, "lookup_errors"),
            (self.lookup_waves, "lookup_waves"),
            (self.lookup_timeouts, "lookup_timeouts"),
            (self.lookup_busy, "lookup_busy"),
            (self.lookups_finished_late, "lookups_finished_late"),
            (self.lookup_cpu, "lookup_cpu_s"),
            (self.lookup_hash_cpu, "lookup_hash_cpu_s"),
            (self.not_cacheable, "not_cacheable"),
            (self.lora_unidentified, "lora_unidentified"),
            (self.hit_tokens, "hit_tokens"),
            (self.prompt_tokens, "prompt_tokens"),
            (self.saved_tokens, "tokens_saved"),
            (self.branch_tails, "branch_tails"),
            (self.offers_exposed, "offers_exposed"),
            (self.offers_cut, "offers_cut"),
            (self.tokens_cut, "tokens_cut"),
            (self.requests_freed_silently, "requests_freed_silently"),
            (self.finished_after_release, "finished_after_release"),
            (self.finish_plans_dropped, "finish_plan_mismatches"),
            (self.lookup_unhidden_stall, "lookup_unhidden_stall_s"),
            (self.lookup_added_latency, "lookup_added_latency_s"),
            (self.lookup_trusted_hits, "lookup_trusted_hits"),
            (self.lookup_old_objects, "old_objects"),
            (self.listing_trust_lost, "listing_trust_lost"),
        ):
            self._feed(metric, source, name, _num(stats, name))
        self._feed(self.objects_rejected.labels("foreign"), source, "foreign_objects", _num(stats, "foreign_objects"))
        for src in ("index", "list"):
            self._feed(self.lookup_listed.labels(src), source, f"listed[{src}]", _num(stats, f"lookup_{src}_lookups"))
        for group, n in _mapping(stats, "hit_blocks_by_group").items():
            self._feed(self.hit_blocks.labels(str(group)), source, f"hit_blocks[{group}]", _number(n))
        self.observe_lookups(_field(stats, "recent_lookups") or (), source)
        self.observe_value(_mapping(stats, "value"), source)
        for b, n in enumerate(_field(stats, "value_lag_reads") or ()):
            edge = f"{lag_bin_edge(b):.0f}"
            self._feed(self.value_read_lag.labels(edge), source, f"value_lag[{edge}]", _number(n))
        tps = _num(stats, "prefill_tokens_per_s")
        if tps:
            self.prefill_tokens_per_second.set(tps)

    def observe_value(self, kinds: Mapping[str, Any], source: str = "leader") -> None:
        """The write policy's value line (``ValueModel.snapshot``: kind -> its figures)."""
        for kind, d in kinds.items():
            if not isinstance(d, Mapping):
                continue
            k = str(kind)

            def feed(counter: Any, name: str, _k: str = k, _d: Mapping[str, Any] = d) -> None:
                self._feed(counter, source, f"value[{_k}].{name}", _number(_d.get(name)))

            feed(self.value_gpu_usd.labels(k), "gpu_usd")
            for part in ("put", "storage", "get"):
                feed(self.value_s3_usd.labels(k, part), f"{part}_usd")
            feed(self.value_tokens.labels(k), "tokens")
            feed(self.value_reads.labels(k), "reads")
            feed(self.value_device_reuses.labels(k), "device_reads")
            feed(self.value_objects.labels(k), "objects")
            for decision, name in (("write", "written"), ("explore", "explored"), ("refuse", "refused")):
                feed(self.value_decisions.labels(k, decision), name)
            for gauge, name in ((self.value_reads_per_write, "reads_per_write"),
                                (self.value_marginal_share, "marginal_share"),
                                (self.value_s3_share, "s3_share"),
                                (self.value_fleet_writes, "fleet_writes")):
                v = _number(d.get(name))
                if v is not None:
                    gauge.labels(k).set(v)

    def observe_lookups(self, records: Any, source: str = "leader") -> None:
        """Each lookup record (``LeaderStats.recent_lookups``) not observed yet: its stall, budget,
        saveable tokens and decision. Records dropped from the bounded list between two calls are
        missed by the histograms and these counters alike (observe at least every few thousand
        lookups)."""
        with self._lock:
            last = self._lookup_seq.get(source, -1)
            new = [x for x in list(records) if x.seq > last]
            if new:
                self._lookup_seq[source] = new[-1].seq
        for x in new:
            self.lookup_stall.labels(x.decision).observe(x.stall_s)
            if x.budget_s != float("inf"):
                self.lookup_budget.observe(x.budget_s)
            self.lookup_saveable.labels(x.decision).inc(x.saveable_tokens)
            self.lookup_decisions.labels(x.decision).inc()
            if getattr(x, "corunning", 0):
                self.lookup_added_latency_each.observe(x.added_s)

    def observe_head_helpers(self, stats: Mapping[str, float]) -> None:
        """Copy :meth:`s3kv.store.headprocs.HeadHelpers.stats`."""
        self.head_helpers_ready.set(stats.get("ready", 0.0))
        self._feed(self.head_helper_starts, "helpers", "starts", _number(stats.get("starts")))
        self._feed(self.head_helper_shares, "helpers", "shares", _number(stats.get("shares")))
        self._feed(self.head_helper_cpu, "helpers", "cpu_s", _number(stats.get("cpu_s")))

    def observe_worker(self, stats: Any, source: str = "worker") -> None:
        """Copy a worker's cumulative stats (``WorkerStats``, or a mapping with its field names;
        every field is optional)."""
        for attr, name in _WORKER_COUNTERS.items():
            self._feed(getattr(self, attr), source, attr, _num(stats, name))
        for attr, name in _WORKER_GAUGES.items():
            v = _num(stats, name)
            if v is not None:
                getattr(self, attr).set(v)
        # Retries are counted once per process where every retry passes (``store.retrying``),
        # not per worker: one source, so workers sharing a process do not count them twice.
        for op, n in retries_by_op().items():
            if op in STORE_OPS:
                self._feed(self.store_retries.labels(op), "store", f"retries[{op}]", float(n))
        for reason, name in _WORKER_DROPS.items():
            self._feed(self.saves_dropped.labels(reason), source, f"drop[{reason}]", _num(stats, name))
        for label, name in (("engine_recompute", "rung_engine_recompute"), ("parked_retry", "rung_parked_retry")):
            self._feed(self.failed_load_rungs.labels(label), source, f"rung[{label}]", _num(stats, name))
        by_cause = _mapping(stats, "parked_by_cause")
        for label in PARK_CAUSES:
            self._feed(self.parked_by_cause.labels(label), source, f"park[{label}]", _number(by_cause.get(label, 0)))
        for label, name in (
            ("recovered", "parked_loads_recovered"),
            ("cancelled", "parked_loads_cancelled"),
            ("abandoned", "parked_loads_abandoned"),
        ):
            self._feed(self.parked_loads_ended.labels(label), source, f"parked[{label}]", _num(stats, name))
        # A load that found an object corrupt quarantines it (``loads._condemn``): a rejection.
        self._feed(self.objects_rejected.labels("corrupt"), source, "rejected[corrupt]",
                   _num(stats, "objects_quarantined"))
        for op, name in (("put", "put_requests"), ("get", "get_requests")):
            self._feed(self.billed_requests.labels(op), source, f"billed[{op}]", _num(stats, name))
        self._observe_host_tier(stats, source)

    def _observe_host_tier(self, stats: Any, source: str) -> None:
        host, loaded = _num(stats, "host_hits"), _num(stats, "objects_loaded")
        host_b, loaded_b = _num(stats, "host_hit_bytes"), _num(stats, "bytes_loaded")
        self._feed(self.tier_loads.labels("host"), source, "tier[host]", host)
        self._feed(self.tier_loaded_bytes.labels("host"), source, "tier_bytes[host]", host_b)
        if loaded is not None:
            self._feed(self.tier_loads.labels("s3"), source, "tier[s3]", loaded - (host or 0))
        if loaded_b is not None:
            self._feed(self.tier_loaded_bytes.labels("s3"), source, "tier_bytes[s3]", loaded_b - (host_b or 0))
        for event, name in (("inserted", "host_inserted"), ("kept_from_s3", "host_promoted"),
                            ("evicted", "host_evicted"), ("write_back", "host_write_backs"),
                            ("write_back_failed", "host_write_back_failed"), ("divergence", "host_divergence"),
                            ("bad", "host_bad"), ("host_only_save", "host_only_saves")):
            self._feed(self.host_tier_events.labels(event), source, f"host[{event}]", _num(stats, name))

    # -- reading -----------------------------------------------------------------------
    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 if it does not exist yet), e.g. ``value("s3kv_lookups_total")``."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def snapshot(self) -> dict[str, float]:
        """Every current sample as ``{'name{label="v",...}': value}`` (``*_created`` omitted)."""
        return _flatten(self.registry.collect())


def start_http_server(metrics: Metrics | CollectorRegistry, port: int, addr: str = DEFAULT_ADDR) -> Any:
    """Serve ``metrics``' registry on ``addr:port`` (port 0 picks a free one) from a daemon thread.

    Binds loopback by default. Returns the HTTP server (``.server_port``; ``.shutdown()`` stops it).
    """
    registry = metrics.registry if isinstance(metrics, Metrics) else metrics
    result = _prom_start_http_server(port, addr=addr, registry=registry)
    return result[0] if isinstance(result, tuple) else result


def rank_port(base_port: int, rank: int) -> int:
    """The port rank ``rank`` serves on: ``base_port + rank`` (0 stays 0: metrics off)."""
    if base_port <= 0:
        return 0
    port = base_port + rank
    if port > 65535:
        raise ValueError(f"S3KV_METRICS_PORT={base_port} + rank {rank} is past the last TCP port")
    return port


def serve_for_rank(
    metrics: Metrics, base_port: int, rank: int = 0, tp_size: int = 1, addr: str = DEFAULT_ADDR
) -> Any:
    """Serve one rank's metrics on ``base_port + rank`` (None when ``base_port`` is 0).

    Every rank of a tensor-parallel engine runs in its own process with its own registry, so each
    needs its own port; Prometheus scrapes them as separate targets and ``s3kv_rank_info`` says
    which rank a target is. Leader-side counters (lookups, hit and prompt tokens) come from the
    rank that hosts the scheduler (rank 0); worker counters (saves, loads, staging) from every rank.
    """
    port = rank_port(base_port, rank)
    if not port:
        return None
    metrics.set_rank(rank, tp_size)
    return start_http_server(metrics, port, addr)


def read_endpoint(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Scrape a metrics endpoint: ``{'name{label="v",...}': value}`` as :meth:`Metrics.snapshot`."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - an http:// URL we were given
        text = resp.read().decode()
    return parse_exposition(text)


def parse_exposition(text: str) -> dict[str, float]:
    return _flatten(text_string_to_metric_families(text))


def _flatten(families: Iterable[Any]) -> dict[str, float]:
    """Samples as ``{'name{label="v",...}': value}``, labels sorted, ``*_created`` omitted."""
    out: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if s.labels:
                inner = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{inner}}}"] = s.value
            else:
                out[s.name] = s.value
    return out


def figures(samples: Mapping[str, float]) -> dict[str, float]:
    """The numbers a person asks first, from a snapshot or a scrape: tokens served from the store
    (and their share of prompt tokens), bytes each way, store requests by operation, and what the
    host tier served and holds."""

    def total(name: str) -> float:
        return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))

    def by_label(name: str, label: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(name + "{") and label in k)

    def by_op(name: str, op: str) -> float:
        return by_label(name, f'op="{op}"')

    hit, prompt = total(f"{PREFIX}_hit_tokens_total"), total(f"{PREFIX}_prompt_tokens_total")
    out = {
        "hit_tokens": hit,
        "prompt_tokens": prompt,
        "hit_share": hit / prompt if prompt else 0.0,
        "loaded_bytes": total(f"{PREFIX}_loaded_bytes_total"),
        "saved_bytes": total(f"{PREFIX}_saved_bytes_total"),
        "objects_saved": total(f"{PREFIX}_objects_saved_total"),
        "objects_loaded": total(f"{PREFIX}_objects_loaded_total"),
        "saves_dropped": total(f"{PREFIX}_saves_dropped_total"),
        "load_failures": total(f"{PREFIX}_load_failures_total"),
        # Stall priced as latency: GPU time lost to lookups, latency added to the requests beside them.
        "lookups": total(f"{PREFIX}_lookups_total"),
        "lookup_stall_s": total(f"{PREFIX}_lookup_stall_seconds_sum"),
        "lookup_unhidden_stall_s": total(f"{PREFIX}_lookup_unhidden_stall_seconds_total"),
        "lookup_added_latency_s": total(f"{PREFIX}_lookup_added_latency_seconds_total"),
        "lookups_from_index": sum(v for k, v in samples.items()
                                  if k.startswith(f"{PREFIX}_lookup_listed_total{{") and 'source="index"' in k),
        "host_tier_loads": by_label(f"{PREFIX}_tier_loads_total", 'tier="host"'),
        "host_tier_loaded_bytes": by_label(f"{PREFIX}_tier_loaded_bytes_total", 'tier="host"'),
        "host_tier_bytes": total(f"{PREFIX}_host_tier_bytes"),
    }
    for op in STORE_OPS:
        out[f"{op}_requests"] = by_op(f"{PREFIX}_store_requests_total", op)
    return out


def value_line(samples: Mapping[str, float], head_usd_per_1k: float = 0.0004) -> dict[str, Any]:
    """The value line from a snapshot or scrapes (summed): per kind of object, the prefill GPU
    dollars its hits saved against the S3 dollars it was billed; the lookups' HEADs (from the
    store's request counter, at ``head_usd_per_1k``) as kind ``lookup``; and the ratio."""
    kinds: dict[str, dict[str, float]] = {}
    heads = 0.0
    lag = [0.0] * LAG_BINS  # dated reads (s3kv_value_read_lag_reads_total), summed
    for key, v in samples.items():
        name, _, rest = key.partition("{")
        labels = {a: b.strip('"') for a, _, b in (x.partition("=") for x in rest.rstrip("}").split(","))}
        if name == f"{PREFIX}_store_requests_total" and labels.get("op") == "head":
            heads += v
        if name == f"{PREFIX}_value_read_lag_reads_total" and "lag_le_s" in labels:
            # Back in ValueModel.lag_reads' bins: a bin's upper edge less one second lies inside it.
            lag[lag_bin(float(labels["lag_le_s"]) - 1)] += v
        kind = labels.get("kind", "")
        if not name.startswith(f"{PREFIX}_value_") or not kind:
            continue
        row = kinds.setdefault(kind, {"gpu_usd": 0.0, "s3_usd": 0.0, "tokens": 0.0, "reads": 0.0, "objects": 0.0})
        field = name[len(PREFIX) + 7:].removesuffix("_total")
        if field == "s3_usd":
            part = labels.get("part", "")
            row[f"{part}_usd"] = row.get(f"{part}_usd", 0.0) + v
            row["s3_usd"] += v
        elif field in ("gpu_usd", "tokens", "reads", "objects"):
            row[field] += v
    if heads:
        kinds["lookup"] = {"gpu_usd": 0.0, "s3_usd": heads * head_usd_per_1k / 1000, "tokens": 0.0, "reads": 0.0,
                           "objects": 0.0, "head_usd": heads * head_usd_per_1k / 1000, "heads": heads}
    gpu = sum(r["gpu_usd"] for r in kinds.values())
    s3 = sum(r["s3_usd"] for r in kinds.values())
    return {"kinds": kinds, "gpu_usd": gpu, "s3_usd": s3, "ratio": s3 / gpu if gpu > 0 else None,
            "lag_reads": lag}


class MetricsStore(StoreWrapper):
    """Times and counts every store call into a :class:`Metrics`.

    Counting unit as in :class:`s3kv.store.instrument.InstrumentedStore`: head counts keys,
    get counts ranges, put counts calls, delete counts keys, list counts calls. Latency is per
    call (a HEAD batch, a multi-range GET, a whole listing).
    """

    def __init__(
        self, inner: ObjectStore, metrics: Metrics, *, clock: Callable[[], float] = time.perf_counter
    ):
        super().__init__(inner)
        self.metrics = metrics
        self._clock = clock

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        return self._head(keys, self.inner.head_many)

    def head_many_checked(self, keys: Sequence[str], expect: Mapping[str, SpanExpect]) -> HeadBatch:
        return self._head(keys, lambda ks: self.inner.head_many_checked(ks, expect))

    def _head(self, keys: Sequence[str], call: Callable[[Sequence[str]], HeadBatch]) -> HeadBatch:
        t0 = self._clock()
        try:
            batch = call(keys)
        except StoreError as exc:
            self.metrics.record_request(
                "head", self._clock() - t0, requests=len(keys), errors={type(exc).__name__: len(keys)}
            )
            raise
        errors = collections.Counter(type(err).__name__ for err in batch.failed.values())
        self.metrics.record_request("head", self._clock() - t0, requests=len(keys), errors=errors)
        return batch

    def _timed(
        self,
        op: str,
        call: Callable[[], _T],
        *,
        requests: int = 1,
        bytes_up: int = 0,
        bytes_down: Callable[[_T], int] = lambda _: 0,
    ) -> _T:
        """``call()``, timed and counted as ``op``; a StoreError counts one error of its type."""
        t0 = self._clock()
        try:
            out = call()
        except StoreError as exc:
            self.metrics.record_request(
                op, self._clock() - t0, requests=requests, bytes_up=bytes_up, errors={type(exc).__name__: 1}
            )
            raise
        self.metrics.record_request(
            op, self._clock() - t0, requests=requests, bytes_up=bytes_up, bytes_down=bytes_down(out)
        )
        return out

    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        return self._timed("put", lambda: self.inner.put(key, data, metadata), bytes_up=total_size(data))

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        return self._timed("get", lambda: self.inner.get_ranges(key, ranges), requests=len(ranges),
                           bytes_down=lambda out: sum(len(b) for b in out))

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        self._timed("get", lambda: self.inner.get_ranges_into(key, ranges, out), requests=len(ranges),
                    bytes_down=lambda _: sum(r.length for r in ranges))

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        return self._timed("fetch", lambda: self.inner.get_if_changed(key, etag),
                           bytes_down=lambda got: len(got.data) if got else 0)

    def delete_many(self, keys: Sequence[str]) -> None:
        self._timed("delete", lambda: self.inner.delete_many(keys), requests=len(keys))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        t0 = self._clock()
        errors: dict[str, int] = {}
        try:
            yield from self.inner.list(prefix)
        except StoreError as exc:
            errors[type(exc).__name__] = 1
            raise
        finally:  # also when the caller stops early
            self.metrics.record_request("list", self._clock() - t0, errors=errors)
