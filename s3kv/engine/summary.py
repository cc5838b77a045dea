"""What one namespace holds, from a LIST pass refreshed in the background: cold misses for free.

A lookup that knows nothing about a prompt (no index entry) otherwise probes with HEAD waves:
two or three round trips before it can even say "miss", on the engine's scheduling path.
With a summary of the namespace's objects - every ``(group, shard, chain digest)`` with its
page count, read off the key and the object's size - the lookup answers its probes locally:

* a **miss** costs no request at all (the common case for new prompts);
* a **hit** is a *candidate*: by default (``lookup_summary_trust_s`` = 0), before anything is
  promised every object the hit would load that the index does not already know is HEADed in
  one wave (its metadata checked like any HEAD). A summary can be stale both ways - an object
  written after the listing is a miss until the next refresh (safe), an object deleted since
  the listing fails that verify wave, which drops the candidate and falls back to probing. So
  the summary never causes a promise that the store itself did not just confirm.
* with ``lookup_summary_trust_s`` > 0, a listing younger than that is itself the store's
  confirmation - the same kind of evidence as a HEAD answer, which the index trusts for
  ``index_ttl_s`` (10 minutes by default) - and a cold hit costs no request either. The spans
  then come from key and size (no metadata in a listing): an object planted under one of our
  keys with a plausible size is caught by the load's header and checksum check (a failed load,
  never a wrong byte), where the HEAD path would have rejected it before promising.

Why a LIST and not a digest filter engines publish: the listing is the store's own truth,
costs one request per 1,000 objects per refresh (about a dollar a day per engine at 200k
objects every 30 s), needs no writer cooperation and no format of its own. It is bounded:
past ``max_objects`` the summary gives up (lookups probe with HEADs as before) rather than
hold an unbounded map. Memory: about 100 bytes per object.

The refresh runs on its own daemon thread; the owner (a ``LeaderCore``) stops it with
:meth:`stop` or implicitly by being garbage-collected (``weakref.finalize``).
"""

from __future__ import annotations

import _thread
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.keys import DIGEST_SIZE, KeyScheme
from ..core.objects import MAX_PAGES_PER_OBJECT, object_len
from ..store.base import ObjectStore, StoreError

log = logging.getLogger("s3kv.summary")

#: (group id, shard) -> {chain digest at the object's last block: page count}
Snapshot = Mapping[tuple[int, int], Mapping[bytes, int]]


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
        self._stop = threading.Event()
        self._started = False
        self.refreshes = 0
        self.failures = 0
        self.objects = 0

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

    # -- refreshing ---------------------------------------------------------------------
    def refresh(self) -> bool:
        """One LIST pass; True if a new snapshot replaced the old one."""
        prefix = self.scheme.namespace_prefix
        tp = self.scheme.tp_size
        taken = self._clock()
        snap: dict[tuple[int, int], dict[bytes, int]] = {}
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
                snap.setdefault((grp.group_id, shard), {})[digest] = count
        except StoreError as e:
            self.failures += 1
            log.warning("s3kv: lookup summary refresh of %s failed (%s); keeping the last one", prefix, e)
            return False
        self._snapshot = snap
        self._taken_at = taken
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
