"""The host tier on a GPU: a pinned arena, loads copied host->device straight from it, bit-exact."""

from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("needs a CUDA device", allow_module_level=True)

from s3kv.config import Settings  # noqa: E402
from s3kv.core.plan import BufferId, ConnectorMetadata, LoadOp, ObjectRef, SealOp, StageOp  # noqa: E402
from s3kv.engine.worker import WorkerCore  # noqa: E402
from s3kv.sim.layouts import GroupSpec, make_layout, page_bytes  # noqa: E402
from s3kv.store.instrument import InstrumentedStore  # noqa: E402
from s3kv.store.memory import MemoryStore  # noqa: E402

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
GROUPS = [GroupSpec((0, 2), None, (256 * 1024,), pad=4096), GroupSpec((1, 3), 128, (64 * 1024, 4096))]
TPB = 32


def digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def make_core(store, *, seed=0, **kw):
    base = dict(staging_mib=64, upload_threads=2, download_threads=4, load_timeout_s=10.0, host_cache_gb=0.25)
    base.update(kw)
    layout = make_layout(GROUPS, num_slots=64, tokens_per_block=TPB, device=DEV, fill_seed=seed)
    core = WorkerCore(Settings(**base), store, "kv", 0, 1, "cuda-model", "bf16", failed_load_hook=True)
    core.register_layout(layout)
    # A pinned tier is pinned in the background: until it is ready it holds nothing.
    assert core.host_tier is None or core.host_tier.wait_ready(60)
    return core, layout


def step(core, md, fwd):
    core.bind(md)
    with torch.cuda.stream(fwd):
        core.start_load_kv(fwd)
        for layer in range(4):
            core.wait_for_layer_load(layer, fwd)
        core.wait_for_save(fwd)
    return core.get_finished([], [])


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("group", [0, 1], ids=["single-region", "multi-region"])
def test_a_load_from_the_pinned_tier_is_bit_exact_and_reads_no_store(group, verify):
    store = InstrumentedStore(MemoryStore())
    a, la = make_core(store, seed=1, host_cache_verify=verify)
    fwd = torch.cuda.Stream(device=DEV)
    assert a.host_tier is not None and a.host_tier.pinned
    src, dst = [7, 3, 40, 41, 42], [10, 11, 12, 30, 5]
    d = digest("tier", group)
    bid = BufferId(1, group, 0, len(src))
    step(a, ConnectorMetadata(stages=tuple(StageOp(bid, i, s) for i, s in enumerate(src)),
                              seals=(SealOp(bid, len(src), d),)), fwd)
    assert a.flush(10)
    gets = store.snapshot().get
    step(a, ConnectorMetadata(loads=(LoadOp(9, ObjectRef(group, d, ((0, 5),)), tuple(range(5)), tuple(dst)),)), fwd)
    fwd.synchronize()
    torch.cuda.synchronize()
    assert [page_bytes(la, group, s) for s in dst] == [page_bytes(la, group, s) for s in src]
    assert store.snapshot().get == gets
    st = a.stats()
    assert st.host_hits == 1 and st.host_pinned and st.load_staging_fallbacks == 0
    a.close()


@pytest.mark.parametrize("loop", ["non-overlap", "overlap+graphs"])
@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_repeat_on_one_gpu_engine_is_served_from_host_memory(tp, load_mode, loop):
    from s3kv.sim import (
        EXECUTOR_LOOPS,
        SimCacheConfig,
        SimEngine,
        gemma3_like,
        multi_turn_workload,
        repeat_workload,
    )
    from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    store = InstrumentedStore(MemoryStore())
    specs = multi_turn_workload(n_conversations=2, turns=2, system_len=256, first_len=128, turn_len=96,
                                max_new_tokens=40)
    s = Settings(url="memory://cuda", staging_mib=256, check_access=False, load_mode=load_mode, lookup_timeout_s=5.0,
                 host_cache_gb=1.0)
    with SimEngine(gemma3_like(64, kv_heads=4, head_dim=64), SimCacheConfig(tokens_per_block=32, max_seq_len=4096),
                   S3KvConnectorLeader, S3KvConnectorWorker, tp_size=tp, device="cuda", chunk_size=96,
                   failed_load_hook=load_mode == "sync",
                   connector_kwargs=dict(settings=s, store=store, engine_key=f"cuda-host-{tp}-{load_mode}-{loop}"),
                   **EXECUTOR_LOOPS[loop]) as e:
        assert all(w.core.host_tier.wait_ready(60) for w in e.workers)  # pinned in the background
        cold = e.run(specs)
        for w in e.workers:
            assert w.flush(60)
        before = store.snapshot()
        warm = e.run(repeat_workload(specs, 1000))
        after = store.snapshot()
        stats = [w.core.stats() for w in e.workers]
    assert cold.kv_mismatches == 0 and warm.kv_mismatches == 0
    assert warm.hit_rate >= 0.9, warm.summary()
    assert (after.get, after.head) == (before.get, before.head)
    assert all(st.host_hits > 0 and st.host_pinned and st.host_divergence == 0 for st in stats)


def test_bench_host_tier_smoke():
    from s3kv.tools.bench.hostcopies import bench_host_tier

    r = bench_host_tier((1.0, 4.0), pages=8, objects=2, device="cuda", capacity_gib=1.0, repeats=3)
    assert r["pinned"] is True and r["bit_exact"] is True and r["register_s"] > 0
    assert r["register_return_s"] < r["register_s"]  # registration returns before the pinning ends
    assert r["host_tier_ratio_vs_memcpy"] > 0 and r["results"][0]["tier_pinned"] is True
    print(r)


def test_a_tier_of_any_size_pins_exactly_that_size():
    """PyTorch's pinned allocator rounds up to a power of two; the arena of a size that is not one
    is registered with CUDA instead: pinned, exactly its size, and copies from it are exact."""
    from s3kv.transfer.staging import StagingPool

    n = 3 * (1 << 20) + 4096
    pool = StagingPool(n, pinned=True, load_reserve_fraction=0.0)
    assert pool.pinned and pool._arena.is_pinned() and pool._arena.numel() == pool.capacity
    buf = pool.try_acquire(1 << 20)
    buf.tensor.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    dev = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
    dev.copy_(buf.tensor, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), buf.tensor)
    buf.release()


def test_a_pinned_tier_is_registered_in_the_background_then_serves_from_pinned_memory():
    """Registration returns at once; the arena is pinned on a thread of its own (with the caller's
    device current), and until then the tier holds nothing (a ghost, counted). Once ready, an object
    copied to the device straight from it is exact."""
    import time

    from s3kv.core.objects import ObjectIdentity, encode_object
    from s3kv.transfer.hosttier import HostTier

    ident = ObjectIdentity(b"n" * 16, "ab" * 8, 0, 1, 32, 1 << 20)
    t0 = time.perf_counter()
    tier = HostTier(MemoryStore(), 2 << 30, pinned=True)
    returned = time.perf_counter() - t0
    early = tier.reserve("early", ident, 0, 4)
    ready_before = tier.ready
    assert tier.wait_ready(120) and tier.pinned and tier.pool._arena.is_pinned()
    st = tier.stats()
    assert st.arena_ready and returned < st.register_s
    if not ready_before:
        assert early is not None and early.buf is None and st.not_ready == 1
    e = tier.reserve("k", ident, 0, 4)
    pages = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    buf = tier.fill_pages(e, pages)
    views = [buf.memoryview(e.base + i * (1 << 20), 1 << 20) for i in range(4)]
    assert tier.commit(e, encode_object(ident, 0, b"d" * 16, views, "k"))
    buf.release()
    entry, held = tier.acquire("k")
    dev = torch.empty(4 << 20, dtype=torch.uint8, device=DEV)
    dev.copy_(held.view(entry.base, 4 << 20), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), pages)
    held.release()
    tier.close()


@pytest.mark.parametrize("nbytes", [1 << 24, (1 << 24) + 4096 * 3 + 512])
def test_a_pinned_arena_is_exactly_its_size_pinned_and_copies_bit_exact(nbytes):
    """Registered after its pages were faulted in (``pinned_arena``), whatever the size: exactly
    ``nbytes`` (PyTorch's own pinned allocator rounds up to a power of two), zeroed, and an async
    host->device copy from anywhere in it is bit-exact."""
    from s3kv.transfer.staging import pinned_arena

    arena = pinned_arena(nbytes)
    assert arena.numel() == nbytes and arena.is_pinned() and arena[nbytes - 4096 :].is_pinned()
    assert int(arena.count_nonzero()) == 0
    pattern = torch.randint(0, 256, (nbytes - 100,), dtype=torch.uint8)
    arena[100:] = pattern
    out = torch.empty(nbytes - 100, dtype=torch.uint8, device=DEV)
    out.copy_(arena[100:], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), pattern)
