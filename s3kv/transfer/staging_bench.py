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

The copier is the worker's (``copy_path``: one ``cudaMemcpyBatchAsync`` per call where
the runtime has it); when that is the batch, the per-page fallback is timed in the
same run too (``per_page_*`` keys), so the two can be compared side by side.
Every timed path is checked bit-exact once (``bit_exact``).
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
    copiers: dict[str, Copier], fwd: Any, dev: torch.device, pb: int, pages: int, repeats: int, warmup: int, seed: int
) -> tuple[dict[str, float], bool, bool]:
    """Seconds per run of d2h / h2d through each copier and of the contiguous memcpys."""
    total = pb * pages
    layout = make_layout([GroupSpec((0,), None, (pb,))], num_slots=2 * pages, device=dev, fill_seed=seed)
    regions = tuple(layout.group(0).regions)
    slots = list(range(0, 2 * pages, 2))  # never adjacent: one copy per page
    random.Random(seed).shuffle(slots)
    pool = StagingPool.for_device(total, dev, pinned=True, load_reserve_fraction=0.0)
    buf = pool.try_acquire(total, SAVE)
    assert buf is not None
    copies = [PageCopy(regions, s, buf.tensor, i * pb) for i, s in enumerate(slots)]
    contiguous = torch.empty(total, dtype=torch.uint8, device=dev)
    pool_rows = regions[0].as_tensor()
    expected = torch.cat([pool_rows[s] for s in slots]).cpu()
    exact = True
    t: dict[str, float] = {}
    for name, copier in copiers.items():

        def d2h(copier: Copier = copier) -> None:
            Copier.synchronize(copier.save(copies, fwd))

        def h2d(copier: Copier = copier) -> None:
            copier.begin_loads(fwd)
            Copier.synchronize(copier.load(copies))

        # Bit-exact once per path: staged bytes equal the pages, and a load puts them back.
        buf.tensor.zero_()
        d2h()
        exact &= torch.equal(buf.tensor.cpu(), expected)
        for s in slots:
            pool_rows[s].zero_()
        h2d()
        exact &= torch.equal(torch.cat([pool_rows[s] for s in slots]).cpu(), expected)
        t[f"{name}d2h"] = _best(d2h, dev, repeats, warmup)
        t[f"{name}h2d"] = _best(h2d, dev, repeats, warmup)

    def memcpy_d2h() -> None:
        buf.tensor.copy_(contiguous, non_blocking=True)

    def memcpy_h2d() -> None:
        contiguous.copy_(buf.tensor, non_blocking=True)

    t["md2h"] = _best(memcpy_d2h, dev, repeats, warmup)
    t["mh2d"] = _best(memcpy_h2d, dev, repeats, warmup)
    buf.release()
    return t, pool.pinned, exact


#: The page sizes the headline ratios cover (the issue's 1-16 MiB); smaller pages are reported per row.
HEADLINE_MIN_PAGE_MIB = 1.0


def bench_staging(
    page_sizes_mib: Sequence[float] = (1, 4, 16),
    pages: int = 64,
    device: str | torch.device = "cuda",
    *,
    repeats: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_staging: CUDA is not available")
    copier = Copier(dev)
    copiers = {"": copier}
    if copier.path == "memcpy_batch":
        copiers["pp_"] = Copier(dev, batch=False)
    fwd = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    rows: list[dict[str, Any]] = []
    keys = [f"{n}{d}" for n in copiers for d in ("d2h", "h2d")] + ["md2h", "mh2d"]
    totals = dict.fromkeys(["bytes", *keys], 0.0)
    pinned = False
    exact = True
    for mib in page_sizes_mib:
        pb = int(mib * (1 << 20))
        total = pb * pages
        t, pinned, ok = _bench_one(copiers, fwd, dev, pb, pages, repeats, warmup, seed)
        exact &= ok
        gbps = {k: total / v / 1e9 for k, v in t.items()}
        row: dict[str, Any] = {
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
        if "pp_" in copiers:
            row["per_page_d2h_ratio_vs_memcpy"] = gbps["pp_d2h"] / gbps["md2h"]
            row["per_page_h2d_ratio_vs_memcpy"] = gbps["pp_h2d"] / gbps["mh2d"]
        rows.append(row)
        totals["bytes"] += total
        for k, v in t.items():
            totals[k] += v
    b = totals["bytes"]
    head = [r for r in rows if r["page_mib"] >= HEADLINE_MIN_PAGE_MIB] or rows
    out: dict[str, Any] = {
        "device": str(dev),
        "pinned": pinned,
        "copy_path": copier.path,
        "bit_exact": bool(exact),
        "pages": pages,
        "page_sizes_mib": list(page_sizes_mib),
        "headline_page_mib": [r["page_mib"] for r in head],
        "results": rows,
        # Worst page size of the headline range: the number to watch.
        "d2h_ratio_vs_memcpy": min(r["d2h_ratio_vs_memcpy"] for r in head),
        "h2d_ratio_vs_memcpy": min(r["h2d_ratio_vs_memcpy"] for r in head),
        # Over all page sizes together.
        "d2h_gbps": b / totals["d2h"] / 1e9,
        "h2d_gbps": b / totals["h2d"] / 1e9,
        "memcpy_d2h_gbps": b / totals["md2h"] / 1e9,
        "memcpy_h2d_gbps": b / totals["mh2d"] / 1e9,
    }
    if "pp_" in copiers:
        out["per_page_d2h_ratio_vs_memcpy"] = min(r["per_page_d2h_ratio_vs_memcpy"] for r in head)
        out["per_page_h2d_ratio_vs_memcpy"] = min(r["per_page_h2d_ratio_vs_memcpy"] for r in head)
    return out


if __name__ == "__main__":  # pragma: no cover - manual runs
    import json
    import sys

    print(json.dumps(bench_staging(device=sys.argv[1] if len(sys.argv) > 1 else "cuda"), indent=2))
