"""The window-aware hit rule (s3kv/core/hitrule.py), checked against the engine's page rule."""

from __future__ import annotations

import pytest

from s3kv.core.hitrule import Span, covers, object_ends_needed, required_range, servable, sliding_lo
from s3kv.core.layout import CacheGeometry, GroupGeometry

SLIDING = GroupGeometry(0, 64, (0, 1), (100,))
FULL = GroupGeometry(1, None, (2,), (100,))


def geo(tp: int = 1, tpb: int = 32, groups=(SLIDING, FULL)) -> CacheGeometry:
    return CacheGeometry(tokens_per_block=tpb, groups=tuple(groups), tp_size=tp, kv_dtype="bf16", model_id="m")


def engine_real_ordinals(window: int, tpb: int, h_tokens: int, alloc_blocks: int) -> set[int]:
    """The API doc's page rule, no sinks: ordinals < (h + 1 - W) // tpb get no page."""
    e = max(0, (h_tokens + 1 - window) // tpb)
    return set(range(e, alloc_blocks))


# ---------------------------------------------------------------- required_range


def test_engine_example_window64_tpb32_h8():
    # h = 8 blocks = 256 tokens: the first real sliding page is (256 + 1 - 64) // 32 = 6.
    assert (256 + 1 - 64) // 32 == 6
    assert sliding_lo(64, 32, 8) == 6
    assert required_range(SLIDING, 32, 0, 8) == (6, 8)
    assert required_range(FULL, 32, 0, 8) == (0, 8)
    # With a device match d, full needs [d, h); sliding needs max(d, lo).
    assert required_range(FULL, 32, 3, 8) == (3, 8)
    assert required_range(SLIDING, 32, 3, 8) == (6, 8)
    assert required_range(SLIDING, 32, 7, 8) == (7, 8)


def test_api_doc_test_fact_prompt256_offer128():
    # "window 64, tpb 32, prompt 256, offer 128 -> ordinals 0-1 are -1, 2-7 real".
    assert engine_real_ordinals(64, 32, 128, 8) == set(range(2, 8))
    lo, hi = required_range(SLIDING, 32, 0, 4)
    assert (lo, hi) == (2, 4)


@pytest.mark.parametrize("window", [1, 31, 32, 33, 64, 65, 100, 256, 1000])
@pytest.mark.parametrize("tpb", [1, 16, 32])
@pytest.mark.parametrize("d", [0, 2])
def test_required_range_is_exactly_the_real_pages_to_fill(window, tpb, d):
    g = GroupGeometry(0, window, (0,), (8,))
    for h in range(d + 1, 40):
        lo, hi = required_range(g, tpb, d, h)
        real = engine_real_ordinals(window, tpb, h * tpb, h)
        want = {o for o in real if d <= o < h}
        assert set(range(lo, hi)) == want, (window, tpb, d, h)


def test_margin_widens_sliding_only():
    assert required_range(SLIDING, 32, 0, 8, margin=1) == (5, 8)
    assert required_range(SLIDING, 32, 0, 8, margin=10) == (0, 8)
    assert required_range(SLIDING, 32, 4, 8, margin=10) == (4, 8)  # never below d
    assert required_range(FULL, 32, 2, 8, margin=3) == (2, 8)


def test_required_range_empty_when_h_not_above_d():
    lo, hi = required_range(FULL, 32, 5, 5)
    assert lo >= hi
    lo, hi = required_range(SLIDING, 32, 6, 4)
    assert lo >= hi


# ---------------------------------------------------------------- covers


def test_covers():
    S = Span
    assert covers([], 3, 3)
    assert covers([], 5, 2)
    assert not covers([], 0, 1)
    assert covers([S(0, 4)], 0, 4)
    assert covers([S(0, 4)], 1, 3)
    assert not covers([S(0, 4)], 0, 5)
    assert covers([S(4, 8), S(0, 4)], 0, 8)  # unsorted, adjacent
    assert not covers([S(0, 4), S(5, 8)], 0, 8)  # gap at 4
    assert covers([S(0, 4), S(5, 8)], 5, 8)
    assert covers([S(0, 6), S(2, 3), S(5, 9)], 0, 9)  # overlap and nested
    assert not covers([S(1, 9)], 0, 9)  # starts late
    assert covers([S(1, 9)], 1, 9)
    assert covers([S(0, 2), S(0, 10)], 0, 10)  # same first, longer one counts


def test_covers_matches_bruteforce():
    import random

    rng = random.Random(1234)
    for _ in range(500):
        spans = []
        for _ in range(rng.randint(0, 5)):
            a = rng.randint(0, 12)
            spans.append(Span(a, a + rng.randint(1, 5)))
        lo = rng.randint(0, 12)
        hi = rng.randint(0, 15)
        have = set().union(*(set(range(s.first, s.end)) for s in spans)) if spans else set()
        assert covers(spans, lo, hi) == set(range(lo, hi)).issubset(have), (spans, lo, hi)


# ---------------------------------------------------------------- servable


def full_cov(g: CacheGeometry, lo: int, hi: int, bpo: int = 1, skip=()):
    """Coverage of objects of ``bpo`` blocks in [lo, hi) for every group x shard, minus ``skip``."""
    cov: dict = {}
    for grp in g.groups:
        for s in range(g.tp_size):
            for first in range(lo, hi, bpo):
                end = min(hi, first + bpo)
                if (grp.group_id, s, end) in skip:
                    continue
                cov.setdefault((grp.group_id, s), {})[end] = Span(first, end)
    return cov


def test_servable_with_only_sliding_tail():
    g = geo()
    cov = {
        (0, 0): {8: Span(6, 8)},  # the sliding tail only
        (1, 0): {e: Span(e - 1, e) for e in range(1, 9)},
    }
    assert servable(g, cov, 0, 8)
    # The tail for h=8 does not serve h=7 (needs ordinal 5 in the sliding group).
    assert not servable(g, cov, 0, 7)


def test_servable_needs_every_group():
    g = geo()
    cov = full_cov(g, 0, 8)
    assert servable(g, cov, 0, 8)
    cov_no_full = {k: v for k, v in cov.items() if k[0] != 1}
    assert not servable(g, cov_no_full, 0, 8)
    cov_no_sliding = {k: v for k, v in cov.items() if k[0] != 0}
    assert not servable(g, cov_no_sliding, 0, 8)
    # A hole in the full group at ordinal 2.
    assert not servable(g, full_cov(g, 0, 8, skip={(1, 0, 3)}), 0, 8)
    # A hole in the sliding group below its window does not matter.
    assert servable(g, full_cov(g, 0, 8, skip={(0, 0, 3)}), 0, 8)
    # ...inside the window it does.
    assert not servable(g, full_cov(g, 0, 8, skip={(0, 0, 7)}), 0, 8)


def test_servable_needs_every_shard():
    g = geo(tp=2)
    assert servable(g, full_cov(g, 0, 8), 0, 8)
    for grp in (0, 1):
        cov = full_cov(g, 0, 8, skip={(grp, 1, 8)})
        assert not servable(g, cov, 0, 8), f"group {grp} shard 1 missing but servable"
        cov = full_cov(g, 0, 8, skip={(grp, 0, 8)})
        assert not servable(g, cov, 0, 8)


def test_servable_respects_device_match():
    g = geo()
    cov = full_cov(g, 4, 8)
    assert not servable(g, cov, 0, 8)
    assert servable(g, cov, 4, 8)
    assert not servable(g, cov, 8, 8)  # nothing to serve
    assert not servable(g, cov, 9, 8)


def test_servable_with_margin():
    g = geo()
    cov = {(0, 0): {8: Span(6, 8)}, (1, 0): {8: Span(0, 8)}}
    assert servable(g, cov, 0, 8)
    assert not servable(g, cov, 0, 8, margin=1)
    cov[(0, 0)][6] = Span(5, 6)
    assert servable(g, cov, 0, 8, margin=1)


def test_servable_object_ending_past_h():
    g = geo()
    # One 16-block object per group serves any h <= 16 (same chain prefix).
    cov = {(0, 0): {16: Span(0, 16)}, (1, 0): {16: Span(0, 16)}}
    for h in range(1, 17):
        assert servable(g, cov, 0, h)
    assert not servable(g, cov, 0, 17)


# ---------------------------------------------------------------- object_ends_needed


def test_object_ends_needed():
    assert object_ends_needed(0, 8, 4) == [4, 8]
    assert object_ends_needed(0, 8, 1) == list(range(1, 9))
    assert object_ends_needed(6, 8, 4) == [8]
    assert object_ends_needed(5, 10, 4) == [8, 10]
    assert object_ends_needed(3, 3, 4) == []
    assert object_ends_needed(0, 9, 4) == [4, 8, 9]


@pytest.mark.parametrize("bpo", [1, 3, 4])
def test_object_ends_needed_covers_range(bpo):
    for lo in range(0, 10):
        for hi in range(lo + 1, 14):
            ends = object_ends_needed(lo, hi, bpo)
            spans = [Span(max((e - 1) // bpo * bpo, 0), e) for e in ends]
            assert covers(spans, lo, hi)
            assert ends == sorted(set(ends)) and ends[-1] == hi
