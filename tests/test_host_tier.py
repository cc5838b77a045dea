"""The host tier (issue 39): its bound, its eviction by value, the write policies, and the engine
served from host memory -- bit-exact, with no store request, on every executor loop, TP 1 and 2,
sync and async loads; a rank whose tier diverged falls back to the store or the failed-load path."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
import time

import pytest
import torch

from s3kv.config import Settings
from s3kv.core.objects import ObjectIdentity, decode_object, encode_object, header_len
from s3kv.core.plan import BufferId, ConnectorMetadata, LoadOp, ObjectRef, SealOp, StageOp
from s3kv.engine.index import KeyIndex
from s3kv.engine.worker import WorkerCore
from s3kv.sim import (
    EXECUTOR_LOOPS,
    SimCacheConfig,
    SimEngine,
    gemma3_like,
    multi_turn_workload,
    repeat_workload,
)
from s3kv.sim.layouts import GroupSpec, make_layout, page_bytes
from s3kv.store.instrument import InstrumentedStore
from s3kv.store.memory import MemoryStore
from s3kv.transfer.hosttier import EVICT, NEVER, NOW, HostTier
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

TPB = 16
GROUPS = [GroupSpec((0, 2), None, (192,), pad=64), GroupSpec((1, 3), 64, (128, 32))]


def ident(page_bytes=1000, tpb=TPB, shard=0) -> ObjectIdentity:
    return ObjectIdentity(b"n" * 16, "ab" * 8, shard, 1, tpb, page_bytes)


def fill(tier: HostTier, key: str, identity: ObjectIdentity, first: int, count: int, *, to_s3=NOW, seed=0):
    """Reserve, fill and commit an object the way the upload path does; its pages (bytes)."""
    e = tier.reserve(key, identity, first, count, to_s3=to_s3)
    if e is None:
        return None
    rng = random.Random(seed)
    pages = torch.tensor([rng.randrange(256) for _ in range(count * identity.page_bytes)], dtype=torch.uint8)
    buf = tier.fill_pages(e, pages)
    if buf is not None:
        pb = identity.page_bytes
        views = [buf.memoryview(e.base + i * pb, pb) for i in range(count)]
        tier.commit(e, encode_object(identity, first, b"d" * 16, views, key))
        buf.release()
    return bytes(pages.numpy().tobytes())


# --------------------------------------------------------------------------- the tier alone


def charged(count, identity=None):
    """What the tier charges an object of ``count`` pages (its buffer, rounded to the arena's unit)."""
    base, nbytes = HostTier.layout(identity or ident(), count)
    return HostTier(MemoryStore(), 1 << 20).charge("k", nbytes, nbytes - base + header_len(count))


@pytest.mark.parametrize("weigh", [None, "x3"])
def test_the_tier_never_holds_more_than_its_size(weigh):
    """Random objects, reads and drops: the bytes charged never pass the capacity, and what it
    accounts for is exactly what it charged."""
    rng = random.Random(7)
    w = (lambda key, n: 3 * n + 11) if weigh else None
    tier = HostTier(MemoryStore(), 200_000, weigh=w)
    high = 0
    for i in range(400):
        op = rng.random()
        if op < 0.6:
            fill(tier, f"k{i}", ident(rng.choice([500, 1000, 4000])), 0, rng.randint(1, 12), seed=i)
        elif op < 0.9 and tier.keys():
            got = tier.acquire(rng.choice(tier.keys()))
            if got is not None:
                got[1].release()
        elif tier.keys():
            tier.discard(rng.choice(tier.keys()))
        st = tier.stats()
        assert st.used <= tier.capacity
        assert st.used == sum(e.charged for e in tier.entries().values())
        high = max(high, st.used)
    st = tier.stats()
    assert st.evicted > 0 and st.high_water == high <= tier.capacity
    assert st.ghosts == 0 or weigh is None  # a buffer per object with a weigher: never out of room


def test_an_object_larger_than_the_tier_is_refused_and_nothing_evicted():
    tier = HostTier(MemoryStore(), 50_000)
    fill(tier, "small", ident(), 0, 4)
    assert tier.reserve("huge", ident(), 0, 60) is None
    assert tier.keys() == ["small"] and tier.stats().too_big == 1


def test_eviction_keeps_what_is_read_and_worth_most_per_byte():
    """GDSF: a read object outlives unread ones of the same worth; of unread ones, the one that
    covers fewer tokens per byte goes first; ties go by key (every rank evicts alike)."""
    tier = HostTier(MemoryStore(), 3 * charged(4) + 100)
    for k in ("a", "b", "c"):
        fill(tier, k, ident(), 0, 4)
    tier.acquire("a")[1].release()
    fill(tier, "d", ident(), 0, 4)  # room for three: b (unread, lowest key) goes
    assert tier.keys() == ["a", "c", "d"]
    # Same bytes, more tokens per block: worth more per byte, kept over c and d.
    fill(tier, "e", ident(tpb=64), 0, 4)
    assert "e" in tier.keys() and "c" not in tier.keys()


def test_a_read_of_an_object_another_rank_lacks_raises_it_on_both_ranks():
    """Rank 1 accounts for an object as a ghost (its save was dropped) while rank 0 holds it; a
    plan's load reads it on both. Its value must rise on both, or the two tiers evict different
    objects next and rank 0's tier vouches for one rank 1 no longer has."""
    ranks = [HostTier(MemoryStore(), 2 * charged(4) + 100) for _ in range(2)]
    fill(ranks[0], "x", ident(), 0, 4)
    ranks[1].reserve("x", ident(), 0, 4, ghost=True)
    for tier in ranks:
        fill(tier, "y", ident(), 0, 4)
        got = tier.acquire("x")  # the plan's load of x, on every rank
        if got is not None:
            got[1].release()
        fill(tier, "z", ident(), 0, 4)  # room for two: the unread y goes, on both
    assert ranks[0].keys() == ranks[1].keys() == ["x", "z"]
    assert ranks[0].stats().hits == 1 and ranks[1].stats().hits == 0  # only bytes served count as hits


def test_an_object_read_long_ago_falls_behind_newer_ones():
    """Recency without a clock: each eviction raises the floor new objects start from, so an
    object read a few times long ago is evicted once enough newer objects came and went."""
    tier = HostTier(MemoryStore(), 3 * charged(4) + 100)
    fill(tier, "old", ident(), 0, 4)
    for _ in range(3):
        tier.acquire("old")[1].release()
    for i in range(20):
        fill(tier, f"new{i:02d}", ident(), 0, 4)
    assert "old" not in tier.keys()


def test_a_held_object_is_answered_like_the_store_would():
    """As an ObjectStore: HEAD and ranged reads of a held object come from memory, byte for byte
    the object the store would hold; anything else is the inner store's."""
    inner = InstrumentedStore(MemoryStore())
    tier = HostTier(inner, 1 << 20)
    idn = ident()
    pages = fill(tier, "k", idn, 3, 5)
    info = tier.head("k")
    assert info is not None and info.metadata["s3kv-first"] == "3" and info.metadata["s3kv-count"] == "5"
    whole = tier.get("k")
    header, got = decode_object(whole, idn, "k")
    assert (header.first_ordinal, header.page_count) == (3, 5) and b"".join(bytes(p) for p in got) == pages
    out = bytearray(10)
    tier.get_ranges_into("k", [_range(header_len(5) + 2, 10)], [memoryview(out)])
    assert bytes(out) == pages[2:12]
    assert inner.snapshot().requests == 0
    assert tier.head("other") is None and inner.snapshot().head == 1


def test_what_a_lookup_reads_by_digest_is_what_the_tier_serves_by_key():
    """``held(prefix)``: the entries under a group's key prefix by digest, for a lookup asking about
    thousands of ends at once -- the same objects ``span_of`` answers for, through every change."""
    idn = ident(page_bytes=100)
    tier = HostTier(MemoryStore(), 10 * charged(2, idn))
    pre, other = "ns/aa.0of1/", "ns/bb.0of1/"
    digests = [bytes([i]) * 16 for i in range(12)]

    def by_digest(prefix):
        return {d for d, e in tier.held(prefix).items() if e.ready}

    def by_key(prefix):
        return {d for d in digests if tier.span_of(prefix + d.hex()) is not None}

    for i, d in enumerate(digests[:10]):
        fill(tier, pre + d.hex(), idn, 2 * i, 2)
    e = tier.reserve(other + digests[0].hex(), idn, 0, 2)  # reserved, not filled yet: not served
    assert e is not None and by_digest(other) == by_key(other) == set()
    assert by_digest(pre) == by_key(pre) and len(by_key(pre)) == 9  # the tenth evicted the first
    tier.discard(pre + digests[5].hex())
    fill(tier, pre + digests[11].hex(), idn, 22, 2)
    assert by_digest(pre) == by_key(pre) and digests[5] not in by_digest(pre) and digests[11] in by_digest(pre)
    fill(tier, pre + digests[5].hex(), idn, 10, 2)  # the same key again, a new entry
    assert by_digest(pre) == by_key(pre) and digests[5] in by_digest(pre)
    tier.close()
    assert tier.held(pre) == {} and tier.held(other) == {}


def test_a_read_of_a_held_object_evicted_meanwhile_gets_its_bytes_and_gives_them_back():
    """An object evicted while a read of it copies (the worker thread reserving a seal) is read
    whole from the bytes the read retained, which go back to the arena afterwards."""
    idn = ident()
    tier = HostTier(MemoryStore(), 3 * HostTier.layout(idn, 5)[1])
    pages = fill(tier, "k", idn, 3, 5)

    class Evicting(list):
        """Ranges whose reading makes room for a seal that evicts ``k``."""

        def __iter__(self):
            fill(tier, "big", idn, 0, 14)
            return super().__iter__()

    got = tier.get_ranges("k", Evicting([_range(header_len(5), 10)]))
    assert got == [pages[:10]] and "k" not in tier.keys()
    tier.discard("big")
    assert tier.pool is not None and tier.pool.in_use == 0
    tier.close()


def _range(offset, length):
    from s3kv.store.base import ByteRange

    return ByteRange(offset, length)


def test_evict_policy_writes_on_eviction_only_what_a_load_read():
    inner = MemoryStore()
    written = []
    tier = HostTier(inner, 3 * charged(4) + 100, on_written=lambda k, span: written.append((k, span.first, span.count)))
    fill(tier, "read", ident(), 8, 4, to_s3=EVICT)
    fill(tier, "unread", ident(), 0, 4, to_s3=EVICT)
    fill(tier, "local", ident(), 0, 4, to_s3=NEVER)
    tier.acquire("read")[1].release()
    tier.acquire("local")[1].release()
    for i in range(4):
        fill(tier, f"x{i}", ident(), 0, 4, to_s3=NEVER)
    assert tier.flush_write_backs(10)
    assert inner.keys() == ["read"] and written == [("read", 8, 4)]
    decode_object(inner.get("read"), ident(), "read")  # the bytes the store got verify


def test_a_ghost_is_accounted_but_never_served():
    tier = HostTier(MemoryStore(), 1 << 20)
    e = tier.reserve("g", ident(), 0, 4, ghost=True)
    assert e is not None and e.buf is None
    assert tier.acquire("g") is None and tier.span_of("g") is None and tier.head("g") is None
    assert tier.stats().used == e.charged and tier.stats().ghosts == 1


class _GatedArena:
    """Stands in for the arena's allocator: allocating (and pinning, on a GPU) waits for ``open``,
    so a test sees a tier whose arena is not ready yet, for as long as it likes."""

    def __init__(self):
        import threading

        from s3kv.transfer.staging import StagingPool

        self.open = threading.Event()
        gate = self.open

        class Pool(StagingPool):
            def __init__(self, *a, **kw):
                assert gate.wait(30), "the test never opened the gate"
                super().__init__(*a, **kw)

        self.pool = Pool


@pytest.fixture
def gated(monkeypatch):
    """Tiers made from now on register in the background, each waiting for ``gated.open``."""
    import functools

    import s3kv.transfer.hosttier as hosttier_mod
    import s3kv.transfer.tiers as tiers_mod

    g = _GatedArena()
    monkeypatch.setattr(hosttier_mod, "StagingPool", g.pool)
    monkeypatch.setattr(tiers_mod, "HostTier", functools.partial(HostTier, background=True))
    yield g
    g.open.set()


def test_a_tier_not_ready_yet_holds_nothing_but_accounts_like_the_others(gated):
    """While its arena is being allocated (pinned) in the background, the tier answers nothing and
    reserves ghosts -- accounted and evicted like every rank's copy, never served -- counted; once
    ready it takes objects as usual."""
    ready = []
    tier = HostTier(MemoryStore(), 1 << 20, background=True, on_ready=lambda t: ready.append(t.pool is not None))
    assert not tier.ready and tier.pool is None and ready == []
    assert fill(tier, "early", ident(), 0, 4) is not None
    e = tier.entries()["early"]
    assert e.buf is None and not e.ready and tier.stats().used == e.charged
    assert tier.acquire("early") is None and tier.span_of("early") is None and tier.head("early") is None
    st = tier.stats()
    assert st.not_ready == 1 and st.no_room == 0 and st.ghosts == 1 and not st.arena_ready and st.register_s == 0
    gated.open.set()
    assert tier.wait_ready(10) and ready == [True]
    pages = fill(tier, "late", ident(), 0, 4)
    got = tier.acquire("late")
    assert got is not None and bytes(got[1].memoryview(got[0].base, 4000)) == pages
    got[1].release()
    st = tier.stats()
    assert st.arena_ready and st.register_s > 0 and st.not_ready == 1 and st.ghosts == 1
    assert "early" in tier.keys()  # still accounted: ranks stay in step
    tier.close()


def test_closing_a_tier_before_its_arena_is_ready_leaves_nothing_behind(gated):
    tier = HostTier(MemoryStore(), 1 << 20, background=True)
    tier.close()
    gated.open.set()
    assert not tier.wait_ready(0.5) and tier.pool is None


# --------------------------------------------------------------------------- the worker's policies


def digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def make_core(store, *, seed=0, tp_rank=0, tp_size=1, index=None, failed_load_hook=True, host_weigh=None, **kw):
    base = dict(staging_mib=4, upload_threads=2, download_threads=4, load_timeout_s=5.0, host_cache_gb=0.001)
    base.update(kw)
    layout = make_layout(GROUPS, num_slots=32, tokens_per_block=TPB, fill_seed=seed)
    core = WorkerCore(Settings(**base), store, "kv", tp_rank, tp_size, model_id="m", kv_dtype="bf16", index=index,
                      failed_load_hook=failed_load_hook, host_weigh=host_weigh)
    core.register_layout(layout)
    return core, layout


def step(core, md, finished_gen=(), started_loading=()):
    core.bind(md)
    core.start_load_kv(None)
    for layer in range(4):
        core.wait_for_layer_load(layer, None)
    core.wait_for_save(None)
    return core.get_finished(list(finished_gen), list(started_loading))


def seal_md(rid, group, slots, d, to_s3=NOW):
    bid = BufferId(rid, group, 0, len(slots))
    return ConnectorMetadata(stages=tuple(StageOp(bid, i, s) for i, s in enumerate(slots)),
                             seals=(SealOp(bid, len(slots), d, to_s3=to_s3),))


def load_md(rid, group, d, count, slots):
    return ConnectorMetadata(loads=(LoadOp(rid, ObjectRef(group, d, ((0, count),)), tuple(range(count)), tuple(slots)),))


@pytest.mark.parametrize("to_s3", [NOW, EVICT, NEVER])
def test_a_seal_lands_in_the_tier_and_in_the_store_as_its_policy_says(to_s3):
    inner = InstrumentedStore(MemoryStore())
    index = KeyIndex()
    a, la = make_core(inner, index=index, host_cache_gb=40_000 / 2**30)  # room for a few objects
    d = digest(to_s3)
    step(a, seal_md(1, 0, [3, 4, 5], d, to_s3))
    assert a.flush(10)
    key = a.object_key(0, d)
    assert a.host_tier.holds(key)
    assert (key in inner.inner.keys()) == (to_s3 == NOW)
    assert (index.get(key) is not None) == (to_s3 == NOW)  # the index only knows what the store holds
    before = inner.snapshot()
    step(a, load_md(9, 0, d, 3, [20, 21, 22]))
    assert [page_bytes(la, 0, s) for s in (20, 21, 22)] == [page_bytes(la, 0, s) for s in (3, 4, 5)]
    assert inner.snapshot().get == before.get  # served from host memory
    st = a.stats()
    assert st.host_hits == 1 and st.host_only_saves == (to_s3 != NOW)
    # Evicted: an "evict" object a load read is written to the store then; a "never" one is gone.
    for i in range(40):
        step(a, seal_md(100 + i, 0, [6, 7, 8, 9], digest("fill", i), NEVER))
        assert a.flush(10)
    assert not a.host_tier.holds(key)
    assert a.host_tier.flush_write_backs(10)
    assert (key in inner.inner.keys()) == (to_s3 in (NOW, EVICT))
    assert (index.get(key) is not None) == (to_s3 in (NOW, EVICT))
    a.close()


@pytest.mark.parametrize("to_s3", [EVICT, NEVER])
def test_a_host_only_seal_larger_than_the_tier_is_counted_as_dropped_not_as_held(to_s3):
    store = MemoryStore()
    a, _ = make_core(store, host_cache_gb=1e-9)  # a tier too small for any object
    step(a, seal_md(1, 0, [3, 4], digest("big"), to_s3))
    assert a.flush(10)
    st = a.stats()
    assert store.keys() == [] and st.seals_dropped_no_tier == 1
    a.close()


@pytest.mark.parametrize("to_s3", [EVICT, NEVER])
def test_a_host_only_seal_without_a_tier_is_dropped_and_counted(to_s3):
    store = MemoryStore()
    a, _ = make_core(store, host_cache_gb=0)
    step(a, seal_md(1, 0, [3, 4], digest("x"), to_s3))
    assert a.flush(10)
    assert store.keys() == [] and a.stats().seals_dropped_no_tier == 1 and a.stats().staging_in_use == 0
    a.close()


def test_no_tier_unless_asked_outside_an_engine():
    """-1 (auto) sizes a tier from the machine only for an engine's GPU cache: a core built by a
    tool or test, or a CPU cache, has none."""
    a, _ = make_core(MemoryStore(), host_cache_gb=-1)
    assert a.host_tier is None
    a.close()


def test_the_automatic_size_is_the_same_on_every_rank_and_within_the_container(tmp_path, monkeypatch):
    """-1 sizes every rank's tier from what reads the same on all of them (the host's total memory,
    at most the container's limit), never from what is available when each rank starts: tiers of
    different sizes evict differently, and rank 0's tier then promises objects another rank lacks."""
    from s3kv.transfer import tiers

    gib = 1 << 30
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(tiers, "CGROUP_LIMITS", (str(tmp_path / "none"),))
    monkeypatch.setattr(tiers, "MEMINFO", str(meminfo))
    sizes = []
    for available in (90, 30):  # rank 0 starts, then rank 1 while rank 0's arena is being pinned
        meminfo.write_text(f"MemTotal: {100 * gib // 1024} kB\nMemAvailable: {available * gib // 1024} kB\n")
        sizes.append(tiers.capacity_bytes(-1, "cuda"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert sizes[0] == sizes[1] == 20 * gib // gpus
    limit = tmp_path / "memory.max"
    limit.write_text(f"{40 * gib}\n")
    monkeypatch.setattr(tiers, "CGROUP_LIMITS", (str(limit),))
    assert tiers.capacity_bytes(-1, "cuda") == sizes[0] * 40 // 100
    limit.write_text("max\n")
    assert tiers.capacity_bytes(-1, "cuda") == sizes[0]


def test_a_parked_load_of_a_host_only_object_still_being_filled_here_is_served_once_it_is():
    """Rank 0's tier held the object when the plan ran; this rank's copy was still being filled
    (its upload thread behind rank 0's). The store never gets a host-only object, so on an engine
    without a failed-load hook the request parks -- and its retry must find the copy in this rank's
    tier once it is there, not re-read the store until the client cancels."""
    store = InstrumentedStore(MemoryStore())
    a, la = make_core(store, failed_load_hook=False, host_cache_gb=40_000 / 2**30)
    a._retry_base_s = 0.05
    d, count, tier, idn = digest("filling"), 3, a.host_tier, a.identity(0)
    key = a.object_key(0, d)
    e = tier.reserve(key, idn, 0, count, to_s3=NEVER)  # reserved in plan order; bytes not there yet
    ref = ObjectRef(0, d, ((0, count),))
    a.bind(ConnectorMetadata(loads=(LoadOp(7, ref, (0, 1, 2), (20, 21, 22), host=True),),
                             async_load_ids=frozenset({7})))
    a.start_load_kv(None)
    a.wait_for_save(None)
    assert a.get_finished([], [7]) == ([], [])
    deadline = time.monotonic() + 5
    while not a._counters.snapshot().get("rung_parked_retry") and time.monotonic() < deadline:
        assert a.get_finished([], []) == ([], [])
        time.sleep(0.01)
    assert a._counters.snapshot().get("rung_parked_retry") == 1  # parked: the store has no copy
    pages = torch.randint(0, 256, (count * idn.page_bytes,), dtype=torch.uint8)
    buf = tier.fill_pages(e, pages)
    views = [buf.memoryview(e.base + i * idn.page_bytes, idn.page_bytes) for i in range(count)]
    assert tier.commit(e, encode_object(idn, 0, d, views, key))
    buf.release()
    loaded: list[int] = []
    while not loaded and time.monotonic() < deadline + 5:
        loaded += a.get_finished([], [])[1]
        time.sleep(0.01)
    assert loaded == [7]
    raw = pages.numpy().tobytes()
    pb = idn.page_bytes
    assert [page_bytes(la, 0, s) for s in (20, 21, 22)] == [raw[i * pb : (i + 1) * pb] for i in range(count)]
    assert key not in store.inner.keys()
    a.close()


def test_a_corrupt_tier_copy_is_dropped_and_the_store_serves_the_load():
    store = MemoryStore()
    a, la = make_core(store, host_cache_verify=True)
    d = digest("bad")
    step(a, seal_md(1, 0, [3, 4], d))
    assert a.flush(10)
    key = a.object_key(0, d)
    e = a.host_tier.entries()[key]
    e.buf.tensor[e.base + 5] ^= 1  # a flipped bit in host memory
    step(a, load_md(9, 0, d, 2, [20, 21]))
    assert [page_bytes(la, 0, s) for s in (20, 21)] == [page_bytes(la, 0, s) for s in (3, 4)]
    st = a.stats()
    assert st.host_bad == 1 and st.host_hits == 0 and st.objects_loaded == 1
    assert not a.host_tier.holds(key)
    a.close()


def test_a_worker_whose_tier_is_not_ready_yet_saves_to_s3_and_drops_host_only_saves(gated):
    """Registration does not wait for the arena (pinned in the background): until it is ready a
    seal still goes to the store as its policy says, a host-only one is dropped and counted, and a
    load of what was saved then reads the store. Once ready, saves land in the tier again."""
    store = InstrumentedStore(MemoryStore())
    a, la = make_core(store, host_cache_gb=40_000 / 2**30)
    assert a.host_tier is not None and not a.host_tier.ready and not a.stats().host_ready
    d_now, d_never = digest("now"), digest("never")
    step(a, seal_md(1, 0, [3, 4], d_now, NOW))
    step(a, seal_md(2, 0, [5, 6], d_never, NEVER))
    assert a.flush(10)
    assert store.inner.keys() == [a.object_key(0, d_now)]  # not the host-only one
    st = a.stats()
    assert st.seals_dropped_no_tier == 1 and st.host_only_saves == 0 and st.host_inserted == 0
    assert st.staging_in_use == 0
    gets = store.snapshot().get
    step(a, load_md(9, 0, d_now, 2, [20, 21]))
    assert [page_bytes(la, 0, s) for s in (20, 21)] == [page_bytes(la, 0, s) for s in (3, 4)]
    assert store.snapshot().get > gets and a.stats().host_hits == 0
    gated.open.set()
    assert a.host_tier.wait_ready(10) and a.stats().host_ready
    d = digest("after")
    step(a, seal_md(3, 0, [7, 8], d, NEVER))
    assert a.flush(10)
    gets = store.snapshot().get
    step(a, load_md(10, 0, d, 2, [22, 23]))
    assert [page_bytes(la, 0, s) for s in (22, 23)] == [page_bytes(la, 0, s) for s in (7, 8)]
    assert store.snapshot().get == gets and a.stats().host_hits == 1
    a.close()


def test_a_tier_measures_its_copy_bandwidth_once_ready(gated):
    """The "worth loading" rule needs the tier's bandwidth: measured on the arena's own memory once
    it is allocated (in the background), before the tier takes objects."""
    a, _ = make_core(MemoryStore(), host_cache_gb=40_000 / 2**30)
    assert a.speeds["host"].bytes_per_s == float("inf")  # not measured: no hit is refused on a guess
    gated.open.set()
    assert a.host_tier.wait_ready(10)
    assert 0 < a.speeds["host"].bytes_per_s < float("inf")
    assert a.host_tier.stats().used == 0 and a.host_tier.pool.stats().in_use == 0  # its buffer is back
    a.close()


@pytest.mark.parametrize("where", ["header", "trailer"])
def test_a_hit_never_serves_a_tier_copy_whose_framing_changed_since_it_was_admitted(where):
    """A hit is placed on the calling thread without decoding the header again: the header (and
    the trailer of keyed tags) in the arena must still be the bytes checked when they were admitted.
    A changed byte there -- even with page checking off -- drops the copy; the store serves the load."""
    store = InstrumentedStore(MemoryStore())
    key_text = "0123456789abcdef0123456789abcdef-tier"
    a, la = make_core(store, integrity_key=key_text)
    d = digest("framing", where)
    step(a, seal_md(1, 1, [3, 4], d))
    assert a.flush(10)
    key = a.object_key(1, d)
    e = a.host_tier.entries()[key]
    at = e.start + 60 if where == "header" else e.base + 2 * a.identity(1).page_bytes + 3
    e.buf.tensor[at] ^= 1
    gets = store.snapshot().get
    step(a, load_md(9, 1, d, 2, [20, 21]))
    assert [page_bytes(la, 1, s) for s in (20, 21)] == [page_bytes(la, 1, s) for s in (3, 4)]
    st = a.stats()
    assert st.host_bad == 1 and st.host_hits == 0 and st.objects_loaded == 1
    assert store.snapshot().get > gets and not a.host_tier.holds(key)
    a.close()


def test_a_hit_whose_copy_fails_fails_its_request_and_releases_the_tier(monkeypatch):
    """A tier hit's copies are enqueued on the calling thread: when that fails, the load fails --
    the request takes the failed-load path, nothing is counted loaded -- and the tier's bytes are
    not held by it any more. The next load is served again."""
    import s3kv.transfer.copies as copies_mod

    store = MemoryStore()
    a, la = make_core(store)
    d = digest("copy fails")
    step(a, seal_md(1, 0, [3, 4], d))
    assert a.flush(10)
    key = a.object_key(0, d)
    real = copies_mod.copy_to_device

    def broken(copies, non_blocking=False):
        raise RuntimeError("copy engine fault (test)")

    monkeypatch.setattr(copies_mod, "copy_to_device", broken)
    step(a, load_md(9, 0, d, 2, [20, 21]))
    assert a.take_failed_load_request_ids() == {9}
    st = a.stats()
    assert st.host_hits == 0 and st.objects_loaded == 0 and st.loads_failed_objects == 1
    e = a.host_tier.entries()[key]
    assert e.ready and e.buf.refcount == 1  # only the tier's own reference
    monkeypatch.setattr(copies_mod, "copy_to_device", real)
    step(a, load_md(10, 0, d, 2, [22, 23]))
    assert [page_bytes(la, 0, s) for s in (22, 23)] == [page_bytes(la, 0, s) for s in (3, 4)]
    assert a.stats().host_hits == 1
    a.close()


def test_a_whole_object_read_from_the_store_is_kept_for_the_next_load():
    store = InstrumentedStore(MemoryStore())
    a, la = make_core(store)
    d = digest("promote")
    step(a, seal_md(1, 1, [3, 4], d))
    assert a.flush(10)
    b, lb = make_core(store, seed=5)
    step(b, load_md(9, 1, d, 2, [20, 21]))
    gets = store.snapshot().get
    step(b, load_md(10, 1, d, 2, [22, 23]))
    assert store.snapshot().get == gets
    want = [page_bytes(la, 1, s) for s in (3, 4)]
    assert [page_bytes(lb, 1, s) for s in (20, 21)] == want == [page_bytes(lb, 1, s) for s in (22, 23)]
    st = b.stats()
    assert st.host_promoted == 1 and st.host_hits == 1
    a.close()
    b.close()


def test_a_tier_whose_promoted_objects_go_unread_stops_reading_whole_objects_for_it():
    """A whole read costs GETs the load does not need: paid only while the tier's promoted objects
    are read there again. Pages weighed as 10 MiB: a 4-page object is 3 GETs whole, its first 3
    pages 2; room for one such object, so each promotion evicts the last one, unread."""
    store = InstrumentedStore(MemoryStore())
    a, la = make_core(store)
    ids = [digest("unread", i) for i in range(4)]
    for i, d in enumerate(ids):
        step(a, seal_md(1 + i, 1, [3, 4, 5, 6], d))
    assert a.flush(10)
    sim = a.host_tier.entries()[a.object_key(1, ids[0])].identity.page_bytes

    def weigh(key, nbytes):  # as the trace replay weighs a real model's pages
        n = (nbytes - header_len(0)) // (header_len(1) - header_len(0) + sim)
        return header_len(n) + n * (10 << 20)

    b, lb = make_core(store, seed=5, host_cache_gb=50 / 1024, host_weigh=weigh)
    part = lambda rid, d: ConnectorMetadata(  # noqa: E731 - the object's first 3 of 4 pages
        loads=(LoadOp(rid, ObjectRef(1, d, ((0, 4),)), (0, 1, 2), (20, 21, 22)),))
    step(b, part(10, ids[0]))
    step(b, part(11, ids[1]))  # evicts ids[0], never read again
    assert b.host_tier.promotion_read_share() < 0.5
    down = store.snapshot().bytes_down
    step(b, part(12, ids[2]))
    st = b.stats()
    assert (st.host_promoted, st.host_promotions_declined) == (2, 1)
    assert store.snapshot().bytes_down - down == header_len(4) + 3 * sim  # its own pages, not the whole
    assert [page_bytes(lb, 1, s) for s in (20, 21, 22)] == [page_bytes(la, 1, s) for s in (3, 4, 5)]
    # Read again where it is held, the tier promotes again.
    step(b, part(13, ids[1]))
    step(b, part(14, ids[1]))
    assert b.host_tier.promotion_read_share() >= 0.5
    step(b, part(15, ids[3]))
    assert b.stats().host_promoted == 3
    a.close()
    b.close()


# --------------------------------------------------------------------------- the engine


_keys = itertools.count()


class PolicyLeader(S3KvConnectorLeader):
    """The leader with every seal's ``to_s3`` set to ``TO_S3`` (the value policy's choice)."""

    TO_S3 = NOW

    def build_connector_meta(self, scheduler_output):
        md = super().build_connector_meta(scheduler_output)
        seal = lambda s: dataclasses.replace(s, to_s3=self.TO_S3)  # noqa: E731
        return dataclasses.replace(
            md, seals=tuple(map(seal, md.seals)),
            finish_plans=tuple(dataclasses.replace(p, seals=tuple(map(seal, p.seals))) for p in md.finish_plans),
        )


def engine(store, *, tp=1, loop="non-overlap", load_mode="async", leader=S3KvConnectorLeader, gb=0.05, **kw):
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, host_cache_gb=gb, load_mode=load_mode,
                 **{"lookup_timeout_s": 5.0, **kw})
    return SimEngine(gemma3_like(64, kv_heads=2), SimCacheConfig(tokens_per_block=TPB, max_seq_len=2048),
                     leader, S3KvConnectorWorker, tp_size=tp, chunk_size=48, failed_load_hook=load_mode == "sync",
                     connector_kwargs=dict(settings=s, store=store, engine_key=f"host-{next(_keys)}"),
                     **EXECUTOR_LOOPS[loop])


SPECS = multi_turn_workload(n_conversations=2, turns=2, system_len=160, first_len=96, turn_len=64, max_new_tokens=24)


def flushed(e):
    for w in e.workers:
        assert w.flush(30)


@pytest.mark.parametrize("loop", list(EXECUTOR_LOOPS))
@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_repeat_on_one_engine_is_served_from_host_memory_with_no_store_request(tp, load_mode, loop):
    store = InstrumentedStore(MemoryStore())
    with engine(store, tp=tp, loop=loop, load_mode=load_mode) as e:
        cold = e.run(SPECS)
        flushed(e)
        before = store.snapshot()
        warm = e.run(repeat_workload(SPECS, 10_000))
        flushed(e)
        after = store.snapshot()
        stats = [w.core.stats() for w in e.workers]
    assert cold.kv_mismatches == 0 and warm.kv_mismatches == 0 and warm.guard_violations == 0
    assert warm.hit_rate >= 0.9, warm.summary()
    assert (after.get, after.head, after.put) == (before.get, before.head, before.put)
    for st in stats:
        assert st.host_hits > 0 and st.host_divergence == 0 and st.objects_loaded == st.host_hits
        assert st.host_high_water <= st.host_capacity


@pytest.mark.parametrize("tp", [1, 2])
def test_a_fresh_engine_keeps_what_it_read_from_the_store(tp):
    """Engine B reads A's objects from the store once; its own repeat is then served from B's tier."""
    store = InstrumentedStore(MemoryStore())
    with engine(store, tp=tp) as a:
        a.run(SPECS)
        flushed(a)
    with engine(store, tp=tp) as b:
        first = b.run(repeat_workload(SPECS, 10_000))
        flushed(b)
        gets = store.snapshot().get
        again = b.run(repeat_workload(SPECS, 20_000))
        assert store.snapshot().get == gets
        promoted = [w.core.stats().host_promoted for w in b.workers]
    assert first.kv_mismatches == 0 and again.kv_mismatches == 0
    assert again.hit_rate >= 0.9 and all(p > 0 for p in promoted)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_host_only_object_is_never_promised_once_evicted(tp):
    """``never``: nothing reaches the store. A repeat is served from the tier; once the tier has
    evicted the first conversations (others filled it), their repeat is a miss -- never a failed
    or wrong load.

    At TP 2 the engine has the failed-load hook (sync loads), as production requires for host-only
    objects there (``WritePolicy.host_only_safe``): rank 1's tier can evict a shard rank 0 still
    holds (their admissions race their own upload threads), and only the hook lets that request be
    recomputed. Forcing ``never`` without it once left such a request parked for good (a hung run)."""
    store = InstrumentedStore(MemoryStore())
    PolicyLeader.TO_S3 = NEVER
    mode = "sync" if tp > 1 else "async"
    with engine(store, tp=tp, leader=PolicyLeader, gb=0.0006, load_mode=mode) as e:  # SPECS need ~0.4 MB
        first = e.run(SPECS)
        flushed(e)
        warm = e.run(repeat_workload(SPECS, 10_000))
        flushed(e)
        assert warm.hit_rate >= 0.9, warm.summary()
        # Enough others to fill the tier (12: a prompt-end snapshot no longer repeats in its chunk's
        # object, so each conversation keeps fewer bytes there than it did).
        others = multi_turn_workload(n_conversations=12, turns=2, system_len=160, first_len=96, turn_len=64,
                                     max_new_tokens=24, seed=99, first_id=50_000)
        e.run(others)
        flushed(e)
        late = e.run(repeat_workload(SPECS, 30_000))
        stats = [w.core.stats() for w in e.workers]
        leader = e.leader.core.stats
    snap = store.snapshot()
    # Nothing written; a read only by a rank whose tier diverged (it tries the store first, which
    # never had the object).
    assert snap.put == 0 and snap.bytes_down == 0 and (snap.get == 0 or any(st.host_divergence for st in stats))
    assert first.kv_mismatches == 0 and warm.kv_mismatches == 0 and late.kv_mismatches == 0
    assert late.hit_rate < warm.hit_rate
    assert leader.promises_broken == 0
    for st in stats:
        assert st.host_evicted > 0 and st.host_high_water <= st.host_capacity
        # A failed load only where this rank's tier diverged from rank 0's (never at TP 1): what
        # rank 0 evicted is never promised.
        assert st.loads_failed_objects <= st.host_divergence and st.requests_failed <= st.host_divergence
    assert stats[0].host_divergence == 0  # rank 0's tier is what the leader promises from


def test_a_rank_whose_tier_lost_an_object_reads_it_from_the_store():
    store = InstrumentedStore(MemoryStore())
    with engine(store, tp=2) as e:
        e.run(SPECS)
        flushed(e)
        tier1 = e.workers[1].core.host_tier
        for k in tier1.keys():
            tier1.discard(k)
        gets = store.snapshot().get
        warm = e.run(repeat_workload(SPECS, 10_000))
        st0, st1 = (w.core.stats() for w in e.workers)
    assert warm.kv_mismatches == 0 and warm.hit_rate >= 0.9
    assert st1.host_divergence > 0 and st0.host_divergence == 0
    assert store.snapshot().get > gets


def test_a_rank_whose_tier_lost_a_host_only_object_takes_the_failed_load_path():
    store = InstrumentedStore(MemoryStore())
    PolicyLeader.TO_S3 = NEVER
    with engine(store, tp=2, leader=PolicyLeader, load_mode="sync") as e:
        e.run(SPECS)
        flushed(e)
        tier1 = e.workers[1].core.host_tier
        for k in tier1.keys():
            tier1.discard(k)
        warm = e.run(repeat_workload(SPECS, 10_000))
        st1 = e.workers[1].core.stats()
    assert warm.kv_mismatches == 0  # recomputed by the engine, never served unverified
    assert st1.host_divergence > 0 and st1.rung_engine_recompute > 0
    assert any(r.recomputed_failed_load for r in warm.requests)


def test_metrics_say_which_tier_served_each_load():
    store = MemoryStore()
    with engine(store) as e:
        e.run(SPECS)
        flushed(e)
        e.run(repeat_workload(SPECS, 10_000))
        for w in e.workers:
            w.observe_metrics()
        m = e.workers[0].metrics
        st = e.workers[0].core.stats()
        assert m.value("s3kv_tier_loads_total", tier="host") == st.host_hits > 0
        assert m.value("s3kv_tier_loads_total", tier="s3") == st.objects_loaded - st.host_hits
        assert m.value("s3kv_host_tier_bytes") == st.host_used > 0
        assert m.value("s3kv_host_tier_capacity_bytes") == st.host_capacity
        assert m.value("s3kv_host_tier_events_total", event="inserted") == st.host_inserted > 0


# --------------------------------------------------------------------------- never slower than recompute


def test_a_hit_is_weighed_against_recomputing_it():
    from s3kv.core.hitrule import Span
    from s3kv.core.layout import CacheGeometry, GroupGeometry
    from s3kv.engine.leader.worth import worth_loading
    from s3kv.transfer.tiers import TierSpeed

    g = CacheGeometry(16, (GroupGeometry(0, None, (0,), (1000,)), GroupGeometry(1, 64, (1,), (1000,))), 1, "bf16", "m")
    cov = {(0, 0): {8: Span(0, 8), 16: Span(8, 16)}, (1, 0): {8: Span(4, 8), 16: Span(11, 16)}}
    host = {(0, 0, 8), (1, 0, 8)}  # the first half in host memory, the rest in S3
    fast, slow = TierSpeed(1e-4, 1e10), TierSpeed(5.0, 1e6)
    # 1000 tokens/s: 16 blocks of 16 tokens take 0.256 s to recompute.
    assert worth_loading(g, cov, host, 0, 16, 0, {"host": fast, "s3": fast}, 1000.0).h_blocks == 16
    assert worth_loading(g, cov, host, 0, 16, 0, {"host": fast, "s3": slow}, 1000.0).h_blocks == 0
    cut = worth_loading(g, cov, host, 0, 16, 0, {"host": fast, "s3": slow}, 1000.0, host_h=8)
    assert cut.h_blocks == 8 and cut.store_bytes == 0 and cut.host_bytes == (8 + 4) * 1000
    assert worth_loading(g, cov, host, 0, 16, 0, {"host": slow, "s3": slow}, 1000.0, host_h=8).h_blocks == 0


def test_the_bytes_a_hit_loads_per_tier_are_counted_as_the_load_plan_picks_them():
    """From the first needed page on, the object of smallest end covering the next page serves it
    and every page after it that it holds: the one-pass count agrees with a scan of every object per
    pick on coverages with overlaps, tails and holes."""
    from s3kv.core.hitrule import Span, required_range
    from s3kv.core.layout import CacheGeometry, GroupGeometry
    from s3kv.engine.leader.worth import _split_bytes

    g = CacheGeometry(16, (GroupGeometry(0, None, (0,), (1000,)), GroupGeometry(1, 64, (1,), (10,))), 1, "bf16", "m")
    rng = random.Random(7)
    for _ in range(300):
        cov, host = {}, set()
        for gid in (0, 1):
            spans = {}
            for _ in range(rng.randrange(12)):
                end = rng.randrange(1, 40)
                spans[end] = Span(max(0, end - rng.randrange(1, 9)), end)
                if rng.random() < 0.4:
                    host.add((gid, 0, end))
            cov[(gid, 0)] = spans
        d = rng.randrange(0, 10)
        h = rng.randrange(d + 1, 42)
        want = [0, 0]
        for grp in g.groups:
            lo, hi = required_range(grp, 16, d, h, 0)
            o = lo
            while o < hi:
                got = min((e for e, s in cov[(grp.group_id, 0)].items() if s.first <= o < s.end), default=None)
                if got is None:
                    break  # the count stops at the first page no object covers
                upto = min(cov[(grp.group_id, 0)][got].end, hi)
                want[(grp.group_id, 0, got) not in host] += (upto - o) * grp.page_bytes
                o = upto
        assert _split_bytes(g, cov, host, d, h, 0) == tuple(want)


def test_an_engine_loads_only_what_beats_recomputing_it():
    """S3 measured far slower than recomputing: a fresh engine takes no hit from it (counted
    not_worth), and where its host tier holds the first turn, a second turn loads that part only."""
    store = InstrumentedStore(MemoryStore())
    turns = multi_turn_workload(n_conversations=2, turns=2, system_len=160, first_len=96, turn_len=64,
                                max_new_tokens=24)
    first = [s for s in turns if s.request_id % 2 == 0]
    second = [dataclasses.replace(s, after=()) for s in turns if s.request_id % 2 == 1]  # prompts are fixed
    others = multi_turn_workload(n_conversations=2, turns=1, system_len=160, first_len=96, seed=5, first_id=100)
    with engine(store) as a:
        a.run(turns + others)
        flushed(a)
    with engine(store, lookup_timeout_s=-1) as b:  # lookups (and loads) follow the value: the default
        speeds = b.workers[0].core.speeds
        # Speeds are measured as loads run; a loaded machine must not make S3 look slow yet.
        speeds["s3"].observe = lambda nbytes, seconds: None  # type: ignore[method-assign]
        b.run(repeat_workload(first, 10_000))  # read from S3 (instant so far): kept in B's tier
        flushed(b)
        speeds["s3"].latency_s, speeds["s3"].bytes_per_s = 30.0, 1e3
        gets = store.snapshot().get
        cut = b.run(repeat_workload(second, 20_000))
        none = b.run(repeat_workload(others, 30_000))  # stored, in S3 only
        leader = b.leader.core.stats
    assert cut.kv_mismatches == 0 and none.kv_mismatches == 0
    assert store.snapshot().get == gets
    assert 0 < cut.matched_tokens < sum(len(s.prompt) for s in second) - 2 * 64  # the first turn's part
    assert none.matched_tokens == 0
    assert leader.offers_not_worth == 4 and leader.lookup_decisions.get("not_worth", 0) == 2


def test_stats_shows_each_tier_of_a_running_engine(tmp_path):
    """``s3kv stats --engine URL``: the bucket, and beside it what a rank's host tier served and holds
    (from its metrics endpoint); an endpoint that does not answer is one line, not a failure."""
    import json

    from click.testing import CliRunner

    from s3kv.cli import main
    from s3kv.engine.metrics import start_http_server

    with engine(MemoryStore()) as e:
        e.run(SPECS)
        flushed(e)
        e.run(repeat_workload(SPECS, 10_000))
        e.workers[0].observe_metrics()
        st = e.workers[0].core.stats()
        server = start_http_server(e.workers[0].metrics, 0)
        try:
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            args = ["stats", "--url", f"file://{tmp_path}", "--engine", url, "--engine", "http://127.0.0.1:9/metrics"]
            out = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
            text = CliRunner().invoke(main, args, catch_exceptions=False)
        finally:
            server.shutdown()
    doc = json.loads(out.stdout)
    live, dead = doc["tiers"]
    assert live["loads"] == {"host": st.host_hits, "s3": st.objects_loaded - st.host_hits} and st.host_hits > 0
    assert live["host_tier"]["bytes"] == st.host_used and live["host_tier"]["capacity_bytes"] == st.host_capacity
    assert "error" in dead
    assert f"loads from the host tier {st.host_hits}" in text.stdout and "no metrics" in text.stdout


def test_a_weigher_charges_objects_by_their_stored_size():
    """Contract 2: ``weigh(key, nbytes)`` sees each object's size as the store holds it, and the
    capacity bounds what it charges (a replay charges a real model's pages for tiny ones)."""
    from s3kv.core.objects import object_len

    seen = []

    def weigh(key, nbytes):
        seen.append((key, nbytes))
        return 1000 * nbytes

    tier = HostTier(MemoryStore(), 10_000 * 1000 + 1, weigh=weigh)
    fill(tier, "a", ident(), 0, 5)
    fill(tier, "b", ident(), 0, 5)
    assert seen == [("a", object_len(5, 1000, False)), ("b", object_len(5, 1000, False))]
    assert tier.keys() == ["b"] and tier.stats().used == 1000 * object_len(5, 1000, False)


def test_signed_objects_are_checked_in_the_tier_too():
    """With integrity keys the tier holds the object's trailer of keyed tags where the store does,
    and a hit checks it: a header re-signed by no key is refused and read from the store."""
    store = MemoryStore()
    key_text = "0123456789abcdef0123456789abcdef-tier"
    a, la = make_core(store, integrity_key=key_text)
    d = digest("signed")
    step(a, seal_md(1, 1, [3, 4], d))
    assert a.flush(10)
    key = a.object_key(1, d)
    decode_object(store.get(key), a.identity(1), key)  # the store's copy verifies
    assert bytes(a.host_tier.get(key)) == store.get(key)  # the tier's bytes are the store's
    step(a, load_md(9, 1, d, 2, [20, 21]))
    assert [page_bytes(la, 1, s) for s in (20, 21)] == [page_bytes(la, 1, s) for s in (3, 4)]
    assert a.stats().host_hits == 1
    e = a.host_tier.entries()[key]
    e.buf.tensor[e.base + 2 * a.identity(1).page_bytes + 20] ^= 1  # a bit of the trailer
    step(a, load_md(10, 1, d, 2, [22, 23]))
    assert [page_bytes(la, 1, s) for s in (22, 23)] == [page_bytes(la, 1, s) for s in (3, 4)]
    st = a.stats()
    assert st.host_bad == 1 and st.host_hits == 1 and st.objects_loaded == 2
    a.close()


def test_write_back_at_tp2_without_the_failed_load_hook_writes_through():
    """Rank 0's tier vouches for every rank's copy; a host-only object another rank's tier lost
    has no other source, and without the failed-load hook its request would stay parked. So on
    such an engine ``back`` writes through: the rank that lost its copy reads the store."""
    store = InstrumentedStore(MemoryStore())
    with engine(store, tp=2, write_policy="back", lookup_timeout_s=5.0) as e:  # async loads: no hook
        assert not e.leader.core.writes.host_only_safe
        e.run(SPECS)
        flushed(e)
        assert store.snapshot().put > 0
        tier1 = e.workers[1].core.host_tier
        for k in tier1.keys():
            tier1.discard(k)
        warm = e.run(repeat_workload(SPECS, 10_000))
        st1 = e.workers[1].core.stats()
    assert warm.kv_mismatches == 0 and warm.hit_rate >= 0.9, warm.summary()
    assert st1.host_divergence > 0 and st1.loads_failed_objects == 0


def test_write_back_stays_host_only_where_a_lost_copy_is_recomputed():
    store = InstrumentedStore(MemoryStore())
    with engine(store, tp=2, write_policy="back", load_mode="sync") as e:  # sync: the hook is on
        assert e.leader.core.writes.host_only_safe
        e.run(SPECS)
        flushed(e)
        assert store.snapshot().put == 0  # (until the tier closes: write-back of what is left)
