"""The real adapter classes driven by the engine simulator: every loaded byte is checked.

Two engines ("clusters") share only a store; the second must be served from what
the first saved, and the simulator's checker compares every page either of them
loaded with what recomputation would have written.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from s3kv.config import Settings
from s3kv.sim import (
    EXECUTOR_LOOPS,
    FULL_ATTENTION,
    SimCacheConfig,
    SimEngine,
    SimModel,
    SimRequestSpec,
    flat_model,
    gemma3_like,
    honour_minus_blocks,
    multi_turn_workload,
    preempt_generation_once,
    preempt_once,
    random_tokens,
    repeat_workload,
    shared_prefix_workload,
)
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

_keys = itertools.count()


def make_engine(store, model, *, tp=1, chunk=None, tpb=16, max_seq_len=2048, flat=False, engine=None,
                failed_load_hook=None, loop="non-overlap", **settings):
    """``load_mode="sync"`` runs on a line with the failed-load path (s3kv loads async there too:
    no line can fail a sync load, docs/failures.md)."""
    # A generous lookup budget: these tests count hits, and a busy CI core can take longer than
    # the default budget (then a lookup is a miss, by design; tests/test_lookup_budget.py covers that).
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, **{"lookup_timeout_s": 5.0, **settings})
    if failed_load_hook is None:
        failed_load_hook = s.load_mode == "sync"
    kwargs = dict(settings=s, store=store, engine_key=engine or f"test-{next(_keys)}")
    return SimEngine(
        model,
        SimCacheConfig(tokens_per_block=tpb, max_seq_len=max_seq_len),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        tp_size=tp,
        chunk_size=chunk,
        flat=flat,
        failed_load_hook=failed_load_hook,
        connector_kwargs=kwargs,
        **EXECUTOR_LOOPS[loop],
    )


def run(engine, specs):
    with engine:
        rep = engine.run(specs)
        for w in engine.workers:
            assert w.flush(30)
    return rep


def cold_warm(model, specs, warm_specs=None, **kw):
    store = MemoryStore()
    cold = run(make_engine(store, model, **kw), specs)
    warm = run(make_engine(store, model, **kw), warm_specs or repeat_workload(specs, 10_000))
    return store, cold, warm


@pytest.mark.parametrize("loop", list(EXECUTOR_LOOPS))
@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk", [None, 48])
def test_vswa_cold_then_warm_is_bit_exact(load_mode, tp, chunk, loop):
    specs = multi_turn_workload(n_conversations=2, turns=2, system_len=160, first_len=96, turn_len=64,
                                max_new_tokens=24)
    _, cold, warm = cold_warm(gemma3_like(64, kv_heads=2), specs, tp=tp, chunk=chunk, load_mode=load_mode,
                              loop=loop)
    assert cold.kv_mismatches == 0 and warm.kv_mismatches == 0
    assert cold.guard_violations == 0 and warm.guard_violations == 0
    # Every prompt is many windows long; the warm engine must still serve almost all of it.
    assert warm.hit_rate >= 0.9, warm.summary()
    assert warm.pages_checked > 0
    # Asked for sync or not, the adapter loads async: no TensorRT-LLM line can fail a sync load.
    assert all(r.loaded_async for r in warm.requests if r.matched_tokens)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_preempted_while_generating_replays_exact(tp):
    """KVCacheManagerV2 may pause a generating request for recompute: its pages are freed with no
    connector call, its tokens so far become its prompt and it is looked up and reported anew
    under the same id. Nothing of the first attempt may leak into the replay, and what either
    attempt saved must serve a later engine bit-exact."""
    specs = multi_turn_workload(n_conversations=2, turns=2, system_len=160, first_len=96, turn_len=64,
                                max_new_tokens=40)
    store = MemoryStore()
    # The guard would read the preemptions as memory pressure and cut the replays' hits; off, each
    # replay loads what its first attempt saved.
    eng = make_engine(store, gemma3_like(64, kv_heads=2), tp=tp, chunk=48, offer_guard="off")
    eng.preempt_generation_hook = preempt_generation_once(after_tokens=20)
    cold = run(eng, specs)
    assert cold.kv_mismatches == 0 and cold.guard_violations == 0
    assert all(r.replays == 1 for r in cold.requests) and cold.matched_tokens > 0
    assert eng.leader.core.active_requests() == 0
    warm = run(make_engine(store, gemma3_like(64, kv_heads=2), tp=tp, chunk=48), repeat_workload(specs, 10_000))
    assert warm.kv_mismatches == 0 and warm.hit_rate >= 0.9, warm.summary()


def test_flat_single_group_layout():
    specs = shared_prefix_workload(n_users=3, system_len=96, user_len=40)
    _, cold, warm = cold_warm(flat_model(), specs, flat=True)
    assert warm.kv_mismatches == 0 and warm.matched_tokens > 0
    assert warm.hit_rate >= 0.8


def test_two_regions_per_group():
    model = SimModel(num_layers=6, kv_heads=2, head_dim=8, regions_per_group=2,
                     max_attention_window=(64,) * 5 + (FULL_ATTENTION,))
    specs = shared_prefix_workload(n_users=2, system_len=128, user_len=64)
    _, _, warm = cold_warm(model, specs, tp=2, chunk=32)
    assert warm.kv_mismatches == 0 and warm.hit_rate >= 0.9


def test_decode_blocks_serve_the_next_turn():
    """Turn 2 = turn 1 + its generated answer + new text: the answer's blocks come from the store."""
    specs = multi_turn_workload(n_conversations=1, turns=2, system_len=64, first_len=64, turn_len=32,
                                max_new_tokens=70)
    store = MemoryStore()
    turn2 = dataclasses.replace(specs[1], after=())
    rep = run(make_engine(store, gemma3_like(48)), specs[:1])
    rep2 = run(make_engine(store, gemma3_like(48)), [turn2])
    t1_history = len(specs[0].prompt) + specs[0].max_new_tokens - 1  # the last token has no KV
    assert rep.kv_mismatches == 0 and rep2.kv_mismatches == 0
    assert rep2.requests[0].matched_tokens == t1_history // 16 * 16
    # Without decode saving only the turn-1 prompt is reusable.
    store = MemoryStore()
    run(make_engine(store, gemma3_like(48), save_decode=False), specs[:1])
    rep3 = run(make_engine(store, gemma3_like(48), save_decode=False), [turn2])
    assert rep3.requests[0].matched_tokens == len(specs[0].prompt) // 16 * 16


@pytest.mark.parametrize("windows", [(512, FULL_ATTENTION), (128,) * 5 + (FULL_ATTENTION,)])
@pytest.mark.parametrize("prompt_len", [4096, 16384])
def test_long_prompts_exact_repeat_and_multi_turn(windows, prompt_len):
    """Issue acceptance: tpb 32, prompts 4k-16k, an exact repeat on a fresh engine hits >= 90%."""
    model = SimModel(num_layers=len(windows), kv_heads=1, head_dim=4, max_attention_window=windows)
    rng = random.Random(prompt_len)
    prompt = random_tokens(rng, prompt_len, 32000)
    t1 = SimRequestSpec(1, tuple(prompt), max_new_tokens=40)
    kw = dict(tpb=32, max_seq_len=prompt_len + 2048, chunk=2048)
    store = MemoryStore()
    cold = run(make_engine(store, model, **kw), [t1])
    answer = list(cold.requests[0].output_tokens)
    repeat = run(make_engine(store, model, **kw), [SimRequestSpec(2, tuple(prompt), max_new_tokens=4)])
    assert repeat.kv_mismatches == 0
    assert repeat.requests[0].matched_tokens >= 0.9 * prompt_len
    turn2 = SimRequestSpec(3, tuple(prompt + answer + random_tokens(rng, 300, 32000)), max_new_tokens=4)
    rep2 = run(make_engine(store, model, **kw), [turn2])
    history = prompt_len + len(answer) - 1
    assert rep2.kv_mismatches == 0
    assert rep2.requests[0].matched_tokens >= history // 32 * 32


def test_shared_block_without_shared_prefix_never_shares_kv():
    """Two prompts with an identical block after different prefixes: the seed's per-block keys collide."""
    rng = random.Random(3)
    common = random_tokens(rng, 64, 32000)
    a = SimRequestSpec(1, tuple(random_tokens(rng, 64, 32000) + common + random_tokens(rng, 32, 32000)))
    b = SimRequestSpec(2, tuple(random_tokens(rng, 64, 32000) + common + random_tokens(rng, 32, 32000)))
    store = MemoryStore()
    run(make_engine(store, gemma3_like(64)), [a])
    rep = run(make_engine(store, gemma3_like(64)), [b])
    assert rep.requests[0].matched_tokens == 0 and rep.kv_mismatches == 0


def test_salts_isolate_tenants():
    specs = shared_prefix_workload(n_users=2, system_len=96, user_len=32, cache_salt="tenant-a")
    other = shared_prefix_workload(n_users=2, system_len=96, user_len=32, cache_salt="tenant-b", first_id=50)
    same = shared_prefix_workload(n_users=2, system_len=96, user_len=32, cache_salt="tenant-a", first_id=90)
    store = MemoryStore()
    run(make_engine(store, gemma3_like(64)), specs)
    rep_b = run(make_engine(store, gemma3_like(64)), other)
    rep_a = run(make_engine(store, gemma3_like(64)), same)
    assert rep_b.matched_tokens == 0 and rep_b.kv_mismatches == 0
    assert rep_a.matched_tokens > 0 and rep_a.kv_mismatches == 0


def test_deleted_middle_object_stops_the_hit_before_it():
    model = gemma3_like(64)
    prompt = tuple(random_tokens(random.Random(5), 640, 32000))
    store = MemoryStore()
    # Checkpoints every 8 blocks: sliding tails exist at 8, 16, 24, ... so the hit can
    # fall back to the last one before the hole.
    kw = dict(blocks_per_object=4, checkpoint_tokens=128)
    eng = make_engine(store, model, **kw)
    run(eng, [SimRequestSpec(1, prompt)])
    full_gid = next(g.group_id for g in eng.leader.core.geometry.groups if g.window is None)
    fp = eng.leader.core.geometry.groups[full_gid].fingerprint
    # The object holding blocks [16, 20) of the full-attention group.
    from s3kv.core.keys import Chain, chain_root

    core = eng.leader.core
    chain = Chain(chain_root(core.namespace), 16)
    chain.extend_to(list(prompt))
    victim = core.scheme.object_key(fp, 0, chain.digests[19])
    assert victim in store.keys()
    store.delete_many([victim])
    rep = run(make_engine(store, model, **kw), [SimRequestSpec(2, prompt)])
    assert rep.kv_mismatches == 0
    assert rep.requests[0].matched_tokens == 16 * 16  # stops at the start of the deleted object


def test_tp2_missing_shard_object_means_no_hit_for_that_chunk():
    model = gemma3_like(64)
    prompt = tuple(random_tokens(random.Random(6), 640, 32000))
    store = MemoryStore()
    kw = dict(tp=2, blocks_per_object=4, checkpoint_tokens=128)
    eng = make_engine(store, model, **kw)
    run(eng, [SimRequestSpec(1, prompt)])
    core = eng.leader.core
    from s3kv.core.keys import Chain, chain_root

    chain = Chain(chain_root(core.namespace), 16)
    chain.extend_to(list(prompt))
    full = next(g for g in core.geometry.groups if g.window is None)
    victim = core.scheme.object_key(full.fingerprint, 1, chain.digests[11])  # shard 1, blocks [8, 12)
    assert victim in store.keys()
    store.delete_many([victim])
    rep = run(make_engine(store, model, **kw), [SimRequestSpec(2, prompt)])
    assert rep.kv_mismatches == 0
    assert rep.requests[0].matched_tokens == 8 * 16


@pytest.mark.parametrize("chunk", [32, 96])  # chunk < window and chunk > window (window 64)
def test_chunked_prefill_stores_every_block_once_with_store_everything(chunk):
    model = gemma3_like(64)
    specs = shared_prefix_workload(n_users=2, system_len=200, user_len=100, max_new_tokens=2)
    store = MemoryStore()
    eng = make_engine(store, model, chunk=chunk, storage_policy="all", save_decode=False)
    staged: dict[tuple[int, int, int], int] = {}
    build = eng.leader.build_connector_meta

    def spy(so):
        meta = build(so)
        for op in meta.stages:
            k = (op.buffer.request_id, op.buffer.group, op.ordinal)
            staged[k] = staged.get(k, 0) + 1
        return meta

    eng.leader.build_connector_meta = spy
    run(eng, specs)
    groups = eng.leader.core.geometry.num_groups
    for s in specs:
        blocks = len(s.prompt) // 16
        for g in range(groups):
            for o in range(blocks):
                assert staged.get((s.request_id, g, o)) == 1, (s.request_id, g, o)


def test_window_policy_stores_half_or_less_of_store_everything():
    model = SimModel(num_layers=6, kv_heads=1, head_dim=4, max_attention_window=(128,) * 5 + (FULL_ATTENTION,))
    prompt = tuple(random_tokens(random.Random(9), 16384, 32000))
    sizes = {}
    for policy in ("window", "all"):
        store = MemoryStore()
        rep = run(make_engine(store, model, tpb=32, max_seq_len=18000, chunk=4096, storage_policy=policy),
                  [SimRequestSpec(1, prompt, max_new_tokens=2)])
        assert rep.kv_mismatches == 0
        sizes[policy] = sum(i.size for i in store.list(""))
    assert sizes["window"] <= 0.5 * sizes["all"], sizes


def test_replay_and_partial_honour_stay_exact():
    """Honoured-less lands between stored sliding tails; "all" stores every tail there is."""
    specs = shared_prefix_workload(n_users=3, system_len=160, user_len=64)
    store = MemoryStore()
    cold = make_engine(store, gemma3_like(64), chunk=48, storage_policy="all")
    cold.preempt_hook = preempt_once(after_chunks=2)  # replayed mid-prefill: staged saves are discarded
    rep_cold = run(cold, specs)
    assert rep_cold.kv_mismatches == 0 and all(r.replays == 1 for r in rep_cold.requests)
    eng = make_engine(store, gemma3_like(64), chunk=48, storage_policy="all")
    eng.honour = honour_minus_blocks(1, 16)
    rep = run(eng, repeat_workload(specs, 500))
    assert rep.kv_mismatches == 0
    assert all(0 < r.matched_tokens < r.offered_tokens for r in rep.requests)


def test_no_request_state_leaks():
    model = flat_model()
    store = MemoryStore()
    eng = make_engine(store, model, flat=True)
    rng = random.Random(11)
    specs = [SimRequestSpec(i, tuple(random_tokens(rng, 40, 32000)), max_new_tokens=1) for i in range(300)]
    run(eng, specs)
    assert eng.leader.core.active_requests() == 0


@pytest.mark.parametrize("policy", ["window", "all"])
def test_groups_pack_their_own_blocks_per_object(policy):
    """A full-attention group of one layer has small pages: more blocks per object than the sliding group."""
    model = SimModel(num_layers=6, kv_heads=8, head_dim=64, max_attention_window=(64,) * 5 + (FULL_ATTENTION,))
    specs = shared_prefix_workload(n_users=2, system_len=600, user_len=100, max_new_tokens=20)
    kw = dict(target_object_mib=1, checkpoint_tokens=1024, storage_policy=policy)
    store = MemoryStore()
    eng = make_engine(store, model, **kw)
    run(eng, specs)
    core = eng.leader.core
    full = next(g.group_id for g in core.geometry.groups if g.window is None)
    sliding = 1 - full
    assert core.group_blocks[full] == 32 and core.group_blocks[sliding] == 4
    counts = {}
    for info in store.list(""):
        gfp = info.key.rsplit("/", 2)[-2].split(".")[0]
        counts.setdefault(gfp, []).append(int(info.metadata["s3kv-count"]))
    assert max(counts[core.geometry.groups[full].fingerprint]) == 32
    assert max(counts[core.geometry.groups[sliding].fingerprint]) <= (4 if policy == "all" else 64)
    warm = run(make_engine(store, model, **kw), repeat_workload(specs, 100))
    assert warm.kv_mismatches == 0 and warm.hit_rate >= 0.9, warm.summary()


def test_a_load_from_an_objects_start_is_one_get():
    """Header and the first wanted pages are adjacent: one ranged GET per object (the bill counts GETs)."""
    from s3kv.store.instrument import InstrumentedStore

    store = InstrumentedStore(MemoryStore())
    specs = shared_prefix_workload(n_users=2, system_len=300, user_len=60)
    run(make_engine(store, flat_model(), flat=True, blocks_per_object=4), specs)
    store.reset()
    eng = make_engine(store, flat_model(), flat=True, blocks_per_object=4)
    rep = run(eng, repeat_workload(specs, 100))
    loaded = eng.workers[0].core.stats().objects_loaded
    assert rep.kv_mismatches == 0 and loaded > 0
    assert store.snapshot().get == loaded


def test_attention_dp_needs_connectors_that_declare_it():
    from sim_connectors import OracleLeader, OracleStore, OracleWorker

    from s3kv.sim import SimContractError

    with pytest.raises(SimContractError, match="supports_attention_dp"):
        SimEngine(gemma3_like(64, kv_heads=2), SimCacheConfig(tokens_per_block=16, max_seq_len=2048),
                  OracleLeader, OracleWorker, attention_dp=(0, 2), connector_kwargs={"store": OracleStore()})
