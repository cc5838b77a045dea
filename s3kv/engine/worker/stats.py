"""The worker's counters, as one frozen snapshot: what it staged, uploaded, loaded, dropped, failed.

``s3kv.engine.metrics`` copies them into Prometheus, ``s3kv.core.cost`` weighs them into
requests and dollars per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class WorkerStats:
    pages_staged: int
    bytes_staged: int
    #: Seals handed to the upload threads.
    seals_submitted: int
    objects_uploaded: int
    bytes_uploaded: int
    #: put() answered "already exists" (another writer won): success, not uploaded by us.
    objects_already_present: int
    #: Object buffers that found no staging room (the save is dropped).
    saves_dropped_staging_full: int
    #: Stages skipped because their buffer was dropped.
    stages_dropped: int
    #: Seals ignored because their buffer was dropped.
    seals_dropped: int
    #: Uploads that failed after the store's retries.
    saves_dropped_store_error: int
    #: Uploads refused because the store's breaker was open.
    saves_dropped_breaker_open: int
    #: Everything else that dropped a save: full upload queue, incomplete seal, bad op.
    saves_dropped_other: int
    uploads_pending: int
    pages_loaded: int
    bytes_loaded: int
    objects_loaded: int
    loads_failed_objects: int
    requests_failed: int
    load_staging_fallbacks: int
    #: The staging pool (all 0 until there is one).
    staging_capacity: int = 0
    staging_in_use: int = 0
    staging_high_water: int = 0
    staging_drops: int = 0
    staging_pinned: bool = False
    #: Failed promised loads by rung (docs/failures.md), and how parked ones ended.
    rung_engine_recompute: int = 0
    rung_parked_retry: int = 0
    parked_loads_recovered: int = 0
    parked_loads_cancelled: int = 0
    #: Parked loads stopped because the engine gave their pages to another request (LeaderCore).
    parked_loads_abandoned: int = 0
    #: Requests parked right now while their load is retried (rung 3).
    parked_now: int = 0
    #: Requests that parked (rung 3) by why their load failed (``loads.PARK_CAUSES``).
    parked_by_cause: dict[str, int] = field(default_factory=dict)
    #: Requests the engine aborted through its failed-load path (``try_abort_request``).
    loads_aborted: int = 0
    load_retries: int = 0
    objects_quarantined: int = 0
    #: Objects a failed load never verified, read once in the background (released or kept).
    objects_audited: int = 0
    #: A rank past 0 that could not write its verdicts where the leader reads them (another
    #: host): its bad objects are promised again until the leader's index forgets them.
    verdicts_unshared: int = 0
    uploads_dropped_at_exit: int = 0
    #: S3 requests the saves and loads cost, as S3 bills them (s3kv/core/cost.py): PUT-class (a
    #: multipart upload is create + parts + complete) and GETs (long ranges split). HEADs are
    #: the lookups' (the store's request counters). For $ per token: ``cost.usage_from_stats``.
    put_requests: int = 0
    get_requests: int = 0
    #: The host tier (``s3kv.transfer.hosttier``; all 0 without one): its size and what it holds
    #: (bytes charged, objects; ghosts: accounted but never served here), ...
    host_capacity: int = 0
    host_used: int = 0
    host_high_water: int = 0
    host_objects: int = 0
    host_ghosts: int = 0
    host_pinned: bool = False
    #: ... whether its arena is ready (a pinned one is pinned in the background after registration:
    #: until then it holds nothing), the seconds that took, ...
    host_ready: bool = False
    host_register_s: float = 0.0
    #: ... loads it served (objects, page bytes) with no store request, objects read whole from
    #: the store into it, seals filled into it, evictions, ...
    host_hits: int = 0
    host_hit_bytes: int = 0
    host_promoted: int = 0
    #: ... loads that read only their pages: the extra GETs of a whole read outweighed the tier's
    #: read share of what it promoted (``HostTier.promotion_read_share``), ...
    host_promotions_declined: int = 0
    host_inserted: int = 0
    host_evicted: int = 0
    #: ... seals kept in the tier only (``to_s3`` evict/never), evicted ``evict`` objects written
    #: to the store (and the failures), ...
    host_only_saves: int = 0
    host_write_backs: int = 0
    host_write_back_failed: int = 0
    #: ... loads rank 0's tier served whose object this rank's tier lacked (read from the store
    #: instead), tier copies that failed a check (dropped), and seals meant for a host tier only on a
    #: rank without one, or whose tier had no bytes for them (not ready yet, too fragmented): dropped.
    host_divergence: int = 0
    host_bad: int = 0
    seals_dropped_no_tier: int = 0

    @property
    def saves_dropped(self) -> int:
        """Saves lost for any reason: the one sum every report prints, so none leaves a reason
        out (the demo's figure once omitted ``other``)."""
        return (self.saves_dropped_staging_full + self.saves_dropped_store_error
                + self.saves_dropped_breaker_open + self.saves_dropped_other)


#: Fields read from the staging pool's stats and the host tier's (their absence leaves the
#: field's default); every other field but those ``worker_stats`` sets is the counter of its name.
_FROM_POOL = {"staging_capacity": "capacity", "staging_in_use": "in_use", "staging_high_water": "high_water",
              "staging_drops": "drops", "staging_pinned": "pinned"}
_FROM_HOST = {"host_capacity": "capacity", "host_used": "used", "host_high_water": "high_water",
              "host_objects": "objects", "host_ghosts": "ghosts", "host_pinned": "pinned", "host_ready": "arena_ready",
              "host_register_s": "register_s", "host_evicted": "evicted"}


def worker_stats(
    c: Mapping[str, float], s: Any, *, uploads_pending: int, parked_now: int, host: Any = None
) -> WorkerStats:
    """The snapshot from the counters ``c``, the staging pool's stats ``s`` (None: no pool yet)
    and the host tier's (``HostTierStats``, None: no tier)."""
    snap: dict[str, Any] = {f.name: int(c.get(f.name, 0)) for f in fields(WorkerStats)
                            if f.name not in _FROM_POOL and f.name not in _FROM_HOST}
    for source, names in ((s, _FROM_POOL), (host, _FROM_HOST)):
        if source is not None:
            snap.update({name: getattr(source, attr) for name, attr in names.items()})
    snap.update(
        saves_dropped_other=snap["saves_dropped_other"] + int(c.get("saves_dropped_error", 0))
        + int(c.get("uploads_cancelled", 0)),
        uploads_pending=uploads_pending,
        parked_now=parked_now,
        parked_by_cause={k[len("parked_cause_"):]: int(v) for k, v in c.items() if k.startswith("parked_cause_")},
    )
    return WorkerStats(**snap)
