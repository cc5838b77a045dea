"""In-memory object store: the reference semantics every other store must match."""

from __future__ import annotations

import builtins
import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from .base import (
    TOUCH_GONE,
    TOUCH_REFRESHED,
    TOUCH_YOUNG,
    Buffer,
    ByteRange,
    Fetched,
    HeadBatch,
    NotFound,
    ObjectInfo,
    ObjectStore,
    StoreError,
    as_buffers,
)


class MemoryStore(ObjectStore):
    def __init__(self, url: str = "memory://"):
        self.url = url
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, dict[str, str], float]] = {}
        #: key -> ETag: a fresh one per write (a key deleted and written again gets a new one).
        self._etags: dict[str, str] = {}
        self._versions = itertools.count(1)

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        found: dict[str, ObjectInfo] = {}
        missing: set[str] = set()
        with self._lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is None:
                    missing.add(key)
                else:
                    found[key] = ObjectInfo(key, len(obj[0]), dict(obj[1]), obj[2])
        failed: dict[str, StoreError] = {}
        return HeadBatch(found, frozenset(missing), failed)

    def put(self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None) -> bool:
        body = b"".join(bytes(b) for b in as_buffers(data))
        with self._lock:
            if key in self._objects:
                return False
            # S3 lowercases user-metadata names on the wire; match it so code tested here behaves the same.
            meta = {k.lower(): v for k, v in (metadata or {}).items()}
            self._objects[key] = (body, meta, time.time())
            self._etags[key] = f'"{next(self._versions)}"'
            return True

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            raise NotFound("no such object", key=key)
        body = obj[0]
        out = []
        for r in ranges:
            if r.end > len(body):
                raise StoreError(f"range {r.offset}+{r.length} beyond object size {len(body)}", key=key)
            out.append(body[r.offset : r.end])
        return out

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        with self._lock:
            obj, tag = self._objects.get(key), self._etags.get(key, "")
        if obj is None:
            raise NotFound("no such object", key=key)
        return None if etag is not None and etag == tag else Fetched(obj[0], tag)

    def touch(self, key: str, min_age_s: float = 0.0) -> str:
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return TOUCH_GONE
            now = time.time()
            if now - obj[2] < min_age_s:
                return TOUCH_YOUNG
            self._objects[key] = (obj[0], obj[1], now)
            return TOUCH_REFRESHED

    def store_time(self) -> float:
        return time.time()  # what put() and touch() stamp objects with

    def delete_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)
                self._etags.pop(key, None)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted((k, v) for k, v in self._objects.items() if k.startswith(prefix))
        for key, (body, meta, ts) in items:
            yield ObjectInfo(key, len(body), dict(meta), ts)

    # test helpers -------------------------------------------------------
    def corrupt(self, key: str, offset: int) -> None:
        """Flip one bit of a stored object (tests of integrity checks)."""
        with self._lock:
            body, meta, ts = self._objects[key]
            b = bytearray(body)
            b[offset] ^= 0x01
            self._objects[key] = (bytes(b), meta, ts)
            self._etags[key] = f'"{next(self._versions)}"'

    def keys(self) -> builtins.list[str]:
        with self._lock:
            return sorted(self._objects)
