"""Background uploads of sealed objects from host staging.

The worker hands over an :class:`UploadJob` per ``SealOp``: the staging buffer
(with a reference held for this job), how many pages to pack, the object's
identity and name, and the completion event of the copies that filled those
pages. An upload thread waits on that event (never the forward stream), packs
``encode_header`` over the staged pages plus the pages themselves as a list of
memoryviews (no join copy), and calls ``store.put`` (write-once: ``False`` means
another writer already stored it, which is success).

With a host tier (:mod:`.hosttier`) the job carries the tier entry its seal reserved: the
pages are copied from staging into the tier first and hashed *there* (the checksums cover the
bytes the tier serves), the header lands in front of them, the entry becomes visible, and the
store gets the tier's bytes -- when the seal's ``to_s3`` is ``now``; ``evict`` and ``never``
stay in the tier (it writes ``evict`` objects back itself). The staging reference is released
as soon as the pages are in the tier.

A failed put (any :class:`StoreError`, after the store's own retries) is a
dropped save: a log line and a counter, never an error to the engine. Confirmed
creations are reported to the engine's key index (:class:`KnownKeys`). Either way the job's
buffer reference is released, so the buffer is freed after the last seal that
used it.

The queue is bounded; :meth:`Uploader.submit` never blocks and returns False
when it is full (the caller drops the save and counts it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.cost import MULTIPART_THRESHOLD, PART_SIZE, put_requests
from ..core.objects import ObjectIdentity, ObjectSpan, encode_object, object_metadata
from ..store.base import ObjectStore, StoreError
from ..store.breaker import StoreUnavailable
from .counters import Counters
from .hosttier import NOW, HostTier, TierEntry
from .staging import StagingBuffer

log = logging.getLogger(__name__)


@dataclass
class UploadJob:
    key: str
    identity: ObjectIdentity
    #: Holds one reference for this job; released when the job ends, however it ends.
    buffer: StagingBuffer
    first: int
    count: int
    last_digest: bytes
    #: Completion event of the copies that filled pages [0, count) (None: already complete).
    ready: Any = None
    request_id: int = -1
    #: The host tier's entry for this object (reserved at the seal, in plan order), or None.
    host: TierEntry | None = None
    #: ``SealOp.to_s3``: write to the store now, or leave it to the host tier.
    to_s3: str = NOW

    def pages(self) -> list[memoryview]:
        pb = self.identity.page_bytes
        return [self.buffer.memoryview(i * pb, pb) for i in range(self.count)]


class KnownKeys(Protocol):
    """Where confirmed uploads are reported: the engine's key index (``s3kv.engine.index``).

    A protocol, not an import: the transfer layer sits below the engine and knows only this call.
    """

    def put_written(self, key: str, span: ObjectSpan) -> None: ...


_STOP = object()


class Uploader:
    def __init__(
        self,
        store: ObjectStore,
        *,
        threads: int = 4,
        queue_size: int = 1024,
        index: KnownKeys | None = None,
        counters: Counters | None = None,
        wait_event: Callable[[Any], None] | None = None,
        name: str = "s3kv-upload",
    ):
        self.store = store
        #: Set once the worker knows its layout (``register_layout``): where seals land first.
        self.tier: HostTier | None = None
        self.index = index
        self.counters = counters or Counters()
        #: S3 puts bodies this large as multipart uploads of ``part_size`` parts (S3KV_MULTIPART_*):
        #: what ``put_requests`` counts (PUT-class requests, as S3 bills them).
        self.multipart_threshold = MULTIPART_THRESHOLD
        self.part_size = PART_SIZE
        self._wait_event = wait_event or (lambda ev: ev.synchronize() if ev is not None else None)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._cond = threading.Condition()
        self._pending = 0  # queued + running
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    # -- producer side ----------------------------------------------------
    def submit(self, job: UploadJob) -> bool:
        """Queue a job. False (nothing queued; caller keeps its reference) if closed or full."""
        with self._cond:
            if self._closed:
                return False
            self._pending += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
            return False
        return True

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload finished. True if drained, False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = 30.0, cancel: bool = False) -> bool:
        """Stop the threads: drain first (or drop what is still queued with ``cancel``).

        Returns True if every job ended (uploaded, failed or cancelled) in time.
        """
        with self._cond:
            if self._closed:
                already = True
            else:
                self._closed = True
                already = False
        if cancel:
            self._cancel_queued()
        drained = self.flush(timeout)
        if not drained:
            self._cancel_queued()
        if not already:
            for _ in self._threads:
                self._queue.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return drained

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is _STOP:
                continue
            job.buffer.release()
            if job.host is not None and self.tier is not None:
                self.tier.fail(job.host)
            self.counters.add("uploads_cancelled")
            self._done()

    def _done(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    # -- upload threads ---------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            held = None
            try:
                held = self._upload(job)
            except Exception:  # noqa: BLE001 - a thread must survive anything a job does
                log.exception("s3kv: upload of %s failed unexpectedly; save dropped", job.key)
                self.counters.add("saves_dropped_error")
                if job.host is not None and self.tier is not None and not job.host.ready:
                    self.tier.fail(job.host)
            finally:
                job.buffer.release()
                if held is not None:
                    held.release()
                self._done()

    def _upload(self, job: UploadJob) -> StagingBuffer | None:
        """Tier first (if any), then the store (``now``). Returns a tier buffer reference to release."""
        self._wait_event(job.ready)
        pages: list[Any] = job.pages()
        held = self._to_tier(job)
        if held is not None:
            assert job.host is not None
            pb = job.identity.page_bytes
            pages = [held.memoryview(job.host.base + i * pb, pb) for i in range(job.count)]
        # With integrity keys in the identity, both are signed for this key.
        body = encode_object(job.identity, job.first, job.last_digest, pages, job.key)
        if held is not None and self.tier is not None and job.host is not None:
            if self.tier.commit(job.host, body):
                self.counters.add("host_inserted")
        if job.to_s3 != NOW:
            self.counters.add("host_only_saves")
            return held
        if self._put(job, body) and self.tier is not None and job.host is not None:
            self.tier.mark_stored(job.host)
        return held

    def _to_tier(self, job: UploadJob) -> StagingBuffer | None:
        """Copy the pages into the job's tier entry; the entry's buffer, retained, or None (no
        entry, a ghost, or evicted meanwhile)."""
        if self.tier is None or job.host is None:
            return None
        return self.tier.fill_pages(job.host, job.buffer.view(0, job.count * job.identity.page_bytes))

    def _put(self, job: UploadJob, body: list[Any]) -> bool:
        """Write-once PUT of ``body``; True when the store holds the object afterwards."""
        nbytes = sum(memoryview(b).nbytes for b in body)
        meta = object_metadata(job.identity, job.first, job.count, job.key)
        self.counters.add("put_requests", put_requests(nbytes, self.multipart_threshold, self.part_size))
        try:
            created = self.store.put(job.key, body, meta)
        except StoreUnavailable:
            # The breaker is open: the store is down, not this object (the breaker said so once).
            self.counters.add("saves_dropped_breaker_open")
            return False
        except StoreError as e:
            log.warning("s3kv: save of %s dropped after store error: %s", job.key, e)
            self.counters.add("saves_dropped_store_error")
            return False
        if created:
            self.counters.add("objects_uploaded")
            self.counters.add("bytes_uploaded", nbytes)
            if self.index is not None:
                self.index.put_written(job.key, ObjectSpan(job.first, job.count))
        else:
            self.counters.add("objects_already_present")
        return True
