"""``s3kv bench staging``: scattered page copies through s3kv's copy path vs one contiguous memcpy.

A thin front end to :func:`s3kv.tools.bench.staging_copies.bench_staging` (see there for the method):
device->pinned-host (save) and pinned-host->device (load) copies of scattered pages, against one
``copy_`` of the same bytes. Needs a CUDA device; without one it says so and exits 0
(``{"skipped": "needs CUDA"}``). ``--device cpu`` runs the same code on host memory (a smoke test
of the path, not a measurement worth quoting).

``host_tier`` (:mod:`.hostcopies`): a load served from the host tier, through the worker, against
the same contiguous memcpy -- with and without re-hashing every page, and the path without a
tier (a store read through staging) -- and the time to allocate and pin a tier.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .common import machine_info, rnd

DEFAULT_PAGE_MIB = (0.25, 1.0, 4.0, 16.0)
#: Issue 6's bar for an H200: scattered pages at >= 0.9 of one contiguous pinned memcpy,
#: over the headline page sizes (1-16 MiB; smaller pages are reported, not targeted).
TARGET_RATIO = 0.9


#: Issue 39's bar: a load from the host tier reaches the GPU at >= 0.9 of one pinned memcpy.
HOST_TARGET_RATIO = 0.9


def run_staging(
    page_mib: Sequence[float], pages: int, device: str, *, host_objects: int = 4, host_pages: int = 16,
    host_gib: float = 4.0,
) -> dict[str, Any]:
    import torch

    base: dict[str, Any] = {
        "bench": "staging",
        "store": {"kind": "none", "where": "no store: host<->device copies only", "latency_ms_injected": 0},
        "latency_ms_injected": 0,
    }
    if device.startswith("cuda") and not torch.cuda.is_available():
        return {
            **base,
            "machine": machine_info(),
            "skipped": "needs CUDA",
            "reason": "s3kv bench staging needs a CUDA device (torch.cuda.is_available() is False); "
            "run it on a GPU machine, or pass --device cpu for a smoke run",
            "targets": {},
            "targets_met": {},
        }
    from .hostcopies import bench_host_tier
    from .staging_copies import bench_staging

    t0 = time.perf_counter()
    res = bench_staging(tuple(page_mib), pages, device)
    out = {**base, "machine": machine_info(), **res}
    host = bench_host_tier(tuple(page_mib), host_pages, host_objects, device, capacity_gib=host_gib)
    out["host_tier"] = {k: rnd(v, 3) if isinstance(v, float) else v for k, v in host.items()}
    if device.startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name(torch.device(device))
    out["targets"] = {
        "d2h_ratio_ge_0.9": f"save copies >= {TARGET_RATIO} x one contiguous memcpy (worst page of 1-16 MiB)",
        "h2d_ratio_ge_0.9": f"load copies >= {TARGET_RATIO} x one contiguous memcpy (worst page of 1-16 MiB)",
        "bit_exact": "every timed copy path moved exactly the pages' bytes",
        "host_tier_ratio_ge_0.9": f"loads from the host tier >= {HOST_TARGET_RATIO} x one contiguous pinned memcpy "
        "(worst page of 1-16 MiB)",
    }
    out["targets_met"] = {
        "d2h_ratio_ge_0.9": out["d2h_ratio_vs_memcpy"] >= TARGET_RATIO,
        "h2d_ratio_ge_0.9": out["h2d_ratio_vs_memcpy"] >= TARGET_RATIO,
        "bit_exact": out["bit_exact"] and host["bit_exact"],
        "host_tier_ratio_ge_0.9": host["host_tier_ratio_vs_memcpy"] >= HOST_TARGET_RATIO,
    }
    for k in (
        "d2h_ratio_vs_memcpy",
        "h2d_ratio_vs_memcpy",
        "d2h_gbps",
        "h2d_gbps",
        "memcpy_d2h_gbps",
        "memcpy_h2d_gbps",
    ):
        out[k] = rnd(out[k], 3)
    for k in [k for k in out if k.endswith("_ratio_vs_memcpy")]:
        out[k] = rnd(out[k], 3)
    out["seconds"] = rnd(time.perf_counter() - t0, 1)
    return out


def table(res: dict[str, Any]) -> str:
    from .common import targets_line

    if res.get("skipped"):
        return f"s3kv bench staging: skipped -- {res['reason']}"
    m = res.get("machine", {})
    pp = "per_page_d2h_ratio_vs_memcpy" in res
    dv = "device_d2h_ratio_vs_memcpy" in res
    lines = [
        f"s3kv bench staging -- {res.get('device_name', res['device'])}, pinned staging: {res['pinned']}, "
        f"copy path: {res.get('copy_path', '?')}, {res['pages']} scattered pages per run; "
        f"machine: {m.get('cores')} cores",
        "",
        f"{'page':>9} | {'save D2H GB/s':>13} {'memcpy':>8} {'ratio':>6} | {'load H2D GB/s':>13} {'memcpy':>8} "
        f"{'ratio':>6}"
        + (f" | {'GPU-time ratio d2h/h2d':>23}" if dv else "")
        + (f" | {'per-page copies d2h/h2d':>24}" if pp else ""),
    ]
    for r in res["results"]:
        lines.append(
            f"{r['page_mib']:>5g} MiB | {r['d2h_gbps']:>13.2f} {r['memcpy_d2h_gbps']:>8.2f} "
            f"{r['d2h_ratio_vs_memcpy']:>6.2f} | {r['h2d_gbps']:>13.2f} {r['memcpy_h2d_gbps']:>8.2f} "
            f"{r['h2d_ratio_vs_memcpy']:>6.2f}"
            + (f" | {r['device_d2h_ratio_vs_memcpy']:>11.2f} / {r['device_h2d_ratio_vs_memcpy']:<9.2f}" if dv else "")
            + (
                f" | {r['per_page_d2h_ratio_vs_memcpy']:>11.2f} / {r['per_page_h2d_ratio_vs_memcpy']:<10.2f}"
                if pp
                else ""
            )
        )
    lines.append(
        f"{'all':>9} | {res['d2h_gbps']:>13.2f} {res['memcpy_d2h_gbps']:>8.2f} {res['d2h_ratio_vs_memcpy']:>6.2f}"
        f" | {res['h2d_gbps']:>13.2f} {res['memcpy_h2d_gbps']:>8.2f} {res['h2d_ratio_vs_memcpy']:>6.2f}"
        f"   (ratios: worst page of {', '.join(f'{x:g}' for x in res.get('headline_page_mib', []))} MiB)"
    )
    h = res.get("host_tier")
    if h:
        lines += [
            "",
            f"host tier: {h['capacity_gib']:g} GiB allocated{' and pinned' if h['pinned'] else ''} in "
            f"{h['register_s']:.2f} s; loads of {h['objects']} objects x {h['pages_per_object']} pages through the "
            "worker, from the tier / re-hashing every page / from a store through staging, vs one memcpy:",
            f"{'page':>9} | {'tier GB/s':>9} {'ratio':>6} | {'verify GB/s':>11} {'ratio':>6} | "
            f"{'store GB/s':>10} {'ratio':>6} | {'memcpy':>7}",
        ]
        for r in h["results"]:
            lines.append(
                f"{r['page_mib']:>5g} MiB | {r['host_tier_gbps']:>9.2f} {r['host_tier_ratio_vs_memcpy']:>6.2f} | "
                f"{r['host_tier_verify_gbps']:>11.2f} {r['host_tier_verify_ratio_vs_memcpy']:>6.2f} | "
                f"{r['store_path_gbps']:>10.2f} {r['store_path_ratio_vs_memcpy']:>6.2f} | {r['memcpy_gbps']:>7.2f}"
            )
    lines.append(targets_line(res))
    return "\n".join(lines)
