"""How close scattered page copies through s3kv's copy path come to one big memcpy.

For each page size, ``pages`` pages sit at scattered (non-adjacent, shuffled)
slots of a device pool. We time

* ``d2h``: :meth:`Copier.save` of those pages into one pinned staging buffer
  (side stream ordered after the forward stream, as a save does), and
* ``h2d``: :meth:`Copier.load` of the staged pages back into the slots,

against a plain ``copy_`` of one contiguous device tensor of the same total
bytes to / from the same pinned buffer. ``*_ratio_vs_memcpy`` is our GB/s divided
by the memcpy's (1.0 = as fast as one contiguous copy). Wall-clock, best of
``repeats``, after ``warmup`` untimed runs, host synchronized around each run.
Runs on ``device='cpu'`` too (plain memory, no streams) for smoke tests.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .copies import Copier, PageCopy
from .staging import SAVE, StagingPool
from .testing import GroupSpec, make_layout


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
        _sync(device)
    best = float("inf")
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _bench_one(
    copier: Copier, fwd: Any, dev: torch.device, pb: int, pages: int, repeats: int, warmup: int, seed: int
) -> tuple[dict[str, float], bool]:
    """Seconds per run of d2h / h2d through the copy path and of the contiguous memcpys."""
    total = pb * pages
    layout = make_layout([GroupSpec((0,), None, (pb,))], num_slots=2 * pages, device=dev, fill_seed=None)
    regions = tuple(layout.group(0).regions)
    slots = list(range(0, 2 * pages, 2))  # never adjacent: one copy per page
    random.Random(seed).shuffle(slots)
    pool = StagingPool.for_device(total, dev, pinned=True, load_reserve_fraction=0.0)
    buf = pool.try_acquire(total, SAVE)
    assert buf is not None
    copies = [PageCopy(regions, s, buf.tensor, i * pb) for i, s in enumerate(slots)]
    contiguous = torch.empty(total, dtype=torch.uint8, device=dev)

    def d2h() -> None:
        Copier.synchronize(copier.save(copies, fwd))

    def h2d() -> None:
        copier.begin_loads(fwd)
        Copier.synchronize(copier.load(copies))

    def memcpy_d2h() -> None:
        buf.tensor.copy_(contiguous, non_blocking=True)

    def memcpy_h2d() -> None:
        contiguous.copy_(buf.tensor, non_blocking=True)

    t = {
        "d2h": _best(d2h, dev, repeats, warmup),
        "h2d": _best(h2d, dev, repeats, warmup),
        "md2h": _best(memcpy_d2h, dev, repeats, warmup),
        "mh2d": _best(memcpy_h2d, dev, repeats, warmup),
    }
    buf.release()
    return t, pool.pinned


def bench_staging(
    page_sizes_mib: Sequence[float] = (1, 4, 16),
    pages: int = 64,
    device: str | torch.device = "cuda",
    *,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_staging: CUDA is not available")
    copier = Copier(dev)
    fwd = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    rows: list[dict[str, Any]] = []
    totals = {"bytes": 0.0, "d2h": 0.0, "h2d": 0.0, "md2h": 0.0, "mh2d": 0.0}
    pinned = False
    for mib in page_sizes_mib:
        pb = int(mib * (1 << 20))
        total = pb * pages
        t, pinned = _bench_one(copier, fwd, dev, pb, pages, repeats, warmup, seed)
        gbps = {k: total / v / 1e9 for k, v in t.items()}
        rows.append(
            {
                "page_mib": mib,
                "pages": pages,
                "bytes": total,
                "d2h_gbps": gbps["d2h"],
                "h2d_gbps": gbps["h2d"],
                "memcpy_d2h_gbps": gbps["md2h"],
                "memcpy_h2d_gbps": gbps["mh2d"],
                "d2h_ratio_vs_memcpy": gbps["d2h"] / gbps["md2h"],
                "h2d_ratio_vs_memcpy": gbps["h2d"] / gbps["mh2d"],
            }
        )
        totals["bytes"] += total
        for k, v in t.items():
            totals[k] += v
    b = totals["bytes"]
    return {
        "device": str(dev),
        "pinned": pinned,
        "pages": pages,
        "page_sizes_mib": list(page_sizes_mib),
        "results": rows,
        # Worst page size: the number to watch.
        "d2h_ratio_vs_memcpy": min(r["d2h_ratio_vs_memcpy"] for r in rows),
        "h2d_ratio_vs_memcpy": min(r["h2d_ratio_vs_memcpy"] for r in rows),
        # Over all page sizes together.
        "d2h_gbps": b / totals["d2h"] / 1e9,
        "h2d_gbps": b / totals["h2d"] / 1e9,
        "memcpy_d2h_gbps": b / totals["md2h"] / 1e9,
        "memcpy_h2d_gbps": b / totals["mh2d"] / 1e9,
    }


if __name__ == "__main__":  # pragma: no cover - manual runs
    import json
    import sys

    print(json.dumps(bench_staging(device=sys.argv[1] if len(sys.argv) > 1 else "cuda"), indent=2))
