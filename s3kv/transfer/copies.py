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

Measured on an H200 (``s3kv bench staging``, 64 scattered pages vs one pinned memcpy):
this one-copy-per-page path gives d2h/h2d 0.86/0.84 at 1 MiB, 0.96/0.95 at 4 MiB and
0.99/0.98 at 16 MiB. Two alternatives were tried and were slower at 1 MiB: gathering
runs of pages on the device (``index_select``) into a scratch then one copy (0.74-0.86),
and one ``torch._foreach_copy_`` call for all pages (0.68). Small pages stay bound by
per-copy set-up; a fused gather kernel writing straight to mapped pinned memory is the
next thing to try.

Without CUDA (``device.type == 'cpu'``, streams ``None``) every copy is a plain
synchronous ``copy_`` and events are ``None`` (= already complete).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch


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


def _plan(copies: Sequence[PageCopy]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(_pairs(copies))


def copy_to_host(copies: Sequence[PageCopy], non_blocking: bool = False) -> None:
    for dev, host in _pairs(copies):
        host.copy_(dev, non_blocking=non_blocking)


def copy_to_device(copies: Sequence[PageCopy], non_blocking: bool = False) -> None:
    for dev, host in _pairs(copies):
        dev.copy_(host, non_blocking=non_blocking)


class Copier:
    """Issues page copies for one cache device, on side streams when it is a GPU."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._save_stream: Any = None
        self._load_stream: Any = None
        self._lock = threading.Lock()
        if self.is_cuda:
            self._save_stream = torch.cuda.Stream(device=self.device)
            self._load_stream = torch.cuda.Stream(device=self.device)

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
        with torch.cuda.device(self.device), torch.cuda.stream(self._save_stream):
            self._save_stream.wait_event(forward_done)
            copy_to_host(copies, non_blocking=True)
            done = torch.cuda.Event()
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
        if not copies:
            return None
        if not self.is_cuda:
            copy_to_device(copies)
            return None
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self._load_stream):
            copy_to_device(copies, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._load_stream)
        return done

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
