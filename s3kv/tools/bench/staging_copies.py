"""How close scattered page copies through s3kv's copy path come to one big memcpy.

For each page size, ``pages`` pages sit at scattered (non-adjacent, shuffled)
slots of a device pool. We time

* ``d2h``: :meth:`Copier.save` of those pages into one pinned staging buffer
  (side stream ordered after the forward stream, as a save does), and
* ``h2d``: :meth:`Copier.load` of the staged pages back into the slots,

against a plain ``copy_`` of one contiguous device tensor of the same total
bytes to / from the same pinned buffer. ``*_ratio_vs_memcpy`` is our GB/s divided
by the memcpy's (1.0 = as fast as one contiguous copy). Wall-clock, best of
``repeats``, after ``warmup`` untimed runs, host synchronized around each run: on an
idle GPU the host's set-up of the copies counts too.

``device_*_ratio_vs_memcpy`` (CUDA) time the same calls on the GPU alone: the forward
stream is first kept busy (``torch.cuda._sleep``), as a running forward pass keeps it,
so every copy is queued before the first one starts; CUDA events on the forward stream
then measure how long the copy engines take, against the memcpy measured the same way.
That is the cost a busy engine sees; the host set-up then overlaps the forward.

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

from ...sim.layouts import GroupSpec, make_layout
from ...transfer.copies import Copier, PageCopy
from ...transfer.staging import SAVE, StagingPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
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


#: Keeps the forward stream busy while the copies are queued (cycles; ~5 ms at ~2 GHz).
_GATE_CYCLES = 10_000_000


def _device_best(enqueue: Callable[[], None], fwd: Any, repeats: int, warmup: int) -> float:
    """Seconds of GPU time from the forward stream's gate to the end of the copies, best run."""
    best = float("inf")
    for i in range(warmup + max(1, repeats)):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(fwd):
            torch.cuda._sleep(_GATE_CYCLES)
            start.record(fwd)
            enqueue()
            end.record(fwd)
        torch.cuda.synchronize()
        if i >= warmup:
            best = min(best, start.elapsed_time(end) / 1e3)
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
        if dev.type == "cuda":

            def save(copier: Copier = copier) -> None:
                copier.save(copies, fwd)  # the forward stream waits for the copies

            def load(copier: Copier = copier) -> None:
                copier.begin_loads(fwd)
                copier.wait_on(copier.load(copies), fwd)

            t[f"{name}dev_d2h"] = _device_best(save, fwd, repeats, warmup)
            t[f"{name}dev_h2d"] = _device_best(load, fwd, repeats, warmup)

    def memcpy_d2h() -> None:
        buf.tensor.copy_(contiguous, non_blocking=True)

    def memcpy_h2d() -> None:
        contiguous.copy_(buf.tensor, non_blocking=True)

    t["md2h"] = _best(memcpy_d2h, dev, repeats, warmup)
    t["mh2d"] = _best(memcpy_h2d, dev, repeats, warmup)
    if dev.type == "cuda":
        t["dev_md2h"] = _device_best(memcpy_d2h, fwd, repeats, warmup)
        t["dev_mh2d"] = _device_best(memcpy_h2d, fwd, repeats, warmup)
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
    # Keyed by the prefix of their result keys ("" = the worker's path).
    copiers = {"": copier}
    if copier.path == "memcpy_batch":
        copiers["per_page_"] = Copier(dev, batch=False)
    fwd = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    rows: list[dict[str, Any]] = []
    totals: dict[str, float] = {"bytes": 0.0}
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
        }
        for name in copiers:
            for d in ("d2h", "h2d"):
                row[f"{name}{d}_ratio_vs_memcpy"] = gbps[f"{name}{d}"] / gbps[f"m{d}"]
                if f"{name}dev_{d}" in t:
                    row[f"{name}device_{d}_ratio_vs_memcpy"] = gbps[f"{name}dev_{d}"] / gbps[f"dev_m{d}"]
        rows.append(row)
        totals["bytes"] += total
        for k, v in t.items():
            totals[k] = totals.get(k, 0.0) + v
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
    for k in [k for k in head[0] if k.endswith("_ratio_vs_memcpy") and k not in out]:
        out[k] = min(r[k] for r in head)
    return out
