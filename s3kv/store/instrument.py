"""Request and byte counters around any store (tests assert on them; metrics export them).

Counting unit is the request a real S3 would bill: ``head`` counts keys (one HEAD each),
``get`` counts ranges asked for (the S3 store may split a long one further), ``put`` counts
put calls (a multipart upload is still one logical put), ``delete`` counts keys, ``list``
counts list calls. ``bytes_up`` is the body size of every put attempted; ``bytes_down`` the
bytes returned by gets. ``errors`` counts calls (or HEAD keys) that ended in a StoreError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields

from .base import (
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


@dataclass(frozen=True)
class StoreStats:
    head: int = 0
    put: int = 0
    get: int = 0
    delete: int = 0
    list: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    errors: int = 0
    #: HEADs that answered "missing"; puts that found the key already there (returned False).
    head_missing: int = 0
    put_existing: int = 0
    #: Conditional GETs (``get_if_changed``: the fleet index's refresh), and of those, the ones
    #: answered "not modified" (no body). Apart from ``get`` (loads' ranges), which tests count.
    fetch: int = 0
    fetch_unchanged: int = 0

    @property
    def requests(self) -> int:
        return self.head + self.put + self.get + self.delete + self.list + self.fetch

    def __sub__(self, other: StoreStats) -> StoreStats:
        """Counters accumulated between two snapshots."""
        return StoreStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


class InstrumentedStore(StoreWrapper):
    def __init__(self, inner: ObjectStore):
        super().__init__(inner)
        self._lock = threading.Lock()
        self._c = {f.name: 0 for f in fields(StoreStats)}

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._c[name] += n

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._c)

    def reset(self) -> None:
        with self._lock:
            for name in self._c:
                self._c[name] = 0

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        return self._head(keys, self.inner.head_many)

    def head_many_checked(self, keys: Sequence[str], expect: Mapping[str, SpanExpect]) -> HeadBatch:
        return self._head(keys, lambda ks: self.inner.head_many_checked(ks, expect))

    def _head(self, keys: Sequence[str], call: Callable[[Sequence[str]], HeadBatch]) -> HeadBatch:
        try:
            batch = call(keys)
        except StoreError:
            self._add(head=len(keys), errors=len(keys))
            raise
        self._add(head=len(keys), head_missing=len(batch.missing), errors=len(batch.failed))
        return batch

    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        size = total_size(data)
        try:
            created = self.inner.put(key, data, metadata)
        except StoreError:
            self._add(put=1, bytes_up=size, errors=1)
            raise
        self._add(put=1, bytes_up=size, put_existing=0 if created else 1)
        return created

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        try:
            out = self.inner.get_ranges(key, ranges)
        except StoreError:
            self._add(get=len(ranges), errors=1)
            raise
        self._add(get=len(ranges), bytes_down=sum(len(b) for b in out))
        return out

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        try:
            self.inner.get_ranges_into(key, ranges, out)
        except StoreError:
            self._add(get=len(ranges), errors=1)
            raise
        self._add(get=len(ranges), bytes_down=sum(r.length for r in ranges))

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        try:
            got = self.inner.get_if_changed(key, etag)
        except StoreError:
            self._add(fetch=1, errors=1)
            raise
        self._add(fetch=1, fetch_unchanged=int(got is None), bytes_down=len(got.data) if got else 0)
        return got

    def delete_many(self, keys: Sequence[str]) -> None:
        try:
            self.inner.delete_many(keys)
        except StoreError:
            self._add(delete=len(keys), errors=1)
            raise
        self._add(delete=len(keys))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._add(list=1)
        try:
            yield from self.inner.list(prefix)
        except StoreError:
            self._add(errors=1)
            raise
