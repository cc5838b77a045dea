"""The failed-load path (docs/failures.md, rung 1): a failed promised load ends its request.

The manager model (``s3kv/sim/failpath.py``) is checked against the sequence upstream's own tests
assert (consensus, release on every rank, scheduler abort, finalize); then s3kv on it: honour-less
and corrupt-object requests end (failed or recomputed), none parked, never a wrong byte. Without
the path a broken promise parks, and is counted by cause.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time

import pytest

from s3kv.config import Settings, warn_once
from s3kv.sim import (
    SimCacheConfig,
    SimEngine,
    SimEngineCrash,
    SimRequestSpec,
    gemma3_like,
    honour_when_growth_fails,
    random_tokens,
)
from s3kv.sim.failpath import TRANSFER_FAILED, FailedLoadPath
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker
from s3kv.trtllm.api import FAILED_LOAD_HOOK, engine_features

TPB, WINDOW = 16, 64
_keys = itertools.count()


# ----------------------------------------------------------------------------- the manager model


class _Worker:
    def __init__(self, release: object = True):
        self.finished: tuple[list[int], list[int]] = ([], [])
        self.failed: set[int] = set()
        self.aborted: list[int] = []
        self.release = release

    def get_finished(self, finished_gen, started_loading):
        out, self.finished = self.finished, ([], [])
        return out

    def take_failed_load_request_ids(self):
        out, self.failed = self.failed, set()
        return out

    def try_abort_request(self, request_id):
        self.aborted.append(request_id)
        return self.release


class _Scheduler:
    def __init__(self):
        self.successful: list[int] = []
        self.aborted: list[tuple[int, str]] = []

    def finalize_successful_load(self, request_id):
        self.successful.append(request_id)
        return True

    def try_abort_request(self, request_id, reason):
        self.aborted.append((request_id, reason))
        return True


def _path(tp):
    def call(name, fn, *args):
        return fn(*args)

    def parse(rank, ret):
        return list(ret[0]), list(ret[1])

    return FailedLoadPath(tp, call, lambda msg: SimEngineCrash("get_finished", msg), parse)


def test_a_failure_on_one_rank_aborts_on_every_rank_before_the_request_ends():
    """Pass 1: rank 1 reports the failure (intent -> consensus). Pass 2: every worker releases it,
    then rank 0's scheduler aborts it. Pass 3: finalized, returned failed. Rank 0 finishing the
    same load meanwhile does not resume it (a failure wins)."""
    workers, sched, path = [_Worker(), _Worker()], _Scheduler(), _path(2)
    r = path.poll(workers, sched, [], [42])
    assert r.failed_loads == () and not r.resumed_loads
    workers[0].finished = ([], [42])
    workers[1].failed = {42}
    r = path.poll(workers, sched, [], [])
    assert r.failed_loads == () and workers[0].aborted == workers[1].aborted == [] and sched.aborted == []
    r = path.poll(workers, sched, [], [])
    assert workers[0].aborted == workers[1].aborted == [42] and r.released == {42}
    assert sched.aborted == [(42, TRANSFER_FAILED)] and r.failed_loads == () and sched.successful == []
    r = path.poll(workers, sched, [], [])
    assert r.failed_loads == (42,) and not r.resumed_loads
    assert all(not m.tracked() for m in path.ranks)
    r = path.poll(workers, sched, [], [])  # nothing is done twice
    assert r.failed_loads == () and workers[0].aborted == [42] and sched.aborted == [(42, TRANSFER_FAILED)]


def test_a_load_resumes_a_pass_after_every_rank_finished_it():
    workers, sched, path = [_Worker(), _Worker()], _Scheduler(), _path(2)
    path.poll(workers, sched, [], [7])
    workers[0].finished = ([], [7])
    assert not path.poll(workers, sched, [], []).resumed_loads
    workers[1].finished = ([], [7])
    assert not path.poll(workers, sched, [], []).resumed_loads and sched.successful == [7]
    assert path.poll(workers, sched, [], []).resumed_loads == {7}


def test_failed_ids_that_are_not_exact_ints_are_dropped_as_the_fork_drops_them():
    """The fork keeps only ``int`` ids: one that is a bool or an int subclass never aborts its
    request there -- so the simulator drops it too, and a worker returning such ids is caught."""

    class Id(int):
        pass

    workers, sched, path = [_Worker()], _Scheduler(), _path(1)
    path.poll(workers, sched, [], [42])
    workers[0].failed = {Id(42)}
    for _ in range(3):
        r = path.poll(workers, sched, [], [])
        assert r.failed_loads == () and workers[0].aborted == [] and sched.aborted == []
    workers[0].failed = {42}
    for _ in range(3):
        r = path.poll(workers, sched, [], [])
    assert sched.aborted == [(42, TRANSFER_FAILED)] and r.failed_loads == (42,)


def test_failed_ids_of_untracked_requests_are_dropped():
    """A sync load is no async load the manager tracks: its failure is ignored (hence sync is never used)."""
    workers, sched, path = [_Worker()], _Scheduler(), _path(1)
    workers[0].failed = {5}
    for _ in range(3):
        assert path.poll(workers, sched, [], []).failed_loads == ()
    assert workers[0].aborted == []


def test_a_worker_that_does_not_release_kills_the_engine():
    workers, sched, path = [_Worker(release=False)], _Scheduler(), _path(1)
    path.poll(workers, sched, [], [3])
    workers[0].failed = {3}
    path.poll(workers, sched, [], [])
    with pytest.raises(SimEngineCrash, match="failed to release request 3"):
        path.poll(workers, sched, [], [])


# ----------------------------------------------------------------------------- feature detection


class _W:
    pass


class _S:
    pass


def _cls(base, **methods):
    return type("X", (base,), {name: (lambda self, *a: True) for name in methods})


@pytest.mark.parametrize(
    ("worker", "scheduler", "found"),
    [
        (dict(take_failed_load_request_ids=1, try_abort_request=1), dict(try_abort_request=1,
                                                                        finalize_successful_load=1), True),
        (dict(take_failed_load_request_ids=1, abort_request=1), dict(abort_request=1, finish_load=1), True),
        # the block-id API before it (get_block_ids_with_load_errors, handle_load_errors): not this path
        (dict(get_block_ids_with_load_errors=1, abort_request=1), {}, False),
        (dict(take_failed_load_request_ids=1), {}, False),
        ({}, {}, False),
    ],
    ids=["newest", "earlier-names", "block-ids", "half", "merged-line"],
)
def test_the_path_is_detected_by_its_names(worker, scheduler, found):
    features = engine_features(_cls(_W, **worker), _cls(_S, **scheduler))
    assert (FAILED_LOAD_HOOK in features) == found


# ----------------------------------------------------------------------------- s3kv on the path


def _engine(store, *, tp=1, hook=True, outcome="recompute", honour=None, policy="window", chunk=48, overlap=False,
            **settings):
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, blocks_per_object=4, lookup_timeout_s=5.0,
                 checkpoint_tokens=8 * TPB, storage_policy=policy, **settings)
    return SimEngine(
        gemma3_like(WINDOW, num_layers=6, kv_heads=2 * tp, head_dim=8),
        SimCacheConfig(tokens_per_block=TPB, max_seq_len=4096),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        tp_size=tp,
        chunk_size=chunk,
        honour=honour,
        failed_load_hook=hook,
        failed_load_outcome=outcome,
        overlap=overlap,
        connector_kwargs=dict(settings=s, store=store, engine_key=f"failpath-{next(_keys)}"),
    )


PROMPT = tuple(random_tokens(random.Random(8), 20 * TPB + 5, 32000))


def _stored(tp, policy="window"):
    store = MemoryStore()
    with _engine(store, tp=tp, policy=policy) as cold:
        cold.run([SimRequestSpec(1, PROMPT, max_new_tokens=2)])
        for w in cold.workers:
            assert w.flush(30)
    return store


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("outcome", ["fail", "recompute"])
def test_honoured_less_than_the_stored_tails_serve_ends_the_request(tp, outcome):
    """Boundaries a smaller load cannot serve under the window policy (no sliding tail ends there):
    the request ends -- failed with a clear reason, or recomputed bit-exact -- within a few passes,
    never parked, never a wrong byte; boundaries that can be served still are."""
    store = _stored(tp)
    for k in (3, 12, 8, 20):
        with _engine(store, tp=tp, outcome=outcome, honour=lambda offer, k=k: min(offer, k * TPB)) as eng:
            rep = eng.run([SimRequestSpec(100 + k, PROMPT, max_new_tokens=2)], max_iterations=200)
            stats = [w.core.stats() for w in eng.workers]
        r = rep.requests[0]
        assert rep.kv_mismatches == 0 and sum(s.parked_now for s in stats) == 0, k
        if k in (8, 20):  # a checkpoint and the offer itself: a correct smaller load
            assert r.matched_tokens == k * TPB and not r.failed and not r.recomputed_failed_load
        elif outcome == "fail":
            assert r.failed == "KV cache load failure" and r.output_tokens == ()
        else:
            assert r.recomputed_failed_load and r.matched_tokens == 0 and len(r.output_tokens) == 2


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("outcome", ["fail", "recompute"])
def test_a_corrupt_object_ends_its_request_and_the_next_one_misses(tp, outcome):
    store = _stored(tp)
    for key, (body, meta, t) in list(store._objects.items()):
        store._objects[key] = (body[:-8] + bytes(8), meta, t)  # the last page's bytes: checksums fail
    with _engine(store, tp=tp, outcome=outcome) as eng:
        first = eng.run([SimRequestSpec(200, PROMPT, max_new_tokens=2)], max_iterations=200)
        later = eng.run([SimRequestSpec(201, PROMPT, max_new_tokens=2)], max_iterations=200)
        stats = [w.core.stats() for w in eng.workers]
        aborted = eng.leader.core.stats.loads_aborted
    assert first.kv_mismatches == 0 and later.kv_mismatches == 0
    r = first.requests[0]
    assert (r.failed == "KV cache load failure") if outcome == "fail" else r.recomputed_failed_load
    assert aborted == 1 and sum(s.loads_aborted for s in stats) >= 1 and sum(s.parked_now for s in stats) == 0
    assert later.requests[0].offered_tokens == 0  # quarantined: a clean miss, no second failed load


def test_sync_is_never_honoured_even_with_the_path(caplog):
    store = _stored(1)
    warn_once.cache_clear()  # said once per process: an earlier test may have said it
    with caplog.at_level(logging.WARNING, logger="s3kv"), _engine(store, load_mode="sync") as eng:
        rep = eng.run([SimRequestSpec(300, PROMPT, max_new_tokens=2)])
    assert rep.kv_mismatches == 0 and rep.requests[0].loaded_async and rep.requests[0].matched_tokens
    assert "covers async loads only" in caplog.text


def _busy(rid):
    """A request that keeps batches queued for ~70 passes: upstream cancels only in a pass that
    queues a batch (py_executor @0004396), so a request parked for good is cancelled only then."""
    return SimRequestSpec(rid, tuple(random_tokens(random.Random(rid), 2 * TPB, 32000)), max_new_tokens=70)


def test_without_the_path_a_broken_promise_parks_and_is_counted_by_cause():
    store = _stored(1)
    with _engine(store, hook=False, honour=lambda offer: min(offer, 3 * TPB)) as eng:
        rep = eng.run([SimRequestSpec(400, PROMPT, max_new_tokens=2, cancel_after_iterations=30), _busy(401)])
        stats = eng.workers[0].core.stats()
    assert rep.kv_mismatches == 0 and rep.by_id(400).cancelled
    assert stats.parked_by_cause == {"broken_promise": 1} and stats.rung_parked_retry == 1


@pytest.mark.parametrize(("chunk_blocks", "parks"), [(3, True), (8, False)])
def test_v2s_own_smaller_honour_parks_only_off_a_stored_tail(chunk_blocks, parks):
    """V2 under memory pressure honours one block below the first chunk's end. A first chunk ending
    at a checkpoint (a quiet engine, chunk a multiple of the checkpoint spacing) lands on a stored
    tail and is served; one ending elsewhere is a broken promise: parked without the path (cause
    broken_promise), ended with it."""
    store = _stored(1)
    honour = honour_when_growth_fails(chunk_blocks * TPB, TPB)
    with _engine(store, hook=False, honour=honour, chunk=chunk_blocks * TPB) as eng:
        # The client gives up on a request parked for good; a served one must never race that
        # clock (its async load takes wall time, passes spin meanwhile: a loaded box ran 30 first).
        give_up = 30 if parks else 100_000
        rep = eng.run([SimRequestSpec(500, PROMPT, max_new_tokens=2, cancel_after_iterations=give_up), _busy(502)])
        stats = eng.workers[0].core.stats()
    r = rep.by_id(500)
    assert rep.kv_mismatches == 0 and r.cancelled == parks
    assert stats.parked_by_cause == ({"broken_promise": 1} if parks else {})
    if not parks:
        assert r.matched_tokens == (chunk_blocks - 1) * TPB
    with _engine(store, honour=honour, chunk=chunk_blocks * TPB) as eng:
        rep = eng.run([SimRequestSpec(501, PROMPT, max_new_tokens=2)], max_iterations=200)
    assert rep.kv_mismatches == 0 and rep.requests[0].recomputed_failed_load == parks


@pytest.mark.parametrize("rank1", ["reading", "copying"])
def test_an_abort_quiesces_another_ranks_load_in_flight(rank1):
    """TP 2: rank 0's object is corrupt, rank 1's load still in flight. The manager aborts on every
    rank, then frees the pages: rank 1's GET, when it comes back, must place nothing; a copy
    already issued must have completed before its ``try_abort_request`` returns."""
    from test_worker import GatedStore, _FakeEvent, digest, load_md, make_core, save_object, step

    from s3kv.sim.layouts import page_bytes

    store = MemoryStore()
    saver0, _ = make_core(store, seed=10, tp_rank=0, tp_size=2)
    saver1, _ = make_core(store, seed=11, tp_rank=1, tp_size=2)
    d = digest("abort-tp")
    md = save_object(saver0, 1, 1, 0, [3, 4, 5], d)
    for c in (saver0, saver1):
        step(c, md)
        assert c.flush(5)
        c.close()
    key0 = saver0.object_key(1, d)
    body, meta, t = store._objects[key0]
    store._objects[key0] = (body[:-8] + bytes(8), meta, t)  # rank 0's checksums fail
    gated = GatedStore(store)
    r0, _ = make_core(store, seed=20, tp_rank=0, tp_size=2)
    r1, l1 = make_core(gated, seed=21, tp_rank=1, tp_size=2)
    slots = (7, 8, 9)
    before = [page_bytes(l1, 1, s) for s in slots]
    lmd = load_md(5, 1, d, ((0, 3), (0, 3)), range(3), slots, is_async=True)
    step(r0, lmd, started_loading=[5])
    step(r1, lmd, started_loading=[5])
    in_flight = list(r1._loads.jobs)
    deadline = time.monotonic() + 10
    failed: set[int] = set()
    while not failed and time.monotonic() < deadline:
        step(r0, None)
        failed = r0.take_failed_load_request_ids()
    assert failed == {5} and in_flight and not any(j.finished for j in in_flight)
    assert r0.try_abort_request(5) is True
    if rank1 == "copying":  # the GET is back, its device copies still running
        copy_done, real_load = _FakeEvent(), r1._copier.load
        r1._copier.load = lambda copies: (real_load(copies), copy_done)[1]
        gated.gate.set()
        while not all(j.event is copy_done for j in in_flight) and time.monotonic() < deadline:
            time.sleep(0.01)
        returned = threading.Event()
        t = threading.Thread(target=lambda: r1.try_abort_request(5) and returned.set())
        t.start()
        assert not returned.wait(0.2)  # waits for the copies ...
        copy_done.flag.set()
        assert returned.wait(5)  # ... then releases the pages
        t.join()
        r0.close()
        r1.close()
        return
    assert r1.try_abort_request(5) is True
    gated.gate.set()  # rank 1's GET comes back after the abort
    while not all(j.finished for j in in_flight) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert all(j.finished for j in in_flight)
    assert [page_bytes(l1, 1, s) for s in slots] == before  # nothing landed in the freed pages
    assert step(r1, None) == ([], []) and r1.take_failed_load_request_ids() == set()
    r0.close()
    r1.close()


def test_an_abort_that_raises_part_way_still_waits_for_the_copies_before_releasing():
    """The manager frees an aborted request's pages once ``try_abort_request`` returned True (the
    adapter's answer even when the core raised): a load copy already issued must have completed."""
    from test_worker import _FakeEvent, digest, load_md, make_core, save_object, step

    from s3kv.trtllm.boundary import Contain

    store = MemoryStore()
    saver, _ = make_core(store, seed=10)
    d = digest("abort-raises")
    step(saver, save_object(saver, 1, 1, 0, [3, 4, 5], d))
    assert saver.flush(5)
    saver.close()
    core, _ = make_core(store, seed=20)
    copy_done, real_load = _FakeEvent(), core._copier.load
    core._copier.load = lambda copies: (real_load(copies), copy_done)[1]  # copies still running
    step(core, load_md(5, 1, d, ((0, 3),), range(3), (7, 8, 9), is_async=True), started_loading=[5])
    deadline = time.monotonic() + 10
    while not all(j.event is copy_done for j in core._loads.jobs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core._loads.jobs and all(j.event is copy_done for j in core._loads.jobs)

    def broken(rid):
        raise RuntimeError("abort failed before it waited for anything")

    core._loads.abort = broken
    w = object.__new__(S3KvConnectorWorker)  # the adapter around this core
    w.core, w._contain = core, Contain("worker")
    returned = threading.Event()
    t = threading.Thread(target=lambda: w.try_abort_request(5) and returned.set())
    t.start()
    assert not returned.wait(0.2)  # waits for the copies ...
    copy_done.flag.set()
    assert returned.wait(5)  # ... then lets the manager free the pages
    t.join()
    assert w._contain.errors["try_abort_request"] == 1
    core.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["non-overlap", "overlap"])
def test_a_cancel_lands_only_in_a_pass_that_queues_a_batch_and_tells_the_connector_nothing(overlap):
    """py_executor @0004396 runs ``_handle_canceled_requests`` only inside ``if can_queue:`` (after
    ``_send_kv_async``; the overlap loop: in ``_process_previous_batch``, with a previous batch): a
    request parked for good, alone, is never cancelled; beside a running request it is, freed
    without ``request_finished``."""
    from s3kv.sim import SimHang

    store = _stored(1)
    honour = lambda offer: min(offer, 3 * TPB)  # noqa: E731 - a broken promise: parked for good (no hook)
    with _engine(store, hook=False, honour=honour, overlap=overlap) as eng:
        with pytest.raises(SimHang):
            eng.run([SimRequestSpec(410, PROMPT, max_new_tokens=2, cancel_after_iterations=5)], max_iterations=100)
    with _engine(store, hook=False, honour=honour, overlap=overlap) as eng:
        told: list[int] = []
        real = eng.leader.request_finished_by_layer_group
        eng.leader.request_finished_by_layer_group = lambda req, lists: (told.append(req.request_id), real(req, lists))[1]
        rep = eng.run([SimRequestSpec(411, PROMPT, max_new_tokens=2, cancel_after_iterations=5), _busy(412)])
    assert rep.by_id(411).cancelled and not rep.by_id(412).cancelled
    assert told == [412]
