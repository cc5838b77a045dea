"""Refresh on hit: keep a hot prefix alive under short retention.

S3 has no access time, and s3kv's retention (``s3kv gc --expired``, docs/operations.md) deletes
by ``LastModified``. So an engine that loads an object bumps its ``LastModified`` with a
server-side copy of the object onto itself (:meth:`ObjectStore.touch`: same bytes, same
metadata -- content stays write-once; one PUT-class request, no bytes through the engine) --
once the load passed its checks (:meth:`ObjectStore.note_verified`, from
``transfer/download.py``), never on the GET alone: a garbage object's life is not extended.

Rate limit, per object and engine: no refresh of an object this engine wrote or refreshed less
than ``interval_s`` (half the retention) ago -- an object read by many requests costs one copy
per half retention, and its age never passes the retention while it is read at least that
often. The store skips the copy of an object last modified less than ``interval_s`` ago
(another engine refreshed it): one HEAD instead. Refreshes run on one background thread from a
bounded queue; a full queue or a failed copy drops the refresh (the object may expire and be
recomputed: a miss, never a wrong byte). Every outcome is counted (``s3kv_refresh_total``), and
the first copy the bucket refuses is logged as a WARNING: a bucket policy that denies CopyObject
(the Terraform module's ``enforce_write_once``) turns refresh off, and hot prefixes then expire
``retention_h`` after their write.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .base import TOUCH_REFRESHED, Buffer, ByteRange, ObjectStore, PermissionDenied, StoreError, StoreWrapper

log = logging.getLogger(__name__)

#: Objects whose last refresh this engine remembers (~150 bytes each).
MAX_REMEMBERED = 200_000
#: The refresh thread ends after this long without work (started again on demand).
IDLE_S = 5.0


class RefreshOnHit(StoreWrapper):
    def __init__(
        self,
        inner: ObjectStore,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
        queue_size: int = 1024,
        on_outcome: Callable[[str], None] | None = None,
    ):
        super().__init__(inner)
        self.interval_s = interval_s
        self._clock = clock
        self._on_outcome = on_outcome
        self._warned = False
        self._lock = threading.Lock()
        self._last: OrderedDict[str, float] = OrderedDict()  # key -> last write or refresh here
        self.refreshed = self.dropped = self._busy = 0
        self._queue: queue.Queue[str | None] | None = queue.Queue(maxsize=queue_size) if background else None
        self._thread: threading.Thread | None = None

    def _note(self, key: str, now: float) -> None:
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)

    def put(self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None) -> bool:
        created = self.inner.put(key, data, metadata)
        if created:  # not when another writer's object was there: its age is not ours to know
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
        with self._lock:
            self._busy += 1  # queued or running
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            with self._lock:
                self._busy -= 1
            self.dropped += 1
            self._count("dropped")
            return
        with self._lock:
            # Started on demand and gone after IDLE_S without work: a runtime whose store its
            # caller owns is never closed, and must not leave a thread behind.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="s3kv-refresh", daemon=True)
                self._thread.start()

    def _count(self, outcome: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    def _touch(self, key: str) -> None:
        try:
            outcome = self.inner.touch(key, self.interval_s)
        except PermissionDenied as exc:
            self.dropped += 1
            self._count("denied")
            if not self._warned:  # once: every refresh fails the same way
                self._warned = True
                log.warning(
                    "s3kv: refresh on hit is refused by the bucket (%s); hot prefixes will expire "
                    "retention_h after their write. A bucket policy that denies CopyObject under "
                    "the prefix (the Terraform module's enforce_write_once) does this: set "
                    "enforce_write_once=false, or S3KV_REFRESH_ON_HIT=false with a longer retention "
                    "(docs/operations.md)", exc)
            return
        except StoreError as exc:  # best effort: the object may expire and be recomputed
            self.dropped += 1
            self._count("failed")
            log.debug("refresh of %s failed: %s", key, exc)
            return
        if outcome == TOUCH_REFRESHED:
            self.refreshed += 1
        self._count(outcome)

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            try:
                key = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if key is None:
                return
            self._touch(key)
            with self._lock:
                self._busy -= 1

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every queued refresh has run (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._busy == 0:
                return True
            time.sleep(0.01)
        return False

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        self.inner.get_ranges_into(key, ranges, out)  # forwarded: the loader's path to the store

    def note_verified(self, key: str) -> None:
        """A load of ``key`` passed its checks: a hit. Not on the GET itself: bytes that fail
        their checksums or tags (a planted or corrupt object) must not have their life extended
        (issue 37) -- the copy would keep garbage alive for another retention."""
        self._hit(key)
        self.inner.note_verified(key)

    def close(self) -> None:
        if self._queue is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
        self.inner.close()


def set_refresh_interval(store: Any, interval_s: float) -> None:
    """Follow the retention gc deletes by (the leader's plan carries it): the ``RefreshOnHit``
    in ``store``'s wrappers, if any, refreshes every ``interval_s``."""
    while store is not None:
        if isinstance(store, RefreshOnHit):
            store.interval_s = interval_s
            return
        store = getattr(store, "inner", None)
