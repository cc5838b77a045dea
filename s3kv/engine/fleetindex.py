"""The fleet index at run time: one publisher writes it, every engine keeps a fresh copy.

The format is ``s3kv.core.fleetindex``'s; this module does the I/O.

Why this is one module: it is both ends of one object's protocol -- the publisher that writes the
index and the refresher that polls it -- and what rides on those two passes: the retention gc
learns (``s3kv.core.retention``) is read from engines' reports in the publisher's own LIST and
published in its index, and the reports are written on the refresher's poll, timed by the index
it just took. The rules (format, learning, what each object is kept for) live in ``s3kv.core``;
what is left here is the I/O around them, and a split would pass each half's state to the other.

**Publishing** (:class:`Publisher`): list the namespaces under a root, HEAD each object not seen
before (its metadata gives the exact span; with an integrity key its metadata tag must verify,
so a planted object never enters a signed index), and write one index per namespace at
``{namespace prefix}fleet-index``. Objects already known (same key, same size) are not asked
again, so a steady pass costs the LIST and one HEAD per new object. The index is replaced by a
delete then a write-once PUT (``If-None-Match``): the bucket policy that makes KV write-once
(docs/operations.md) needs no exception, and an engine that polls in between sees a 404 and keeps
the index it has.

Who publishes: the ``s3kv gc --watch`` daemon (``--index EVERY``), not an elected engine. It is one
process per deployment already, it already lists the namespace (with the operator's LIST and
DELETE rights; publishing adds PutObject on the index keys only), and it holds no GPU: a LIST pass
of a million objects (1,000 requests, tens of seconds) never runs on an engine, nor does an
election over S3 (leases by conditional writes, failover when the leader dies). Where no publisher
runs, engines see no index and fall back to what they did before (the LIST summary if
``S3KV_LOOKUP_SUMMARY_S`` > 0, else HEAD waves).

**Expiring in each pass** (where gc learns the retention, and has checked this host's clock
against the store's: :meth:`Publisher.vouch`): the pass deletes what its own listing shows expired --
each object past the retention gc keeps it for (``keep_s``) plus gc's margin, gc's own rule -- and
leaves it out of the index. Why here and not only in gc's ``--watch`` pass: that pass runs every
few minutes, and an expired object lives on half a period on average. At a 10-minute period
that was 300 s on top of the ~17 minutes gc then kept an object at the shortest retention it learns
(363 s + its 660 s margin of the time): up to 30% more storage, itself a third to a half of the S3 bill on
the workload family. The publisher lists every ``every_s`` anyway, so deleting from that
listing costs no request but the DELETEs.

**Refreshing** (:class:`IndexRefresher`, one per leader): a conditional GET every
``S3KV_FLEET_INDEX_S`` on a daemon thread (an unchanged index is a 304, no body); a changed one
is parsed there, never on the scheduler's thread. What it refuses (counted by reason in
``refused``):

* an index that is not this namespace's, malformed, or larger than ``fleet_index_max_objects``;
* with an integrity key: an unsigned index, one signed by a key it does not hold, or one whose
  tag does not verify -- anyone with ``s3:PutObject`` on the prefix can write that key, and only
  a key holder's index may answer for the fleet (a planted index could only hide objects, but it
  could also vouch for planted ones);
* an index listed before the one it holds while that one is still fresh (an old signed index
  written back: its objects may be gone).

An index is **fresh** while younger than three publish periods (its own ``every_s``, at least
three refresh intervals): a publisher that stopped is noticed by its index's age, and lookups
fall back. ``clock`` is POSIX time (the index carries the publisher's); a replay on a trace's
clock passes its own to both sides, and :meth:`IndexRefresher.refresh` picks a new index up at once.
"""

from __future__ import annotations

import _thread
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..core.cost import EXPIRY_MARGIN_S
from ..core.fleetindex import (
    DIGEST_BYTES,
    FRESH_PERIODS,
    INDEX_NAME,
    FleetIndex,
    IndexEntry,
    IndexFormatError,
    SectionId,
    add_evidence,
    decode,
    encode,
    max_index_bytes,
)
from ..core.integrity import IntegrityKeys
from ..core.keys import ParsedKey, parse_key
from ..core.objects import ObjectFormatError, ObjectIdentity, span_from_metadata
from ..core.retention import (
    REPORT_EVERY_S,
    REPORT_STALE_S,
    REPORTS_DIR,
    RETENTION_FLOOR_S,
    FleetReads,
    believe_s,
    decode_report,
    encode_report,
    engine_lag_s,
    learn_retention,
    parse_report_key,
    report_key,
    retention_for,
)
from ..core.value import HALF_LIFE_S as VALUE_HALF_LIFE_S
from ..core.value import KEEP, LAG_BINS
from ..store.base import NotFound, ObjectInfo, ObjectStore, StoreError

log = logging.getLogger("s3kv.fleetindex")

#: HEADs of one batch when the publisher asks about new objects.
HEAD_BATCH = 256
#: A publisher's clock may run this far ahead of an engine's before its index is refused.
MAX_SKEW_S = 60.0
#: Deleted objects an engine remembers (``IndexRefresher.gone``, ~150 bytes each: ~15 MB): a busy
#: fleet's tails of an hour or more (the 3,000-request replays delete a few thousand).
GONE_ENTRIES = 100_000
#: Copies of its own last reports an engine keeps (the index may hold any of the last few).
SENT_KEPT = 16
#: A wall-clock step this large since gc checked the store's clock stops the index passes'
#: deletions (``Publisher.vouch``); well within gc's 60 s margin, well above NTP slewing.
MAX_STEP_S = 10.0


def index_key(namespace_prefix: str) -> str:
    """Where a namespace's index lives (``namespace_prefix`` ends with ``/``)."""
    return namespace_prefix + INDEX_NAME


# ------------------------------------------------------------------------------ publishing
@dataclass
class PublishReport:
    """One pass: per namespace prefix, objects indexed; and what the pass cost."""

    indexed: dict[str, int] = field(default_factory=dict)
    heads: int = 0
    #: Objects left out: their HEAD refused them (foreign, unsigned, damaged), or it failed.
    refused: int = 0
    failed: int = 0
    #: Objects not asked about yet (past ``max_heads``): in the next pass's index.
    deferred: int = 0
    bytes: int = 0
    #: Namespaces whose index could not be written (the error), and those another writer held.
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: Objects (and their bytes) the pass deleted as expired (module doc, expiring in each pass).
    expired: int = 0
    expired_bytes: int = 0


class Publisher:
    """Publishes the index of every namespace under ``root`` (or of one), keeping what its HEADs
    learned between passes (``_known``: key -> (size, end, count), or (size, None) refused)."""

    def __init__(
        self,
        store: ObjectStore,
        root: str,
        *,
        integrity: IntegrityKeys | None = None,
        every_s: float = 10.0,
        max_heads: int = 100_000,
        namespaces: Iterable[str] = (),
        sub_prefixes: bool = False,
        clock: Callable[[], float] = time.time,
        learn: tuple[float, float] | None = None,
        engine_poll_s: float = 5.0,
    ):
        """``namespaces``: prefixes (``{root}{namespace}/``) published even while they hold nothing
        yet -- an empty index answers every lookup of a new namespace "miss" for free, where without
        one engines probe until its first objects are listed. ``sub_prefixes``: also namespaces
        below sub-prefixes of ``root`` (another deployment's URL, as ``s3kv gc`` keeps out of them
        unless told to); by default only ``{root}{namespace}/``. ``learn``: (ceiling s, gc's margin
        s) to learn each namespace's retention from the engines' read reports and publish it
        (``s3kv.core.retention``); None: keep the ceiling, publish none. ``engine_poll_s``: how
        often engines fetch the index (``S3KV_FLEET_INDEX_S``): how late they may learn of a change."""
        self.store = store
        self.root = root
        self.namespaces = list(namespaces)
        self.sub_prefixes = sub_prefixes
        self.integrity = integrity
        self.every_s = every_s
        self.max_heads = max_heads
        self._clock = clock
        self._known: dict[str, tuple[int, int | None, int]] = {}
        self._last_s = 0.0
        self.learn = learn
        self.engine_poll_s = engine_poll_s
        #: Per namespace prefix: the fleet's reads, the report keys taken, and (retention s, since).
        self.reads: dict[str, FleetReads] = {}
        #: Per namespace: the fleet's write-policy evidence as this pass summed it (``_learn``).
        self._evidence: dict[str, tuple[dict[str, tuple[float, float]], dict[str, int]] | None] = {}
        self._taken: set[str] = set()
        self.retention: dict[str, tuple[float, float]] = {}
        #: Per namespace prefix: gc's margin past the retention as the last pass set it
        #: (:meth:`margin_s`).
        self._margin: dict[str, float] = {}
        #: Per namespace prefix: (time set, retention kept) of the retentions gc kept within the
        #: last :meth:`_shrink_after_s`, oldest first -- the first one in force at the window's start
        #: (:meth:`keep_s`: a shorter retention deletes only once no engine may act on an answer
        #: given under a longer one).
        self._kept: dict[str, list[tuple[float, float]]] = {}
        #: Per namespace prefix: until when a retention longer than the one learnt last applies (past
        #: or to come): :meth:`held_until`.
        self._held: dict[str, float] = {}
        #: Per namespace prefix: (time published, what engines believe) since learning began,
        #: oldest first (``core.retention.retention_for``: what gc keeps each object for).
        self.history: dict[str, list[tuple[float, float]]] = {}
        #: The store's clock minus this host's, as gc last checked it (``vouch``); None:
        #: unchecked, and the pass deletes nothing (module doc, expiring in each pass).
        self.expire_skew_s: float | None = None
        self._vouched = (0.0, 0.0)
        #: This host's wall and monotonic clocks (a test steps the wall one).
        self.wall: Callable[[], float] = time.time
        self.mono: Callable[[], float] = time.monotonic
        #: What its passes deleted as expired since it started: objects, bytes.
        self.expired_total = [0, 0]

    def publish(self, now: float | None = None, namespace: str | None = None) -> PublishReport:
        """One pass: list, HEAD what is new, write each namespace's index. ``now``: the listing's
        time (default: the clock); ``namespace``: only that one (32 hex digits). Raises
        StoreError when the listing fails (nothing written)."""
        t0 = time.perf_counter()
        listed_at = self._clock() if now is None else now
        rep = PublishReport()
        by_ns: dict[str, list[tuple[ObjectInfo, ParsedKey]]] = {
            nsp: [] for nsp in self.namespaces if not namespace or namespace in nsp
        }
        reports: dict[str, list[tuple[ObjectInfo, str, int]]] = {}
        for info in self.store.list(self.root):
            rel = info.key[len(self.root):]
            if self.learn is not None and REPORTS_DIR in rel:
                ns_rel, _, name = rel.partition("/")
                rep_of = parse_report_key(name)
                if rep_of is not None and rel.count("/") == 2 and (not namespace or ns_rel == namespace):
                    reports.setdefault(info.key[: len(self.root) + len(ns_rel) + 1], []).append((info, *rep_of))
                continue
            parsed = parse_key(rel)
            if parsed is None or parsed.tp_size < 1 or not 0 <= parsed.shard < parsed.tp_size:
                continue
            if not self.sub_prefixes and rel.count("/") != 2:
                continue  # under a sub-prefix: another deployment's
            if namespace and parsed.namespace != namespace:
                continue
            tail = f"{parsed.group_fingerprint}.{parsed.shard}of{parsed.tp_size}/{parsed.digest}"
            by_ns.setdefault(info.key[: len(info.key) - len(tail)], []).append((info, parsed))
        if self.learn is not None:
            for nsp in reports:  # engines that report: a live namespace, even before its first object
                by_ns.setdefault(nsp, [])
            for nsp in by_ns:
                self._learn(nsp, reports.get(nsp, []), listed_at)
        known: dict[str, tuple[int, int | None, int]] = {}
        budget = self.max_heads
        for nsp, objs in by_ns.items():
            objs = self._expire(nsp, objs, listed_at, rep)
            fresh = [(i, p) for i, p in objs if self._known.get(i.key, (-1,))[0] != i.size]
            asked, rep.deferred = fresh[:budget], rep.deferred + max(0, len(fresh) - budget)
            budget -= len(asked)
            learned = self._head(asked, rep)
            sections: dict[SectionId, list[IndexEntry]] = {}
            for info, p in objs:
                got = learned.get(info.key) or self._known.get(info.key)
                if got is None or got[0] != info.size:
                    continue  # deferred, or its HEAD failed: next pass
                known[info.key] = got
                if got[1] is None:
                    continue  # refused
                written = info.last_modified if info.last_modified is not None else listed_at
                sections.setdefault((p.group_fingerprint, p.shard, p.tp_size), []).append(
                    IndexEntry(bytes.fromhex(p.digest), got[1], got[2], min(written, listed_at))
                )
            key = index_key(nsp)
            tag = self.integrity.current if self.integrity is not None else None
            # The period engines judge its age by: a pass longer than the period sets the pace.
            every = max(self.every_s, self._last_s, time.perf_counter() - t0)
            data = encode(bytes.fromhex(nsp[-33:-1]), sections, object_key=key, listed_at=listed_at,
                          published_at=self._clock(), every_s=every, tag_key=tag,
                          retention=self.retention.get(nsp), retention_history=self.history.get(nsp, ()),
                          evidence=self._evidence.get(nsp))
            try:
                self.store.delete_many([key])
                if not self.store.put(key, data):
                    rep.errors[nsp] = "another writer created the index between this pass's delete and write"
                    continue
            except StoreError as e:
                rep.errors[nsp] = f"{type(e).__name__}: {e}"
                continue
            rep.indexed[nsp] = sum(len(v) for v in sections.values())
            rep.bytes += len(data)
        self._known = known
        rep.seconds = self._last_s = time.perf_counter() - t0
        return rep

    def vouch(self, skew_s: float | None) -> None:
        """gc just read the store's clock: ``skew_s`` is it minus this host's (None: unchecked, a
        dry run -- delete nothing). Until the next check the passes add it to this host's clock,
        unless that clock steps meanwhile (an NTP step, a VM resumed): past :data:`MAX_STEP_S`
        of difference from the monotonic clock they stop deleting until gc checks again."""
        self.expire_skew_s = skew_s
        self._vouched = (self.wall(), self.mono())

    def _expire(self, nsp: str, objs: list[tuple[ObjectInfo, ParsedKey]], listed_at: float,
                rep: PublishReport) -> list[tuple[ObjectInfo, ParsedKey]]:
        """Delete the objects of ``objs`` past gc's cutoff (module doc); the ones left. An object
        whose DELETE failed stays, in the index too: the next pass (or gc's) tries again."""
        if self.expire_skew_s is None or self.learn is None or nsp not in self.retention:
            return objs
        step = (self.wall() - self._vouched[0]) - (self.mono() - self._vouched[1])
        if abs(step) > MAX_STEP_S:
            log.warning("s3kv gc: this host's clock stepped %+.0f s since gc checked it against the store's: "
                        "index passes delete nothing until the next check", step)
            self.expire_skew_s = None
            return objs
        now = listed_at + self.expire_skew_s
        gone: list[ObjectInfo] = []
        for info, _ in objs:
            cutoff = self.cutoff_s(nsp, info.last_modified)
            if cutoff is not None and now - info.last_modified >= cutoff:  # type: ignore[operator]
                gone.append(info)
        if not gone:
            return objs
        try:
            self.store.delete_many([o.key for o in gone])  # the store batches (S3: 1,000 a request)
        except StoreError as e:
            log.warning("s3kv gc: %d expired objects of %s not deleted in this index pass: %s", len(gone), nsp, e)
            return objs
        rep.expired += len(gone)
        rep.expired_bytes += sum(o.size for o in gone)
        self.expired_total[0] += len(gone)
        self.expired_total[1] += sum(o.size for o in gone)
        deleted = {o.key for o in gone}
        return [(i, p) for i, p in objs if i.key not in deleted]

    def _learn(self, nsp: str, reports: list[tuple[ObjectInfo, str, int]], now: float) -> None:
        """Fold a namespace's new read reports into its fleet reads and choose its retention
        (``s3kv.core.retention``); superseded and stale reports are deleted. A report that cannot
        be read is left for the next pass; one that is not a report is skipped for good."""
        assert self.learn is not None
        cap_s = self.learn[0]
        reads = self.reads.setdefault(nsp, FleetReads(LAG_BINS))
        newest: dict[str, tuple[ObjectInfo, int]] = {}
        gone: list[str] = []
        for info, engine, seq in reports:
            cur = newest.get(engine)
            if cur is None or seq > cur[1]:
                if cur is not None:
                    gone.append(cur[0].key)
                newest[engine] = (info, seq)
            else:
                gone.append(info.key)
        for engine, (info, seq) in sorted(newest.items(), key=lambda x: x[1][1]):
            stale = info.last_modified is not None and now - info.last_modified > REPORT_STALE_S
            if stale:
                gone.append(info.key)
            if stale or info.key in self._taken:
                continue
            try:
                got = decode_report(self.store.get(info.key), LAG_BINS, info.key, self.integrity)
            except StoreError:
                continue
            except (ValueError, KeyError, TypeError):
                log.warning("s3kv: %s is not a read report (or not signed by our key); skipped", info.key)
            else:
                reads.take(engine, got.lag_reads, min(got.at, now))
                reads.take_evidence(engine, seq, min(got.at, now), got.evidence)
                reads.take_belief(engine, min(got.at, now), got.belief_s)
            self._taken.add(info.key)
        if gone:
            try:
                self.store.delete_many(gone)
            except StoreError:
                pass  # the next pass deletes them
            self._taken.difference_update(gone)
        # The margin covers the longest an engine reporting here promises loads on an answer it got:
        # one that runs other settings than gc (a rolling upgrade from the old 600 s TTL) is kept
        # safe by what it says, not by what gc was told.
        margin_s = self._margin[nsp] = max(self.learn[1], reads.longest_belief(now) + EXPIRY_MARGIN_S)
        since = self.retention[nsp][1] if nsp in self.retention else self._learning_since(nsp, now)
        # The evidence the index will carry, summed once: it also says what the reads pay for.
        pooled = self._evidence[nsp] = self._pooled(nsp, now)
        paid, stored = pooled[0].get(KEEP, (0.0, 0.0)) if pooled is not None else (0.0, 0.0)
        r = learn_retention(reads.lag_reads, margin_s=margin_s, cap_s=cap_s, watched_s=now - since,
                            paid_s=paid / stored if stored > 0 else None)  # (core.value.KEEP)
        self.retention[nsp] = (cap_s if r is None else r, since)
        kept = self._kept.setdefault(nsp, [])
        if not kept or kept[-1][1] != self.retention[nsp][0]:
            kept.append((now, self.retention[nsp][0]))
        after = self._shrink_after_s(margin_s)
        longer = [kept[i + 1][0] + after for i in range(len(kept) - 1) if kept[i][1] > kept[-1][1]]
        self._held[nsp] = max([self._held.get(nsp, -math.inf), *longer])
        while len(kept) > 1 and kept[1][0] <= now - after:
            kept.pop(0)
        hist = self.history.setdefault(nsp, [])
        b = believe_s(r)
        if not hist or hist[-1][1] != b:
            hist.append((now, b))
        # What no object alive can have been believed under any more: past the ceiling's span.
        while len(hist) > 1 and hist[1][0] < now - 2 * (cap_s + margin_s):
            hist.pop(0)

    def _pooled(self, nsp: str, now: float) -> tuple[dict[str, tuple[float, float]], dict[str, int]] | None:
        """The fleet's write-policy evidence the index carries (``s3kv.core.value``, pooled over the
        fleet); None where no engine reported any."""
        reads = self.reads.get(nsp)
        if reads is None or not reads.evidence:
            return None
        return reads.pooled(now, VALUE_HALF_LIFE_S)

    def keep_s(self, nsp: str, touched_at: float, *, settled: bool = False) -> float | None:
        """The retention gc keeps a namespace's object for, last written or refreshed at
        ``touched_at`` (``core.retention.retention_for``); None where it learns none. ``settled``:
        once the longer retentions it kept lately no longer apply (:meth:`held_until`)."""
        got = self.retention.get(nsp)
        if self.learn is None or got is None:
            return None
        lag = engine_lag_s(self.every_s, self.engine_poll_s, EXPIRY_MARGIN_S)
        # The longest retention kept lately, not the one just learnt: an engine told an object is
        # there (a HEAD, a listing) while gc kept it promises loads of it on that answer for a
        # while, and a shorter retention would delete it under the promise. In a replay of batch
        # jobs over shared templates (one engine, S3 only), gc learnt 300 s after keeping the
        # ceiling: chain objects 11 minutes old that a lookup had just found present were deleted
        # in the next pass, and the load promised on them failed (the request parked for good).
        kept = got[0] if settled else max((r for _, r in self._kept.get(nsp, ())), default=got[0])
        return retention_for(self.history.get(nsp, ()), touched_at, retention_s=max(got[0], kept), since=got[1],
                             cap_s=self.learn[0], lag_s=lag)

    def held_until(self, nsp: str) -> float:
        """Until when gc deletes a namespace's objects by a retention longer than the one it learnt
        last (:meth:`keep_s`), that time past or to come; -inf where never."""
        return self._held.get(nsp, -math.inf)

    def _shrink_after_s(self, margin_s: float) -> float:
        """How long after gc keeps a shorter retention it deletes by it: engines may act on an index
        of the longer one for their lag, and on an answer they got under it (a HEAD, a listing) for
        their promise -- what gc's margin covers."""
        return engine_lag_s(self.every_s, self.engine_poll_s, EXPIRY_MARGIN_S) + margin_s

    def cutoff_s(self, nsp: str, last_modified: float | None) -> float | None:
        """The age past which gc deletes a namespace's object last written or refreshed at
        ``last_modified``: the retention it keeps it for (``keep_s``) plus gc's margin; None where
        it learns none (or the store gave no date). Both gc's pass and the index passes ask here."""
        if last_modified is None or self.learn is None:
            return None
        keep = self.keep_s(nsp, last_modified)
        return None if keep is None else keep + self.margin_s(nsp)

    def margin_s(self, nsp: str) -> float:
        """gc's margin past the retention in a namespace: its own settings' (``learn``), or longer
        where an engine reporting there promises loads on older answers (``_learn``)."""
        assert self.learn is not None
        return self._margin.get(nsp, self.learn[1])

    def _learning_since(self, nsp: str, now: float) -> float:
        """Since when gc has learnt this namespace's retention: as its last index says (a gc that
        restarted goes on), else from ``now``."""
        key = index_key(nsp)
        try:
            old = decode(self.store.get(key), object_key=key, namespace=bytes.fromhex(nsp[-33:-1]),
                         keys=self.integrity, max_objects=1 << 62)
        except (StoreError, IndexFormatError, ValueError):
            return now
        if self.integrity is not None and not old.verified:
            return now
        self.history[nsp] = list(old.retention_history)
        if old.retention_s is not None:  # kept until now, by the gc before this one
            self._kept[nsp] = [(now, old.retention_s)]
        return old.auto_since if old.auto_since is not None and old.auto_since <= now else now

    def _head(self, objs: list[tuple[ObjectInfo, ParsedKey]], rep: PublishReport) -> dict[str, tuple[int, int | None, int]]:
        """What HEADs say of new objects: (size, end, count), or (size, None, 0) for one refused."""
        out: dict[str, tuple[int, int | None, int]] = {}
        for i in range(0, len(objs), HEAD_BATCH):
            chunk = objs[i : i + HEAD_BATCH]
            try:
                batch = self.store.head_many([o.key for o, _ in chunk])
            except StoreError:
                rep.failed += len(chunk)
                continue
            rep.heads += len(chunk)
            for info, p in chunk:
                found = batch.found.get(info.key)
                if found is None:
                    rep.failed += info.key in batch.failed
                    continue  # gone since the listing, or failed: not in this index
                try:
                    span = span_from_metadata(self._identity(p, found.metadata), found.metadata, found.size, info.key)
                except (ObjectFormatError, ValueError):
                    rep.refused += 1
                    out[info.key] = (info.size, None, 0)
                    continue
                out[info.key] = (info.size, span.first + span.count, span.count)
        return out

    def _identity(self, p: ParsedKey, md: Mapping[str, str]) -> ObjectIdentity:
        """The identity the key promises, sizes from the metadata (as ``s3kv verify`` does)."""
        return ObjectIdentity(bytes.fromhex(p.namespace), p.group_fingerprint, p.shard, p.tp_size,
                              int(md.get("s3kv-tpb", "")), int(md.get("s3kv-page-bytes", "")),
                              integrity=self.integrity)


# ------------------------------------------------------------------------------ refreshing
class IndexRefresher:
    """The engine's copy of its namespace's index (module docstring). Reading is lock-free: the
    index is replaced whole."""

    def __init__(
        self,
        store: ObjectStore,
        key: str,
        namespace: bytes,
        *,
        keys: IntegrityKeys | None,
        interval_s: float,
        max_objects: int,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.key = key
        self.namespace = namespace
        self.keys = keys
        self.interval_s = interval_s
        self.max_objects = max_objects
        self.clock = clock
        self._index: FleetIndex | None = None
        self._etag: str | None = None
        #: Counts up with every index taken (lookups tell snapshots apart by it).
        self.generation = 0
        self.fetches = 0
        self.failures = 0
        self._failing = 0  # failures since the store last answered: a streak warns once
        self.refused: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._said_missing = False
        #: How long this engine promises loads on an answer it got (a HEAD, a listing), reported for
        #: gc's margin (``FleetReads.longest_belief``); None: not said (gc assumes the old default).
        self.belief_s: float | None = None
        #: The engine's dated reads (``ValueModel.lag_reads``), reported while gc learns the
        #: retention (``s3kv.core.retention``); None: this engine reports nothing.
        self.reads: Callable[[], Sequence[float]] | None = None
        #: The engine's write-policy evidence (``ValueModel.evidence``), reported beside its reads
        #: for gc to pool; None: none. The last reports' copies (number -> (time, evidence)) are
        #: kept: an index's sum holds one of them, which :meth:`others` takes back out.
        self.evidence: Callable[[], dict[str, list[float]] | None] | None = None
        self._sent: OrderedDict[int, tuple[float, dict[str, list[float]]]] = OrderedDict()
        self._others: tuple[FleetIndex | None, dict[str, tuple[float, float]]] = (None, {})
        self.engine = os.urandom(8).hex()
        self.reports = 0
        self._reported_at = float("-inf")
        #: Objects gc deleted, as successive indexes show: a digest's first 8 bytes (its index key)
        #: -> (write time,), of the sections whose fingerprint is in ``track`` (shard 0), the newest
        #: :data:`GONE_ENTRIES` kept. Where a lookup would have gone on past its hit, a ghost read
        #: (``core.retention``). Keyed by bytes, not the key's int: a lookup checks every block end
        #: of its prompt past the hit, on the scheduler's thread (0.15 ms for 2,048 blocks, not 0.56).
        self.gone: OrderedDict[bytes, tuple[float]] = OrderedDict()
        self.track: frozenset[str] = frozenset()

    # -- reading --------------------------------------------------------------------------
    def max_age_s(self, idx: FleetIndex | None = None) -> float:
        idx = idx or self._index
        every = idx.every_s if idx is not None else 0.0
        return FRESH_PERIODS * max(every, self.interval_s)

    def age_s(self) -> float:
        """Seconds since the current index's listing began (inf without one)."""
        idx = self._index
        return self.clock() - idx.listed_at if idx is not None else float("inf")

    @property
    def held(self) -> FleetIndex | None:
        """The last index taken, fresh or not (what gc said it deletes by stays true while it is gone)."""
        return self._index

    def current(self) -> FleetIndex | None:
        """The index, if fresh (module docstring); None otherwise."""
        idx = self._index
        if idx is None or self.clock() - idx.listed_at > self.max_age_s(idx):
            return None
        return idx

    # -- refreshing -----------------------------------------------------------------------
    def refresh(self) -> bool:
        """One conditional GET; True if a new index replaced the one held. Never raises a store
        error (counted, logged once per streak). Its thread and a caller (a replay) may both call it."""
        with self._lock:
            took = self._refresh()
            self.report()
            return took

    def report(self, force: bool = False) -> None:
        """Write this engine's read report when the index says gc learns the retention and the
        last one is :data:`REPORT_EVERY_S` old, or ``force`` (a failure: the next pass tries again)."""
        idx, now = self._index, self.clock()
        if self.reads is None or idx is None or idx.retention_s is None:
            return
        if now - self._reported_at < REPORT_EVERY_S and not force:
            return
        key = report_key(self.key[: len(self.key) - len(INDEX_NAME)], self.engine, self.reports)
        try:
            self.reports += 1  # a key taken by a failed write-once PUT is not tried again
            tag = self.keys.current if self.keys is not None else None
            ev = self.evidence() if self.evidence is not None else None
            if self.store.put(key, encode_report(self.reads(), now, key, tag, ev, self.belief_s)):
                self._reported_at = now
                if ev is not None:
                    self._sent[self.reports - 1] = (now, ev)
                    while len(self._sent) > SENT_KEPT:
                        self._sent.popitem(last=False)
        except StoreError as e:
            log.debug("s3kv: read report %s not written: %s", key, e)

    def others(self) -> dict[str, tuple[float, float]] | None:
        """The other engines' write-policy evidence now (``s3kv.core.value``, pooled over the
        fleet): :meth:`others_listed` decayed to now."""
        got = self.others_listed()
        if got is None:
            return None
        keep = 0.5 ** (got[1] / VALUE_HALF_LIFE_S)
        return {k: (r * keep, w * keep) for k, (r, w) in got[0].items()}

    def others_listed(self) -> tuple[dict[str, tuple[float, float]], float] | None:
        """(the other engines' evidence as of the fresh index's listing, seconds since): its fleet
        sum less this engine's own report in it; None without a fresh index that carries one. An
        own report the index holds but this engine no longer has a copy of (a restart) stays in:
        its counts are the fleet's traffic too. Worked out once per index (the write policy asks
        on every request's plan); the caller decays it (a new dict each time, never changed)."""
        idx = self.current()
        if idx is None or idx.evidence is None:
            return None
        age = max(0.0, self.clock() - idx.listed_at)
        if self._others[0] is idx:
            return self._others[1], age
        out = dict(idx.evidence)
        mine = self._sent.get(idx.evidence_of.get(self.engine, -1))
        if mine is not None:
            add_evidence(out, mine[1], -(0.5 ** (max(0.0, idx.listed_at - mine[0]) / VALUE_HALF_LIFE_S)))
            out = {k: (max(0.0, r), max(0.0, w)) for k, (r, w) in out.items()}
        self._others = (idx, out)
        return out, age

    def _refresh(self) -> bool:
        self.fetches += 1
        try:
            got = self.store.get_if_changed(self.key, self._etag)
        except NotFound:
            self._failing = 0
            if not self._said_missing:
                self._said_missing = True
                # Why say what the fallback costs: a next turn's hit ends where its history did,
                # anywhere in an object's stride, and HEADs must ask every block end there (up to a
                # stride's blocks a lookup: 127 for Gemma-3-27B at 32 tokens a block).
                log.info("s3kv: no fleet index at %s yet; until a publisher writes one (s3kv gc --watch ... "
                         "--index 10s), lookups ask with HEADs -- up to an object's blocks per lookup", self.key)
            return False
        except StoreError as e:
            self.failures += 1
            self._failing += 1
            log.log(logging.WARNING if self._failing == 1 else logging.DEBUG,
                    "s3kv: fleet index refresh failed (%s); keeping the one held", e)
            return False
        self._said_missing = False
        self._failing = 0
        if got is None:
            return False
        self._etag = got.etag  # a refused version is not fetched again until it changes
        if len(got.data) > max_index_bytes(self.max_objects):
            return self._refuse("too_large", f"{len(got.data)} bytes")
        try:
            idx = decode(got.data, object_key=self.key, namespace=self.namespace, keys=self.keys,
                         max_objects=self.max_objects)
        except IndexFormatError as e:
            return self._refuse(e.reason, str(e))
        if self.keys is not None and not idx.verified:
            return self._refuse("unsigned", "unsigned, while this engine holds an integrity key")
        now = self.clock()
        if idx.listed_at - now > MAX_SKEW_S:
            return self._refuse("future", f"listed {idx.listed_at - now:.0f} s in this engine's future")
        held = self.current()
        if held is not None and idx.listed_at < held.listed_at:
            return self._refuse("older", "listed before the index held")
        if self._index is not None and self.track:
            self._note_gone(self._index, idx)
        self._index = idx
        self.generation += 1
        return True

    def _note_gone(self, old: FleetIndex, new: FleetIndex) -> None:
        """What ``old`` listed and ``new`` does not, old enough for gc to have deleted it by age.
        Why from the indexes: a reader cannot tell a deleted object from one never
        written, and the object it wanted was most often another engine's -- its own it reads from
        its device."""
        for sid, sec in old.sections.items():
            if sid[0] not in self.track or sid[1] != 0:
                continue
            got = new.sections.get(sid)
            kept = set(got.keys) if got is not None else set()
            for k, age in zip(sec.keys, sec.ages, strict=True):
                written = old.written_at(age)
                # gc deletes by age nothing younger than the floor: one gone sooner went otherwise.
                if k not in kept and new.listed_at - written >= RETENTION_FLOOR_S:
                    b = k.to_bytes(DIGEST_BYTES, "little")
                    self.gone[b] = (written,)
                    self.gone.move_to_end(b)
        while len(self.gone) > GONE_ENTRIES:
            self.gone.popitem(last=False)

    def _refuse(self, reason: str, why: str) -> bool:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.warning("s3kv: fleet index %s refused: %s", self.key, why)
        return False

    def start(self) -> IndexRefresher:
        if not self._started:
            self._started = True
            # Not threading.Thread: its start() waits for the new thread (a GIL hand-off), and this
            # may be called on the scheduling path.
            _thread.start_new_thread(self._run, ())
        return self

    def _run(self) -> None:
        if self.fetches:
            self._stop.wait(self.interval_s)  # refreshed by hand just now: not again at once
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the refresher must outlive any one pass
                log.exception("s3kv: fleet index refresh failed unexpectedly")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()

