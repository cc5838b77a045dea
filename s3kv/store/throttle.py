"""Latency and bandwidth shaping around any store (benchmarks and tests on a fast local store).

Model: every call costs ``latency_s`` (one round trip; a HEAD batch counts as one because a
real store fans it out in parallel), then its bytes flow through a link of
``bandwidth_bytes_per_s`` per direction. The link is *shared*: concurrent transfers queue on
it, so N threads together get the bandwidth, not N times it - which is what makes a
bandwidth-bound benchmark honest. Upload and download are separate links (full duplex).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from .base import Buffer, ByteRange, Fetched, HeadBatch, ObjectInfo, ObjectStore, StoreWrapper, total_size


class _Link:
    """A FIFO pipe of fixed bandwidth: each transfer reserves the next free slot in time."""

    def __init__(self, bytes_per_s: float | None):
        self._rate = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0

    def transfer(self, nbytes: int) -> None:
        if not self._rate or nbytes <= 0:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self._rate
            done_at = self._free_at
        # Sleep outside the lock: other threads reserve their slots meanwhile.
        delay = done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ThrottledStore(StoreWrapper):
    def __init__(
        self, inner: ObjectStore, latency_s: float = 0.0, bandwidth_bytes_per_s: float | None = None
    ):
        if latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be > 0 (or None for unlimited)")
        super().__init__(inner)
        self.latency_s = latency_s
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._up = _Link(bandwidth_bytes_per_s)
        self._down = _Link(bandwidth_bytes_per_s)

    def _rtt(self) -> None:
        if self.latency_s:
            time.sleep(self.latency_s)

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        self._rtt()
        return self.inner.head_many(keys)

    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        self._rtt()
        self._up.transfer(total_size(data))
        return self.inner.put(key, data, metadata)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        self._rtt()
        out = self.inner.get_ranges(key, ranges)
        self._down.transfer(sum(len(b) for b in out))
        return out

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        self._rtt()
        self.inner.get_ranges_into(key, ranges, out)
        self._down.transfer(sum(r.length for r in ranges))

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        self._rtt()
        got = self.inner.get_if_changed(key, etag)
        if got is not None:
            self._down.transfer(len(got.data))
        return got

    def delete_many(self, keys: Sequence[str]) -> None:
        self._rtt()
        self.inner.delete_many(keys)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._rtt()
        return self.inner.list(prefix)
