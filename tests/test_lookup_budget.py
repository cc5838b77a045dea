"""Lookups off the critical path (issue 16) and lookups that cannot stall (issue 17, point 5).

* a hung store costs each lookup at most its budget, the background backlog is bounded
  (further lookups are misses at once), and the timeouts open the circuit breaker;
* ``file://`` serves only regular files: a FIFO or a symlink under a key is no object (a FIFO
  would block a reader forever);
* the namespace summary answers a cold miss with no request and a cold hit with one verify
  wave, and a stale summary never makes a promise the store did not just confirm;
* the key index does bounded work per insert.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
from test_lookup import TPB, geo, put_prefix, tokens_of

from s3kv.config import Settings
from s3kv.core.lookup import stall_budget_s
from s3kv.core.objects import ObjectSpan
from s3kv.core.retention import RETENTION_FLOOR_S
from s3kv.engine.index import MISSING, KeyIndex
from s3kv.engine.leader import LeaderCore
from s3kv.store.base import ByteRange, HeadBatch, NotFound, StoreWrapper
from s3kv.store.breaker import BreakerPolicy, BreakerState, CircuitBreakerStore
from s3kv.store.fsspec_store import FsspecStore
from s3kv.store.instrument import InstrumentedStore
from s3kv.store.memory import MemoryStore


class HungHeads(StoreWrapper):
    """HEADs block until released (a store that stopped answering)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.release = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()

    def head_many(self, keys) -> HeadBatch:
        with self._lock:
            self.calls += 1
        self.release.wait(30)
        return super().head_many(keys)


def _leader(store, g, **settings) -> LeaderCore:
    s = Settings(url="memory://t", **{"blocks_per_object": 4, "checkpoint_tokens": 16 * TPB, **settings})
    return LeaderCore(s, store, "pfx", tp_size=g.tp_size, model_id=g.model_id, kv_dtype=g.kv_dtype,
                      index=KeyIndex(10_000, 600.0, 2.0), geometry=g)


def test_hung_store_costs_a_budget_per_lookup_bounds_the_backlog_and_opens_the_breaker():
    g = geo()
    mem = MemoryStore()
    hung = HungHeads(mem)
    breaker = CircuitBreakerStore(hung, BreakerPolicy(failures=3, reset_s=60))
    core = _leader(breaker, g, lookup_timeout_s=0.05, lookup_max_pending=2)
    try:
        times = []
        for i in range(6):
            prompt = tokens_of(20 * TPB + 3, seed=i + 1)
            t0 = time.monotonic()
            assert core.get_num_new_matched_tokens(i, prompt, len(prompt), 0) == (0, False)
            times.append(time.monotonic() - t0)
        # Each lookup: at most its budget (plus scheduling slack), never the hang.
        assert max(times) < 0.5, times
        # Two waves hang in the background; the third lookup found the pool busy.
        assert hung.calls == 2
        assert core.stats.lookup_timeouts == 2
        assert core.stats.lookup_busy >= 1
        assert breaker.state is BreakerState.CLOSED  # two timeouts so far; busy misses send nothing
    finally:
        hung.release.set()
    deadline = time.monotonic() + 5
    while core._pending_waves and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core._pending_waves == 0
    # The late waves settle nothing (a success seconds late must not reset the count); the
    # store answering a lookup in time restarts it.
    prompt = tokens_of(20 * TPB + 3, seed=50)
    assert core.get_num_new_matched_tokens(50, prompt, len(prompt), 0) == (0, False)
    assert core.stats.lookup_timeouts == 2
    core.close_lookup()
    # Hung again, three timeouts in a row trip it (a backlog of three lets three waves hang).
    assert breaker.state is BreakerState.CLOSED
    hung.release.clear()
    core = _leader(breaker, g, lookup_timeout_s=0.05, lookup_max_pending=3)
    try:
        for seed in (97, 98, 99):
            prompt = tokens_of(20 * TPB + 3, seed=seed)
            core.get_num_new_matched_tokens(seed, prompt, len(prompt), 0)
        assert core.stats.lookup_timeouts == 3
        assert breaker.state is BreakerState.OPEN  # three timeouts: a hung store trips it
        calls = hung.calls
        t0 = time.monotonic()
        prompt = tokens_of(20 * TPB + 3, seed=100)
        assert core.get_num_new_matched_tokens(100, prompt, len(prompt), 0) == (0, False)
        assert hung.calls == calls  # open: not even tried
        assert time.monotonic() - t0 < 1.0  # (a tried call would hang: the count above is the proof)
    finally:
        hung.release.set()
        core.close_lookup()


class StuckShare(HungHeads):
    """Each wave is late on this side (one HEAD helper stopped), while the store answers the
    HEADs asked with it: ``answered_since`` says so, as the S3 stores do. ``alive=False``: no
    HEAD asked since got an answer (a store that stopped)."""

    def __init__(self, inner, alive: bool = True):
        super().__init__(inner)
        self.alive = alive
        self.asked: list[float] = []

    def head_many(self, keys) -> HeadBatch:
        self.asked.append(time.monotonic())
        return super().head_many(keys)

    def answered_since(self, t: float) -> bool:
        return self.alive and any(a >= t for a in self.asked)


@pytest.mark.parametrize("alive", [True, False], ids=["store-answers", "store-stopped"])
def test_lookups_late_on_this_side_never_open_the_breaker(alive):
    """A wave late only on this side -- one stopped HEAD helper holds its share, the store
    answered the others -- is not the store's failure. Counted, four such lookups opened the
    breaker within a second (cutting loads and saves off a healthy store for its reset time)
    before the helper's ping could find it out. A store that answers nothing still trips it."""
    g = geo()
    stuck = StuckShare(MemoryStore(), alive=alive)
    breaker = CircuitBreakerStore(stuck, BreakerPolicy(failures=3, reset_s=60))
    core = _leader(breaker, g, lookup_timeout_s=0.05, lookup_max_pending=4)
    try:
        for seed in (1, 2, 3, 4):
            prompt = tokens_of(20 * TPB + 3, seed=seed)
            assert core.get_num_new_matched_tokens(seed, prompt, len(prompt), 0) == (0, False)
        assert core.stats.lookup_timeouts == (4 if alive else 3)  # open after three: not even sent
        if alive:
            assert breaker.state is BreakerState.CLOSED and breaker.consecutive_failures == 0
            assert breaker.timeouts_excused == 4
        else:
            assert breaker.state is BreakerState.OPEN and breaker.timeouts_excused == 0
    finally:
        stuck.release.set()
        core.close_lookup()


def test_fifo_and_symlinks_are_not_objects(tmp_path):
    store = FsspecStore(f"file://{tmp_path}/store", fsync=False)
    assert store.put("ns/real", b"payload") is True
    os.makedirs(tmp_path / "store" / "ns", exist_ok=True)
    os.mkfifo(tmp_path / "store" / "ns" / "fifo")
    os.symlink(tmp_path / "store" / "ns" / "real", tmp_path / "store" / "ns" / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "store" / "ns" / "dangling")
    done = threading.Event()
    out: dict = {}

    def probe() -> None:
        out["batch"] = store.head_many(["ns/fifo", "ns/link", "ns/real", "ns/dangling"])
        try:
            store.get_ranges("ns/fifo", [ByteRange(0, 1)])
        except NotFound as e:
            out["get"] = e
        out["list"] = [i.key for i in store.list("ns/")]
        done.set()

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    assert done.wait(5), "a FIFO under file:// blocked the store"
    batch = out["batch"]
    assert set(batch.found) == {"ns/real"}
    assert batch.missing == frozenset({"ns/fifo", "ns/link", "ns/dangling"})
    assert isinstance(out["get"], NotFound)
    assert out["list"] == ["ns/real"]  # links skipped, the dangling one does not abort the walk


def test_summary_cold_miss_is_free_and_cold_hit_is_one_verified_wave():
    g = geo(tp=2)
    mem = MemoryStore()
    stored = tokens_of(40 * TPB + 9, seed=3)
    put_prefix(mem, g, stored, 40, 4)
    counted = InstrumentedStore(mem)
    core = _leader(counted, g, lookup_timeout_s=0, lookup_summary_s=3600)
    summary = core.lookup_summary()
    assert summary is not None and summary.refresh() and summary.objects == 10 * 2 * len(g.groups)
    try:
        before = counted.snapshot()
        other = tokens_of(40 * TPB + 9, seed=4)
        assert core.get_num_new_matched_tokens(1, other, len(other), 0) == (0, False)
        assert (counted.snapshot() - before).head == 0  # a cold miss: no request at all
        assert core.stats.lookup_summary_misses == 1

        before = counted.snapshot()
        n, _ = core.get_num_new_matched_tokens(2, stored, len(stored), 0)
        assert n == 40 * TPB
        io = counted.snapshot() - before
        assert core.stats.lookup_summary_hits == 1 and core.stats.lookup_waves == 1
        # One wave, and only objects the hit loads (all 10 chunks of every group and shard).
        assert 0 < io.head <= 10 * 2 * len(g.groups)
        # Promised spans come from the HEADs (metadata), and the repeat is index-only.
        before = counted.snapshot()
        assert core.get_num_new_matched_tokens(3, stored, len(stored), 0)[0] == 40 * TPB
        assert (counted.snapshot() - before).head == 0
    finally:
        core.close_lookup()


def test_stale_summary_never_promises_a_deleted_object():
    g = geo()
    mem = MemoryStore()
    stored = tokens_of(40 * TPB + 9, seed=5)
    keys = put_prefix(mem, g, stored, 40, 4)
    core = _leader(mem, g, lookup_timeout_s=0, lookup_summary_s=3600)
    summary = core.lookup_summary()
    assert summary is not None and summary.refresh()
    try:
        # Delete a spine chunk in the middle after the listing: the summary still lists it.
        from s3kv.core.keys import chain_digests, chain_root

        digests = chain_digests(chain_root(core.namespace), stored, TPB)
        spine = g.groups[g.spine_group].fingerprint
        victim = core.scheme.object_key(spine, 0, digests[19])  # the chunk of blocks 16..19
        assert victim in keys
        mem.delete_many([victim])
        n, _ = core.get_num_new_matched_tokens(1, stored, len(stored), 0)
        assert core.stats.lookup_summary_stale == 1
        assert n <= 16 * TPB  # at most what is contiguous below the hole
        assert core.index.get(victim) is MISSING
    finally:
        core.close_lookup()


def test_summary_ignores_foreign_sizes_and_gives_up_past_its_bound():
    g = geo()
    mem = MemoryStore()
    stored = tokens_of(16 * TPB + 9, seed=6)
    keys = put_prefix(mem, g, stored, 16, 4)
    core = _leader(mem, g, lookup_summary_s=3600, lookup_summary_max_objects=2)
    summary = core.lookup_summary()
    assert summary is not None
    assert summary.refresh() is False and not summary.ready  # more objects than the bound
    core.close_lookup()
    core = _leader(mem, g, lookup_summary_s=3600)
    mem.put(keys[0][:-32] + "0" * 32, b"not an object")  # our path, a size no page count fits
    summary = core.lookup_summary()
    assert summary is not None and summary.refresh() and summary.objects == len(keys)
    core.close_lookup()


def test_index_does_bounded_work_per_insert():
    now = [0.0]
    idx = KeyIndex(max_entries=1_000_000, ttl_s=600, negative_ttl_s=2, clock=lambda: now[0])
    for i in range(50_000):
        idx.put_missing(f"n{i}")
    now[0] = 10.0
    idx.put_present("p", ObjectSpan(0, 1))
    # One insert removed a handful of expired entries, not all 50,000 at once.
    assert 50_000 - 20 <= len(idx) <= 50_000
    # Timed without the collector: in one clean-clone CI run the loop took 1.6 s (0.1 s here),
    # likely a full collection of the multi-GB test process landing inside it (not proven); the
    # bound is on the index's work.
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i in range(10_000):
            idx.put_present(f"q{i}", ObjectSpan(0, 1))
        took = time.perf_counter() - t0
    finally:
        gc.enable()
    assert took < 1.0
    assert len(idx) == 10_001 + max(0, 50_000 - 8 * 10_001)  # swept as fast as it filled
    assert idx.get("n1") is None and idx.get("p") == ObjectSpan(0, 1)
    # The bound drops negatives before positives.
    small = KeyIndex(max_entries=3, ttl_s=600, negative_ttl_s=2, clock=lambda: now[0])
    small.put_present("a", ObjectSpan(0, 1))
    small.put_missing("b")
    small.put_present("c", ObjectSpan(0, 1))
    small.put_present("d", ObjectSpan(0, 1))
    assert small.get("b") is None and small.get("a") is not None and len(small) == 3


def test_the_budget_follows_the_prefill_a_hit_would_save_within_the_cap():
    """Issue 30: a lookup may stall the scheduler for a share of the prefill its best hit saves
    (a long prompt waits longer than a short one), never past the cap, never for nothing."""
    assert stall_budget_s(16_384, 7500.0, 0.5, 0.2) == 0.2  # 16k tokens: ~1.1 s at half: the cap
    assert stall_budget_s(1_500, 7500.0, 0.5, 0.2) == pytest.approx(0.1)
    assert stall_budget_s(150, 7500.0, 0.5, 0.2) == pytest.approx(0.01)
    assert stall_budget_s(0, 7500.0, 0.5, 0.2) == 0.0
    s = Settings()
    assert s.lookup_timeout_s == -1  # by default the budget follows the value
    assert (s.lookup_stall_fraction, s.lookup_max_stall_ms, s.prefill_tokens_per_s) == (0.5, 500.0, 0.0)


def test_the_budget_weighs_a_hit_with_the_one_prefill_figure():
    """Issue 38: the budget's prefill speed is the bill's -- the model's FLOPs at peak x MFU
    (s3kv.core.cost.Prefill), the engine's TP GPUs together -- unless a measured one overrides it."""
    from s3kv.core.cost import Prefill
    from s3kv.core.model import ModelSpec

    one = Prefill.from_settings(Settings())
    assert 11_000 < one.tokens_per_s < 13_500  # Gemma-3-27B at 0.65 x 989.4 TFLOP/s: ~82 us a token
    assert Prefill.from_settings(Settings(), tp=4).tokens_per_s == pytest.approx(4 * one.tokens_per_s)
    assert Prefill.from_settings(Settings(prefill_mfu=0.325)).tokens_per_s == pytest.approx(one.tokens_per_s / 2)
    small = ModelSpec("small", 8, 1024, 4096, 8, 2, 128, window=0, global_every=1)
    assert Prefill.from_settings(Settings(), small).tokens_per_s > 20 * one.tokens_per_s
    # The deprecated setting still wins, as the engine's own throughput (all its GPUs).
    assert Prefill.from_settings(Settings(prefill_tokens_per_s=7500.0), small, tp=2).tokens_per_s == 7500.0
    # A leader's lookup budget uses it (no config.json for this model: the default model's figure).
    g = geo()
    core = _leader(MemoryStore(), g)
    try:
        want = Prefill.from_settings(Settings(), tp=g.tp_size).tokens_per_s
        assert core._lookups.lookup_budget_s(1000) == pytest.approx(0.5 * 1000 / want)
    finally:
        core.close_lookup()


class SlowHeads(StoreWrapper):
    """Every HEAD wave takes ``delay_s`` (a store far away)."""

    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s
        self.waves = 0

    def head_many(self, keys) -> HeadBatch:
        self.waves += 1
        time.sleep(self.delay_s)
        return super().head_many(keys)


def test_a_long_prompt_waits_for_its_hit_where_a_short_one_misses():
    """Same store, 80 ms a wave: the short prompt's budget (a share of its small prefill) runs out
    and it misses; the long prompt's budget covers its waves and it hits. The records say why."""
    g = geo()
    mem = MemoryStore()
    short = tokens_of(4 * TPB + 3, seed=1)
    long = tokens_of(64 * TPB + 3, seed=2)
    put_prefix(mem, g, short, 4, 4)
    put_prefix(mem, g, long, 64, 4)
    # 2,000 tokens/s at a fraction of 0.5: 4 blocks -> 32 ms (under one wave); 64 blocks -> 512 ms.
    core = _leader(SlowHeads(mem, 0.08), g, prefill_tokens_per_s=2_000.0, lookup_max_stall_ms=2000.0)
    try:
        assert core.get_num_new_matched_tokens(1, short, len(short), 0) == (0, False)
        short_rec = core.stats.recent_lookups[-1]
        n, _ = core.get_num_new_matched_tokens(2, long, len(long), 0)
        long_rec = core.stats.recent_lookups[-1]
    finally:
        core.close_lookup()
    assert short_rec.decision == "ran_out" and short_rec.saveable_tokens == 4 * TPB
    assert short_rec.budget_s == pytest.approx(0.5 * 4 * TPB / 2_000.0)
    assert n == 64 * TPB and long_rec.decision == "hit" and long_rec.hit_tokens == 64 * TPB
    assert long_rec.budget_s == pytest.approx(0.5 * 64 * TPB / 2_000.0)
    assert long_rec.stall_s > short_rec.budget_s  # it waited longer than the short one could
    assert core.stats.lookup_decisions == {"ran_out": 1, "hit": 1}
    assert core.stats.lookup_saveable_tokens == 68 * TPB


def test_a_budget_shorter_than_waves_take_spends_no_stall_and_still_warms_the_index():
    """Waves take ~50 ms lately; a lookup with a 16 ms budget would surely run out: it sends no
    wave of its own (no stall beyond hashing), is finished in the background, and the prefix's
    next lookup hits from the index."""
    g = geo()
    mem = MemoryStore()
    long = tokens_of(64 * TPB + 3, seed=1)
    short = tokens_of(2 * TPB + 3, seed=2)
    put_prefix(mem, g, long, 64, 4)
    put_prefix(mem, g, short, 2, 4)
    core = _leader(SlowHeads(mem, 0.05), g, prefill_tokens_per_s=2_000.0, lookup_max_stall_ms=2000.0)
    try:
        assert core.get_num_new_matched_tokens(1, long, len(long), 0)[0] == 64 * TPB  # waves: ~50 ms each
        waves = core.stats.lookup_waves
        assert core.get_num_new_matched_tokens(2, short, len(short), 0) == (0, False)
        rec = core.stats.recent_lookups[-1]
        assert rec.decision == "ran_out" and rec.budget_s == pytest.approx(0.016)
        assert core.stats.lookup_waves == waves  # nothing sent on the scheduler's time
        assert rec.stall_s < rec.budget_s
        deadline = time.monotonic() + 5
        while core.stats.lookups_finished_late == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.get_num_new_matched_tokens(3, short, len(short), 0)[0] == 2 * TPB
        assert core.stats.recent_lookups[-1].decision == "hit"
    finally:
        core.close_lookup()


def test_a_short_budget_running_out_is_no_store_failure_a_wait_to_the_cap_is():
    """A healthy store 50 ms away: short prompts' budgets (a few ms) run out lookup after lookup,
    which says nothing of the store -- the breaker stays closed. A hung store that holds long
    prompts to the cap still opens it."""
    g = geo()
    mem = MemoryStore()
    slow = CircuitBreakerStore(SlowHeads(mem, 0.05), BreakerPolicy(failures=2, reset_s=60))
    core = _leader(slow, g, prefill_tokens_per_s=10_000.0, lookup_max_stall_ms=100.0, lookup_max_pending=8)
    try:
        for i in range(4):
            prompt = tokens_of(4 * TPB + 3, seed=i + 1)  # 128 tokens: a 6.4 ms budget
            assert core.get_num_new_matched_tokens(i, prompt, len(prompt), 0) == (0, False)
        assert core.stats.lookup_timeouts == 4 and slow.state is BreakerState.CLOSED
    finally:
        core.close_lookup()
    hung = HungHeads(mem)
    breaker = CircuitBreakerStore(hung, BreakerPolicy(failures=2, reset_s=60))
    core = _leader(breaker, g, prefill_tokens_per_s=10_000.0, lookup_max_stall_ms=50.0, lookup_max_pending=8)
    try:
        for i in range(2):
            prompt = tokens_of(64 * TPB + 3, seed=i + 10)  # 2048 tokens: 102 ms, capped at 50
            assert core.get_num_new_matched_tokens(i, prompt, len(prompt), 0) == (0, False)
        assert breaker.state is BreakerState.OPEN
    finally:
        hung.release.set()
        core.close_lookup()


def test_the_cap_holds_against_a_hung_store_whatever_the_prompt():
    """A hung store costs each lookup at most the cap, however much its prompt could save."""
    g = geo()
    hung = HungHeads(MemoryStore())
    core = _leader(hung, g, lookup_max_stall_ms=60.0, lookup_max_pending=8)  # default rule otherwise
    try:
        slowest: list[float] = []
        for i in range(3):
            # A lookup that overran the cap once may have been descheduled (a loaded CI host took
            # 0.47 s once); one that ignores the cap overruns every time (~0.85 s): the fastest of
            # three fresh prompts must be within the cap plus scheduling slack.
            took_each = []
            for attempt in range(3):
                req = 10 * i + attempt
                prompt = tokens_of(400 * TPB + 3, seed=req + 1)  # 12.8k tokens: ~0.85 s at half: past the cap
                # A full collection of the whole suite's heap took ~1 s inside the timed call once
                # (clean-clone CI, a 3 GB test process): run it here, not in the timed lookup.
                gc.collect()
                t0 = time.monotonic()
                assert core.get_num_new_matched_tokens(req, prompt, len(prompt), 0) == (0, False)
                took = time.monotonic() - t0
                rec = core.stats.recent_lookups[-1]
                assert rec.budget_s == 0.06 and rec.decision == "ran_out"
                assert rec.stall_s <= took
                took_each.append(took)
                if took < 0.06 + 0.4:
                    break
            slowest.append(min(took_each))
        assert max(slowest) < 0.06 + 0.4, slowest  # the cap plus scheduling slack
    finally:
        hung.release.set()
        core.close_lookup()


def test_index_get_many_answers_like_get_and_expires_the_same():
    now = [0.0]
    idx = KeyIndex(max_entries=100, ttl_s=10, negative_ttl_s=2, clock=lambda: now[0])
    idx.put_present("p", ObjectSpan(0, 4))
    idx.put_missing("m")
    idx.quarantine(["q"], ttl=5)
    keys = ["p", "m", "q", "unknown"]
    assert idx.get_many(keys) == [ObjectSpan(0, 4), MISSING, MISSING, None]
    assert idx.get_many(keys) == [idx.get(k) for k in keys]
    now[0] = 3.0  # the negative expired; the quarantine and the positive did not
    assert idx.get_many(keys) == [ObjectSpan(0, 4), None, MISSING, None]
    now[0] = 11.0
    assert idx.get_many(keys) == [None, None, None, None]
    assert len(idx) == 0  # expired entries read are dropped, as by get


def test_index_put_many_does_what_single_puts_do():
    """A HEAD wave's answers in one call: the same entries, expiries, quarantine rule, sweeping
    and bound as putting them one at a time."""
    def filled(batched: bool) -> KeyIndex:
        now = [0.0]
        idx = KeyIndex(max_entries=40, ttl_s=10, negative_ttl_s=2, clock=lambda: now[0])
        for i in range(30):
            idx.put_missing(f"old{i}")
        idx.quarantine(["bad"], ttl=50)
        now[0] = 5.0  # the 30 negatives expired
        present = [(f"p{i}", ObjectSpan(i, 1)) for i in range(12)] + [("bad", ObjectSpan(0, 1))]
        missing = [f"m{i}" for i in range(6)] + ["p0"]  # p0: missing after all (a later answer)
        if batched:
            idx.put_many(present, missing)
        else:
            for k, span in present:
                idx.put_present(k, span)
            for k in missing:
                idx.put_missing(k)
        return idx

    one, many = filled(False), filled(True)
    keys = [f"old{i}" for i in range(30)] + [f"p{i}" for i in range(12)] + [f"m{i}" for i in range(6)] + ["bad"]
    assert many.get_many(keys) == one.get_many(keys)
    assert many.get("bad") is MISSING and many.get("p0") is MISSING and many.get("p3") == ObjectSpan(3, 1)
    assert len(many) == len(one) == 12 + 6 + 1  # expired negatives swept, as single puts sweep
    many.put_many([(f"x{i}", ObjectSpan(0, 1)) for i in range(60)], [])
    assert len(many) == 40  # bounded like single puts


def test_the_index_keeps_an_answer_no_longer_than_its_object_may_be_believed():
    """``keep`` renews what a lookup found through the index itself, so it must not outlast what the
    HEAD that learnt it said: each renewal from memory alone kept chain objects found but never
    loaded (so never refreshed) known past gc's cutoff, and the load promised on them failed."""
    now = [0.0]
    idx = KeyIndex(max_entries=100, ttl_s=10, negative_ttl_s=2, clock=lambda: now[0])
    idx.put_many([("short", ObjectSpan(0, 1)), ("long", ObjectSpan(0, 1)), ("undated", ObjectSpan(0, 1))], (),
                 believable={"short": 6.0, "long": 100.0})
    now[0] = 5.0
    assert all(idx.get(k) is not None for k in ("short", "long", "undated"))
    idx.keep(["short", "long", "undated", "never-asked"])
    now[0] = 6.5  # "short": its object's life as the HEAD dated it is over
    assert idx.get("short") is None and idx.get("long") is not None and idx.get("never-asked") is None
    now[0] = 12.0  # "undated": its TTL, never renewed; "long": renewed at 5 s
    assert idx.get("undated") is None and idx.get("long") is not None
    for t in range(14, 101, 8):  # renewed as long as lookups find it, never past its 100 s
        now[0] = float(t)
        idx.keep(["long"])
        assert idx.get("long") is not None
    now[0] = 100.5
    assert idx.get("long") is None


def test_a_missing_answer_never_hides_what_was_learnt_present_after_it_was_asked():
    """A wave's "missing" answers were true when it was asked; an object this engine uploaded (or
    a later HEAD found) after that is newer evidence. Same clock reading counts as after: a replay's
    trace clock stands still between a request's lookup and its uploads."""
    now = [5.0]
    idx = KeyIndex(max_entries=100, ttl_s=10, negative_ttl_s=2, clock=lambda: now[0])
    asked = idx.now()
    idx.put_present("up", ObjectSpan(0, 4))  # this engine's upload confirmed, same tick
    now[0] = 6.0
    idx.put_present("later", ObjectSpan(0, 4))
    idx.put_present("before", ObjectSpan(0, 4))
    idx.put_many([], ["up", "later", "gone"], asked_at=asked)
    assert idx.get("up") == idx.get("later") == ObjectSpan(0, 4) and idx.get("gone") is MISSING
    idx.put_many([], ["before"], asked_at=idx.now() + 1)  # asked after it was learnt: deleted since
    assert idx.get("before") is MISSING


class AskedHeads(HungHeads):
    """HungHeads that remember what they were asked."""

    def __init__(self, inner):
        super().__init__(inner)
        self.asked: list[str] = []

    def head_many(self, keys) -> HeadBatch:
        self.asked += list(keys)
        return super().head_many(keys)


def test_a_late_wave_never_hides_an_upload_confirmed_while_it_ran():
    """A lookup runs out of budget on a wave that then answers "missing" -- asked before this
    engine's upload of one of its objects was confirmed, answered after. The index keeps the
    upload: the next lookup of the prefix is answered locally, not with HEADs that find nothing
    for two seconds (before: the late answer replaced it)."""
    g = geo()
    store = AskedHeads(MemoryStore())
    core = _leader(store, g, lookup_timeout_s=0.05)
    toks = tokens_of(16 * TPB + 3, seed=4)
    try:
        assert core.get_num_new_matched_tokens(1, toks, len(toks), 0) == (0, False)
        assert core.stats.lookup_timeouts == 1 and store.asked
        key = store.asked[0]
        core.index.put_present(key, ObjectSpan(0, 4))  # the upload's confirmation, meanwhile
        store.release.set()
        deadline = time.monotonic() + 5
        while core._lookups.pending_waves and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core._lookups.pending_waves == 0
        assert core.index.get(key) == ObjectSpan(0, 4)
    finally:
        core.close_lookup()


def test_lookup_counts_its_cpu_and_keeps_a_handed_over_token_list():
    g = geo()
    mem = MemoryStore()
    stored = tokens_of(40 * TPB + 9, seed=7)
    put_prefix(mem, g, stored, 40, 4)
    core = _leader(mem, g, lookup_timeout_s=0)
    try:
        mine = list(stored)
        assert core.get_num_new_matched_tokens(1, mine, len(mine), 0, owned=True)[0] == 40 * TPB
        assert core._requests[1].tokens is mine  # handed over: not copied
        theirs = list(stored)
        assert core.get_num_new_matched_tokens(2, theirs, len(theirs), 0)[0] == 40 * TPB
        kept = core._requests[2].tokens
        assert kept is not theirs and kept == theirs  # not handed over: a copy of its own
        longer = stored + [1, 2, 3]  # a replayed request with generated tokens: only the prompt is kept
        core.get_num_new_matched_tokens(3, longer, len(stored), 0, owned=True)
        assert core._requests[3].tokens == stored
        st = core.stats
        assert 0 < st.lookup_hash_cpu_s <= st.lookup_cpu_s
    finally:
        core.close_lookup()


def test_a_store_slower_than_the_budget_costs_the_scheduler_nothing_after_a_few_lookups():
    """Issue 37 (attacked): a store that answers every HEAD slower than the cap and never fails
    (its uploads succeed, so the breaker never opens) cost every lookup its whole budget, forever:
    500 ms at the defaults. Once the last few waves were all slower than a lookup's budget, its
    wave goes to the background (a miss now, the prefix warmed in the index for its next lookup),
    and when the store is fast again the background waves show it and lookups wave again."""
    g = geo()
    mem = MemoryStore()
    slow = SlowHeads(mem, 0.3)
    # 64 blocks at 2,000 tokens/s: a ~0.5 s budget, capped at 150 ms -- half a wave.
    core = _leader(slow, g, prefill_tokens_per_s=2_000.0, lookup_max_stall_ms=150.0, lookup_max_pending=4)
    prompts = [tokens_of(64 * TPB + 3, seed=s) for s in range(1, 13)]
    for p in prompts:
        put_prefix(mem, g, p, 64, 4)
    try:
        stalls = []
        for i, p in enumerate(prompts[:8]):
            t0 = time.monotonic()
            assert core.get_num_new_matched_tokens(i, p, len(p), 0) == (0, False)
            stalls.append(time.monotonic() - t0)
            time.sleep(0.35)  # requests keep arriving; the background waves end meanwhile
        assert all(s >= 0.14 for s in stalls[:3]), stalls  # learning: the first waves wait their budget
        assert max(stalls[4:]) < 0.05, stalls  # then nothing on the scheduler's time (was 150 ms each)
        assert all(r.decision == "ran_out" for r in list(core.stats.recent_lookups)[-4:])
        # A prefix looked up while the store was slow was warmed in the background: its next lookup hits.
        deadline = time.monotonic() + 5
        while core._pending_waves and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.get_num_new_matched_tokens(100, prompts[7], len(prompts[7]), 0)[0] == 64 * TPB
        # The store is fast again: the next lookups' background waves show it, then lookups hit.
        slow.delay_s = 0.005
        hits = 0
        for i, p in enumerate(prompts[8:]):
            hits += core.get_num_new_matched_tokens(200 + i, p, len(p), 0)[0] > 0
            time.sleep(0.35)
        assert hits >= 2, hits
    finally:
        core.close_lookup()


def test_this_engines_own_upload_is_believed_for_the_floors_life_a_heads_answer_for_the_ttl():
    """Until a fleet index says what gc keeps, an upload this engine made is known present for
    the floor's life (the retention floor + the TTL: gc deletes nothing younger by any rule, a
    learnt retention included), a HEAD's answer only ``ttl_s`` (it says nothing of the object's
    age). Not the setting's hour: an engine that never sees an index cannot tell a gc keeping it
    from one that learnt a shorter retention. A quarantine or a "missing" asked after the upload
    still ends the belief."""
    now = [0.0]
    s = Settings(url="memory://x", index_ttl_s=600, retention_h=1.0)
    idx = KeyIndex.from_settings(s)
    idx._clock = lambda: now[0]
    for k in ("mine", "mine2", "mine3"):
        idx.put_written(k, ObjectSpan(0, 4))
    idx.put_present("headed", ObjectSpan(0, 4))
    now[0] = RETENTION_FLOOR_S + 600 - 1
    assert idx.get("mine") == ObjectSpan(0, 4) and idx.get("headed") is None
    idx.quarantine(["mine2"], 30)
    assert idx.get("mine2") is MISSING
    idx.put_many([], ["mine3"], asked_at=idx.now())  # asked after the upload: deleted since
    assert idx.get("mine3") is MISSING
    now[0] = RETENTION_FLOOR_S + 600 + 1  # gc may delete it from here on: verify before promising
    assert idx.get("mine") is None
    short = KeyIndex.from_settings(Settings(url="memory://x", index_ttl_s=60, retention_h=0.02))
    assert short.written_ttl_s == 0.02 * 3600 + 60  # a setting below the floor: gc keeps only that
    off = KeyIndex.from_settings(Settings(url="memory://x", index_ttl_s=0))
    off.put_written("k", ObjectSpan(0, 1))
    assert off.get("k") is None  # positives not kept at all: nor own uploads
