"""What one namespace holds, known without asking the store: cold misses for free.

A lookup that knows nothing about a prompt (no index entry) otherwise probes with HEAD waves:
two or three round trips before it can even say "miss", on the engine's scheduling path. With a
**listing** of the namespace's objects -- every ``(group, shard, chain digest)`` with its page
count -- the lookup answers its probes locally. Two sources, one interface (:class:`Listing`):

* the **fleet index** (``s3kv.engine.fleetindex``, :class:`IndexListing`): one publisher lists
  the namespace and HEADs each new object once; every engine fetches the result with a
  conditional GET every few seconds. Exact spans (from the objects' metadata) and write times.
* the **namespace summary** (:class:`NamespaceSummary`, :class:`SummaryListing`): this engine's
  own LIST pass, every ``lookup_summary_s`` -- the fallback where no fresh index exists (off by
  default: every engine listing on its own is what the index replaces). Spans from key and size.

What a listed entry is worth:

* a **miss** costs no request at all (the common case for new prompts);
* a **hit** is a *candidate*: before anything is promised every object the hit would load that
  the key index does not already know is HEADed in one wave (its metadata checked like any
  HEAD). A listing can be stale both ways - an object written after it is a miss until the next
  one (safe), an object deleted since fails that verify wave, which drops the candidate and falls
  back to probing. So the listing never causes a promise that the store did not just confirm;
* unless the listing is **trusted**: a fleet index signed with the integrity key and younger than
  ``fleet_index_trust_s``, or a LIST younger than ``lookup_summary_trust_s`` for objects it listed
  younger than gc's floor (``Listings.trusted`` says why) -- the same kind of
  evidence as a HEAD answer, which the key index trusts for ``index_ttl_s`` -- and then a cold
  hit costs no request either. An object deleted or planted behind a trusted listing is caught
  by the load (header, checksums, tags: a failed load, never a wrong byte), and
  :class:`TrustGate` then stops trusting that source until it proves right again.

Why the index and not only a LIST per engine: the listing is the store's own truth but costs one
request per 1,000 objects per refresh per engine (about a dollar a day per engine at 200k objects
every 30 s) and holds ~100 bytes per object in every engine; the index is one small request per
engine per refresh, ~18 bytes per object, listed once for the fleet.

The summary's refresh runs on its own daemon thread; the owner (a ``LeaderCore``) stops it with
:meth:`NamespaceSummary.stop` or implicitly by being garbage-collected (``weakref.finalize``).
"""

from __future__ import annotations

import _thread
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.fleetindex import FleetIndex, Section
from ..core.keys import DIGEST_SIZE, KeyScheme
from ..core.objects import MAX_PAGES_PER_OBJECT, object_len
from ..store.base import ObjectStore, StoreError

log = logging.getLogger("s3kv.summary")

#: (group id, shard) -> {chain digest at the object's last block: (page count, LastModified or None)}
Snapshot = Mapping[tuple[int, int], Mapping[bytes, tuple[int, float | None]]]


class Listing:
    """One source's view of the namespace, as a lookup reads it."""

    #: "index" or "list" (metrics, logs).
    source = ""
    #: Tells listings of one source apart: a newer one has a larger number.
    generation = 0

    def find(self, group_id: int, shard: int, digest: bytes, end: int) -> tuple[int, float | None] | None:
        """(page count, when it was written if known) of the object the key ``digest`` names in
        that group and shard, ending at block ``end``; None if not listed (or it cannot end there)."""
        raise NotImplementedError


class SummaryListing(Listing):
    """A LIST pass's snapshot: counts from key and size; write times are the store's LastModified
    (its clock, not this engine's), against ``listed_at`` (this host's wall clock when the pass began)."""

    source = "list"

    def __init__(self, snap: Snapshot, generation: int, listed_at: float):
        self.snap = snap
        self.generation = generation
        self.listed_at = listed_at

    def find(self, group_id: int, shard: int, digest: bytes, end: int) -> tuple[int, float | None] | None:
        got = self.snap.get((group_id, shard), {}).get(digest)
        return None if got is None or got[0] > end else got


class IndexListing(Listing):
    """A fleet index, read with this engine's group ids."""

    source = "index"

    def __init__(self, index: FleetIndex, groups: Mapping[str, int], tp_size: int, generation: int):
        self.index = index
        self.generation = generation
        self._sections: dict[tuple[int, int], Section] = {
            (groups[gfp], shard): sec for (gfp, shard, tp), sec in index.sections.items()
            if tp == tp_size and gfp in groups
        }

    def find(self, group_id: int, shard: int, digest: bytes, end: int) -> tuple[int, float | None] | None:
        sec = self._sections.get((group_id, shard))
        got = sec.find(digest, end) if sec is not None else None
        return None if got is None else (got[0], self.index.written_at(got[1]))


class TrustGate:
    """Whether a listing may stand in for a HEAD (a free hit), per source.

    Trust is lost when a load of an object a listing vouched for fails (``lose``: it was deleted
    behind the listing, or planted at a plausible size): from then on every candidate of that
    source is verified by HEAD -- which refuses a planted object before anything is promised --
    until the source is **re-verified**: a listing taken after the loss, whose candidates then
    passed ``PROBATION`` verify waves in a row with nothing refuted. Without this, every later
    request of a planted namespace was promised a load that failed (issue 37: on the layout line
    each one parked for 4 retries, 9 s).
    """

    PROBATION = 3

    def __init__(self) -> None:
        #: source -> generation of its listing when trust was lost (absent: trusted).
        self._lost: dict[str, int] = {}
        self._confirmed: dict[str, int] = {}

    def trusted(self, source: str) -> bool:
        return source not in self._lost

    def lose(self, source: str, generation: int) -> bool:
        """A load ``source`` vouched for failed; True if that took its trust (it had it)."""
        had = source not in self._lost
        if had:
            log.warning("s3kv: a load of an object the %s listed failed; its hits are verified by HEAD "
                        "until it proves right again", "fleet index" if source == "index" else "namespace LIST")
        self._lost[source] = generation
        self._confirmed[source] = 0
        return had

    def verified(self, source: str, generation: int, ok: bool) -> None:
        """A verify wave over candidates of ``source``'s listing ``generation`` ended: all
        confirmed (``ok``) or something refuted."""
        lost = self._lost.get(source)
        if lost is None:
            return
        if not ok:
            self._confirmed[source] = 0
        elif generation > lost:
            self._confirmed[source] = self._confirmed.get(source, 0) + 1
            if self._confirmed[source] >= self.PROBATION:
                del self._lost[source]
                log.info("s3kv: the %s proved right again; its signed, young entries are trusted", source)


@dataclass(frozen=True)
class SummaryGroup:
    group_id: int
    page_bytes: int
    #: Integrity on: the namespace's objects carry a trailer of keyed tags (and only they are ours).
    tagged: bool = False


def count_from_size(size: int, page_bytes: int, tagged: bool = False) -> int | None:
    """The page count of an object of ``size`` bytes (header + pages, + the trailer of tags when
    ``tagged``), or None if none fits.

    Why ``tagged`` is exact both ways: with integrity on, the size of a genuine object includes
    its trailer -- counted without it, none of a keyed fleet's objects were listed (0 of 18) and
    a summary-enabled engine never hit. And an object at the untagged size in a keyed namespace
    can only be a keyless writer's: listed, it was a hit that trust mode promised and whose load
    then failed (a 416 on the trailer read past its end) for every lookup of that prompt.
    """
    fixed = object_len(0, page_bytes, tagged)
    per = object_len(1, page_bytes, tagged) - fixed  # a page, its checksum (and its tag)
    if size <= fixed or (size - fixed) % per:
        return None
    n = (size - fixed) // per
    return n if n <= MAX_PAGES_PER_OBJECT else None


class NamespaceSummary:
    def __init__(
        self,
        store: ObjectStore,
        scheme: KeyScheme,
        groups: Mapping[str, SummaryGroup],
        *,
        interval_s: float,
        max_objects: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``groups``: group fingerprint -> its id and page size (keys of other groups are ignored)."""
        self.store = store
        self.scheme = scheme
        self.groups = dict(groups)
        self.interval_s = interval_s
        self.max_objects = max_objects
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._taken_at = 0.0
        self._listed_at = 0.0  # wall clock (time.time()) when the snapshot's pass began
        self._stop = threading.Event()
        self._started = False
        self.refreshes = 0
        self.objects = 0
        self._listing: SummaryListing | None = None

    # -- reading (lock-free: the snapshot is replaced whole) ------------------------------
    @property
    def max_age_s(self) -> float:
        """Older than this, the summary is not used (refreshes kept failing)."""
        return 3 * self.interval_s

    def snapshot(self) -> Snapshot | None:
        snap = self._snapshot
        if snap is None or self._clock() - self._taken_at > self.max_age_s:
            return None
        return snap

    def age_s(self) -> float:
        """Seconds since the current snapshot's listing began (inf without one)."""
        return self._clock() - self._taken_at if self._snapshot is not None else float("inf")

    @property
    def ready(self) -> bool:
        return self.snapshot() is not None

    def listing(self) -> SummaryListing | None:
        """The current snapshot as a :class:`Listing` (None: not ready or too old)."""
        snap = self.snapshot()
        if snap is None:
            return None
        cur = self._listing
        if cur is None or cur.snap is not snap:
            cur = self._listing = SummaryListing(snap, self.refreshes, self._listed_at)
        return cur

    # -- refreshing ---------------------------------------------------------------------
    def refresh(self) -> bool:
        """One LIST pass; True if a new snapshot replaced the old one."""
        prefix = self.scheme.namespace_prefix
        tp = self.scheme.tp_size
        taken, listed_at = self._clock(), time.time()
        snap: dict[tuple[int, int], dict[bytes, tuple[int, float | None]]] = {}
        n = 0
        try:
            for info in self.store.list(prefix):
                if self._stop.is_set():
                    return False
                rest = info.key[len(prefix) :]
                gs, _, digest_hex = rest.partition("/")
                gfp, _, shard_s = gs.partition(".")
                grp = self.groups.get(gfp)
                if grp is None or len(digest_hex) != 2 * DIGEST_SIZE:
                    continue
                shard_str, _, tp_str = shard_s.partition("of")
                try:
                    shard = int(shard_str)
                    digest = bytes.fromhex(digest_hex)
                except ValueError:
                    continue
                if tp_str != str(tp) or not 0 <= shard < tp:
                    continue
                count = count_from_size(info.size, grp.page_bytes, grp.tagged)
                if count is None:
                    continue  # not one of our objects (or damaged): the HEAD path would reject it too
                n += 1
                if n > self.max_objects:
                    log.warning(
                        "s3kv: namespace %s holds more than %d objects; lookup summary off "
                        "(raise S3KV_LOOKUP_SUMMARY_MAX_OBJECTS to keep it)",
                        prefix, self.max_objects,
                    )
                    self._snapshot = None
                    self.objects = n
                    return False
                snap.setdefault((grp.group_id, shard), {})[digest] = (count, info.last_modified)
        except StoreError as e:
            log.warning("s3kv: lookup summary refresh of %s failed (%s); keeping the last one", prefix, e)
            return False
        self._snapshot = snap
        self._taken_at, self._listed_at = taken, listed_at
        self.objects = n
        self.refreshes += 1
        return True

    def start(self) -> NamespaceSummary:
        if not self._started:
            self._started = True
            # Not threading.Thread: its start() waits until the new thread runs (a GIL hand-off,
            # milliseconds), and this is called from the first lookup on the scheduling path.
            _thread.start_new_thread(self._run, ())
        return self

    def _run(self) -> None:
        if self._snapshot is not None:
            self._stop.wait(self.interval_s)  # refreshed by hand just now: not again at once
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the refresher must outlive any one pass
                log.exception("s3kv: lookup summary refresh failed unexpectedly")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
