"""The download threads' gate on GET requests in flight (see :class:`RequestSlots`)."""

from __future__ import annotations

import threading
from collections import deque


class RequestSlots:
    """At most ``capacity`` GET requests in flight across jobs, granted first come, first served.

    A job takes as many slots as the requests its ranges split into (capped at the capacity):
    ``download_threads`` then bounds the streams on the wire, as a plain client's threads do.
    Counting jobs instead let a 32 MiB object open 4 streams per slot, so the setting did not
    say what reached the store. On the 16-core GPU host against loopback SeaweedFS, more
    streams did not load faster (splitting into 4 MiB parts was 12-38% slower); with this gate
    loads measured the same as before within run-to-run noise. A lone job still gets every
    slot it can use (a short prompt's one object arrives in parallel parts). FIFO, so a large
    job is not starved by a run of small ones.
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._free = self.capacity
        self._queue: deque[object] = deque()
        self._cv = threading.Condition()

    def acquire(self, n: int) -> int:
        """Wait for ``min(n, capacity)`` slots; returns how many were taken (give them back)."""
        n = max(1, min(n, self.capacity))
        me = object()
        with self._cv:
            self._queue.append(me)
            while self._queue[0] is not me or self._free < n:
                self._cv.wait()
            self._queue.popleft()
            self._free -= n
            self._cv.notify_all()  # the next in line may fit in what is left
        return n

    def release(self, n: int) -> None:
        with self._cv:
            self._free += n
            self._cv.notify_all()
