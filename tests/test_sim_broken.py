"""Deliberately broken connectors: the checker must catch every one (and a never-returning one must not hang)."""

from __future__ import annotations

import random
import time

import pytest
from sim_connectors import (
    LateSaveWorker,
    NeverReturnsWorker,
    OracleLeader,
    OracleStore,
    OracleWorker,
    SaltBlindLeader,
    WindowExactLeader,
    WrongGroupWorker,
    WrongPrefixLeader,
    WrongShardWorker,
    WrongSlotWorker,
)

from s3kv.sim import (
    SimCacheConfig,
    SimEngine,
    SimHang,
    SimRequestSpec,
    gemma3_like,
    random_tokens,
    repeat_workload,
    shared_prefix_workload,
)

CFG = SimCacheConfig(tokens_per_block=16, max_seq_len=1024)


def two_passes(leader=OracleLeader, worker=OracleWorker, *, tp=1, mode="sync", max_new_tokens=6, **kw):
    eng = SimEngine(
        gemma3_like(64, kv_heads=2 * tp),
        CFG,
        leader,
        worker,
        tp_size=tp,
        connector_kwargs={"store": OracleStore(), "mode": mode},
        **kw,
    )
    cold_specs = shared_prefix_workload(n_users=3, system_len=128, user_len=70, max_new_tokens=max_new_tokens)
    cold = eng.run(cold_specs)
    warm = eng.run(repeat_workload(cold_specs, 100))
    return cold, warm


def test_wrong_prefix_keys_are_caught():
    """Keyed by a block's own tokens (the upstream example): same block after a different prefix."""
    rng = random.Random(1)
    shared = random_tokens(rng, 96, 32000)
    a = SimRequestSpec(0, tuple(random_tokens(rng, 64, 32000) + shared))
    b = SimRequestSpec(1, tuple(random_tokens(rng, 64, 32000) + shared), device_match_tokens=64)
    results = {}
    for leader in (OracleLeader, WrongPrefixLeader):
        eng = SimEngine(gemma3_like(64), CFG, leader, OracleWorker, connector_kwargs={"store": OracleStore()})
        eng.run([a])
        results[leader] = eng.run([b])
    good, bad = results[OracleLeader], results[WrongPrefixLeader]
    assert good.matched_tokens == 0 and good.kv_mismatches == 0
    assert bad.matched_tokens > 0 and bad.kv_mismatches > 0
    assert {m.kind for m in bad.mismatches} == {"wrong"} and {m.source for m in bad.mismatches} == {
        "connector"
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_wrong_group_is_caught(mode):
    _, warm = two_passes(worker=WrongGroupWorker, mode=mode, chunk_size=48)
    assert warm.kv_mismatches > 0
    assert {m.layer_group for m in warm.mismatches} == {0, 1}


def test_wrong_slot_is_caught():
    _, warm = two_passes(worker=WrongSlotWorker)
    assert warm.kv_mismatches > 0
    assert all(m.source == "connector" for m in warm.mismatches if m.phase == "load")


def test_wrong_shard_is_caught_on_the_other_rank_only():
    _, warm = two_passes(worker=WrongShardWorker, tp=2)
    assert warm.kv_mismatches > 0 and {m.rank for m in warm.mismatches} == {1}


def test_late_save_of_freed_pages_is_caught():
    """Saving one iteration late copies pages the engine freed (junked) when the request finished."""
    cold, warm = two_passes(worker=LateSaveWorker, max_new_tokens=1, max_batch=1)
    # Silent where it happens; shows up as junk served to the next request sharing the prefix (the
    # cold pass's later users already share the system prompt: max_batch 1 runs them one after another).
    assert cold.kv_mismatches > 0 and warm.kv_mismatches > 0
    assert "junk" in {m.kind for m in warm.mismatches}


def test_late_save_of_sliding_pages_that_left_the_window_is_caught():
    """Chunk > window: sliding pages leave the window (and are junked) in the iteration they are computed."""
    eng = SimEngine(
        gemma3_like(32),
        CFG,
        OracleLeader,
        LateSaveWorker,
        chunk_size=80,
        connector_kwargs={"store": OracleStore()},
    )
    rng = random.Random(3)
    p = tuple(random_tokens(rng, 200, 32000))
    eng.run([SimRequestSpec(1, p, max_new_tokens=30)])
    # Sliding blocks 5-7 completed in chunk 2 and left the window right after it (cutoff at 160 is 8):
    # saved one iteration late, they hold junk. A prefix served up to 128 needs sliding ordinals 6-7.
    rep = eng.run([SimRequestSpec(2, p[:129], max_new_tokens=1)])
    assert rep.matched_tokens == 128
    assert rep.kv_mismatches > 0 and {m.layer_group for m in rep.mismatches} == {1}


def test_window_exact_plan_is_caught_when_the_engine_retains_more():
    _, warm = two_passes(leader=WindowExactLeader)
    assert warm.kv_mismatches == 0  # exact retention: the plan covers every real page
    _, warm = two_passes(leader=WindowExactLeader, extra_allocated_blocks=1)
    assert warm.kv_mismatches > 0 and {m.layer_group for m in warm.mismatches} == {1}


def test_salt_blind_keys_are_caught():
    eng = SimEngine(
        gemma3_like(64), CFG, SaltBlindLeader, OracleWorker, connector_kwargs={"store": OracleStore()}
    )
    p = tuple(random_tokens(random.Random(5), 150, 32000))
    eng.run([SimRequestSpec(1, p, cache_salt="tenant-a")])
    rep = eng.run([SimRequestSpec(2, p, cache_salt="tenant-b")])
    assert rep.matched_tokens > 0 and rep.kv_mismatches > 0


def test_never_returned_async_id_raises_simhang_within_the_cap():
    eng = SimEngine(
        gemma3_like(64),
        CFG,
        OracleLeader,
        NeverReturnsWorker,
        tp_size=1,
        connector_kwargs={"store": OracleStore(), "mode": "async"},
    )
    specs = shared_prefix_workload(n_users=2, system_len=64, user_len=40)
    eng.run(specs)  # cold: nothing to load, nothing parked
    t0 = time.perf_counter()
    with pytest.raises(SimHang) as e:
        eng.run(repeat_workload(specs, 10), max_iterations=40)
    assert time.perf_counter() - t0 < 5
    assert set(e.value.stuck) == {10, 11}
    assert "never returned it as finished loading" in str(e.value)
