"""WorkerCore on a CUDA device: pinned staging, side streams, events and stream ordering.

Skipped cleanly without CUDA. Each test drives the worker the way the engine does,
with an explicit forward stream.
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("needs a CUDA device", allow_module_level=True)

from s3kv.config import Settings  # noqa: E402
from s3kv.core.objects import decode_object, header_len  # noqa: E402
from s3kv.core.plan import BufferId, ConnectorMetadata, LoadOp, ObjectRef, SealOp, StageOp  # noqa: E402
from s3kv.engine.worker import WorkerCore  # noqa: E402
from s3kv.sim.layouts import GroupSpec, make_layout, page_bytes  # noqa: E402
from s3kv.store.base import StoreWrapper  # noqa: E402
from s3kv.store.memory import MemoryStore  # noqa: E402

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
# Realistic-ish pages: group 0 one region of 256 KiB (padded), group 1 data + scales.
GROUPS = [GroupSpec((0, 2), None, (256 * 1024,), pad=4096), GroupSpec((1, 3), 128, (64 * 1024, 4096))]
TPB = 32


def digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def make_core(store, *, seed=0, tp_rank=0, tp_size=1, groups=GROUPS, num_slots=64, **kw):
    base = dict(staging_mib=64, upload_threads=2, download_threads=4, load_timeout_s=10.0)
    base.update(kw)
    layout = make_layout(groups, num_slots=num_slots, tokens_per_block=TPB, device=DEV, fill_seed=seed)
    core = WorkerCore(Settings(**base), store, "kv", tp_rank, tp_size, "cuda-model", "bf16", failed_load_hook=True)
    core.register_layout(layout)
    return core, layout


def step(core, md, fwd, finished_gen=(), started_loading=()):
    core.bind(md)
    with torch.cuda.stream(fwd):
        core.start_load_kv(fwd)
        for layer in range(4):
            core.wait_for_layer_load(layer, fwd)
            core.save_kv_layer(layer, fwd)
        core.wait_for_save(fwd)
    return core.get_finished(list(finished_gen), list(started_loading))


def save_md(rid, group, first, slots, d, capacity=None, close=True):
    bid = BufferId(rid, group, first, capacity or len(slots))
    stages = tuple(StageOp(bid, first + i, s) for i, s in enumerate(slots))
    return ConnectorMetadata(stages=stages, seals=(SealOp(bid, len(slots), d, close),))


def load_md(rid, group, d, spans, ordinals, slots, is_async=False):
    op = LoadOp(rid, ObjectRef(group, d, spans), tuple(ordinals), tuple(slots))
    return ConnectorMetadata(loads=(op,), async_load_ids=frozenset({rid} if is_async else ()))


def stored_pages(store, core, group, d):
    _, pages = decode_object(store.get(core.object_key(group, d)), core.identity(group))
    return [bytes(p) for p in pages]


def pages_of(layout, group, slots):
    torch.cuda.synchronize()
    return [page_bytes(layout, group, s) for s in slots]


def sleep_cycles(ms: float) -> int:
    return int(ms * 1e-3 * 2.0e9)  # ~2 GHz SM clock; only needs to be "long"


class SlowStore(StoreWrapper):
    def __init__(self, inner, put_delay=0.0):
        super().__init__(inner)
        self.put_delay = put_delay

    def put(self, key, data, metadata=None):
        time.sleep(self.put_delay)
        return super().put(key, data, metadata)


class GatedStore(StoreWrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()

    def get_ranges(self, key, ranges):
        self.gate.wait(10)
        return super().get_ranges(key, ranges)


@pytest.fixture
def fwd():
    return torch.cuda.Stream(device=DEV)


@pytest.mark.parametrize("batch_copies", [True, False], ids=["batch", "per-page"])
@pytest.mark.parametrize("group", [0, 1], ids=["single-region", "multi-region"])
def test_round_trip_through_pinned_staging(group, batch_copies, fwd):
    store = MemoryStore()
    a, la = make_core(store, seed=1, batch_copies=batch_copies)
    b, lb = make_core(store, seed=2, batch_copies=batch_copies)
    assert a.stats().staging_pinned and a.staging.try_acquire(1).tensor.is_pinned()
    src, dst = [7, 3, 40, 41, 42], [10, 11, 12, 30, 5]
    d = digest("rt", group)
    step(a, save_md(1, group, 0, src, d), fwd)
    assert a.flush(10)
    assert stored_pages(store, a, group, d) == pages_of(la, group, src)
    step(b, load_md(9, group, d, ((0, 5),), range(5), dst), fwd)
    fwd.synchronize()
    assert pages_of(lb, group, dst) == pages_of(la, group, src)
    assert b.stats().pages_loaded == 5
    a.close()
    b.close()


def test_tensor_parallel_two_ranks(fwd):
    store = MemoryStore()
    r = [make_core(store, seed=10 + i, tp_rank=i, tp_size=2) for i in range(2)]
    s = [make_core(store, seed=20 + i, tp_rank=i, tp_size=2) for i in range(2)]
    d = digest("tp")
    md = save_md(1, 1, 0, [3, 4], d)
    for core, _ in r:
        step(core, md, fwd)
        assert core.flush(10)
    assert r[0][0].object_key(1, d) != r[1][0].object_key(1, d)
    lmd = load_md(5, 1, d, ((0, 2), (0, 2)), range(2), (8, 9))
    for core, _ in s:
        step(core, lmd, fwd)
    fwd.synchronize()
    for i in range(2):
        assert pages_of(s[i][1], 1, (8, 9)) == pages_of(r[i][1], 1, (3, 4))
    for core, _ in r + s:
        core.close()


def test_save_copy_sees_the_forward_and_later_kernels_wait_for_it(fwd):
    """The forward writes pages late (after a long kernel); right after wait_for_save a kernel
    on the forward stream overwrites them with 0xDB. The object must hold the forward's bytes."""
    store = MemoryStore()
    a, la = make_core(SlowStore(store, put_delay=0.05), seed=1)
    slots = list(range(0, 40, 2))  # 20 pages of 260 KiB: a copy that takes a while
    region = la.group(0).regions[0]
    fresh = torch.randint(0, 256, (len(slots), region.size), dtype=torch.uint8, device=DEV)
    expected = [bytes(fresh[i].cpu().numpy().tobytes()) for i in range(len(slots))]
    d = digest("order")
    # Warm up every kernel used below: a first (lazily loaded) launch can block the host until the
    # device is idle, which would hide the ordering under test.
    warm = torch.empty(region.size, dtype=torch.uint8, device=DEV)
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(1000)
        warm.fill_(0xDB)
        warm.copy_(fresh[0])
    torch.cuda.synchronize()
    a.bind(save_md(1, 0, 0, slots, d))
    with torch.cuda.stream(fwd):
        a.start_load_kv(fwd)
        torch.cuda._sleep(sleep_cycles(100))  # the "forward" is still running ...
        for i, s in enumerate(slots):  # ... and writes the pages at its very end
            region.slot_tensor(s).copy_(fresh[i])
        t0 = time.perf_counter()
        a.wait_for_save(fwd)
        host_wait = time.perf_counter() - t0
        for s in slots:  # the engine frees the pages; the next kernel scribbles on them
            region.slot_tensor(s).fill_(0xDB)
    assert host_wait < 0.05, host_wait  # never synchronized the forward on the host
    assert a.get_finished([1], []) == ([], [])  # the copy cannot be done yet: still behind the sleep
    fwd.synchronize()
    assert a.flush(10)
    assert stored_pages(store, a, 0, d) == expected
    assert a.get_finished([], []) == ([1], [])
    assert pages_of(la, 0, slots[:1]) == [b"\xdb" * region.size]
    a.close()


def test_load_waits_for_earlier_forward_work_and_layers_wait_for_load(fwd):
    store = MemoryStore()
    a, la = make_core(store, seed=1)
    b, lb = make_core(store, seed=2)
    d = digest("load-order")
    step(a, save_md(1, 0, 0, [1, 2, 3], d), fwd)
    assert a.flush(10)
    region = lb.group(0).regions[0]
    with torch.cuda.stream(fwd):  # warm up the kernels used below (see the save-order test)
        torch.cuda._sleep(1000)
        region.slot_tensor(63).fill_(0x11)
        region.slot_tensor(63).clone()
    torch.cuda.synchronize()
    b.bind(load_md(9, 0, d, ((0, 3),), range(3), (20, 21, 22)))
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(sleep_cycles(50))
        region.slot_tensor(22).fill_(0x11)  # earlier work still touching a slot handed to the load
        b.start_load_kv(fwd)
        b.wait_for_layer_load(0, fwd)
        seen = region.slot_tensor(22).clone()  # "the layer" reads the page
        b.wait_for_save(fwd)
    fwd.synchronize()
    want = pages_of(la, 0, [3])[0]
    assert bytes(seen.cpu().numpy().tobytes()) == want
    assert pages_of(lb, 0, [20, 21, 22]) == pages_of(la, 0, [1, 2, 3])
    a.close()
    b.close()


def test_async_load_reported_only_when_on_device(fwd):
    store = MemoryStore()
    a, la = make_core(store, seed=1)
    step(a, save_md(1, 1, 0, [5, 6], digest("async")), fwd)
    assert a.flush(10)
    gated = GatedStore(store)
    b, lb = make_core(gated, seed=2)
    md = load_md(4, 1, digest("async"), ((0, 2),), range(2), (30, 31), is_async=True)
    assert step(b, md, fwd, started_loading=[4]) == ([], [])
    assert step(b, None, fwd) == ([], [])
    gated.gate.set()
    got, deadline = [], time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = step(b, None, fwd)[1]
    assert got == [4]
    assert pages_of(lb, 1, (30, 31)) == pages_of(la, 1, (5, 6))
    assert step(b, None, fwd) == ([], [])
    a.close()
    b.close()


def test_corrupt_object_never_reaches_the_device(fwd):
    store = MemoryStore()
    a, _ = make_core(store, seed=1)
    d = digest("bad")
    step(a, save_md(1, 0, 0, [1, 2], d), fwd)
    assert a.flush(10)
    key = a.object_key(0, d)
    store.corrupt(key, header_len(2) + 7)
    b, lb = make_core(store, seed=2)
    before = pages_of(lb, 0, (20, 21))
    step(b, load_md(9, 0, d, ((0, 2),), range(2), (20, 21)), fwd)  # never raises into the engine
    assert b.take_failed_load_request_ids() == {9}  # rung 1: the engine recomputes it
    fwd.synchronize()
    assert pages_of(lb, 0, (20, 21)) == before
    a.close()
    b.close()


def test_staging_bound_and_drops_on_cuda(fwd):
    store = MemoryStore()
    a, _ = make_core(SlowStore(store, put_delay=0.02), seed=1, staging_mib=2)
    cap = a.staging.capacity
    for it in range(6):
        stages, seals = [], []
        for r in range(4):
            bid = BufferId(10 * it + r, 0, 0, 2)
            stages += [StageOp(bid, 0, r), StageOp(bid, 1, r + 8)]
            seals.append(SealOp(bid, 2, digest(it, r)))
        step(a, ConnectorMetadata(stages=tuple(stages), seals=tuple(seals)), fwd)
        assert a.staging.in_use <= cap
    assert a.flush(10)
    st = a.stats()
    assert st.saves_dropped_staging_full > 0 and st.staging_high_water <= cap
    assert st.objects_uploaded + st.saves_dropped_staging_full == 24
    assert a.staging.in_use == 0
    a.close()


def test_bench_staging_smoke():
    from s3kv.tools.bench.staging_copies import bench_staging

    r = bench_staging(page_sizes_mib=(1, 4), pages=16, device="cuda", repeats=3)
    assert r["pinned"] is True
    assert 0 < r["d2h_ratio_vs_memcpy"] and 0 < r["h2d_ratio_vs_memcpy"]
    print(r)
