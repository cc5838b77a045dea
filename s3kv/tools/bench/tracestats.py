"""What a request trace's reuse looks like: the figures that decide whether a cache pays on it.

One function, :func:`describe`, characterises any trace in the Mooncake format (the public one,
a generated one from :mod:`s3kv.tools.bench.gentrace`, or a user's own): ``s3kv bench
describe-trace FILE`` prints it, and ``s3kv bench gen-trace`` prints it for what it wrote, so a
generated workload and a real one are measured by the same code.

Definitions (over hash blocks, 512 tokens in the Mooncake format; a hash id names a block *and*
the whole prefix before it):

* **re-read fraction**: of the distinct hash ids in the trace, the share that more than one
  request's prompt holds -- blocks a prefix cache could ever serve;
* **reuse gap**: each time a request's prompt holds a hash id some earlier request held, the time
  since the latest such request (its arrival to this one's); percentiles over those reuses,
  block by block (a long shared prefix counts once per block, as the bytes it keeps do);
* **reusable tokens**: per request, the leading blocks an earlier request already had, one token
  short of the prompt (``tracefile.trace_reuse_tokens``: the ideal a cache of everything serves).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .common import pct
from .tracefile import TraceRequest, duration_hours, find_continuations, trace_reuse_tokens

#: Reuse-gap percentiles reported.
GAP_PERCENTILES = (50, 90, 99)


def describe(reqs: Sequence[TraceRequest], block_tokens: int) -> dict[str, Any]:
    """The trace's size and reuse (module doc). ``reqs`` in arrival order."""
    holders: dict[int, int] = {}  # hash id -> requests holding it
    last_seen: dict[int, float] = {}  # hash id -> arrival (ms) of the latest request holding it
    gaps: list[float] = []
    for r in reqs:
        for h in r.hash_ids:
            prev = last_seen.get(h)
            if prev is not None:
                gaps.append((r.timestamp_ms - prev) / 1000)
            last_seen[h] = r.timestamp_ms
            holders[h] = holders.get(h, 0) + 1
    distinct = len(holders)
    reread = sum(1 for n in holders.values() if n > 1)
    prompt_tokens = sum(r.input_length for r in reqs)
    inputs = [r.input_length for r in reqs]
    outputs = [r.output_length for r in reqs]
    reusable = sum(trace_reuse_tokens(reqs, block_tokens))
    return {
        "requests": len(reqs),
        "duration_min": round(duration_hours(reqs) * 60, 2),
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(outputs),
        "input_p50": pct(inputs, 0.5),
        "input_p99": pct(inputs, 0.99),
        "output_p50": pct(outputs, 0.5),
        "continuations": len(find_continuations(reqs, block_tokens)),
        "distinct_blocks": distinct,
        "reread_blocks": reread,
        "reread_fraction": round(reread / distinct, 4) if distinct else 0.0,
        "block_reuses": len(gaps),
        **{f"gap_p{q}_s": None if not gaps else round(pct(gaps, q / 100), 1) for q in GAP_PERCENTILES},
        "reusable_tokens": reusable,
        "reusable_pct_of_prompt": round(100 * reusable / prompt_tokens, 2) if prompt_tokens else 0.0,
    }


def _gap(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def describe_line(d: dict[str, Any]) -> str:
    """One line: the figures a reader compares traces by."""
    return (
        f"{d['requests']} requests over {d['duration_min']:.1f} min, {d['prompt_tokens'] / 1e6:.2f}M prompt tokens "
        f"(p50 {d['input_p50']}, p99 {d['input_p99']}), {d['continuations']} next turns; "
        f"{100 * d['reread_fraction']:.1f}% of {d['distinct_blocks']} distinct prefix blocks re-read; reuse gap "
        f"p50 {_gap(d['gap_p50_s'])}, p90 {_gap(d['gap_p90_s'])}, p99 {_gap(d['gap_p99_s'])}; "
        f"{d['reusable_pct_of_prompt']:.1f}% of prompt tokens reusable"
    )
