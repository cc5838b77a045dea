"""How fast a host-tier hit reaches the GPU, and what the tier costs to set up.

Part of ``s3kv bench staging`` (:func:`bench_host_tier`). Through the real worker
(``WorkerCore`` with a host tier, sync loads): ``objects`` objects of ``pages`` scattered
pages each are saved (they land in the tier), then loaded back into other scattered slots,
timed from ``start_load_kv`` until the copies are on the device (host synchronized), best of
``repeats``. Against one contiguous ``copy_`` of the same bytes from pinned memory:

* ``host_tier_ratio_vs_memcpy`` -- the load as the engine runs it from the tier (header checked
  in the arena, pages copied host->device straight from it); the issue's bar is >= 0.9;
  ``host_tier_host_us``: the host time of that iteration's connector calls alone (on a GPU the
  copies run on after they return: what the connector's Python costs per load);
* ``host_tier_verify_ratio_vs_memcpy`` -- the same with ``S3KV_HOST_CACHE_VERIFY`` (every page's
  checksum on every hit): the cost of re-hashing;
* ``store_path_ratio_vs_memcpy`` -- the same objects from an in-memory store through staging
  (the path without a tier: a host copy into staging, then the device copy).

Registering a tier of ``capacity_gib`` (a pinned one is allocated and pinned in the background):
``register_return_s`` -- until ``HostTier(...)`` returns (what the engine's layout registration
waits for); ``register_s`` / ``register_gib_per_s`` -- until the tier is ready (allocated and
pinned; it holds nothing before); ``register_max_stall_s`` -- the longest a small host->device copy
plus synchronize took on the calling thread meanwhile (does pinning in the background hold up the
engine's own CUDA calls?). Runs on ``device='cpu'`` too (smoke runs; plain memory: nothing to pin).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...config import Settings
from ...core.plan import BufferId, ConnectorMetadata, LoadOp, ObjectRef, SealOp, StageOp
from ...engine.worker import WorkerCore
from ...sim.layouts import GroupSpec, make_layout
from ...store.memory import MemoryStore
from ...transfer.hosttier import HostTier
from ...transfer.staging import StagingPool
from .staging_copies import _best, _sync


def _step(core: WorkerCore, md: ConnectorMetadata | None, fwd: Any) -> None:
    core.bind(md)
    core.start_load_kv(fwd)
    core.wait_for_layer_load(0, fwd)
    core.wait_for_save(fwd)
    core.get_finished([], [])


def _worker_load_s(
    dev: torch.device, pb: int, objects: int, pages: int, *, tier_gib: float, verify: bool, repeats: int, seed: int
) -> tuple[float, float, bool, bool]:
    """Best seconds to load ``objects`` x ``pages`` pages through a worker, best seconds the host
    spent in the connector's calls of that iteration (the copies may still run on a GPU); bit
    exact, pinned tier."""
    n = objects * pages
    layout = make_layout([GroupSpec((0,), None, (pb,))], num_slots=4 * n, device=dev, fill_seed=seed)
    rows = layout.group(0).regions[0].as_tensor()
    slots = list(range(0, 4 * n, 2))
    random.Random(seed).shuffle(slots)
    src, dst = slots[:n], slots[n : 2 * n]  # never adjacent: one copy per page
    settings = Settings(url="memory://bench", check_access=False, host_cache_gb=tier_gib, host_cache_verify=verify,
                        staging_mib=max(64, 2 * n * pb >> 20), download_threads=8, load_timeout_s=120.0)
    core = WorkerCore(settings, MemoryStore(), "bench", 0, 1, "bench-model", "bf16", failed_load_hook=True)
    core.register_layout(layout)
    if core.host_tier is not None and not core.host_tier.wait_ready(120):
        raise RuntimeError("the host tier was not ready within 120 s")
    fwd = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    try:
        stages, seals, loads = [], [], []
        for k in range(objects):
            bid = BufferId(k, 0, 0, pages)
            d = random.Random(seed * 1000 + k).randbytes(16)
            stages += [StageOp(bid, i, s) for i, s in enumerate(src[k * pages : (k + 1) * pages])]
            seals.append(SealOp(bid, pages, d))
            loads.append(LoadOp(100 + k, ObjectRef(0, d, ((0, pages),)), tuple(range(pages)),
                                tuple(dst[k * pages : (k + 1) * pages])))
        _step(core, ConnectorMetadata(stages=tuple(stages), seals=tuple(seals)), fwd)
        core.flush(120)
        md = ConnectorMetadata(loads=tuple(loads))
        _step(core, md, fwd)  # warm-up, and the bit-exactness check
        _sync(dev)
        exact = bool(torch.equal(rows[dst], rows[src]))
        best = host = float("inf")
        for _ in range(max(1, repeats)):
            rows[dst] = 0
            _sync(dev)
            t0 = time.perf_counter()
            _step(core, md, fwd)
            t1 = time.perf_counter()
            _sync(dev)
            best, host = min(best, time.perf_counter() - t0), min(host, t1 - t0)
        pinned = core.host_tier is not None and core.host_tier.pinned
        return best, host, exact, pinned
    finally:
        core.close()


def _memcpy_s(dev: torch.device, nbytes: int, repeats: int) -> float:
    pool = StagingPool.for_device(nbytes, dev, pinned=True, load_reserve_fraction=0.0)
    buf = pool.try_acquire(nbytes)
    assert buf is not None
    out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = _best(lambda: out.copy_(buf.tensor, non_blocking=True), dev, max(1, repeats) + 1, warmup=0)
    buf.release()
    return best


def _register(dev: torch.device, capacity_gib: float) -> tuple[float, float, float, bool]:
    """(seconds until ``HostTier`` returned, until it was ready, the longest small copy meanwhile,
    pinned)."""
    probe_src = torch.zeros(4096, dtype=torch.uint8)
    probe_dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    _sync(dev)
    t0 = time.perf_counter()
    tier = HostTier(MemoryStore(), int(capacity_gib * (1 << 30)), pinned=dev.type == "cuda")
    returned = time.perf_counter() - t0
    stall = 0.0
    while not tier.wait_ready(0.001):
        t = time.perf_counter()
        probe_dst.copy_(probe_src)
        _sync(dev)
        stall = max(stall, time.perf_counter() - t)
    ready, pinned = time.perf_counter() - t0, tier.pinned
    tier.close()
    del tier
    return returned, ready, stall, pinned


def bench_host_tier(
    page_sizes_mib: Sequence[float] = (1.0, 4.0, 16.0),
    pages: int = 16,
    objects: int = 4,
    device: str | torch.device = "cuda",
    *,
    capacity_gib: float = 4.0,
    repeats: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    dev = torch.device(device)
    t0 = time.perf_counter()
    register_return_s, register_s, stall, pinned = _register(dev, capacity_gib)
    rows: list[dict[str, Any]] = []
    exact = True
    for mib in page_sizes_mib:
        pb = int(mib * (1 << 20))
        nbytes = objects * pages * pb
        gib = 2 * nbytes / (1 << 30) + 0.01
        host, host_cpu, ok1, tier_pinned = _worker_load_s(dev, pb, objects, pages, tier_gib=gib, verify=False,
                                                          repeats=repeats, seed=seed)
        verify, _, ok2, _ = _worker_load_s(dev, pb, objects, pages, tier_gib=gib, verify=True, repeats=repeats,
                                           seed=seed)
        store, _, ok3, _ = _worker_load_s(dev, pb, objects, pages, tier_gib=0, verify=False, repeats=repeats,
                                          seed=seed)
        memcpy = _memcpy_s(dev, nbytes, repeats)
        exact &= ok1 and ok2 and ok3
        rows.append({
            "page_mib": mib, "bytes": nbytes, "tier_pinned": tier_pinned,
            "host_tier_gbps": nbytes / host / 1e9, "host_tier_host_us": host_cpu * 1e6, "host_tier_verify_gbps": nbytes / verify / 1e9,
            "store_path_gbps": nbytes / store / 1e9, "memcpy_gbps": nbytes / memcpy / 1e9,
            "host_tier_ratio_vs_memcpy": memcpy / host, "host_tier_verify_ratio_vs_memcpy": memcpy / verify,
            "store_path_ratio_vs_memcpy": memcpy / store,
        })
    head = [r for r in rows if r["page_mib"] >= 1.0] or rows
    return {
        "device": str(dev),
        "objects": objects,
        "pages_per_object": pages,
        "capacity_gib": capacity_gib,
        "pinned": pinned,
        "register_return_s": register_return_s,
        "register_s": register_s,
        "register_gib_per_s": capacity_gib / register_s if register_s > 0 else None,
        "register_max_stall_s": stall,
        "bit_exact": exact,
        "results": rows,
        "host_tier_ratio_vs_memcpy": min(r["host_tier_ratio_vs_memcpy"] for r in head),
        "host_tier_verify_ratio_vs_memcpy": min(r["host_tier_verify_ratio_vs_memcpy"] for r in head),
        "store_path_ratio_vs_memcpy": min(r["store_path_ratio_vs_memcpy"] for r in head),
        "seconds": time.perf_counter() - t0,
    }
