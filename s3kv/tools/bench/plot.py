"""Charts for ``--plot`` (matplotlib, Agg backend: no display needed).

The baseline drawn in red is what s3kv replaces: one object per block, written and read
synchronously (and, for lookups, found by one HEAD per block per layer group, in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

S3KV = "#1f77b4"
WARM = "#2ca02c"
RAW = "#7f7f7f"
#: Colour of the one-object-per-block, synchronous baseline.
BASELINE = "#d62728"


PLOT_HINT = "--plot needs matplotlib: pip install matplotlib (the plot and demo extras have it)"


def require_matplotlib() -> None:
    """Fail before a benchmark runs, not after, when ``--plot`` cannot be honoured."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError(PLOT_HINT)


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - checked up front by require_matplotlib
        raise click.ClickException(PLOT_HINT) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(res: dict[str, Any]) -> str:
    s = res.get("store", {})
    m = res.get("machine", {})
    lat = s.get("latency_ms_injected", res.get("latency_ms_injected", 0)) or 0
    where = s.get("kind", "?")
    return f"store: {where}, {lat:g} ms injected per request; machine: {m.get('cores', '?')} cores"


def _save(fig: Any, path: str, tight: bool = True) -> None:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _tok(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _bar_labels(ax: Any, bars: Any, fmt: str) -> None:
    for b in bars:
        h = b.get_height()
        if h > 0:
            ax.annotate(
                fmt.format(h),
                (b.get_x() + b.get_width() / 2, h),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )


def _headroom(ax: Any, highs: Sequence[float], lows: Sequence[float], factor: float) -> None:
    """Log axis with room above the tallest bar for its labels."""
    top = max(highs)
    bottom = min(v for v in lows if v > 0)
    ax.set_ylim(bottom / 3, top * factor)


def plot_lookup(res: dict[str, Any], path: str) -> None:
    plt = _plt()
    rows = res["results"]
    x = list(range(len(rows)))
    labels = [_tok(r["tokens"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    w = 0.27
    b1 = ax1.bar(
        [i - w for i in x], [r["latency_ms"] for r in rows], w, color=S3KV, label="s3kv cold (empty index)"
    )
    ax1.bar(x, [max(r["warm_latency_ms"], 1e-3) for r in rows], w, color=WARM, label="s3kv warm (index hit)")
    b3 = ax1.bar(
        [i + w for i in x],
        [r["sequential_latency_ms"] for r in rows],
        w,
        color=BASELINE,
        label="sequential scan: one HEAD per block per layer group, in order",
    )
    for b, r in zip(b3, rows, strict=True):
        if r["sequential_extrapolated"]:
            b.set_hatch("//")
            b.set_alpha(0.75)
    _bar_labels(ax1, b1, "{:.0f}")
    _bar_labels(ax1, b3, "{:.0f}")
    ax1.set_yscale("log")
    _headroom(
        ax1,
        [r["sequential_latency_ms"] for r in rows] + [r["latency_ms"] for r in rows],
        [max(r["warm_latency_ms"], 1e-3) for r in rows],
        8,
    )
    ax1.set_xticks(x, labels)
    ax1.set_xlabel("prompt length (tokens)")
    ax1.set_ylabel("lookup latency (ms, log scale)")
    ax1.grid(axis="y", alpha=0.3)
    ax1.set_title("Time to find the stored prefix")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    for i, r in enumerate(rows):
        ax1.annotate(
            f"{r['speedup_vs_sequential']:.0f}x",
            (i, r["sequential_latency_ms"]),
            ha="center",
            va="bottom",
            fontsize=8,
            fontweight="bold",
            xytext=(0, 12),
            textcoords="offset points",
        )
    if any(r["sequential_extrapolated"] for r in rows):
        ax1.text(
            0.99,
            0.01,
            "hatched: extrapolated from the measured first HEADs",
            transform=ax1.transAxes,
            ha="right",
            va="bottom",
            fontsize=7,
        )

    c1 = ax2.bar([i - w / 2 for i in x], [r["requests"] for r in rows], w, color=S3KV, label="s3kv HEADs")
    c2 = ax2.bar(
        [i + w / 2 for i in x],
        [r["sequential_requests"] for r in rows],
        w,
        color=BASELINE,
        label="sequential scan HEADs",
    )
    _bar_labels(ax2, c1, "{:.0f}")
    _bar_labels(ax2, c2, "{:.0f}")
    ax2.set_yscale("log")
    _headroom(ax2, [r["sequential_requests"] for r in rows] + [r["requests"] for r in rows], [1], 8)
    ax2.set_xticks(x, labels)
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("HEAD requests per lookup (log scale)")
    ax2.set_title("Requests, and s3kv round trips (waves)")
    for i, r in enumerate(rows):
        ax2.annotate(
            f"{r['round_trips']} RT",
            (i - w / 2, max(r["requests"], 1)),
            ha="center",
            va="bottom",
            fontsize=8,
            color=S3KV,
            fontweight="bold",
            xytext=(0, 12),
            textcoords="offset points",
        )
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    g = res["geometry"]
    fig.suptitle(
        f"s3kv bench lookup -- {g['model_block_structure']} block structure "
        f"({g['windows']}, {g['tokens_per_block']} tok/block, {g['blocks_per_object']} blocks/object)\n"
        + _subtitle(res),
        fontsize=10,
    )
    _save(fig, path)


def plot_transfer(res: dict[str, Any], path: str) -> None:
    plt = _plt()
    rows = res["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    labels = [f"{r['object_mib']:g} MiB" for r in rows]
    x = list(range(len(rows)))
    w = 0.27
    for ax, what in zip(axes, ("save", "load"), strict=True):
        bars = [
            ax.bar(
                [i - w for i in x],
                [r[f"{what}_mib_s"] for r in rows],
                w,
                color=S3KV,
                label=f"s3kv pipeline ({res['concurrency'][what]} threads)",
            ),
            ax.bar(
                x,
                [r[f"raw_{what}_mib_s"] for r in rows],
                w,
                color=RAW,
                label=f"raw boto3, same concurrency ({res['concurrency'][what]})",
            ),
            ax.bar(
                [i + w for i in x],
                [r[f"seed_{what}_mib_s"] for r in rows],
                w,
                color=BASELINE,
                label=f"one object per block ({res['page_mib']:g} MiB), synchronous",
            ),
        ]
        for b in bars:
            _bar_labels(ax, b, "{:.0f}")
        ax.set_xticks(x, labels)
        ax.set_xlabel("object size")
        ax.set_ylabel("throughput (MiB/s)")
        ax.set_title(
            f"{what.capitalize()}: {res[f'{what}_ratio_vs_raw']:.2f}x raw, "
            f"{res[f'{what}_speedup_vs_seed']:.1f}x one object per block"
        )
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    top = max(r[k] for r in rows for k in r if k.endswith("_mib_s"))
    axes[0].set_ylim(0, top * 1.4)  # room for the legend above the tallest bar
    fig.suptitle(
        f"s3kv bench transfer -- {res['total_mib']} MiB per object size, CPU host tensors\n" + _subtitle(res),
        fontsize=10,
    )
    _save(fig, path)


def plot_staging(res: dict[str, Any], path: str) -> None:
    plt = _plt()
    if res.get("skipped"):
        fig, ax = plt.subplots(figsize=(6, 2.5))
        ax.axis("off")
        ax.text(
            0.5,
            0.5,
            f"s3kv bench staging: skipped\n{res.get('reason', res['skipped'])}",
            ha="center",
            va="center",
            fontsize=11,
        )
        _save(fig, path, tight=False)
        return
    rows = res["results"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    labels = [f"{r['page_mib']:g} MiB" for r in rows]
    x = list(range(len(rows)))
    w = 0.2
    series = [
        ("d2h_gbps", "s3kv save copy (device->pinned)", S3KV, ""),
        ("memcpy_d2h_gbps", "one contiguous memcpy D2H", RAW, ""),
        ("h2d_gbps", "s3kv load copy (pinned->device)", WARM, ""),
        ("memcpy_h2d_gbps", "one contiguous memcpy H2D", RAW, "//"),
    ]
    for k, (key, label, color, hatch) in enumerate(series):
        b = ax.bar(
            [i + (k - 1.5) * w for i in x], [r[key] for r in rows], w, color=color, label=label, hatch=hatch
        )
        _bar_labels(ax, b, "{:.1f}")
    ax.set_xticks(x, labels)
    ax.set_xlabel(f"page size ({res['pages']} scattered pages per run)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title(
        f"s3kv bench staging on {res.get('device_name', res['device'])} ({res.get('copy_path', '?')}): "
        f"worst ratio vs memcpy of {', '.join(f'{x:g}' for x in res.get('headline_page_mib', []))} MiB pages "
        f"D2H {res['d2h_ratio_vs_memcpy']:.2f}, H2D {res['h2d_ratio_vs_memcpy']:.2f}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def _group_bytes(d: dict[str, Any]) -> dict[str, float]:
    return {k: v["bytes"] / 2**20 for k, v in sorted(d.items())}


def plot_e2e(res: dict[str, Any], path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax = axes[0]
    pol = res["policies"]["window"]
    phases = ("cold", "warm")
    x = list(range(len(phases)))
    served = [pol[p]["matched_tokens"] for p in phases]
    computed = [pol[p]["computed_tokens"] for p in phases]
    ax.bar(x, computed, 0.5, color=RAW, label="prompt tokens recomputed")
    ax.bar(x, served, 0.5, bottom=computed, color=S3KV, label="prompt tokens served from S3")
    for i, p in enumerate(phases):
        r = pol[p]
        ax.annotate(
            f"hit {r['hit_rate']:.0%}\n{r['mean_request_latency_ms']:.0f} ms/request\n"
            f"kv_mismatches {r['kv_mismatches']}",
            (i, computed[i] + served[i]),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.set_xticks(x, [f"{p} cluster" for p in phases])
    ax.set_ylabel("prompt tokens")
    ax.set_title("Multi-turn VSWA workload (window policy)")
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.25)

    ax = axes[1]
    win = _group_bytes(res["stored_bytes_by_group"]["window"])
    allp = _group_bytes(res["stored_bytes_by_group"]["all"])
    groups = sorted(set(win) | set(allp))
    x = list(range(len(groups)))
    b1 = ax.bar(
        [i - 0.2 for i in x], [win.get(g, 0) for g in groups], 0.4, color=S3KV, label="policy: window"
    )
    b2 = ax.bar([i + 0.2 for i in x], [allp.get(g, 0) for g in groups], 0.4, color=RAW, label="policy: all")
    _bar_labels(ax, b1, "{:.1f}")
    _bar_labels(ax, b2, "{:.1f}")
    ax.set_xticks(x, groups, fontsize=8)
    ax.set_ylabel("stored (MiB)")
    ax.set_title(f"Stored bytes per layer group: window/all = {res['stored_ratio_window_vs_all']:.2f}")
    ax.legend(fontsize=8)

    ax = axes[2]
    soak = res["memory"]
    samples: Sequence[float] = soak["rss_mib_samples"]
    rounds = list(range(1, len(samples) + 1))
    ax.plot(rounds, samples, "o-", color=S3KV, label="process RSS (MiB)")
    ax.set_xlabel(f"soak round ({soak['requests_per_round']} requests each)")
    ax.set_ylabel("RSS (MiB)")
    lo, hi = min(samples), max(samples)
    ax.set_ylim(max(0, lo - max(50, 0.1 * lo)), hi + max(100, 0.25 * hi))
    ax2 = ax.twinx()
    ax2.plot(
        rounds,
        [b / 2**20 for b in soak["staging_in_use_samples_bytes"]],
        "s--",
        color=BASELINE,
        label="staging in use after round (MiB)",
    )
    ax2.axhline(
        soak["staging_high_water_bytes"] / 2**20,
        color=BASELINE,
        alpha=0.4,
        linestyle=":",
        label="staging high water (MiB)",
    )
    ax2.set_ylabel("staging (MiB)")
    ax2.set_ylim(0, max(1.0, soak["staging_capacity_bytes"] / 2**20))
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Memory over a long run: RSS {soak['rss_mib_start']:.0f} -> {soak['rss_mib_end']:.0f} MiB")
    fig.suptitle(
        "s3kv bench e2e -- cold cluster then warm cluster on one store\n" + _subtitle(res), fontsize=10
    )
    _save(fig, path)
