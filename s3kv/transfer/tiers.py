"""What a tier is worth and how big it is: measured load speeds, the host tier's automatic size.

A hit is taken only where loading it beats recomputing it (``s3kv/engine/leader/worth.py``);
that needs each tier's speed as this machine delivers it: :class:`TierSpeed` keeps what the
worker's loads measured (latency per object, bandwidth), :func:`calibrate` measures the host
tier's copy bandwidth once, at registration. :func:`capacity_bytes` turns
``S3KV_HOST_CACHE_GB`` into bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..store.base import ObjectStore
from .counters import Counters
from .hosttier import HostTier, Weigher
from .staging import ALIGN, StagingBuffer

log = logging.getLogger(__name__)


@dataclass
class TierSpeed:
    """A tier's load speed as measured: latency per object and bandwidth (EWMAs).

    Each observation is one object read: ``nbytes`` in ``seconds``. Reads of at most
    ``small`` bytes update the latency; larger ones the bandwidth (what they took beyond the
    latency). Until observed, a tier is taken as instant (``latency_s`` 0, infinite bandwidth):
    no hit is refused on a guess.
    """

    latency_s: float = 0.0
    bytes_per_s: float = float("inf")
    small: int = 1 << 20
    alpha: float = 0.2
    observed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        with self._lock:
            a = self.alpha if self.observed else 1.0
            if nbytes <= self.small:
                self.latency_s += a * (seconds - self.latency_s)
            else:
                bw = nbytes / max(seconds - self.latency_s, seconds * 0.1)
                self.bytes_per_s = bw if self.bytes_per_s == float("inf") else self.bytes_per_s + a * (bw - self.bytes_per_s)
            self.observed += 1

    def set_bandwidth(self, bytes_per_s: float) -> None:
        """A measured figure (the tier's calibration copy at registration)."""
        with self._lock:
            self.bytes_per_s = bytes_per_s

    def load_s(self, nbytes: int) -> float:
        """Seconds to load ``nbytes`` (objects read in parallel: one latency)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bytes_per_s


def calibrate(tier: HostTier, device: Any, nbytes: int = 16 << 20) -> float:
    """Bytes per second of one copy from the tier's memory to ``device`` (best of three): the
    tier's bandwidth for the "worth loading" rule (``engine/leader/worth.py``). 0 when it cannot
    be measured (no room, no device memory to spare: the engine's KV cache has taken it).

    On a stream of its own, waiting for that stream only: it runs once the arena is ready, in the
    background, while the engine may already be running its forward passes."""
    import torch

    n = min(nbytes, tier.capacity // 2) // ALIGN * ALIGN
    pool = tier.pool  # the arena (none with a weigher): the memory the tier's loads copy from
    buf = None if n <= 0 else pool.try_acquire(n) if pool is not None else StagingBuffer.standalone(n)
    if buf is None:
        return 0.0
    try:
        cuda = getattr(device, "type", str(device)) == "cuda"
        stream = torch.cuda.Stream(device=device) if cuda else None

        def best_of_three() -> float:
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                dst.copy_(buf.tensor, non_blocking=cuda)
                if stream is not None:
                    stream.synchronize()
                best = min(best, time.perf_counter() - t0)
            return best

        if stream is not None:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                best = best_of_three()
        else:
            best = best_of_three()
        return n / best if best > 0 else 0.0
    except Exception as e:  # noqa: BLE001 - a measurement, never a reason to refuse the engine
        log.info("s3kv: host tier bandwidth not measured (%s); loads will measure it", e)
        return 0.0
    finally:
        buf.release()


#: The automatic size (``host_cache_gb = -1`` on a GPU engine): this share of the host's memory,
#: split between its GPUs (one tier per rank), at most ``AUTO_MAX_BYTES`` a rank.
AUTO_FRACTION = 0.2
AUTO_MAX_BYTES = 64 << 30
#: Where the host's memory and the container's limit are read (cgroup v2, then v1).
MEMINFO = "/proc/meminfo"
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _host_memory() -> int:
    """Bytes of memory the engine's processes may use: the host's total (``MemTotal``), at most
    the container's limit; 0 where it cannot be read.

    Why the total, not what is available now: every rank sizes its own tier, and the tiers must be
    the same size -- their eviction follows the plan on every rank only then (``hosttier``'s module
    doc), and the leader promises what rank 0's tier holds. What is available differs from one
    rank's start to the next (the other ranks' arenas being pinned, weights being read); the total
    and the limit read the same on every rank. Why the limit: ``/proc/meminfo`` shows the host's
    memory inside a container too, and a tier sized from it could take a pod past its limit."""
    total = 0
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return 0
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                word = f.read().strip()
        except OSError:
            continue
        if word.isdigit():  # "max": no limit
            total = min(total, int(word))
        break
    return total


def capacity_bytes(host_cache_gb: float, device: Any) -> int:
    """The tier size ``S3KV_HOST_CACHE_GB`` asks for on a cache living on ``device``: GiB as set,
    or (-1, auto) ``AUTO_FRACTION`` of the host's memory per GPU of this host, capped, on a GPU
    cache -- 0 elsewhere (the simulator and tests on the CPU: a tier only when asked for)."""
    if host_cache_gb >= 0:
        return int(host_cache_gb * (1 << 30))
    if getattr(device, "type", str(device)) != "cuda":
        return 0
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return int(min(AUTO_MAX_BYTES, AUTO_FRACTION * _host_memory() / max(1, gpus))) // ALIGN * ALIGN


def open_host_tier(
    store: ObjectStore,
    host_cache_gb: float,
    device: Any,
    *,
    pinned: bool,
    weigh: Weigher | None,
    counters: Counters,
    on_written: Callable[[str, Any], None] | None,
    speed: TierSpeed,
    name: str,
) -> HostTier | None:
    """A rank's host tier in front of ``store`` (None when the size is 0). A pinned arena is
    allocated and pinned in the background (seconds per 10 GiB: the engine's start-up does not
    wait; the tier holds nothing until then); once it is ready, its copy bandwidth to ``device``
    is measured into ``speed`` and how long it took is logged."""
    nbytes = capacity_bytes(host_cache_gb, device)
    if nbytes <= 0:
        return None
    t0 = time.perf_counter()

    def ready(tier: HostTier) -> None:
        bw = calibrate(tier, device)
        if bw > 0:
            speed.set_bandwidth(bw)
        log.info("s3kv %s: host tier %.2f GiB (%s) ready %.2f s after registration (allocated in %.2f s); "
                 "%.1f GB/s to %s", name, nbytes / (1 << 30), "pinned" if tier.pinned else "pageable",
                 time.perf_counter() - t0, tier.register_s, bw / 1e9, device)

    return HostTier(store, nbytes, pinned=pinned, weigh=weigh, on_written=on_written, counters=counters, name=name,
                    on_ready=ready)
