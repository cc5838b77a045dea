"""What ``s3kv bench trace`` prints: the table and the plot of a result (``trace.run_trace``)."""

from __future__ import annotations

from typing import Any

from ..options import retention_line


def table(res: dict[str, Any]) -> str:
    from .common import header, targets_line

    t, s = res["trace"], res["sim"]
    lines = [
        f"s3kv bench trace -- {t['path']} ({t['format']}): {t['requests']} requests, "
        f"{t['prompt_tokens'] / 1e6:.2f}M prompt tokens, {t['continuations']} continuations, "
        f"{t['duration_hours'] * 60:.1f} min of traffic",
        f"model {res['model']['name']} (window {s['window']}); simulator: {s['tokens_per_block']} tokens/block, "
        f"{s['layers']}, tiny pages ({s['sim_page_bytes']['full']} B) -- objects sized and bytes/requests reported "
        f"for the real pages ({s['real_page_bytes']['full'] / 2**20:.2f} MiB full, "
        f"{s['real_page_bytes']['sliding'] / 2**20:.2f} MiB sliding); checkpoints every {s['checkpoint_tokens']} tok",
        f"engine: {s['engine']}; answers: {s['answers']} ({s['answer_tokens_not_replayed']} answer tokens not "
        "replayed, their full-attention pages added by arithmetic)",
        header(res),
        *_fleet_lines(res),
        "",
        f"ideal (every block an earlier request computed): {res['ideal_tokens'] / 1e6:.2f}M tokens = "
        f"{res['ideal_pct_of_prompt']:.1f}% of prompt tokens ({res['ideal_marginal_tokens'] / 1e6:.2f}M past the "
        f"device matches: what %ideal divides by); the trace's own hash-id reuse: "
        f"{t['reuse_by_hash_ids_tokens'] / 1e6:.2f}M",
        "",
        f"{'policy':>18} | {'served':>8} {'%prompt':>7} {'%ideal':>7} | {'stored GiB':>10} | "
        f"{'PUT/1k':>7} {'GET/1k':>7} {'HEAD/1k':>7} | {'S3 $':>7} {'GPU $':>7} {'ratio':>6} | {'GPU-s saved':>11} | "
        f"{'mism':>4}",
    ]
    for name, p in res["policies"].items():
        per = p["per_1k_prompt_tokens"]
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.3f}"
        lines.append(
            f"{name:>18} | {p['served_tokens'] / 1e6:>7.2f}M {p['served_pct_of_prompt']:>6.1f}% "
            f"{(p['served_pct_of_ideal'] or 0):>6.1f}% | "
            f"{p.get('stored_bytes_incl_unreplayed_answers', p['stored_bytes']) / 2**30:>10.1f} | "
            f"{per['put']:>7.3f} {per['get']:>7.3f} {per['head']:>7.3f} | "
            f"{p['s3_usd']:>7.3f} {p['gpu_usd_saved']:>7.3f} {ratio:>6} | "
            f"{p['gpu_seconds_saved']:>11.0f} | {p.get('kv_mismatches', '-'):>4}"
        )
    lines.append("")
    lines.append("scheduler stall per lookup (ms; the lookup's wall time, hashing included) and per token served:")
    for name, p in res["policies"].items():
        st = p.get("lookup_stall")
        if st:
            lines.append(
                f"  {name:>18}: p50 {st['p50_ms']:.2f}, p99 {st['p99_ms']:.2f}, max {st['max_ms']:.1f} ms over "
                f"{st['lookups']} lookups; {st['us_per_token_served'] or 0:.2f} us per token served; "
                + ", ".join(f"{k} {v}" for k, v in sorted(st["decisions"].items()))
            )
    lines.append("stored bytes per layer group (GiB, real page sizes):")
    for name, p in res["policies"].items():
        parts = ", ".join(f"{g} {b / 2**30:.1f}" for g, b in p["stored_bytes_by_group"].items())
        lines.append(f"  {name:>18}: {parts}")
    if "window_vs_all" in res:
        w = {k: "n/a" if v is None else f"{v:.4f}" for k, v in res["window_vs_all"].items()}  # None: nothing to divide by
        lines.append(
            f"window policy vs store-everything: served {w['served']} of its tokens "
            f"({w['served_vs_ideal']} of the ideal), stored {w['stored_bytes']} of its bytes "
            f"({w['distinct_page_bytes']} counting each page once)"
        )
    if "branch_tails" in res:
        b = res["branch_tails"]
        lines.append(
            f"branch-point tails: {b['served_tokens_added'] / 1e6:+.3f}M tokens served "
            f"({b['served_pct_points_added']:+.2f} pp of prompt tokens), {b['stored_bytes_added'] / 2**30:+.1f} GiB "
            f"stored ({b['stored_bytes_added_pct']:+.1f}%: a hit also stores less), {b['tails_stored']} tails"
        )
    for name, p in res["policies"].items():
        kinds = p.get("by_kind")
        if kinds:
            parts = ", ".join(
                f"{k} {int(d['objects'])} ({100 * d['objects_read'] / d['objects']:.0f}% read, "
                f"{d['served_tokens'] / 1e6:.2f}M served)"
                for k, d in kinds.items()
                if d["objects"]
            )
            lines.append(f"objects by kind, {name}: {parts}")
    pr, v = res["prices"], res["value"]
    lines.append(
        f"prices: PUT ${pr['put_per_1k']}/1k, GET/HEAD ${pr['get_per_1k']}/1k, storage ${pr['gb_month']}/GB-month, "
        f"kept {pr['retention_h']:g} h after the last write or refresh (+ half a {v['gc_period_s']:g} s gc period); "
        f"GPU ${v['gpu']['usd_per_hour']:g}/h at {v['gpu']['peak_tflops']:g} TFLOP/s x MFU {v['gpu']['mfu']:g}"
    )
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
    st = v["stall"]
    host = ""
    if v["gpu_usd_saved"] != v["gpu_usd_saved_s3"]:
        r3 = "-" if v["ratio_s3kv"] is None else f"{v['ratio_s3kv']:.3f}"
        host = (f"; the host tier saved ${v['gpu_usd_saved'] - v['gpu_usd_saved_s3']:.3f} more with no S3 request "
                f"(S3 $ over every tier's saving: {r3})")
    lines.append(
        f"value ({v['policy']}): S3 ${v['s3_usd']:.3f} (requests ${v['requests_usd']:.3f}, storage "
        f"${v['storage_usd']:.3f}) for ${v['gpu_usd_saved_s3']:.3f} of prefill GPU time S3 saved past the device "
        f"match, less ${v['stall_gpu_usd']:.4f} of GPU time the lookups stalled the batch beyond one decode forward "
        f"({st['hidden_ms']:g} ms, hidden by the overlap loop): ratio {ratio} (below 1: s3kv pays for itself){host}",
    )
    lines.append(
        f"inter-token latency a lookup adds to co-running requests: p50 {st['itl_added_p50_ms']:.2f} ms, "
        f"p99 {st['itl_added_p99_ms']:.2f} ms"
    )
    if v.get("retention_learnt"):
        lines.append(retention_line(v["retention_learnt"]))
    lines.append(f"took {res['seconds']:.0f} s")
    lines.append(targets_line(res))
    return "\n".join(lines)


def _fleet_lines(res: dict[str, Any]) -> list[str]:
    f = res["fleet"]
    dev = f["device_cache_tokens"]
    if not dev:
        cache = "no device prefix cache (S3 the only source of reuse)"
    else:
        cache = f"device prefix cache {dev:,} tokens per engine" + (
            f" (the default: {f['device_cache_derivation']})" if f["device_cache_default"] else " (--device-cache-tokens)"
        ) + f"; sliding pages {f['device_sliding']}"
    host = f"; host tier {f['host_cache_tokens']:,} tokens per engine" if f.get("host_cache_tokens") else "; no host tier"
    lines = [
        f"fleet: {f['clusters']} engine(s), router {f['router']} ({f['router_rule']}); {cache}{host}",
    ]
    for name, p in res["policies"].items():
        t = p.get("host_tier")
        if t:
            lines.append(
                f"  host tiers, {name}: {t['gib_per_engine']:g} GiB per engine (high water {t['high_water_gib']:g}), "
                f"{t['inserted']} objects in, {t['evicted']} evicted, {t['hits']} hits, {t['write_backs']} written "
                "to S3 at eviction"
            )
    for name, p in res["policies"].items():
        sh = p.get("tiers", {}).get("shares")
        if sh:
            lines.append(
                f"  prompt tokens served by, {name}: device {100 * sh['device']:.1f}%, host {100 * sh['host']:.1f}%, "
                f"S3 {100 * sh['s3']:.1f}%, computed {100 * sh['computed']:.1f}%"
            )
    return lines


def plot_trace(res: dict[str, Any], path: str) -> None:
    from .plot import BASELINE, RAW, S3KV, WARM, _plt, _save

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    colors = {"window": S3KV, "window-no-branch": "#9467bd", "all": RAW, "upstream-example": BASELINE, "ideal": WARM}
    ax = axes[0]
    c = res["curves"]
    x = [v / 1e6 for v in c["prompt_tokens"]]
    for name, ys in c["served"].items():
        ax.plot(x, [y / 1e6 for y in ys], label=name, color=colors.get(name), lw=1.5,
                ls="--" if name in ("ideal", "upstream-example") else "-")
    ax.set_xlabel("prompt tokens so far (M)")
    ax.set_ylabel("tokens served from S3 so far (M)")
    ax.set_title("Served over the trace")
    ax.legend(fontsize=8)

    names = list(res["policies"])
    ax = axes[1]
    groups = sorted({g for p in res["policies"].values() for g in p["stored_bytes_by_group"]})
    width = 0.8 / max(1, len(groups))
    for gi, g in enumerate(groups):
        vals = [res["policies"][n]["stored_bytes_by_group"].get(g, 0) / 2**30 for n in names]
        ax.bar([i + gi * width for i in range(len(names))], vals, width, label=g)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(names))], names, fontsize=8, rotation=15)
    ax.set_ylabel("stored (GiB, real page sizes)")
    ax.set_title("Bytes stored per layer group")
    ax.legend(fontsize=8)

    ax = axes[2]
    served = [res["policies"][n]["served_pct_of_prompt"] for n in names]
    usd = [res["policies"][n]["usd_per_trace_hour"] or 0 for n in names]
    bars = ax.bar(names, served, color=[colors.get(n, RAW) for n in names])
    for b, u in zip(bars, usd, strict=True):
        ax.annotate(f"${u:.2f}/h", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.axhline(res["ideal_pct_of_prompt"], color=WARM, ls="--", lw=1, label="ideal")
    ax.set_ylabel("prompt tokens served from S3 (%)")
    ax.set_title("Served (bars) and S3 $ per hour of trace")
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"{res['trace']['requests']} requests, {res['model']['name']}; kv_mismatches {res['kv_mismatches']}", fontsize=10
    )
    _save(fig, path)

