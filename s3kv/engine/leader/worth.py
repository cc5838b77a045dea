"""Never slower than recompute: how much of a hit is worth loading, from each tier's measured speed.

A hit replaces the prefill of its tokens (``prefill_tokens_per_s``: the package's one figure).
Loading it costs, per rank (each loads its own shard, in parallel), the bytes its plan copies:
every page of ``[d, h)`` of a full-attention group, the in-window tail of a sliding one. Pages in
the host tier load at its speed, the rest at the store's; the two run side by side, so the load
takes as long as the slower of them (``TierSpeed.load_s``: a latency plus bytes over bandwidth,
as the workers measured them; a tier not measured yet is taken as instant -- no hit is refused
on a guess).

Two loads are weighed: the whole hit ``h``, and the longest point ``h' <= h`` that the host tier
alone serves (a prefix in host memory, the rest only in the store; the lookup finds it with the
tier's answers only, no request). The one that saves the most
time wins; when neither beats recomputing, the lookup is a miss (users of every peer report
remote hits slower than the prefill they replace: LMCache #1938, SGLang #26305). Linear prefill
time is the conservative side: attention makes a long prefix cost more per token than this.

Only where lookups follow the value (``S3KV_LOOKUP_TIMEOUT_S`` -1, the default: their time budget
is a share of the prefill the hit saves); a fixed budget, or none, weighs no hit either.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

from ...core.hitrule import Coverage, required_range
from ...core.layout import CacheGeometry
from ...core.lookup import Ask


@dataclass(frozen=True)
class Weighed:
    """What a candidate hit costs and saves (seconds), and the bytes per rank each tier loads."""

    h_blocks: int
    host_bytes: int
    store_bytes: int
    load_s: float
    recompute_s: float

    @property
    def saves_s(self) -> float:
        return self.recompute_s - self.load_s


def _split_bytes(g: CacheGeometry, coverage: Coverage, host: Set[Ask], d: int, h: int, margin: int) -> tuple[int, int]:
    """(bytes from the host tier, bytes from the store) one rank loads to serve ``h`` on ``d``:
    each needed page from the smallest object (shard 0's) covering it, as the load plan picks."""
    tpb = g.tokens_per_block
    host_b = store_b = 0
    for grp in g.groups:
        lo, hi = required_range(grp, tpb, d, h, margin)
        if hi <= lo:
            continue
        # Each page from the object of smallest end covering it. One pass over the spans sorted
        # by end (ends ascend as ``o`` does), not a scan of all of them per object: a 128k-token
        # hit has hundreds of objects, and this runs twice per lookup on the scheduler's thread.
        spans = sorted(coverage.get((grp.group_id, 0), {}).items())
        i, n = 0, len(spans)
        o = lo
        while o < hi:
            while i < n and spans[i][1].end <= o:  # ``o`` only grows: these never cover it again
                i += 1
            j = i
            while j < n and spans[j][1].first > o:  # starts past ``o`` (a tail): may cover a later one
                j += 1
            if j == n:  # not covered: the hit rule would not have offered it
                break
            end, span = spans[j]
            upto = min(span.end, hi)
            nbytes = (upto - o) * grp.page_bytes
            if (grp.group_id, 0, end) in host:
                host_b += nbytes
            else:
                store_b += nbytes
            o = upto
    return host_b, store_b


def weigh(g: CacheGeometry, coverage: Coverage, host: Set[Ask], d: int, h: int, margin: int, speeds: Mapping,
          prefill_tokens_per_s: float) -> Weighed:
    host_b, store_b = _split_bytes(g, coverage, host, d, h, margin)
    load = max(speeds["host"].load_s(host_b), speeds["s3"].load_s(store_b))
    return Weighed(h, host_b, store_b, load, (h - d) * g.tokens_per_block / prefill_tokens_per_s)


def worth_loading(g: CacheGeometry, coverage: Coverage, host: Set[Ask], d: int, h: int, margin: int,
                  speeds: Mapping, prefill_tokens_per_s: float, host_h: int | None = None,
                  whole: Weighed | None = None) -> Weighed:
    """The candidate to load (``h_blocks == d``: none beats recomputing): the whole hit ``h`` or
    ``host_h``, the longest point the host tier alone serves (its objects in ``coverage``),
    whichever saves the most time. ``whole``: ``h`` already weighed on this coverage (the
    caller's; not weighed again on the scheduler's thread)."""
    best = whole if whole is not None else weigh(g, coverage, host, d, h, margin, speeds, prefill_tokens_per_s)
    if host_h is not None and d < host_h < h:
        cand = weigh(g, coverage, host, d, host_h, margin, speeds, prefill_tokens_per_s)
        if cand.saves_s > best.saves_s:
            best = cand
    if best.saves_s <= 0:
        return Weighed(d, 0, 0, 0.0, 0.0)
    return best
