"""Offers a failed allocation grow cannot break (``s3kv/engine/leader/pressure.py``).

KVCacheManagerV2 under memory pressure honours ``(C - 1) // tpb * tpb`` of an offer reaching the
first chunk's end ``C``; with the window policy most such points have no stored sliding tail, and
on a line without the failed-load path the request then parks until its client gives up. These
tests drive the simulator's V2 rule (``SimEngine(first_chunk=..., grow_fails=...)``) over every
first-chunk end of a stored prompt, one request after another on one engine, as pressure comes
and goes, and count what parks, what is served, and what the guard gave up.
"""

from __future__ import annotations

import itertools
import random

import pytest
from test_metrics import sample, scrape

from s3kv.config import Settings
from s3kv.engine.leader.pressure import PressureGauge, fallback_blocks
from s3kv.engine.metrics import Metrics
from s3kv.sim import (
    SimCacheConfig,
    SimEngine,
    SimRequestSpec,
    gemma3_like,
    honour_when_growth_fails,
    preempt_once,
    random_tokens,
)
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

TPB, WINDOW = 16, 64
BLOCKS = 20  # full blocks of PROMPT; tails are stored at 8, 16 (checkpoints) and 20 (history end)
PROMPT = tuple(random_tokens(random.Random(8), BLOCKS * TPB + 5, 32000))
_keys = itertools.count()


def _engine(store, *, guard, chunks, grow_fails, hook=False, frozen=True):
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, blocks_per_object=4, lookup_timeout_s=5.0,
                 checkpoint_tokens=8 * TPB, offer_guard=guard)
    eng = SimEngine(
        gemma3_like(WINDOW, num_layers=6, kv_heads=2, head_dim=8),
        SimCacheConfig(tokens_per_block=TPB, max_seq_len=4096),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        chunk_size=8 * TPB,
        first_chunk=lambda rid: chunks.get(rid),
        grow_fails=grow_fails,
        failed_load_hook=hook,
        connector_kwargs=dict(settings=s, store=store, engine_key=f"guard-{next(_keys)}"),
    )
    if frozen:  # the hold never runs out: pressure ends only as the engine shows it
        eng.leader.core._lookups.pressure.clock = lambda: 0.0
    return eng


def _stored():
    store = MemoryStore()
    with _engine(store, guard="off", chunks={}, grow_fails=None) as cold:
        cold.run([SimRequestSpec(1, PROMPT, max_new_tokens=2)])
        assert cold.workers[0].flush(30)
    return store


def _busy(rid):
    """Keeps batches queued, so a request parked for good is cancelled (upstream cancels only in a
    pass that queues a batch)."""
    return SimRequestSpec(rid, tuple(random_tokens(random.Random(rid), 2 * TPB, 32000)), max_new_tokens=60)


def _sweep(store, guard, pressure, *, hook=False, parks=(), order=None):
    """One request per first-chunk end (1..BLOCKS blocks, or ``order``), in turn on one engine;
    ``pressure(k)``: does growing the allocation fail for the request whose first chunk is ``k``
    blocks. Results by ``k`` (a repeat past the first BLOCKS by ``(k, position)``).

    ``parks``: the requests expected to park for good, whose client gives up after 25 passes. The
    others get no deadline, so a served request never races its async load against a client's
    clock; one that parks anyway hangs the run (``SimHang``), which fails the test."""
    order = list(order or range(1, BLOCKS + 1))
    chunks = {100 * i + k: k * TPB for i, k in enumerate(order, start=1)}
    out = {}
    with _engine(store, guard=guard, chunks=chunks, grow_fails=lambda rid: pressure(rid % 100), hook=hook) as eng:
        for i, k in enumerate(order, start=1):
            give_up = 25 if k in parks else None
            rid = 100 * i + k
            rep = eng.run([SimRequestSpec(rid, PROMPT, max_new_tokens=2, cancel_after_iterations=give_up),
                           _busy(10_000 + rid)])
            r = rep.by_id(rid)
            assert rep.kv_mismatches == 0, (guard, k)
            out[k if i <= BLOCKS else (k, i)] = "parked" if r.cancelled else r.matched_tokens // TPB
        stats = eng.leader.core.stats
        parked_by_cause = eng.workers[0].core.stats().parked_by_cause
    return out, stats, parked_by_cause


#: Points the stored tails serve (docs/failures.md, "Smaller honours, measured"): a tail ending at
#: c serves c and c - 1, and the checkpoint's tail (ends 16) with the history end's (ends 20) cover
#: every sliding block from 11 on; 0 honours nothing.
SERVABLE = {0, 7, 8, 15, 16, 17, 18, 19, 20}


def test_sustained_pressure_without_the_path_parks_none_instead_of_twelve():
    """Every grow fails. Unguarded, each first chunk ending past a point no tail serves parks its
    request (12 of 20). Guarded, the first smaller honour shows the pressure and every exposed offer
    after it is cut inside its first chunk: served, none parked."""
    store = _stored()
    exposed = [k for k in range(1, BLOCKS + 1) if k - 1 not in SERVABLE]
    off, off_stats, off_causes = _sweep(store, "off", lambda k: True, parks=exposed)
    parked = sorted(k for k, v in off.items() if v == "parked")
    assert parked == exposed and len(parked) == 12
    assert off_causes == {"broken_promise": len(parked)} and off_stats.offers_cut == 0

    on, on_stats, on_causes = _sweep(store, "pressure", lambda k: True)
    # k = 1 honours nothing (a smaller honour: pressure shown at no cost), so nothing parks at all.
    assert [k for k, v in on.items() if v == "parked"] == [] and on_causes == {}
    for k, v in on.items():
        fb = k - 1
        if fb in SERVABLE:  # safe offers are made in full; the engine honours its fallback
            assert v == fb, k
        else:  # cut to the largest stored point inside the first chunk, honoured in full
            assert v == max(p for p in SERVABLE if p < fb), k
    assert on_stats.offers_cut == len(parked) and on_stats.offers_exposed == len(parked)
    tokens_cut = sum((BLOCKS - max(p for p in SERVABLE if p < k - 1)) * TPB for k in parked)
    assert on_stats.tokens_cut == tokens_cut
    m = Metrics()
    m.observe_leader(on_stats)
    s = scrape(m)
    assert sample(s, "s3kv_offers_cut_total") == len(parked)
    assert sample(s, "s3kv_offer_tokens_cut_total") == tokens_cut


def test_the_first_exposed_offer_of_an_episode_is_the_only_one_at_risk():
    """Pressure begins at an exposed request (nothing shown before it): that one parks; the rest of
    the episode is cut and served."""
    store = _stored()
    out, stats, causes = _sweep(store, "pressure", lambda k: k >= 4, parks={4})
    assert [k for k, v in out.items() if v == "parked"] == [4]
    assert causes == {"broken_promise": 1}
    assert all(v == BLOCKS for k, v in out.items() if k < 4)  # no pressure: full offers


def test_no_pressure_no_cut_and_pressure_ends_when_a_grow_succeeds():
    """Grows succeed: every offer is made and honoured in full. Then pressure that ends: the first
    grow-needing offer honoured in full turns the guard off again."""
    store = _stored()
    out, stats, _ = _sweep(store, "pressure", lambda k: False)
    assert all(v == BLOCKS for v in out.values()) and stats.offers_cut == 0
    # Grows fail up to k = 9 only: the 1-block chunk shows the pressure (honours nothing), so the
    # exposed 2..7 are cut; 10..15 are cut too (pressure still held): a cut offer ends inside its
    # chunk, needs no grow, shows nothing. k = 16's fallback (15) is stored: offered in
    # full, the grow now succeeds, pressure ends -- and an exposed chunk end (11) that comes again
    # after it is offered in full and served whole.
    order = [*range(1, BLOCKS + 1), 11]
    out, stats, _ = _sweep(store, "pressure", lambda k: k <= 9, order=order)
    assert out[10] == 8 and out[11] == 8 and out[16] == BLOCKS
    assert out[(11, BLOCKS + 1)] == BLOCKS and stats.offers_cut == 12
    assert [k for k, v in out.items() if v == "parked"] == []


def test_a_fallback_the_lookup_did_not_ask_about_is_checked_before_cutting():
    """A tail at the fallback point that the lookup never asked about (it looked for the longest
    hit): the guard asks the store before cutting, finds it, and makes the offer in full; the
    engine's failed grow then honours that point and it is served."""
    store = MemoryStore()
    with _engine(store, guard="off", chunks={}, grow_fails=None) as cold:
        cold.run([SimRequestSpec(1, PROMPT[: 13 * TPB + 5], max_new_tokens=2)])  # a tail ending at 13
        cold.run([SimRequestSpec(2, PROMPT, max_new_tokens=2)])
        assert cold.workers[0].flush(30)
    with _engine(store, guard="always", chunks={3: 14 * TPB}, grow_fails=lambda rid: True) as eng:
        rep = eng.run([SimRequestSpec(3, PROMPT, max_new_tokens=2)])
        stats = eng.leader.core.stats
    r = rep.by_id(3)
    assert rep.kv_mismatches == 0 and r.offered_tokens == BLOCKS * TPB and r.matched_tokens == 13 * TPB
    assert stats.offers_exposed == 1 and stats.offers_cut == 0 and stats.promises_broken == 0


@pytest.mark.parametrize("guard", ["off", "pressure", "always"])
def test_a_preempted_request_shows_the_pressure_before_any_grow_fails(guard):
    """V2 preempts a request when pages run short and looks it up again: that replay is pressure.
    The next exposed offer is cut at once -- the first failed grow of the episode breaks nothing;
    unguarded, it parks."""
    store = _stored()
    other = tuple(random_tokens(random.Random(77), 40 * TPB, 32000))  # five chunks of 8 blocks
    with _engine(store, guard=guard, chunks={2: 12 * TPB}, grow_fails=lambda rid: rid == 2) as eng:
        eng.preempt_hook = preempt_once(after_chunks=1, request_ids={1})
        first = eng.run([SimRequestSpec(1, other, max_new_tokens=2)])
        assert first.by_id(1).replays == 1 and eng.leader.core._lookups.pressure.on()
        give_up = 25 if guard == "off" else None
        rep = eng.run([SimRequestSpec(2, PROMPT, max_new_tokens=2, cancel_after_iterations=give_up), _busy(3)])
        stats = eng.leader.core.stats
    r = rep.by_id(2)
    assert rep.kv_mismatches == 0
    if guard == "off":
        assert r.cancelled and stats.promises_broken == 1 and stats.offers_cut == 0
    else:
        assert not r.cancelled and r.matched_tokens == 8 * TPB
        assert stats.offers_cut == 1 and stats.promises_broken == 0


def test_a_request_asked_again_before_it_ran_shows_no_pressure():
    """Dropped from a pass before it ran (a token budget, not memory) and asked again: nothing."""
    store = _stored()
    with _engine(store, guard="pressure", chunks={}, grow_fails=None) as eng:
        core = eng.leader.core
        for _ in range(2):
            core.get_num_new_matched_tokens(9, list(PROMPT), len(PROMPT), 0, first_chunk_tokens=12 * TPB)
        assert not core._lookups.pressure.on()


def test_a_cut_stores_no_branch_tail_where_the_lookup_found_one():
    """The lookup found a tail at block 13 (the end of the stored chain); the guard cut the offer
    to a point inside a 5-block first chunk. A branch tail at 13 would only upload it again."""
    store = MemoryStore()
    with _engine(store, guard="off", chunks={}, grow_fails=None) as cold:
        cold.run([SimRequestSpec(1, PROMPT[: 13 * TPB + 5], max_new_tokens=2)])
        assert cold.workers[0].flush(30)
    with _engine(store, guard="always", chunks={3: 5 * TPB}, grow_fails=None) as eng:
        rep = eng.run([SimRequestSpec(3, PROMPT, max_new_tokens=2)])
        stats = eng.leader.core.stats
    assert rep.kv_mismatches == 0 and stats.offers_cut == 1 and stats.branch_tails == 0


def test_a_chunk_the_engine_will_not_say_is_no_chunk():
    from s3kv.trtllm.leader import first_chunk

    class Refuses:  # the C++ binding checks the request's state
        @property
        def context_chunk_size(self):
            raise RuntimeError("TLLM_CHECK failed")

    class Says:
        context_chunk_size = 256

    assert first_chunk(Refuses()) is None and first_chunk(object()) is None and first_chunk(Says()) == 256


def test_always_cuts_exposed_offers_even_without_pressure():
    store = _stored()
    out, stats, _ = _sweep(store, "always", lambda k: False)
    for k, v in out.items():
        assert v == (BLOCKS if k - 1 in SERVABLE else max(p for p in SERVABLE if p < k - 1)), k


def test_with_the_path_the_guard_keeps_more_than_a_recompute_would():
    """On a line with the failed-load path a broken promise ends the request by recomputing it
    whole; the cut serves the stored part inside the first chunk instead."""
    store = _stored()
    off, _, _ = _sweep(store, "off", lambda k: True, hook=True)
    on, _, _ = _sweep(store, "pressure", lambda k: True, hook=True)
    assert sum(on.values()) > sum(off.values())
    assert "parked" not in off.values() and "parked" not in on.values()


@pytest.mark.parametrize("d_blocks", [0, 3])
def test_the_guard_predicts_the_simulators_v2_rule(d_blocks):
    """The connector's fallback point equals what the simulator's V2 honours on a failed grow."""
    for chunk_blocks in range(1, 12):
        honour = honour_when_growth_fails(chunk_blocks * TPB, TPB, d_blocks * TPB)
        for offer_blocks in range(1, 16):
            fb = fallback_blocks(d_blocks, offer_blocks, chunk_blocks * TPB, TPB)
            got = d_blocks + honour(offer_blocks * TPB) // TPB
            assert (fb is None) == (got == d_blocks + offer_blocks and offer_blocks < chunk_blocks)
            assert got == (d_blocks + offer_blocks if fb is None else fb)


def test_the_gauge_holds_pressure_for_its_hold_and_backs_off_when_it_comes_straight_back():
    now = [0.0]
    g = PressureGauge(hold_s=60, clock=lambda: now[0])
    assert not g.on()
    g.honoured(needed_grow=True, less=False)
    assert not g.on()
    g.honoured(needed_grow=True, less=True)
    assert g.on() and g.episodes == 1
    now[0] = 59
    g.honoured(needed_grow=False, less=False)  # no grow needed: says nothing of memory
    assert g.on()
    now[0] = 120
    assert not g.on()
    g.honoured(needed_grow=False, less=True)  # back within a hold of the expiry: the hold doubles
    assert g.on() and g.episodes == 2 and g.hold_s == 120
    now[0] = 120 + 121
    assert not g.on()
    g.honoured(needed_grow=True, less=True)
    assert g.hold_s == 240 and g.episodes == 3
    g.honoured(needed_grow=True, less=False)  # the engine grew, but the pressure flaps: its hold ends it
    assert g.on() and g.hold_s == 240
    now[0] = 241 + 241
    assert not g.on()
    now[0] = 1000  # long after the expiry: a new episode, at the base hold
    g.honoured(needed_grow=True, less=True)
    assert g.on() and g.hold_s == 60 and g.episodes == 4
    g.honoured(needed_grow=True, less=False)  # the engine grew: over, and the hold is back to base
    assert not g.on() and g.hold_s == 60
    now[0] = 1030  # back within a hold of that end: flapping, the hold doubles and a grow no longer ends it
    g.honoured(needed_grow=True, less=True)
    assert g.on() and g.hold_s == 120 and g.episodes == 5
    g.honoured(needed_grow=True, less=False)
    assert g.on()
    now[0] = 1030 + 121
    assert not g.on()
    now[0] = 1151 + 600  # long after the expiry: a new episode, at the base hold
    g.honoured(needed_grow=True, less=True)
    assert g.on() and g.hold_s == 60 and g.episodes == 6


def test_pressure_that_flaps_breaks_one_promise_per_doubling_not_one_per_flap():
    """Issue 37 (attacked): a client can make the engine short of pages (a burst of long prompts
    that are misses, so nothing it sends is an offer) and let go again. The first exposed offer
    of the episode -- another client's -- breaks (parks on the merged line); the guard turns on;
    then one grow-needing offer honoured in full (the burst is over: a safe offer of the
    attacker's own, a stored prefix whose fallback is stored) turned it off again, at once. Every
    burst then broke one more victim's promise: one per flap, as fast as the attacker can flap.
    Pressure back within a hold of the last episode's end -- by a grow or by its hold -- is
    flapping: the hold doubles, and that episode ends only with its hold, so a flapping engine
    breaks one promise per doubling, as sustained pressure does."""
    store = _stored()
    victim, safe = 12, 9  # first chunks of 12 blocks (fallback 11: no tail) and 9 (fallback 8: stored)
    cycles = 4
    chunks = {100 * i + k: k * TPB for i in range(1, cycles + 1) for k in (victim, safe)}
    parked, served, probes = [], [], []
    with _engine(store, guard="pressure", chunks=chunks, grow_fails=lambda rid: rid % 100 == victim) as eng:
        for i in range(1, cycles + 1):
            rid = 100 * i + victim  # the burst holds the pages: this victim's grow fails
            rep = eng.run([SimRequestSpec(rid, PROMPT, max_new_tokens=2, cancel_after_iterations=40),
                           _busy(10_000 + rid)])
            assert rep.kv_mismatches == 0
            (parked if rep.by_id(rid).cancelled else served).append(rep.by_id(rid).matched_tokens // TPB)
            rid = 100 * i + safe  # the burst is over: the attacker's safe offer, honoured in full
            rep = eng.run([SimRequestSpec(rid, PROMPT, max_new_tokens=2)])
            assert rep.kv_mismatches == 0
            probes.append(rep.by_id(rid).matched_tokens // TPB)
        stats = eng.leader.core.stats
        gauge = eng.leader.core._lookups.pressure
    print(f"flapping pressure, {cycles} bursts: {len(parked)} victims parked, {len(served)} cut and served "
          f"({served} blocks), probes {probes}, broken {stats.promises_broken}, cut {stats.offers_cut}")
    assert len(parked) == 2 and stats.promises_broken == 2  # the first episode, and the first flap
    assert served == [8] * (cycles - 2)  # cut inside the first chunk: the stored 8 blocks
    assert gauge.on() and gauge.hold_s > gauge.base_hold_s
