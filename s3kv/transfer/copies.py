"""Page copies between the KV cache and host staging.

A page of a layer group is the concatenation of its regions' ``slot_tensor(slot)``;
in staging it occupies ``page_bytes`` contiguous bytes, region after region. Per
page we issue one copy per region; runs of adjacent slots of a single-region
group whose slots are packed (``stride == size``) into adjacent staging bytes
are merged into one copy.

Stream ordering on CUDA (``Copier`` with a CUDA device):

* Saves (:meth:`Copier.save`): record an event on the forward stream, make the
  save side stream wait on it (the copies see the finished forward), enqueue the
  device->host copies there and record a completion event. Then the **forward
  stream waits on that event**: any GPU work enqueued later on the forward
  stream — including whatever writes a page the engine frees and reuses after
  this iteration — runs after the copy. The host never synchronizes here; the
  upload thread waits on the completion event before reading the staging bytes.
* Loads: :meth:`Copier.begin_loads` (once per iteration, before any load copy)
  makes the load side stream wait on the forward stream's work so far (a slot
  handed to a request may still be touched by earlier GPU work). Download threads
  enqueue host->device copies on the load stream (:meth:`Copier.load`) and get a
  completion event; the forward stream waits on it (:meth:`Copier.wait_on`)
  before a layer that reads the pages runs, and an async load is reported only
  once the event has completed.

How the bytes move on CUDA: when the CUDA runtime has ``cudaMemcpyBatchAsync``
(12.8+, see :mod:`.memcpy_batch`) and the host side is pinned, the pages of one call go
to the driver in a few batches of (dst, src, size) segments -- adjacent ones merged --
addressed from each region's ``as_tensor()`` (asked once per copier). Otherwise (older runtime, pageable
staging, ``S3KV_BATCH_COPIES=0``, or the driver refusing a batch) each page is one
``copy_`` of ``slot_tensor`` views. Both are copy-engine copies on the same side stream,
so the ordering above is the same for both.

Measured on an H200 (``s3kv bench staging``, 64 scattered pages per call vs one
contiguous pinned memcpy of the same bytes, d2h/h2d, seven runs):

* batched, wall clock on an idle GPU: 1 MiB 0.90-0.96 / 0.90-0.96, 4 MiB 0.95-0.99,
  16 MiB 0.98-1.00, 256 KiB 0.69-0.87; on the GPU alone (copies queued behind a busy
  forward stream) 0.99 at 1 MiB and 0.92-1.00 at 256 KiB: the copy engines run at
  memcpy speed, what is left is host set-up before the first copy;
* one ``copy_`` per page: 1 MiB 0.85-0.88 / 0.82-0.86, 256 KiB 0.30-0.58 (0.90 / 0.88 and
  0.76 / 0.66 on the GPU alone: the engine idles between small copies);
* host time of a 64-page save call: ~0.14 ms batched, ~1 ms per page.

Tried and slower at 1 MiB: a device gather (``index_select``) into scratch then one
copy (0.74-0.86), one ``torch._foreach_copy_`` (0.68), a Triton kernel writing through
mapped pinned memory (0.87/0.85, and it takes SMs from the forward pass).

Without CUDA (``device.type == 'cpu'``, streams ``None``) every copy is a plain
synchronous ``copy_`` and events are ``None`` (= already complete).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .memcpy_batch import MemcpyBatch, MemcpyBatchError

log = logging.getLogger(__name__)


class PageCopy(NamedTuple):
    """One page: ``regions`` (the group's), its ``slot``, and where it sits in host memory."""

    regions: tuple[Any, ...]
    slot: int
    host: torch.Tensor  # 1-D uint8 host tensor (a staging buffer's)
    offset: int  # byte offset of the page in ``host``


def _packed(region: Any) -> bool:
    return int(region.stride) == int(region.size)


def _pairs(copies: Sequence[PageCopy]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(device view, host view) pairs, merging runs of adjacent packed slots.

    A generator, so each copy is launched as soon as its views exist: on CUDA the
    GPU copies page i while Python builds the views of page i+1.
    """
    i, n = 0, len(copies)
    while i < n:
        c = copies[i]
        if len(c.regions) == 1 and _packed(c.regions[0]):
            region = c.regions[0]
            size = int(region.size)
            j = i + 1
            while (
                j < n
                and copies[j].regions is c.regions
                and copies[j].host is c.host
                and copies[j].slot == c.slot + (j - i)
                and copies[j].offset == c.offset + (j - i) * size
            ):
                j += 1
            if j - i > 1:
                rows = region.as_tensor()[c.slot : c.slot + (j - i)]
                # Only a true view may be merged: a reshaped copy would swallow a host->device write.
                if rows.is_contiguous() and rows.numel() == (j - i) * size:
                    yield rows.view(-1), c.host[c.offset : c.offset + (j - i) * size]
                    i = j
                    continue
        off = c.offset
        for region in c.regions:
            size = int(region.size)
            yield region.slot_tensor(c.slot), c.host[off : off + size]
            off += size
        i += 1


class Segments(NamedTuple):
    """Byte ranges to copy: ``device[i]`` <-> ``host[i]``, ``sizes[i]`` bytes each."""

    device: list[int]
    host: list[int]
    sizes: list[int]


class Unbatchable(ValueError):
    """A region's ``as_tensor()`` is not the plain ``[num_slots, size]`` row view the
    address arithmetic needs; that call's pages go per page instead."""


class _Rows(NamedTuple):
    """Where a region's slots live: from one ``as_tensor()`` call, kept with the region."""

    region: Any
    rows: torch.Tensor  # kept: the addresses below stay valid while it lives
    ptr: int
    stride: int  # bytes between slots
    slots: int

    @classmethod
    def of(cls, region: Any) -> _Rows:
        rows = region.as_tensor()
        # Raw addresses are only as good as this check: the driver does not validate them (a
        # bad one is read as host memory and can crash the process), so anything but a 2-D
        # view with contiguous rows at least ``size`` bytes long is refused.
        if (
            rows.dim() != 2
            or rows.shape[0] < 1
            or (rows.shape[1] > 1 and rows.stride(1) != 1)
            or rows.shape[1] * rows.element_size() < int(region.size)
        ):
            raise Unbatchable(f"as_tensor() of a region gave shape {tuple(rows.shape)}, strides {rows.stride()}")
        return cls(region, rows, rows.data_ptr(), rows.stride(0) * rows.element_size(), int(rows.shape[0]))


def segments(copies: Sequence[PageCopy], rows_cache: dict[int, _Rows] | None = None) -> Segments:
    """Address ranges of ``copies``, merging ranges adjacent on both sides.

    Device addresses come from each region's ``as_tensor()`` (bounds-checked per slot
    like ``slot_tensor``), host addresses from the staging tensor, so a batch copies
    exactly the bytes the per-page views would. ``rows_cache`` (the copier's) keeps the
    ``as_tensor()`` answers between calls -- regions are immutable and registered once;
    each entry holds its region, so its ``id`` cannot be reused. Per page this is plain
    integer arithmetic: tensor attribute calls cost more than the copy set-up they save.
    """
    cache = rows_cache if rows_cache is not None else {}
    hosts: dict[int, tuple[int, int]] = {}
    dev: list[int] = []
    host: list[int] = []
    sizes: list[int] = []
    for c in copies:
        hk = hosts.get(id(c.host))
        if hk is None:
            h = c.host
            if h.element_size() != 1 or h.dim() != 1 or not h.is_contiguous():
                raise ValueError("PageCopy.host must be a contiguous 1-D uint8 tensor")
            hk = hosts[id(h)] = (h.data_ptr(), h.numel())
        hptr, hlen = hk
        off = c.offset
        for region in c.regions:
            rows = cache.get(id(region))
            if rows is None or rows.region is not region:
                rows = cache[id(region)] = _Rows.of(region)
            if not 0 <= c.slot < rows.slots:
                raise IndexError(f"slot {c.slot} outside [0, {rows.slots})")
            n = int(region.size)
            if off < 0 or off + n > hlen:
                raise ValueError(f"page bytes [{off}, {off + n}) outside a {hlen}-byte staging buffer")
            if n == 0:
                continue  # the driver refuses a whole batch that holds an empty copy
            d = rows.ptr + c.slot * rows.stride
            a = hptr + off
            if sizes and dev[-1] + sizes[-1] == d and host[-1] + sizes[-1] == a:
                sizes[-1] += n
            else:
                dev.append(d)
                host.append(a)
                sizes.append(n)
            off += n
    return Segments(dev, host, sizes)


class _PinnedCache:
    """Is a staging tensor page-locked? Asked once per underlying arena.

    ``is_pinned()`` asks the driver (about 10 us); staging buffers are views of one
    long-lived arena, so the answer is kept per base tensor. Each entry holds a weak
    reference to its tensor, so a reused ``id`` of a freed tensor is never trusted.
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}

    def __call__(self, copies: Sequence[PageCopy]) -> bool:
        last = None
        for c in copies:
            if c.host is last:
                continue
            last = c.host
            base = c.host._base if c.host._base is not None else c.host
            hit = self._known.get(id(base))
            if hit is None or hit[0]() is not base:
                if len(self._known) > 64:  # only dead entries can pile up; start over
                    self._known.clear()
                hit = self._known[id(base)] = (weakref.ref(base), bool(base.is_pinned()))
            if not hit[1]:
                return False
        return True


def copy_to_host(copies: Sequence[PageCopy], non_blocking: bool = False) -> None:
    for dev, host in _pairs(copies):
        host.copy_(dev, non_blocking=non_blocking)


def copy_to_device(copies: Sequence[PageCopy], non_blocking: bool = False) -> None:
    for dev, host in _pairs(copies):
        dev.copy_(host, non_blocking=non_blocking)


#: Pages in the first batch of a call; each later batch doubles, up to ``_MAX_BATCH``
#: (see ``Copier._enqueue``).
_FIRST_BATCH = 4
_MAX_BATCH = 64
#: Refusals in a row after which a copier stops trying the batch call.
_MAX_REFUSALS = 3


class Copier:
    """Issues page copies for one cache device, on side streams when it is a GPU."""

    def __init__(self, device: torch.device, *, batch: bool = True):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._save_stream: Any = None
        self._load_stream: Any = None
        self._lock = threading.Lock()
        self._batch: MemcpyBatch | None = None
        self._rows: dict[int, _Rows] = {}
        self._pinned = _PinnedCache()
        self._refusals = 0
        if self.is_cuda:
            self._save_stream = torch.cuda.Stream(device=self.device)
            self._load_stream = torch.cuda.Stream(device=self.device)
            if batch:
                self._batch = MemcpyBatch.load(self.device)

    @property
    def path(self) -> str:
        """How copies are issued: ``memcpy_batch``, ``per_page`` (CUDA) or ``cpu``."""
        if not self.is_cuda:
            return "cpu"
        return "memcpy_batch" if self._batch is not None else "per_page"

    def _enqueue(self, copies: Sequence[PageCopy], to_host: bool, stream: Any, step: int = _FIRST_BATCH) -> int:
        """Enqueue the copies on ``stream`` (the current stream): one batch, else per page.
        ``step``: pages in the first batch; returns the size the next batch would have (a caller
        enqueueing several lists back to back passes it on: only the very first batch is small)."""
        batch = self._batch
        if batch is not None and self._pinned(copies):
            try:
                # A small first batch gets the copy engine going while the host builds the rest
                # (on an idle GPU the host's set-up is otherwise on the critical path); doubling
                # keeps each batch's set-up (~2.5 us a page) shorter than the previous batch's
                # copies (~19 us a 1 MiB page on an H200), so the engine does not wait between them.
                lo = 0
                while lo < len(copies):
                    seg = segments(copies[lo : lo + step], self._rows)
                    dst, src = (seg.host, seg.device) if to_host else (seg.device, seg.host)
                    batch.copy(dst, src, seg.sizes, stream.cuda_stream)
                    lo, step = lo + step, min(2 * step, _MAX_BATCH)
                self._refusals = 0
                return step
            except Unbatchable as e:
                log.warning("s3kv: %s; these pages go per page", e)
            except MemcpyBatchError as e:
                # Earlier batches may be queued; copying the same bytes again below is harmless.
                self._refusals += 1
                if self._refusals >= _MAX_REFUSALS:
                    log.warning("s3kv: %s; %d refusals in a row, using per-page copies from now on", e, self._refusals)
                    self._batch = None
                else:
                    log.warning("s3kv: %s; these pages go per page", e)
        if to_host:
            copy_to_host(copies, non_blocking=True)
        else:
            copy_to_device(copies, non_blocking=True)
        return step

    def _forward(self, stream: Any) -> Any:
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    # -- saves ------------------------------------------------------------
    def save(self, copies: Sequence[PageCopy], forward_stream: Any = None) -> Any:
        """Device->host copies of ``copies``; returns their completion event (None on CPU)."""
        if not copies:
            return None
        if not self.is_cuda:
            copy_to_host(copies)
            return None
        fwd = self._forward(forward_stream)
        forward_done = torch.cuda.Event()
        forward_done.record(fwd)
        done = torch.cuda.Event()
        with torch.cuda.device(self.device), torch.cuda.stream(self._save_stream):
            self._save_stream.wait_event(forward_done)
            try:
                self._enqueue(copies, True, self._save_stream)
            finally:
                # Also when enqueueing failed part-way: what was queued is still waited for.
                done.record(self._save_stream)
                # Stream-ordered protection: later forward work (which may reuse a freed
                # page) cannot start before the copy finished. No host synchronization.
                fwd.wait_event(done)
        return done

    # -- loads ------------------------------------------------------------
    def begin_loads(self, forward_stream: Any = None) -> None:
        """Order the coming load copies after the forward stream's work so far."""
        if not self.is_cuda:
            return
        ev = torch.cuda.Event()
        ev.record(self._forward(forward_stream))
        with self._lock:
            self._load_stream.wait_event(ev)

    def load(self, copies: Sequence[PageCopy]) -> Any:
        """Host->device copies (thread-safe); returns their completion event (None on CPU)."""
        return self.load_each((copies,)) if copies else None

    def load_each(self, parts: Iterable[Sequence[PageCopy]]) -> Any:
        """Host->device copies of every list of pages ``parts`` yields, as one call: one lock,
        one completion event (None on CPU). Each list is enqueued as soon as it is yielded, so the
        copy engine works on the first while the caller prepares (checks) the next; the batches
        keep doubling across lists. When it raises (a list's copies refused, or ``parts`` itself),
        nothing it enqueued is still in flight: a caller failing the loads may free their pages."""
        if not self.is_cuda:
            for copies in parts:
                copy_to_device(copies)
            return None
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self._load_stream):
            done = torch.cuda.Event()
            try:
                step = _FIRST_BATCH
                for copies in parts:
                    if copies:
                        step = self._enqueue(copies, False, self._load_stream, step)
            except BaseException:
                done.record(self._load_stream)
                done.synchronize()  # rare path: nothing of the failed call stays in flight
                raise
            done.record(self._load_stream)
        return done

    def drain(self) -> None:
        """Wait until every copy issued so far has finished (before staging memory is freed:
        batched copies are invisible to PyTorch's pinned-memory allocator)."""
        if self.is_cuda:
            self._save_stream.synchronize()
            self._load_stream.synchronize()

    def wait_on(self, event: Any, stream: Any = None) -> None:
        """Make ``stream`` (the forward stream) wait for ``event``; no host wait."""
        if event is None or not self.is_cuda:
            return
        self._forward(stream).wait_event(event)

    # -- events -----------------------------------------------------------
    @staticmethod
    def done(event: Any) -> bool:
        return event is None or bool(event.query())

    @staticmethod
    def synchronize(event: Any) -> None:
        if event is not None:
            event.synchronize()
