"""The retention gc learns from what the fleet reads (issue 38, ``s3kv.core.retention``): engines
report their dated reads while the fleet index says gc learns, gc folds the reports, publishes the
retention and deletes by it -- shorter when reads come early, longer again when they come late,
never below what an engine believes without asking.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import pytest
from click.testing import CliRunner
from test_fleet_index import TPB, _leader, _write, tokens_of

from s3kv.config import Settings
from s3kv.core.cost import EXPIRY_MARGIN_S, expiry_age_s
from s3kv.core.fleetindex import decode
from s3kv.core.retention import (
    BELIEF_FORGET_S,
    HALF_LIFE_S,
    LEGACY_BELIEF_S,
    MIN_DATED_READS,
    RETENTION_FLOOR_S,
    FleetReads,
    decode_report,
    encode_report,
    lag_bin_edge,
    learn_retention,
    paid_cutoff,
    parse_report_key,
    report_key,
    settled,
)
from s3kv.core.value import GC_WATCH_S, KEEP, LAG_BINS, lag_bin
from s3kv.engine.fleetindex import Publisher, index_key
from s3kv.store.factory import open_store
from s3kv.store.memory import MemoryStore
from s3kv.store.refresh import RefreshOnHit, set_refresh_interval
from s3kv.tools.ops import gc_command

CAP, MARGIN = 3600.0, 660.0


def _reads(*lags: tuple[float, int]) -> list[float]:
    out = [0.0] * LAG_BINS
    for lag, n in lags:
        out[lag_bin(lag)] += n
    return out


#: A gc that has learnt for less than the ceiling (a fleet just started).
NEW = 0.0
#: Reads to learn from, for a settled gc: all within a minute of their objects' writes (the floor);
#: all 20-34 minutes after; and those with 10 more an hour late.
SHORT_READS = _reads((30, 100))
EARLY_READS = _reads((1200, 100))
LATE_READS = _reads((1200, 100), (3000, 10))
EARLY = learn_retention(EARLY_READS, margin_s=MARGIN, cap_s=CAP)
LATE = learn_retention(LATE_READS, margin_s=MARGIN, cap_s=CAP)
#: Reads 10-17 minutes after their writes: what a new gc keeps for them is well above the floor.
MID_READS = _reads((600, 100))


def young(reads: list[float]) -> float | None:
    """What a gc that has learnt for less than the ceiling keeps for ``reads``."""
    return learn_retention(reads, margin_s=MARGIN, cap_s=CAP, watched_s=NEW)


# ------------------------------------------------------------------------------ the rule
def test_a_new_gc_leaves_an_octave_of_room_beyond_the_reads():
    """Learning for less than the ceiling (and gc's margin), gc cannot have seen reads later than it
    has watched, nor their ghosts: an octave of room beyond 99% of the reads stands in for them --
    not the whole lag bin above the one that holds that lag (one to two octaves)."""
    def new(reads: list[float]) -> float | None:
        return learn_retention(reads, margin_s=MARGIN, cap_s=CAP, watched_s=NEW)

    # Every read within 2 minutes, or all but one in a hundred: the floor.
    assert new(_reads((5, 60), (90, 40))) == RETENTION_FLOOR_S
    assert new(_reads((5, 99), (700, 1))) == RETENTION_FLOOR_S
    # 2% of the reads 700 s late: 99% come within ~723 s (inside the 511-1,023 s bin); room to
    # twice that, so the late reads are kept -- the old rule kept objects to 2,047 s.
    later = new(_reads((5, 60), (90, 38), (700, 2)))
    assert later is not None and 1400 < later + MARGIN < 1500
    # Reads 20-34 minutes late: the settled cut (inside their bin) and an octave beyond it.
    assert EARLY is not None and (early := new(EARLY_READS)) is not None
    assert early + MARGIN + 1 == pytest.approx(2 * (EARLY + MARGIN + 1)) and early < CAP
    assert lag_bin_edge(10) < early + MARGIN < lag_bin_edge(11)
    # More late reads never shorten it; past an octave of the ceiling it is the ceiling.
    got = [new(_reads((5, 60), (90, 38), (700, n))) for n in (2, 5, 20, 60)]
    assert got == sorted(got) and got[0] < got[-1]
    assert new(_reads((5, 60), (90, 30), (1500, 5), (3000, 5))) == CAP
    # Too few dated reads: the ceiling stands (None); never below the floor.
    assert new(_reads((5, MIN_DATED_READS - 1))) is None
    assert learn_retention(_reads((1, 100)), margin_s=100.0, cap_s=CAP, watched_s=NEW) >= RETENTION_FLOOR_S


def test_a_settled_gc_keeps_99_percent_of_the_reads_and_grows_with_the_late_ones():
    """Learning for longer than the ceiling, gc cuts at the lag 99% of the reads come within --
    ghost reads (below) telling it of the reads past its cutoff."""
    # Every read within 2 minutes: the floor (gc's margin alone outlives them).
    assert learn_retention(_reads((5, 60), (90, 40)), margin_s=MARGIN, cap_s=CAP) == RETENTION_FLOOR_S
    # Reads 1,023-2,047 s old: objects go inside that bin -- not a whole bin later (the rule this
    # replaced kept them to 4,095 s) -- and late enough for 99% of the reads.
    assert EARLY is not None and lag_bin_edge(9) < EARLY + MARGIN < lag_bin_edge(10)
    # Late reads past 1% of them (what ghost reads of deleted objects report): longer, up to the
    # ceiling; 1% is within the rule. Never shorter for more late reads.
    got = [learn_retention(_reads((1200, 100), (3000, n)), margin_s=MARGIN, cap_s=CAP) for n in (0, 1, 2, 5, 50)]
    assert got == sorted(got) and got[1] + MARGIN <= lag_bin_edge(10) < got[2] + MARGIN and got[-1] < CAP
    assert EARLY < LATE < CAP
    assert learn_retention(_reads((1200, 100), (5000, 5)), margin_s=MARGIN, cap_s=CAP) == CAP
    # Only once gc has watched the ceiling and its margin (before, the room above).
    assert not settled(CAP + MARGIN - 1, margin_s=MARGIN, cap_s=CAP) and settled(CAP + MARGIN, margin_s=MARGIN, cap_s=CAP)
    assert learn_retention(EARLY_READS, margin_s=MARGIN, cap_s=CAP, watched_s=CAP + MARGIN - 1) > EARLY
    # Too few dated reads: the ceiling stands (None); never below the floor.
    assert learn_retention(_reads((5, MIN_DATED_READS - 1)), margin_s=MARGIN, cap_s=CAP) is None
    assert learn_retention(_reads((1, 100)), margin_s=100.0, cap_s=CAP) == RETENTION_FLOOR_S


def test_the_fleet_reads_take_what_grew_forget_and_survive_a_restart():
    fr = FleetReads(LAG_BINS)
    fr.take("a", _reads((5, 10)), 0.0)
    fr.take("b", _reads((5, 4)), 0.0)
    fr.take("a", _reads((5, 16)), 0.0)  # six more since a's last report
    assert sum(fr.lag_reads) == 20
    fr.take("b", _reads((5, 1)), HALF_LIFE_S)  # counts went down: b restarted, all of them are new
    assert sum(fr.lag_reads) == 20 / 2 + 1


def test_report_keys_round_trip_and_foreign_names_are_not_reports():
    key = report_key("kv/" + "ab" * 16 + "/", "0123456789abcdef", 7)
    assert parse_report_key(key.split("/", 2)[2]) == ("0123456789abcdef", 7)
    assert parse_report_key("fleet-reads/xyz.1") is None and parse_report_key("fleet-index") is None


# ------------------------------------------------------------------------------ gc learns
def _publisher(store, clock, nsp):
    return Publisher(store, "pfx/", every_s=10.0, clock=lambda: clock[0], learn=(CAP, MARGIN), namespaces=[nsp])


#: How long after it keeps a shorter retention gc deletes by it, for ``_publisher``'s gc: engines'
#: lag (3 index periods and the clock margin) and what they promise on an answer (its margin).
_SHRINK_AFTER = 3 * 10 + EXPIRY_MARGIN_S + MARGIN


def _gc_that_shortened(store):
    """An engine's leader on ``store`` and a gc that learnt a retention at 1,000 s (reads up to 12
    minutes late) and a shorter one at 2,000 s (10,000 more, all early): (core, nsp, clock, gc,
    long, short)."""
    core = _leader(store, fleet_index_s=5)
    nsp = core.scheme.namespace_prefix
    clock = [1000.0]
    pub = _publisher(store, clock, nsp)
    k0 = report_key(nsp, "00000000000000aa", 0)
    store.put(k0, encode_report(_reads((30, 100), (700, 10)), clock[0], k0))
    pub.publish(clock[0])
    long = young(_reads((30, 100), (700, 10)))
    assert long is not None and pub.retention[nsp][0] == long
    k1 = report_key(nsp, "00000000000000aa", 1)  # 10,000 more reads, all early: the late ones are 0.1%
    store.put(k1, encode_report(_reads((30, 10_100), (700, 10)), clock[0], k1))
    clock[0] += 1000
    pub.publish(clock[0])
    short = young(_reads((30, 10_100), (700, 10)))
    assert short is not None and short < long
    assert pub.retention[nsp][0] == short  # published at once (engines believe and refresh by it)
    return core, nsp, clock, pub, long, short


def _fresh_gc(store):
    """An engine's leader on ``store`` and a gc that starts learning at 1,000 s, one pass done."""
    core = _leader(store, fleet_index_s=5)
    nsp = core.scheme.namespace_prefix
    clock = [1000.0]
    pub = _publisher(store, clock, nsp)
    pub.publish(clock[0])
    return core, nsp, clock, pub


def test_gc_keeps_objects_past_the_longest_belief_an_engine_reports():
    """gc's margin covers how long the reporting engines promise loads on an answer they got, not
    only its own settings: in a rolling upgrade from the 600 s default, a gc told 120 s (a 180 s
    margin) keeps objects 660 s past their retention while an engine that does not say reports;
    180 s once every engine says 120 s; an engine silent for BELIEF_FORGET_S counts no more."""
    store = MemoryStore()
    nsp = _leader(store, fleet_index_s=5).scheme.namespace_prefix
    t0 = time.time()
    clock = [t0]
    own_margin = 120.0 + EXPIRY_MARGIN_S
    pub = Publisher(store, "pfx/", every_s=10.0, clock=lambda: clock[0], learn=(CAP, own_margin),
                    namespaces=[nsp])
    seqs: dict[str, int] = {}

    def report(engine: str, belief: float | None) -> None:
        seq = seqs[engine] = seqs.get(engine, -1) + 1
        k = report_key(nsp, engine, seq)
        store.put(k, encode_report(MID_READS, clock[0], k, belief_s=belief))

    def margin_after_a_pass() -> float:
        clock[0] += 10
        pub.publish(clock[0])
        m = pub.margin_s(nsp)
        assert pub.cutoff_s(nsp, clock[0]) == pub.keep_s(nsp, clock[0]) + m
        return m

    report("00000000000000aa", None)  # an engine of the version before: its report names no belief
    report("00000000000000bb", 120.0)
    assert margin_after_a_pass() == LEGACY_BELIEF_S + EXPIRY_MARGIN_S == 660.0
    report("00000000000000aa", 120.0)  # upgraded: its newer report says 120 s
    assert margin_after_a_pass() == own_margin
    report("00000000000000cc", 900.0)  # one told to believe longer widens it...
    assert margin_after_a_pass() == 900.0 + EXPIRY_MARGIN_S
    clock[0] += BELIEF_FORGET_S  # ...until it has been silent for BELIEF_FORGET_S
    report("00000000000000aa", 120.0)
    assert margin_after_a_pass() == own_margin
    # A belief that is no number of seconds is no report.
    k = report_key(nsp, "00000000000000dd", 0)
    for bad in (-1.0, float("inf"), float("nan"), True, "600", None):
        body = json.loads(encode_report(MID_READS, clock[0], k))
        body["belief_s"] = bad
        with pytest.raises(ValueError, match="belief_s"):
            decode_report(json.dumps(body).encode(), LAG_BINS, k)


def test_gc_shortens_the_retention_when_reads_come_early_and_grows_it_back_when_they_come_late():
    store = MemoryStore()
    core, nsp, clock, pub = _fresh_gc(store)
    assert pub.retention[nsp] == (CAP, 1000.0)  # learning, nothing read yet: the ceiling...
    assert pub.history[nsp] == [(1000.0, RETENTION_FLOOR_S)]  # ...engines believing the floor
    k0 = report_key(nsp, "00000000000000aa", 0)
    store.put(k0, encode_report(_reads((30, 100)), clock[0], k0))
    clock[0] += 10
    pub.publish(clock[0])
    assert pub.retention[nsp][0] == RETENTION_FLOOR_S  # every read within 31 s: the floor
    key = index_key(nsp)
    idx = decode(store.get(key), object_key=key, namespace=core.namespace, keys=None, max_objects=100)
    assert (idx.retention_s, idx.auto_since, idx.believe_s) == (RETENTION_FLOOR_S, 1000.0, RETENTION_FLOOR_S)
    # What was written while gc had nothing to learn from was believed for the floor only -- but
    # gc kept it for the ceiling, and deletes by the floor only once no engine acts on an answer
    # given before (``test_gc_deletes_by_a_shorter_retention_only_once...``).
    assert pub.keep_s(nsp, 1000.0 + 3 * 10 + 60) == CAP
    # The same engine later: 10 more reads, all at 10-15 minutes -- beyond half the cutoff.
    k1 = report_key(nsp, "00000000000000aa", 1)
    store.put(k1, encode_report(_reads((30, 100), (700, 10)), clock[0], k1))
    clock[0] += 10
    pub.publish(clock[0])
    grown = pub.retention[nsp][0]
    assert grown > RETENTION_FLOOR_S and grown + MARGIN > 2 * 700  # the late reads and room beyond them
    # (the first report's reads forgot a little in the 10 s between)
    assert grown == pytest.approx(young(_reads((30, 100), (700, 10))), rel=1e-3)
    # The superseded report is gone; the newest stays (the next gc that starts reads it).
    names = [k for k in store.keys() if "fleet-reads/" in k]
    assert names == [report_key(nsp, "00000000000000aa", 1)]
    # A gc that restarts goes on learning since the same time (what it deletes early depends on it).
    again = _publisher(store, clock, nsp)
    again.publish(clock[0])
    assert again.retention[nsp][1] == 1000.0 and again.retention[nsp][0] == pytest.approx(grown, rel=1e-3)


def test_a_lookup_past_an_object_gc_deleted_reports_a_ghost_read():
    """The read a deleted object would have served reaches gc (core.retention, ghost reads): the
    engine remembers what successive fleet indexes stopped listing, old enough for gc to have
    deleted it by age, and a lookup that would have gone on past its hit to such an object counts
    a read at its age in what it reports -- whichever engine wrote it."""
    store = MemoryStore()
    writer, core = _leader(store, fleet_index_s=5), _leader(store, fleet_index_s=5)
    try:
        nsp = core.scheme.namespace_prefix
        young, old = tokens_of(40 * TPB + 9, seed=3), tokens_of(40 * TPB + 9, seed=5)
        keys = {"young": _write(writer, store, young, 20), "old": _write(writer, store, old, 20)}  # another engine's
        clock = [time.time()]
        pub = Publisher(store, "pfx/", every_s=10.0, clock=lambda: clock[0], namespaces=[nsp])
        pub.publish(clock[0])
        fi = core.fleet_index()
        assert fi is not None
        fi.clock = lambda: clock[0]
        assert fi.refresh()
        other = tokens_of(8 * TPB + 1, seed=4)
        assert core.get_num_new_matched_tokens(1, other, len(other), 0) == (0, False)  # (lookups track)
        store.delete_many(keys["young"])  # gone younger than gc deletes anything by age: another cause
        clock[0] += 100
        pub.publish(clock[0])
        assert fi.refresh()
        store.delete_many(keys["old"])  # gone at 1,000 s: what gc's retention cut off
        clock[0] += 900
        pub.publish(clock[0])
        assert fi.refresh()
        assert core.get_num_new_matched_tokens(2, young, len(young), 0) == (0, False)
        assert core.writes.model.ghosts == 0
        clock[0] += 500  # asked 1,500 s after the write
        assert core.get_num_new_matched_tokens(3, old, len(old), 0) == (0, False)
        assert core.writes.model.ghosts == 1
        assert core._lookups.listings.reads()[lag_bin(1500)] == 1  # in the next read report
        # A prompt that stops short of every object goes nowhere near them: no ghost.
        short = old[: 3 * TPB + 3]
        assert core.get_num_new_matched_tokens(4, short, len(short), 0) == (0, False)
        assert core.writes.model.ghosts == 1
    finally:
        writer.close_lookup()
        core.close_lookup()


def test_an_engine_judges_a_heads_answer_by_what_gc_keeps_that_object_for():
    """A lookup believes a HEAD's "present" while the object is younger than gc keeps it plus what
    it promises on an answer (``Listings.believable``). What gc keeps it for depends on when it
    was written (an object written under a longer belief keeps it), and the index carries what
    gc decides by: the engine's reckoning is gc's own, never longer -- judged by the retention
    alone, templates written under an hour's belief looked too old once gc learnt five minutes,
    and a replay of batch jobs (2,400 requests, 4 engines) lost 10% of its tokens."""
    from test_fleet_index import _Clock, _refreshed

    core, nsp, clock, pub, long, short = _gc_that_shortened(MemoryStore())
    try:
        _refreshed(core, _Clock(clock[0]))
        listings = core._lookups.listings
        for touched in (900.0, 1000.0 + 90, 1500.0, 2000.0 + long + 90 - 1, 2000.0 + long + 91, 5000.0):
            assert listings.kept_s(touched) == pub.keep_s(nsp, touched, settled=True), touched
        assert listings.kept_s(1500.0) == long and listings.kept_s(5000.0) == short
    finally:
        core.close_lookup()


def test_gc_deletes_by_a_shorter_retention_only_once_engines_stopped_acting_on_the_longer():
    """A HEAD or a listing tells an engine an object is there, and it promises loads on that answer
    for a while (``index_ttl_s``, a listing's trust), its index telling it the retention up to its
    lag late: an object gc kept under a longer retention must outlive those answers. (A replay of
    batch jobs over shared templates, one engine and S3 only: gc learnt 300 s after keeping the
    ceiling, deleted in its next pass chain objects 11 minutes old that a lookup had just found,
    and the load promised on them failed -- the request parked for good.) A gc that restarts
    keeps what the last index said for as long."""
    store = MemoryStore()
    core, nsp, clock, pub = _fresh_gc(store)
    touched = 1000.0 + 3 * 10 + 60  # after learning began (and its lag): no belief of the ceiling
    assert pub.retention[nsp][0] == CAP and pub.keep_s(nsp, touched) == CAP
    k0 = report_key(nsp, "00000000000000aa", 0)
    store.put(k0, encode_report(SHORT_READS, clock[0], k0))
    clock[0] += 10
    pub.publish(clock[0])
    shrunk_at = clock[0]
    assert pub.retention[nsp][0] == RETENTION_FLOOR_S  # told at once...
    while clock[0] < shrunk_at + _SHRINK_AFTER - 10:
        clock[0] += 10
        pub.publish(clock[0])
        assert pub.keep_s(nsp, touched) == CAP, clock[0] - shrunk_at  # ...applied only after
    clock[0] += 20
    pub.publish(clock[0])
    assert pub.keep_s(nsp, touched) == RETENTION_FLOOR_S
    assert pub.cutoff_s(nsp, touched) == RETENTION_FLOOR_S + pub.margin_s(nsp)
    # A gc restarted under an index that says the ceiling, learning the floor at its first pass.
    store2 = MemoryStore()
    _, nsp2, clock2, first = _fresh_gc(store2)
    assert first.retention[nsp2][0] == CAP
    k = report_key(nsp2, "00000000000000aa", 0)
    store2.put(k, encode_report(SHORT_READS, clock2[0], k))
    clock2[0] += 10
    again = _publisher(store2, clock2, nsp2)
    again.publish(clock2[0])
    assert again.retention[nsp2][0] == RETENTION_FLOOR_S and again.keep_s(nsp2, touched) == CAP
    clock2[0] += _SHRINK_AFTER
    again.publish(clock2[0])
    assert again.keep_s(nsp2, touched) == RETENTION_FLOOR_S


def test_gc_keeps_each_object_for_the_longest_retention_an_engine_may_have_believed_for_it():
    """An engine believes its upload for the retention of the index it holds, without asking
    again: after a shorter one is published, what was written under the longer one (or touched
    while a write under it is still believed) keeps the longer one; later writes the shorter."""
    core, nsp, clock, pub, long, short = _gc_that_shortened(MemoryStore())
    clock[0] += _SHRINK_AFTER  # (applied once engines act on no answer given under the longer one)
    pub.publish(clock[0])
    lag = 3 * 10 + 60
    assert pub.keep_s(nsp, 1000 - 1) == CAP  # written before learning began (and its lag)
    assert pub.keep_s(nsp, 1000 + lag) == long  # under the longer one
    assert pub.keep_s(nsp, 2000 + long + lag - 1) == long  # a write at 1999 may still be believed
    assert pub.keep_s(nsp, 2000 + long + lag + 1) == short


def test_with_an_integrity_key_gc_learns_only_from_reports_a_key_holder_signed():
    from test_fleet_index import KEYS, SECRET

    store = MemoryStore()
    core = _leader(store, fleet_index_s=5, integrity_key=SECRET)
    nsp = core.scheme.namespace_prefix
    clock = [1000.0]
    pub = Publisher(store, "pfx/", every_s=10.0, clock=lambda: clock[0], learn=(CAP, MARGIN), namespaces=[nsp],
                    integrity=KEYS)
    planted = report_key(nsp, "00000000000000bb", 0)
    store.put(planted, encode_report(_reads((30, 100)), clock[0], planted))  # unsigned
    pub.publish(clock[0])
    assert pub.retention[nsp][0] == CAP
    signed = report_key(nsp, "00000000000000aa", 0)
    store.put(signed, encode_report(_reads((30, 100)), clock[0], signed, KEYS.current))
    moved = report_key(nsp, "00000000000000cc", 0)  # a signed report copied to another key
    store.put(moved, store.get(signed))
    clock[0] += 10
    pub.publish(clock[0])
    assert pub.retention[nsp][0] == young(_reads((30, 100))) and sum(pub.reads[nsp].lag_reads) == 100


def test_without_learning_gc_publishes_no_retention_and_engines_report_nothing():
    store = MemoryStore()
    core = _leader(store, fleet_index_s=5)
    nsp = core.scheme.namespace_prefix
    Publisher(store, "pfx/", every_s=10.0, clock=lambda: time.time(), namespaces=[nsp]).publish()
    fi = core.fleet_index()
    assert fi is not None and fi.refresh()
    core._lookups.listings.current()
    assert core._lookups.index.written_ttl_s == core.settings.retention_h * 3600
    fi.report(force=True)
    assert not [k for k in store.keys() if "fleet-reads/" in k]


def test_an_engine_reports_while_gc_learns_and_believes_its_uploads_for_the_retention_gc_says():
    from s3kv.core.objects import ObjectSpan

    store = MemoryStore()
    core = _leader(store, fleet_index_s=5)
    idx, listings = core._lookups.index, core._lookups.listings
    idx.ttl_s = 100.0  # shorter than any belief below, so each shows
    core.writes.model.lag_reads[lag_bin(40)] += 3  # what its value model dated
    nsp = core.scheme.namespace_prefix
    Publisher(store, "pfx/", every_s=10.0, clock=lambda: time.time(), namespaces=[nsp]).publish()
    fi = core.fleet_index()
    assert fi is not None and fi.refresh()
    listings.current()
    assert idx.written_ttl_s == CAP  # gc keeps the setting: so does the engine
    idx.put_written("before", ObjectSpan(0, 4))
    clock = [time.time() + 1]
    pub = _publisher(store, clock, nsp)
    pub.publish(clock[0])
    assert fi.refresh()
    listings.current()
    assert idx.written_ttl_s == RETENTION_FLOOR_S  # learning, nothing dated yet: gc keeps the ceiling,
    # engines believe the floor (or every object written meanwhile would keep the ceiling)
    # What was believed for the setting is cut to the floor's life (gc keeps objects written
    # before for the setting, but not once refreshed).
    assert idx._written["before"][0] <= idx.now() + RETENTION_FLOOR_S + idx.ttl_s
    reports = [k for k in store.keys() if "fleet-reads/" in k]
    assert len(reports) == 1 and json.loads(store.get(reports[0]))["lag_reads"][lag_bin(40)] == 3
    # ...and how long it promises loads on a HEAD's answer or a listing, for gc's margin.
    st = core.settings
    assert json.loads(store.get(reports[0]))["belief_s"] == st.index_ttl_s + st.lookup_summary_trust_s
    fi.refresh()  # within REPORT_EVERY_S: no second report
    assert len([k for k in store.keys() if "fleet-reads/" in k]) == 1
    k = report_key(nsp, "00000000000000aa", 0)
    store.put(k, encode_report(MID_READS, clock[0], k))
    clock[0] += 10
    pub.publish(clock[0])
    assert fi.refresh()
    listings.current()
    learnt = young(MID_READS)
    assert learnt is not None and learnt > RETENTION_FLOOR_S
    # What the fresh index says (the reads forgot a little in the 10 s since the report).
    assert idx.written_ttl_s == pytest.approx(learnt, rel=1e-3)
    # The workers refresh what they load at half an object's life under it (the plan carries it).
    margin = expiry_age_s(core.settings) - core.settings.retention_h * 3600  # the engine's, from its settings
    assert core.build_connector_meta([], []).refresh_s == pytest.approx((idx.written_ttl_s + margin) / 2)
    fi.clock = lambda: time.time() + 3600  # the publisher stopped: the index goes stale
    listings.current()
    assert idx.written_ttl_s == RETENTION_FLOOR_S + idx.ttl_s


def test_the_write_policy_bills_storage_for_the_life_gc_gives_objects():
    """A policy billing the ceiling would refuse objects worth their real, shorter keep."""
    store = MemoryStore()
    core = _leader(store, fleet_index_s=5)
    nsp = core.scheme.namespace_prefix
    ceiling_life = core.writes.model.bill.lifetime_s
    clock = [time.time()]
    pub = _publisher(store, clock, nsp)
    k0 = report_key(nsp, "00000000000000aa", 0)
    store.put(k0, encode_report(MID_READS, clock[0], k0))
    pub.publish(clock[0])
    fi = core.fleet_index()
    assert fi is not None and fi.refresh()
    core.writes._follow_fleet()
    learnt = young(MID_READS)
    assert learnt is not None
    # Shorter by the learnt retention, and gone within half the index's period (10 s) rather than
    # half gc's --watch period: the publisher deletes in each pass.
    assert core.writes.model.bill.lifetime_s == ceiling_life - (CAP - learnt) - (GC_WATCH_S - 10.0) / 2


def test_a_worker_follows_the_refresh_period_the_plan_carries():
    inner = RefreshOnHit(MemoryStore(), 1800.0)
    wrapped = dataclasses.make_dataclass("W", [("inner", object)])(inner)
    set_refresh_interval(wrapped, 181.5)
    assert inner.interval_s == 181.5
    set_refresh_interval(MemoryStore(), 1.0)  # no refresher: nothing to follow, no error


def _gc(url: str, now: float, env: dict[str, str]) -> dict:
    r = CliRunner().invoke(gc_command, ["--url", url, "--expired", "--index", "10s", "--yes", "--json",
                                        "--now", str(now)], env=env)
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def _file_writer(tmp_path):
    """(url, store, a leader that writes there, its namespace prefix) on a file:// cache."""
    url = f"file://{tmp_path}/cache"
    store = open_store(url)
    writer = _leader(store, fleet_index_s=0)
    writer.scheme = dataclasses.replace(writer.scheme, prefix="")  # file:// URLs carry no key prefix
    return url, store, writer, writer.scheme.namespace_prefix


def _aged(tmp_path, writer, store, seed: int, age: float, now: float) -> list[str]:
    """An object chain written ``age`` seconds before ``now`` (its files' times set back)."""
    keys = _write(writer, store, tokens_of(8 * TPB + 9, seed=seed), 8)
    for k in keys:
        os.utime(tmp_path / "cache" / k, (now - age, now - age))
    return keys


def test_gc_deletes_by_the_learnt_retention_only_what_was_written_after_engines_knew(tmp_path):
    """Objects written after gc learnt a retention (plus the time every engine takes to see it) go
    at it plus gc's margin; older ones were believed for the ceiling and stay until it; with
    S3KV_RETENTION_AUTO=false gc keeps the ceiling for all."""
    url, store, writer, nsp = _file_writer(tmp_path)
    now = time.time()
    aged = {age: _aged(tmp_path, writer, store, seed, age, now) for seed, age in ((1, 1100.0), (2, 100.0), (3, 1990.0))}
    # Learnt for 5,000 s (past the ceiling and its margin): the reads alone decide -- all within a
    # minute, the floor -- and what was written since goes at 960 s (the 1,100 s ones went before).
    for env, learnt_ago, gone in (({"S3KV_RETENTION_AUTO": "false"}, 2000, []), ({}, 2000, aged[1100.0]),
                                  ({}, 5000, aged[1990.0])):
        idx = tmp_path / "cache" / index_key(nsp)
        if idx.exists():
            idx.unlink()
        # gc learnt ``learnt_ago`` s ago from an engine's reads (its index says since when and what).
        k = report_key(nsp, "00000000000000aa", 0)
        store.put(k, encode_report(SHORT_READS, now - learnt_ago, k))
        _gc(url, now - learnt_ago, env)
        doc = _gc(url, now, env)
        assert doc["deleted"]["objects"] == len(gone)
        left = {i.key for i in store.list("")}
        assert not left & set(gone)
        # 100 s old: within any retention; 1,990 s, with gc learning for 2,000 s: written before every
        # engine knew gc learns.
        assert set(aged[100.0]) <= left and (learnt_ago > 2000 or set(aged[1990.0]) <= left)


def test_gc_expired_keeps_what_an_engine_of_the_version_before_may_still_believe(tmp_path):
    """``gc --expired --index`` deletes by the margin the engines report, not only by its own
    settings': an object 3,900 s old (past the ceiling plus gc's own 180 s) stays while an engine
    whose report names no belief (one of the version before: 600 s) reports, and goes once that
    engine's newer report says 120 s."""
    url, store, writer, nsp = _file_writer(tmp_path)
    now = time.time()
    keys = _aged(tmp_path, writer, store, 5, 3900.0, now)
    assert CAP + Settings().index_ttl_s + EXPIRY_MARGIN_S < 3900.0 < CAP + LEGACY_BELIEF_S + EXPIRY_MARGIN_S
    for seq, belief, kept in ((0, None, True), (1, 120.0, False)):
        k = report_key(nsp, "00000000000000aa", seq)
        store.put(k, encode_report(SHORT_READS, now - 5, k, belief_s=belief))
        doc = _gc(url, now, {})
        left = {i.key for i in store.list("")}
        assert (set(keys) <= left) is kept and (not set(keys) & left) is (not kept), (seq, doc["deleted"])


def test_a_replay_that_learns_the_retention_bills_less_storage_for_the_same_tokens(tmp_path):
    """The whole loop on a trace's clock (tools/bench/indexhook.py): engines report, the publisher
    learns, the billed store deletes by it -- storage falls, every token is still served, no promised
    load fails (engines never believed their uploads past the floor)."""
    from s3kv.tools.bench.common import bench_store
    from s3kv.tools.bench.fleet import FleetConfig
    from s3kv.tools.bench.gentrace import PRESETS, generate, write_trace
    from s3kv.tools.bench.trace import TraceConfig, run_trace

    p = tmp_path / "chat.jsonl"
    write_trace(generate(PRESETS["chat"], 80, 3), p)
    out = {}
    for auto, before in ((False, 0.0), (True, 0.0), ("settled", CAP + MARGIN)):
        cfg = TraceConfig(path=str(p), tokens_per_block=TPB, jobs=1, runs=("window",),
                          fleet=FleetConfig(device_cache_tokens=0),  # S3 serves every repeat: reads to date
                          # gc's margin of 120 s, not 660: a short trace's few-minute reads are kept
                          # above the floor by a new gc, so the settled one's cut shows
                          settings={"write_policy": "through", "retention_auto": bool(auto), "index_ttl_s": 60},
                          gc_learnt_s=before)
        with bench_store(f"memory://test-learn-{auto}", name="trace") as bs:
            out[auto] = run_trace(bs, cfg)
    fixed, learnt, settled_ = (out[a]["policies"]["window"] for a in (False, True, "settled"))
    assert out[True]["value"]["retention_learnt"]["retention_s"] < CAP
    assert out[False]["value"]["retention_learnt"] is None
    assert learnt["storage_usd"] < fixed["storage_usd"]
    assert learnt["served_tokens"] == fixed["served_tokens"]
    assert out[True]["load_failures"] == 0 and out[True]["kv_mismatches"] == 0
    # A gc long running (``--gc-learnt``) cuts without the octave of room: shorter, no more storage
    # (on a trace of minutes, no less either: each gc deletes by the ceiling it kept until the
    # trace's reads came for as long as engines may act on answers given under it).
    assert out["settled"]["value"]["retention_learnt"]["retention_s"] < out[True]["value"]["retention_learnt"]["retention_s"]
    assert settled_["storage_usd"] <= learnt["storage_usd"]
    assert out["settled"]["load_failures"] == 0 and out["settled"]["kv_mismatches"] == 0


def test_a_replay_keeps_every_load_it_promised_while_gc_learns_a_shorter_retention(tmp_path):
    """Batch jobs over shared templates, one engine, S3 only: gc keeps the ceiling until reads come,
    then learns a few minutes, while lookups keep finding the templates' chain objects (HEADs, the
    key index's memory) past where their hits end, so nothing loads -- nor refreshes -- them.
    Every load promised on those answers must find its objects: before, gc deleted them in the
    pass after it learnt, the load failed and the request stayed parked for good (the replay never
    finished)."""
    from s3kv.tools.bench.common import bench_store
    from s3kv.tools.bench.fleet import FleetConfig
    from s3kv.tools.bench.gentrace import PRESETS, generate, write_trace
    from s3kv.tools.bench.trace import TraceConfig, run_trace

    p = tmp_path / "fewshot.jsonl"
    write_trace(generate(PRESETS["fewshot-batch"], 600, 7), p)
    cfg = TraceConfig(path=str(p), jobs=1, runs=("window",), limit=130, fleet=FleetConfig(device_cache_tokens=0))
    with bench_store("memory://test-promises", name="trace") as bs:
        out = run_trace(bs, cfg)
    w = out["policies"]["window"]
    assert out["load_failures"] == 0 and out["kv_mismatches"] == 0
    assert w["retention_learnt"]["changes"] > 0 and w["retention_learnt"]["min_s"] < CAP  # gc did learn shorter
    assert w["served_tokens"] > 0


# ------------------------------------------------------------------------------ expiring in each index pass
def test_the_index_pass_deletes_what_expired_by_the_store_clock_once_gc_vouched_for_it(tmp_path):
    """The publisher deletes from its own listing what gc's rule says expired, and leaves it out of
    the index -- only once gc checked this host's clock against the store's, and by the store's."""
    url = f"file://{tmp_path}/cache"
    store = open_store(url)
    writer = _leader(store, fleet_index_s=0)
    writer.scheme = dataclasses.replace(writer.scheme, prefix="")
    nsp = writer.scheme.namespace_prefix
    now = time.time()
    clock = [now - 2000]
    pub = Publisher(store, "", every_s=10.0, clock=lambda: clock[0], learn=(CAP, MARGIN), namespaces=[nsp])
    k = report_key(nsp, "00000000000000aa", 0)
    store.put(k, encode_report(_reads((30, 100)), clock[0], k))
    pub.publish(clock[0])
    cutoff = pub.retention[nsp][0] + MARGIN
    assert cutoff == RETENTION_FLOOR_S + MARGIN  # learnt (every read within 31 s: the floor): what was
    # written since (and its lag) goes at 960 s
    aged = {}
    for seed, age in ((1, cutoff + 80.0), (2, 100.0)):
        keys = _write(writer, store, tokens_of(8 * TPB + 9, seed=seed), 8)
        for key in keys:
            os.utime(tmp_path / "cache" / key, (now - age, now - age))
        aged[age] = set(keys)
    old, young = aged[cutoff + 80.0], aged[100.0]

    def indexed() -> int:
        key = index_key(nsp)
        return decode(store.get(key), object_key=key, namespace=writer.namespace, keys=None, max_objects=100).objects

    clock[0] = now
    rep = pub.publish(now)  # gc has not checked the clock: nothing deleted
    assert rep.expired == 0 and indexed() == len(old) + len(young)
    pub.vouch(-200.0)  # the store's clock 200 s behind this host's: the old ones are 903 s old there
    assert pub.publish(now).expired == 0
    pub.vouch(0.0)
    wall = pub.wall
    pub.wall = lambda: wall() + 120  # this host's clock steps 2 minutes: delete nothing until checked
    assert pub.publish(now).expired == 0 and pub.expire_skew_s is None
    pub.wall = wall
    pub.vouch(0.0)
    rep = pub.publish(now)
    left = {i.key for i in store.list("")}
    assert rep.expired == len(old) and not left & old and young <= left
    assert rep.expired_bytes > 0 and pub.expired_total == [rep.expired, rep.expired_bytes]
    assert indexed() == len(young)  # what it deleted is not in the index it wrote


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_watch_with_the_index_deletes_what_expires_between_its_passes(tmp_path, monkeypatch, dry_run):
    """Between two ``--watch`` passes the fleet index's passes delete what expired and the next
    pass says how much; a dry run deletes nothing there either."""
    import types

    from test_ops_cli import NS_A, _put, cli

    import s3kv.tools.ops as ops
    from s3kv.core.keys import KeyScheme
    from s3kv.store.fsspec_store import FsspecStore

    url = f"file://{tmp_path}/cache"
    store = FsspecStore(url)
    now = time.time()
    _put(store, KeyScheme("", NS_A, tp_size=1), "e0e0e0e0e0e0e0e0", 0, 64, 0, 2)  # young: stays
    planted: list[str] = []
    mono = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        mono[0] += s
        if len(slept) == 1:  # after the first pass: an object that expired long ago appears
            before = {i.key for i in store.list("")}
            _put(store, KeyScheme("", NS_A, tp_size=1), "d0d0d0d0d0d0d0d0", 0, 64, 0, 2)
            planted.extend({i.key for i in store.list("")} - before)
            for key in planted:
                os.utime(tmp_path / "cache" / key, (now - 3 * 86400, now - 3 * 86400))
        if len(slept) == 61:  # the second pass printed, its publishing under way
            raise KeyboardInterrupt

    monkeypatch.setattr(ops, "time", types.SimpleNamespace(time=time.time, monotonic=lambda: mono[0], sleep=sleep))
    args = ["gc", "--url", url, "--expired", "--watch", "10m", "--index", "10s", "--json", "--now", str(now)]
    r = CliRunner().invoke(cli(), args + (["--dry-run"] if dry_run else []))
    passes = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(passes) == 2 and planted, r.output
    left = {i.key for i in store.list("")}
    assert passes[1]["deleted"]["objects"] == 0
    if dry_run:
        assert set(planted) <= left and "deleted_in_index_passes" not in passes[1]
        assert passes[1]["matched"]["objects"] == len(planted)  # what gc would delete
    else:
        assert not left & set(planted)
        assert passes[0]["deleted_in_index_passes"]["objects"] == 0
        assert passes[1]["deleted_in_index_passes"]["objects"] == len(planted)


def test_a_replay_takes_gc_to_have_learnt_since_before_its_first_request():
    """A trace is a window of a fleet's traffic: its gc publisher ran before the first request
    (tools/bench/indexhook.py), so an object written then is kept by the learnt retention, not
    for the ceiling an engine that had not yet seen gc learn might have believed."""
    from types import SimpleNamespace

    from s3kv.core.retention import engine_lag_s
    from s3kv.tools.bench.billing import BilledStore
    from s3kv.tools.bench.indexhook import ReplayIndex

    mem = MemoryStore()
    billed = BilledStore(mem, 1 << 30, 128 << 20, retention_s=CAP, expire_after_s=CAP + MARGIN)
    engine = _leader(billed, fleet_index_s=5)
    nsp = engine.scheme.namespace_prefix
    fleet = SimpleNamespace(store=billed, engines=[SimpleNamespace(leader=SimpleNamespace(core=engine))])
    k = report_key(nsp, "00000000000000aa", 0)
    mem.put(k, encode_report(MID_READS, 0.0, k))  # reads to learn from at its first pass
    hook = ReplayIndex(every_s=10, learn=(CAP, MARGIN))
    try:
        hook(1000.0, fleet)
        pub = hook._publisher
        since = pub.retention[nsp][1]
        assert since <= 1000.0 - engine_lag_s(10, 5, EXPIRY_MARGIN_S)
        learnt = young(MID_READS)
        assert learnt is not None and learnt < CAP
        assert pub.retention[nsp][0] == learnt
        assert pub.keep_s(nsp, 1000.0) == learnt  # (started with the trace: the ceiling)
        assert engine.fleet_index().current().retention_s == learnt  # engines knew from the start
    finally:
        engine.close_lookup()


def test_gc_pools_the_engines_evidence_and_each_engine_adds_the_others():
    """The write policy's reads per write are a fleet-wide rate (``s3kv.core.value``, pooled over
    the fleet): engines report their evidence beside their reads, gc sums each engine's newest
    report into the index, and an engine adds that sum less its own report."""
    from s3kv.core.retention import decode_report
    from s3kv.core.value import CHECKPOINT
    from s3kv.core.value import HALF_LIFE_S as VALUE_HL

    store = MemoryStore()
    core = _leader(store, fleet_index_s=5)
    nsp = core.scheme.namespace_prefix
    clock = [time.time()]
    pub = _publisher(store, clock, nsp)
    pub.publish(clock[0])
    fi = core.fleet_index()
    assert fi is not None
    fi.clock = lambda: clock[0]
    mine = {CHECKPOINT: [1.0, 40.0], f"{CHECKPOINT}@3": [1.0, 30.0]}
    fi.evidence = lambda: {k: list(v) for k, v in mine.items()}
    assert fi.refresh()  # takes the index, writes report 0 with its evidence
    assert fi.others() is None  # no engine's evidence in the index yet: nothing to add
    other_at = clock[0] - 30
    k = report_key(nsp, "00000000000000bb", 4)
    store.put(k, encode_report(_reads((30, 5)), other_at, k, evidence={CHECKPOINT: [0.0, 120.0]}))
    clock[0] += 10
    pub.publish(clock[0])
    assert fi.refresh()
    key = index_key(nsp)
    idx = decode(store.get(key), object_key=key, namespace=core.namespace, keys=None, max_objects=100)
    assert idx.evidence_of == {fi.engine: 0, "00000000000000bb": 4}
    # The sum, as of the listing: this engine's 40 ten seconds old, the other's 120 forty.
    want = 40 * 0.5 ** (10 / VALUE_HL) + 120 * 0.5 ** (40 / VALUE_HL)
    assert idx.evidence[CHECKPOINT][1] == pytest.approx(want)
    clock[0] += 5
    others = fi.others()
    assert others is not None
    assert others[CHECKPOINT] == pytest.approx((0.0, 120 * 0.5 ** (45 / VALUE_HL)))  # its own taken back out
    assert others[f"{CHECKPOINT}@3"] == pytest.approx((0.0, 0.0), abs=1e-9)
    # The leader pools them before it plans: the others' unread checkpoints lower its estimate.
    m = core.writes.model
    alone = m.reads_per_write(CHECKPOINT)
    core.writes._follow_fleet()
    assert m.reads_per_write(CHECKPOINT) < alone / 10
    assert m.snapshot()[CHECKPOINT]["fleet_writes"] == pytest.approx(others[CHECKPOINT][1])  # what the metrics show
    # What its reports carry is the leader's own snapshot, taken under its lock as it plans: the
    # report thread never computes on the model itself.
    assert m.shared is not None and core._lookups.listings.evidence() is m.shared
    assert m.shared[CHECKPOINT] == list(m._own(CHECKPOINT))
    # A report whose evidence is not two non-negative counts is no report: gc skips it.
    bad = report_key(nsp, "00000000000000cc", 0)
    with pytest.raises(ValueError):
        decode_report(encode_report(_reads(), 0.0, bad, evidence={CHECKPOINT: [-1.0, 2.0]}), LAG_BINS, bad)
    # One engine alone adds nothing: the sum holds only its own report.
    store2 = MemoryStore()
    solo = _leader(store2, fleet_index_s=5)
    pub2 = _publisher(store2, clock, solo.scheme.namespace_prefix)
    pub2.publish(clock[0])
    fi2 = solo.fleet_index()
    assert fi2 is not None
    fi2.clock, fi2.evidence = (lambda: clock[0]), (lambda: {k: list(v) for k, v in mine.items()})
    fi2.refresh()
    clock[0] += 10
    pub2.publish(clock[0])
    assert fi2.refresh()
    got = fi2.others()
    assert got is not None and all(r == pytest.approx(0, abs=1e-9) and w == pytest.approx(0, abs=1e-9)
                                   for r, w in got.values())


def test_the_fleets_evidence_sums_each_engines_newest_report_and_forgets_silent_engines():
    hl = 1800.0
    fr = FleetReads(LAG_BINS)
    fr.take_evidence("a", 3, 0.0, {"checkpoint": (1.0, 10.0)})
    fr.take_evidence("a", 2, 0.0, {"checkpoint": (9.0, 90.0)})  # an older report, taken late: not newer
    fr.take_evidence("b", 0, hl, {"checkpoint": (0.0, 4.0), "prompt-end": (1.0, 2.0)})
    total, held = fr.pooled(hl, hl)
    assert held == {"a": 3, "b": 0}
    assert total["checkpoint"] == pytest.approx((0.5, 5.0 + 4.0)) and total["prompt-end"] == (1.0, 2.0)
    # Eight half-lives after a's last report it is dropped; b, still reporting, stays.
    fr.take_evidence("b", 1, 9 * hl, {"checkpoint": (0.0, 6.0)})
    total, held = fr.pooled(9 * hl, hl)
    assert held == {"b": 1} and total == {"checkpoint": (0.0, 6.0)}


# ------------------------------------------------------------------------------ what the reads pay for
def _gain_on_a_grid(reads: list[float], paid_s: float, t: float) -> float:
    """``paid_s x F(t) - t``, F read from the bins independently of the module: each bin's reads
    spread evenly over log(1 + lag) between its edges."""
    n, got = sum(reads), 0.0
    for b, x in enumerate(reads):
        lo, hi = (2.0**b - 1), (2.0 ** (b + 1) - 1)
        if t >= hi:
            got += x
        elif t > lo:
            got += x * math.log((t + 1) / (lo + 1)) / math.log(2)
    return paid_s * got / n - t


@pytest.mark.parametrize("paid_s", [30.0, 600.0, 5_000.0, 40_000.0, 1e6])
@pytest.mark.parametrize("reads", [_reads((30, 90), (1500, 10)), _reads((5, 40), (200, 40), (3000, 20)), EARLY_READS])
def test_the_cut_the_reads_pay_for_is_the_best_on_a_fine_grid(reads, paid_s):
    """Keeping everything written to age t costs t seconds of it; the reads within t save ``paid_s``
    x their share: the cut is where that gain is largest (checked against a grid of ages)."""
    t = paid_cutoff(reads, paid_s)
    grid = max(_gain_on_a_grid(reads, paid_s, x) for x in [i * 0.5 for i in range(0, 2 * 8192)])
    assert _gain_on_a_grid(reads, paid_s, t) >= grid - 1e-6 * max(1.0, paid_s)
    assert _gain_on_a_grid(reads, paid_s, t) >= 0  # never worse than keeping nothing


def test_gc_keeps_objects_no_longer_than_the_reads_pay_for():
    """99% of the reads is a share, not a price: where the reads pay for little storage, a tail of
    late ones no longer keeps everything written for them; where they pay for much, the 99% rule
    stands. More paid never shortens it; unknown (None) is the 99% rule alone."""
    reads = _reads((30, 90), (1500, 10))  # a tenth of the reads 25 minutes late
    rule = learn_retention(reads, margin_s=MARGIN, cap_s=CAP)
    assert rule is not None and rule > 1000
    got = [learn_retention(reads, margin_s=MARGIN, cap_s=CAP, paid_s=p) for p in (100.0, 15_000.0, 40_000.0, 1e7)]
    assert got == sorted(got)
    # The late tenth pays for a tenth of 100 s (or of 15,000 s): not the 25-34 minutes of keeping
    # everything it needs -- the floor.
    assert got[0] == got[1] == RETENTION_FLOOR_S
    # Paid for 40,000 s, it brings 4,000 s of them for at most 2,047 s kept: kept, as the rule says.
    assert got[2] == pytest.approx(rule) and got[3] == pytest.approx(rule)
    assert learn_retention(reads, margin_s=MARGIN, cap_s=CAP, paid_s=None) == rule
    # Nothing read yet that pays: the cut is at once (the floor stands under it).
    assert paid_cutoff(reads, 0.0) == 0.0 and paid_cutoff(_reads(), 1e6) == 0.0


def test_gc_cuts_where_the_fleets_reads_stop_paying_for_what_it_stores():
    """Engines report what their S3 reads saved and the bytes they wrote (``core.value.KEEP``, with
    the write-policy evidence); gc sums them and keeps objects no longer than that pays for."""
    reads = _reads((30, 90), (1500, 10))

    def learnt(keep: list[float] | None) -> float:
        store = MemoryStore()
        _, nsp, clock, pub = _fresh_gc(store)
        k = report_key(nsp, "00000000000000aa", 0)
        store.put(k, encode_report(reads, clock[0], k, evidence=None if keep is None else {KEEP: keep}))
        clock[0] += 10
        pub.publish(clock[0])
        return pub.retention[nsp][0]

    alone = learnt(None)
    assert alone == pytest.approx(young(reads), rel=1e-3) and alone > 1000
    # Reads that pay for 100 s of all it stores: the early reads' cut (31 s), with a new gc's octave
    # of room -- both cuts are blind past what gc watched -- under the floor.
    assert learnt([100.0 * 1e12, 1e12]) == RETENTION_FLOOR_S
    assert learnt([1e7 * 1e12, 1e12]) == pytest.approx(alone, rel=1e-3)  # for months: the rule stands
    assert learnt([5.0, 0.0]) == pytest.approx(alone, rel=1e-3)  # nothing stored said: unknown


def test_an_engine_reports_what_its_reads_saved_against_the_bytes_it_wrote():
    """``KEEP``: the prefill $ its S3 reads saved, in byte-seconds at the bucket's price, and the bytes
    it wrote -- chain objects too (a hit reads them) -- both decayed as the rest of its evidence."""
    from s3kv.core.cost import Prefill, Prices
    from s3kv.core.value import HALF_LIFE_S as VALUE_HL
    from s3kv.core.value import HISTORY_END, Bill, ValueModel

    m = ValueModel(Prefill.from_settings(Settings()), Bill(Prices(), lifetime_s=3600.0))
    m.advance_to(0.0)
    m.bill = dataclasses.replace(m.bill, lifetime_s=600.0)  # gc learnt a shorter life: still the ceiling's
    m.wrote("chain", [1000, 3000])
    m.wrote(HISTORY_END, [500], b"d" * 16, 4096)
    m.read(None, None, 2000, 1000, 10, 10)
    saved = m.prefill.usd(1000, 2000)
    assert saved > 0
    # Not before it watched the longest life an object may have: its reads so far cannot say what
    # later ones pay (gc's shorter life cuts those off, so it cannot say that either).
    m.advance_to(3599.0)
    assert KEEP not in m.evidence()
    # Then: what its reads saved, and the bytes, decayed alike (every read had time to come: past
    # the lag prior's 34 minutes).
    m.advance_to(2 * VALUE_HL)
    assert m.evidence()[KEEP] == pytest.approx([saved / m.bill.prices.usd_per_byte_s / 4, 4500.0 / 4])
    # Bytes just written count nothing yet: none of their reads had time to come.
    m.wrote("chain", [8000])
    assert m.evidence()[KEEP][1] == pytest.approx(4500.0 / 4)
    m.advance_to(2 * VALUE_HL + 60)
    assert 4500.0 / 4 < m.evidence()[KEEP][1] < 4500.0 / 4 + 8000.0 * 0.9  # a share of them
    # Free storage: nothing to weigh the retention against, so nothing is said.
    assert KEEP not in ValueModel(m.prefill, Bill(Prices(gb_month=0.0))).evidence()
