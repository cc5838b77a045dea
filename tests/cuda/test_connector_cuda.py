"""The real adapter through the simulator with CUDA pools, pinned staging, streams and events."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# TensorRT-LLM's defaults too: the overlap loop, and decode in replayed CUDA graphs (no layer hooks).
LOOPS = ["non-overlap", "overlap+graphs"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2])
def test_vswa_cold_warm_on_cuda(load_mode, tp, loop):
    from s3kv.config import Settings
    from s3kv.sim import (
        EXECUTOR_LOOPS,
        SimCacheConfig,
        SimEngine,
        gemma3_like,
        multi_turn_workload,
        repeat_workload,
    )
    from s3kv.store.memory import MemoryStore
    from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    store = MemoryStore()
    specs = multi_turn_workload(n_conversations=2, turns=2, system_len=256, first_len=128, turn_len=96,
                                max_new_tokens=40)

    def engine(name):
        s = Settings(url="memory://cuda", staging_mib=256, check_access=False, load_mode=load_mode, lookup_timeout_s=5.0)
        return SimEngine(gemma3_like(64, kv_heads=4, head_dim=64), SimCacheConfig(tokens_per_block=32, max_seq_len=4096),
                         S3KvConnectorLeader, S3KvConnectorWorker, tp_size=tp, device="cuda", chunk_size=96,
                         failed_load_hook=load_mode == "sync",  # sync loads need an engine with the hook
                         connector_kwargs=dict(settings=s, store=store, engine_key=f"cuda-{name}-{tp}-{load_mode}-{loop}"),
                         **EXECUTOR_LOOPS[loop])

    with engine("A") as a:
        cold = a.run(specs)
        for w in a.workers:
            assert w.flush(60)
        assert a.workers[0].core.settings.pinned
    with engine("B") as b:
        warm = b.run(repeat_workload(specs, 1000))
    assert cold.kv_mismatches == 0 and warm.kv_mismatches == 0
    assert warm.hit_rate >= 0.9, warm.summary()


@pytest.mark.parametrize(("loop", "new_tokens"), [("non-overlap", 70), ("overlap+graphs", 70), ("overlap+graphs", 121)])
@pytest.mark.parametrize("tp", [1, 2])
def test_finish_plans_on_cuda(tp, loop, new_tokens):
    """Issue 12 on the GPU: A finishes (history several windows long) while B decodes, and the engine
    goes idle after B. The finish plan's device->host copies run on the side stream from get_finished;
    the next turn of A, on a fresh engine, is served its whole history bit-exact; held pages are
    released by the next traffic."""
    import random

    from s3kv.config import Settings
    from s3kv.sim import EXECUTOR_LOOPS, SimCacheConfig, SimEngine, SimRequestSpec, gemma3_like, random_tokens
    from s3kv.store.memory import MemoryStore
    from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    store = MemoryStore()
    rng = random.Random(tp)

    def engine(name):
        s = Settings(url="memory://cuda", staging_mib=256, check_access=False, blocks_per_object=4, lookup_timeout_s=5.0,
                     checkpoint_tokens=256)
        return SimEngine(gemma3_like(64, kv_heads=4, head_dim=64), SimCacheConfig(tokens_per_block=16, max_seq_len=4096),
                         S3KvConnectorLeader, S3KvConnectorWorker, tp_size=tp, device="cuda", chunk_size=48,
                         connector_kwargs=dict(settings=s, store=store, engine_key=f"cuda-fin-{name}-{tp}-{loop}"),
                         **EXECUTOR_LOOPS[loop])

    # 215 + 121: (h + 1) % 16 == 0, the block leaving last is freed between request_finished and
    # get_finished on the overlap loop.
    a = SimRequestSpec(1, tuple(random_tokens(rng, 215, 32000)), max_new_tokens=new_tokens)
    b = SimRequestSpec(2, tuple(random_tokens(rng, 150, 32000)), max_new_tokens=260)
    with engine("A") as e:
        rep = e.run([a, b])
        for w in e.workers:
            assert w.flush(60)
        e.drain_held()
        assert 1 not in e.held_request_ids and 2 not in e.held_request_ids
    assert rep.kv_mismatches == 0
    out = rep.by_id(1).output_tokens
    turn2 = SimRequestSpec(3, a.prompt + out + tuple(random_tokens(rng, 40, 32000)), max_new_tokens=4)
    with engine("B") as e2:
        rep2 = e2.run([turn2])
    assert rep2.kv_mismatches == 0
    assert rep2.requests[0].matched_tokens == (len(a.prompt) + len(out) - 1) // 16 * 16


def test_loads_of_requests_freed_without_a_word_never_land_on_cuda():
    """On the GPU, with the executor line that frees cancelled requests with no connector call and
    KVCacheManagerV2 pausing generating requests for recompute: a parked load (host->device copies
    on the side stream) whose request was freed is stopped before the forward of the request its
    pages went to, and nothing lands there once the store answers. Bit-exact throughout."""
    import dataclasses
    import threading
    import time
    import uuid

    from s3kv.config import Settings
    from s3kv.sim import (
        SimCacheConfig,
        SimEngine,
        SimRequestSpec,
        gemma3_like,
        multi_turn_workload,
        preempt_generation_once,
        repeat_workload,
    )
    from s3kv.store.base import NotFound, StoreWrapper
    from s3kv.store.memory import MemoryStore
    from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    class Gate(StoreWrapper):
        """Shard 0's objects are gone; shard 1's GETs wait for ``gate``."""

        def __init__(self, inner):
            super().__init__(inner)
            self.gate = threading.Event()

        def get_ranges(self, key, ranges):
            if ".0of2/" in key:
                raise NotFound("gone from shard 0", key=key)
            self.gate.wait(20)
            return self.inner.get_ranges(key, ranges)

    mem = MemoryStore()
    specs = multi_turn_workload(n_conversations=2, turns=2, system_len=256, first_len=128, turn_len=96,
                                max_new_tokens=40)

    def engine(store, **kw):
        s = Settings(url="memory://cuda", staging_mib=256, check_access=False, lookup_timeout_s=5.0, offer_guard="off")
        return SimEngine(gemma3_like(64, kv_heads=4, head_dim=64), SimCacheConfig(tokens_per_block=32, max_seq_len=4096),
                         S3KvConnectorLeader, S3KvConnectorWorker, tp_size=2, device="cuda", chunk_size=96,
                         connector_kwargs=dict(settings=s, store=store, engine_key=f"cuda-{uuid.uuid4().hex[:8]}"), **kw)

    with engine(mem, preempt_generation_hook=preempt_generation_once(after_tokens=10)) as a:
        cold = a.run(specs)
        for w in a.workers:
            assert w.flush(60)
    assert cold.kv_mismatches == 0 and all(r.replays == 1 for r in cold.requests)
    gated = Gate(mem)
    victim = dataclasses.replace(repeat_workload(specs, 1000)[0], cancel_after_iterations=3)
    with engine(gated, silent_cancel=True) as b:
        # The cancel lands in a pass that queues a batch (py_executor @0004396): a miss keeps them coming.
        busy = SimRequestSpec(4000, tuple(range(9000, 9000 + 64)), 20)
        first = b.run([busy, victim])
        assert first.by_id(victim.request_id).cancelled and first.by_id(victim.request_id).loaded_async

        def open_once_computing():
            deadline = time.monotonic() + 30
            while not gated.gate.is_set() and time.monotonic() < deadline:
                st = next((x for x in list(b._live) if x.rid == 5000), None)
                if st is not None and st.computed > 0:
                    gated.gate.set()
                time.sleep(0.0005)

        watch = threading.Thread(target=open_once_computing, daemon=True)
        watch.start()
        nxt = b.run([SimRequestSpec(5000, tuple(range(7000, 7000 + len(victim.prompt))), 300)])
        watch.join(30)
        abandoned = b.leader.core.stats.loads_abandoned
    assert gated.gate.is_set()
    assert first.kv_mismatches == 0 and nxt.kv_mismatches == 0, (first.summary(), nxt.summary())
    assert abandoned >= 1
