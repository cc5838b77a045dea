"""Finding the largest servable prefix in few HEAD waves (s3kv/core/lookup.py, LeaderCore lookups)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from s3kv.config import Settings
from s3kv.core.hitrule import Span, servable
from s3kv.core.keys import KeyScheme, chain_digests, chain_root, namespace_digest
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.core.lookup import LookupParams, find_hit
from s3kv.core.objects import ObjectIdentity, encode_object, object_metadata
from s3kv.engine.index import KeyIndex
from s3kv.engine.leader import LeaderCore
from s3kv.store.base import HeadBatch, StoreError, StoreWrapper, TransientError
from s3kv.store.memory import MemoryStore

TPB = 32
SLIDING = 0
FULL = 1


def geo(tp: int = 1, window: int = 128, full: bool = True) -> CacheGeometry:
    groups = [GroupGeometry(0, window, (0, 1, 2), (64,))]
    if full:
        groups.append(GroupGeometry(1, None, (3,), (64,)))
    return CacheGeometry(tokens_per_block=TPB, groups=tuple(groups), tp_size=tp, kv_dtype="bf16", model_id="m")


class FakeProber:
    """Answers asks from a dict of stored objects; one call = one HEAD wave."""

    def __init__(self, objects: dict[tuple[int, int, int], Span]):
        self.objects = objects
        self.waves: list[set] = []

    def __call__(self, asks):
        self.waves.append(set(asks))
        return {a: self.objects.get(a) for a in asks}


def stored(g: CacheGeometry, n_blocks: int, bpo: int, *, snapshot: bool = True) -> dict:
    """Every group x shard holds chunks ending at multiples of ``bpo`` up to ``n_blocks``,
    plus the prompt-end snapshot ending at ``n_blocks`` (what the "all" policy saves)."""
    objs = {}
    for grp in g.groups:
        for s in range(g.tp_size):
            for end in range(bpo, n_blocks + 1, bpo):
                objs[(grp.group_id, s, end)] = Span(end - bpo, end)
            if snapshot and n_blocks % bpo:
                first = n_blocks // bpo * bpo
                objs[(grp.group_id, s, n_blocks)] = Span(first, n_blocks)
    return objs


def coverage_of(objs: dict) -> dict:
    cov: dict = {}
    for (g, s, e), sp in objs.items():
        cov.setdefault((g, s), {})[e] = sp
    return cov


def run_lookup(g, objs, prompt_len, *, bpo, d_blocks=0, cp_blocks=None, budget=128):
    params = LookupParams(
        blocks_per_object=bpo, checkpoint_blocks=cp_blocks or 128 // bpo * bpo or bpo, margin=1, budget=budget
    )
    prober = FakeProber(objs)
    res = find_hit(g, params, d_blocks, prompt_len // TPB, (prompt_len - 1) // TPB, prober)
    assert res.waves == len(prober.waves)
    return res, prober


# ---------------------------------------------------------------- wave counts


@pytest.mark.parametrize("tp", [1, 2])
def test_4096_block_prefix_bpo1_in_at_most_3_waves(tp):
    g = geo(tp=tp)
    n = 4096
    objs = stored(g, n, 1)
    res, prober = run_lookup(g, objs, n * TPB + 7, bpo=1)
    assert res.h_blocks == n
    assert len(prober.waves) <= 3
    assert servable(g, coverage_of(objs), 0, res.h_blocks, 1)


@pytest.mark.parametrize("stored_blocks", [1, 31, 1000, 2500, 4095])
def test_partial_prefix_of_long_prompt_in_at_most_3_waves(stored_blocks):
    g = geo()
    objs = stored(g, stored_blocks, 1)
    res, prober = run_lookup(g, objs, 4096 * TPB + 7, bpo=1)
    assert res.h_blocks == stored_blocks
    assert len(prober.waves) <= 3


@pytest.mark.parametrize("n_blocks", [8, 40, 41])
def test_a_cold_hit_of_a_prompt_stored_whole_takes_one_wave(n_blocks):
    """Issue 30: the first wave also asks what verifying the longest hit needs (bounded), so a
    repeat of a stored prompt -- a warm cluster's usual cold hit -- is one round trip, not two."""
    g = geo()
    objs = stored(g, n_blocks, 4)
    res, prober = run_lookup(g, objs, n_blocks * TPB + 5, bpo=4, cp_blocks=16)
    assert res.h_blocks == n_blocks
    assert len(prober.waves) == 1
    # On a miss the same wave costs at most the bounded extra asks beside the probe.
    res, miss = run_lookup(g, {}, n_blocks * TPB + 5, bpo=4, cp_blocks=16)
    assert res.h_blocks == 0 and len(miss.waves) <= 2
    probes = {a for a in miss.waves[0] if a[0] == g.spine_group and a[1] == 0}
    assert len(miss.waves[0]) - len(probes) <= 24


def test_nothing_stored_is_a_quick_miss():
    g = geo()
    res, prober = run_lookup(g, {}, 4096 * TPB, bpo=1)
    assert res.h_blocks == 0
    assert len(prober.waves) <= 2


def test_wave_sizes_bounded_by_budget_plus_verify():
    g = geo()
    objs = stored(g, 4096, 1)
    res, prober = run_lookup(g, objs, 4096 * TPB + 1, bpo=1, budget=64)
    assert len(prober.waves[0]) <= 65  # strided probe (+ the prompt's last block)
    assert res.h_blocks == 4096


def test_device_match_offsets_the_search():
    g = geo()
    objs = stored(g, 64, 4)
    res, _ = run_lookup(g, objs, 64 * TPB + 3, bpo=4, d_blocks=16)
    assert res.h_blocks == 64
    res, _ = run_lookup(g, objs, 64 * TPB + 3, bpo=4, d_blocks=64)
    assert res.h_blocks == 64  # nothing to add: no hit beyond d


# ---------------------------------------------------------------- exact repeats


@pytest.mark.parametrize("bpo", [1, 3, 4, 8])
@pytest.mark.parametrize("prompt_len", [8 * TPB, 8 * TPB + 5, 9 * TPB - 1, 12 * TPB, 100 * TPB, 100 * TPB + 1])
def test_exact_repeat_hits_hmax(bpo, prompt_len):
    """A previous request with the same prompt saved chunks + its prompt-end snapshot."""
    g = geo()
    full_blocks = prompt_len // TPB
    objs = stored(g, full_blocks, bpo)
    res, prober = run_lookup(g, objs, prompt_len, bpo=bpo)
    hmax = (prompt_len - 1) // TPB
    assert res.h_blocks == hmax, f"exact repeat served {res.h_blocks} of {hmax} blocks"
    assert len(prober.waves) <= 3
    assert servable(g, res.coverage, 0, res.h_blocks, 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_multi_turn_extension_hits_previous_history_mid_chunk(tp):
    """The common hit: the previous turn's history ends mid-chunk. The probe finds the chunks, the
    fill-in the snapshot at 10 -- and, asked with it, the tails the verify would ask for whichever
    end it finds: two round trips, not three."""
    g = geo(tp=tp)
    # A previous turn stored 10 blocks with bpo 4: chunks at 4, 8 and a snapshot ending at 10.
    objs = stored(g, 10, 4)
    res, prober = run_lookup(g, objs, 40 * TPB + 3, bpo=4)
    assert res.h_blocks == 10
    assert len(prober.waves) == 2 and res.waves == 2
    assert servable(g, res.coverage, 0, 10, 1)


def test_a_cold_miss_of_a_long_prompt_is_one_wave():
    """Nothing stored: the probe's first chunk end is missing, and the block ends before it (what a
    fill-in wave would ask) rode in the probe wave -- one round trip. A gap wider than the bound
    (small pages: many blocks per object) keeps its own wave rather than cost every lookup."""
    g = geo()
    res, prober = run_lookup(g, {}, 400 * TPB + 5, bpo=8)
    assert res.h_blocks == 0 and len(prober.waves) == 1
    assert {(1, 0, e) for e in range(1, 8)} <= prober.waves[0]
    res, prober = run_lookup(g, stored(g, 5, 8), 400 * TPB + 5, bpo=8)
    assert res.h_blocks == 5  # a shorter prompt's snapshot before the first chunk end: still found
    res, prober = run_lookup(g, {}, 400 * TPB + 5, bpo=32, cp_blocks=64)
    assert res.h_blocks == 0 and len(prober.waves) == 2 and len(prober.waves[1]) == 31


def test_a_shorter_hit_the_waves_already_confirmed_is_found_without_a_wave():
    """Asks riding in an earlier wave can make a spine with holes look whole, so the fallback jumps
    to a checkpoint below everything; a shorter end the waves already confirmed on every group and
    shard is then still found, from what was seen (found by a review of the fill-in merge: a miss
    here where the previous lookup found 4 blocks)."""
    g = CacheGeometry(tokens_per_block=TPB, groups=(GroupGeometry(0, None, (0,), (64,)), GroupGeometry(1, 64, (1,), (64,))),
                      tp_size=2, kv_dtype="bf16", model_id="m")
    params = LookupParams(blocks_per_object=4, checkpoint_blocks=16, margin=3, budget=3, fallbacks=0)
    objs = {(0, 0, 4): Span(0, 4), (0, 0, 5): Span(4, 5), (0, 1, 4): Span(0, 4), (0, 1, 6): Span(4, 6),
            (1, 0, 3): Span(0, 3), (1, 0, 4): Span(0, 4), (1, 0, 10): Span(8, 10), (1, 1, 4): Span(0, 4),
            (1, 1, 12): Span(8, 12)}
    prober = FakeProber(objs)
    res = find_hit(g, params, 0, 17, 17, prober)
    assert res.h_blocks == 4 and servable(g, coverage_of(objs), 0, 4, 3)
    assert len(prober.waves) <= 3


# ---------------------------------------------------------------- holes and shards


@pytest.mark.parametrize("hole_end", [2001, 1, 4096, 33])
def test_missing_middle_object_stops_before_it(hole_end):
    g = geo()
    objs = stored(g, 4096, 1)
    del objs[(FULL, 0, hole_end)]
    res, prober = run_lookup(g, objs, 4096 * TPB + 5, bpo=1)
    want = hole_end - 1
    assert res.h_blocks == want
    assert len(prober.waves) <= 4
    if want:
        assert servable(g, coverage_of(objs), 0, want, 1)


def test_missing_sliding_tail_object_no_false_hit():
    g = geo()
    objs = stored(g, 64, 4)
    del objs[(SLIDING, 0, 64)]  # the tail a hit at 64 needs
    res, _ = run_lookup(g, objs, 64 * TPB + 5, bpo=4, cp_blocks=16)
    assert res.h_blocks < 64
    assert res.h_blocks == 0 or servable(g, coverage_of(objs), 0, res.h_blocks, 1)


def test_tp2_missing_full_object_on_one_shard():
    g = geo(tp=2)
    objs = stored(g, 16, 4)
    del objs[(FULL, 1, 12)]  # chunk [8, 12) missing on shard 1 only
    res, _ = run_lookup(g, objs, 16 * TPB + 5, bpo=4)
    assert res.h_blocks == 8
    assert servable(g, coverage_of(objs), 0, 8, 1)
    assert not servable(g, coverage_of(objs), 0, 12, 1)


def test_tp2_missing_sliding_object_on_one_shard():
    g = geo(tp=2)
    objs = stored(g, 16, 4)
    del objs[(SLIDING, 1, 16)]  # shard 1 lacks the tail a hit at 16 needs
    res, _ = run_lookup(g, objs, 16 * TPB + 5, bpo=4, cp_blocks=4)
    assert res.h_blocks <= 12
    assert res.h_blocks == 0 or servable(g, coverage_of(objs), 0, res.h_blocks, 1)


def test_sliding_only_geometry():
    g = geo(full=False)
    objs = stored(g, 16, 4)
    res, _ = run_lookup(g, objs, 16 * TPB + 5, bpo=4)
    assert res.h_blocks == 16


def test_result_is_always_servable_fuzz():
    import random

    rng = random.Random(7)
    for _ in range(200):
        tp = rng.choice([1, 2])
        g = geo(tp=tp, window=rng.choice([32, 64, 128, 300]))
        bpo = rng.choice([1, 2, 4])
        n = rng.randint(1, 40)
        objs = stored(g, n, bpo)
        for k in rng.sample(sorted(objs), rng.randint(0, 4)):
            del objs[k]
        prompt_len = rng.randint(TPB + 1, 48 * TPB)
        d = rng.choice([0, 0, rng.randint(0, 10)])
        res, prober = run_lookup(g, objs, prompt_len, bpo=bpo, d_blocks=d, cp_blocks=4 * bpo)
        assert d <= res.h_blocks <= max(d, (prompt_len - 1) // TPB)
        if res.h_blocks > d:
            assert servable(g, coverage_of(objs), d, res.h_blocks, 1)
        assert len(prober.waves) <= 4


# ---------------------------------------------------------------- through LeaderCore (store + index)


class CountingStore(StoreWrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.head_calls = 0
        self.keys_asked = 0

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        self.head_calls += 1
        self.keys_asked += len(keys)
        return self.inner.head_many(keys)


class FailingStore(StoreWrapper):
    def __init__(self, inner, mode="raise"):
        super().__init__(inner)
        self.mode = mode

    def head_many(self, keys):
        if self.mode == "raise":
            raise TransientError("simulated outage")
        if self.mode == "store-error":
            raise StoreError("simulated failure")
        if self.mode == "failed":
            return HeadBatch({}, frozenset(), {k: TransientError("503", key=k) for k in keys})
        return self.inner.head_many(keys)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make_core(store, g, *, clock=None, **settings):
    s = Settings(url="memory://t", **{"blocks_per_object": 4, "checkpoint_tokens": 16 * TPB, "lookup_timeout_s": 5.0,
                                         **settings})
    index = KeyIndex(10_000, 600.0, 2.0, clock=clock or Clock())
    # Sync loads exist only on engines with a failed-load hook (else the leader loads async).
    return LeaderCore(s, store, "pfx", tp_size=g.tp_size, model_id=g.model_id, kv_dtype=g.kv_dtype, index=index,
                      geometry=g, failed_load_hook=s.load_mode == "sync")


def put_prefix(store, g, tokens, n_blocks, bpo, *, prefix="pfx", salt=None):
    """Write the objects a saved prefix of ``n_blocks`` would have (every group, every shard)."""
    ns = namespace_digest(g)
    digests = chain_digests(chain_root(ns, cache_salt=salt), tokens, g.tokens_per_block)
    scheme = KeyScheme(prefix, ns, g.tp_size)
    ends = list(range(bpo, n_blocks + 1, bpo))
    if n_blocks % bpo:
        ends.append(n_blocks)
    keys = []
    for grp in g.groups:
        for s in range(g.tp_size):
            ident = ObjectIdentity(ns, grp.fingerprint, s, g.tp_size, g.tokens_per_block, grp.page_bytes)
            for end in ends:
                first = (end - 1) // bpo * bpo
                count = end - first
                key = scheme.object_key(grp.fingerprint, s, digests[end - 1])
                pages = [bytes(grp.page_bytes)] * count
                store.put(key, encode_object(ident, first, digests[end - 1], pages), object_metadata(ident, first, count))
                keys.append(key)
    return keys


def tokens_of(n: int, seed: int = 1) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(n)]


def test_leader_lookup_hits_then_second_lookup_is_network_free():
    g = geo(tp=2)
    mem = MemoryStore()
    prompt = tokens_of(40 * TPB + 9)
    put_prefix(mem, g, prompt, 40, 4)
    store = CountingStore(mem)
    core = make_core(store, g)
    n, is_async = core.get_num_new_matched_tokens(1, prompt, len(prompt), 0)
    assert (n, is_async) == (40 * TPB, True)
    assert core.stats.lookup_waves >= 1 and store.head_calls >= 1
    waves, calls = core.stats.lookup_waves, store.head_calls
    n2, _ = core.get_num_new_matched_tokens(2, prompt, len(prompt), 0)
    assert n2 == n
    assert core.stats.lookup_waves == waves, "second lookup went to the network"
    assert store.head_calls == calls


def test_leader_lookup_salt_isolates():
    g = geo()
    mem = MemoryStore()
    prompt = tokens_of(20 * TPB + 1)
    put_prefix(mem, g, prompt, 20, 4, salt="a")
    core = make_core(mem, g)
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), 0) == (0, False)
    assert core.get_num_new_matched_tokens(2, prompt, len(prompt), 0, cache_salt="b") == (0, False)
    assert core.get_num_new_matched_tokens(3, prompt, len(prompt), 0, cache_salt="a")[0] == 20 * TPB


def test_leader_lookup_rejects_foreign_metadata():
    g = geo()
    mem = MemoryStore()
    prompt = tokens_of(8 * TPB + 1)
    # Same keys, but objects written by another geometry (page bytes differ): must not hit.
    other = CacheGeometry(TPB, tuple(GroupGeometry(x.group_id, x.window, x.layer_ids, (128,)) for x in g.groups),
                          1, "bf16", "m")
    ns = namespace_digest(g)
    digests = chain_digests(chain_root(ns), prompt, TPB)
    scheme = KeyScheme("pfx", ns, 1)
    for grp, ogrp in zip(g.groups, other.groups, strict=True):
        ident = ObjectIdentity(ns, grp.fingerprint, 0, 1, TPB, ogrp.page_bytes)
        for end in (4, 8):
            pages = [bytes(ogrp.page_bytes)] * 4
            mem.put(scheme.object_key(grp.fingerprint, 0, digests[end - 1]),
                    encode_object(ident, end - 4, digests[end - 1], pages), object_metadata(ident, end - 4, 4))
    core = make_core(mem, g)
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), 0) == (0, False)
    assert core.stats.foreign_objects > 0


@pytest.mark.parametrize("mode", ["raise", "store-error", "failed"])
def test_store_errors_during_lookup_are_a_miss(mode):
    g = geo()
    mem = MemoryStore()
    prompt = tokens_of(20 * TPB + 1)
    put_prefix(mem, g, prompt, 20, 4)
    store = FailingStore(mem, mode)
    clock = Clock()
    core = make_core(store, g, clock=clock)
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), 0) == (0, False)
    assert core.stats.lookup_errors > 0
    assert core.stats.misses == 1
    # Errors are not remembered as "missing": once the store recovers, the same prompt hits.
    store.mode = "ok"
    assert core.get_num_new_matched_tokens(2, prompt, len(prompt), 0)[0] == 20 * TPB


def test_store_unavailable_flag_is_a_miss_without_io():
    g = geo()
    store = CountingStore(MemoryStore())
    core = make_core(store, g)
    prompt = tokens_of(10 * TPB)
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), 0, store_available=False) == (0, False)
    assert store.head_calls == 0


def test_device_match_mid_block_is_a_miss():
    g = geo()
    mem = MemoryStore()
    prompt = tokens_of(20 * TPB + 1)
    put_prefix(mem, g, prompt, 20, 4)
    core = make_core(mem, g)
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), TPB + 3) == (0, False)
    n, _ = core.get_num_new_matched_tokens(2, prompt, len(prompt), 4 * TPB)
    assert n == 16 * TPB  # offer counts beyond the device match


def test_offer_never_reaches_last_prompt_token():
    g = geo()
    mem = MemoryStore()
    prompt = tokens_of(12 * TPB)  # block aligned: the last block cannot be offered
    put_prefix(mem, g, prompt, 12, 4)
    core = make_core(mem, g)
    n, _ = core.get_num_new_matched_tokens(1, prompt, len(prompt), 0)
    assert n % TPB == 0 and n <= len(prompt) - 1
    assert n == 11 * TPB


def test_sync_mode_and_min_hit_blocks():
    g = geo()
    mem = MemoryStore()
    prompt = tokens_of(20 * TPB + 1)
    put_prefix(mem, g, prompt, 4, 4)
    core = make_core(mem, g, load_mode="sync")
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), 0) == (4 * TPB, False)
    core = make_core(mem, g, min_hit_blocks=5)
    assert core.get_num_new_matched_tokens(1, prompt, len(prompt), 0) == (0, False)


def test_index_sweeps_expired_negatives():
    from s3kv.core.objects import ObjectSpan

    now = [0.0]
    idx = KeyIndex(max_entries=100_000, ttl_s=600, negative_ttl_s=2, clock=lambda: now[0])
    for i in range(1000):
        idx.put_missing(f"k{i}")
    now[0] = 10.0  # every negative has expired
    for i in range(1100):
        idx.put_present(f"p{i}", ObjectSpan(0, 1))
    assert len(idx) <= 1100  # the 1000 expired negatives were swept, not kept until asked


def test_slow_store_lookup_is_a_bounded_miss_and_warms_the_index_later():
    """A lookup runs in the engine's scheduling path: past its budget it is a miss, not a wait."""
    import time as _time

    from s3kv.store.base import StoreWrapper
    from s3kv.store.memory import MemoryStore

    class SlowHeads(StoreWrapper):
        delay = 0.0

        def head_many(self, keys):
            _time.sleep(self.delay)
            return super().head_many(keys)

    g = CacheGeometry(16, (GroupGeometry(0, None, (0,), (64,)),), 1, "bf16", "m")
    store = SlowHeads(MemoryStore())
    tokens = list(range(16 * 20))
    writer = LeaderCore(Settings(url="memory://x", blocks_per_object=4), store, "p", tp_size=1,
                        model_id="m", kv_dtype="bf16", geometry=g)
    # Store every object of the prompt (as a writer's uploads would).
    from s3kv.core.objects import ObjectIdentity, encode_object, object_metadata

    assert writer.geometry is not None
    root = chain_root(writer.namespace)
    digests = chain_digests(root, tokens, 16)
    ident = ObjectIdentity(writer.namespace, g.groups[0].fingerprint, 0, 1, 16, 64)
    for end in range(4, 21, 4):
        key = writer.scheme.object_key(g.groups[0].fingerprint, 0, digests[end - 1])
        pages = [bytes(64)] * 4
        store.put(key, encode_object(ident, end - 4, digests[end - 1], pages), object_metadata(ident, end - 4, 4))
    store.delay = 0.5
    leader = LeaderCore(Settings(url="memory://x", blocks_per_object=4, lookup_timeout_s=0.2), store, "p",
                        tp_size=1, model_id="m", kv_dtype="bf16", geometry=g)
    t0 = _time.monotonic()
    n, _ = leader.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    assert n == 0 and _time.monotonic() - t0 < 0.45 and leader.stats.lookup_timeouts == 1
    _time.sleep(0.8)  # the abandoned wave finished in the background and fed the index
    assert len(leader.index) > 0
    store.delay = 0.0
    n2, _ = leader.get_num_new_matched_tokens(2, tokens, len(tokens), 0)
    assert n2 > 0


def test_a_lookup_that_ran_out_is_finished_in_the_background():
    """A long prompt's probe needs two waves; a budget that covers less than one makes the
    lookup a miss. Its remaining waves then run in the background (after the wave that ran
    out, no HEAD asked twice), so the next lookup of the prefix is answered from the index
    with no request at all -- with the store still as slow."""
    import time as _time

    from s3kv.store.base import StoreWrapper
    from s3kv.store.instrument import InstrumentedStore
    from s3kv.store.memory import MemoryStore

    class SlowHeads(StoreWrapper):
        delay = 0.0
        unchecked = 0  # keys asked without what their answers must say

        def head_many(self, keys):
            self.unchecked += len(keys)
            _time.sleep(self.delay)
            return super().head_many(keys)

        def head_many_checked(self, keys, expect):
            self.unchecked += sum(k not in expect for k in keys)
            _time.sleep(self.delay)
            return super().head_many(keys)

    g = geo()
    mem = MemoryStore()
    # Stored: 64 blocks of an 80-block prompt (a whole-prompt hit would be found in one wave).
    tokens = tokens_of(80 * TPB + 5, seed=11)
    put_prefix(mem, g, tokens, 64, 4)
    store = InstrumentedStore(SlowHeads(mem))
    store.inner.delay = 0.3
    leader = make_core(store, g, lookup_timeout_s=0.1, lookup_probe_budget=8)
    try:
        assert leader.get_num_new_matched_tokens(1, tokens, len(tokens), 0)[0] == 0
        assert leader.stats.lookup_timeouts == 1
        deadline = _time.monotonic() + 10
        while leader.stats.lookups_finished_late == 0 and _time.monotonic() < deadline:
            _time.sleep(0.05)
        assert leader.stats.lookups_finished_late == 1
        heads = store.snapshot().head
        n, _ = leader.get_num_new_matched_tokens(2, tokens, len(tokens), 0)
        assert n == 64 * TPB
        assert store.snapshot().head == heads  # answered by the index: no request
        assert leader.stats.lookup_timeouts == 1
        # The background waves, too, ask for answers checked where they arrive (HEAD helpers).
        assert store.inner.unchecked == 0
    finally:
        leader.close_lookup()
    # The foreground waves and the background finish together asked what one unhurried lookup asks.
    plain = InstrumentedStore(mem)
    ref = make_core(plain, g, lookup_timeout_s=0, lookup_probe_budget=8)
    try:
        assert ref.get_num_new_matched_tokens(1, tokens, len(tokens), 0)[0] == 64 * TPB
        assert ref.stats.lookup_waves >= 2 and plain.snapshot().head == heads
    finally:
        ref.close_lookup()
