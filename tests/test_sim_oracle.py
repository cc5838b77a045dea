"""A correct connector (the oracle) passes every scenario with 0 mismatches and real hits."""

from __future__ import annotations

import os

import pytest
import torch
from sim_connectors import FlatOracleLeader, FlatOracleWorker, OracleLeader, OracleStore, OracleWorker

from s3kv.sim import (
    EXECUTOR_LOOPS,
    SimCacheConfig,
    SimEngine,
    SimReport,
    SimRequestSpec,
    discard_async,
    flat_model,
    gemma3_like,
    generate_tokens,
    honour_minus_blocks,
    multi_turn_workload,
    preempt_generation_once,
    preempt_once,
    repeat_workload,
    request_root,
    shared_prefix_workload,
)

TPB = 16
CFG = SimCacheConfig(tokens_per_block=TPB, max_seq_len=1024)
W = 64


def workload(first_id: int = 0, **kw):
    args = dict(n_users=3, system_len=128, user_len=70, max_new_tokens=6)
    args.update(kw)
    return shared_prefix_workload(first_id=first_id, **args)


def make(
    *,
    mode="sync",
    tp=1,
    regions=1,
    chunk=None,
    device="cpu",
    leader=OracleLeader,
    worker=OracleWorker,
    store=None,
    model=None,
    config=CFG,
    worker_kw=None,
    **kw,
):
    store = store or OracleStore()
    model = model or gemma3_like(W, kv_heads=2 * tp, regions_per_group=regions)
    eng = SimEngine(
        model,
        config,
        leader,
        worker,
        tp_size=tp,
        chunk_size=chunk,
        device=device,
        connector_kwargs={"store": store, "mode": mode, **(worker_kw or {})},
        **kw,
    )
    return eng, store


def assert_clean(rep: SimReport) -> None:
    assert rep.kv_mismatches == 0, rep.mismatches[:5]
    assert rep.guard_violations == 0


def full_hit(spec: SimRequestSpec) -> int:
    return (len(spec.prompt) - 1) // TPB * TPB


@pytest.mark.parametrize("loop", list(EXECUTOR_LOOPS))
@pytest.mark.parametrize("regions", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk", [None, 48, 100], ids=["whole", "chunk<W", "chunk>W"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_repeat_hits_whole_history_with_zero_mismatches(mode, chunk, tp, regions, loop):
    eng, store = make(mode=mode, tp=tp, regions=regions, chunk=chunk, **EXECUTOR_LOOPS[loop])
    cold_specs = workload()
    cold = eng.run(cold_specs)
    assert_clean(cold)
    assert cold.matched_tokens == 0 and cold.pages_audited > 0
    warm_specs = repeat_workload(cold_specs, 100)
    warm = eng.run(warm_specs)
    assert_clean(warm)
    for spec in warm_specs:
        r = warm.by_id(spec.request_id)
        assert r.matched_tokens == full_hit(spec)  # the whole history, not the smallest window
        assert r.loaded_async == (mode == "async")
    # full group: 12 blocks; sliding: the in-window tail (192+1-64)//16 = 8 -> 4 blocks; per rank.
    assert warm.pages_checked == 3 * 16 * tp
    assert [r.output_tokens for r in warm.requests] == [r.output_tokens for r in cold.requests]
    assert store.loads > 0


@pytest.mark.parametrize("loop", list(EXECUTOR_LOOPS))
def test_multi_turn_extends_whole_history(loop):
    eng, _ = make(chunk=40, **EXECUTOR_LOOPS[loop])
    specs = multi_turn_workload(n_conversations=2, turns=3, max_new_tokens=8)
    rep = eng.run(specs)
    assert_clean(rep)
    by_id = {s.request_id: s for s in specs}
    for s in specs:
        r = rep.by_id(s.request_id)
        assert r.output_tokens == tuple(generate_tokens(request_root(), s.prompt, 8, 32000))
        if not s.after:
            assert r.matched_tokens == 0
            continue
        prev = by_id[s.after[0]]
        # The previous turn's KV covers its prompt and all but the last answer token (decode blocks saved too).
        history = len(prev.prompt) + 8 - 1
        if "overlap" in loop:
            # The overlap loop's host learns the token of the last KV position only at
            # request_finished, after the last metadata: a block it completes is not saved.
            history -= 1
        assert r.matched_tokens == history // TPB * TPB
    assert rep.hit_rate > 0.4


def test_honoured_less_than_offered():
    eng, _ = make(honour=honour_minus_blocks(2, TPB), chunk=48)
    eng.run(workload())
    warm_specs = repeat_workload(workload(), 100)
    warm = eng.run(warm_specs)
    assert_clean(warm)
    for s in warm_specs:
        r = warm.by_id(s.request_id)
        assert (r.offered_tokens, r.matched_tokens) == (full_hit(s), full_hit(s) - 2 * TPB)


@pytest.mark.parametrize("kw", [{"extra_allocated_blocks": 1}, {"extra_retained_blocks": 2}])
def test_engine_retaining_more_than_the_window(kw):
    eng, _ = make(chunk=100, **kw)
    eng.run(workload())
    warm = eng.run(repeat_workload(workload(), 100))
    assert_clean(warm)
    assert warm.matched_tokens == sum(full_hit(s) for s in workload())


def test_preempted_requests_replay_and_reuse_their_own_saves():
    eng, _ = make(chunk=48, preempt_hook=preempt_once(after_chunks=2))
    cold = eng.run(workload())
    assert_clean(cold)
    for r in cold.requests:
        assert r.replays == 1 and r.matched_tokens == 96  # blocks saved before the preemption
    warm = eng.run(repeat_workload(workload(), 100))
    assert_clean(warm)
    assert all(r.replays == 0 for r in warm.requests)  # served whole: one chunk, no preemption point
    assert [r.output_tokens for r in warm.requests] == [r.output_tokens for r in cold.requests]


def test_discarded_async_loads_are_harmless():
    eng, _ = make(mode="async", chunk=48, discard_hook=discard_async(request_ids={100, 102}))
    cold = eng.run(workload())
    warm_specs = repeat_workload(workload(), 100)
    warm = eng.run(warm_specs)
    assert_clean(warm)
    for s in warm_specs:
        r = warm.by_id(s.request_id)
        discarded = s.request_id in (100, 102)
        assert r.discarded == discarded and r.loaded_async
        assert r.matched_tokens == (0 if discarded else full_hit(s))
        assert r.computed_tokens == len(s.prompt) - r.matched_tokens
    # A third pass still hits everything: nothing wrong was saved by the recompute.
    third = eng.run(repeat_workload(workload(), 200))
    assert_clean(third)
    assert third.matched_tokens == sum(full_hit(s) for s in warm_specs)
    assert [r.output_tokens for r in third.requests] == [r.output_tokens for r in cold.requests]


def test_async_delays_and_held_pages():
    eng, _ = make(mode="async", tp=2, chunk=48, worker_kw={"async_delay": 2, "hold_on_finish": True})
    eng.run(workload())
    warm = eng.run(repeat_workload(workload(), 100))
    assert_clean(warm)
    assert warm.matched_tokens == sum(full_hit(s) for s in workload())
    eng.drain_held()
    assert sum(a.in_use for a in eng.allocators) == eng.held_pages()


def test_device_match_plus_connector():
    eng, _ = make(chunk=48)
    eng.run(workload())
    specs = [
        SimRequestSpec(s.request_id, s.prompt, s.max_new_tokens, device_match_tokens=32)
        for s in repeat_workload(workload(), 100)
    ]
    warm = eng.run(specs)
    assert_clean(warm)
    for s in specs:
        r = warm.by_id(s.request_id)
        assert (r.device_match_tokens, r.matched_tokens) == (32, full_hit(s) - 32)


def test_salt_lora_and_unhashed_multimodal_isolate(tmp_path):
    eng, _ = make()
    base = workload(n_users=1)[0]
    p = base.prompt
    a7, a8 = _adapter(tmp_path / "a7", b"seven"), _adapter(tmp_path / "a8", b"eight")
    eng.run(
        [
            SimRequestSpec(1, p, cache_salt="a"),
            SimRequestSpec(2, p, lora_task_id=7, lora_path=a7),
            SimRequestSpec(3, p, multimodal_positions=(3,), multimodal_hashes=((1, 2),)),
            SimRequestSpec(4, p, multimodal_positions=(3,)),
        ]
    )
    rep = eng.run(
        [
            SimRequestSpec(11, p, cache_salt="a"),
            SimRequestSpec(12, p, cache_salt="b"),
            SimRequestSpec(13, p, lora_task_id=7, lora_path=a7),
            SimRequestSpec(14, p, lora_task_id=8, lora_path=a8),
            SimRequestSpec(15, p, multimodal_positions=(3,), multimodal_hashes=((1, 2),)),
            SimRequestSpec(16, p, multimodal_positions=(3,)),
        ]
    )
    assert_clean(rep)
    hit = full_hit(base)
    assert [r.matched_tokens for r in rep.requests] == [hit, 0, hit, 0, hit, 0]


def _adapter(d, weights: bytes) -> str:
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


def test_the_engine_applies_the_weights_first_loaded_for_a_lora_id(tmp_path):
    """Upstream caches adapters by task id: a later request naming another path for the id gets
    the cached weights, so a connector keyed by that path would serve the wrong KV."""
    eng, _ = make()
    p = workload(n_users=1)[0].prompt
    a, b = _adapter(tmp_path / "a", b"one"), _adapter(tmp_path / "b", b"two")
    eng.run([SimRequestSpec(1, p, lora_task_id=7, lora_path=a)])
    eng.run([SimRequestSpec(2, p, lora_task_id=7, lora_path=b)])  # computed with a's weights, saved as b's
    rep = eng.run([SimRequestSpec(3, p, lora_task_id=9, lora_path=b)])  # really b's weights
    assert rep.requests[0].matched_tokens > 0 and rep.kv_mismatches > 0
    with pytest.raises(ValueError, match="no lora_path"):
        eng.run([SimRequestSpec(4, p, lora_task_id=11)])


def test_flat_mode_uses_flat_callbacks_and_the_v1_tensor():
    seen = []

    class Leader(FlatOracleLeader):
        def build_connector_meta(self, out):
            seen.extend(out.new_requests + out.cached_requests)
            return super().build_connector_meta(out)

    model = flat_model(num_layers=2)
    eng, _ = make(model=model, leader=Leader, worker=FlatOracleWorker, flat=True, chunk=48)
    eng.run(workload())
    warm = eng.run(repeat_workload(workload(), 100))
    assert_clean(warm)
    assert warm.matched_tokens == sum(full_hit(s) for s in workload())
    assert eng.leader.flat_calls > 0
    assert all(rd.new_block_ids_by_layer_group == [] for rd in seen)
    assert any(rd.new_block_ids for rd in seen)
    with pytest.raises(ValueError, match="flat"):
        make(flat=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_oracle_on_cuda(mode):
    eng, _ = make(mode=mode, tp=2, regions=2, chunk=48, device="cuda")
    eng.run(workload())
    warm = eng.run(repeat_workload(workload(), 100))
    assert_clean(warm)
    assert warm.matched_tokens == sum(full_hit(s) for s in workload())
    assert eng.pools[0].arena.is_cuda


@pytest.mark.parametrize("seed", range(int(os.environ.get("S3KV_SIM_FUZZ", "6"))))
def test_oracle_fuzz_mixed_knobs(seed):
    """Random mixes of prefixes, chunk sizes (not block multiples), honour, replays, TP, async delays."""
    import random

    rng = random.Random(seed)
    tp = rng.choice([1, 2])
    window = rng.choice([32, 48, 64])
    chunk = rng.choice([None, 24, 40, 72, 150])
    mode = rng.choice(["sync", "async"])
    honour_blocks = rng.choice([0, 0, 1, 3])
    loop = EXECUTOR_LOOPS[rng.choice(list(EXECUTOR_LOOPS))]
    eng, _ = make(
        **loop,
        mode=mode,
        tp=tp,
        chunk=chunk,
        model=gemma3_like(window, kv_heads=2 * tp, regions_per_group=rng.choice([1, 2])),
        honour=honour_minus_blocks(honour_blocks, TPB),
        preempt_hook=preempt_once(after_chunks=1, request_ids={rng.randrange(8) for _ in range(2)}),
        preempt_generation_hook=preempt_generation_once(after_tokens=rng.choice([1, 2, 5]), request_ids={rng.randrange(8)}),
        discard_hook=discard_async(request_ids={rng.randrange(8)}),
        extra_retained_blocks=rng.choice([0, 1]),
        max_batch=rng.choice([1, 2, 4]),
        worker_kw={"async_delay": rng.choice([0, 1, 3]), "hold_on_finish": rng.choice([False, True])},
    )
    trunk = [rng.randrange(32000) for _ in range(rng.randrange(40, 200))]
    for rnd in range(3):
        specs = []
        for i in range(8 if rnd == 0 else 4):
            cut = rng.randrange(1, len(trunk))
            p = trunk[:cut] + [rng.randrange(32000) for _ in range(rng.randrange(1, 60))]
            d = rng.choice([0, 0, (cut // TPB) * TPB]) if rnd else 0
            d = min(d, (len(p) - 1) // TPB * TPB)
            new = rng.randrange(1, 30)
            stop = rng.choice([None, None, rng.randrange(1, new + 1)])  # a stop token ends it early
            specs.append(SimRequestSpec(rnd * 100 + i, tuple(p), new, device_match_tokens=d, stop_after=stop))
        rep = eng.run(specs)
        assert_clean(rep)
        for s in specs:
            out = generate_tokens(request_root(), s.prompt, s.output_limit, 32000)
            assert rep.by_id(s.request_id).output_tokens == tuple(out)
    eng.drain_held()
    assert sum(a.in_use for a in eng.allocators) == eng.held_pages()
