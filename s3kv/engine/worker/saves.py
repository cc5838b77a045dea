"""Save jobs on one rank: object buffers in host staging, stage copies, seals, finish plans.

Best effort, never an engine error, never a stall. ``wait_for_save`` runs the iteration's
``StageOp``s: the first stage of an object opens its buffer in host staging
(``BufferId.capacity`` pages; no room -> the buffer is dropped and counted, its later stages
and seals ignored and counted) and the pages are copied device->host in one stream-ordered
batch (:mod:`s3kv.transfer.copies`). ``SealOp``s go to the upload threads with a reference on
the buffer; ``close`` drops the plan's reference, so the bytes are freed after the last upload
that reads them. A seal with ``close=False`` (a snapshot) pins pages ``[0, count)``: later
stages of the same buffer go to higher pages, and a re-stage of a pinned page is ignored (the
chain digest names the same KV; the in-flight upload keeps the bytes it hashed).

With a host tier each seal first reserves the object's place there, here, in plan order (so
every rank's tier evicts the same objects: ``s3kv.transfer.hosttier``); the upload thread
fills it. ``SealOp.to_s3`` says whether the object also goes to the store now. A seal whose
buffer was dropped still reserves its place, as a ghost, so this rank's tier stays in step with
the others'. A seal meant for the host tier only (``evict``/``never``) on a rank without one,
or whose tier has no bytes for it (its arena not ready yet -- being pinned at start-up -- or too
fragmented: a ghost), is dropped and counted (``seals_dropped_no_tier``).

Finishing requests: the standing finish plans (``metadata.finish_plans``) are run when the id
reaches ``get_finished``; the id is handed back once every stage copy of that request issued
so far has completed (at once on CPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...config import Settings
from ...core.plan import BufferId, ConnectorMetadata, FinishPlan, SealOp, StageOp
from ...transfer.copies import Copier, PageCopy
from ...transfer.counters import Counters
from ...transfer.hosttier import NOW, HostTier
from ...transfer.staging import SAVE, StagingBuffer, StagingPool
from ...transfer.upload import Uploader, UploadJob
from .rank import RankLayout

log = logging.getLogger("s3kv.worker")


@dataclass
class OpenBuffer:
    bid: BufferId
    buf: StagingBuffer
    page_bytes: int
    staged: set[int] = field(default_factory=set)
    #: Pages [0, pinned) are read by a seal already issued: never re-staged.
    pinned: int = 0
    #: Completion event of the latest copies into this buffer (None: complete).
    ready: Any = None


class SaveJobs:
    """One rank's saves. Called under the worker's lock."""

    def __init__(self, settings: Settings, counters: Counters, uploader: Uploader):
        self.settings = settings
        self.counters = counters
        self.uploader = uploader
        # Set by attach (register_layout).
        self.rank: RankLayout | None = None
        self.copier: Copier | None = None
        self.pool: StagingPool | None = None
        self.tier: HostTier | None = None
        self.buffers: dict[BufferId, OpenBuffer] = {}
        self.dropped: set[BufferId] = set()
        self.copy_events: dict[int, Any] = {}  # request id -> latest stage copy event
        self.handed: dict[int, None] = {}  # ordered set: ids handed to get_finished, not yet returned
        # Standing finish plans (request id -> plan), run when the id reaches get_finished.
        self.finish_plans: dict[int, FinishPlan] = {}
        self.last_stream: Any = None  # the forward stream of the latest wait_for_save
        self._last_drop_warn = 0.0
        self._dropped_since_warn = 0

    def attach(self, rank: RankLayout, copier: Copier, pool: StagingPool, tier: HostTier | None = None) -> None:
        self.rank, self.copier, self.pool, self.tier = rank, copier, pool, tier

    # -- per iteration ----------------------------------------------------
    def bind(self, md: ConnectorMetadata) -> None:
        """Take the metadata's finish plans; drop what discarded requests staged (plan first). Here,
        not in ``wait_for_save``: a pass whose requests were all parked runs no forward, and its
        discards would be lost -- a failed request's buffers then stayed for good."""
        for rid in md.discard_ids:
            self.finish_plans.pop(rid, None)
            try:
                self.discard(rid, wait=True)
            except Exception:  # noqa: BLE001 - the plans below must still be taken
                log.exception("s3kv: dropping what request %s staged failed", rid)
        for plan in md.finish_plans:
            if plan.empty:
                self.finish_plans.pop(plan.request_id, None)
            else:
                self.finish_plans[plan.request_id] = plan

    def run(self, md: ConnectorMetadata, stream: Any, failed: set[int]) -> None:
        """``wait_for_save``: stage, seal and release what the plan says; nothing of a request
        whose sync load failed this iteration (its pages hold no verified KV)."""
        if not (md.stages or md.seals or md.discard_ids or md.releases):
            return
        if self.rank is None:
            log.error("s3kv: save ops before register_layout; dropped")
            self.counters.add("saves_dropped_other", len(md.seals))
            return
        try:
            for rid in failed:
                self.discard(rid)
            self._stage([op for op in md.stages if op.buffer.request_id not in failed], stream)
            for seal in md.seals:
                if seal.buffer.request_id not in failed:
                    self._seal(seal)
            # A released buffer's last seal already went out; free its staging now.
            for bid in md.releases:
                self._close_buffer(bid)
                self.dropped.discard(bid)
        except Exception:  # noqa: BLE001 - saves are best effort; never fail the engine
            log.exception("s3kv: save path failed; this iteration's saves may be dropped")
            self.counters.add("saves_dropped_other")

    def finish(self, rid: int, failed_now: set[int]) -> None:
        """The request ended: run its finish plan (unless its sync load failed), drop the rest."""
        plan = self.finish_plans.pop(rid, None)
        if plan is not None and self.rank is not None and rid not in failed_now:
            try:
                self._stage(plan.stages, self.last_stream)
                for seal in plan.seals:
                    self._seal(seal)
                for bid in plan.releases:
                    self._close_buffer(bid)
                    self.dropped.discard(bid)
            except Exception:  # noqa: BLE001 - saves are best effort; never fail the engine
                log.exception("s3kv: finish plan of request %d failed; its last saves are dropped", rid)
                self.counters.add("saves_dropped_other")
        self.discard(rid)

    def hand(self, rid: int) -> None:
        self.handed.setdefault(rid, None)

    def finished(self) -> list[int]:
        """Handed ids whose stage copies completed: returned (once) from ``get_finished``."""
        saving: list[int] = []
        for rid in list(self.handed):
            if Copier.done(self.copy_events.get(rid)):
                saving.append(rid)
                del self.handed[rid]
                self.copy_events.pop(rid, None)
        return saving

    def reap(self) -> None:
        """Forget completed copy events of requests not waiting in ``get_finished``."""
        if self.copy_events:
            done = [rid for rid, ev in self.copy_events.items() if rid not in self.handed and Copier.done(ev)]
            for rid in done:
                del self.copy_events[rid]

    def close(self) -> None:
        for bid in list(self.buffers):
            self._close_buffer(bid)
        self.dropped.clear()

    # -- buffers ----------------------------------------------------------
    def _stage(self, stages: Iterable[StageOp], stream: Any) -> None:
        assert self.copier is not None and self.rank is not None
        copies: list[PageCopy] = []
        touched: dict[BufferId, OpenBuffer] = {}
        requests: set[int] = set()
        nbytes = 0
        for op in stages:
            ob = self._buffer_for(op)
            if ob is None:
                continue
            idx = op.ordinal - op.buffer.first
            copies.append(
                PageCopy(self.rank.regions[op.buffer.group], op.slot, ob.buf.tensor, idx * ob.page_bytes)
            )
            ob.staged.add(idx)
            touched[op.buffer] = ob
            requests.add(op.buffer.request_id)
            nbytes += ob.page_bytes
        if not copies:
            return
        event = self.copier.save(copies, stream)
        for ob in touched.values():
            ob.ready = event
        if event is not None:
            for rid in requests:
                self.copy_events[rid] = event
        self.counters.add("pages_staged", len(copies))
        self.counters.add("bytes_staged", nbytes)

    def _buffer_for(self, op: StageOp) -> OpenBuffer | None:
        """The open buffer a stage goes to, or None (dropped / invalid; counted)."""
        assert self.rank is not None
        bid = op.buffer
        ob = self.buffers.get(bid)
        if ob is None:
            if bid in self.dropped:
                self.counters.add("stages_dropped")
                return None
            if bid.group not in self.rank.identity or bid.capacity <= 0:
                log.error("s3kv: stage into invalid buffer %s; save dropped", bid)
                self.dropped.add(bid)
                self.counters.add("saves_dropped_other")
                return None
            assert self.pool is not None
            page_bytes = self.rank.identity[bid.group].page_bytes
            buf = self.pool.try_acquire(bid.capacity * page_bytes, SAVE)
            if buf is None:
                self._warn_dropped(bid)
                self.dropped.add(bid)
                self.counters.add("saves_dropped_staging_full")
                self.counters.add("stages_dropped")
                return None
            ob = self.buffers[bid] = OpenBuffer(bid, buf, page_bytes)
        idx = op.ordinal - bid.first
        regions = self.rank.regions[bid.group]
        if not 0 <= idx < bid.capacity or not 0 <= op.slot < min(int(r.num_slots) for r in regions):
            log.error("s3kv: invalid stage %s (page %d of %d); skipped", op, idx, bid.capacity)
            self.counters.add("saves_dropped_other")
            return None
        if idx < ob.pinned and idx in ob.staged:
            # Read by an issued seal: keep those bytes (same chain digest -> same KV).
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
        assert self.rank is not None
        bid = seal.buffer
        ob = self.buffers.get(bid)
        tier = self.tier
        if tier is None and seal.to_s3 != NOW:
            # The leader never plans this without a tier; a rank that has none cannot keep it.
            self.counters.add("seals_dropped_no_tier")
            if seal.close:
                self._close_buffer(bid)
                self.dropped.discard(bid)
            return
        known = bid.group in self.rank.identity
        key = self.rank.object_key(bid.group, seal.last_digest) if known else ""
        if ob is None:
            if bid in self.dropped:
                self.counters.add("seals_dropped")
                if tier is not None and known and 0 < seal.count <= bid.capacity:
                    # The other ranks hold theirs: account for it as they do (never served here).
                    tier.reserve(key, self.rank.identity[bid.group], bid.first, seal.count, to_s3=seal.to_s3,
                                 ghost=True)
                if seal.close:
                    self.dropped.discard(bid)
            else:
                log.warning("s3kv: seal of a buffer never staged (%s); ignored", bid)
                self.counters.add("saves_dropped_other")
            return
        try:
            missing = [i for i in range(seal.count) if i not in ob.staged]
            if not 0 < seal.count <= bid.capacity or missing:
                log.warning(
                    "s3kv: seal of %s with %d pages, missing %s; save dropped", bid, seal.count, missing[:8]
                )
                self.counters.add("saves_dropped_other")
                return
            identity = self.rank.identity[bid.group]
            host = tier.reserve(key, identity, bid.first, seal.count, to_s3=seal.to_s3) if tier is not None else None
            if host is None and tier is not None and (seal.to_s3 != NOW or tier.stored(key)):
                # The tier holds this object already (and, for "now", knows the store does too):
                # the same chain digest names the same KV, nothing to write. Else it refused a
                # host-only object (larger than the tier, or the tier closed): nowhere to go.
                if not tier.knows(key):
                    self.counters.add("seals_dropped_no_tier")
                return
            if host is not None and host.buf is None and seal.to_s3 != NOW:
                # Accounted as the other ranks account it (a ghost), but this rank's tier has no
                # bytes for it: a host-only save has nowhere to go.
                self.counters.add("seals_dropped_no_tier")
                return
            job = UploadJob(
                key=key,
                identity=identity,
                buffer=ob.buf.retain(),
                first=bid.first,
                count=seal.count,
                last_digest=seal.last_digest,
                ready=ob.ready,
                request_id=bid.request_id,
                host=host,
                to_s3=seal.to_s3,
            )
            if self.uploader.submit(job):
                ob.pinned = max(ob.pinned, seal.count)
                self.counters.add("seals_submitted")
            else:
                job.buffer.release()
                if host is not None and tier is not None:
                    tier.fail(host)
                log.warning("s3kv: upload queue full or closed; save of %s dropped", job.key)
                self.counters.add("saves_dropped_other")
        finally:
            if seal.close:
                self._close_buffer(bid)

    def _close_buffer(self, bid: BufferId) -> None:
        ob = self.buffers.pop(bid, None)
        if ob is not None:
            ob.buf.release()

    def abort(self, rid: int) -> None:
        """The engine aborts the request and frees its pages once every rank returns: wait for
        its stage copies (``get_finished`` waits for exactly these; the latest covers the earlier
        ones, one save stream), then forget it -- it is never returned from ``get_finished``."""
        Copier.synchronize(self.copy_events.pop(rid, None))
        self.handed.pop(rid, None)
        self.finish_plans.pop(rid, None)
        self.discard(rid)

    def discard(self, request_id: int, *, wait: bool = False) -> None:
        """Drop what ``request_id`` staged, uploading nothing. ``wait``: its stage copies are
        waited for first (a discard the metadata brings: done by now in every path traced, and a
        buffer back in the pool may go to a download at once, which a copy still landing would
        overwrite). Not at a finish: ``get_finished`` must not block on the copies it just issued."""
        for bid in [b for b in self.buffers if b.request_id == request_id]:
            if wait:
                Copier.synchronize(self.buffers[bid].ready)
            self._close_buffer(bid)
        self.dropped = {b for b in self.dropped if b.request_id != request_id}
