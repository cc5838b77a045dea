"""Bounded host staging memory for saves and loads.

One arena of ``capacity`` bytes is allocated when the pool is made (pinned when
the cache is on a CUDA device and ``settings.pinned``; plain host memory
otherwise) and carved into buffers by a first-fit allocator with coalescing
frees. Nothing is allocated on the hot path, and nothing ever exceeds the bound:
:meth:`StagingPool.try_acquire` never blocks, it returns ``None`` when the bytes
are not free and the caller drops the save (and counts it).

Saves and loads share the arena but not equally: saves may hold at most
``capacity - load_reserve`` bytes (by default a quarter of the pool is kept for
loads), while loads may use any free byte. A burst of saves therefore never
starves a promised load; loads are short-lived (released as soon as their
host->device copy completes), so they cannot starve saves for long either. A
load that still finds no room falls back to a one-off unpooled buffer
(:meth:`StagingBuffer.standalone`): a promised load is never refused for lack of
staging, it only loses the pinned fast path.

A buffer exposes its bytes as a 1-D ``torch.uint8`` tensor (a view of the arena,
for copies) and as a ``memoryview`` (for hashing and uploads) without copying.
Buffers are reference counted: the owner holds one reference, every in-flight
upload that reads it holds another (:meth:`StagingBuffer.retain`), and the bytes
return to the pool when the last one is released.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Buffer offsets and sizes are rounded up to this many bytes.
ALIGN = 256
SAVE = "save"
LOAD = "load"


def host_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory, without copying.

    The view keeps ``t`` alive (through the ctypes array it wraps), so a view of a
    temporary tensor never points at freed memory.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("host_memoryview needs a contiguous host tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    arr = (ctypes.c_uint8 * n).from_address(t.data_ptr())
    arr._s3kv_owner = t  # type: ignore[attr-defined]  # the view -> arr -> t keeps the memory alive
    return memoryview(arr).cast("B")


def pinned_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory, exactly.

    Plain host memory, its pages faulted in, then registered with CUDA (``cudaHostRegister``),
    unregistered when the arena is collected; where registering fails or does not read back as
    pinned, PyTorch's pinned allocator, which rounds every allocation up to a power of two (a
    40 GiB host tier would pin 64 GiB).

    Why fault the pages in first: registering untouched memory faults every page in while it
    holds the driver, and every CUDA call of the process waits -- 8 GiB stalled a 4 KiB copy on
    another thread 3.3-3.5 s on an H100 host; touched first, 0.42-0.48 s (the touch itself,
    0.4 s, holds nothing). Why not register in chunks, which bounds each stall too: a copy whose
    source spans two registrations fails ("invalid argument"), and staged objects span any
    boundary (docs/benchmarks.md, "Host tier").
    """
    cudart = torch.cuda.cudart()
    arena = torch.empty(nbytes, dtype=torch.uint8)
    arena.zero_()
    ptr = arena.data_ptr()
    try:
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        ok = int(getattr(err, "value", err)) == 0
    except Exception as e:  # noqa: BLE001 - a runtime without it: the rounded allocation
        log.info("s3kv: cannot register %d bytes with CUDA (%s); pinning a power of two", nbytes, e)
        ok = False
    if ok and arena.is_pinned():
        # The storage stays alive until the memory is unregistered (the finalizer holds it).
        weakref.finalize(arena, _unregister, cudart, ptr, arena.untyped_storage())
        return arena
    if ok:
        _unregister(cudart, ptr, None)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _unregister(cudart: Any, ptr: int, _storage: Any) -> None:
    try:
        cudart.cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone
        pass


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class StagingBuffer:
    """A reference-counted slice of staging memory (or a standalone host buffer)."""

    __slots__ = ("pool", "offset", "nbytes", "reserved", "kind", "tensor", "_view", "_refs", "_lock")

    def __init__(
        self,
        pool: StagingPool | None,
        offset: int,
        nbytes: int,
        reserved: int,
        kind: str,
        tensor: torch.Tensor,
        view: memoryview,
    ):
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.reserved = reserved
        self.kind = kind
        #: 1-D uint8 host tensor of exactly ``nbytes`` (a view of the pool's arena).
        self.tensor = tensor
        self._view = view
        self._refs = 1
        self._lock = threading.Lock()

    @classmethod
    def standalone(cls, nbytes: int, kind: str = LOAD) -> StagingBuffer:
        """An unpooled plain host buffer (the fallback when the pool is full)."""
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8)[:nbytes]
        return cls(None, 0, nbytes, 0, kind, t, host_memoryview(t) if nbytes else memoryview(bytearray()))

    @property
    def pooled(self) -> bool:
        return self.pool is not None

    @property
    def pinned(self) -> bool:
        return self.pool is not None and self.pool.pinned

    def view(self, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Tensor view of ``[start, start+length)`` of this buffer."""
        length = self.nbytes - start if length is None else length
        if start < 0 or start + length > self.nbytes:
            raise IndexError(f"range {start}+{length} outside buffer of {self.nbytes} bytes")
        return self.tensor[start : start + length]

    def memoryview(self, start: int = 0, length: int | None = None) -> memoryview:
        """Byte view of ``[start, start+length)`` of this buffer (no copy)."""
        length = self.nbytes - start if length is None else length
        if start < 0 or start + length > self.nbytes:
            raise IndexError(f"range {start}+{length} outside buffer of {self.nbytes} bytes")
        return self._view[start : start + length]

    @property
    def refcount(self) -> int:
        with self._lock:
            return self._refs

    def retain(self) -> StagingBuffer:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("retain() of a released staging buffer")
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("release() of a staging buffer more often than it was held")
            self._refs -= 1
            last = self._refs == 0
        if last and self.pool is not None:
            self.pool._free(self)

    def __repr__(self) -> str:
        return f"StagingBuffer({self.kind}, offset={self.offset}, nbytes={self.nbytes}, refs={self._refs})"


@dataclass(frozen=True)
class StagingStats:
    capacity: int
    #: Bytes held by live buffers (after alignment), saves and loads together.
    in_use: int
    save_in_use: int
    load_in_use: int
    #: Most bytes ever held at once.
    high_water: int
    #: Most bytes saves may hold (capacity minus the load reserve).
    save_limit: int
    #: try_acquire calls answered None, by kind.
    save_drops: int
    load_drops: int
    acquired: int
    pinned: bool

    @property
    def drops(self) -> int:
        return self.save_drops + self.load_drops


class StagingPool:
    """A fixed arena of host memory carved into reference-counted buffers."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pinned: bool = False,
        load_reserve_fraction: float = 0.25,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity_bytes}")
        if not 0.0 <= load_reserve_fraction < 1.0:
            raise ValueError(f"load_reserve_fraction must be in [0, 1), got {load_reserve_fraction}")
        self.capacity = capacity_bytes // ALIGN * ALIGN or ALIGN
        self.save_limit = int(self.capacity * (1.0 - load_reserve_fraction)) // ALIGN * ALIGN
        self.pinned = False
        arena: torch.Tensor | None = None
        if pinned:
            try:
                arena = pinned_arena(self.capacity)
                self.pinned = True
            except Exception as e:  # noqa: BLE001 - no driver, out of pinnable memory, ...
                log.warning(
                    "s3kv: cannot pin %d bytes of staging (%s); using pageable memory", self.capacity, e
                )
        if arena is None:
            arena = torch.empty(self.capacity, dtype=torch.uint8)
        self._arena = arena
        self._view = host_memoryview(arena)
        self._lock = threading.Lock()
        # Free extents as parallel sorted lists (offset -> size), coalesced.
        self._free_off: list[int] = [0]
        self._free_len: list[int] = [self.capacity]
        self._in_use = {SAVE: 0, LOAD: 0}
        self._high_water = 0
        self._drops = {SAVE: 0, LOAD: 0}
        self._acquired = 0
        self._closed = False

    @classmethod
    def for_device(
        cls, capacity_bytes: int, device: torch.device | None, *, pinned: bool = True, **kw
    ) -> StagingPool:
        """Pinned only where it helps and works: a CUDA cache with CUDA available."""
        use_pinned = bool(
            pinned and device is not None and device.type == "cuda" and torch.cuda.is_available()
        )
        return cls(capacity_bytes, pinned=use_pinned, **kw)

    # -- allocation -------------------------------------------------------
    def try_acquire(self, nbytes: int, kind: str = SAVE) -> StagingBuffer | None:
        """A buffer of ``nbytes``, or None at once if the bound would be exceeded."""
        if kind not in (SAVE, LOAD):
            raise ValueError(f"kind must be {SAVE!r} or {LOAD!r}, got {kind!r}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = round_up(max(nbytes, 1))
        with self._lock:
            if self._closed:
                self._drops[kind] += 1
                return None
            if kind == SAVE and self._in_use[SAVE] + size > self.save_limit:
                self._drops[kind] += 1
                return None
            for i, length in enumerate(self._free_len):
                if length >= size:
                    offset = self._free_off[i]
                    if length == size:
                        del self._free_off[i]
                        del self._free_len[i]
                    else:
                        self._free_off[i] = offset + size
                        self._free_len[i] = length - size
                    break
            else:
                self._drops[kind] += 1
                return None
            self._in_use[kind] += size
            total = self._in_use[SAVE] + self._in_use[LOAD]
            self._high_water = max(self._high_water, total)
            self._acquired += 1
        tensor = self._arena[offset : offset + nbytes]
        return StagingBuffer(self, offset, nbytes, size, kind, tensor, self._view[offset : offset + nbytes])

    def _free(self, buf: StagingBuffer) -> None:
        with self._lock:
            self._in_use[buf.kind] -= buf.reserved
            off, size = buf.offset, buf.reserved
            i = bisect.bisect_left(self._free_off, off)
            # Merge with the previous and next extents when they touch.
            if i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == off:
                i -= 1
                off = self._free_off[i]
                size += self._free_len[i]
                del self._free_off[i]
                del self._free_len[i]
            if i < len(self._free_off) and off + size == self._free_off[i]:
                size += self._free_len[i]
                del self._free_off[i]
                del self._free_len[i]
            self._free_off.insert(i, off)
            self._free_len.insert(i, size)

    # -- introspection ----------------------------------------------------
    @property
    def in_use(self) -> int:
        with self._lock:
            return self._in_use[SAVE] + self._in_use[LOAD]

    def stats(self) -> StagingStats:
        with self._lock:
            return StagingStats(
                capacity=self.capacity,
                in_use=self._in_use[SAVE] + self._in_use[LOAD],
                save_in_use=self._in_use[SAVE],
                load_in_use=self._in_use[LOAD],
                high_water=self._high_water,
                save_limit=self.save_limit,
                save_drops=self._drops[SAVE],
                load_drops=self._drops[LOAD],
                acquired=self._acquired,
                pinned=self.pinned,
            )

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of each free extent, for tests."""
        with self._lock:
            return list(zip(self._free_off, self._free_len, strict=True))

    def close(self) -> None:
        """Refuse new buffers. The arena stays alive until the pool object is collected,
        so a buffer still held by a straggling thread never points at freed memory."""
        with self._lock:
            self._closed = True
