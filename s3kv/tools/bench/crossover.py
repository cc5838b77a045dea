"""Where a hit starts to beat recomputing it, per tier: the "never slower than recompute" rule.

Part of ``s3kv bench transfer`` (the ``worth`` section). For hits of a real model's geometry
(``--model``; one rank's shard at TP 1), it weighs what the leader weighs before it offers a hit
(``s3kv/engine/leader/worth.py``, the same function): the bytes the load copies -- every block
of a full-attention group, the in-window tail of a sliding one -- at each tier's speed as
measured on this machine, against recomputing the tokens at ``prefill_tokens_per_s`` (the
package's one prefill figure).

* host tier: its copy bandwidth to the KV cache's device (``s3kv.transfer.tiers.calibrate``:
  host->GPU on a GPU machine, a host memcpy elsewhere);
* S3: the store's round trip (a HEAD of a key that does not exist, median of a few) and
  s3kv's load throughput the transfer bench just measured.

``ratio`` = recompute seconds / load seconds: above 1 the hit is worth loading. ``crossover_tokens``:
the smallest hit (powers of two from one block) worth loading from that tier.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from ...core.hitrule import Span
from ...engine.leader.worth import weigh
from ...store.memory import MemoryStore
from ...transfer.hosttier import HostTier
from ...transfer.tiers import TierSpeed, calibrate
from ..sizing import geometry_of
from .common import ModelSpec, rnd

HIT_TOKENS = (256, 1024, 4096, 16384, 65536, 131072)


def store_round_trip_s(store: Any, n: int = 5) -> float:
    """Median seconds of a HEAD of a key that does not exist: the store's round trip."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        store.head_many([f"s3kv-bench/crossover/none-{i}"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_speed(device: str) -> TierSpeed:
    """The host tier's copy bandwidth to ``device`` (a small tier, measured as the worker does)."""
    tier = HostTier(MemoryStore(), 64 << 20, pinned=device.startswith("cuda"))
    try:
        import torch

        bw = calibrate(tier, torch.device(device), 32 << 20)
    finally:
        tier.close()
    speed = TierSpeed()
    speed.set_bandwidth(bw if bw > 0 else float("inf"))
    return speed


def crossover(
    model: ModelSpec, tokens_per_block: int, prefill_tokens_per_s: float, speeds: dict[str, TierSpeed],
    hits: Sequence[int] = HIT_TOKENS,
) -> dict[str, Any]:
    g = geometry_of(model, tokens_per_block, 1)  # one rank at TP 1

    def weighed(tokens: int, tier: str) -> Any:
        h = max(1, tokens // tokens_per_block)
        cov = {(grp.group_id, 0): {h: Span(0, h)} for grp in g.groups}
        host = {(grp.group_id, 0, h) for grp in g.groups} if tier == "host" else set()
        return weigh(g, cov, host, 0, h, 0, speeds, prefill_tokens_per_s)

    rows = []
    for t in hits:
        row: dict[str, Any] = {"hit_tokens": t}
        for tier in ("host", "s3"):
            w = weighed(t, tier)
            row[f"{tier}_load_ms"] = rnd(w.load_s * 1e3, 3)
            row[f"{tier}_ratio"] = rnd(w.recompute_s / w.load_s, 2) if w.load_s > 0 else None
            row["bytes"] = w.host_bytes + w.store_bytes
        row["recompute_ms"] = rnd(t / prefill_tokens_per_s * 1e3, 3)
        rows.append(row)
    cross: dict[str, int | None] = {}
    for tier in ("host", "s3"):
        t, cross[tier] = tokens_per_block, None
        while t <= 1 << 20:
            if weighed(t, tier).saves_s > 0:
                cross[tier] = t
                break
            t *= 2
    return {
        "model": model.name,
        "tokens_per_block": tokens_per_block,
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "host_gb_s": rnd(speeds["host"].bytes_per_s / 1e9, 2),
        "s3_gb_s": rnd(speeds["s3"].bytes_per_s / 1e9, 3),
        "s3_latency_ms": rnd(speeds["s3"].latency_s * 1e3, 2),
        "crossover_tokens": cross,
        "rows": rows,
    }


def table(w: dict[str, Any]) -> list[str]:
    c = w["crossover_tokens"]

    def at(x: int | None) -> str:
        return "never (up to 1M tokens)" if x is None else f"{x} tokens"

    lines = [
        f"worth loading ({w['model']}, one rank at TP 1, {w['tokens_per_block']}-token blocks, recompute at "
        f"{w['prefill_tokens_per_s']:g} tokens/s): host tier {w['host_gb_s']:g} GB/s; S3 {w['s3_gb_s']:g} GB/s "
        f"+ {w['s3_latency_ms']:g} ms a round trip",
        f"{'hit tokens':>10} | {'MiB':>8} | {'recompute ms':>12} | {'host ms':>8} {'ratio':>7} | {'S3 ms':>8} {'ratio':>7}",
    ]
    for r in w["rows"]:
        lines.append(
            f"{r['hit_tokens']:>10} | {r['bytes'] / 2**20:>8.1f} | {r['recompute_ms']:>12.1f} | "
            f"{r['host_load_ms']:>8.2f} {r['host_ratio'] or 0:>7.1f} | {r['s3_load_ms']:>8.2f} {r['s3_ratio'] or 0:>7.2f}"
        )
    lines.append(f"a hit beats recomputing it from {at(c['host'])} in the host tier, {at(c['s3'])} from S3 "
                 "(ratio = recompute / load; the leader takes only hits above 1)")
    return lines
