"""Many page copies in one ``cudaMemcpyBatchAsync`` call (CUDA runtime >= 12.8), through ctypes.

Why: a save or load moves tens to thousands of scattered pages. One ``copy_`` per page
pays Python, dispatcher and driver set-up per copy (about 15 us), and the copy engine
idles between small copies. The batch API hands the driver every (dst, src, size) at
once and keeps the copies on the copy engines (no SMs taken from the forward pass).
On an H200 the batched copies run at 0.99 of one contiguous memcpy's speed at 1 MiB
pages (0.85-0.88 per page); numbers and method in :mod:`.copies`.

PyTorch does not expose the call, so this module binds the CUDA runtime that the
process already loaded (the one PyTorch uses). Anything unexpected -- no CUDA build,
runtime older than 12.8, the symbol missing, a non-Linux host -- means
:meth:`MemcpyBatch.load` returns ``None`` and the caller keeps per-page copies. So does
a device of compute capability 10 or newer (Blackwell): another inference engine
(lmdeploy's turbomind) reports the batch call crashing there and turns it off; we
have only measured it on Hopper, and a crash of the serving process is no price for
a faster copy. The call's contract is written down here once:

* addresses are plain integers valid in the unified address space: device memory, or
  page-locked host memory (pageable host memory is *not* passed here -- the caller
  checks ``is_pinned`` -- because the driver may then copy synchronously);
* ``srcAccessOrder = stream``: the sources are read in stream order, exactly like
  ``cudaMemcpyAsync`` on that stream, so the usual event ordering holds;
* never the legacy default stream (the API rejects it);
* CUDA 12.8/12.9 take an extra ``failIdx`` out-argument before the stream; CUDA 13 dropped it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from array import array
from collections.abc import Sequence

log = logging.getLogger(__name__)

_MIN_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
_FAILIDX_BEFORE = 13000  # ... with a failIdx argument until CUDA 13.0
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
_MAX_CAPABILITY_MAJOR = 10  # Blackwell and newer: not used (see the module docstring)


class MemcpyBatchError(RuntimeError):
    """The driver refused a batch (the error is cleared; nothing was left half-reported)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _loaded_cudart_paths() -> list[str]:
    """The CUDA runtimes mapped into this process (PyTorch's first), Linux only."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcudart.so" in line:
                    p = line.split()[-1]
                    if p not in paths:
                        paths.append(p)
    except OSError:
        pass
    return paths


class MemcpyBatch:
    """A bound ``cudaMemcpyBatchAsync``; build with :meth:`load`."""

    def __init__(self, lib: ctypes.CDLL, version: int, path: str):
        self._lib = lib
        self.version = version
        self.path = path
        self._fn = lib.cudaMemcpyBatchAsync
        self._fn.restype = ctypes.c_int
        self._attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._with_failidx = version < _FAILIDX_BEFORE

    @classmethod
    def load(cls, device: object = None) -> MemcpyBatch | None:
        """Bind the process's CUDA runtime for ``device`` (default: the current one), or
        ``None`` when the batch call is not there or not trusted on that device."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            torch.cuda.init()  # loads PyTorch's runtime, so it is the one found first below
            major, minor = torch.cuda.get_device_capability(device)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - no usable CUDA: per-page copies
            return None
        if major >= _MAX_CAPABILITY_MAJOR:
            log.info("s3kv: compute capability %d.%d: batched copies not trusted there; per-page copies", major, minor)
            return None
        # Only a runtime PyTorch already loaded: a second copy found elsewhere would keep its
        # own current device and error state (PyTorch builds that link it statically: per page).
        for path in _loaded_cudart_paths():
            try:
                lib = ctypes.CDLL(path)
                version = ctypes.c_int(0)
                if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
                    continue
                if version.value < _MIN_VERSION or not hasattr(lib, "cudaMemcpyBatchAsync"):
                    log.info("s3kv: %s (CUDA %d): no cudaMemcpyBatchAsync; per-page copies", path, version.value)
                    continue
                return cls(lib, version.value, path)
            except OSError:
                continue
        return None

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
        """Enqueue ``len(sizes)`` copies on ``stream`` (a ``cudaStream_t`` as int); raises :class:`MemcpyBatchError`."""
        n = len(sizes)
        if n == 0:
            return
        if not stream:
            raise MemcpyBatchError("cudaMemcpyBatchAsync cannot use the legacy default stream")
        # array('Q') converts the lists in C; the ctypes views share (and keep alive) its memory.
        dst = (ctypes.c_void_p * n).from_buffer(array("Q", dsts))
        src = (ctypes.c_void_p * n).from_buffer(array("Q", srcs))
        size = (ctypes.c_size_t * n).from_buffer(array("Q", sizes))
        # One attributes entry (index 0) covers every copy: stream-ordered sources.
        args: list[object] = [dst, src, size, ctypes.c_size_t(n)]
        args += [ctypes.byref(self._attrs), self._attr_idx, ctypes.c_size_t(1)]
        fail_idx = ctypes.c_size_t(0)
        if self._with_failidx:
            args.append(ctypes.byref(fail_idx))
        args.append(ctypes.c_void_p(stream))
        rc = self._fn(*args)
        if rc != 0:
            # The runtime also records the error as its "last error"; clear it so that
            # PyTorch's next launch check does not raise it against unrelated work.
            self._lib.cudaGetLastError()
            where = f" (copy {fail_idx.value})" if self._with_failidx else ""
            raise MemcpyBatchError(f"cudaMemcpyBatchAsync failed with cudaError {rc}{where} for {n} copies")
