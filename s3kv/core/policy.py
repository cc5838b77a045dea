"""Which blocks each layer group stores. Pure; shares its window arithmetic with the hit rule.

Saving every block of a sliding group stores the whole prompt for layers that
will only ever read a tail (Gemma-3-27B at 32k tokens: ~15.5 GiB stored vs
~2.9 GiB a hit can use). The "window" policy stores, for sliding groups, only
the in-window tails a future hit can use, ending at *hit boundaries*:

* every ``checkpoint_blocks`` (a multiple of ``blocks_per_object``, so a tail
  ends on an object boundary) -- hits for prompts that share a long prefix;
* the prompt's last full block -- exact repeats;
* the end of the request's history, staged at ``request_finished`` from the
  still-live window -- multi-turn continuations;
* a request's *branch point* (``branch_end``): where its lookup found the
  full-attention chain stored past the last servable sliding tail -- a shared
  system prompt or document followed by different questions. The request
  recomputes that prefix anyway, so it also stores the tail ending there, and
  the next request with that prefix hits it (``S3KV_BRANCH_TAILS``).

Full-attention groups store every block. The "all" policy stores every block
of every group. The tail is derived from ``hitrule.required_range`` so what is
stored and what a hit needs can never drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import Settings, auto_blocks_per_object
from .hitrule import required_range
from .layout import CacheGeometry


def object_sizes(page_bytes: Sequence[int], tokens_per_block: int, settings: Settings) -> tuple[tuple[int, ...], int]:
    """(blocks per object of each group, checkpoint stride in blocks).

    Each group packs objects of ~``target_object_mib`` from its own page size (a
    full-attention group of few layers has small pages: many blocks per object,
    so fewer PUTs and fewer HEADs per lookup). An object never spans a
    checkpoint, so a checkpoint is an object boundary a lookup can find by key:
    round the stride up to the largest count, then each count down to a divisor.
    """
    cp = max(1, settings.checkpoint_tokens // tokens_per_block)
    raw = [min(auto_blocks_per_object(p, settings), cp) for p in page_bytes]
    cp = -(-cp // max(raw)) * max(raw)
    out = []
    for b in raw:
        while cp % b:
            b -= 1
        out.append(b)
    return tuple(out), cp


def largest_object_bytes(policy: StoragePolicy) -> int:
    """The largest object any group of ``policy`` can make: a full object of its blocks, or (a
    sliding group stored by window) the one object holding a whole tail, which at long windows
    is far larger than the target size."""
    g = policy.geometry
    far = 1 << 30  # a boundary past every window: the widest tail
    out = 0
    for i, grp in enumerate(g.groups):
        blocks = policy.bpo(i)
        if not policy.stores_everything(i):
            lo, hi = policy._tail(i, far)
            blocks = max(blocks, hi - lo)
        out = max(out, blocks * grp.page_bytes)
    return out


def staging_warnings(geometry: CacheGeometry, settings: Settings, capacity: int) -> list[str]:
    """What a host staging pool of ``capacity`` bytes cannot do for this geometry (logged at
    layout registration): a save stages a whole object (a load that does not fit falls back to
    unpinned memory), and saves need a buffer per open object and group."""
    out = []
    blocks, cp = object_sizes([g.page_bytes for g in geometry.groups], geometry.tokens_per_block, settings)
    biggest = max(b * g.page_bytes for b, g in zip(blocks, geometry.groups, strict=True))
    n = max(1, geometry.num_groups)
    if capacity < 4 * biggest * n:  # with room for fewer, most saves would be dropped
        out.append(
            f"S3KV_STAGING_MIB={settings.staging_mib} holds fewer than 4 objects per layer group (largest object "
            f"{biggest / 2**20:.1f} MiB, {geometry.num_groups} groups): saves will be dropped under load; raise it "
            f"to at least {-(-4 * biggest * n // 2**20)}"
        )
    policy = StoragePolicy(geometry, max(blocks), cp, settings.storage_policy, settings.window_margin_blocks,
                           group_blocks=blocks)
    largest = largest_object_bytes(policy)
    if largest > capacity:  # a save that cannot stage its object is dropped, every time
        out.append(
            f"the largest object a layer group can make ({largest / 2**20:.1f} MiB, a sliding tail or a full "
            f"object) does not fit S3KV_STAGING_MIB={settings.staging_mib}: such objects are never saved; raise it to at least {-(-4 * largest // 2**20)} (room for 4)"
        )
    return out


@dataclass(frozen=True)
class StoragePolicy:
    geometry: CacheGeometry
    blocks_per_object: int
    checkpoint_blocks: int
    mode: str = "window"  # or "all"
    margin: int = 0
    #: Blocks per object of each group (default: ``blocks_per_object`` for all). Small pages
    #: (a full-attention group of few layers) pack more blocks per object: fewer PUTs and HEADs.
    group_blocks: tuple[int, ...] | None = None
    #: Store a sliding tail at a request's branch point (see ``branch_end``).
    branch_tails: bool = True
    _tails: dict[tuple[int, int], tuple[int, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        for b in self.group_blocks or (self.blocks_per_object,):
            if self.checkpoint_blocks % b:
                raise ValueError("checkpoint_blocks must be a multiple of every group's blocks per object")

    def bpo(self, group: int) -> int:
        return self.group_blocks[group] if self.group_blocks else self.blocks_per_object

    def tail(self, group: int, boundary: int) -> tuple[int, int]:
        """Ordinals a sliding group stores for hits at ``boundary`` and one block below it.

        One block below: a prompt of exactly k full blocks can be served only up
        to k-1 blocks (the engine never asks for the last prompt token).
        """
        # Asked for every block of every sliding group the leader plans: memoised.
        key = (group, boundary)
        hit = self._tails.get(key)
        if hit is None:
            hit = self._tails[key] = self._tail(group, boundary)
            if len(self._tails) > 65536:
                self._tails.clear()
        return hit

    def _tail(self, group: int, boundary: int) -> tuple[int, int]:
        g = self.geometry.groups[group]
        tpb = self.geometry.tokens_per_block
        lo_below, _ = required_range(g, tpb, 0, max(0, boundary - 1), self.margin)
        lo_at, _ = required_range(g, tpb, 0, boundary, self.margin)
        return min(lo_below, lo_at), boundary

    def hit_lo(self, group: int, boundary: int) -> int:
        """First ordinal a sliding group needs for a hit at ``boundary`` itself (``tail`` less the
        block below)."""
        g = self.geometry.groups[group]
        return required_range(g, self.geometry.tokens_per_block, 0, boundary, self.margin)[0]

    def stores_everything(self, group: int) -> bool:
        return self.mode == "all" or not self.geometry.groups[group].is_sliding

    def keeps(self, group: int, ordinal: int, prompt_blocks: int) -> bool:
        """Is ``ordinal`` stored when it completes (before the request's end is known)?"""
        return self.stores_everything(group) or bool(self.tail_ends(group, ordinal, prompt_blocks))

    def tail_ends(self, group: int, ordinal: int, prompt_blocks: int) -> list[int]:
        """The hit boundaries whose stored tail holds ``ordinal`` (furthest first): the prompt's end
        and the next checkpoint. The value policy may refuse some; the block then goes to the
        furthest one it keeps.

        A sliding group's tail is stored as ONE object ending at its boundary
        (not split at chunk ends): two different objects of one request must
        never end at the same block, or write-once would keep whichever came
        first -- possibly the shorter one.
        """
        out = []
        cp = self.checkpoint_blocks
        boundary = (ordinal // cp + 1) * cp
        lo, hi = self.tail(group, boundary)
        if lo <= ordinal < hi:
            out.append(boundary)
        if ordinal < prompt_blocks and prompt_blocks != boundary:
            lo, hi = self.tail(group, prompt_blocks)
            if lo <= ordinal < hi:
                out.append(prompt_blocks)
        out.sort(reverse=True)
        return out

    def tail_end(self, group: int, ordinal: int, prompt_blocks: int) -> int | None:
        """The furthest hit boundary whose stored tail holds ``ordinal`` (None: not stored)."""
        ends = self.tail_ends(group, ordinal, prompt_blocks)
        return ends[0] if ends else None

    def chunk_end(self, ordinal: int, group: int | None = None) -> int:
        b = self.blocks_per_object if group is None else self.bpo(group)
        return (ordinal // b + 1) * b

    def branch_end(self, spine_blocks: int, served_blocks: int, prompt_blocks: int) -> int | None:
        """End of the branch-point tail a request stores, or None.

        ``spine_blocks``: how far its lookup found the full-attention chain stored
        (every shard, capped at what the engine lets a hit serve); ``served_blocks``:
        what it was served. Past the served point the request recomputes a prefix
        whose full-attention pages are already stored but which no sliding tail
        can serve: the next request diverging there (a shared system prompt or
        document, then another question) misses it again. A tail ending at that
        point makes it servable. None when the policy stores every block, has no
        sliding group to serve, or already stores a tail ending there (a
        checkpoint, the prompt's end).
        """
        if not self.branch_tails or self.mode != "window" or spine_blocks <= served_blocks:
            return None
        if spine_blocks % self.checkpoint_blocks == 0 or spine_blocks >= prompt_blocks:
            return None
        if not any(g.is_sliding for g in self.geometry.groups):
            return None
        return spine_blocks
