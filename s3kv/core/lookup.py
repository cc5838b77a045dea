"""Finding the largest servable prefix in few round trips. Pure logic over a probe callback.

Objects hold runs of blocks inside aligned runs of ``bpo`` ("chunks"), named by the
chain digest of their last block, so "does an object end at ordinal e" is one HEAD. A
full-attention group stores every block, so its objects alone say how long the
stored prefix is; that group is the *spine*. Three waves of parallel HEADs:

1. **probe** the spine (shard 0) at chunk ends -- all of them when there are at
   most ``budget``, else ``budget`` evenly strided ones -- plus the prompt's own
   last full block (a previous request's prompt-end snapshot), and, when they are
   few, the block ends before the first chunk end;
2. **fill in** the gap after the highest probe that has every lower probe
   present: its chunk ends and every block end in between (a previous turn's
   history ended mid-chunk) -- when the gap is short, with the verify wave's asks
   for whichever end it may find;
3. **verify** every group x shard the hit rule needs for the best candidate and
   for a few fallbacks (the checkpoints just below it), since sliding groups
   hold only tails at checkpoint, prompt-end and history-end boundaries.

So a cold miss usually costs one round trip and a hit two (a next turn's hit, too); a hit of a
prompt stored whole one, since the probe wave also carries its verify asks when they are few.
A hole found by the verify wave (an object deleted from the middle) costs one
more wave for the candidates below the hole; otherwise the answer is final.
Probes answered by the local index cost no round trip.

**Objects that start inside a chunk** (``Span.first`` not a chunk start): a writer that found the
chain stored up to a point inside a chunk writes only what follows it (a prompt-end snapshot, then
the rest of its chunk; a next turn, after the history it loaded) rather than the chunk again from
its start. Such an object names where the one below it ends, so a wave that finds it asks for that
end next (``_MAX_HOPS`` waves at most; the fleet index answers them with no request), and the verify
wave asks every shard and full-attention group for the same ends as the spine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat

from .hitrule import Coverage, Span, object_ends_needed, required_range, servable
from .layout import CacheGeometry

#: (group, shard, end ordinal of the object)
Ask = tuple[int, int, int]
#: One wave: answers every ask with the object's span, or None (missing, failed or foreign).
Prober = Callable[[set[Ask]], dict[Ask, Span | None]]


@dataclass(frozen=True)
class LookupParams:
    blocks_per_object: int
    checkpoint_blocks: int
    margin: int = 0
    budget: int = 128
    fallbacks: int = 2
    #: Blocks per object of each group; ``blocks_per_object`` is the spine's (and the default).
    group_blocks: tuple[int, ...] | None = None

    def bpo(self, group: int) -> int:
        return self.group_blocks[group] if self.group_blocks else self.blocks_per_object


@dataclass
class LookupResult:
    h_blocks: int
    #: (group, shard) -> {end: span} of every object seen present.
    coverage: dict[tuple[int, int], dict[int, Span]] = field(default_factory=dict)
    waves: int = 0
    asks: int = 0
    #: How far (blocks) the full-attention chain was seen stored, contiguous from the device
    #: match on every shard, capped at hmax (the device match when not looked at, or when
    #: no group has full attention). Past ``h_blocks`` it marks a branch point: the prefix is
    #: stored but no sliding tail ends there (see ``StoragePolicy.branch_end``).
    spine_blocks: int = 0


#: At most this many block ends before the first chunk end ride in the first wave, and no more
#: than it probes (the first wave at most doubles). Why a bound: the gap is one object's blocks
#: less one (11 for Gemma-3-27B at TP 1), cheap beside a long prompt's probe wave; but small pages
#: pack many blocks per object (96 at TP 8), and a short prompt probes a few chunk ends only:
#: asking that many more HEADs of every lookup, hit or miss, would cost more than the round trip
#: a cold miss saves. The same bound lets the fill-in wave carry the verify wave's asks.
_EARLY_GAP = 16


#: Waves spent following objects that start inside a chunk down to the one below (module doc).
_MAX_HOPS = 4


#: At most this many verify asks ride in the first wave (see ``find_hit``): about the sliding
#: tails of a hit and its two checkpoint fallbacks for a few layer groups and shards.
_SPECULATIVE_VERIFY = 24


def stall_budget_s(saveable_tokens: int, prefill_tokens_per_s: float, fraction: float, cap_s: float) -> float:
    """How long one lookup may stall the scheduler: ``fraction`` of the prefill time its best
    possible hit would save (``saveable_tokens`` at ``prefill_tokens_per_s``), at most ``cap_s``.

    Why value, not a fixed time: the lookup holds the whole batch for its wall time, while a miss
    costs that request's prefill. Waiting 100 ms to skip the ~2 s prefill of a 16k-token prompt
    is a good trade; waiting 50 ms to skip 200 tokens is not. The cap bounds what a hung store
    can cost any one lookup, however long the prompt.
    """
    if saveable_tokens <= 0 or prefill_tokens_per_s <= 0:
        return 0.0
    return max(0.0, min(cap_s, fraction * saveable_tokens / prefill_tokens_per_s))


def _strided(ends: list[int], budget: int) -> list[int]:
    if len(ends) <= budget:
        return list(ends)
    step = len(ends) / budget
    picked = {ends[min(len(ends) - 1, int(i * step))] for i in range(budget)}
    picked.add(ends[-1])
    return sorted(picked)


def find_hit(
    geometry: CacheGeometry,
    params: LookupParams,
    d_blocks: int,
    full_blocks: int,
    hmax_blocks: int,
    probe: Prober,
    *,
    count_wave: Callable[[set[Ask]], bool] | None = None,
) -> LookupResult:
    """Largest ``h`` (blocks) with ``d < h <= hmax`` servable from the store, or ``d`` (no hit).

    ``full_blocks`` is how many full blocks the prompt has (objects may end
    there); ``hmax_blocks`` the most the engine lets us serve (< prompt length).
    ``count_wave(asks)`` says whether a wave went to the network (the index may
    answer it all); defaults to "every non-empty wave counts".
    """
    spine = geometry.spine_group
    bpo = params.bpo(spine)
    result = LookupResult(h_blocks=d_blocks, spine_blocks=d_blocks)
    if hmax_blocks <= d_blocks:
        return result
    known: dict[Ask, Span | None] = {}

    def run(asks: Iterable[Ask]) -> None:
        todo = set(asks).difference(known)
        if not todo:
            return
        answers = probe(todo)
        if count_wave is None or count_wave(todo):
            result.waves += 1
        result.asks += len(todo)
        coverage = result.coverage
        for a in todo:
            span = answers.get(a)
            known[a] = span
            if span is not None:
                grp, shard, end = a
                by_end = coverage.get((grp, shard))
                if by_end is None:
                    by_end = coverage[(grp, shard)] = {}
                by_end[end] = span

    def found(end: int, shard: int = 0, group: int = spine) -> bool:
        return known.get((group, shard, end)) is not None

    def inside_ends(lo: int, hi: int) -> list[int]:
        """Where the spine's objects found start inside a chunk within ``(lo, hi)``: the ends of
        the objects below them, on every shard and full-attention group alike (each writer splits
        all of them at the same blocks)."""
        return [sp.first for sp in result.coverage.get((spine, 0), {}).values() if lo < sp.first < hi and sp.first % bpo]

    def follow() -> None:
        """Ask for the object below each spine object found that starts inside a chunk (module doc)."""
        if geometry.groups[spine].is_sliding:
            return
        for _ in range(_MAX_HOPS):
            below = {(spine, 0, e) for e in inside_ends(d_blocks, top + 1)} - known.keys()
            if not below:
                return
            run(below)

    # Objects may end anywhere up to the prompt's last full block. For a
    # block-aligned prompt that is hmax + 1: its own prompt-end object is the
    # only one covering the last servable blocks, so it must be probed too.
    top = full_blocks
    chunk_ends = [e for e in range((d_blocks // bpo + 1) * bpo, top + 1, bpo)]
    if not chunk_ends or chunk_ends[-1] != top:
        chunk_ends.append(top)

    def candidates(upper: int) -> list[int]:
        cands = [upper] if upper > d_blocks else []
        cp = params.checkpoint_blocks
        c = (upper - 1) // cp * cp if upper > 0 else 0
        while c > d_blocks and len(cands) < 1 + params.fallbacks:
            cands.append(c)
            c -= cp
        return cands

    def needed(h: int) -> set[Ask]:
        asks: set[Ask] = set()
        for g in geometry.groups:
            lo, hi = required_range(g, geometry.tokens_per_block, d_blocks, h, params.margin)
            gb = params.bpo(g.group_id)
            ends = object_ends_needed(lo, hi, gb)
            if g.window is None and ends:
                ends += inside_ends(lo, hi)
            if ends and hi < top:
                # An object ending a little past h covers it too: the prompt-end
                # snapshot, or the chunk that h falls inside.
                ends += [top, min(top, (hi // gb + 1) * gb)]
            for shard in range(geometry.tp_size):
                # The tuples are made in C (a 128k-token prompt needs ~350 asks per candidate).
                asks.update(zip(repeat(g.group_id), repeat(shard), ends))
        return asks

    # Wave 1: strided probe of the spine. With it, when they are few, the block ends before the
    # first chunk end (what wave 2 would fill in if that probe is missing): without them every
    # cold miss of a long prompt paid a second round trip to learn that no shorter prompt
    # ended there (a replay of the Mooncake trace: 354 of 600 lookups).
    probes = _strided(chunk_ends, params.budget)
    first_gap = range(d_blocks + 1, min(chunk_ends[0], top + 1))
    early = first_gap if len(first_gap) <= min(_EARLY_GAP, len(probes)) else range(0)
    wave1 = {*((spine, 0, e) for e in probes), *((spine, 0, e) for e in early)}
    # With it, when they are few, the verify asks of the longest hit and its checkpoint fallbacks
    # (the sliding tails, the other shards): a cold hit of a prompt stored whole -- a repeat, a
    # cluster serving what another computed -- then takes one round trip instead of two, and a
    # checkpoint hit's verify wave is mostly answered already. Why a bound: on a miss these HEADs
    # buy nothing (``s3kv bench trace`` counts the HEADs; the demo's warm cluster: +2%).
    if not geometry.groups[spine].is_sliding:
        spec: set[Ask] = set()
        for h in candidates(hmax_blocks):
            spec |= needed(h) - wave1
            if len(spec) > _SPECULATIVE_VERIFY:  # only grows: a long prompt stops building it here
                break
        else:
            wave1 |= spec
    run(wave1)
    follow()

    # The highest probe below which every probe was found (the spine stores
    # every block, so presence is a prefix until proven otherwise).
    low = d_blocks
    nxt = None
    for e in probes:
        if found(e):
            low = e
        else:
            nxt = e
            break
    upper = nxt if nxt is not None else top + 1
    if low < top:
        # Wave 2: fill in every block end in (low, upper) -- chunk ends and
        # mid-chunk ends (a previous prompt or conversation ended there).
        fill = range(low + 1, min(upper, top + 1))
        filling = {(spine, 0, e) for e in fill}
        if len(fill) <= _EARLY_GAP and low > d_blocks and not geometry.groups[spine].is_sliding:
            # With it, when the gap is short, what the verify wave would ask for whichever end
            # the fill-in finds (mostly the same sliding tails): a hit that ends mid-chunk -- a
            # conversation's next turn, the common hit -- then takes two round trips, not three.
            for end in {low, *fill}:
                for h in candidates(min(end, hmax_blocks)):
                    filling |= needed(h)
        run(filling)
        follow()

    spine_ends = sorted(e for (g, s, e), v in known.items() if g == spine and s == 0 and v is not None)
    if geometry.groups[spine].is_sliding:
        # No full-attention group: the spine holds tails only, so its highest
        # object end is the candidate and the verify wave decides.
        best = max(spine_ends, default=d_blocks)
    else:
        # Unprobed chunk ends between strided probes are assumed present here;
        # the verify wave checks every one of them.
        best = max([low] + [e for e in spine_ends if low < e < upper])
    best = min(best, hmax_blocks)

    tried: set[int] = set()
    for _attempt in range(2):
        cands = [h for h in candidates(best) if h not in tried]
        if not cands:
            break
        wave: set[Ask] = set()
        for h in cands:
            wave |= needed(h)
        run(wave)  # Wave 3 (and at most one more after a hole).
        tried.update(cands)
        for h in cands:
            if servable(geometry, result.coverage, d_blocks, h, params.margin):
                result.h_blocks = h
                return _with_spine(result, geometry, d_blocks, hmax_blocks)
        # A hole: fall back to what is contiguous on every shard of the spine.
        hole_best = min(
            contiguous_end(result.coverage.get((spine, s), {}), d_blocks) for s in range(geometry.tp_size)
        )
        hole_best = min(hole_best, hmax_blocks)
        if hole_best >= best or hole_best <= d_blocks:
            # Contiguous spine but a sliding tail is missing: try lower checkpoints.
            best = max(d_blocks, (best - 1) // params.checkpoint_blocks * params.checkpoint_blocks)
        else:
            best = hole_best
        if best <= d_blocks:
            break
    # No candidate tried was servable; what the waves saw may still serve a shorter hit, at no
    # cost: the ends of the objects seen present, highest first (at most _EARLY_GAP checks, no
    # wave). Why: asks that rode in an earlier wave make a spine look whole where a hole of
    # unasked objects used to send the fallback to a lower end that was servable.
    seen = sorted({e for by_end in result.coverage.values() for e in by_end if d_blocks < e <= hmax_blocks},
                  reverse=True)
    for h in seen[:_EARLY_GAP]:
        if servable(geometry, result.coverage, d_blocks, h, params.margin):
            result.h_blocks = h
            break
    return _with_spine(result, geometry, d_blocks, hmax_blocks)


def _with_spine(result: LookupResult, geometry: CacheGeometry, d_blocks: int, hmax_blocks: int) -> LookupResult:
    """Fill ``result.spine_blocks`` from the full-attention spans the waves saw."""
    if not geometry.groups[geometry.spine_group].is_sliding:
        result.spine_blocks = spine_end(geometry, result.coverage, d_blocks, hmax_blocks)
    return result


def spine_end(geometry: CacheGeometry, coverage: Coverage, d_blocks: int, hmax_blocks: int) -> int:
    """How far from ``d_blocks`` (at most ``hmax_blocks``) ``coverage`` holds the full-attention
    spine on every shard without a gap."""
    spine = geometry.spine_group
    end = min(contiguous_end(coverage.get((spine, s), {}), d_blocks) for s in range(geometry.tp_size))
    return max(d_blocks, min(end, hmax_blocks))


def contiguous_end(spans_by_end: Mapping[int, Span], d_blocks: int) -> int:
    """How far from ``d_blocks`` the spans cover without a gap."""
    pos = d_blocks
    for first, end in sorted(spans_by_end.values()):
        if first > pos:
            break
        if end > pos:
            pos = end
    return pos
