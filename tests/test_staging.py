"""StagingPool and the page copy helpers (CPU)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from s3kv.sim.layouts import GroupSpec, make_layout, page_bytes
from s3kv.transfer.copies import Copier, PageCopy, _pairs, copy_to_device, copy_to_host
from s3kv.transfer.staging import ALIGN, LOAD, SAVE, StagingBuffer, StagingPool, host_memoryview


def test_acquire_release_reuses_memory_and_tracks_stats():
    pool = StagingPool(64 * 1024, load_reserve_fraction=0.25)
    assert pool.capacity == 64 * 1024 and pool.save_limit == 48 * 1024
    a = pool.try_acquire(10_000)
    b = pool.try_acquire(20_000)
    assert a is not None and b is not None
    assert a.tensor.numel() == 10_000 and a.memoryview().nbytes == 10_000
    st = pool.stats()
    assert st.in_use == st.save_in_use >= 30_000 and st.high_water == st.in_use
    a.release()
    b.release()
    assert pool.in_use == 0
    assert pool.free_extents() == [(0, pool.capacity)]  # fully coalesced
    c = pool.try_acquire(40_000)
    assert c is not None and c.offset == 0  # the same memory again
    c.release()
    assert pool.stats().high_water >= 40_000


def test_saves_never_exceed_their_share_and_loads_keep_a_reserve():
    pool = StagingPool(64 * 1024, load_reserve_fraction=0.25)
    saves = []
    while (b := pool.try_acquire(4096, SAVE)) is not None:
        saves.append(b)
    assert sum(b.reserved for b in saves) <= pool.save_limit
    assert pool.stats().save_drops == 1
    # The reserve is still there for loads.
    loads = []
    while (b := pool.try_acquire(4096, LOAD)) is not None:
        loads.append(b)
    assert len(loads) == (pool.capacity - pool.save_limit) // 4096
    st = pool.stats()
    assert st.in_use <= st.capacity and st.load_drops == 1
    for b in saves + loads:
        b.release()
    assert pool.in_use == 0


def test_too_large_request_is_refused_at_once():
    pool = StagingPool(8192)
    assert pool.try_acquire(8193, LOAD) is None
    assert pool.try_acquire(pool.save_limit + 1, SAVE) is None
    assert pool.stats().drops == 2


def test_refcount_frees_after_last_release():
    pool = StagingPool(8192)
    b = pool.try_acquire(1000)
    assert b is not None
    b.retain()
    b.release()
    assert pool.in_use == ALIGN * 4  # still held by the second reference
    b.release()
    assert pool.in_use == 0
    with pytest.raises(RuntimeError):
        b.release()


def test_views_alias_the_arena_without_copies():
    pool = StagingPool(8192)
    b = pool.try_acquire(512)
    assert b is not None
    b.view(10, 4).fill_(7)
    assert bytes(b.memoryview(10, 4)) == b"\x07" * 4
    b.memoryview(100, 3)[:] = b"abc"
    assert b.tensor[100:103].tolist() == [97, 98, 99]
    with pytest.raises(IndexError):
        b.view(500, 100)
    b.release()


def test_random_alloc_free_never_overlaps_or_exceeds_bound():
    rng = random.Random(3)
    pool = StagingPool(1 << 20, load_reserve_fraction=0.0)
    live: list[StagingBuffer] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).release()
        else:
            b = pool.try_acquire(rng.randrange(1, 100_000), rng.choice([SAVE, LOAD]))
            if b is not None:
                live.append(b)
        spans = sorted((b.offset, b.offset + b.reserved) for b in live)
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
        assert pool.in_use == sum(b.reserved for b in live) <= pool.capacity
    for b in live:
        b.release()
    assert pool.free_extents() == [(0, pool.capacity)]


def test_concurrent_acquire_release_is_consistent():
    pool = StagingPool(256 * 1024, load_reserve_fraction=0.0)

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(500):
            b = pool.try_acquire(rng.randrange(1, 30_000))
            if b is not None:
                assert pool.in_use <= pool.capacity
                b.release()

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.in_use == 0 and pool.free_extents() == [(0, pool.capacity)]


def test_standalone_buffer_and_host_memoryview():
    b = StagingBuffer.standalone(100)
    assert not b.pooled and b.nbytes == 100
    b.memoryview()[:] = bytes(range(100))
    assert b.tensor.tolist() == list(range(100))
    b.release()
    t = torch.arange(8, dtype=torch.uint8)
    assert bytes(host_memoryview(t)) == bytes(range(8))


def test_cpu_pool_is_not_pinned():
    pool = StagingPool.for_device(4096, torch.device("cpu"), pinned=True)
    assert not pool.pinned


@pytest.mark.parametrize("pad", [0, 16])
@pytest.mark.parametrize("sizes", [(128,), (96, 32)])
def test_page_copies_round_trip_scattered_and_adjacent(pad, sizes):
    layout = make_layout([GroupSpec((0, 1), None, sizes, pad)], num_slots=12, fill_seed=5)
    regions = tuple(layout.group(0).regions)
    pb = sum(sizes)
    slots = [3, 4, 5, 9, 0, 1]  # runs of adjacent slots and scattered ones
    host = torch.zeros(len(slots) * pb, dtype=torch.uint8)
    copies = [PageCopy(regions, s, host, i * pb) for i, s in enumerate(slots)]
    if len(sizes) == 1 and pad == 0:
        assert len(list(_pairs(copies))) == 3  # [3,4,5] [9] [0,1]
    copy_to_host(copies)
    raw = bytes(host_memoryview(host))
    for i, s in enumerate(slots):
        assert raw[i * pb : (i + 1) * pb] == page_bytes(layout, 0, s)
    # And back into other slots.
    dst = [6, 7, 8, 10, 11, 2]
    back = [PageCopy(regions, s, host, i * pb) for i, s in enumerate(dst)]
    copy_to_device(back)
    for i, s in enumerate(dst):
        assert page_bytes(layout, 0, s) == raw[i * pb : (i + 1) * pb]


def test_cpu_copier_has_no_events():
    layout = make_layout([GroupSpec((0,), None, (64,))], num_slots=4)
    regions = tuple(layout.group(0).regions)
    c = Copier(torch.device("cpu"))
    host = torch.zeros(64, dtype=torch.uint8)
    assert c.save([PageCopy(regions, 1, host, 0)], None) is None
    c.begin_loads(None)
    assert c.load([PageCopy(regions, 2, host, 0)]) is None
    assert Copier.done(None)
    assert page_bytes(layout, 0, 2) == page_bytes(layout, 0, 1)


def test_bench_staging_runs_on_cpu():
    from s3kv.tools.bench.staging_copies import bench_staging

    r = bench_staging(page_sizes_mib=(1 / 64, 1 / 16), pages=8, device="cpu", repeats=2)
    assert len(r["results"]) == 2 and r["pinned"] is False
    assert r["copy_path"] == "cpu" and r["bit_exact"] is True
    for k in ("d2h_ratio_vs_memcpy", "h2d_ratio_vs_memcpy", "d2h_gbps", "h2d_gbps"):
        assert r[k] > 0


def test_host_memoryview_keeps_a_temporary_tensor_alive():
    import gc

    view = host_memoryview(torch.full((1 << 20,), 7, dtype=torch.uint8))
    gc.collect()
    junk = [torch.full((1 << 20,), 1, dtype=torch.uint8) for _ in range(8)]  # reuse freed memory if any
    assert bytes(view[:16]) == b"\x07" * 16 and len(junk) == 8


# -- batched copies: address segments (the CUDA batch path's input) ------------------


def _memmove_segments(seg, to_host: bool) -> None:
    """Apply segments with plain memmove: on CPU the addresses are process addresses, so this
    checks the address arithmetic byte for byte without a GPU."""
    import ctypes

    for d, h, n in zip(seg.device, seg.host, seg.sizes, strict=True):
        ctypes.memmove(h, d, n) if to_host else ctypes.memmove(d, h, n)


@pytest.mark.parametrize(
    "spec",
    [GroupSpec((0,), None, (512,)), GroupSpec((0,), None, (512,), pad=64), GroupSpec((0, 1), 64, (256, 64, 32))],
    ids=["packed", "padded", "multi-region"],
)
def test_segments_move_exactly_the_pages_bytes(spec):
    from s3kv.transfer.copies import segments

    layout = make_layout([spec], num_slots=16, fill_seed=3)
    regions = tuple(layout.group(0).regions)
    pb = sum(spec.region_sizes)
    slots = [3, 4, 5, 9, 0, 1, 15]
    host = torch.zeros(len(slots) * pb + 100, dtype=torch.uint8)[50:-50]  # a view: data_ptr is offset
    copies = [PageCopy(regions, s, host, i * pb) for i, s in enumerate(slots)]
    seg = segments(copies)
    assert sum(seg.sizes) == len(slots) * pb
    _memmove_segments(seg, to_host=True)
    raw = bytes(host_memoryview(host))
    for i, s in enumerate(slots):
        assert raw[i * pb : (i + 1) * pb] == page_bytes(layout, 0, s)
    # Back into other slots, through the same arithmetic.
    dst = [6, 7, 8, 10, 11, 2, 12]
    _memmove_segments(segments([PageCopy(regions, s, host, i * pb) for i, s in enumerate(dst)]), to_host=False)
    for i, s in enumerate(dst):
        assert page_bytes(layout, 0, s) == raw[i * pb : (i + 1) * pb]
    for s in (13, 14):  # untouched slots keep their bytes
        assert page_bytes(layout, 0, s) == page_bytes(make_layout([spec], num_slots=16, fill_seed=3), 0, s)


def test_segments_merge_only_ranges_adjacent_on_both_sides():
    from s3kv.transfer.copies import segments

    packed = tuple(make_layout([GroupSpec((0,), None, (128,))], num_slots=16).group(0).regions)
    padded = tuple(make_layout([GroupSpec((0,), None, (128,), pad=8)], num_slots=16).group(0).regions)
    host = torch.zeros(8 * 128, dtype=torch.uint8)
    # Slots 3,4,5 into host pages 0,1,2: one range; slot 9 -> page 3: another; slot 10 -> page 5 (gap): a third.
    seg = segments([PageCopy(packed, s, host, o * 128) for s, o in ((3, 0), (4, 1), (5, 2), (9, 3), (10, 5))])
    assert seg.sizes == [3 * 128, 128, 128]
    base = packed[0].as_tensor().data_ptr()
    assert seg.device == [base + 3 * 128, base + 9 * 128, base + 10 * 128]
    assert seg.host == [host.data_ptr(), host.data_ptr() + 3 * 128, host.data_ptr() + 5 * 128]
    # Padded slots are never adjacent in device memory.
    assert len(segments([PageCopy(padded, s, host, i * 128) for i, s in enumerate((3, 4, 5))]).sizes) == 3


def test_segments_reject_slots_and_offsets_outside_their_buffers():
    from s3kv.transfer.copies import segments

    regions = tuple(make_layout([GroupSpec((0,), None, (128,))], num_slots=4).group(0).regions)
    host = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(IndexError, match="slot 4"):
        segments([PageCopy(regions, 4, host, 0)])
    with pytest.raises(IndexError, match="slot -1"):
        segments([PageCopy(regions, -1, host, 0)])
    with pytest.raises(ValueError, match="staging buffer"):
        segments([PageCopy(regions, 0, host, 200)])
    with pytest.raises(ValueError, match="uint8"):
        segments([PageCopy(regions, 0, torch.zeros(64, dtype=torch.int32), 0)])


def test_without_cuda_copies_are_plain_and_no_batch_is_bound():
    from s3kv.transfer.memcpy_batch import MemcpyBatch

    assert Copier(torch.device("cpu")).path == "cpu"
    if not torch.cuda.is_available():
        assert MemcpyBatch.load() is None


def test_segments_ask_each_region_for_its_tensor_once_per_copier():
    from s3kv.transfer.copies import segments

    class Counting:
        def __init__(self, inner):
            self.inner, self.size, self.calls = inner, inner.size, 0

        def as_tensor(self):
            self.calls += 1
            return self.inner.as_tensor()

    (inner,) = make_layout([GroupSpec((0,), None, (64,))], num_slots=8).group(0).regions
    region = Counting(inner)
    host = torch.zeros(128, dtype=torch.uint8)
    cache: dict = {}
    for _ in range(3):
        seg = segments([PageCopy((region,), 2, host, 0), PageCopy((region,), 7, host, 64)], cache)
        assert seg.device == [inner.as_tensor().data_ptr() + 2 * 64, inner.as_tensor().data_ptr() + 7 * 64]
    assert region.calls == 1
    segments([PageCopy((region,), 1, host, 0)])  # no cache: asks again
    assert region.calls == 2


# -- the batch loop and the ctypes binding, driven on CPU ------------------------------


class _MemmoveBatch:
    """Stands in for MemcpyBatch on CPU: the addresses are process addresses."""

    def __init__(self, fail_on=()):
        self.calls: list[int] = []
        self.fail_on = set(fail_on)

    def copy(self, dsts, srcs, sizes, stream):
        import ctypes

        from s3kv.transfer.memcpy_batch import MemcpyBatchError

        assert stream == 1234
        self.calls.append(len(sizes))
        if len(self.calls) in self.fail_on:
            raise MemcpyBatchError("cudaMemcpyBatchAsync failed with cudaError 1 (test)")
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            assert n > 0
            ctypes.memmove(d, s, n)


class _Stream:
    cuda_stream = 1234


def _batched_copier(batch):
    c = Copier(torch.device("cpu"))
    c._batch = batch
    c._pinned = lambda copies: True  # noqa: ARG005 - host memory stands in for pinned
    return c


@pytest.mark.parametrize("fail_on", [(), (1,), (3,)], ids=["ok", "first-refused", "third-refused"])
def test_enqueue_hands_pages_over_in_doubling_batches_and_falls_back(fail_on):
    spec = GroupSpec((0, 1), 64, (96, 32), pad=16)
    layout = make_layout([spec], num_slots=200, fill_seed=7)
    regions = tuple(layout.group(0).regions)
    pb = 128
    slots = random.Random(1).sample(range(200), 150)
    host = torch.zeros(150 * pb, dtype=torch.uint8)
    batch = _MemmoveBatch(fail_on)
    c = _batched_copier(batch)
    c._enqueue([PageCopy(regions, s, host, i * pb) for i, s in enumerate(slots)], True, _Stream())
    raw = bytes(host_memoryview(host))
    for i, s in enumerate(slots):
        assert raw[i * pb : (i + 1) * pb] == page_bytes(layout, 0, s)
    if not fail_on:
        # 4, 8, 16, 32, 64 pages, then the last 26; two regions, never adjacent (padded): 2 copies a page.
        assert batch.calls == [2 * n for n in (4, 8, 16, 32, 64, 26)]
    else:
        assert len(batch.calls) == fail_on[0]  # stopped at the refusal, the rest went per page
        assert c._batch is batch  # one refusal does not turn batching off
    # Loads back into other slots, through the same loop.
    dst = [s for s in range(200) if s not in set(slots)][:50]
    c._enqueue([PageCopy(regions, s, host, i * pb) for i, s in enumerate(dst)], False, _Stream())
    for i, s in enumerate(dst):
        assert page_bytes(layout, 0, s) == raw[i * pb : (i + 1) * pb]


def test_batching_stops_after_refusals_in_a_row():
    layout = make_layout([GroupSpec((0,), None, (64,))], num_slots=8, fill_seed=1)
    regions = tuple(layout.group(0).regions)
    host = torch.zeros(64, dtype=torch.uint8)
    batch = _MemmoveBatch(fail_on=range(1, 100))
    c = _batched_copier(batch)
    for k in range(3):
        c._enqueue([PageCopy(regions, 5, host, 0)], True, _Stream())
        assert bytes(host_memoryview(host)) == page_bytes(layout, 0, 5)
        assert (c._batch is None) == (k == 2)


def test_a_region_without_a_row_view_goes_per_page_and_empty_regions_are_skipped():
    from s3kv.transfer.copies import Unbatchable, segments

    class Flat:
        def __init__(self, inner):
            self.inner, self.size, self.stride = inner, inner.size, inner.stride

        def as_tensor(self):
            return self.inner.as_tensor().reshape(-1)  # 1-D: no row arithmetic possible

        def slot_tensor(self, slot):
            return self.inner.slot_tensor(slot)

    (inner,) = make_layout([GroupSpec((0,), None, (64,))], num_slots=8, fill_seed=2).group(0).regions
    host = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(Unbatchable):
        segments([PageCopy((Flat(inner),), 3, host, 0)])
    batch = _MemmoveBatch()
    c = _batched_copier(batch)
    c._enqueue([PageCopy((Flat(inner),), 3, host, 0)], True, _Stream())
    assert bytes(host_memoryview(host)) == bytes(host_memoryview(inner.slot_tensor(3).contiguous()))
    assert batch.calls == [] and c._batch is batch
    # A zero-byte region adds no segment (the driver refuses a batch holding one).
    (empty,) = make_layout([GroupSpec((0,), None, (0,), pad=8)], num_slots=8).group(0).regions
    seg = segments([PageCopy((inner, empty), 3, host, 0)])
    assert seg.sizes == [64]


@pytest.mark.parametrize("version,with_failidx", [(12080, True), (12090, True), (13000, False), (13020, False)])
def test_batch_binding_passes_the_runtime_versions_arguments(version, with_failidx):
    import ctypes

    from s3kv.transfer.memcpy_batch import MemcpyBatch, MemcpyBatchError

    seen: list[tuple] = []
    cleared: list[int] = []

    def fake_call(*args):
        seen.append(args)
        return fake_call.rc

    fake_call.rc = 0
    lib = type("Lib", (), {})()
    lib.cudaMemcpyBatchAsync = fake_call
    lib.cudaGetLastError = lambda: cleared.append(1)
    b = MemcpyBatch(lib, version, "libcudart-test")
    b.copy([10, 20], [30, 40], [5, 6], 99)
    (args,) = seen
    assert len(args) == (9 if with_failidx else 8)
    dst, src, size, count = args[:4]
    assert list(dst) == [10, 20] and list(src) == [30, 40] and list(size) == [5, 6] and count.value == 2
    assert args[-1].value == 99 and args[6].value == 1  # one attributes entry, the stream last
    attrs = ctypes.cast(args[4], ctypes.POINTER(type(b._attrs))).contents
    assert attrs.srcAccessOrder == 1 and list(args[5]) == [0]
    fake_call.rc = 1
    with pytest.raises(MemcpyBatchError, match="cudaError 1"):
        b.copy([1], [2], [3], 99)
    assert cleared == [1]  # the runtime's last error is cleared, not left for PyTorch to trip on
    with pytest.raises(MemcpyBatchError, match="default stream"):
        b.copy([1], [2], [3], 0)
    b.copy([], [], [], 99)  # nothing to do: no call
    assert len(seen) == 2


def test_pinned_cache_asks_once_per_base_and_never_trusts_a_dead_entry():
    import gc

    from s3kv.transfer.copies import _PinnedCache

    (region,) = make_layout([GroupSpec((0,), None, (64,))], num_slots=4).group(0).regions
    cache = _PinnedCache()
    arena = torch.zeros(1024, dtype=torch.uint8)
    views = [arena[i * 64 : (i + 1) * 64] for i in range(4)]
    assert cache([PageCopy((region,), i, v, 0) for i, v in enumerate(views)]) is False  # plain memory
    assert list(cache._known) == [id(arena)]
    ref = cache._known[id(arena)][0]
    del arena, views
    gc.collect()
    assert ref() is None  # a new tensor that reuses the id is asked again, not given this answer
