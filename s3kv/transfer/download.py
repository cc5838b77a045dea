"""Verified loads: ranged reads of stored objects into cache slots.

One :class:`LoadJob` per object (the load ops of an iteration grouped by key):
one ``store.get_ranges_into(key, [header] + pages, staging views)`` with adjacent
pages coalesced into one range, run on a download thread: the bytes land in
(pinned) staging straight from the store, one host copy (obstore writes each
response there; stores without a native path copy once from their ``bytes``).
The header is verified against the identity we expect (``decode_header``: magic, version, namespace, group, shard,
geometry, header checksum) and must name exactly the span (first ordinal, page
count) and chain digest the plan promised for this shard. The wanted pages are
in host staging and **every page's checksum is verified there, before
any byte is copied to the device** — the bytes verified are the bytes copied.
Only then are the host->device copies enqueued (``Copier.load``), and the store is told the
object passed (``ObjectStore.note_verified``: refresh on hit keeps only verified objects alive).

An audit job (``place=False``) reads and verifies the same way and places nothing.

The host tier (:mod:`.hosttier`): a job whose object the rank's tier holds (``job.host``,
acquired in plan order by the worker) reads nothing and takes no download thread
(:meth:`Downloader.serve_hits`, on the caller's thread): the header and trailer in the tier's
(pinned) arena must still be the bytes the tier checked when it admitted them, that header must
name the plan's identity, span and digest, the pages are re-hashed when ``verify_host`` is set,
and the host->device copies go straight from the arena. A tier entry that fails a check is never
served again (a ghost) and the job reads the store instead, as it does when the entry is another
version of the object than the plan's. A job that reads a whole object from the store may carry a
tier reservation (``job.promote``): the object lands there instead of in staging, is verified
whole, and enters the tier once verified -- the copies then go from the tier as well.

A job ends ``DONE`` (copies issued; ``event`` tells when they completed) or
``FAILED`` (``error`` says why; nothing was copied to the device). A job that
has not started placing pages can be cancelled (deadline passed); once placing
has begun it runs to completion, so no slot is ever half written by a job the
caller gave up on.

Why this is one module: a load and an audit are one read-and-verify path (``_load``), and the
job's states, its cancellation and the threads that run it are kept in step in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..core.cost import get_requests
from ..core.objects import (
    ForeignObject,
    HeaderCorrupt,
    ObjectFormatError,
    ObjectHeader,
    ObjectIdentity,
    SpanMismatch,
    decode_header,
    header_len,
    object_len,
    trailer_range,
    verify_page,
)
from ..store.base import ByteRange, ObjectStore, StoreError
from .copies import Copier, PageCopy
from .counters import Counters
from .hosttier import PAGE_ALIGN, HostTier, TierEntry
from .staging import LOAD, StagingBuffer, StagingPool, round_up
from .tiers import TierSpeed

log = logging.getLogger(__name__)

PENDING, PLACING, DONE, FAILED, CANCELLED = "pending", "placing", "done", "failed", "cancelled"


class LoadPlanError(Exception):
    """The load ops do not fit the object the plan names (a leader bug; never loaded)."""


@dataclass
class LoadJob:
    key: str
    group: int
    regions: tuple[Any, ...]
    identity: ObjectIdentity
    first: int  # the object's first ordinal for this shard (from the plan)
    count: int  # the object's page count for this shard
    last_digest: bytes
    #: (ordinal, slot) pairs to fill, slots unique.
    targets: list[tuple[int, int]]
    request_ids: set[int]
    is_async: bool
    deadline: float  # time.monotonic() past which the job may be cancelled
    #: slot -> the request it belongs to (to drop a failed request's targets).
    owners: dict[int, int] = field(default_factory=dict)
    #: False: an audit -- read and verify the pages, place nothing (``targets``' slots unused).
    place: bool = True
    state: str = PENDING
    error: BaseException | None = None
    event: Any = None
    buffer: StagingBuffer | None = None
    future: Future | None = field(default=None, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: ``time.monotonic()`` when it was submitted, and since when its read has been in flight
    #: (inf: none in flight -- not sent yet, or ended).
    submitted_at: float = float("inf")
    reading_since: float = float("inf")
    #: The leader found the object in rank 0's host tier (``LoadOp.host``).
    plan_host: bool = False
    #: This rank's tier entry to load from, or None; ``host_buf``: its buffer, retained for the
    #: job (``HostTier.acquire``) until it becomes the job's ``buffer``.
    host: TierEntry | None = None
    host_buf: StagingBuffer | None = None
    #: A tier reservation the whole object is read into from the store, or None.
    promote: TierEntry | None = None
    #: At most this many GETs per range (``ByteRange.parts``): the job's share of the store's
    #: connections among the objects of its load (``core.cost.stream_share``); 0: the store's split.
    streams: int = 0

    @property
    def finished(self) -> bool:
        return self.state in (DONE, FAILED, CANCELLED)

    def page_ranges(self) -> tuple[list[int], list[ByteRange]]:
        """Sorted unique page indexes, and the coalesced ranges that hold them."""
        pb = self.identity.page_bytes
        hl = header_len(self.count)
        idx = sorted({o - self.first for o, _ in self.targets})
        ranges: list[ByteRange] = []
        run_start = prev = -1
        for i in idx:
            if run_start < 0:
                run_start = prev = i
            elif i == prev + 1:
                prev = i
            else:
                ranges.append(ByteRange(hl + run_start * pb, (prev - run_start + 1) * pb))
                run_start = prev = i
        if run_start >= 0:
            ranges.append(ByteRange(hl + run_start * pb, (prev - run_start + 1) * pb))
        return idx, ranges

    def read_requests(self, page_bytes: int | None = None) -> tuple[int, int]:
        """GETs this job costs reading only its pages (as :meth:`Downloader._load` sends them:
        the header merged into the first range where they touch, the trailer apart), and reading
        the whole object (what a tier promotion reads). ``page_bytes``: the pages' real size
        where it is not the identity's (a replay's tier weighs a real model's pages)."""
        pb = page_bytes or self.identity.page_bytes
        idx, ranges = self.page_ranges()
        tagged = self.identity.integrity is not None
        pages = sum(get_requests(r.length // self.identity.page_bytes * pb) for r in ranges)
        pages += int(not idx or idx[0] != 0) + int(tagged)
        return pages, get_requests(object_len(self.count, pb, tagged))

    def release_if_complete(self, done: Any) -> bool:
        """Free the staging of a placed job once ``done(event)``; True when nothing is held any more."""
        with self.lock:
            if not self.finished:
                return False
            if self.buffer is None:
                return True
            # A failed or cancelled job's own thread frees its buffer (it may still be using it).
            if self.state != DONE or not done(self.event):
                return False
            self.buffer.release()
            self.buffer = None
            return True

    def drop_requests(self, request_ids: set[int], reason: BaseException) -> bool:
        """Forget the targets of failed requests if nothing was placed yet (cancel if none is left).

        True if the job will not write into those requests' slots; False if it already
        started placing (the caller must wait for its copies to complete).
        """
        with self.lock:
            if self.state != PENDING:
                return self.state in (FAILED, CANCELLED)
            self.targets = [(o, s) for o, s in self.targets if self.owners.get(s) not in request_ids]
            self.request_ids -= request_ids
            if not self.targets:
                self.state = CANCELLED
                self.error = reason
            return True

    def try_cancel(self, reason: BaseException) -> tuple[bool, bool]:
        """Cancel unless pages are already being placed.

        Returns (will not place, cancelled by this call).
        """
        with self.lock:
            if self.state == PENDING:
                self.state = CANCELLED
                self.error = reason
                return True, True
            return self.state in (FAILED, CANCELLED), False


class Downloader:
    def __init__(
        self,
        store: ObjectStore,
        pool: StagingPool,
        copier: Copier,
        *,
        threads: int = 8,
        counters: Counters | None = None,
        name: str = "s3kv-download",
        tier: HostTier | None = None,
        verify_host: bool = False,
        speeds: dict[str, TierSpeed] | None = None,
    ):
        self.store = store
        self.pool = pool
        self.copier = copier
        self.counters = counters or Counters()
        self.tier = tier
        #: Re-check every page's checksum on a host-tier hit (``S3KV_HOST_CACHE_VERIFY``).
        self.verify_host = verify_host
        #: Load speed per tier ("host", "s3"), measured here: what a hit is worth loading.
        self.speeds = speeds if speeds is not None else {"host": TierSpeed(), "s3": TierSpeed()}
        # ``threads`` objects being read at once, and as many threads again so that verifying
        # and placing one object's pages overlaps the next objects' GETs instead of idling a
        # connection (measured on the 16-core GPU host: a 15-25% bubble at 3-4 GB/s without it).
        # Objects, not requests: each object's parts (store.range_split_bytes) go out in
        # parallel on top, up to the store's connection cap. One S3 stream carries on the order
        # of 100 MB/s, so streams are what reaches GB/s from a real bucket; a gate counting
        # requests (tried: 8 streams in all) measured no faster on loopback SeaweedFS, where
        # one stream is not the limit, and would cap a real bucket at a quarter of the streams.
        self._gets = threading.BoundedSemaphore(max(1, threads))
        self._executor = ThreadPoolExecutor(max_workers=2 * max(1, threads), thread_name_prefix=name)
        # Audits (``place=False``) one at a time on their own thread: they follow a failed load,
        # and a long prompt's plan can leave hundreds of objects to audit -- gigabytes that must
        # not take the download threads (and the staging) from the loads requests wait for. A
        # daemon thread, not an executor's: at interpreter exit Python joins executor threads
        # after they ran their whole queue, and the engine's exit must not wait for audits.
        self._name = name
        self._audit_q: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._audit_thread: threading.Thread | None = None
        self._audit_lock = threading.Lock()
        self._closed = False
        #: ``time.monotonic()`` when a load's read last ended (bytes or an error): the store was
        #: answering then. What tells a job queued behind hung reads from one behind busy ones.
        self.last_read_end = time.monotonic()

    def submit(self, job: LoadJob) -> LoadJob:
        job.submitted_at = time.monotonic()
        if job.place:
            job.future = self._executor.submit(self._run, job)
            return job
        job.future = Future()
        with self._audit_lock:
            if not self._closed:
                if self._audit_thread is None:
                    self._audit_thread = threading.Thread(target=self._audits, name=f"{self._name}-audit",
                                                          daemon=True)
                    self._audit_thread.start()
                self._audit_q.put(job)
                return job
        job.future.cancel()  # closed: never run (its callbacks see a job still pending)
        return job

    def audits_queued(self) -> int:
        return self._audit_q.qsize()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._audit_lock:
            self._closed = True
            self._audit_q.put(None)

    def _audits(self) -> None:
        while True:
            job = self._audit_q.get()
            if job is None or self._closed:
                if job is not None and job.future is not None:
                    job.future.cancel()
                break
            fut = job.future
            if fut is None or not fut.set_running_or_notify_cancel():
                continue
            self._run(job)  # never raises
            fut.set_result(None)
        while True:  # closed: what is left is never run
            try:
                job = self._audit_q.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future is not None:
                job.future.cancel()

    # -- on a download thread ---------------------------------------------
    def _run(self, job: LoadJob) -> None:
        try:
            self._load(job)
        except BaseException as e:  # noqa: BLE001 - every failure fails the job, never the thread
            with job.lock:
                if job.state == PLACING:
                    # Copies may have been partly issued: the job is failed, never done.
                    log.error("s3kv: load of %s failed while placing pages: %s", job.key, e)
                cancelled = job.state == CANCELLED  # already counted by whoever cancelled it
                if not cancelled:
                    job.state = FAILED
                    job.error = e
                if job.buffer is not None:
                    job.buffer.release()
                    job.buffer = None
            self._drop_tier_refs(job)
            if not cancelled and job.place:  # an audit's failure is counted by its caller
                self.counters.add("loads_failed_objects")
            if not isinstance(e, (StoreError, ObjectFormatError, LoadPlanError)):
                log.exception("s3kv: unexpected error loading %s", job.key)

    def _drop_tier_refs(self, job: LoadJob) -> None:
        """What the job holds of the host tier and will not use: released (a reservation it was to
        fill becomes a ghost)."""
        with job.lock:
            held, job.host_buf = job.host_buf, None
            promote, job.promote = job.promote, None
        if held is not None:
            held.release()
        if promote is not None and self.tier is not None:
            self.tier.fail(promote)

    def _load(self, job: LoadJob) -> None:
        if job.state != PENDING:
            self._drop_tier_refs(job)
            return
        pb = job.identity.page_bytes
        idx, ranges = job.page_ranges()
        if not idx:
            raise LoadPlanError(f"no pages to load from {job.key}")
        if idx[0] < 0 or idx[-1] >= job.count:
            raise LoadPlanError(
                f"ordinals {idx[0] + job.first}..{idx[-1] + job.first} outside the object's "
                f"span {job.first}+{job.count} for shard {job.identity.shard}"
            )
        if job.host is not None:  # never: ``serve_hits`` placed it or handed it back without its entry
            self._unhost(job)
        if job.promote is not None:
            self._load_whole(job, idx)
            return
        hl = header_len(job.count)
        nbytes = len(idx) * pb
        # Bytes land in staging straight from the store (one host copy): the header just in
        # front of the first page, the pages packed in index order from a page-aligned offset.
        base = round_up(hl, PAGE_ALIGN)
        # An audit reads into memory of its own: the pinned staging is the loads'.
        buf = self.pool.try_acquire(base + nbytes, LOAD) if job.place else StagingBuffer.standalone(base + nbytes)
        if buf is None:
            self.counters.add("load_staging_fallbacks")
            buf = StagingBuffer.standalone(base + nbytes)
        with job.lock:
            job.buffer = buf
        page_views: list[memoryview] = []
        pos = base
        for r in ranges:
            page_views.append(buf.memoryview(pos, r.length))
            pos += r.length
        if ranges and ranges[0].offset == hl:
            # The first wanted page follows the header: one request for both (a whole-object
            # load is then a single GET, as cheap as any client's).
            want = [ByteRange(0, hl + ranges[0].length), *ranges[1:]]
            into = [buf.memoryview(base - hl, hl + ranges[0].length), *page_views[1:]]
        else:
            want = [ByteRange(0, hl), *ranges]
            into = [buf.memoryview(base - hl, hl), *page_views]
        # Integrity on: the trailer of keyed tags rides in the same request wave.
        tr = trailer_range(job.identity, job.count)
        trailer: bytearray | None = None
        if tr is not None:
            trailer = bytearray(tr[1])
            want.append(ByteRange(*tr))
            into.append(memoryview(trailer))
        # An audit runs on its own thread and takes no slot of the loads' (one stream beside them).
        with self._gets if job.place else contextlib.nullcontext():
            if job.state != PENDING:  # cancelled while it waited for a connection slot
                with job.lock:
                    job.buffer = None
                buf.release()
                return
            t0 = job.reading_since = time.monotonic()
            if job.streams:
                want = [dataclasses.replace(r, parts=job.streams) for r in want]
            self.counters.add("get_requests", sum(get_requests(r.length, cap=r.parts) for r in want))
            try:
                self.store.get_ranges_into(job.key, want, into)
            finally:
                job.reading_since = float("inf")
                if job.place:
                    self.last_read_end = time.monotonic()
        if job.place:
            self.speeds["s3"].observe(sum(r.length for r in want), time.monotonic() - t0)
        header = decode_header(
            buf.memoryview(base - hl, hl), job.identity, job.key, None if trailer is None else memoryview(trailer)
        )
        _same_object(job, header)

        # Verify every page in staging before anything reaches the device.
        where: dict[int, int] = {}
        for k, i in enumerate(idx):
            verify_page(header, i, buf.memoryview(base + k * pb, pb), job.key)
            where[i] = base + k * pb
        self._verified(job.key)
        self._place(job, buf, where, pb)

    # -- the host tier -------------------------------------------------------------------------
    def _place(self, job: LoadJob, buf: StagingBuffer, page_at: dict[int, int], pb: int) -> None:
        """Copy the verified pages (page index -> offset in ``buf``) into the job's slots."""
        with job.lock:
            if job.state != PENDING or not job.place:  # cancelled meanwhile; an audit
                job.buffer = None
                buf.release()
                if job.state == PENDING:
                    job.state = DONE
                return
            job.state = PLACING
            copies = [PageCopy(job.regions, slot, buf.tensor, page_at[o - job.first]) for o, slot in job.targets]
        event = self.copier.load(copies)
        with job.lock:
            job.event = event
            if event is None:  # CPU: the copy is complete; the buffer may go
                job.buffer = None
                buf.release()
            job.state = DONE
        self.counters.add("pages_loaded", len(copies))
        self.counters.add("bytes_loaded", len(copies) * pb)
        self.counters.add("objects_loaded")

    def _check(self, job: LoadJob, e: TierEntry, buf: StagingBuffer) -> tuple[dict[int, int], ObjectHeader]:
        """Verify the whole object read into the tier entry's buffer ``buf`` against the plan:
        header, trailer, every page; (page index -> offset of the page in ``buf``, the header)."""
        pb = job.identity.page_bytes
        trailer = None
        if job.identity.integrity is not None:
            trailer = buf.memoryview(e.base + e.count * pb, e.size - e.header_len - e.count * pb)
        header = decode_header(buf.memoryview(e.start, e.header_len), job.identity, job.key, trailer)
        _same_object(job, header)
        where = {i: e.base + i * pb for i in range(e.count)}
        for i, off in where.items():
            verify_page(header, i, buf.memoryview(off, pb), job.key)
        return where, header

    def serve_hits(self, jobs: Sequence[LoadJob]) -> list[LoadJob]:
        """Place the jobs whose object this rank's host tier holds (``job.host``, acquired in plan
        order) here, on the calling thread; the others are returned untouched, with those whose
        entry failed its check (read from the store instead).

        Why not on a download thread: the bytes are in (pinned) memory already and the copies are
        asynchronous on the load stream, so a thread hides nothing -- and its hand-off, the GIL
        passed back and forth and one copy call per object cost more than the copies of a 1 MiB
        page object (issue 39's bar is 0.9x a pinned memcpy). Each object is checked (``_hit``)
        before any of its pages is enqueued; all the hits' copies go in one ``Copier.load_each``
        (one completion event), object after object, so the copy engine starts on the first while
        the next is checked."""
        rest = [j for j in jobs if j.host is None]
        hits = [j for j in jobs if j.host is not None]
        if not hits:
            return rest
        t0 = time.monotonic()
        placed: list[LoadJob] = []

        def pages() -> Any:
            for job in hits:
                copies = self._hit(job)
                if copies is None:
                    rest.append(job)
                else:
                    placed.append(job)
                    yield copies

        try:
            event = self.copier.load_each(pages())
        except Exception as exc:  # noqa: BLE001 - a failed copy fails its loads, never the caller
            # Nothing it enqueued is in flight any more (``load_each``); what it never reached
            # reads the store.
            log.error("s3kv: copying %d host tier hit(s) to the device failed: %s", len(placed), exc)
            for job in placed:
                with job.lock:
                    job.state, job.error = FAILED, exc
                    buf, job.buffer = job.buffer, None
                if buf is not None:
                    buf.release()
            self.counters.add("loads_failed_objects", len(placed))
            done = {id(j) for j in placed} | {id(j) for j in rest}
            for job in hits:
                if id(job) not in done:
                    self._unhost(job)
                    rest.append(job)
            return rest
        pages_n = hit_bytes = 0
        for job in placed:
            with job.lock:
                job.event = event
                if event is None:  # CPU: the copies are complete; the buffer may go
                    buf, job.buffer = job.buffer, None
                    assert buf is not None
                    buf.release()
                job.state = DONE
            pb = job.identity.page_bytes
            pages_n += len(job.targets)
            hit_bytes += len({o for o, _ in job.targets}) * pb
        if placed:
            if event is None:  # complete on return (CPU); a GPU's bandwidth is measured at registration
                self.speeds["host"].observe(hit_bytes, time.monotonic() - t0)
            c = self.counters
            c.add("pages_loaded", pages_n)
            c.add("bytes_loaded", sum(len(j.targets) * j.identity.page_bytes for j in placed))
            c.add("objects_loaded", len(placed))
            c.add("host_hits", len(placed))
            c.add("host_hit_bytes", hit_bytes)
        return rest

    def _hit(self, job: LoadJob) -> list[PageCopy] | None:
        """The page copies of a host tier hit, its entry checked against the plan (``job.buffer``
        then holds the entry's bytes for the job, state ``PLACING``); None when the entry failed
        (the job is left to read the store, without it)."""
        e = job.host
        with job.lock:
            buf, job.host_buf = job.host_buf, None  # retained for this job by ``HostTier.acquire``
            job.buffer = buf
        assert e is not None and buf is not None
        pb = job.identity.page_bytes
        try:
            if not job.targets:
                raise LoadPlanError(f"no pages to load from {job.key}")
            h = e.header
            if h is None or e.framing(buf) != e.admitted:
                # The header and trailer were checked when the bytes were admitted (``HostTier.
                # mark_ready``); bytes that differ from them now are not those bytes.
                raise HeaderCorrupt("the host tier's copy changed since it was admitted", job.key)
            if h.identity != job.identity:
                raise ForeignObject("the host tier's copy has another identity than the plan's", job.key)
            _same_object(job, h)
            if self.verify_host:
                for i in sorted({o - job.first for o, _ in job.targets}):
                    verify_page(h, i, buf.memoryview(e.base + i * pb, pb), job.key)
        except (ObjectFormatError, LoadPlanError) as exc:
            if isinstance(exc, SpanMismatch):
                # Another version of the object (the same blocks' KV from another first block: a
                # seal of this rank, where the store kept an earlier writer's): both are right, the
                # plan names the store's. Kept, and read from the store this time.
                self.counters.add("host_divergence")
            else:
                log.error("s3kv: host tier copy of %s failed its check (%s); reading the store", job.key, exc)
                self.counters.add("host_bad")
                if self.tier is not None:
                    self.tier.fail(e)  # a ghost: never served again, still accounted as on every rank
            self._unhost(job)
            return None
        with job.lock:
            job.state = PLACING
        base = e.base - job.first * pb
        return [PageCopy(job.regions, slot, buf.tensor, base + o * pb) for o, slot in job.targets]

    def _unhost(self, job: LoadJob) -> None:
        """The job will not load from its tier entry: what it holds of it is released."""
        with job.lock:
            job.host = None
            buf, job.buffer = job.buffer, None
            held, job.host_buf = job.host_buf, None
        for b in (buf, held):
            if b is not None:
                b.release()

    def _load_whole(self, job: LoadJob, idx: Sequence[int]) -> None:
        """Read the whole object from the store into its tier reservation, verify it whole, admit
        it to the tier, then place the job's pages from there."""
        e = job.promote
        tier = self.tier
        assert e is not None and tier is not None
        with job.lock:  # the job's own reference: an eviction meanwhile keeps the bytes
            buf, job.host_buf = job.host_buf, None
            job.buffer = buf
        assert buf is not None
        with self._gets:
            if job.state != PENDING:  # cancelled while it waited for a connection slot
                with job.lock:
                    job.buffer = None
                    job.promote = None
                buf.release()
                tier.fail(e)
                return
            t0 = job.reading_since = time.monotonic()
            self.counters.add("get_requests", get_requests(e.size, cap=job.streams))
            try:
                self.store.get_ranges_into(job.key, [ByteRange(0, e.size, job.streams)],
                                           [buf.memoryview(e.start, e.size)])
            finally:
                job.reading_since = float("inf")
                self.last_read_end = time.monotonic()
            seconds = time.monotonic() - t0
        self.speeds["s3"].observe(e.size, seconds)
        where, header = self._check(job, e, buf)  # the tier keeps only verified bytes
        job.promote = None
        if tier.mark_ready(e, header, stored=True):
            self.counters.add("host_promoted")
        self._place(job, buf, {i: where[i] for i in idx}, job.identity.page_bytes)



    def _verified(self, key: str) -> None:
        """Tell the store a load of ``key`` passed its checks (refresh on hit waits for this);
        best effort: a failing hook never fails the load."""
        try:
            self.store.note_verified(key)
        except Exception:  # noqa: BLE001 - the load is good whatever a refresh does
            log.debug("s3kv: note_verified(%s) failed", key, exc_info=True)


def _same_object(job: LoadJob, header: ObjectHeader) -> None:
    """The object is the one the plan names: its span for this shard and its chain digest."""
    if header.first_ordinal != job.first or header.page_count != job.count:
        # The plan's span ends at the block the key names (checked on HEAD): a header
        # claiming other blocks is span poisoning, never loaded.
        raise SpanMismatch(
            f"object holds ordinals {header.first_ordinal}+{header.page_count}, "
            f"the plan expected {job.first}+{job.count}",
            job.key,
        )
    if header.last_digest != job.last_digest:
        raise LoadPlanError(f"object {job.key!r} names another chain digest than its key")


def build_jobs(
    loads: Sequence[Any],
    *,
    tp_rank: int,
    is_async: Any,
    resolve: Any,
    deadline: float,
) -> tuple[list[LoadJob], dict[int, tuple[str | None, str]]]:
    """Group ``LoadOp``s by (object key, async) into jobs.

    ``resolve(op) -> (key, group regions, identity)`` (may raise ``LoadPlanError``);
    ``is_async(request_id) -> bool``. Returns the jobs and, per request whose ops do
    not fit (no span for this shard, a slot outside the pool or asked for twice with
    different ordinals, ...), ``(key, reason)``: those ops are left out and the
    request must be failed by the caller.
    """
    jobs: dict[tuple[str, bool], LoadJob] = {}
    #: per job: slot -> the ordinal it gets.
    taken: dict[tuple[str, bool], dict[int, int]] = {}
    errors: dict[int, tuple[str | None, str]] = {}
    for op in loads:
        key: str | None = None
        try:
            key, regions, identity = resolve(op)
            if len(op.ordinals) != len(op.slots):
                raise LoadPlanError(f"{len(op.ordinals)} ordinals but {len(op.slots)} slots")
            if tp_rank >= len(op.obj.spans):
                raise LoadPlanError(f"the object has no span for shard {tp_rank}")
            first, count = (int(x) for x in op.obj.spans[tp_rank])
            if any(int(f) + int(c) != first + count for f, c in op.obj.spans):
                # One key (the digest of the last block) per object: every shard's span ends there.
                raise LoadPlanError(f"the object's spans {op.obj.spans} do not end at one block")
            num_slots = min(int(r.num_slots) for r in regions)
            ords = list(map(int, op.ordinals))
            slots = list(map(int, op.slots))
            if slots and not (0 <= min(slots) and max(slots) < num_slots):
                bad = next(s for s in slots if not 0 <= s < num_slots)
                raise LoadPlanError(f"slot {bad} outside [0, {num_slots})")
            if ords and not (first <= min(ords) and max(ords) < first + count):
                bad = next(o for o in ords if not first <= o < first + count)
                raise LoadPlanError(f"ordinal {bad} outside the object's span {first}+{count}")
            a = bool(is_async(op.request_id))
            job = jobs.get((key, a))
            if job is not None and (job.first, job.count) != (first, count):
                raise LoadPlanError("the object is named with two different spans in one plan")
            have = taken.get((key, a), {})
            asked = dict(zip(slots, ords, strict=True))  # in order of first appearance
            if len(asked) != len(slots) or have:
                seen = dict(have)
                for o, s in zip(ords, slots, strict=True):
                    if seen.setdefault(s, o) != o:
                        raise LoadPlanError(f"slot {s} asked for ordinals {seen[s]} and {o}")
        except LoadPlanError as e:
            errors.setdefault(op.request_id, (key, str(e)))
            continue
        if job is None:
            job = LoadJob(
                key=key,
                group=op.obj.group,
                regions=regions,
                identity=identity,
                first=first,
                count=count,
                last_digest=op.obj.last_digest,
                targets=[],
                request_ids=set(),
                is_async=a,
                deadline=deadline,
            )
            jobs[(key, a)] = job
            taken[(key, a)] = have
        job.request_ids.add(op.request_id)
        job.plan_host = job.plan_host or bool(getattr(op, "host", False))
        new = {s: o for s, o in asked.items() if s not in have} if have else asked
        job.targets += zip(new.values(), new, strict=True)  # (ordinal, slot)
        job.owners.update(dict.fromkeys(new, op.request_id))
        have.update(new)
    return list(jobs.values()), errors
