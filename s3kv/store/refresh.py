"""Refresh on hit: keep a hot prefix alive under short retention.

S3 has no access time, and s3kv's retention (``s3kv gc --expired``, docs/operations.md) deletes
by ``LastModified``. So an engine that loads an object bumps its ``LastModified`` with a
server-side copy of the object onto itself (:meth:`ObjectStore.touch`: same bytes, same
metadata -- content stays write-once; one PUT-class request, no bytes through the engine).

Rate limit, per object and engine: no refresh of an object this engine wrote or refreshed less
than ``interval_s`` (half the retention) ago -- an object read by many requests costs one copy
per half retention, and its age never passes the retention while it is read at least that
often. Refreshes run on one background thread from a bounded queue; a full queue or a failed
copy drops the refresh (the object may expire and be recomputed: a miss, never a wrong byte).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from .base import Buffer, ByteRange, ObjectStore, StoreError, StoreWrapper

log = logging.getLogger(__name__)

#: Objects whose last refresh this engine remembers (~150 bytes each).
MAX_REMEMBERED = 200_000


class RefreshOnHit(StoreWrapper):
    def __init__(
        self,
        inner: ObjectStore,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
        queue_size: int = 1024,
    ):
        super().__init__(inner)
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: OrderedDict[str, float] = OrderedDict()  # key -> last write or refresh here
        self.refreshed = self.dropped = 0
        self._queue: queue.Queue[str | None] | None = None
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(target=self._run, name="s3kv-refresh", daemon=True)
            self._thread.start()

    def _note(self, key: str, now: float) -> None:
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)

    def put(self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None) -> bool:
        created = self.inner.put(key, data, metadata)
        with self._lock:
            self._note(key, self._clock())
        return created

    def _hit(self, key: str) -> None:
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                return
            self._note(key, now)
        if self._queue is None:
            self._touch(key)
            return
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            self.dropped += 1

    def _touch(self, key: str) -> None:
        try:
            if self.inner.touch(key):
                self.refreshed += 1
        except StoreError as exc:  # best effort: the object may expire and be recomputed
            self.dropped += 1
            log.debug("refresh of %s failed: %s", key, exc)

    def _run(self) -> None:
        assert self._queue is not None
        while (key := self._queue.get()) is not None:
            self._touch(key)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        out = self.inner.get_ranges(key, ranges)
        self._hit(key)
        return out

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        self.inner.get_ranges_into(key, ranges, out)
        self._hit(key)

    def close(self) -> None:
        if self._queue is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
        self.inner.close()
