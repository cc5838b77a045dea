"""The window-aware hit rule. Pure functions over block ordinals; no I/O.

Why this is sound (DESIGN.md): a page's *content* is a function of the token
prefix up to its block, for every group, sliding or not, so a chained key names
it exactly. Only a page's *presence* depends on the window. To serve history
``h`` on top of a device match ``d`` the engine gives real pages to:

* a full-attention group: every ordinal in ``[d/tpb, h/tpb)``;
* a sliding group with window ``W``: ordinals ``>= (h + 1 - W) // tpb`` (no sinks),
  so only the in-window tail ``[max(d/tpb, (h+1-W)//tpb), h/tpb)`` needs bytes.

Every tensor-parallel shard needs all of the above. This is what lets an exact
repeat or a multi-turn extension hit its whole history although the sliding
groups stored only a tail -- where the upstream example's "every group holds
every block" rule can never serve more than the smallest window.

``margin`` asks sliding groups for extra blocks below the window, for engines
that retain more than ``W`` (speculative decoding adds lookahead). The worker
checks the real allocation against the plan either way (``PlanMismatch``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .layout import CacheGeometry, GroupGeometry


def window_cut(tokens: int, window: int, tokens_per_block: int) -> int:
    """The page rule on a history of ``tokens``: ordinals below it have left a sliding window
    (negative while none has)."""
    return (tokens + 1 - window) // tokens_per_block


def sliding_lo(window: int, tokens_per_block: int, h_blocks: int) -> int:
    """First ordinal the engine gives a real page to, for history ``h_blocks`` blocks."""
    return max(0, window_cut(h_blocks * tokens_per_block, window, tokens_per_block))


def required_range(group: GroupGeometry, tokens_per_block: int, d_blocks: int, h_blocks: int, margin: int = 0):
    """Ordinals ``[lo, hi)`` group must supply to serve ``h_blocks`` on top of ``d_blocks``."""
    hi = h_blocks
    if group.window is None:
        lo = d_blocks
    else:
        lo = max(d_blocks, sliding_lo(group.window, tokens_per_block, h_blocks) - margin)
    return min(lo, hi), hi


class Span(NamedTuple):
    """Block ordinals ``[first, end)`` an object holds. A tuple, not a dataclass: a 128k-token
    lookup makes and sorts hundreds of these on the scheduler's thread, and a tuple is made and
    compared in C (sorted by ``(first, end)`` without a key function)."""

    first: int
    end: int


def covers(spans: Iterable[Span], lo: int, hi: int) -> bool:
    """Does the union of ``spans`` cover every ordinal in ``[lo, hi)``?"""
    if lo >= hi:
        return True
    pos = lo
    # In (first, end) order: of spans starting alike, the longest comes last and wins.
    for first, end in sorted(spans):
        if first > pos:
            break
        if end > pos:
            pos = end
            if pos >= hi:
                return True
    return pos >= hi


#: Coverage found by a lookup: (group, shard) -> {end ordinal of an object: its span}
Coverage = Mapping[tuple[int, int], Mapping[int, Span]]


def servable(
    geometry: CacheGeometry, coverage: Coverage, d_blocks: int, h_blocks: int, margin: int = 0
) -> bool:
    """True if every group on every shard holds what serving ``h_blocks`` needs.

    ``coverage`` must only hold objects keyed by this request's own chain (an
    object ending past ``h`` is fine then: its first pages are the same prefix).
    """
    if h_blocks <= d_blocks:
        return False
    for g in geometry.groups:
        lo, hi = required_range(g, geometry.tokens_per_block, d_blocks, h_blocks, margin)
        for shard in range(geometry.tp_size):
            spans = coverage.get((g.group_id, shard), {}).values()
            if not covers(spans, lo, hi):
                return False
    return True


def object_ends_needed(lo: int, hi: int, blocks_per_object: int) -> list[int]:
    """End ordinals of the objects that would cover ``[lo, hi)``: chunk ends inside, then ``hi``."""
    if lo >= hi:
        return []
    first_chunk_end = (lo // blocks_per_object + 1) * blocks_per_object
    ends = list(range(first_chunk_end, hi, blocks_per_object))
    ends.append(hi)
    return ends
