"""Leader bookkeeping the engine may never end for us, and the optional engine hooks."""

from __future__ import annotations

import logging

from test_leader_plan import (
    Slots,
    engine_slots,
    geometry,
    make_core,
    run_prefill,
    save_through_store,
    toks,
)

from s3kv.store.memory import MemoryStore

TPB = 16


def test_state_of_requests_the_engine_forgot_expires(monkeypatch):
    import s3kv.engine.leader.core as leader_mod

    now = [1000.0]
    monkeypatch.setattr(leader_mod.time, "monotonic", lambda: now[0])
    g = geometry()
    core = make_core(g, request_state_ttl_s=60)
    tokens = toks(9 * TPB + 1)
    core.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    run_prefill(core, 1, tokens, Slots(g).alloc(10))  # reported once, never finished
    core.get_num_new_matched_tokens(2, tokens, len(tokens), 0)  # looked up, never reported
    assert core.active_requests() == 2
    now[0] += 61
    for _ in range(600):  # the sweep runs every 256 iterations
        m = core.build_connector_meta([], [])
        if m.discard_ids:
            break
    assert core.active_requests() == 0 and core.stats.requests_expired == 2
    assert m.discard_ids == frozenset({1, 2})  # the workers drop what they staged for them


def _stored_core(**settings):
    """A leader over a store holding a 12-block prefix, and that prompt (13 blocks and a bit)."""
    g = geometry()
    store = MemoryStore()
    tokens = toks(12 * TPB + 5, seed=6)
    save_through_store(g, store, tokens)
    return g, make_core(g, store, **settings), tokens


def _frozen_gauge(core):
    gauge = core._lookups.pressure
    gauge.clock = lambda: 0.0
    return gauge


def test_engine_cancel_load_shrinks_the_offer_and_request_reset_discards():
    g, core, tokens = _stored_core()
    n, _ = core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)
    assert n == 12 * TPB
    core.cancel_load(5, 8 * TPB, 12 * TPB)  # the engine hands back the tail of the offer
    slots = engine_slots(g, Slots(g), 13, 8)  # V2's page rule at the honoured history
    core.update_state_after_alloc(5, slots, honoured_tokens=8 * TPB)
    meta = core.build_connector_meta([], [])
    assert not meta.failed_load_ids and max(o for op in meta.loads for o in op.ordinals) == 7
    core.request_reset(5)
    assert core.active_requests() == 0 and 5 in core.build_connector_meta([], []).discard_ids


def test_a_smaller_honour_told_by_cancel_load_first_still_shows_memory_pressure():
    """An engine may hand back the offer's tail (``cancel_load``) before it reports what it
    honoured: the offer guard must still see a smaller honour of a grow-needing offer (pressure),
    not a full one (the engine grew), or it would never cut (engine/leader/pressure.py)."""
    g, core, tokens = _stored_core(offer_guard="pressure")
    gauge = _frozen_gauge(core)
    n, _ = core.get_num_new_matched_tokens(5, tokens, len(tokens), 0, first_chunk_tokens=9 * TPB)
    assert n == 12 * TPB and not gauge.on()  # reaches the first chunk's end: needs a grow
    core.cancel_load(5, 8 * TPB, 12 * TPB)
    core.update_state_after_alloc(5, engine_slots(g, Slots(g), 13, 8), honoured_tokens=8 * TPB)
    assert gauge.on() and gauge.episodes == 1


def test_a_whole_offer_taken_back_then_nothing_honoured_shows_pressure():
    g, core, tokens = _stored_core()
    gauge = _frozen_gauge(core)
    assert core.get_num_new_matched_tokens(5, tokens, len(tokens), 0, first_chunk_tokens=TPB)[0] == 12 * TPB
    core.cancel_load(5, 0, 12 * TPB)
    core.update_state_after_alloc(5, engine_slots(g, Slots(g), 13, 0), honoured_tokens=0)
    meta = core.build_connector_meta([], [])
    assert gauge.on() and not meta.loads and not meta.failed_load_ids


def test_partial_block_device_match_is_a_counted_miss():
    g = geometry()
    core = make_core(g)
    tokens = toks(9 * TPB + 1)
    assert core.get_num_new_matched_tokens(1, tokens, len(tokens), TPB + 3) == (0, False)
    assert core.stats.partial_block_misses == 1


def _decoding_past_its_prompt(rid: int = 1):
    """A leader whose request ``rid`` prefilled 20 blocks and decoded 4 more: its standing finish
    plan stages live pages. -> (core, geometry, tokens, page lists, metadata so far)."""
    from test_leader_plan import decode

    g = geometry()
    core = make_core(g, storage_policy="window", checkpoint_tokens=64 * TPB)
    P = 20 * TPB + 3
    tokens = toks(P)
    core.get_num_new_matched_tokens(rid, tokens, P, 0)
    src = Slots(g)
    slots = src.alloc(21)
    metas = run_prefill(core, rid, tokens, slots)
    metas += decode(core, rid, tokens, slots, src, 4 * TPB)
    return core, g, tokens, slots, metas


def test_a_request_finished_after_its_pages_were_freed_saves_nothing_more(caplog):
    """KVCacheManagerV2's request_finished with one empty list per group: the engine freed the
    request's pages first (its forward raised and _handle_errors failed it, or the overlap loop
    finishes a request cancelled in flight). Those pages may be another request's, and the last
    forward may never have written them: the standing finish plan, which copies them, must not run.
    False keeps the id from get_finished; the next metadata has the workers drop its plan and open
    objects -- before this, True sent the plan to run and only a log said the pages were gone."""
    core, g, tokens, _, _ = _decoding_past_its_prompt()
    plan = core._requests[1].finish_sent
    assert plan is not None and plan.stages  # it would copy live pages at finish
    with caplog.at_level(logging.WARNING):
        assert core.request_finished(1, [[], []]) is False
    assert core.stats.finished_after_release == 1 and core.stats.finish_plan_mismatches == 0
    assert "freed its pages" in caplog.text
    assert core.active_requests() == 0
    md = core.build_connector_meta([], [])
    assert 1 in md.discard_ids and not md.stages and not md.seals
    # A request looked up but never given a page is told with empty lists as always: nothing to drop.
    core.get_num_new_matched_tokens(2, toks(3 * TPB), 3 * TPB, 0)
    assert core.active_requests() == 1
    assert core.request_finished(2, [[], []]) is False and core.stats.finished_after_release == 1
    # One V2 branch passes the lists as a dict keyed by group id: the same rule.
    core.get_num_new_matched_tokens(3, tokens, len(tokens), 0)
    run_prefill(core, 3, tokens, Slots(g).alloc(21))
    assert core.request_finished(3, {0: [], 1: []}) is False and core.stats.finished_after_release == 2


def test_a_finish_plan_whose_pages_the_engine_no_longer_holds_never_runs(caplog):
    """An engine that frees sliding pages earlier than the page rule s3kv assumes lists fewer pages
    at request_finished than the standing plan copies. Those pages may be another request's: the
    plan must not run (before, it ran and uploaded them, and only a log and a local quarantine
    followed). False keeps the id from get_finished; the next metadata discards the plan."""
    core, g, tokens, slots, metas = _decoding_past_its_prompt()
    plan = core._requests[1].finish_sent
    assert plan is not None and plan.stages and any(op.buffer.group == 0 for op in plan.stages)
    live = [[-1] * len(slots[0]), slots[1]]  # every sliding page gone, the full-attention ones listed
    with caplog.at_level(logging.ERROR):
        assert core.request_finished(1, live) is False
    assert core.stats.finish_plan_mismatches == 1 and "please report" in caplog.text
    assert core.stats.finished_after_release == 0  # not every list was empty
    md = core.build_connector_meta([], [])
    assert 1 in md.discard_ids and not md.stages and not md.seals
    # The same request with its pages listed as the rule says: the plan runs (True) and nothing is dropped.
    core2, _, _, slots2, _ = _decoding_past_its_prompt()
    assert core2.request_finished(1, slots2) is True and core2.stats.finish_plan_mismatches == 0
    assert 1 not in core2.build_connector_meta([], []).discard_ids

