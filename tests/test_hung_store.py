"""A store that stops answering is found within seconds, with the default settings (issue 29.5).

A hung store fails no call. With the defaults the leader's lookups each counted their timeout, but
after ``lookup_max_pending`` (4) hung waves the rest were busy misses that count nothing, below
``breaker_failures`` (5): the breaker opened only when the hung HEADs' client timeouts and retries
ran out, 40 s on. And a load promised from the index just before the hang waited for
``load_timeout_s`` (60 s) before it took its failure rung.
"""

from __future__ import annotations

import threading
import time

from test_lookup import TPB, geo, tokens_of
from test_worker import GatedStore, _saved, load_md, make_core, page_bytes, step

from s3kv.config import Settings
from s3kv.engine.index import KeyIndex
from s3kv.engine.leader import LeaderCore
from s3kv.store.base import HeadBatch, StoreWrapper
from s3kv.store.breaker import BreakerPolicy, BreakerState, CircuitBreakerStore
from s3kv.store.memory import MemoryStore

DEFAULTS = Settings()


class HungHeads(StoreWrapper):
    """HEADs block until released (a store that stopped answering)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.release = threading.Event()

    def head_many(self, keys) -> HeadBatch:
        self.release.wait(30)
        return super().head_many(keys)


def test_a_hung_store_opens_the_breaker_within_seconds_with_the_defaults():
    assert DEFAULTS.lookup_max_pending < DEFAULTS.breaker_failures  # the shape that hid it
    g = geo()
    hung = HungHeads(MemoryStore())
    breaker = CircuitBreakerStore(hung, BreakerPolicy.from_settings(DEFAULTS))
    s = DEFAULTS.replace(url="memory://t", blocks_per_object=4, checkpoint_tokens=16 * TPB)
    core = LeaderCore(s, breaker, "pfx", tp_size=1, model_id=g.model_id, kv_dtype=g.kv_dtype,
                      index=KeyIndex(10_000, 600.0, 2.0), geometry=g)
    try:
        t0 = time.monotonic()
        opened = None
        seed = 0
        while time.monotonic() - t0 < 8:  # a lookup every 50 ms, as requests arrive
            seed += 1
            prompt = tokens_of(20 * TPB + 3, seed=seed)
            assert core.get_num_new_matched_tokens(seed, prompt, len(prompt), 0) == (0, False)
            if breaker.state is BreakerState.OPEN:
                opened = time.monotonic() - t0
                break
            time.sleep(0.05)
        assert core.stats.lookup_busy > 0  # lookups past the backlog sent nothing
        assert opened is not None and opened < DEFAULTS.breaker_stall_s + 1.5, opened
        assert breaker.stalls == 1
    finally:
        hung.release.set()
        core.close_lookup()


def test_a_load_stalled_past_its_deadline_takes_its_rung_not_a_minute():
    """A load promised just before the store hung: the read never ends. With the defaults
    (load_timeout_s=60) it is a failed load after load_stall_s, named to the engine's failed-load
    hook (rung 1; rung 3 parks and retries it), and the stall counts toward the breaker."""
    store = MemoryStore()
    key, d, _ = _saved(store)
    gated = GatedStore(store)  # every GET hangs
    breaker = CircuitBreakerStore(gated, BreakerPolicy.from_settings(DEFAULTS))
    b, lb = make_core(breaker, seed=2, load_timeout_s=DEFAULTS.load_timeout_s)
    try:
        before = page_bytes(lb, 0, 20)
        t0 = time.monotonic()
        step(b, load_md(7, 0, d, ((0, 3),), [0], [20], is_async=True), started_loading=[7])
        failed: set[int] = set()
        while not failed and time.monotonic() - t0 < 20:
            step(b, None)
            failed = b.take_failed_load_request_ids()
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert failed == {7}, took
        assert DEFAULTS.load_stall_s <= took < DEFAULTS.load_stall_s + 2, took
        assert breaker.consecutive_failures == 1  # the stalled read counted where health is judged
        gated.gate.set()  # the read ends late: it must not place anything
        time.sleep(0.2)
        assert page_bytes(lb, 0, 20) == before
    finally:
        gated.gate.set()
        b.close()


def test_a_sync_load_stalled_fails_in_load_stall_s():
    store = MemoryStore()
    key, d, _ = _saved(store)
    gated = GatedStore(store)
    b, lb = make_core(gated, seed=2, load_timeout_s=DEFAULTS.load_timeout_s, load_stall_s=0.5)
    try:
        t0 = time.monotonic()
        step(b, load_md(7, 0, d, ((0, 3),), [0], [20]))
        assert b.take_failed_load_request_ids() == {7}
        assert time.monotonic() - t0 < 2
    finally:
        gated.gate.set()
        b.close()


def test_a_load_waiting_behind_healthy_full_object_reads_is_not_cut_by_its_own_limit():
    """S3KV_LOAD_STALL_S is per 32 MiB: a 1-page tail load queued behind eight 128 MiB reads (every
    GET slot) waits as long as those reads may healthily take, and is cut only once no read ended
    for that long. Injected clock, no threads."""
    from types import SimpleNamespace

    from s3kv.core.objects import ObjectIdentity
    from s3kv.engine.worker.loads import LoadJobs
    from s3kv.transfer.counters import Counters
    from s3kv.transfer.download import LoadJob

    inf = float("inf")
    loads = LoadJobs(Settings(url="memory://unused", check_access=False, load_stall_s=5.0), None, Counters(),
                     failed_load_hook=True)
    loads.downloader = SimpleNamespace(last_read_end=0.0)
    ident = ObjectIdentity(b"ns", "0" * 16, 0, 1, TPB, 1 << 20)  # 1 MiB pages

    def job(pages, reading_since=inf):
        return LoadJob(key=f"k{pages}", group=0, regions=(), identity=ident, first=0, count=pages,
                       last_digest=b"", targets=[(i, i) for i in range(pages)], request_ids={1},
                       is_async=True, deadline=inf, submitted_at=0.0, reading_since=reading_since)

    reads = [job(128, reading_since=0.0) for _ in range(8)]  # 128 MiB each: 20 s allowed
    tail = job(1)  # 1 MiB: 5 s of its own
    loads.jobs.extend([*reads, tail])
    assert not loads._stalled(tail, 19.0)  # the reads stream at ~7 MB/s each: healthy, it waits
    assert loads._stalled(tail, 20.5)  # no read ended for longer than any may take: they hang
    loads.downloader.last_read_end = 18.0  # one ended meanwhile
    assert not loads._stalled(tail, 20.5)
    for r in reads:  # the reads are over and it still has no connection: its own limit again
        r.reading_since = inf
    assert not loads._stalled(tail, 22.9) and loads._stalled(tail, 23.1)
