"""The host tier: one rank's s3kv objects in host memory (DRAM), in front of the store.

TensorRT-LLM switches its own host KV tier off when a connector attaches; this gives it back.
A :class:`HostTier` holds whole s3kv objects -- the same keys and the same bytes as the store
(header, pages, integrity trailer), so the same checks apply -- in one arena allocated once
(pinned when the cache is on a GPU: :class:`~s3kv.transfer.staging.StagingPool`'s allocator,
``load_reserve_fraction=0``), carved per object. Nothing is allocated on the hot path. Pages
sit at a 4 KiB boundary of their buffer with the header just before them, so a load copies
host->device straight from the arena (no staging, no second host copy). Pinning takes seconds per
10 GiB, so a pinned arena is allocated on a thread of its own: the engine's start-up does not wait,
and until the arena is ready the tier holds nothing (every reservation is a ghost, see below).
Bytes enter the tier checked (:meth:`commit` decodes what the encoder wrote; a promoted object is
verified whole) and the entry keeps that header and the bytes around its pages; a hit compares
the arena's bytes to those instead of decoding the header again.

Bound and value. ``capacity`` bounds the bytes charged, never exceeded: an object is charged
its buffer (or what ``weigh(key, nbytes)`` says of an object of ``nbytes`` -- its size as the
store holds it, ``88 + count x (page_bytes + 8)`` plus any integrity trailer: the trace replay
charges a real model's sizes while the simulator moves tiny pages; a tier with a weigher keeps
each object in a buffer of its own instead of an arena, so it is for simulation). Room is made by evicting the object of least value,
Greedy-Dual-Size-Frequency: ``priority = L + (1 + hits) x tokens / charged bytes`` (what a hit
is worth per byte it holds, times how often it was read), where ``L`` is the priority of the last
object evicted -- an object not read for a while falls behind everything admitted or read
since (recency) without any clock.

Deterministic from the plan (why: every TP rank keeps its own tier of its own shard, and the
leader plans from rank 0's): the tier's *logical* state -- which keys it accounts for, their
priorities, what is evicted -- changes only on calls made from the worker thread in plan
order: :meth:`reserve` (a seal, a promoted load), :meth:`acquire` (a load's hit). Filling the
bytes happens later on an upload or download thread (:meth:`fill_pages` / :meth:`commit`); an
entry is seen by lookups and loads only once committed. What can still differ between ranks --
an arena too fragmented for a buffer, a save or read that failed on one rank -- leaves a
*ghost*: an entry accounted and evicted like any other, whose bytes are not there (never
served). Ranks stay in step on what they account; a rank whose ghost was asked for falls back
to the store (``host_divergence``).

Writes to S3 (``SealOp.to_s3``): ``now`` -- the caller writes through; ``evict`` -- written to
the store when evicted, only if a load read it while cached (:meth:`acquire`), on the tier's
write-back thread; ``never`` -- host only, dropped at eviction. An evicted object leaves the map
at once: from then on no lookup is answered from it (its write-back, if any, reports to
``on_written`` once the store has it).

As an :class:`~s3kv.store.base.ObjectStore` (a wrapper in front of ``inner``): HEAD and ranged
reads of held objects are answered from memory, everything else is the inner store's. Writes go
to the inner store only: the tier admits objects through :meth:`reserve` (the engine's path,
which knows what an object is worth and to whom it must be written).

Why this is one module: the accounting, the eviction order and the lifetime of each object's
bytes (reserved, filled, committed, read by loads in flight, written back) are one state under
one lock; split, every half would reach into the other's.
"""

from __future__ import annotations

import builtins
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.cost import put_requests
from ..core.objects import (
    ObjectFormatError,
    ObjectHeader,
    ObjectIdentity,
    ObjectSpan,
    decode_header,
    header_len,
    object_len,
    object_metadata,
    trailer_len,
)
from ..core.plan import TO_S3
from ..store.base import Buffer, ByteRange, HeadBatch, IntegrityError, ObjectInfo, ObjectStore, StoreWrapper
from .counters import Counters
from .staging import SAVE, StagingBuffer, StagingPool, round_up

log = logging.getLogger(__name__)

#: Pages start at a multiple of this inside an object's buffer, a tier's or a load's staging (the header
#: sits just before them).
PAGE_ALIGN = 4096
#: Write policies a seal may carry (``SealOp.to_s3``).
NOW, EVICT, NEVER = WRITE_POLICIES = TO_S3

#: ``weigh(key, nbytes) -> bytes charged against the capacity``.
Weigher = Callable[[str, int], int]


def _split_key(key: str) -> tuple[str, bytes | None]:
    """(the key's prefix through its last "/", the digest its last part names; None if it names none)."""
    prefix, _, last = key.rpartition("/")
    try:
        return prefix + "/", bytes.fromhex(last)
    except ValueError:
        return prefix + "/", None


@dataclass(eq=False)
class TierEntry:
    """One object the tier accounts for. Its bytes are ``buf[base - hl, base + count*pb + tl)``."""

    key: str
    identity: ObjectIdentity
    first: int
    count: int
    to_s3: str
    charged: int
    tokens: int
    buf: StagingBuffer | None  # None: a ghost (accounted, never served)
    base: int  # offset of page 0 in ``buf``
    priority: float = 0.0
    hits: int = 0
    #: A load read it while cached: an ``evict`` object is then written to the store at eviction.
    read: bool = False
    #: A load read it whole from the store to hold it here (:meth:`HostTier.promotion_read_share`).
    promoted: bool = False
    ready: bool = False  # bytes filled and committed: lookups and loads may use it
    #: The store holds this object too (written through, or read from there).
    stored: bool = False
    evicted: bool = False
    version: int = 0
    #: The header as checked when the bytes were admitted (decoded from them), and those bytes
    #: (header, then trailer): a hit compares the arena's to these instead of decoding again.
    header: ObjectHeader | None = None
    admitted: bytes = b""

    @property
    def header_len(self) -> int:
        return header_len(self.count)

    @property
    def size(self) -> int:
        """The object's bytes (as the store holds it)."""
        tl = trailer_len(self.count) if self.identity.integrity is not None else 0
        return self.header_len + self.count * self.identity.page_bytes + tl

    @property
    def span(self) -> ObjectSpan:
        return ObjectSpan(self.first, self.count)

    @property
    def start(self) -> int:
        """Offset of the object's first byte (the header) in ``buf``."""
        return self.base - self.header_len

    def object_view(self) -> memoryview:
        assert self.buf is not None
        return self.buf.memoryview(self.start, self.size)

    def framing(self, buf: StagingBuffer) -> bytes:
        """The bytes around the pages in ``buf`` (this entry's buffer): header, then trailer."""
        hl, pages = header_len(self.count), self.count * self.identity.page_bytes
        tl = trailer_len(self.count) if self.identity.integrity is not None else 0
        v = buf.memoryview(self.base - hl, hl + pages + tl)
        return bytes(v[:hl]) + bytes(v[hl + pages :]) if tl else bytes(v[:hl])

    def metadata(self) -> dict[str, str]:
        return object_metadata(self.identity, self.first, self.count, self.key)


_NONE_HELD: Mapping[bytes, TierEntry] = {}


@dataclass(frozen=True)
class HostTierStats:
    capacity: int
    #: Bytes charged by the objects the tier accounts for (ghosts included): never above capacity.
    used: int
    high_water: int
    objects: int
    ready: int
    ghosts: int
    pinned: bool
    #: Seconds it took to allocate (and pin) the arena (0 until it is ready).
    register_s: float
    inserted: int
    evicted: int
    hits: int
    write_backs: int
    write_back_failed: int
    write_backs_pending: int
    #: Reservations that got no buffer (the arena too fragmented): ghosts made.
    no_room: int
    #: ... and those made before the arena was ready (still being allocated and pinned).
    not_ready: int
    #: The arena is allocated (and pinned): until then the tier holds nothing.
    arena_ready: bool
    too_big: int
    #: Entries whose save or read failed after they were reserved: ghosts made.
    failed: int
    #: Objects a load read whole into the tier, then read here again before their eviction / not.
    promoted_read: int
    promoted_unread: int


class HostTier(StoreWrapper):
    """One rank's host tier (see the module doc). Thread-safe."""

    def __init__(
        self,
        inner: ObjectStore,
        capacity_bytes: int,
        *,
        pinned: bool = False,
        weigh: Weigher | None = None,
        on_written: Callable[[str, ObjectSpan], None] | None = None,
        counters: Counters | None = None,
        name: str = "s3kv-host",
        background: bool | None = None,
        on_ready: Callable[[HostTier], None] | None = None,
    ):
        """``background``: allocate (and pin) the arena on a thread of its own, the tier holding
        nothing until it is ready (default: when it is pinned -- what takes seconds; plain memory
        costs nothing until touched). ``on_ready(tier)`` runs once the arena is allocated, on that
        thread, just before the tier takes objects (its bandwidth is measured there)."""
        super().__init__(inner)
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.weigh = weigh
        self.on_written = on_written
        self.counters = counters or Counters()
        self._name = name
        #: The arena, once allocated (None until then, and always with a weigher).
        self.pool: StagingPool | None = None
        self.pinned = False
        #: Seconds it took to allocate (and pin) the arena; 0 until it is ready.
        self.register_s = 0.0
        self._ready = threading.Event()
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._entries: dict[str, TierEntry] = {}
        #: The same entries by key prefix (a group and shard's) and the chain digest ending their
        #: key: a lookup asks about every block end of a hit at once (``held``).
        self._by_prefix: dict[str, dict[bytes, TierEntry]] = {}
        self._heap: list[tuple[float, str, int]] = []
        self._inflation = 0.0  # L: the priority of the last object evicted
        self._used = 0
        self._high_water = 0
        #: Event counts, each a ``HostTierStats`` field of its name.
        self._n = {"inserted": 0, "evicted": 0, "hits": 0, "write_backs": 0, "write_back_failed": 0,
                   "no_room": 0, "not_ready": 0, "too_big": 0, "failed": 0, "promoted_read": 0,
                   "promoted_unread": 0}
        #: (read again, evicted unread) of promoted objects, Beta(1, 1) prior, decayed by halving.
        self._promo = [1.0, 1.0]
        self._wb_queue: queue.SimpleQueue[TierEntry | None] = queue.SimpleQueue()
        self._wb_thread: threading.Thread | None = None
        self._wb_pending = 0
        self._wb_cond = threading.Condition()
        self._closed = False
        if weigh is not None:
            # The charged size is not the physical one (a replay charges a real model's pages for
            # tiny simulated ones): no arena of ``capacity`` bytes, a buffer per object.
            self._became_ready()
        elif background if background is not None else pinned:
            # Pinned where the caller's CUDA device is current, as a call made here would be.
            device = torch.cuda.current_device() if pinned and torch.cuda.is_available() else None
            threading.Thread(target=self._open_arena, args=(pinned, device), name=f"{name}-register",
                             daemon=True).start()
        else:
            self._open_arena(pinned)

    # -- the arena ----------------------------------------------------------------------------
    def _open_arena(self, pinned: bool, device: int | None = None) -> None:
        """Allocate (and pin) the arena; until it is ready every reservation is a ghost and every
        load a miss. Pinning takes seconds per 10 GiB: a pinned tier does it in the background, so
        the engine's start-up does not wait for it (``background``)."""
        t0 = time.perf_counter()
        try:
            if device is not None:
                torch.cuda.set_device(device)
            pool = StagingPool(self.capacity, pinned=pinned, load_reserve_fraction=0.0)
        except Exception as e:  # noqa: BLE001 - no memory for it: the tier holds nothing, the engine runs
            log.error("s3kv %s: cannot allocate the host tier's %d bytes (S3KV_HOST_CACHE_GB): %s; it holds "
                      "nothing", self._name, self.capacity, e)
            return
        with self._lock:
            if not self._closed:
                self.pool, self.pinned = pool, pool.pinned
                self.register_s = time.perf_counter() - t0
        if self.pool is None:  # closed meanwhile
            pool.close()
            return
        self._became_ready()

    def _became_ready(self) -> None:
        if self._on_ready is not None:  # before any reservation can take the arena's room
            try:
                self._on_ready(self)
            except Exception:  # noqa: BLE001 - a measurement or a log line, never the tier's failure
                log.exception("s3kv %s: the host tier's on_ready hook failed", self._name)
        self._ready.set()

    @property
    def ready(self) -> bool:
        """The arena is allocated (and pinned): reservations get bytes, hits can be served."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # -- sizes ------------------------------------------------------------------------------
    @staticmethod
    def layout(identity: ObjectIdentity, count: int) -> tuple[int, int]:
        """(offset of page 0, buffer bytes) of an object of ``count`` pages in a tier buffer."""
        hl = header_len(count)
        base = round_up(hl, PAGE_ALIGN)
        tl = trailer_len(count) if identity.integrity is not None else 0
        return base, base + count * identity.page_bytes + tl

    def charge(self, key: str, buffer_bytes: int, object_bytes: int) -> int:
        """What an object is charged: its buffer (rounded as the arena rounds it), or what the
        weigher says of the object (``object_bytes``: its size as the store holds it)."""
        if self.weigh is not None:
            try:
                return max(0, int(self.weigh(key, object_bytes)))
            except Exception:  # noqa: BLE001 - a caller's weigher must not fail a save or a load
                log.exception("s3kv: the host tier's weigher failed on %s; charging the object's bytes", key)
        return round_up(max(buffer_bytes, 1))

    def page_bytes(self, key: str, identity: ObjectIdentity) -> int:
        """A page's bytes as the tier charges them: the identity's, or what the weigher makes
        of them (a replay's real model)."""
        if self.weigh is None:
            return identity.page_bytes
        return max(1, self.charge(key, 0, object_len(1, identity.page_bytes, False)) - header_len(1))

    # -- the plan-ordered calls (worker thread) ---------------------------------------------
    def reserve(self, key: str, identity: ObjectIdentity, first: int, count: int, *, to_s3: str = NOW,
                ghost: bool = False, promoted: bool = False) -> TierEntry | None:
        """Account for the object ``key`` (``count`` pages from ordinal ``first``) and make its
        buffer, evicting what is worth least until it fits. None when the tier holds it already
        or it is larger than the whole tier. ``ghost``: account for it without bytes (the save
        was dropped on this rank; the other ranks hold theirs). The caller fills a real entry
        (:meth:`fill_pages` + :meth:`commit`, or its own writes + :meth:`commit`) or fails it.
        ``promoted``: a load reads it whole from the store (counted for its read share)."""
        if to_s3 not in WRITE_POLICIES:
            raise ValueError(f"to_s3 must be one of {WRITE_POLICIES}, got {to_s3!r}")
        base, nbytes = self.layout(identity, count)
        charged = self.charge(key, nbytes, nbytes - base + header_len(count))
        tokens = count * identity.tokens_per_block
        with self._lock:
            if self._closed or key in self._entries:
                return None
            if charged > self.capacity:
                self._n["too_big"] += 1
                return None
            while self._used + charged > self.capacity:
                if not self._evict_one():
                    return None  # cannot happen: every entry is evictable
            buf = None
            if not ghost:
                buf = self._alloc(nbytes)
                if buf is None:
                    # The arena is not ready yet (being pinned), or too fragmented (or its bytes
                    # still held by loads in flight): a ghost, so the accounting stays the plan's
                    # on every rank.
                    self._n["no_room" if self._ready.is_set() else "not_ready"] += 1
            e = TierEntry(key, identity, int(first), int(count), to_s3, charged, tokens, buf, base,
                          promoted=promoted)
            e.priority = self._inflation + tokens / max(charged, 1)
            self._entries[key] = e
            prefix, digest = _split_key(key)
            if digest is not None:
                self._by_prefix.setdefault(prefix, {})[digest] = e
            self._push(e)
            self._used += charged
            self._high_water = max(self._high_water, self._used)
            self._n["inserted"] += 1
            return e

    def acquire(self, key: str, *, plan: bool = True) -> tuple[TierEntry, StagingBuffer] | None:
        """A load's hit: the committed entry and its buffer, retained for the caller (release it
        once the copies completed). None: no bytes to serve here.

        The read raises the value of every entry the tier accounts for, served or not -- a ghost,
        or an entry whose bytes are still being filled here: another rank serves the same read
        from its own copy and raises it there, and the ranks' tiers evict alike only if their
        priorities do (module doc). ``plan=False``: a read one rank makes on its own (a parked
        load's retry), which changes nothing the others would not change."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            if plan:
                if e.promoted and e.hits == 0:
                    self._promoted(read=True)
                e.hits += 1
                e.read = True
                e.priority = self._inflation + (e.hits + 1) * e.tokens / max(e.charged, 1)
                self._push(e)
            if not e.ready or e.buf is None:
                return None
            self._n["hits"] += 1
            return e, e.buf.retain()

    def _promoted(self, *, read: bool) -> None:
        """A promoted object's fate (lock held): read here again, or evicted unread."""
        self._n["promoted_read" if read else "promoted_unread"] += 1
        self._promo[0 if read else 1] += 1.0
        if sum(self._promo) > 512:  # a window of the last few hundred: it follows the traffic
            self._promo = [x / 2 for x in self._promo]

    def promotion_read_share(self) -> float:
        """The share of objects a load read whole into the tier that were read here again before
        their eviction. Plan-ordered (hits and evictions are) -- the same on every rank."""
        with self._lock:
            return self._promo[0] / (self._promo[0] + self._promo[1])

    def discard(self, key: str) -> None:
        """Drop ``key`` now (its bytes failed a check): no write-back, no answer from it again."""
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self._drop(e)

    # -- filling (any thread) ---------------------------------------------------------------
    def fill_pages(self, e: TierEntry, pages: Any) -> StagingBuffer | None:
        """Copy the object's pages (a 1-D uint8 host tensor, pages back to back) into the entry.
        Returns the entry's buffer, retained for the caller (to hash the pages where they landed
        and write them on; release it after), or None when the entry is a ghost or was evicted."""
        with self._lock:
            if e.buf is None or e.evicted:
                return None
            buf = e.buf.retain()  # an eviction meanwhile must not free the bytes under the copy
        try:
            buf.view(e.base, e.count * e.identity.page_bytes).copy_(pages)
        except BaseException:
            buf.release()
            raise
        return buf

    def commit(self, e: TierEntry, encoded: Sequence[Buffer]) -> bool:
        """Write the header (and trailer) ``encode_object`` made over the entry's pages, check
        them as a load would, and make the entry visible. ``encoded``: header, the pages (already
        in place), [trailer]. False: evicted meanwhile, or the bytes failed the check (a ghost)."""
        with self._lock:
            if e.buf is None or e.evicted:
                return False
            buf = e.buf.retain()
        try:
            header = memoryview(encoded[0]).cast("B")
            buf.memoryview(e.start, header.nbytes)[:] = header
            if e.identity.integrity is not None:
                trailer = memoryview(encoded[-1]).cast("B")
                end = e.base + e.count * e.identity.page_bytes
                buf.memoryview(end, trailer.nbytes)[:] = trailer
            tl = e.size - e.header_len - e.count * e.identity.page_bytes
            try:
                checked = decode_header(buf.memoryview(e.start, e.header_len), e.identity, e.key,
                                        buf.memoryview(e.start + e.size - tl, tl) if tl else None)
            except ObjectFormatError as exc:  # cannot happen unless the encoder and decoder disagree
                log.error("s3kv: the host tier's copy of %s fails its own check (%s); not kept", e.key, exc)
                checked = None
        finally:
            buf.release()
        if checked is None:
            self.fail(e)
            return False
        return self.mark_ready(e, checked)

    def mark_ready(self, e: TierEntry, header: ObjectHeader, *, stored: bool = False) -> bool:
        """The entry's bytes are in place and ``header`` is what checking them decoded: lookups
        and loads may use it now; a hit checks the arena against what it holds now (``framing``).
        ``stored``: they came from the store (it holds the object)."""
        with self._lock:
            if e.buf is None or e.evicted:
                return False
            e.header = header
            e.admitted = e.framing(e.buf)
            e.ready = True
            e.stored = e.stored or stored
            return True

    def mark_stored(self, e: TierEntry) -> None:
        """The store holds the object now (a write-through succeeded, or found it written)."""
        e.stored = True

    def stored(self, key: str) -> bool:
        """The tier holds ``key`` and knows the store does too: a seal of it needs no write."""
        e = self._entries.get(key)
        return e is not None and e.ready and e.stored

    def fail(self, e: TierEntry) -> None:
        """The entry's bytes will not come (a failed save or read), or failed a check: it stays
        as a ghost (accounted like the other ranks' copies, never served)."""
        with self._lock:
            e.ready = False
            if e.evicted:  # its bytes are gone, or the write-back's, which now skips them
                return
            self._n["failed"] += e.buf is not None
            buf, e.buf = e.buf, None
        if buf is not None:
            buf.release()

    # -- what lookups see (no side effects) -------------------------------------------------
    def span_of(self, key: str) -> ObjectSpan | None:
        e = self._entries.get(key)  # a dict read is atomic; the entry's fields are set before it is ready
        if e is None or not e.ready:
            return None
        return ObjectSpan(e.first, e.count)

    def held(self, prefix: str) -> Mapping[bytes, TierEntry]:
        """The entries whose key is ``prefix`` (a group and shard's, ending in "/") plus a chain
        digest's hex, by that digest: a lookup asks about thousands of block ends of one prompt
        without making a key for each. Served only where ``entry.ready`` (as :meth:`span_of`).
        Read without the lock: the map changes in place under it, and a dict read is atomic."""
        return self._by_prefix.get(prefix, _NONE_HELD)

    def holds(self, key: str) -> bool:
        return self.span_of(key) is not None

    def knows(self, key: str) -> bool:
        """An entry for ``key`` exists, served or not (a copy still filling, a ghost)."""
        return key in self._entries

    # -- eviction ---------------------------------------------------------------------------
    def _push(self, e: TierEntry) -> None:
        e.version += 1
        heapq.heappush(self._heap, (e.priority, e.key, e.version))
        if len(self._heap) > 4 * len(self._entries) + 64:  # stale items (raised priorities) pile up
            self._heap = [(x.priority, x.key, x.version) for x in self._entries.values()]
            heapq.heapify(self._heap)

    def _evict_one(self) -> bool:
        while self._heap:
            prio, key, version = heapq.heappop(self._heap)
            e = self._entries.get(key)
            if e is None or e.version != version:
                continue
            del self._entries[key]
            self._inflation = max(self._inflation, prio)
            self._n["evicted"] += 1
            if e.promoted and e.hits == 0:
                self._promoted(read=False)
            self._drop(e)
            return True
        return False

    def _drop(self, e: TierEntry) -> None:
        """``e`` left the map (lock held): its charge is free; its bytes go when no one reads them,
        after the write-back an ``evict`` object read while cached gets."""
        e.evicted = True
        self._used -= e.charged
        prefix, digest = _split_key(e.key)
        held = self._by_prefix.get(prefix)
        if held is not None and digest is not None and held.get(digest) is e:
            del held[digest]
            if not held:
                del self._by_prefix[prefix]
        buf, e.buf = e.buf, None
        if buf is None:
            return
        if e.to_s3 == EVICT and e.read and e.ready and not self._closed:
            e.buf = buf  # the write-back owns this reference now
            self._write_back(e)
            return
        buf.release()

    def _alloc(self, nbytes: int) -> StagingBuffer | None:
        if not self._ready.is_set():
            return None
        if self.pool is None:  # a weigher's tier
            return StagingBuffer.standalone(nbytes, SAVE)
        return self.pool.try_acquire(nbytes, SAVE)

    # -- write-back of evicted "evict" objects ------------------------------------------------
    def _write_back(self, e: TierEntry) -> None:
        with self._wb_cond:
            self._wb_pending += 1
        if self._wb_thread is None:
            self._wb_thread = threading.Thread(target=self._write_backs, name=f"{self._name}-wb", daemon=True)
            self._wb_thread.start()
        self._wb_queue.put(e)

    def _write_backs(self) -> None:
        while True:
            e = self._wb_queue.get()
            if e is None:
                return
            try:
                if not e.ready:  # failed a check after it was evicted: nothing to write
                    continue
                self.counters.add("put_requests", put_requests(e.size))
                created = self.inner.put(e.key, [e.object_view()], e.metadata())
                with self._lock:
                    self._n["write_backs"] += 1
                self.counters.add("host_write_backs")
                if created and self.on_written is not None:
                    self.on_written(e.key, e.span)
            except Exception as exc:  # noqa: BLE001 - a failed write-back is a lost save, never an error
                with self._lock:
                    self._n["write_back_failed"] += 1
                self.counters.add("host_write_back_failed")
                log.warning("s3kv: writing evicted %s to the store failed: %s", e.key, exc)
            finally:
                buf, e.buf = e.buf, None
                if buf is not None:
                    buf.release()
                with self._wb_cond:
                    self._wb_pending -= 1
                    self._wb_cond.notify_all()

    def flush_write_backs(self, timeout: float | None = None) -> bool:
        with self._wb_cond:
            return self._wb_cond.wait_for(lambda: not self._wb_pending, timeout)

    # -- the ObjectStore face -----------------------------------------------------------------
    def _held(self, key: str) -> tuple[TierEntry, StagingBuffer] | None:
        """A held object and its buffer, retained for the caller (an eviction meanwhile clears
        ``e.buf``; the caller's reference keeps the bytes until it releases it)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.ready or e.buf is None:
                return None
            return e, e.buf.retain()

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        found: dict[str, ObjectInfo] = {}
        rest: list[str] = []
        for k in keys:
            e = self._entries.get(k)
            if e is not None and e.ready:
                found[k] = ObjectInfo(k, e.size, e.metadata())
            else:
                rest.append(k)
        if not rest:
            return HeadBatch(found, frozenset(), {})
        batch = self.inner.head_many(rest)
        return HeadBatch({**batch.found, **found}, batch.missing, batch.failed)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        held = self._held(key)
        if held is None:
            return self.inner.get_ranges(key, ranges)
        e, buf = held
        try:
            view = buf.memoryview(e.start, e.size)
            for r in ranges:
                if r.end > view.nbytes:
                    raise IntegrityError(f"range {r.offset}+{r.length} beyond object size {view.nbytes}", key=key)
            return [bytes(view[r.offset : r.end]) for r in ranges]
        finally:
            buf.release()

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        held = self._held(key)
        if held is None:
            self.inner.get_ranges_into(key, ranges, out)
            return
        e, buf = held
        try:
            view = buf.memoryview(e.start, e.size)
            for r, dst in zip(ranges, out, strict=True):
                d = memoryview(dst).cast("B")
                if r.end > view.nbytes or d.nbytes != r.length:
                    raise IntegrityError(f"range {r.offset}+{r.length} does not fit the object or buffer", key=key)
                d[:] = view[r.offset : r.end]
        finally:
            buf.release()

    def delete_many(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.discard(k)
        self.inner.delete_many(keys)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    # -- introspection and lifecycle ----------------------------------------------------------
    def keys(self) -> builtins.list[str]:
        with self._lock:
            return sorted(self._entries)

    def entries(self) -> Mapping[str, TierEntry]:
        """A copy of the map (tests)."""
        with self._lock:
            return dict(self._entries)

    def stats(self) -> HostTierStats:
        with self._lock:
            ready = sum(1 for e in self._entries.values() if e.ready)
            ghosts = sum(1 for e in self._entries.values() if e.buf is None)
            return HostTierStats(
                capacity=self.capacity, used=self._used, high_water=self._high_water, objects=len(self._entries),
                ready=ready, ghosts=ghosts, pinned=self.pinned, register_s=self.register_s,
                write_backs_pending=self._wb_pending, arena_ready=self._ready.is_set(), **self._n,
            )

    def close(self, timeout: float | None = 10.0) -> None:
        """Write back what the ``evict`` policy still owes the store (read while cached), at most
        ``timeout`` seconds, then stop. The inner store is the caller's to close."""
        with self._lock:
            if self._closed:
                return
            owed = [e for e in self._entries.values() if e.to_s3 == EVICT and e.read and e.ready and e.buf]
            for e in owed:
                del self._entries[e.key]
                self._drop(e)
            self._closed = True
        self.flush_write_backs(timeout)
        if self._wb_thread is not None:
            self._wb_queue.put(None)
        with self._lock:
            for e in list(self._entries.values()):
                self._drop(e)
            self._entries.clear()
            self._heap.clear()
        with self._lock:
            pool = self.pool  # None: still being allocated; that thread closes it when done
        if pool is not None:
            pool.close()
