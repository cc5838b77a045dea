"""The lookup's listings of the namespace: which one answers, and whether it may vouch for a hit.

Two sources (``s3kv.engine.summary``): the fleet index, fetched by :class:`IndexRefresher` with a
conditional GET every ``fleet_index_s``; else this engine's own LIST summary (``lookup_summary_s``,
off by default). Neither is used while the store is in doubt (breaker not closed): nothing is
promised from memory then.

A listed candidate costs one HEAD wave unless the listing is **trusted** (:meth:`Listings.trusted`):

* a fleet index only when signed with the integrity key (an unsigned one never makes a hit free,
  and an engine holding a key refuses unsigned indexes altogether), no older than
  ``fleet_index_trust_s`` nor than ``index_ttl_s`` (as old as a HEAD answer the key index still
  trusts), and every object it vouches for younger than the retention when it was listed -- gc
  keeps an object seen that young for ``index_ttl_s`` more (``core.cost.expiry_age_s``), so the
  trust window never outlives the object;
* a LIST summary younger than ``lookup_summary_trust_s``.

A load of an object a trusted listing vouched for that fails (the worker quarantines it in the
key index: gone, corrupt, planted) takes that source's trust away until it proves right again
(``summary.TrustGate``): :meth:`Listings.note_failed_loads` reads the key index's quarantines at
each lookup and matches them against the keys vouched for lately.
"""

from __future__ import annotations

import math
import operator
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from ...config import Settings
from ...core.cost import EXPIRY_MARGIN_S, expiry_age_s, promise_s
from ...core.fleetindex import DIGEST_BYTES, FleetIndex
from ...core.lookup import Ask
from ...core.objects import ObjectSpan
from ...core.retention import RETENTION_FLOOR_S, believe_unknown_s, engine_lag_s, retention_for
from ...store.base import ObjectStore
from ..fleetindex import IndexRefresher, index_key
from ..index import KeyIndex
from ..summary import IndexListing, Listing, NamespaceSummary, SummaryGroup, SummaryListing, TrustGate
from .context import LeaderContext
from .stats import LeaderStats

#: Keys a trusted listing vouched for lately (a failed load of one takes the listing's trust).
VOUCHED_MAX = 4096


#: A digest's index key, as bytes (``IndexRefresher.gone``).
_KEY_BYTES = operator.itemgetter(slice(0, DIGEST_BYTES))


class Listings:
    def __init__(self, settings: Settings, store: ObjectStore, index: KeyIndex, stats: LeaderStats):
        self.settings = settings
        self.store = store
        self.index = index
        self.stats = stats
        self.ctx: LeaderContext | None = None
        self._summary: NamespaceSummary | None = None
        self._fleet: IndexRefresher | None = None
        self._index_listing: IndexListing | None = None
        #: Whether each source may vouch for a hit, the keys one vouched for lately, and how many
        #: of the key index's quarantines were looked at.
        self.trust = TrustGate()
        self._vouched: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._quarantines_seen = index.quarantines
        #: This engine's dated reads for its read reports (the write policy sets it: its value model's).
        self.reads: Callable[[], Sequence[float]] | None = None
        #: Its write-policy evidence for the same reports (``ValueModel.shared``), pooled by gc.
        self.evidence: Callable[[], dict[str, list[float]] | None] | None = None
        self._learning_seen = False
        #: POSIX time, the clock the store dates objects by (:meth:`believable`); None: the fleet
        #: index's (a replay runs it on the trace's), else this host's.
        self.wall: Callable[[], float] | None = None
        self._followed: tuple[FleetIndex | None, bool | None] = (None, None)  # (held, stale) last followed

    def bind(self, ctx: LeaderContext) -> None:
        self.ctx = ctx

    def holds(self, gid: int, digest: bytes, end: int, shards: Sequence[int] = (0,)) -> bool:
        """The store holds group ``gid``'s object ending at block ``end`` of ``digest`` on each of
        ``shards``, as this engine's key index or the current listing knows it (no request)."""
        ctx = self.ctx
        assert ctx is not None
        fp = ctx.geometry.groups[gid].fingerprint
        cur = self.current()
        return all(
            isinstance(self.index.get(ctx.scheme.object_key(fp, shard, digest)), ObjectSpan)
            or (cur is not None and cur.find(gid, shard, digest, end) is not None)
            for shard in shards
        )

    def current(self) -> Listing | None:
        """The freshest listing: the fleet index, else the LIST summary; None when neither is
        fresh or the store is in doubt."""
        if not self.store.available:
            return None
        fleet = self.fleet_index()
        if fleet is not None:
            idx = fleet.start().current()
            self._follow_retention(idx, fleet.held)
            if idx is not None:
                cur = self._index_listing
                if cur is None or cur.index is not idx:
                    assert self.ctx is not None
                    g = self.ctx.geometry
                    cur = self._index_listing = IndexListing(
                        idx, {x.fingerprint: x.group_id for x in g.groups}, g.tp_size, fleet.generation
                    )
                return cur
        summary = self.summary()
        return summary.start().listing() if summary is not None else None

    def _follow_retention(self, fresh: FleetIndex | None, held: FleetIndex | None) -> None:
        """How long this engine believes its own uploads: where gc learns the retention (the index
        carries it), for what the fresh index says (``believe_s``) -- gc keeps each object for the
        longest an engine may have believed (``core.retention.retention_for``); where the fresh
        index says gc keeps the setting, for the setting; else (no index yet, a stale one) for the
        floor's life (``believe_unknown_s``).
        When gc is first seen learning, what was believed for the setting is cut to the floor's
        life: gc keeps objects written before for the setting, but not once refreshed. Called on
        every lookup: it does its work only when the index held or its freshness changed."""
        if held is self._followed[0] and (fresh is None) == self._followed[1]:
            return
        self._followed = (held, fresh is None)
        ttl = self.index.ttl_s
        if ttl <= 0:
            return
        cap = self.settings.retention_h * 3600.0
        if held is None or fresh is None:
            # No index yet, or a stale one: what gc keeps now is unknown here, so the floor's life,
            # which gc keeps by every rule (``KeyIndex.from_settings`` says why).
            want = believe_unknown_s(cap, ttl)
        elif fresh.retention_s is None:
            want = cap  # the fresh index says gc keeps the setting
        else:
            want = min(cap, fresh.believe_s if fresh.believe_s is not None else RETENTION_FLOOR_S)
        learning = held is not None and held.retention_s is not None
        if learning and not self._learning_seen:
            self.index.cap_written(self.index.now() + RETENTION_FLOOR_S + ttl)
        self._learning_seen = learning
        want = max(ttl, want)
        if want != self.index.written_ttl_s:
            self.index.written_ttl_s = want

    def fleet_evidence(self) -> tuple[dict[str, tuple[float, float]] | None, float]:
        """(the other engines' write-policy evidence, its age in seconds): ``IndexRefresher.others_listed``."""
        got = self._fleet.others_listed() if self._fleet is not None else None
        return got if got is not None else (None, 0.0)

    def believable(self, dates: Mapping[str, float]) -> dict[str, float]:
        """For how many seconds more a HEAD's "present" of each object, last written or refreshed
        at ``dates[key]`` (POSIX time), may be believed: until it is as old as gc keeps it
        (:meth:`kept_s`) plus what an engine promises on an answer (``promise_s``). gc deletes it a
        clock margin later (``core.cost.expiry_age_s``), and by a shorter retention only once
        engines stopped acting on answers given under the longer one (``Publisher.keep_s``): past
        this, the load promised on the answer -- or on the key index's memory of it, trusted
        ``index_ttl_s`` -- may find the object gone. 0 or less: not at all. (gc keeps every object
        the retention at least: gc's own rule is reckoned only for those that leaves under a TTL --
        a wave answers hundreds of objects on the scheduler's path.)"""
        now = (self.wall or (self._fleet.clock if self._fleet is not None else time.time))()
        promise, least, ttl = promise_s(self.settings), self.retention_s(), self.index.ttl_s
        out = {}
        for key, lm in dates.items():
            left = lm + least + promise - now
            out[key] = left if left >= ttl else lm + self.kept_s(lm) + promise - now
        return out

    def kept_s(self, touched_at: float) -> float:
        """The retention gc keeps an object last written or refreshed at ``touched_at`` for, as
        far as the fleet index says: where gc learns, by gc's own rule (``retention_for``) over the
        retention and the beliefs the index carries -- an object written under a longer belief
        keeps it -- else the retention it says (else the setting)."""
        said = self.retention_s()
        idx = self._fleet.held if self._fleet is not None else None
        if idx is None or idx.retention_s is None or idx.auto_since is None:
            return said
        lag = engine_lag_s(idx.every_s, self.settings.fleet_index_s, EXPIRY_MARGIN_S)
        return retention_for(idx.retention_history, touched_at, retention_s=said, since=idx.auto_since,
                             cap_s=self.settings.retention_h * 3600.0, lag_s=lag)

    def retention_s(self) -> float:
        """The retention gc deletes by, as the last fleet index said (else the setting)."""
        idx = self._fleet.held if self._fleet is not None else None
        keep = self.settings.retention_h * 3600.0
        return min(keep, idx.retention_s) if idx is not None and idx.retention_s is not None else keep

    def deleted_age_s(self, fingerprint: str, digests: Sequence[bytes], lo: int, hi: int) -> float | None:
        """Where the deepest object of group ``fingerprint`` (shard 0) ending past block ``lo`` and
        up to ``hi`` of a chain (``digests``) that the fleet index listed is gone, deleted by gc for
        its age: its age now in seconds (a ghost read, ``core.retention``); else None. The first
        call starts the tracking of that group."""
        fleet = self._fleet
        if fleet is None:
            return None
        if fingerprint not in fleet.track:
            fleet.track = fleet.track | {fingerprint}
        gone = fleet.gone
        if not gone or hi <= lo:
            return None
        # The deepest first: the index keys digests by their first 8 bytes.
        got = next(filter(None, map(gone.get, map(_KEY_BYTES, reversed(digests[lo:hi])))), None)
        return None if got is None else fleet.clock() - got[0]

    def gc_period_s(self) -> float | None:
        """How often gc deletes what expired, where a fresh fleet index says it learns the
        retention: its publisher deletes in each pass (``engine.fleetindex``, expiring in each
        pass), so the index's own period; None: gc's ``--watch`` period, which no engine can see
        (a stale index: no publisher passes either)."""
        idx = self._fleet.current() if self._fleet is not None else None
        return idx.every_s if idx is not None and idx.retention_s is not None else None

    def refresh_s(self) -> float:
        """How often a worker refreshes an object it loads: half the retention; where gc learns it,
        half the object's whole life (retention + gc's margin) -- a read past half its life says it
        is in use and its life left may not cover the next read, while gc's rule keeps 99% of the
        reads within that half (``core.retention``): a refresh at half a learnt retention copied
        objects on most reads for life they already had."""
        idx = self._fleet.held if self._fleet is not None else None
        if idx is None or idx.retention_s is None:
            return self.retention_s() / 2
        return (self.retention_s() + expiry_age_s(self.settings) - self.settings.retention_h * 3600.0) / 2

    def age_s(self, group_id: int, shard: int, digest: bytes, end: int) -> float | None:
        """Seconds since the object ending at block ``end`` of ``digest`` was written (or refreshed),
        as the fleet index says: its entry's write time, or -- not listed -- at most the index's own
        age (it was written since the listing). None without a current fleet index (a LIST summary
        carries no write times). What the retention advice learns the fleet's reuse lag from."""
        fleet = self._fleet
        cur = self.current() if fleet is not None else None
        if fleet is None or not isinstance(cur, IndexListing):
            return None
        got = cur.find(group_id, shard, digest, end)
        written = got[1] if got is not None and got[1] is not None else cur.index.listed_at
        return max(0.0, fleet.clock() - written)

    def fleet_index(self) -> IndexRefresher | None:
        """The fleet index's refresher (made on first use; its thread starts with the first lookup,
        or at layout registration), or None when ``fleet_index_s`` is 0 or no geometry is bound."""
        ctx = self.ctx
        if self.settings.fleet_index_s <= 0 or ctx is None:
            return None
        if self._fleet is None:
            self._fleet = IndexRefresher(
                self.store, index_key(ctx.scheme.namespace_prefix), ctx.namespace,
                keys=self.settings.integrity, interval_s=self.settings.fleet_index_s,
                max_objects=self.settings.fleet_index_max_objects,
            )
            self._fleet.reads, self._fleet.evidence = self.reads, self.evidence
            self._fleet.belief_s = promise_s(self.settings)
            # The refresher holds no reference to the listings (nor the leader holding them); it
            # stops when they go.
            weakref.finalize(self, self._fleet.stop)
        return self._fleet

    def summary(self) -> NamespaceSummary | None:
        """The namespace summary (made on first use; its refresher starts with the first lookup),
        or None when ``lookup_summary_s`` is 0 or the geometry is not bound yet."""
        ctx = self.ctx
        if self.settings.lookup_summary_s <= 0 or ctx is None:
            return None
        if self._summary is None:
            tagged = self.settings.integrity is not None
            groups = {x.fingerprint: SummaryGroup(x.group_id, x.page_bytes, tagged) for x in ctx.geometry.groups}
            self._summary = NamespaceSummary(
                self.store,
                ctx.scheme,
                groups,
                interval_s=self.settings.lookup_summary_s,
                max_objects=self.settings.lookup_summary_max_objects,
            )
            weakref.finalize(self, self._summary.stop)
        return self._summary

    def trusted(self, listing: Listing, written: Sequence[float | None]) -> bool:
        """Whether ``listing`` may stand in for the HEAD wave over objects written at ``written``
        (module docstring)."""
        s = self.settings
        if not written or not self.trust.trusted(listing.source):
            return False
        if isinstance(listing, IndexListing):
            idx, fleet = listing.index, self._fleet
            if not idx.verified or fleet is None:
                return False
            if fleet.clock() - idx.listed_at > min(s.fleet_index_trust_s, s.index_ttl_s):
                return False
            keep = min(s.retention_h * 3600.0, idx.retention_s or math.inf)
            return all(w is not None and idx.listed_at - w < keep for w in written)
        trust = s.lookup_summary_trust_s
        if not (trust > 0 and self._summary is not None and self._summary.age_s() <= trust):
            return False
        # gc's margin covers the trust only for objects not yet expired when listed: an older one
        # (gc had not come round to it) may go the moment after the listing. Which retention gc
        # keeps, a LIST does not say: only what every rule keeps is vouched for (the floor, or a
        # shorter setting). ``listed_at`` is this host's clock, LastModified the store's: the
        # 60 s of gc's margin beyond the TTL and the trust are the skew's room.
        if not isinstance(listing, SummaryListing):
            return False
        keep = min(s.retention_h * 3600.0, RETENTION_FLOOR_S)
        return all(w is not None and listing.listed_at - w < keep for w in written)

    def vouch(self, todo: dict[str, Ask], listing: Listing) -> None:
        """Remember which listing promised these objects (``note_failed_loads``)."""
        for key in todo:
            self._vouched[key] = (listing.source, listing.generation)
            self._vouched.move_to_end(key)
        while len(self._vouched) > VOUCHED_MAX:
            self._vouched.popitem(last=False)

    def note_failed_loads(self) -> None:
        """Take a source's trust away where a load of an object it vouched for failed."""
        seen, keys = self.index.quarantined_since(self._quarantines_seen)
        self._quarantines_seen = seen
        for key in keys:
            got = self._vouched.pop(key, None)
            if got is not None and self.trust.lose(*got):
                self.stats.listing_trust_lost += 1

    def close(self) -> None:
        if self._summary is not None:
            self._summary.stop()
        if self._fleet is not None:
            self._fleet.stop()
