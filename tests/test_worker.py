"""WorkerCore on CPU: saves, uploads, verified loads, failures and the get_finished contract."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from s3kv.config import Settings
from s3kv.core.objects import (
    ObjectIdentity,
    ObjectSpan,
    decode_object,
    encode_object,
    header_len,
    object_metadata,
)
from s3kv.core.plan import BufferId, ConnectorMetadata, FinishPlan, LoadOp, ObjectRef, SealOp, StageOp
from s3kv.engine.index import KeyIndex
from s3kv.engine.worker import WorkerCore
from s3kv.sim.layouts import GroupSpec, make_layout, page_bytes, write_page
from s3kv.store.base import StoreWrapper, TransientError
from s3kv.store.memory import MemoryStore

# Group 0: full attention, one padded region. Group 1: sliding, two regions (data + scales).
GROUPS = [GroupSpec((0, 2), None, (192,), pad=64), GroupSpec((1, 3), 64, (128, 32))]
TPB = 16


def settings(**kw) -> Settings:
    base = dict(staging_mib=4, upload_threads=2, download_threads=4, load_timeout_s=5.0)
    base.update(kw)
    return Settings(**base)


def digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def make_core(store, *, seed=0, tp_rank=0, tp_size=1, groups=GROUPS, num_slots=32, index=None,
              failed_load_hook=True, **kw):
    """``failed_load_hook``: the engine recomputes requests named by take_failed_load_request_ids
    (rung 1; sync loads exist only there). Without it a failed parked load stays parked (rung 3)."""
    layout = make_layout(groups, num_slots=num_slots, tokens_per_block=TPB, fill_seed=seed)
    core = WorkerCore(
        settings(**kw), store, "kv", tp_rank, tp_size, model_id="test-model", kv_dtype="bf16", index=index,
        failed_load_hook=failed_load_hook,
    )
    core.register_layout(layout)
    return core, layout


def step(core, md, stream=None, finished_gen=(), started_loading=()):
    """One iteration in the engine's order."""
    core.bind(md)
    core.start_load_kv(stream)
    for layer in range(4):
        core.wait_for_layer_load(layer, stream)
        core.save_kv_layer(layer, stream)
    core.wait_for_save(stream)
    return core.get_finished(list(finished_gen), list(started_loading))


def save_object(core, rid, group, first, slots, d, capacity=None, close=True):
    bid = BufferId(rid, group, first, capacity or len(slots))
    stages = tuple(StageOp(bid, first + i, s) for i, s in enumerate(slots))
    return ConnectorMetadata(stages=stages, seals=(SealOp(bid, len(slots), d, close),))


def load_md(rid, group, d, spans, ordinals, slots, *, is_async=False):
    op = LoadOp(rid, ObjectRef(group, d, spans), tuple(ordinals), tuple(slots))
    return ConnectorMetadata(loads=(op,), async_load_ids=frozenset({rid} if is_async else ()))


class SlowStore(StoreWrapper):
    def __init__(self, inner, put_delay=0.0, get_delay=0.0):
        super().__init__(inner)
        self.put_delay = put_delay
        self.get_delay = get_delay
        self.on_put = None

    def put(self, key, data, metadata=None):
        if self.on_put:
            self.on_put(key)
        time.sleep(self.put_delay)
        return super().put(key, data, metadata)

    def get_ranges(self, key, ranges):
        time.sleep(self.get_delay)
        return super().get_ranges(key, ranges)


class GatedStore(StoreWrapper):
    """get_ranges blocks until the gate opens."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()

    def get_ranges(self, key, ranges):
        self.gate.wait(10)
        return super().get_ranges(key, ranges)


class FailingPutStore(StoreWrapper):
    def put(self, key, data, metadata=None):
        raise TransientError("503 slow down", key=key)


@pytest.fixture
def store():
    return MemoryStore()


def stored_pages(store, core, group, d):
    _, pages = decode_object(store.get(core.object_key(group, d)), core.identity(group))
    return [bytes(p) for p in pages]


# -- save then load ---------------------------------------------------------


@pytest.mark.parametrize("group", [0, 1], ids=["single-region", "multi-region"])
def test_save_upload_then_load_into_other_slots_bit_exact(store, group):
    index = KeyIndex()
    a, la = make_core(store, seed=1, index=index)
    b, lb = make_core(store, seed=2)  # another cluster: different bytes everywhere
    src = [5, 2, 9, 3]
    d = digest("obj", group)
    assert step(a, save_object(a, 1, group, 0, src, d)) == ([], [])
    assert a.flush(5)
    key = a.object_key(group, d)
    assert store.keys() == [key]
    assert index.get(key) == ObjectSpan(0, 4)
    assert stored_pages(store, a, group, d) == [page_bytes(la, group, s) for s in src]

    dst = [11, 12, 13, 14]
    before_other = page_bytes(lb, group, 15)
    step(b, load_md(7, group, d, ((0, 4),), range(4), dst))
    for s, t in zip(src, dst, strict=True):
        assert page_bytes(lb, group, t) == page_bytes(la, group, s)
    assert page_bytes(lb, group, 15) == before_other
    st = b.stats()
    assert st.pages_loaded == 4 and st.objects_loaded == 1 and st.loads_failed_objects == 0
    assert a.stats().objects_uploaded == 1 and a.stats().pages_staged == 4
    assert a.staging.in_use == 0 and b.staging.in_use == 0
    a.close()
    b.close()


def test_two_groups_in_one_iteration_and_partial_loads(store):
    a, la = make_core(store, seed=1)
    b, lb = make_core(store, seed=2)
    d0, d1 = digest("g0"), digest("g1")
    m0 = save_object(a, 1, 0, 0, [1, 2, 3, 4, 5, 6], d0)
    m1 = save_object(a, 1, 1, 4, [7, 8], d1, capacity=4)  # partial object: 2 of 4 pages
    step(a, ConnectorMetadata(stages=m0.stages + m1.stages, seals=m0.seals + m1.seals))
    assert a.flush(5)
    assert len(store.keys()) == 2
    # Load a non-contiguous subset of group 0 (two coalesced ranges) and the sliding tail of group 1.
    ops = (
        LoadOp(9, ObjectRef(0, d0, ((0, 6),)), (1, 2, 4), (20, 21, 22)),
        LoadOp(9, ObjectRef(1, d1, ((4, 2),)), (5,), (30,)),
    )
    step(b, ConnectorMetadata(loads=ops))
    assert page_bytes(lb, 0, 20) == page_bytes(la, 0, 2)
    assert page_bytes(lb, 0, 21) == page_bytes(la, 0, 3)
    assert page_bytes(lb, 0, 22) == page_bytes(la, 0, 5)
    assert page_bytes(lb, 1, 30) == page_bytes(la, 1, 8)
    a.close()
    b.close()


def test_one_object_loaded_by_two_requests_is_read_once(store):
    a, la = make_core(store, seed=1)
    b, lb = make_core(store, seed=2)
    d = digest("shared")
    step(a, save_object(a, 1, 0, 0, [1, 2], d))
    a.flush(5)
    reads = []

    class Counting(StoreWrapper):
        def get_ranges(self, key, ranges):
            reads.append(key)
            return super().get_ranges(key, ranges)

    b.store = b._downloader.store = Counting(store)
    ref = ObjectRef(0, d, ((0, 2),))
    md = ConnectorMetadata(loads=(LoadOp(3, ref, (0, 1), (10, 11)), LoadOp(4, ref, (0, 1), (12, 13))))
    step(b, md)
    assert len(reads) == 1
    assert page_bytes(lb, 0, 12) == page_bytes(lb, 0, 10) == page_bytes(la, 0, 1)
    a.close()
    b.close()


def test_a_load_of_several_objects_shares_the_connections_among_them(store):
    """Each object of a load may split its reads into the store's connections over the objects
    read at once (``stream_share``): a lone object keeps every connection, several share them,
    and the pages are the same either way."""
    a, la = make_core(store, seed=1)
    b, lb = make_core(store, seed=2, max_concurrency=12, download_threads=4)
    ds = [digest("obj", i) for i in range(6)]
    for i, d in enumerate(ds):
        step(a, save_object(a, 1, 0, 2 * i, [2 * i + 1, 2 * i + 2], d))
    assert a.flush(5)
    caps: list[list[int]] = []

    class Recording(StoreWrapper):
        def get_ranges(self, key, ranges):
            caps[-1].append(max(r.parts for r in ranges))
            return super().get_ranges(key, ranges)

    b.store = b._downloader.store = Recording(store)
    slot = iter(range(10, 32))
    # 12 connections over the objects read beside each: waves of 4 (the threads).
    for n, want in ((1, [12]), (3, [4, 4, 4]), (6, [3, 3, 3, 3, 6, 6])):
        caps.append([])
        ops = tuple(LoadOp(20 + n, ObjectRef(0, ds[i], ((2 * i, 2),)), (2 * i, 2 * i + 1), (next(slot), next(slot)))
                    for i in range(n))
        step(b, ConnectorMetadata(loads=ops))
        assert sorted(caps[-1]) == want
        for op in ops:
            for o, sl in zip(op.ordinals, op.slots, strict=True):
                assert page_bytes(lb, 0, sl) == page_bytes(la, 0, o + 1)
    a.close()
    b.close()


def test_tensor_parallel_shards_have_their_own_keys_and_bytes(store):
    r0, l0 = make_core(store, seed=10, tp_rank=0, tp_size=2)
    r1, l1 = make_core(store, seed=11, tp_rank=1, tp_size=2)
    d = digest("tp")
    md = save_object(r0, 1, 1, 0, [3, 4, 5], d)  # one plan, broadcast to both ranks
    step(r0, md)
    step(r1, md)
    assert r0.flush(5) and r1.flush(5)
    k0, k1 = r0.object_key(1, d), r1.object_key(1, d)
    assert k0 != k1 and sorted(store.keys()) == sorted([k0, k1])
    assert r0.geometry == r1.geometry and r0.keys.namespace == r1.keys.namespace
    assert stored_pages(store, r0, 1, d) != stored_pages(store, r1, 1, d)

    s0, m0 = make_core(store, seed=20, tp_rank=0, tp_size=2)
    s1, m1 = make_core(store, seed=21, tp_rank=1, tp_size=2)
    lmd = load_md(5, 1, d, ((0, 3), (0, 3)), range(3), (7, 8, 9))
    step(s0, lmd)
    step(s1, lmd)
    for src, dst in zip((3, 4, 5), (7, 8, 9), strict=True):
        assert page_bytes(m0, 1, dst) == page_bytes(l0, 1, src)
        assert page_bytes(m1, 1, dst) == page_bytes(l1, 1, src)
    # A rank-0 object is foreign to rank 1: a plan pointing rank 1 at it never loads it.
    step(s1, load_md(6, 1, d, ((0, 3), (0, 2)), range(2), (1, 2)))
    assert s1.take_failed_load_request_ids() == {6}
    for c in (r0, r1, s0, s1):
        c.close()


# -- snapshots, refcounts, staging bound -------------------------------------


def test_snapshot_seal_then_more_stages_then_final_seal(store):
    slow = SlowStore(store, put_delay=0.15)
    a, la = make_core(slow, seed=1)
    bid = BufferId(1, 0, 0, 4)
    d_snap, d_full = digest("snap"), digest("full")
    originals = [page_bytes(la, 0, s) for s in (4, 5, 6, 7)]
    step(
        a,
        ConnectorMetadata(
            stages=(StageOp(bid, 0, 4), StageOp(bid, 1, 5)), seals=(SealOp(bid, 2, d_snap, False),)
        ),
    )
    # The snapshot upload is in flight; more pages go into the same buffer, one re-stage of a pinned page.
    write_page(la, 0, 9, 0xAB)
    md2 = ConnectorMetadata(
        stages=(StageOp(bid, 2, 6), StageOp(bid, 3, 7), StageOp(bid, 1, 9)), seals=(SealOp(bid, 4, d_full),)
    )
    step(a, md2)
    assert a.staging.in_use > 0  # held by the in-flight uploads
    assert a.flush(5)
    assert a.staging.in_use == 0
    assert stored_pages(store, a, 0, d_snap) == originals[:2]
    assert stored_pages(store, a, 0, d_full) == originals
    a.close()


def test_buffer_freed_only_after_last_close(store):
    a, _ = make_core(store, seed=1)
    bid = BufferId(1, 0, 0, 2)
    step(a, ConnectorMetadata(stages=(StageOp(bid, 0, 1),), seals=(SealOp(bid, 1, digest(1), False),)))
    a.flush(5)
    assert a.staging.in_use > 0  # still open for more stages
    step(a, ConnectorMetadata(stages=(StageOp(bid, 1, 2),), seals=(SealOp(bid, 2, digest(2)),)))
    a.flush(5)
    assert a.staging.in_use == 0
    assert len(store.keys()) == 2
    a.close()


def test_staging_bound_under_a_burst(store, caplog):
    from s3kv.config import warn_once

    warn_once.cache_clear()  # the start-up warning below is said once per process
    observed = []
    slow = SlowStore(store, put_delay=0.25)  # a forward that waited for it: seconds
    groups = [GroupSpec((0,), None, (64 * 1024,))]
    a, la = make_core(slow, seed=1, groups=groups, num_slots=8, staging_mib=1)
    slow.on_put = lambda key: observed.append(a.staging.in_use)
    cap = a.staging.capacity
    total = 0
    t0 = time.monotonic()
    for it in range(10):
        stages, seals = [], []
        for r in range(4):  # 4 objects of 4 pages (256 KiB each) per iteration
            bid = BufferId(100 * it + r, 0, 0, 4)
            stages += [StageOp(bid, i, (i + r) % 8) for i in range(4)]
            seals.append(SealOp(bid, 4, digest(it, r)))
            total += 1
        step(a, ConnectorMetadata(stages=tuple(stages), seals=tuple(seals)))
        assert a.staging.in_use <= cap
    assert time.monotonic() - t0 < 2.0  # the forward never waited for the store
    assert a.flush(10)
    st = a.stats()
    assert st.saves_dropped_staging_full > 0
    assert st.seals_dropped == st.saves_dropped_staging_full
    assert st.objects_uploaded + st.saves_dropped_staging_full == total
    assert st.staging_high_water <= cap and max(observed) <= cap
    assert a.staging.in_use == 0 and st.uploads_pending == 0
    # Dropped saves are said at WARNING, at most once per 30 s (here: once, for many drops), and
    # a pool that cannot hold a few objects was flagged at start-up.
    drops = [r for r in caplog.records if "host staging full" in r.getMessage()]
    assert len(drops) == 1 and drops[0].levelname == "WARNING" and "S3KV_STAGING_MIB" in drops[0].getMessage()
    assert any("holds fewer than 4 objects" in r.getMessage() for r in caplog.records)
    a.close()


def test_slow_store_does_not_slow_wait_for_save(store):
    slow = SlowStore(store, put_delay=1.0)
    a, _ = make_core(slow, seed=1)
    seals, stages = [], []
    for r in range(4):
        m = save_object(a, r, 0, 0, [r, r + 1], digest("slow", r))
        stages += m.stages
        seals += m.seals
    a.bind(ConnectorMetadata(stages=tuple(stages), seals=tuple(seals)))
    a.start_load_kv(None)
    t0 = time.perf_counter()
    a.wait_for_save(None)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, elapsed  # waiting for one upload: 1 s (0.05 against 0.2 s was too close on a loaded host)
    assert a.get_finished([0, 1, 2, 3], []) == ([0, 1, 2, 3], [])  # pages already copied
    assert len(store.keys()) == 0  # uploads still in flight
    assert a.flush(5)
    assert len(store.keys()) == 4
    a.close()


def test_freed_page_junk_never_reaches_the_store(store):
    slow = SlowStore(store, put_delay=0.1)
    a, la = make_core(slow, seed=1)
    original = page_bytes(la, 0, 6)
    d = digest("junk")
    a.bind(save_object(a, 1, 0, 0, [6], d))
    a.start_load_kv(None)
    a.wait_for_save(None)
    write_page(la, 0, 6, 0xDB)  # the engine frees and reuses the page right away
    assert a.get_finished([1], []) == ([1], [])
    a.flush(5)
    assert stored_pages(store, a, 0, d) == [original]
    assert original != b"\xdb" * len(original)
    a.close()


def test_store_errors_drop_saves_without_raising(store):
    a, _ = make_core(FailingPutStore(store), seed=1)
    step(a, save_object(a, 1, 0, 0, [1, 2], digest("x")))
    assert a.flush(5)
    st = a.stats()
    assert st.saves_dropped_store_error == 1 and st.objects_uploaded == 0
    assert a.staging.in_use == 0
    a.close()


def test_existing_object_is_success_not_overwrite(store):
    a, la = make_core(store, seed=1)
    b, _ = make_core(store, seed=2)
    d = digest("dup")
    step(a, save_object(a, 1, 0, 0, [1], d))
    a.flush(5)
    step(b, save_object(b, 1, 0, 0, [1], d))
    b.flush(5)
    assert b.stats().objects_already_present == 1
    assert stored_pages(store, a, 0, d) == [page_bytes(la, 0, 1)]
    a.close()
    b.close()


def test_discard_drops_open_buffers_and_replay_reuses_ids(store):
    a, la = make_core(store, seed=1)
    bid = BufferId(1, 0, 0, 2)
    step(a, ConnectorMetadata(stages=(StageOp(bid, 0, 3),)))
    assert a.staging.in_use > 0
    # Replay: discard, then the same BufferId is staged afresh from other slots in the same plan.
    md = ConnectorMetadata(
        discard_ids=frozenset({1}),
        stages=(StageOp(bid, 0, 8), StageOp(bid, 1, 9)),
        seals=(SealOp(bid, 2, digest("r")),),
    )
    step(a, md)
    a.flush(5)
    assert stored_pages(store, a, 0, digest("r")) == [page_bytes(la, 0, 8), page_bytes(la, 0, 9)]
    assert a.staging.in_use == 0
    a.close()


def test_incomplete_or_unknown_seals_are_dropped_not_uploaded(store):
    a, _ = make_core(store, seed=1)
    bid = BufferId(1, 0, 0, 4)
    step(
        a,
        ConnectorMetadata(
            stages=(StageOp(bid, 0, 1), StageOp(bid, 2, 2)), seals=(SealOp(bid, 3, digest(1)),)
        ),
    )
    step(a, ConnectorMetadata(seals=(SealOp(BufferId(2, 0, 0, 4), 1, digest(2)),)))
    a.flush(5)
    assert store.keys() == []
    assert a.stats().saves_dropped_other == 2 and a.staging.in_use == 0
    a.close()


# -- load failures -------------------------------------------------------------


def _saved(store, n=3, seed=1):
    a, la = make_core(store, seed=seed)
    d = digest("victim", n)
    step(a, save_object(a, 1, 0, 0, list(range(1, n + 1)), d))
    a.flush(5)
    a.close()
    return a.object_key(0, d), d, la


def _assert_fails(b, lb, md, key, slots, caplog):
    """The failed sync load never raises into the engine: the request goes to the engine's
    failed-load hook (recomputed), its slots stay untouched, the log names the object."""
    before = [page_bytes(lb, 0, s) for s in slots]
    caplog.clear()
    step(b, md)
    assert b.take_failed_load_request_ids() == {7}
    assert b.take_failed_load_request_ids() == set()  # once
    assert key in caplog.text
    assert [page_bytes(lb, 0, s) for s in slots] == before  # slots untouched
    return caplog.text


def test_corrupted_page_fails_the_request_naming_the_object(store, caplog):
    key, d, _ = _saved(store)
    obj = store.get(key)
    store.corrupt(key, len(obj) - 5)  # inside the last page
    index = KeyIndex()
    b, lb = make_core(store, seed=2, index=index)
    e = _assert_fails(b, lb, load_md(7, 0, d, ((0, 3),), range(3), (20, 21, 22)), key, (20, 21, 22), caplog)
    assert "ChecksumMismatch" in e
    assert b.stats().loads_failed_objects == 1 and b.stats().requests_failed == 1
    # Quarantined: later lookups on this engine miss instead of promising the same broken load.
    from s3kv.engine.index import MISSING

    assert index.get(key) is MISSING
    b.close()


def test_corrupted_header_fails(store, caplog):
    key, d, _ = _saved(store)
    store.corrupt(key, 20)
    b, lb = make_core(store, seed=2)
    _assert_fails(b, lb, load_md(7, 0, d, ((0, 3),), [0], [20]), key, [20], caplog)
    b.close()


def test_deleted_object_fails(store, caplog):
    key, d, _ = _saved(store)
    store.delete_many([key])
    b, lb = make_core(store, seed=2)
    e = _assert_fails(b, lb, load_md(7, 0, d, ((0, 3),), [1], [20]), key, [20], caplog)
    assert "NotFound" in e
    b.close()


def test_foreign_object_under_our_key_fails(store, caplog):
    b, lb = make_core(store, seed=2)
    d = digest("foreign")
    key = b.object_key(0, d)
    ident = b.identity(0)
    other = ObjectIdentity(b"\x01" * 16, ident.group_fingerprint, 0, 1, TPB, ident.page_bytes)
    pages = [bytes([i]) * ident.page_bytes for i in range(2)]
    store.put(key, encode_object(other, 0, d, pages), object_metadata(other, 0, 2))
    e = _assert_fails(b, lb, load_md(7, 0, d, ((0, 2),), [0, 1], [20, 21]), key, [20, 21], caplog)
    assert "ForeignObject" in e
    b.close()


def test_span_mismatch_fails(store, caplog):
    key, d, _ = _saved(store, n=3)
    b, lb = make_core(store, seed=2)
    _assert_fails(b, lb, load_md(7, 0, d, ((0, 2),), [0], [20]), key, [20], caplog)  # plan says 2 pages, object has 3
    b.close()


def test_load_timeout_fails_and_never_writes_late(store, caplog):
    key, d, la = _saved(store)
    gated = GatedStore(store)
    b, lb = make_core(gated, seed=2, load_timeout_s=0.3)
    t0 = time.monotonic()
    e = _assert_fails(b, lb, load_md(7, 0, d, ((0, 3),), [0], [20]), key, [20], caplog)
    assert time.monotonic() - t0 < 6 and "LoadTimeout" in e  # the gate holds the read 10 s
    before = page_bytes(lb, 0, 20)
    gated.gate.set()  # the download finishes late: it must not place anything
    time.sleep(0.2)
    assert page_bytes(lb, 0, 20) == before
    b.close()


def test_sync_load_failure_of_one_request_leaves_others_loaded(store):
    key, d, la = _saved(store)
    b, lb = make_core(store, seed=2)
    ops = (
        LoadOp(7, ObjectRef(0, digest("missing"), ((0, 1),)), (0,), (20,)),
        LoadOp(8, ObjectRef(0, d, ((0, 3),)), (0, 1, 2), (21, 22, 23)),
    )
    step(b, ConnectorMetadata(loads=ops))
    assert b.take_failed_load_request_ids() == {7}
    assert page_bytes(lb, 0, 23) == page_bytes(la, 0, 3)
    b.close()


# -- async loads and the get_finished contract -----------------------------------


def test_async_ids_reported_only_after_pages_are_in_place(store):
    key, d, la = _saved(store)
    gated = GatedStore(store)
    b, lb = make_core(gated, seed=2)
    md = load_md(7, 0, d, ((0, 3),), range(3), (20, 21, 22), is_async=True)
    before = page_bytes(lb, 0, 22)
    assert step(b, md, started_loading=[7]) == ([], [])
    for _ in range(3):
        assert step(b, None) == ([], [])
    assert page_bytes(lb, 0, 22) == before
    gated.gate.set()
    deadline = time.monotonic() + 5
    got: list[int] = []
    while not got and time.monotonic() < deadline:
        got = step(b, None)[1]
        time.sleep(0.01) if not got else None
    assert got == [7]
    assert page_bytes(lb, 0, 22) == page_bytes(la, 0, 3)
    assert step(b, None) == ([], [])  # never twice
    assert b.staging.in_use == 0
    b.close()


def test_async_id_not_returned_before_it_was_passed_in(store):
    key, d, _ = _saved(store)
    b, _ = make_core(store, seed=2)
    step(b, load_md(7, 0, d, ((0, 3),), [0], [20], is_async=True))
    time.sleep(0.1)
    assert b.get_finished([], []) == ([], [])  # done, but not handed over yet
    assert b.get_finished([], [7]) == ([], [7])
    assert b.get_finished([], []) == ([], [])
    b.close()


def _two_async_loads(store):
    """Request 7 loads page 0 of a corrupted object; request 8 a good one."""
    key, d, la = _saved(store)
    good = store.get(key)
    store.corrupt(key, header_len(3) + 1)  # inside page 0, the one loaded
    d2 = digest("good")
    a, la2 = make_core(store, seed=3)
    step(a, save_object(a, 1, 0, 0, [4, 5], d2))
    a.flush(5)
    a.close()
    ops = (
        LoadOp(7, ObjectRef(0, d, ((0, 3),)), (0,), (20,)),
        LoadOp(8, ObjectRef(0, d2, ((0, 2),)), (0, 1), (21, 22)),
    )
    return key, good, la, la2, ConnectorMetadata(loads=ops, async_load_ids=frozenset({7, 8}))


def _poll(core, until, finished_gen=(), started=(), timeout=5.0):
    """get_finished every few ms (as the engine's loop does while a request is parked)."""
    deadline = time.monotonic() + timeout
    saved: list[int] = []
    loaded: list[int] = []
    first = True
    while time.monotonic() < deadline:
        s_, l_ = core.get_finished(list(finished_gen) if first else [], list(started) if first else [])
        first = False
        saved += s_
        loaded += l_
        if until(saved, loaded):
            break
        time.sleep(0.01)
    return saved, loaded


def test_failed_async_load_goes_to_the_engine_hook_and_others_are_reported(store):
    """Rung 1: the engine's failed-load hook names it (it recomputes); it is never reported loaded."""
    key, _, la, la2, md = _two_async_loads(store)
    b, lb = make_core(store, seed=2)
    before = page_bytes(lb, 0, 20)
    b.bind(md)
    b.start_load_kv(None)
    b.wait_for_save(None)
    saved, loaded = _poll(b, lambda s_, l_: s_ and l_, finished_gen=[3], started=[7, 8])
    assert saved == [3] and loaded == [8]
    assert b.take_failed_load_request_ids() == {7}
    assert b.get_finished([], []) == ([], [])  # the failed id never comes back as finished
    assert page_bytes(lb, 0, 22) == page_bytes(la2, 0, 5)
    assert page_bytes(lb, 0, 20) == before
    assert b.stats().requests_failed == 1
    b.close()


def test_failed_async_load_without_hook_stays_parked_and_is_served_once_the_object_is_good(store, caplog):
    """Rung 3 (the merged engine: no way to fail a load): the request stays parked -- visibly --
    while its object is re-read with backoff; once another engine has written it anew (here: the
    good bytes put back), the retry serves it bit-exact. Never reported loaded before that."""
    key, good, la, la2, md = _two_async_loads(store)
    b, lb = make_core(store, seed=2, failed_load_hook=False)
    b._retry_base_s = 0.05
    before = page_bytes(lb, 0, 20)
    b.bind(md)
    b.start_load_kv(None)
    b.wait_for_save(None)
    saved, loaded = _poll(b, lambda s_, l_: bool(l_), started=[7, 8])
    assert loaded == [8]
    saved, loaded = _poll(b, lambda s_, l_: bool(l_), timeout=0.5)
    assert loaded == [] and page_bytes(lb, 0, 20) == before  # parked, nothing placed
    assert b.take_failed_load_request_ids() == set()  # no hook on this engine
    c = b._counters.snapshot()
    assert c.get("rung_parked_retry") == 1 and c.get("load_retries", 0) >= 1
    assert key in caplog.text and "stays parked" in caplog.text
    store.delete_many([key])
    store.put(key, good)
    saved, loaded = _poll(b, lambda s_, l_: bool(l_))
    assert loaded == [7]
    assert page_bytes(lb, 0, 20) == page_bytes(la, 0, 1)
    assert b._counters.snapshot().get("parked_loads_recovered") == 1
    b.close()


def test_parked_request_cancelled_while_retrying_is_released(store):
    """Rung 3 ends when the request is cancelled: the engine calls request_finished, the id arrives as
    finished-generating, the retries stop and the id is returned as saved (pages may be freed)."""
    b, lb = make_core(store, seed=2, failed_load_hook=False)
    b._retry_base_s = 0.05
    b.bind(load_md(7, 0, digest("never-written"), ((0, 1),), [0], [20], is_async=True))
    b.start_load_kv(None)
    b.wait_for_save(None)
    assert _poll(b, lambda s_, l_: False, started=[7], timeout=0.3) == ([], [])
    assert b._counters.snapshot().get("rung_parked_retry") == 1
    assert b.get_finished([7], []) == ([7], [])
    assert _poll(b, lambda s_, l_: False, timeout=0.2) == ([], [])  # never reported loaded
    assert b._counters.snapshot().get("parked_loads_cancelled") == 1 and not b._loads.parked
    b.close()


def test_async_failure_before_hand_over_goes_to_the_hook(store):
    b, _ = make_core(store, seed=2)
    b.bind(load_md(7, 0, digest("nothing"), ((0, 1),), [0], [20], is_async=True))
    b.start_load_kv(None)
    b.wait_for_save(None)
    _poll(b, lambda s_, l_: bool(b._loads.failed_report), timeout=2)
    assert b.take_failed_load_request_ids() == {7}
    assert b.get_finished([], [7]) == ([], [])
    assert b.get_finished([], []) == ([], [])
    b.close()


def test_async_timeout_is_a_failed_load(store, caplog):
    key, d, _ = _saved(store)
    gated = GatedStore(store)
    b, _ = make_core(gated, seed=2, load_timeout_s=0.2)
    assert step(b, load_md(7, 0, d, ((0, 3),), [0], [20], is_async=True), started_loading=[7]) == ([], [])
    time.sleep(0.3)
    assert b.get_finished([], []) == ([], [])
    assert b.take_failed_load_request_ids() == {7}
    assert "LoadTimeout" in caplog.text
    gated.gate.set()
    b.close()


def test_handed_over_load_without_plan_fails_after_timeout(store):
    b, _ = make_core(store, seed=2, load_timeout_s=0.2)
    assert b.get_finished([], [42]) == ([], [])
    time.sleep(0.3)
    assert b.get_finished([], []) == ([], [])
    assert b.take_failed_load_request_ids() == {42}
    b.close()


def test_declared_async_id_without_loads_is_reported_on_hand_over(store):
    b, _ = make_core(store, seed=2)
    step(b, ConnectorMetadata(async_load_ids=frozenset({5})))
    assert b.get_finished([], [5]) == ([], [5])
    b.close()


def test_saving_ids_returned_once_per_hand_over(store):
    a, _ = make_core(store, seed=1)
    assert a.get_finished([], []) == ([], [])
    assert a.get_finished([5, 5], []) == ([5], [])  # nothing pending: at once, once
    assert a.get_finished([], []) == ([], [])
    assert a.get_finished([5], []) == ([5], [])  # a new hand-over
    a.close()


class _FakeEvent:
    def __init__(self):
        self.flag = threading.Event()

    def query(self):
        return self.flag.is_set()

    def synchronize(self):
        self.flag.wait(10)


def test_finishing_id_waits_for_its_stage_copies(store):
    a, la = make_core(store, seed=1)
    ev = _FakeEvent()
    real_save = a._copier.save

    def save(copies, stream):
        real_save(copies, stream)
        return ev  # pretend the copies are still running on a side stream

    a._copier.save = save
    md = save_object(a, 1, 0, 0, [2, 3], digest("fin"))
    # The stages and seal are request 1's standing finish plan: they run when it finishes.
    md = ConnectorMetadata(finish_plans=(FinishPlan(1, md.stages, md.seals),))
    assert step(a, md, finished_gen=[1, 2]) == ([2], [])  # 2 has nothing pending
    assert a.get_finished([], []) == ([], [])
    time.sleep(0.05)
    assert store.keys() == []  # the upload waits for the copy event too
    ev.flag.set()
    assert a.get_finished([], []) == ([1], [])
    assert a.get_finished([], []) == ([], [])
    assert a.flush(5) and len(store.keys()) == 1
    a.close()


def test_an_abort_waits_for_the_requests_stage_copies(store):
    """The engine frees an aborted request's pages once every rank's ``try_abort_request``
    returned: a stage copy still reading them would save another request's KV under its keys."""
    a, _ = make_core(store, seed=1)
    ev = _FakeEvent()
    real_save = a._copier.save

    def save(copies, stream):
        real_save(copies, stream)
        return ev  # the device->host copies still running on the save stream

    a._copier.save = save
    md = save_object(a, 1, 0, 0, [2, 3], digest("abort"))
    md = ConnectorMetadata(finish_plans=(FinishPlan(1, md.stages, md.seals),))
    assert step(a, md, finished_gen=[1]) == ([], [])  # handed, its copies pending
    returned = threading.Event()
    t = threading.Thread(target=lambda: returned.set() if a.try_abort_request(1) else None)
    t.start()
    assert not returned.wait(0.2)  # waits for the copies ...
    ev.flag.set()
    assert returned.wait(5)  # ... and no longer
    t.join()
    assert a.get_finished([], []) == ([], [])  # forgotten: never returned
    assert not a._saves.handed and not a._saves.finish_plans and not a._saves.copy_events
    a.close()


def test_register_once_and_close_twice(store):
    layout = make_layout(GROUPS, num_slots=8, tokens_per_block=TPB, fill_seed=1)
    a = WorkerCore(settings(), store, "kv", 0, 1, "m", "bf16")
    a.register_layout(layout)
    step(a, save_object(a, 1, 0, 0, [1], digest("m")))
    a.flush(5)
    assert a.stats().pages_staged == 1 and a.stats().objects_uploaded == 1
    with pytest.raises(RuntimeError):
        a.register_layout(layout)
    a.close()
    assert a.close() is True  # idempotent


def test_close_cancels_queued_uploads_cleanly(store):
    slow = SlowStore(store, put_delay=1.0)
    a, _ = make_core(slow, seed=1, upload_threads=1)
    for r in range(5):
        step(a, save_object(a, r, 0, 0, [r], digest("c", r)))
    t0 = time.monotonic()
    a.close(timeout=5, cancel=True)
    assert time.monotonic() - t0 < 2.5  # the one in flight may finish (1 s); the four queued would take 4 s more
    assert a.staging.in_use == 0
    assert len(store.keys()) <= 1


def test_uint8_layout_torch_types_are_plain_cpu(store):
    a, la = make_core(store, seed=1)
    assert not a.stats().staging_pinned
    assert la.group(0).regions[0].slot_tensor(0).dtype == torch.uint8
    a.close()


def test_zero_load_timeout_means_no_deadline(store):
    key, d, la = _saved(store)
    b, lb = make_core(SlowStore(store, get_delay=0.1), seed=2, load_timeout_s=0)
    step(b, load_md(7, 0, d, ((0, 3),), [2], [20]))
    assert page_bytes(lb, 0, 20) == page_bytes(la, 0, 3)
    b.close()


class KeyGatedStore(StoreWrapper):
    """get_ranges of the keys in ``blocked`` wait for the gate."""

    def __init__(self, inner, blocked):
        super().__init__(inner)
        self.blocked = set(blocked)
        self.gate = threading.Event()

    def get_ranges(self, key, ranges):
        if key in self.blocked:
            self.gate.wait(10)
        return super().get_ranges(key, ranges)


def test_failed_request_is_dropped_from_a_shared_pending_load(store):
    """7 and 8 share object X (still downloading); 7's other object is gone. 7 fails at once (engine hook),
    8 is still served, and nothing is written into 7's slots afterwards (the engine reuses them)."""
    key, d, la = _saved(store)
    gated = KeyGatedStore(store, [key])
    b, lb = make_core(gated, seed=2)
    ref = ObjectRef(0, d, ((0, 3),))
    ops = (
        LoadOp(7, ref, (0, 1), (20, 21)),
        LoadOp(7, ObjectRef(0, digest("gone"), ((0, 1),)), (0,), (22,)),
        LoadOp(8, ref, (0, 1, 2), (23, 24, 25)),
    )
    b.bind(ConnectorMetadata(loads=ops, async_load_ids=frozenset({7, 8})))
    b.start_load_kv(None)
    b.wait_for_save(None)
    before = [page_bytes(lb, 0, s) for s in (20, 21)]
    deadline = time.monotonic() + 5
    handed = [7, 8]
    while time.monotonic() < deadline and not b._loads.failed_report:
        assert b.get_finished([], handed) == ([], [])
        handed = []
        time.sleep(0.01)
    assert b.take_failed_load_request_ids() == {7}
    gated.gate.set()
    got: list[int] = []
    while not got and time.monotonic() < deadline:
        got = b.get_finished([], [])[1]
        time.sleep(0.01)
    assert got == [8]
    assert [page_bytes(lb, 0, s) for s in (23, 24, 25)] == [page_bytes(la, 0, s) for s in (1, 2, 3)]
    assert [page_bytes(lb, 0, s) for s in (20, 21)] == before  # 7's slots never written
    b.close()


def test_sync_failure_waits_for_sibling_copies_before_reporting(store):
    """A sync request with one good and one missing object: it is reported failed only after the good
    object's copies are complete (no copy may land after the engine frees the pages)."""
    key, d, la = _saved(store)
    b, lb = make_core(SlowStore(store, get_delay=0.05), seed=2)
    ops = (
        LoadOp(7, ObjectRef(0, d, ((0, 3),)), (0,), (20,)),
        LoadOp(7, ObjectRef(0, digest("gone"), ((0, 1),)), (0,), (21,)),
    )
    step(b, ConnectorMetadata(loads=ops))
    assert b.take_failed_load_request_ids() == {7}
    assert all(j.finished for j in b._loads.jobs)
    b.close()


class _KeyGate(StoreWrapper):
    """GETs of one key wait for the gate."""

    def __init__(self, inner, key):
        super().__init__(inner)
        self.key, self.gate = key, threading.Event()

    def get_ranges(self, key, ranges):
        if key == self.key:
            self.gate.wait(10)
        return super().get_ranges(key, ranges)


def test_an_audit_never_holds_up_a_load(store):
    """A failed load's suspects are audited on their own thread, outside the loads' GET slots and
    staging: with one download thread and an audit stuck on a slow object, a request's load still goes
    through at once."""
    import dataclasses

    from s3kv.transfer.download import DONE, build_jobs

    a, _ = make_core(store, seed=1)
    d_slow, d_next = digest("suspect", 3), digest("next", 3)
    step(a, save_object(a, 1, 0, 0, [1, 2, 3], d_slow))
    step(a, save_object(a, 2, 0, 0, [4, 5, 6], d_next))
    a.flush(5)
    a.close()
    slow = _KeyGate(store, a.object_key(0, d_slow))
    b, lb = make_core(slow, seed=2, download_threads=1)
    untouched = page_bytes(lb, 0, 30)
    (job,), _ = build_jobs([LoadOp(9, ObjectRef(0, d_slow, ((0, 3),)), (0,), (30,))], tp_rank=0,
                           is_async=lambda rid: True, resolve=b._rank.resolve, deadline=float("inf"))
    audit = b._loads.downloader.submit(dataclasses.replace(job, place=False, request_ids=set(), owners={}))
    t0 = time.monotonic()
    step(b, ConnectorMetadata(loads=(LoadOp(7, ObjectRef(0, d_next, ((0, 3),)), (0, 1, 2), (20, 21, 22)),)))
    assert time.monotonic() - t0 < 5 and b.take_failed_load_request_ids() == set()
    assert not audit.finished  # still waiting on its slow object
    assert b.stats().staging_in_use == 0  # and not in the loads' staging
    slow.gate.set()
    audit.future.result(timeout=10)
    assert audit.state == DONE and page_bytes(lb, 0, 30) == untouched  # verified, placed nowhere
    b.close()


def test_the_engines_exit_never_waits_for_queued_audits(tmp_path):
    """TensorRT-LLM calls no connector shutdown: the process just exits. Audits queued behind a
    slow store must not hold it (an executor's threads would run their whole queue first)."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import time, types\n"
        "from s3kv.transfer.download import Downloader, LoadJob\n"
        "from s3kv.store.base import NotFound\n"
        "class Slow:\n"
        "    def get_ranges_into(self, key, want, into):\n"
        "        time.sleep(15.0); raise NotFound('gone', key=key)\n"
        "ident = types.SimpleNamespace(page_bytes=4096, integrity=None, shard=0)\n"
        "d = Downloader(Slow(), pool=None, copier=None, threads=2)\n"
        "for i in range(6):\n"
        "    d.submit(LoadJob(key=f'k{i}', group=0, regions=(), identity=ident, first=0, count=1, last_digest=b'',\n"
        "                     targets=[(0, 0)], request_ids=set(), is_async=True, deadline=float('inf'), place=False))\n"
        "time.sleep(0.2)\n"
        "print(time.time(), flush=True)\n"
    )
    # Timed from the script's last line to the process's end, so a slow interpreter start or
    # import on a loaded machine does not count. Each audit takes 15 s: an exit that waited for
    # the one in flight, let alone the five queued, would take 15 s or more; one that does not
    # wait takes well under a second (a 1 s audit and a 2 s bound failed once on a loaded host).
    out = subprocess.run([sys.executable, str(script)], check=True, timeout=180, capture_output=True, text=True)
    assert time.time() - float(out.stdout.split()[-1]) < 10.0


def test_an_audit_never_releases_an_object_a_load_found_bad_meanwhile():
    """A suspect's audit is under way when another request's load finds the object gone: however
    the audit ends, the object stays quarantined (the load's verdict is newer than the audit's read)."""
    from concurrent.futures import Future

    from s3kv.engine.index import MISSING
    from s3kv.engine.worker.loads import LoadJobs
    from s3kv.store.base import NotFound
    from s3kv.transfer.counters import Counters
    from s3kv.transfer.download import DONE, FAILED, PENDING, LoadJob

    class Held:  # audits submitted, never run: the test ends them
        def __init__(self):
            self.jobs = []

        def submit(self, job):
            job.future = Future()
            self.jobs.append(job)
            return job

        def audits_queued(self):
            return 0

    def job(key, state, error=None):
        return LoadJob(key=key, group=0, regions=(), identity=None, first=0, count=1,  # type: ignore[arg-type]
                       last_digest=b"", targets=[], request_ids={7}, is_async=False, deadline=0.0,
                       state=state, error=error)

    index = KeyIndex(1000, 600.0, 5.0)
    loads = LoadJobs(Settings(), index, Counters(), failed_load_hook=True)
    loads.downloader = Held()  # type: ignore[assignment]
    loads.fail_now({7: ("A", "NotFound: gone")}, [job("A", FAILED), job("K", PENDING)])
    (audit,) = loads.downloader.jobs
    assert audit.key == "K" and index.get("K") is MISSING  # a suspect, quarantined
    loads.fail_now({8: ("K", "NotFound: gone")}, [job("K", FAILED, NotFound("gone", key="K"))])
    audit.state = DONE  # its read (started before the delete) was good
    audit.future.set_result(None)
    assert index.get("K") is MISSING
    # A suspect nobody condemned is released by a good audit.
    loads.fail_now({9: ("B", "NotFound: gone")}, [job("B", FAILED), job("L", PENDING)])
    audit = loads.downloader.jobs[-1]
    audit.state = DONE
    audit.future.set_result(None)
    assert index.get("L") is None


def test_closing_leaves_unread_suspects_quarantined():
    """Audits still queued when the worker closes are never run: their objects stay quarantined
    (not released unread), and only the audit that ran is counted -- as an audit, not a failed load."""
    import types

    from s3kv.engine.index import MISSING
    from s3kv.engine.worker.loads import LoadJobs
    from s3kv.store.base import NotFound
    from s3kv.transfer.counters import Counters
    from s3kv.transfer.download import Downloader, LoadJob

    class SlowGone:
        def get_ranges_into(self, key, want, into):
            time.sleep(0.3)
            raise NotFound("gone", key=key)

    ident = types.SimpleNamespace(page_bytes=4096, integrity=None, shard=0)
    counters, index = Counters(), KeyIndex(1000, 600.0, 5.0)
    loads = LoadJobs(Settings(), index, counters, failed_load_hook=True)
    loads.downloader = Downloader(SlowGone(), pool=None, copier=None, threads=2, counters=counters)  # type: ignore[arg-type]
    keys = [f"k{i}" for i in range(4)]
    loads._audit({k: LoadJob(key=k, group=0, regions=(), identity=ident, first=0, count=1, last_digest=b"",  # type: ignore[arg-type]
                             targets=[(0, 0)], request_ids={7}, is_async=False, deadline=0.0) for k in keys})
    time.sleep(0.1)
    loads.downloader.close()
    time.sleep(0.6)
    assert all(index.get(k) is MISSING for k in keys)
    snap = counters.snapshot()
    assert snap.get("objects_audited") == 1 and not snap.get("loads_failed_objects")


@pytest.mark.parametrize("reason,in_doubt", [("NotFound: gone", True), ("TransientError: 503", False)])
def test_a_gone_object_puts_the_unverified_rest_of_its_plan_in_doubt(reason: str, in_doubt: bool) -> None:
    """A failed load stops at its first failure, so which other objects of the plan it verified is
    luck: when one is gone or bad, every failed object of the plan is quarantined (not only the one
    the request failed on), the ones it never verified are quarantined as suspects (their audit is
    test_reliability.py's), and the ones it verified stay. A store outage says nothing about the
    objects: the failed entry is only dropped, the others stay."""
    from s3kv.core.objects import ObjectSpan
    from s3kv.engine.index import MISSING
    from s3kv.engine.worker.loads import LoadJobs
    from s3kv.store.base import NotFound, TransientError
    from s3kv.transfer.counters import Counters
    from s3kv.transfer.download import CANCELLED, DONE, FAILED, LoadJob

    def job(key: str, state: str, error: BaseException | None = None) -> LoadJob:
        return LoadJob(key=key, group=0, regions=(), identity=None, first=0, count=1,  # type: ignore[arg-type]
                       last_digest=b"", targets=[], request_ids={7}, is_async=False, deadline=0.0,
                       state=state, error=error)

    index = KeyIndex(1000, 600.0, 5.0)
    also = NotFound("gone too", key="d") if in_doubt else TransientError("503", key="d")
    plan = [job("a", FAILED), job("b", DONE), job("c", CANCELLED), job("d", FAILED, also)]
    index.put_many([(k, ObjectSpan(0, 1)) for k in ["a", "b", "c", "d", "other"]], [])
    loads = LoadJobs(Settings(), index, Counters(), failed_load_hook=True)
    loads.fail_now({7: ("a", reason)}, plan)
    assert index.get("a") is (MISSING if in_doubt else None)
    assert index.get("b") == ObjectSpan(0, 1)  # verified by this load
    assert index.get("c") == (MISSING if in_doubt else ObjectSpan(0, 1))  # never verified
    assert index.get("d") is (MISSING if in_doubt else None)  # failed too, though the request failed on "a"
    assert index.get("other") == ObjectSpan(0, 1)  # another plan's object: untouched
    assert loads.take_failed() == {7}


def test_a_sliding_tail_larger_than_the_staging_pool_is_named_at_registration(store, caplog):
    """A sliding group's tail is ONE object of its whole window: with 1 MiB objects but a
    4096-token window of 64 KiB pages (16 MiB tails), an 8 MiB pool can never stage a tail."""
    groups = [GroupSpec((0,), None, (64 * 1024,)), GroupSpec((1,), 4096, (64 * 1024,))]
    with caplog.at_level("WARNING"):
        make_core(store, groups=groups, num_slots=8, staging_mib=8, target_object_mib=1)
    [w] = [r for r in caplog.records if "largest object a layer group can make" in r.getMessage()]
    assert "S3KV_STAGING_MIB=8" in w.getMessage() and "16." in w.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING"):
        make_core(store, groups=groups, num_slots=8, staging_mib=8, target_object_mib=1, storage_policy="all")
    assert not any("largest object" in r.getMessage() for r in caplog.records)


def test_a_plan_asking_one_slot_for_two_pages_is_never_loaded_into_it():
    """Grouping the plan's load ops into jobs: a slot asked for two different ordinals -- within
    one op or across two ops of one object -- fails that request (a leader bug, never half-served);
    the same page asked twice for a slot, and other requests' ops, load as planned."""
    from s3kv.transfer.download import build_jobs

    a, _ = make_core(MemoryStore())
    d = digest("dup", 3)

    def jobs(*ops):
        return build_jobs(ops, tp_rank=0, is_async=lambda rid: False, resolve=a._rank.resolve, deadline=1.0)

    ref = ObjectRef(0, d, ((0, 3),))
    (job,), errors = jobs(LoadOp(1, ref, (0, 1, 0), (20, 21, 20)))  # the same page twice: fine
    assert errors == {} and job.targets == [(0, 20), (1, 21)]
    out, errors = jobs(LoadOp(1, ref, (0, 1), (20, 20)))
    assert out == [] and set(errors) == {1} and "slot 20 asked for ordinals 0 and 1" in errors[1][1]
    (job,), errors = jobs(LoadOp(1, ref, (0, 1), (20, 21)), LoadOp(2, ref, (2,), (21,)), LoadOp(3, ref, (2,), (22,)))
    assert set(errors) == {2} and job.targets == [(0, 20), (1, 21), (2, 22)] and job.request_ids == {1, 3}
    assert job.owners == {20: 1, 21: 1, 22: 3}
    a.close()


def test_a_save_refused_by_an_open_breaker_is_counted_as_such(store):
    """Saves dropped because the breaker is open are their own reason (the metric's
    ``saves_dropped_total{reason="breaker_open"}``), not a store error of that object."""
    from s3kv.store.breaker import StoreUnavailable

    class Open(StoreWrapper):
        def put(self, key, data, metadata=None):
            raise StoreUnavailable("store circuit breaker is open", key=key)

    a, _ = make_core(Open(store), seed=1)
    step(a, save_object(a, 1, 0, 0, [1, 2], digest("x")))
    assert a.flush(5)
    st = a.stats()
    assert st.saves_dropped_breaker_open == 1 and st.saves_dropped_store_error == 0
    a.close()
