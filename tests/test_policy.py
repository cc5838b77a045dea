"""Which blocks each layer group stores (s3kv/core/policy.py), alone and through LeaderCore's save plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from s3kv.config import Settings
from s3kv.core.hitrule import Span, servable
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.core.policy import StoragePolicy
from s3kv.engine.leader import LeaderCore
from s3kv.store.memory import MemoryStore

TPB = 32
LAYER_BYTES = 512


def vswa_geometry(windows=(128, 128, 128, 128, 128, None), tp: int = 1) -> CacheGeometry:
    """One group per distinct window; a group's page is one region per layer of equal size."""
    by_window: dict = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(w, []).append(layer)
    groups = tuple(
        GroupGeometry(i, w, tuple(layers), (LAYER_BYTES,) * len(layers))
        for i, (w, layers) in enumerate(by_window.items())
    )
    return CacheGeometry(TPB, groups, tp, "bf16", "model")


def first_real(window: int, h_blocks: int, margin: int) -> int:
    """Independent statement of the engine rule: first ordinal with a page, widened by the margin."""
    return max(0, (h_blocks * TPB + 1 - window) // TPB - margin)


# ---------------------------------------------------------------- StoragePolicy alone


def test_full_groups_and_all_mode_keep_everything():
    g = vswa_geometry()
    win = StoragePolicy(g, 4, 32, "window", 1)
    every = StoragePolicy(g, 4, 32, "all", 1)
    for o in range(300):
        assert win.keeps(1, o, 100)  # full-attention group
        assert every.keeps(0, o, 100) and every.keeps(1, o, 100)
    assert win.stores_everything(1) and not win.stores_everything(0)
    assert every.stores_everything(0)


@pytest.mark.parametrize("margin", [0, 1, 2])
@pytest.mark.parametrize("prompt_blocks", [3, 10, 31, 32, 33, 64, 100])
def test_window_policy_keeps_exactly_tails_before_prompt_end_and_checkpoints(margin, prompt_blocks):
    g = vswa_geometry()
    W = 128
    cp = 32
    pol = StoragePolicy(g, 4, cp, "window", margin)
    wanted: set[int] = set()
    # Hits at the prompt end and one block below it (a block-aligned prompt serves k-1 blocks).
    for h in (prompt_blocks, prompt_blocks - 1):
        wanted |= set(range(first_real(W, h, margin), h))
    # Hits at every checkpoint (the tail before it); decode may run past the prompt.
    for c in range(cp, 300 + cp, cp):
        wanted |= set(range(min(first_real(W, c, margin), first_real(W, c - 1, margin)), c))
    kept = {o for o in range(300) if pol.keeps(0, o, prompt_blocks)}
    assert kept == {o for o in wanted if o < 300}
    # Sliding tails are short: at most window/tpb + 2 + margin blocks per boundary.
    per_boundary = W // TPB + 2 + margin
    assert len(kept) <= per_boundary * (2 + 300 // cp)


def test_tail_matches_what_the_hit_rule_needs():
    g = vswa_geometry()
    pol = StoragePolicy(g, 4, 32, "window", 1)
    for b in range(1, 200):
        lo, hi = pol.tail(0, b)
        assert hi == b
        cov = {(0, 0): {b: Span(lo, hi)}, (1, 0): {b: Span(0, b)}}
        assert servable(g, cov, 0, b, 1)
        if b > 1:
            assert servable(g, cov, 0, b - 1, 1)
        if lo > 0:
            # One block less would not do: the tail is minimal.
            cov = {(0, 0): {b: Span(lo + 1, hi)}, (1, 0): {b: Span(0, b)}}
            assert not (servable(g, cov, 0, b, 1) and servable(g, cov, 0, b - 1, 1))


def test_checkpoint_must_be_multiple_of_object_size():
    g = vswa_geometry()
    with pytest.raises(ValueError):
        StoragePolicy(g, 4, 30, "window")
    assert StoragePolicy(g, 4, 32).chunk_end(5) == 8
    assert StoragePolicy(g, 4, 32).chunk_end(8) == 12


def test_default_full_attention_objects_are_one_checkpoint_stride():
    """A PUT costs what keeping 64 MiB costs for hours: at the defaults a full-attention object is
    as large as the checkpoint stride lets it be, and the stride stays where the setting puts it
    (Gemma-3-27B at 64 tokens a block: 5 MiB full-attention pages, 26 MiB sliding ones)."""
    from s3kv.core.policy import object_sizes

    mib = 1 << 20
    s = Settings(url="memory://t")
    # TensorRT-LLM's 32 tokens a block halves the pages and doubles the blocks: the object is
    # still one stride (a cap of pages per object made it half a stride at 32 once).
    for tpb, page in ((64, 5 * mib), (32, 5 * mib // 2)):
        (full, sliding), cp = object_sizes([page, 26 * mib * tpb // 64], tpb, s)
        assert cp == s.checkpoint_tokens // tpb and full == cp, tpb
        assert full * page <= s.target_object_mib * mib
        assert cp % sliding == 0 and sliding * 26 * mib * tpb // 64 <= s.target_object_mib * mib
    # 64 MiB objects at a 4,096-token stride: 12-block objects, and checkpoints pushed to 72 blocks.
    (full, _), cp = object_sizes([5 * mib, 26 * mib], 64,
                                 Settings(url="memory://t", target_object_mib=64, checkpoint_tokens=4096))
    assert (full, cp) == (12, 72)


# ---------------------------------------------------------------- through LeaderCore


def plan_one_prompt(g: CacheGeometry, prompt_len: int, policy: str, **settings):
    """Drive LeaderCore for one non-chunked prompt; return (core, all metadata)."""
    s = Settings(url="memory://t", storage_policy=policy, **{"lookup_timeout_s": 5.0, **settings})
    core = LeaderCore(s, MemoryStore(), "pfx", tp_size=g.tp_size, model_id=g.model_id, kv_dtype=g.kv_dtype,
                      geometry=g)
    tokens = [(i * 7 + 3) % 32000 for i in range(prompt_len)]
    assert core.get_num_new_matched_tokens(1, tokens, prompt_len, 0) == (0, False)
    nblocks = -(-prompt_len // TPB)
    slots = [[grp.group_id * 100_000 + o for o in range(nblocks)] for grp in g.groups]
    rd = SimpleNamespace(
        request_id=1, new_tokens=tokens, new_block_ids=[], computed_position=0,
        num_scheduled_tokens=prompt_len, cache_salt=None, new_block_ids_by_layer_group=slots,
    )
    metas = [core.build_connector_meta([rd], [])]
    core.request_finished(1, slots)
    metas.append(core.build_connector_meta([], []))
    assert core.active_requests() == 0
    return core, metas


def stored_bytes(g: CacheGeometry, metas) -> int:
    return sum(g.groups[op.buffer.group].page_bytes for m in metas for op in m.stages)


def coverage_from_seals(metas, tp: int = 1) -> dict:
    cov: dict = {}
    for m in metas:
        for seal in m.seals:
            end = seal.buffer.first + seal.count
            for s in range(tp):
                cov.setdefault((seal.buffer.group, s), {})[end] = Span(seal.buffer.first, end)
    return cov


def test_vswa_16k_prompt_window_policy_stores_at_most_half_of_all():
    g = vswa_geometry()
    assert [(x.window, len(x.layer_ids)) for x in g.groups] == [(128, 5), (None, 1)]
    assert g.groups[0].page_bytes == 5 * g.groups[1].page_bytes  # equal bytes per layer
    prompt_len = 16 * 1024
    _, win = plan_one_prompt(g, prompt_len, "window")
    _, every = plan_one_prompt(g, prompt_len, "all")
    win_bytes, all_bytes = stored_bytes(g, win), stored_bytes(g, every)
    blocks = prompt_len // TPB
    # "all": every block of every group, counted independently.
    assert all_bytes == blocks * sum(x.page_bytes for x in g.groups)
    assert win_bytes <= 0.5 * all_bytes, f"window policy stores {win_bytes / all_bytes:.0%} of 'all'"
    # The full-attention group still stores every block under "window".
    full_ordinals = sorted(op.ordinal for m in win for op in m.stages if op.buffer.group == 1)
    assert full_ordinals == list(range(blocks))


def test_vswa_window_policy_still_serves_repeats_and_checkpoints():
    g = vswa_geometry()
    prompt_len = 16 * 1024 + 17
    core, metas = plan_one_prompt(g, prompt_len, "window")
    cov = coverage_from_seals(metas)
    margin = core.settings.window_margin_blocks
    hmax = (prompt_len - 1) // TPB
    assert servable(g, cov, 0, hmax, margin), "exact repeat not servable from what the policy stored"
    cp = core.params.checkpoint_blocks
    for c in range(cp, hmax, cp):
        assert servable(g, cov, 0, c, margin), f"checkpoint {c} not servable"
    # ...but not an arbitrary boundary between checkpoints (the sliding tail is absent there).
    assert not servable(g, cov, 0, cp + cp // 2, margin)


@pytest.mark.parametrize("prompt_len", [20 * TPB, 20 * TPB + 1, 16 * 1024])
def test_all_policy_stores_every_block_of_every_group_once(prompt_len):
    g = vswa_geometry()
    _, metas = plan_one_prompt(g, prompt_len, "all", blocks_per_object=8)
    blocks = prompt_len // TPB
    for grp in g.groups:
        ords = sorted(op.ordinal for m in metas for op in m.stages if op.buffer.group == grp.group_id)
        assert ords == list(range(blocks))
