"""A bounded, expiring local index of object keys known to exist (or not).

Warm lookups are answered from here without a network call. Entries come from
our own confirmed uploads and from HEAD results. Positives expire after
``ttl_s`` because objects can vanish (lifecycle expiry, ``s3kv gc``, another
operator); negatives expire after ``negative_ttl_s`` because another cluster
may write the object any moment. A stale positive is caught at load time (the
object is verified byte for byte) and costs one request, never wrong KV.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from .objects import ObjectSpan


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


class KeyIndex:
    def __init__(
        self,
        max_entries: int = 1_000_000,
        ttl_s: float = 600.0,
        negative_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (expires_at, span or MISSING)
        self._entries: OrderedDict[str, tuple[float, ObjectSpan | _Missing]] = OrderedDict()
        self._puts_since_sweep = 0

    def _put(self, key: str, value: ObjectSpan | _Missing, ttl: float) -> None:
        if self.max_entries == 0 or ttl <= 0:
            return
        with self._lock:
            now = self._clock()
            self._entries[key] = (now + ttl, value)
            self._entries.move_to_end(key)
            self._puts_since_sweep += 1
            if self._puts_since_sweep >= max(1024, len(self._entries) // 4):
                # Expired entries (short-lived negatives above all) are otherwise only
                # dropped when asked for again; sweep now and then (amortised O(1)).
                self._puts_since_sweep = 0
                for k in [k for k, (exp, _) in self._entries.items() if exp < now]:
                    del self._entries[k]
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def put_present(self, key: str, span: ObjectSpan) -> None:
        self._put(key, span, self.ttl_s)

    def put_missing(self, key: str) -> None:
        self._put(key, MISSING, self.negative_ttl_s)

    def quarantine(self, keys: Iterable[str], ttl: float) -> None:
        """Remember ``keys`` as missing for ``ttl`` seconds: objects that failed verification or
        a load. Later lookups miss instead of promising the same broken load again."""
        for k in keys:
            self._put(k, MISSING, ttl)

    def forget(self, keys: Iterable[str]) -> None:
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)

    def get(self, key: str) -> ObjectSpan | _Missing | None:
        """The span if known present, MISSING if recently seen missing, None if unknown."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[0] < self._clock():
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
