"""The worker side of s3kv: executes each iteration's plan on one rank.

``WorkerCore`` is engine-agnostic: the TensorRT-LLM adapter (``s3kv.trtllm``) and
the simulator call it with the connector's per-iteration order::

    bind(metadata) -> start_load_kv(stream) -> [wait_for_layer_load(i) ... save_kv_layer(i)]*
                   -> wait_for_save(stream) -> get_finished(finished_gen, started_loading)

Pages are addressed only through the layout's regions (``slot_tensor`` /
``as_tensor``); a page is its group's regions concatenated.

Saves (best effort, never an engine error, never a stall):
  ``wait_for_save`` runs the iteration's ``StageOp``s: it opens an object buffer
  in host staging on its first stage (``BufferId.capacity`` pages; no room ->
  the buffer is dropped and counted, its later stages and seals ignored and
  counted) and copies the pages device->host in one stream-ordered batch (see
  :mod:`s3kv.transfer.copies`). ``SealOp``s go to the upload threads with a
  reference on the buffer; ``close`` drops the plan's reference, so the bytes
  are freed after the last upload that reads them. Snapshots: a seal with
  ``close=False`` pins pages ``[0, count)`` — later stages of the same buffer go
  to higher pages (disjoint bytes, no race), and a re-stage of a pinned page is
  ignored (the chain digest names the same KV; the in-flight upload keeps the
  bytes it hashed). ``discard_ids`` drop a request's open buffers first (a
  replay may reuse the same ``BufferId``s in the same plan).

Loads (promised: verified bytes, or the least harmful outcome the engine allows):
  ``start_load_kv`` groups the plan's ``LoadOp``s by object and reads each on a
  download thread (header + wanted pages, verified in staging before any
  host->device copy). Sync requests are waited for inside ``start_load_kv``
  (downloads and verification); on CUDA their host->device copies overlap the
  first layers and the forward stream waits for a group's copies in
  ``wait_for_layer_load`` of that group's layers. Async requests
  (``metadata.async_load_ids``) are reported from ``get_finished`` once their
  pages are on the device. Nothing here ever raises into the engine. A load
  that fails after the store's retries is quarantined (the index remembers the
  object as missing, so later lookups miss) and then: rung 1, on engines with a
  failed-load hook, the id goes to ``take_failed_load_request_ids`` and the
  engine recomputes it; rung 3, otherwise, the request stays parked and its
  objects are re-read with backoff until the load succeeds or the request is
  cancelled (it arrives in ``finished_gen_req_ids``). Sync loads are planned
  only on engines with the hook. See docs/failures.md.

Finishing requests: ``metadata.finish_plans`` keep, per request, what to save
if it finishes after the current pass. When its id reaches ``get_finished``
(same iteration as ``request_finished``, possibly on an engine about to go
idle) the plan's pages are copied off the device, its objects sealed and
uploaded in the background, and the id is returned once those copies completed.

``get_finished`` hand-over state machine (per id, per hand-over): an id is
returned only after it was passed in, exactly once; a saving id as soon as every
stage copy of that request issued so far has completed (at once when nothing is
pending; at once on CPU), a loading id once all its pages are in place.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..core.errors import LoadFailed
from ..core.keys import KeyScheme, namespace_digest
from ..core.layout import CacheGeometry
from ..core.objects import ObjectIdentity
from ..core.plan import BufferId, ConnectorMetadata, FinishPlan, LoadOp, SealOp, StageOp
from ..store.base import ObjectStore
from ..transfer.copies import Copier, PageCopy
from ..transfer.counters import Counters, MetricsHook
from ..transfer.download import DONE, PENDING, Downloader, LoadJob, LoadPlanError, build_jobs
from ..transfer.staging import SAVE, StagingBuffer, StagingPool
from ..transfer.upload import Uploader, UploadJob
from .index import KeyIndex

log = logging.getLogger(__name__)


class LoadTimeout(Exception):
    """A promised load did not complete within ``settings.load_timeout_s``."""


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
    #: Everything else that dropped a save: full upload queue, incomplete seal, bad op.
    saves_dropped_other: int
    uploads_pending: int
    pages_loaded: int
    bytes_loaded: int
    objects_loaded: int
    loads_failed_objects: int
    requests_failed: int
    load_staging_fallbacks: int
    staging_capacity: int
    staging_in_use: int
    staging_high_water: int
    staging_drops: int
    staging_pinned: bool
    #: Failed promised loads by rung (docs/failures.md), and how parked ones ended.
    rung_engine_recompute: int = 0
    rung_parked_retry: int = 0
    parked_loads_recovered: int = 0
    parked_loads_cancelled: int = 0
    #: Requests parked right now while their load is retried (rung 3).
    parked_now: int = 0
    load_retries: int = 0
    objects_quarantined: int = 0
    uploads_dropped_at_exit: int = 0
    #: S3 requests the saves and loads cost, as S3 bills them (s3kv/cost.py): PUT-class (a
    #: multipart upload is create + parts + complete) and GETs (long ranges split). HEADs are
    #: the lookups' (the store's request counters). For $ per token: ``cost.usage_from_stats``.
    put_requests: int = 0
    get_requests: int = 0


@dataclass
class _OpenBuffer:
    bid: BufferId
    buf: StagingBuffer
    page_bytes: int
    staged: set[int] = field(default_factory=set)
    #: Pages [0, pinned) are read by a seal already issued: never re-staged.
    pinned: int = 0
    #: Completion event of the latest copies into this buffer (None: complete).
    ready: Any = None


@dataclass
class _AsyncLoad:
    since: float
    declared: bool = False
    handed: bool = False
    jobs: list[LoadJob] = field(default_factory=list)
    #: (key, reason) of a plan error found before any job ran.
    error: tuple[str | None, str] | None = None
    #: Rung 3 (parked, retrying): attempts so far, when to retry next, the jobs to re-read.
    attempts: int = 0
    retry_at: float | None = None
    failed_jobs: list[tuple[LoadJob, list[tuple[int, int]]]] = field(default_factory=list)


#: Failure reasons (exception type names, see ``_describe``) by what they say about the object.
_CORRUPT = frozenset({"BadMagic", "HeaderCorrupt", "TruncatedObject", "ChecksumMismatch", "IntegrityError",
                      "ObjectFormatError"})
#: Not ours to judge (another format version, another namespace, another span): never deleted.
_UNUSABLE = frozenset({"UnsupportedVersion", "ForeignObject", "LoadPlanError", "Unauthenticated", "SpanMismatch"})


def _kind(reason: str) -> str:
    name = reason.split(":", 1)[0]
    if name == "NotFound":
        return "missing"
    if name in _CORRUPT:
        return "corrupt"
    if name in _UNUSABLE:
        return "unusable"
    return "transient"


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "unknown error"
    return f"{type(e).__name__}: {e}"


class WorkerCore:
    """One rank's connector worker. Thread-safe; holds no global state."""

    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        key_prefix: str = "",
        rank: int = 0,
        tp_size: int = 1,
        model_id: str = "",
        kv_dtype: str = "",
        index: KeyIndex | None = None,
        metrics: MetricsHook | None = None,
        *,
        tp_rank: int | None = None,
        prefix: str | None = None,
        load_reserve_fraction: float = 0.25,
        upload_queue_size: int = 1024,
        failed_load_hook: bool = False,
    ):
        """``rank`` is the tensor-parallel rank (``tp_rank`` is accepted as an alias, as is
        ``prefix`` for ``key_prefix``); ``metrics(name, delta)`` is called on every counter change.
        ``failed_load_hook``: the engine polls ``take_failed_load_request_ids`` and recomputes
        the requests it names (rung 1); without it a failed parked load stays parked and retries."""
        if tp_rank is not None:
            rank = tp_rank
        if prefix is not None:
            key_prefix = prefix
        if not 0 <= rank < tp_size:
            raise ValueError(f"tp rank {rank} outside [0, {tp_size})")
        self.settings = settings
        self.store = store
        self.prefix = key_prefix.rstrip("/")
        self.tp_rank = int(rank)
        self.tp_size = int(tp_size)
        self.model_id = model_id
        self.kv_dtype = str(kv_dtype)
        self.index = index
        self._load_reserve_fraction = load_reserve_fraction
        #: load_timeout_s <= 0 means no deadline.
        self._load_timeout = settings.load_timeout_s if settings.load_timeout_s > 0 else float("inf")
        self._counters = Counters(metrics)
        self._lock = threading.RLock()
        self._uploader = Uploader(
            store,
            threads=settings.upload_threads,
            queue_size=upload_queue_size,
            index=index,
            counters=self._counters,
            wait_event=Copier.synchronize,
            name=f"s3kv-up-r{rank}",
        )
        self._uploader.multipart_threshold = settings.multipart_threshold_mib << 20
        self._uploader.part_size = settings.multipart_part_mib << 20
        # Set by register_layout.
        self._geometry: CacheGeometry | None = None
        self._keys: KeyScheme | None = None
        self._regions: dict[int, tuple[Any, ...]] = {}
        self._identity: dict[int, ObjectIdentity] = {}
        self._layer_group: dict[int, int] = {}
        self._copier: Copier | None = None
        self._pool: StagingPool | None = None
        self._downloader: Downloader | None = None
        # Per-iteration.
        self._metadata: ConnectorMetadata | None = None
        self._loads_started = False
        self._saves_done = False
        self._failed_now: set[int] = set()  # requests whose sync load failed this iteration
        # Saves.
        self._buffers: dict[BufferId, _OpenBuffer] = {}
        self._dropped: set[BufferId] = set()
        self._copy_events: dict[int, Any] = {}  # request id -> latest stage copy event
        self._save_handed: dict[int, None] = {}  # ordered set
        # Loads.
        self._jobs: list[LoadJob] = []  # every job whose staging may still be held
        self._group_events: dict[int, list[Any]] = {}  # sync copies the forward has not waited on
        self._async: dict[int, _AsyncLoad] = {}
        # Failure rungs.
        self.failed_load_hook = failed_load_hook
        self._failed_report: set[int] = set()  # for take_failed_load_request_ids
        self._retry_base_s = 0.5
        self._retry_max_s = 30.0
        # Standing finish plans (request id -> plan), run when the id reaches get_finished.
        self._finish_plans: dict[int, FinishPlan] = {}
        self._last_stream: Any = None  # the forward stream of the latest wait_for_save
        self._last_drop_warn = 0.0
        self._dropped_since_warn = 0
        self._closed = False

    # -- set-up -----------------------------------------------------------
    def register_layout(self, layout: Any) -> CacheGeometry:
        with self._lock:
            if self._geometry is not None:
                raise RuntimeError("register_layout called twice")
            geometry = CacheGeometry.from_layout(
                layout, model_id=self.model_id, tp_size=self.tp_size, kv_dtype=self.kv_dtype
            )
            namespace = namespace_digest(geometry, tagged=self.settings.integrity is not None)
            regions: dict[int, tuple[Any, ...]] = {}
            for g in layout.groups:
                regions[int(g.layer_group_id)] = tuple(g.regions)
            device = None
            for regs in regions.values():
                for r in regs:
                    if int(r.num_slots) > 0:
                        device = r.slot_tensor(0).device
                        break
                if device is not None:
                    break
            if device is None:
                raise ValueError("the KV cache layout has no slots")
            self._keys = KeyScheme(self.prefix, namespace, self.tp_size)
            self._regions = regions
            self._identity = {
                g.group_id: ObjectIdentity(
                    namespace=namespace,
                    group_fingerprint=g.fingerprint,
                    shard=self.tp_rank,
                    tp_size=self.tp_size,
                    tokens_per_block=geometry.tokens_per_block,
                    page_bytes=g.page_bytes,
                    integrity=self.settings.integrity,
                    window=g.window,
                )
                for g in geometry.groups
            }
            self._layer_group = {lid: g.group_id for g in geometry.groups for lid in g.layer_ids}
            self._copier = Copier(device, batch=self.settings.batch_copies)
            self._pool = StagingPool.for_device(
                self.settings.staging_bytes,
                device,
                pinned=self.settings.pinned,
                load_reserve_fraction=self._load_reserve_fraction,
            )
            self._downloader = Downloader(
                self.store,
                self._pool,
                self._copier,
                threads=self.settings.download_threads,
                counters=self._counters,
                name=f"s3kv-down-r{self.tp_rank}",
            )
            self._geometry = geometry
            # Saves need a buffer per open object and group; with room for fewer than a few
            # objects of the largest group, most saves would be dropped.
            from ..core.policy import object_sizes

            blocks, _ = object_sizes([g.page_bytes for g in geometry.groups], geometry.tokens_per_block, self.settings)
            biggest = max(b * g.page_bytes for b, g in zip(blocks, geometry.groups, strict=True))
            if self._pool.capacity < 4 * biggest * max(1, geometry.num_groups):
                log.warning(
                    "s3kv: S3KV_STAGING_MIB=%d holds fewer than 4 objects per layer group (largest object "
                    "%.1f MiB, %d groups): saves will be dropped under load; raise it to at least %d",
                    self.settings.staging_mib, biggest / 2**20, geometry.num_groups,
                    -(-4 * biggest * geometry.num_groups // 2**20),
                )
            log.info(
                "s3kv worker rank %d/%d: %d layer group(s), namespace %s, staging %d MiB (%s) on %s",
                self.tp_rank,
                self.tp_size,
                geometry.num_groups,
                namespace.hex(),
                self._pool.capacity >> 20,
                "pinned" if self._pool.pinned else "pageable",
                device,
            )
            return geometry

    @property
    def geometry(self) -> CacheGeometry:
        if self._geometry is None:
            raise RuntimeError("no KV cache layout registered yet")
        return self._geometry

    @property
    def keys(self) -> KeyScheme:
        if self._keys is None:
            raise RuntimeError("no KV cache layout registered yet")
        return self._keys

    @property
    def staging(self) -> StagingPool:
        if self._pool is None:
            raise RuntimeError("no KV cache layout registered yet")
        return self._pool

    def identity(self, group: int) -> ObjectIdentity:
        return self._identity[group]

    def object_key(self, group: int, last_digest: bytes) -> str:
        """This rank's key of the object of ``group`` ending at ``last_digest``."""
        return self.keys.object_key(self.geometry.groups[group].fingerprint, self.tp_rank, last_digest)

    # -- per iteration ----------------------------------------------------
    def bind(self, metadata: ConnectorMetadata | None) -> None:
        with self._lock:
            self._metadata = metadata
            self._loads_started = False
            self._saves_done = False
            self._failed_now = set()
            if metadata is None:
                return
            for rid in metadata.discard_ids:
                self._finish_plans.pop(rid, None)
            for plan in metadata.finish_plans:
                if plan.empty:
                    self._finish_plans.pop(plan.request_id, None)
                else:
                    self._finish_plans[plan.request_id] = plan

    def start_load_kv(self, stream: Any = None) -> None:
        """Start every load of the bound plan; sync ones are downloaded and verified before return.

        Never raises: a load that cannot be completed with verified bytes takes the
        failure rung this engine allows (see :meth:`_load_failed_now`).
        """
        with self._lock:
            md = self._metadata
            if md is None or self._loads_started:
                return
            self._loads_started = True
            self._reap()
            now = time.monotonic()
            for rid in md.async_load_ids:
                st = self._async.get(rid)
                if st is None:
                    st = self._async[rid] = _AsyncLoad(since=now)
                st.declared = True
            broken: dict[int, tuple[str | None, str]] = {
                rid: (None, "s3kv could not plan the promised load (see the leader's log)")
                for rid in md.failed_load_ids
            }
            if not md.loads and not broken:
                return
            self._require_layout()
            assert self._copier is not None and self._downloader is not None
            self._copier.begin_loads(stream)
            jobs, errors = build_jobs(
                md.loads,
                tp_rank=self.tp_rank,
                is_async=lambda rid: rid in md.async_load_ids,
                resolve=self._resolve,
                deadline=now + self._load_timeout,
            )
            for rid, err in errors.items():
                log.error("s3kv: request %d: load plan does not fit: %s (object %s)", rid, err[1], err[0],
                          extra={"request_id": rid})
                broken.setdefault(rid, err)
            sync_errors: dict[int, tuple[str | None, str]] = {}
            for rid, err in broken.items():
                if rid in md.async_load_ids:
                    self._async[rid].error = err
                else:
                    sync_errors[rid] = err
            for job in jobs:
                self._jobs.append(job)
                self._downloader.submit(job)
                if job.is_async:
                    for rid in job.request_ids:
                        self._async[rid].jobs.append(job)
            sync_jobs = [j for j in jobs if not j.is_async]
        if not sync_jobs and not sync_errors:
            return
        self._wait_jobs(sync_jobs, now + self._load_timeout)
        failed: dict[int, tuple[str | None, str]] = dict(sync_errors)
        with self._lock:
            for job in sync_jobs:
                if job.state == DONE:
                    self._group_events.setdefault(job.group, []).append(job.event)
                else:
                    for rid in job.request_ids:
                        failed.setdefault(rid, (job.key, _describe(job.error)))
            if failed:
                self._load_failed_now(failed)

    def _load_failed_now(self, failed: dict[int, tuple[str | None, str]]) -> None:
        """Sync loads that failed: no copy may still land, nothing of theirs is saved, and the
        engine's failed-load hook (the only safe outcome for a sync load) is told."""
        self._quiesce(set(failed))
        # The engine may still run this iteration's forward for the other requests; the
        # failed ones' pages hold no verified KV, so nothing of theirs may be saved from
        # them (it would poison the shared cache).
        self._failed_now |= set(failed)
        self._note_failed(failed)
        if self.failed_load_hook:
            self._failed_report |= set(failed)
            self._counters.add("rung_engine_recompute", len(failed))
        else:
            # The leader plans sync loads only on engines with the hook; reaching this is a bug.
            self._counters.add("rung_none", len(failed))
            log.critical("s3kv: sync load failed on an engine without a failed-load hook: %s", failed)

    def fail_bound_loads(self, reason: str) -> None:
        """The adapter's fallback when ``start_load_kv`` raised: every load of the bound plan
        takes the failure rung (its state is unknown, so none of it may be trusted)."""
        with self._lock:
            md = self._metadata
            if md is None:
                return
            now = time.monotonic()
            rids = {op.request_id for op in md.loads} | set(md.failed_load_ids) | set(md.async_load_ids)
            sync: dict[int, tuple[str | None, str]] = {}
            for rid in rids:
                if rid in md.async_load_ids:
                    st = self._async.setdefault(rid, _AsyncLoad(since=now))
                    st.declared = True
                    st.error = (None, reason)
                else:
                    sync[rid] = (None, reason)
            if sync:
                self._load_failed_now(sync)

    def install_exit_drain(self, timeout_s: float) -> None:
        """Drain queued uploads (at most ``timeout_s``) when the process exits normally.

        TensorRT-LLM calls no connector ``shutdown()``; without this, saves still in the
        upload queue at exit would be lost silently. What could not finish is counted and logged.
        """
        import atexit
        import weakref

        ref = weakref.ref(self)

        def drain() -> None:
            core = ref()
            if core is None or core._closed:
                return
            pending = core._uploader.pending
            if not pending:
                return
            t0 = time.monotonic()
            drained = core.flush(timeout_s)
            left = core._uploader.pending
            if drained:
                log.info("s3kv: drained %d upload(s) at exit in %.1f s", pending, time.monotonic() - t0)
            else:
                core._counters.add("uploads_dropped_at_exit", left)
                log.warning("s3kv: %d upload(s) still queued after %.1f s at exit; dropped", left, timeout_s)

        atexit.register(drain)

    def take_failed_load_request_ids(self) -> set[int]:
        """Rung 1 (engines that offer it): requests whose promised load failed, to be recomputed."""
        with self._lock:
            out, self._failed_report = self._failed_report, set()
            return out

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        """Make the forward stream wait for the copies into the layer's group (no host wait)."""
        with self._lock:
            group = self._layer_group.get(int(layer_idx))
            events = self._group_events.pop(group, None) if group is not None else None
            if events and self._copier is not None:
                for ev in events:
                    self._copier.wait_on(ev, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        """No-op: a page spans every layer of its group, so it is copied once in wait_for_save."""

    def wait_for_save(self, stream: Any = None) -> None:
        """Copy the iteration's staged pages to host (stream-ordered) and hand seals to the uploader."""
        with self._lock:
            self._last_stream = stream
            # Copies into groups whose layer hook never ran: order them before later work anyway.
            if self._group_events and self._copier is not None:
                for events in self._group_events.values():
                    for ev in events:
                        self._copier.wait_on(ev, stream)
                self._group_events.clear()
            self._reap()
            md = self._metadata
            if md is None or self._saves_done:
                return
            self._saves_done = True
            if not (md.stages or md.seals or md.discard_ids or md.releases):
                return
            if self._geometry is None:
                log.error("s3kv: save ops before register_layout; dropped")
                self._counters.add("saves_dropped_other", len(md.seals))
                return
            failed = self._failed_now
            try:
                for rid in set(md.discard_ids) | failed:
                    self._discard(rid)
                self._stage([op for op in md.stages if op.buffer.request_id not in failed], stream)
                for seal in md.seals:
                    if seal.buffer.request_id not in failed:
                        self._seal(seal)
                # A released buffer's last seal already went out; free its staging now.
                for bid in md.releases:
                    self._close_buffer(bid)
                    self._dropped.discard(bid)
            except Exception:  # noqa: BLE001 - saves are best effort; never fail the engine
                log.exception("s3kv: save path failed; this iteration's saves may be dropped")
                self._counters.add("saves_dropped_other")

    def get_finished(
        self, finished_gen_req_ids: Iterable[int], started_loading_req_ids: Iterable[int]
    ) -> tuple[list[int], list[int]]:
        """(finished saving, finished loading) ids; see the module doc for the rules. Never raises.

        A finishing id runs its standing finish plan here (pages copied off the
        device, objects sealed) and is returned once those copies completed. A
        parked request whose load failed takes the engine's failed-load hook
        (rung 1) or stays parked while the load is retried (rung 3).
        """
        with self._lock:
            self._reap()
            now = time.monotonic()
            for rid in finished_gen_req_ids:
                rid = int(rid)
                self._finish_request(rid)
                self._save_handed.setdefault(rid, None)
            for rid in started_loading_req_ids:
                rid = int(rid)
                st = self._async.get(rid)
                if st is None:
                    st = self._async[rid] = _AsyncLoad(since=now)
                st.handed = True
            self._settle_async_failures(now)

            saving: list[int] = []
            for rid in list(self._save_handed):
                if Copier.done(self._copy_events.get(rid)):
                    saving.append(rid)
                    del self._save_handed[rid]
                    self._copy_events.pop(rid, None)
            loading: list[int] = []
            for rid, st in list(self._async.items()):
                if (
                    st.handed
                    and st.declared
                    and st.error is None
                    and st.retry_at is None  # not parked for a retry
                    and not st.failed_jobs
                    and all(j.state == DONE and Copier.done(j.event) for j in st.jobs)
                ):
                    loading.append(rid)
                    if st.attempts:
                        self._counters.add("parked_loads_recovered")
                        if self.index is not None:  # quarantined while it failed; it is good now
                            self.index.forget(j.key for j in st.jobs)
                        log.warning("s3kv: request %d: load succeeded after %d retries", rid, st.attempts,
                                    extra={"request_id": rid})
                    del self._async[rid]
            return saving, loading

    def _finish_request(self, rid: int) -> None:
        """The request ended: stop its load if still parked, run its finish plan, drop the rest."""
        st = self._async.pop(rid, None)
        if st is not None:
            # Cancelled while parked: make sure no load copy can still land in its pages
            # (the engine frees them once every rank returns the id).
            self._quiesce({rid})
            self._counters.add("loads_cancelled")
            if st.attempts:
                self._counters.add("parked_loads_cancelled")
        plan = self._finish_plans.pop(rid, None)
        if plan is not None and self._geometry is not None and rid not in self._failed_now:
            try:
                self._stage(plan.stages, self._last_stream)
                for seal in plan.seals:
                    self._seal(seal)
                for bid in plan.releases:
                    self._close_buffer(bid)
                    self._dropped.discard(bid)
            except Exception:  # noqa: BLE001 - saves are best effort; never fail the engine
                log.exception("s3kv: finish plan of request %d failed; its last saves are dropped", rid)
                self._counters.add("saves_dropped_other")
        self._discard(rid)

    def _settle_async_failures(self, now: float) -> None:
        """Parked loads that failed: rung 1 (engine hook) or rung 3 (stay parked, retry with backoff)."""
        for rid, st in list(self._async.items()):
            if st.retry_at is not None:
                if now >= st.retry_at and st.handed:
                    self._retry(rid, st, now)
                continue
            failed = self._async_failure(st, now)
            if failed is None:
                continue
            key, reason = failed
            # The request's own targets in each job, taken before quiescing drops them from
            # jobs still pending (a retry re-reads exactly these).
            wanted = {id(j): [(o, s) for o, s in j.targets if j.owners.get(s) == rid] for j in st.jobs}
            self._quiesce({rid})
            first_failure = st.attempts == 0
            self._note_failed({rid: failed}, quiet=not first_failure)
            if self.failed_load_hook:
                del self._async[rid]
                self._failed_report.add(rid)
                self._counters.add("rung_engine_recompute")
                continue
            # Rung 3: the merged engine has no way to fail a load, and returning the id would
            # serve unverified KV. The request stays parked (visibly) while the load is retried.
            delay = min(self._retry_max_s, self._retry_base_s * (2 ** min(st.attempts, 16)))
            st.retry_at = now + delay
            st.failed_jobs = [(j, wanted.get(id(j), [])) for j in st.jobs if j.state != DONE]
            st.jobs = [j for j in st.jobs if j.state == DONE]
            if first_failure:
                self._counters.add("rung_parked_retry")
            st.attempts += 1
            (log.warning if first_failure or st.attempts % 10 == 0 else log.info)(
                "s3kv: request %d stays parked: its load failed (%s); retry %d in %.1f s",
                rid, reason if not key or key in reason else f"{reason} (object {key!r})", st.attempts, delay,
                extra={"request_id": rid, "key": key},
            )

    def _async_failure(self, st: _AsyncLoad, now: float) -> tuple[str | None, str] | None:
        if st.error is not None:
            return st.error
        for job in st.jobs:
            if not job.finished and now > job.deadline:
                self._cancel(job)
            if job.finished and job.state != DONE:
                return job.key, _describe(job.error)
        if st.handed and not st.declared and now - st.since > self._load_timeout:
            return None, "handed over as loading but no load was ever planned for it"
        return None

    def _retry(self, rid: int, st: _AsyncLoad, now: float) -> None:
        """Resubmit the failed objects of a parked request (fresh jobs, fresh deadline)."""
        st.retry_at = None
        if st.error is not None or not st.failed_jobs:
            # Nothing to re-read (the plan itself could not be made): it stays parked until the
            # request is cancelled; say so now and then.
            st.retry_at = now + self._retry_max_s
            return
        assert self._downloader is not None
        for old, targets in st.failed_jobs:
            if not targets:
                continue
            job = dataclasses.replace(
                old, targets=targets, request_ids={rid}, owners={s: rid for _, s in targets},
                state=PENDING, error=None, event=None, buffer=None, future=None, lock=threading.Lock(),
                deadline=now + self._load_timeout,
            )
            self._jobs.append(job)
            self._downloader.submit(job)
            st.jobs.append(job)
        st.failed_jobs = []
        self._counters.add("load_retries")

    def _note_failed(self, failed: dict[int, tuple[str | None, str]], *, quiet: bool = False) -> None:
        """Count and log failed loads; quarantine the objects that failed so later lookups miss.
        ``quiet``: a retry of a load already reported (counted as a retry, logged at INFO)."""
        if quiet:
            self._counters.add("load_retry_failures", len(failed))
        else:
            self._counters.add("requests_failed", len(failed))
        keys = sorted({k for k, _ in failed.values() if k})
        bad = sorted({k for k, r in failed.values() if k and _kind(r) != "transient"})
        if self.index is not None and keys:
            # A stale positive would keep promising the same broken load to every request on this
            # prefix. An object that is gone or bad is remembered as missing for a while (later
            # lookups miss at once); after a store outage the entry is only dropped (the next
            # lookup asks the store again).
            self.index.forget(keys)
            self.index.quarantine(bad, self.settings.quarantine_s)
        corrupt = sorted({k for k, r in failed.values() if k and _kind(r) == "corrupt"})
        if corrupt:
            self._counters.add("objects_quarantined", len(corrupt))
            if self.settings.delete_corrupt:
                for k in corrupt:
                    try:
                        self.store.delete_many([k])
                    except Exception as e:  # noqa: BLE001 - best effort; engines may lack DeleteObject
                        log.warning("s3kv: could not delete corrupt object %s: %s", k, e)
        reasons = sorted({f"{r} (object {k!r})" if k and k not in r else r for k, r in failed.values()})
        (log.info if quiet else log.error)("s3kv: promised load failed: %s", "; ".join(reasons),
                                           extra={"request_ids": sorted(failed), "keys": keys})

    # -- lifecycle --------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every upload queued so far has finished (True) or ``timeout`` passed (False)."""
        return self._uploader.flush(timeout)

    def close(self, timeout: float | None = 30.0, cancel: bool = False) -> bool:
        """Drain (or cancel) uploads, stop the threads, free staging. True if drained in time."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        drained = self._uploader.close(timeout, cancel=cancel)
        with self._lock:
            if self._downloader is not None:
                self._downloader.close()
            for bid in list(self._buffers):
                self._close_buffer(bid)
            self._dropped.clear()
            self._reap()
            if self._copier is not None:
                self._copier.drain()
            if self._pool is not None:
                self._pool.close()
        return drained

    def __enter__(self) -> WorkerCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> WorkerStats:
        c = self._counters.snapshot()
        s = self._pool.stats() if self._pool is not None else None

        def n(name: str) -> int:
            return int(c.get(name, 0))

        return WorkerStats(
            pages_staged=n("pages_staged"),
            bytes_staged=n("bytes_staged"),
            seals_submitted=n("seals_submitted"),
            objects_uploaded=n("objects_uploaded"),
            bytes_uploaded=n("bytes_uploaded"),
            objects_already_present=n("objects_already_present"),
            saves_dropped_staging_full=n("saves_dropped_staging_full"),
            stages_dropped=n("stages_dropped"),
            seals_dropped=n("seals_dropped"),
            saves_dropped_store_error=n("saves_dropped_store_error"),
            saves_dropped_other=n("saves_dropped_other") + n("saves_dropped_error") + n("uploads_cancelled"),
            uploads_pending=self._uploader.pending,
            pages_loaded=n("pages_loaded"),
            bytes_loaded=n("bytes_loaded"),
            objects_loaded=n("objects_loaded"),
            loads_failed_objects=n("loads_failed_objects"),
            requests_failed=n("requests_failed"),
            load_staging_fallbacks=n("load_staging_fallbacks"),
            staging_capacity=s.capacity if s else 0,
            staging_in_use=s.in_use if s else 0,
            staging_high_water=s.high_water if s else 0,
            staging_drops=s.drops if s else 0,
            staging_pinned=s.pinned if s else False,
            rung_engine_recompute=n("rung_engine_recompute"),
            rung_parked_retry=n("rung_parked_retry"),
            parked_loads_recovered=n("parked_loads_recovered"),
            parked_loads_cancelled=n("parked_loads_cancelled"),
            parked_now=sum(1 for st in list(self._async.values()) if st.attempts),
            load_retries=n("load_retries"),
            objects_quarantined=n("objects_quarantined"),
            uploads_dropped_at_exit=n("uploads_dropped_at_exit"),
            put_requests=n("put_requests"),
            get_requests=n("get_requests"),
        )

    # -- internals: saves -------------------------------------------------
    def _require_layout(self) -> None:
        if self._geometry is None:
            raise RuntimeError("no KV cache layout registered yet")

    def _stage(self, stages: Iterable[StageOp], stream: Any) -> None:
        assert self._copier is not None
        copies: list[PageCopy] = []
        touched: dict[BufferId, _OpenBuffer] = {}
        requests: set[int] = set()
        nbytes = 0
        for op in stages:
            ob = self._buffer_for(op)
            if ob is None:
                continue
            idx = op.ordinal - op.buffer.first
            copies.append(
                PageCopy(self._regions[op.buffer.group], op.slot, ob.buf.tensor, idx * ob.page_bytes)
            )
            ob.staged.add(idx)
            touched[op.buffer] = ob
            requests.add(op.buffer.request_id)
            nbytes += ob.page_bytes
        if not copies:
            return
        event = self._copier.save(copies, stream)
        for ob in touched.values():
            ob.ready = event
        if event is not None:
            for rid in requests:
                self._copy_events[rid] = event
        self._counters.add("pages_staged", len(copies))
        self._counters.add("bytes_staged", nbytes)

    def _buffer_for(self, op: StageOp) -> _OpenBuffer | None:
        """The open buffer a stage goes to, or None (dropped / invalid; counted)."""
        bid = op.buffer
        ob = self._buffers.get(bid)
        if ob is None:
            if bid in self._dropped:
                self._counters.add("stages_dropped")
                return None
            if bid.group not in self._identity or bid.capacity <= 0:
                log.error("s3kv: stage into invalid buffer %s; save dropped", bid)
                self._dropped.add(bid)
                self._counters.add("saves_dropped_other")
                return None
            assert self._pool is not None
            page_bytes = self._identity[bid.group].page_bytes
            buf = self._pool.try_acquire(bid.capacity * page_bytes, SAVE)
            if buf is None:
                self._warn_dropped(bid)
                self._dropped.add(bid)
                self._counters.add("saves_dropped_staging_full")
                self._counters.add("stages_dropped")
                return None
            ob = self._buffers[bid] = _OpenBuffer(bid, buf, page_bytes)
        idx = op.ordinal - bid.first
        regions = self._regions[bid.group]
        if not 0 <= idx < bid.capacity or not 0 <= op.slot < min(int(r.num_slots) for r in regions):
            log.error("s3kv: invalid stage %s (page %d of %d); skipped", op, idx, bid.capacity)
            self._counters.add("saves_dropped_other")
            return None
        if idx < ob.pinned and idx in ob.staged:
            # Read by an issued seal: keep those bytes (same chain digest -> same KV).
            self._counters.add("restages_ignored")
            return None
        return ob

    def _warn_dropped(self, bid: BufferId) -> None:
        """Saves dropped for staging room: a WARNING at most every 30 s, with the count since."""
        self._dropped_since_warn += 1
        now = time.monotonic()
        if now - self._last_drop_warn >= 30.0:
            log.warning(
                "s3kv: host staging full: %d save(s) dropped (latest %s); raise S3KV_STAGING_MIB "
                "(now %d) or check the store's upload speed", self._dropped_since_warn, bid, self.settings.staging_mib,
            )
            self._last_drop_warn = now
            self._dropped_since_warn = 0

    def _seal(self, seal: SealOp) -> None:
        bid = seal.buffer
        ob = self._buffers.get(bid)
        if ob is None:
            if bid in self._dropped:
                self._counters.add("seals_dropped")
                if seal.close:
                    self._dropped.discard(bid)
            else:
                log.warning("s3kv: seal of a buffer never staged (%s); ignored", bid)
                self._counters.add("saves_dropped_other")
            return
        try:
            missing = [i for i in range(seal.count) if i not in ob.staged]
            if not 0 < seal.count <= bid.capacity or missing:
                log.warning(
                    "s3kv: seal of %s with %d pages, missing %s; save dropped", bid, seal.count, missing[:8]
                )
                self._counters.add("saves_dropped_other")
                return
            job = UploadJob(
                key=self.object_key(bid.group, seal.last_digest),
                identity=self._identity[bid.group],
                buffer=ob.buf.retain(),
                first=bid.first,
                count=seal.count,
                last_digest=seal.last_digest,
                ready=ob.ready,
                request_id=bid.request_id,
            )
            if self._uploader.submit(job):
                ob.pinned = max(ob.pinned, seal.count)
                self._counters.add("seals_submitted")
            else:
                job.buffer.release()
                log.warning("s3kv: upload queue full or closed; save of %s dropped", job.key)
                self._counters.add("saves_dropped_other")
        finally:
            if seal.close:
                self._close_buffer(bid)

    def _close_buffer(self, bid: BufferId) -> None:
        ob = self._buffers.pop(bid, None)
        if ob is not None:
            ob.buf.release()

    def _discard(self, request_id: int) -> None:
        for bid in [b for b in self._buffers if b.request_id == request_id]:
            self._close_buffer(bid)
        self._dropped = {b for b in self._dropped if b.request_id != request_id}

    # -- internals: loads -------------------------------------------------
    def _resolve(self, op: LoadOp) -> tuple[str, tuple[Any, ...], ObjectIdentity]:
        group = op.obj.group
        if group not in self._identity:
            raise LoadPlanError(f"unknown layer group {group}")
        return self.object_key(group, op.obj.last_digest), self._regions[group], self._identity[group]

    def _wait_jobs(self, jobs: list[LoadJob], deadline: float) -> None:
        for job in jobs:
            fut = job.future
            assert fut is not None
            try:
                fut.result(
                    timeout=None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
                )
            except (FutureTimeout, CancelledError):
                pass
            if not job.finished:
                if not self._cancel(job):
                    # Already placing pages: local copies, finish them rather than leave them half done.
                    try:
                        fut.result()
                    except CancelledError:
                        pass

    def _quiesce(self, failed: set[int]) -> None:
        """Before failing requests: make sure no load copy can still land in their slots.

        The engine frees a failed request's pages and may hand them to another
        request at once. Pending jobs forget the failed requests' targets (and are
        cancelled when nothing is left); jobs already placing or placed are waited
        for until their copies completed. Rare path, so a short host wait is fine.
        """
        reason = LoadFailed("request failed", request_ids=failed)
        for job in list(self._jobs):
            if not job.request_ids & failed and not any(r in failed for r in job.owners.values()):
                continue
            if job.drop_requests(failed, reason):
                continue
            if job.future is not None:
                try:
                    job.future.result()
                except CancelledError:
                    pass
            Copier.synchronize(job.event)

    def _cancel(self, job: LoadJob) -> bool:
        """Give up on a job past its deadline; False if it is already placing pages."""
        stopped, now = job.try_cancel(
            LoadTimeout(f"not loaded within load_timeout_s={self.settings.load_timeout_s}")
        )
        if now:
            log.error("s3kv: load of %s timed out after %.1f s", job.key, self.settings.load_timeout_s)
            self._counters.add("loads_failed_objects")
            self._counters.add("loads_timed_out")
        return stopped

    def _reap(self) -> None:
        """Free the staging of placed loads whose copies completed; forget completed copy events."""
        if self._jobs:
            self._jobs = [j for j in self._jobs if not j.release_if_complete(Copier.done)]
        if self._copy_events:
            done = [
                rid
                for rid, ev in self._copy_events.items()
                if rid not in self._save_handed and Copier.done(ev)
            ]
            for rid in done:
                del self._copy_events[rid]


__all__ = ["LoadTimeout", "WorkerCore", "WorkerStats"]
