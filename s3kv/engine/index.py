"""A bounded, expiring local index of object keys known to exist (or not).

Warm lookups are answered from here without a network call (and, first, from the host tier:
``host_first``). Entries come from
our own confirmed uploads and from HEAD results. Positives expire after
``ttl_s`` because objects can vanish (lifecycle expiry, ``s3kv gc``, another
operator) -- except this engine's own uploads, known for ``written_ttl_s`` (``put_written``);
negatives expire after ``negative_ttl_s`` because another cluster
may write the object any moment. A stale positive is caught at load time (the
object is verified byte for byte) and costs one request, never wrong KV.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.keys import parse_key
from ..core.objects import ObjectSpan
from ..core.retention import believe_unknown_s


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


#: Expired entries dropped per map and insert (more than one, so sweeping outpaces inserting).
_SWEEP = 8


class KeyIndex:
    """Two maps, one per kind of entry, each kept in expiry order.

    Every positive lives ``ttl_s`` and every negative ``negative_ttl_s`` from its last
    ``put``, so re-inserting at the end keeps each map sorted by expiry: expired entries
    are always at the front. Each ``put`` drops at most ``_SWEEP`` of them from each map's
    front - bounded work per insert (the old full sweep every n/4 inserts once took 79 ms
    on one insert, on the engine's scheduling path) that still keeps pace with inserts.
    The size bound evicts negatives first (cheapest to lose), then the positives closest
    to expiry. ``get`` does not reorder (a hit does not extend an entry's life either).
    """

    def __init__(
        self,
        max_entries: int = 1_000_000,
        ttl_s: float = 600.0,
        negative_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        written_ttl_s: float | None = None,
    ):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        #: How long this engine's own confirmed upload stays known (None: ``ttl_s``). Why longer
        #: than a HEAD answer: a HEAD says nothing of the object's age, an upload says it is new,
        #: and gc deletes nothing younger than the retention (``core.cost.expiry_age_s``), so
        #: for the retention it cannot be gone -- a lookup of it needs no verify wave then (a user
        #: back after 10 minutes, on an index no key signs).
        self.written_ttl_s = ttl_s if written_ttl_s is None or ttl_s <= 0 else max(ttl_s, written_ttl_s)
        self.negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (expires_at, span, believable until: ``keep``); key -> expires_at. Both in expiry order.
        self._present: OrderedDict[str, tuple[float, ObjectSpan, float]] = OrderedDict()
        self._missing: OrderedDict[str, float] = OrderedDict()
        # Objects that failed a load (gone, corrupt, foreign): missing for a long while. Its own map,
        # so each map stays in expiry order (one TTL per map).
        self._quarantined: OrderedDict[str, float] = OrderedDict()
        # This engine's own uploads (``put_written``): key -> (expires_at, span), their own TTL.
        self._written: OrderedDict[str, tuple[float, ObjectSpan]] = OrderedDict()
        #: Keys quarantined so far (a count) and the latest of them: the lookups read them to
        #: learn that an object a listing vouched for failed its load (``summary.TrustGate``).
        self.quarantines = 0
        self.recent_quarantined: deque[str] = deque(maxlen=256)

    @classmethod
    def from_settings(cls, settings: Any) -> KeyIndex:
        """The engine's index: its sizes and TTLs from ``settings``; its own uploads known for the
        floor's life (``believe_unknown_s``) until a fleet index says what gc keeps
        (``Listings._follow_retention``), unless positives are not kept at all (``index_ttl_s`` 0).
        Why not the setting: an engine that never holds a fresh index (the index off, refused or
        unreachable) cannot tell a gc keeping the setting from one that learnt a shorter
        retention, and believing the setting there promised loads of objects gc had deleted."""
        ttl = settings.index_ttl_s
        return cls(settings.index_max_entries, ttl, settings.negative_ttl_s,
                   written_ttl_s=believe_unknown_s(settings.retention_h * 3600.0, ttl) if ttl > 0 else 0.0)

    def _sweep(self, now: float, limit: int = _SWEEP) -> None:
        """Drop up to ``limit`` expired entries from the front of each map."""
        maps: tuple[OrderedDict[str, Any], ...] = (self._missing, self._quarantined, self._present, self._written)
        for m in maps:
            for _ in range(limit):
                if not m:
                    break
                k, v = next(iter(m.items()))
                if (v[0] if isinstance(v, tuple) else v) >= now:  # positives: (expires_at, span)
                    break
                del m[k]

    def _bound(self) -> None:
        while len(self._present) + len(self._missing) + len(self._quarantined) + len(self._written) > self.max_entries:
            if self._missing:
                self._missing.popitem(last=False)
            elif self._quarantined:
                self._quarantined.popitem(last=False)
            elif self._present:
                self._present.popitem(last=False)
            else:
                self._written.popitem(last=False)

    def put_present(self, key: str, span: ObjectSpan) -> None:
        self.put_many([(key, span)], ())

    def put_written(self, key: str, span: ObjectSpan) -> None:
        """This engine's upload of ``key`` was confirmed: known present for ``written_ttl_s``."""
        if self.max_entries <= 0 or self.written_ttl_s <= 0:
            return
        with self._lock:
            now = self._clock()
            q = self._quarantined.get(key)
            if q is not None and q >= now:
                return  # a late confirmation must not lift a quarantine
            self._missing.pop(key, None)
            self._written.pop(key, None)
            self._written[key] = (now + self.written_ttl_s, span)
            self._sweep(now)
            self._bound()

    def cap_written(self, until: float) -> None:
        """Believe no own upload past ``until`` (the retention gc deletes by just got shorter than
        what was believed: ``s3kv.core.retention``). Capping keeps the map in expiry order."""
        with self._lock:
            for k, (exp, span) in list(self._written.items()):
                if exp > until:
                    self._written[k] = (until, span)

    def put_missing(self, key: str) -> None:
        self.put_many((), [key])

    def now(self) -> float:
        """This index's clock (a replay runs it on the trace's): what ``asked_at`` is read from."""
        return self._clock()

    def put_many(
        self, present: Iterable[tuple[str, ObjectSpan]], missing: Iterable[str], *, asked_at: float | None = None,
        believable: Mapping[str, float] | None = None,
    ) -> None:
        """A HEAD wave's answers under one lock and one clock reading (hundreds per long prompt,
        on the engine's scheduling path). ``asked_at`` (:meth:`now` when the wave was sent): a
        "missing" answer does not replace what was learnt present since -- the wave was asked
        before, and this engine's own upload (or a later HEAD) confirmed the object after. Late
        waves, waves finished in the background and probes past a listing race the requests'
        own uploads this way; without it their answers hid objects just written. ``believable``:
        seconds from now an answer may be believed at most, where its object's age says (:meth:`keep`);
        one not named is believed for the TTL and never longer."""
        keep_present = self.max_entries > 0 and self.ttl_s > 0
        keep_missing = self.max_entries > 0 and self.negative_ttl_s > 0
        with self._lock:
            now = self._clock()
            n = 0
            if keep_present:
                until, life = now + self.ttl_s, self._quarantined.get
                for key, span in present:
                    q = life(key)
                    if q is not None and q >= now:
                        continue  # a late answer (HEAD wave, upload) must not lift a quarantine
                    self._missing.pop(key, None)
                    self._present.pop(key, None)
                    cap = now + believable[key] if believable is not None and key in believable else until
                    self._present[key] = (min(until, cap), span, cap)
                    n += 1
            if keep_missing:
                until = now + self.negative_ttl_s
                for key in missing:
                    if asked_at is not None:
                        known = self._present.get(key)
                        if known is not None and known[0] - self.ttl_s >= asked_at:
                            continue  # learnt present at or after the question: newer than its answer
                        mine = self._written.get(key)
                        if mine is not None and mine[0] - self.written_ttl_s >= asked_at:
                            continue
                    self._present.pop(key, None)
                    self._written.pop(key, None)
                    self._missing.pop(key, None)
                    self._missing[key] = until
                    n += 1
            if n:
                self._sweep(now, _SWEEP * n)  # as much as n single inserts would sweep
                self._bound()

    def keep(self, keys: Iterable[str]) -> None:
        """What is known present of ``keys`` stays known another TTL, never past what its answer
        said it may be believed for (``put_many``'s ``believable``: gc's cutoff for the object's age,
        less the clock margin). Why the bound: each lookup that finds a key through this index would
        otherwise renew its own memory forever, while the object ages past gc's cutoff -- an object
        found but never loaded is never refreshed either (chain objects past where hits end), and a
        load promised on the renewed memory found it gone."""
        if self.max_entries <= 0 or self.ttl_s <= 0:
            return
        with self._lock:
            now = self._clock()
            for k in keys:
                entry = self._present.get(k)
                if entry is None or entry[0] < now or entry[2] <= entry[0]:
                    continue
                del self._present[k]  # re-inserted at the end: expiry order, as near as a cap allows
                self._present[k] = (min(now + self.ttl_s, entry[2]), entry[1], entry[2])

    def quarantine(self, keys: Iterable[str], ttl: float) -> None:
        """Remember ``keys`` as missing for ``ttl`` seconds: objects that failed verification or
        a load. Later lookups miss instead of promising the same broken load again."""
        if self.max_entries == 0 or ttl <= 0:
            return
        with self._lock:
            now = self._clock()
            for k in keys:
                self._present.pop(k, None)
                self._written.pop(k, None)
                self._missing.pop(k, None)
                self._quarantined.pop(k, None)
                self._quarantined[k] = now + ttl
                self.recent_quarantined.append(k)
                self.quarantines += 1
            self._sweep(now)
            self._bound()

    def quarantined_since(self, seen: int) -> tuple[int, list[str]]:
        """(quarantines so far, the keys quarantined after the first ``seen`` of them -- the latest
        256 at most)."""
        with self._lock:
            n, recent = self.quarantines, self.recent_quarantined
            k = min(n - seen, len(recent))
            return n, list(recent)[len(recent) - k :] if k > 0 else []

    def forget_missing(self, keys: Iterable[str]) -> None:
        """Drop what was remembered as missing (not quarantines, not known objects): ``keys`` may
        exist now."""
        with self._lock:
            for k in keys:
                self._missing.pop(k, None)

    def forget(self, keys: Iterable[str], *, keep_quarantine: bool = False) -> None:
        """Drop what is known of ``keys``; ``keep_quarantine``: not their quarantines."""
        with self._lock:
            for k in keys:
                self._present.pop(k, None)
                self._written.pop(k, None)
                self._missing.pop(k, None)
                if not keep_quarantine:
                    self._quarantined.pop(k, None)

    def get(self, key: str) -> ObjectSpan | _Missing | None:
        """The span if known present, MISSING if recently seen missing, None if unknown."""
        with self._lock:
            return self._get(key, self._clock())

    def get_many(self, keys: Iterable[str]) -> list[ObjectSpan | _Missing | None]:
        """``get`` of each key, under one lock and one clock reading: a 128k-token lookup asks
        about hundreds of keys on the engine's scheduling path."""
        with self._lock:
            now, one = self._clock(), self._get
            return [one(k, now) for k in keys]

    def _get(self, key: str, now: float) -> ObjectSpan | _Missing | None:
        # Unrolled (no loop over the maps): this runs for every ask of every lookup.
        entry = self._present.get(key)
        if entry is not None:
            if entry[0] >= now:
                return entry[1]
            del self._present[key]
        mine = self._written.get(key)
        if mine is not None:
            if mine[0] >= now:
                return mine[1]
            del self._written[key]
        exp = self._quarantined.get(key)
        if exp is not None:
            if exp >= now:
                return MISSING
            del self._quarantined[key]
        exp = self._missing.get(key)
        if exp is not None:
            if exp >= now:
                return MISSING
            del self._missing[key]
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._present) + len(self._missing) + len(self._quarantined) + len(self._written)


class AllShards:
    """Where a rank's confirmed uploads go: its key index, which also forgets that the object's
    other shards were missing.

    Why: each TensorRT-LLM rank is its own process, and only rank 0's worker shares the leader's
    index; every other rank's confirmations land in an index nobody reads. The leader plans one
    seal for every shard, so rank 0's shard landing says the others are landing too. Without
    this a shard the leader once found missing (a lookup before the upload) stayed "missing"
    there for ``negative_ttl_s`` after its rank uploaded it: the next request missed (a branch
    tail's hit with TP 2, test_branch_tails.py with one process per rank). Forgotten, the next
    lookup asks the store (a shard whose upload failed is then found missing again)."""

    def __init__(self, index: KeyIndex):
        self.index = index

    def put_written(self, key: str, span: ObjectSpan) -> None:
        self.index.put_written(key, span)
        parsed = parse_key(key)
        if parsed is None:  # not an object key (a caller's own): nothing to say about shards
            return
        head = key.rsplit("/", 2)[0]
        self.index.forget_missing(
            f"{head}/{parsed.group_fingerprint}.{r}of{parsed.tp_size}/{parsed.digest}"
            for r in range(parsed.tp_size) if r != parsed.shard
        )


def host_first(
    tier: Any, index: KeyIndex, keys: Mapping[Any, str], known: list[Any], shard0_key: Callable[[Any], str],
    answered: set[Any],
) -> list[Any]:
    """``known`` (the index's answers for ``keys``, ask -> key, in order) with what the host tier
    holds answered first, the asks it answered added to ``answered``.

    The leader sees rank 0's tier only, which holds shard 0 of each object; every other rank's
    tier holds its own shard of the same object (the plan keeps them in step), so an ask for
    shard ``s`` is answered with shard 0's span. One exception: the index knows this shard's span
    from the store and rank 0's tier holds the store's version too -- shards may have different
    writers there, and a rank that read its shard from the store holds that writer's version. (A
    tier may hold another version than the store under a key: its own seal, where the store kept
    an earlier writer's; both are right, loads check the span they get.) A tier answer needs no
    request: no stall, no bill, whether or not the store is reachable.
    """
    out = []
    for (a, key), v in zip(keys.items(), known, strict=True):
        k0 = key if a[1] == 0 else shard0_key(a)
        span = tier.span_of(k0)
        if span is not None:
            answered.add(a)
            if a[1] == 0 or not isinstance(v, ObjectSpan) or index.get(k0) != span:
                v = span
        out.append(v)
    return out
