"""The fleet index (issue 41): one publisher lists the namespace, every engine answers lookups from
its copy -- a miss for no request, a hit for one HEAD wave, or none where it is signed and young.

What must hold whatever the index says: an object written after it is a miss (or found by a probe),
never a wrong promise; an object deleted behind it is never promised unverified except where a
signed, young index vouched for it, and then its failed load costs that one request and the
index's trust; a planted or unsigned index never makes a hit free; a publisher that stops is
noticed by its index's age. Plus the trust-mode row of issue 37 (a planted LIST).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any

import pytest
from test_connector_sim import make_engine
from test_lookup import TPB, geo, tokens_of

from s3kv.config import Settings
from s3kv.core.fleetindex import (
    ENTRY_BYTES,
    INDEX_NAME,
    IndexEntry,
    IndexFormatError,
    decode,
    encode,
)
from s3kv.core.integrity import IntegrityKeys
from s3kv.core.keys import chain_digests, chain_root, parse_key
from s3kv.core.objects import ObjectIdentity, encode_object, object_metadata
from s3kv.engine.fleetindex import IndexRefresher, Publisher, index_key
from s3kv.engine.index import MISSING, KeyIndex
from s3kv.engine.leader import LeaderCore
from s3kv.engine.leader.pace import Pace
from s3kv.sim import gemma3_like
from s3kv.sim.request import SimRequestSpec
from s3kv.store.base import NotFound
from s3kv.store.instrument import InstrumentedStore
from s3kv.store.memory import MemoryStore

SECRET = "0123456789abcdef" * 4
OTHER = "fedcba9876543210" * 4
KEYS = IntegrityKeys.from_secrets(SECRET)


# ------------------------------------------------------------------------------ helpers
def _leader(store, **kw) -> LeaderCore:
    s = Settings(url="memory://t", **{"blocks_per_object": 4, "checkpoint_tokens": 16 * TPB,
                                      "lookup_timeout_s": 5.0, **kw})
    g = geo()
    core = LeaderCore(s, store, "pfx", tp_size=g.tp_size, model_id=g.model_id, kv_dtype=g.kv_dtype,
                      index=KeyIndex(10_000, 600.0, 2.0), geometry=g)
    assert core.geometry is not None
    return core


def _write(core: LeaderCore, store, tokens, n_blocks: int, *, sign: bool = True, bpo: int = 4) -> list[str]:
    """The objects a saved prefix of ``n_blocks`` has under ``core``'s namespace (every group)."""
    g = core.geometry
    integrity = core.settings.integrity if sign else None
    digests = chain_digests(chain_root(core.namespace), tokens, TPB)
    keys = []
    for grp in g.groups:
        ident = ObjectIdentity(core.namespace, grp.fingerprint, 0, 1, TPB, grp.page_bytes, integrity=integrity)
        for end in range(bpo, n_blocks + 1, bpo):
            first = end - bpo
            key = core.scheme.object_key(grp.fingerprint, 0, digests[end - 1])
            store.put(key, encode_object(ident, first, digests[end - 1], [bytes(grp.page_bytes)] * bpo, key),
                      object_metadata(ident, first, bpo, key))
            keys.append(key)
    return keys


def _publish(store, now: float, integrity=None, every_s: float = 10.0, root: str = "pfx/"):
    return Publisher(store, root, integrity=integrity, every_s=every_s, clock=lambda: now).publish(now)


class _Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _refreshed(core: LeaderCore, clock: _Clock | None = None) -> IndexRefresher:
    fleet = core.fleet_index()
    assert fleet is not None
    if clock is not None:
        fleet.clock = clock
    assert fleet.refresh()
    return fleet


# ------------------------------------------------------------------------------ the format
def _entries(rng: random.Random, n: int, listed_at: float) -> list[IndexEntry]:
    return [IndexEntry(rng.randbytes(16), rng.randrange(1, 4096), rng.randrange(1, 64), listed_at - rng.randrange(3600))
            for _ in range(n)]


def test_format_round_trip_is_compact_and_bounded():
    rng = random.Random(1)
    listed = 1_700_000_000.0
    secs = {("0123456789abcdef", 0, 2): _entries(rng, 5000, listed), ("fedcba9876543210", 1, 2): _entries(rng, 300, listed)}
    ns = bytes(range(16))
    key = "kv/" + ns.hex() + "/" + INDEX_NAME
    data = encode(ns, secs, object_key=key, listed_at=listed, published_at=listed + 2, every_s=10, tag_key=None)
    assert len(data) < 5300 * ENTRY_BYTES  # the age and end columns compress; digests do not
    idx = decode(data, object_key=key, namespace=ns, keys=None, max_objects=10_000)
    assert idx.objects == 5300 and not idx.verified and idx.key_id is None
    for (sid, entries) in secs.items():
        sec = idx.sections[sid]
        for e in entries[:200]:
            count, age = sec.find(e.digest, e.end)
            assert count == e.count and idx.written_at(age) == e.written_at
            assert sec.find(e.digest, e.end + 1) is None  # the key names an object ending elsewhere
        assert sec.find(rng.randbytes(16), 5) is None
    with pytest.raises(IndexFormatError) as e:
        decode(data, object_key=key, namespace=ns, keys=None, max_objects=5299)
    assert e.value.reason == "too_large"
    with pytest.raises(IndexFormatError) as e:
        decode(data, object_key=key, namespace=bytes(16), keys=None, max_objects=10_000)
    assert e.value.reason == "namespace"
    with pytest.raises(IndexFormatError) as e:
        decode(data[:-10], object_key=key, namespace=ns, keys=None, max_objects=10_000)
    assert e.value.reason in ("truncated", "foreign")


def test_a_signed_index_verifies_only_as_written_by_a_key_holder_at_its_own_key():
    rng = random.Random(2)
    ns = bytes(range(16))
    key = "kv/" + ns.hex() + "/" + INDEX_NAME
    secs = {("0123456789abcdef", 0, 1): _entries(rng, 50, 100.0)}
    data = encode(ns, secs, object_key=key, listed_at=100, published_at=100, every_s=10, tag_key=KEYS.current)
    assert decode(data, object_key=key, namespace=ns, keys=KEYS, max_objects=100).verified
    # A reader without the key takes it as unsigned (it cannot check the tag).
    assert not decode(data, object_key=key, namespace=ns, keys=None, max_objects=100).verified
    cases = {
        "bad_signature": dict(data=data[:-40] + bytes([data[-40] ^ 1]) + data[-39:]),  # a flipped bit of the body
        "unknown_key": dict(keys=IntegrityKeys.from_secrets(OTHER)),
    }
    for reason, kw in cases.items():
        args = {"data": data, "object_key": key, "namespace": ns, "keys": KEYS, "max_objects": 100, **kw}
        with pytest.raises(IndexFormatError) as e:
            decode(**args)
        assert e.value.reason == reason
    # Copied to another key (the tag binds its key): refused.
    with pytest.raises(IndexFormatError) as e:
        decode(data, object_key="other/" + ns.hex() + "/" + INDEX_NAME, namespace=ns, keys=KEYS, max_objects=100)
    assert e.value.reason == "bad_signature"


# ------------------------------------------------------------------------------ lookups from it
def test_a_cold_miss_costs_no_request_and_an_unsigned_index_hit_one_verify_wave():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0)
    stored = tokens_of(40 * TPB + 9, seed=3)
    _write(writer, mem, stored, 40, sign=False)
    rep = _publish(mem, time.time())
    assert sum(rep.indexed.values()) == 10 * 2 and rep.heads == 20 and not rep.errors
    counted = InstrumentedStore(mem)
    core = _leader(counted, fleet_index_s=3600)
    try:
        _refreshed(core)
        before = counted.snapshot()
        other = tokens_of(40 * TPB + 9, seed=4)
        assert core.get_num_new_matched_tokens(1, other, len(other), 0) == (0, False)
        io = counted.snapshot() - before
        assert io.head == io.list == io.get == 0  # no request on the lookup's path
        before = counted.snapshot()
        n, _ = core.get_num_new_matched_tokens(2, stored, len(stored), 0)
        assert n == 40 * TPB
        io = counted.snapshot() - before
        assert core.stats.lookup_waves == 1 and 0 < io.head <= 20 and io.list == 0
        assert core.stats.lookup_index_lookups == 2 and core.stats.lookup_trusted_hits == 0
        # Unchanged since: the next poll is a 304.
        unchanged = counted.snapshot().fetch_unchanged
        assert not core.fleet_index().refresh() and counted.snapshot().fetch_unchanged == unchanged + 1
    finally:
        core.close_lookup()


def test_a_signed_young_index_makes_a_hit_free_and_only_then():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0, integrity_key=SECRET)
    stored = tokens_of(40 * TPB + 9, seed=5)
    _write(writer, mem, stored, 40)
    t0 = time.time()
    assert sum(_publish(mem, t0, integrity=KEYS).indexed.values()) == 20
    counted = InstrumentedStore(mem)
    core = _leader(counted, fleet_index_s=3600, fleet_index_trust_s=20, integrity_key=SECRET)
    clock = _Clock(t0 + 1)
    try:
        _refreshed(core, clock)
        before = counted.snapshot()
        assert core.get_num_new_matched_tokens(1, stored, len(stored), 0)[0] == 40 * TPB
        assert (counted.snapshot() - before).requests == 0 and core.stats.lookup_trusted_hits == 1
        # Older than fleet_index_trust_s (still fresh: three publish periods): one verify wave.
        clock.t = t0 + 25
        before = counted.snapshot()
        assert core.get_num_new_matched_tokens(2, stored, len(stored), 0)[0] == 40 * TPB
        assert (counted.snapshot() - before).head > 0 and core.stats.lookup_trusted_hits == 1
    finally:
        core.close_lookup()
    # Objects older than the retention when listed: gc may delete them any moment -- verified.
    core = _leader(counted, fleet_index_s=3600, integrity_key=SECRET, retention_h=0.5)
    late = t0 + 1800
    _publish(mem, late, integrity=KEYS)
    try:
        _refreshed(core, _Clock(late + 1))
        before = counted.snapshot()
        assert core.get_num_new_matched_tokens(3, stored, len(stored), 0)[0] == 40 * TPB
        assert (counted.snapshot() - before).head > 0 and core.stats.lookup_trusted_hits == 0
    finally:
        core.close_lookup()


def test_an_object_written_after_the_index_is_a_miss_or_a_probe_find_never_a_wrong_promise():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0)
    shared = tokens_of(40 * TPB + 9, seed=6)
    _write(writer, mem, shared, 20, sign=False)  # the first 20 blocks before the index
    _publish(mem, time.time())
    _write(writer, mem, shared, 40, sign=False)  # blocks 20..40 after it (and again 0..20: write-once)
    counted = InstrumentedStore(mem)
    # A slow prefill makes the rest worth a background probe at once (the value rule).
    core = _leader(counted, fleet_index_s=3600, prefill_tokens_per_s=10.0)
    try:
        _refreshed(core)
        before = counted.snapshot()
        n, _ = core.get_num_new_matched_tokens(1, shared, len(shared), 0)
        assert n == 20 * TPB  # what the index holds, verified; nothing past it promised
        assert (counted.snapshot() - before).head <= 2 * 5 + 1  # the verify wave only, on this path
        deadline = time.monotonic() + 10
        while core.stats.lookup_probes_past_found == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.stats.lookup_probes_past == 1 and core.stats.lookup_probes_past_found == 1
        # The probe found the rest: the next lookup of the prefix is answered locally, whole.
        waves = core.stats.lookup_waves
        assert core.get_num_new_matched_tokens(2, shared, len(shared), 0)[0] == 40 * TPB
        assert core.stats.lookup_waves == waves
    finally:
        core.close_lookup()
    # Where a probe is not worth it (the default prefill speed, a short prompt): a plain miss.
    core = _leader(InstrumentedStore(mem), fleet_index_s=3600)
    fresh = tokens_of(40 * TPB + 9, seed=7)
    _publish(mem, time.time())
    _write(writer, mem, fresh, 40, sign=False)
    try:
        _refreshed(core)
        assert core.get_num_new_matched_tokens(3, fresh, len(fresh), 0) == (0, False)
        assert core.stats.lookup_probes_past == 0
    finally:
        core.close_lookup()


def test_an_object_gc_deleted_behind_an_unsigned_index_is_never_promised():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0)
    stored = tokens_of(40 * TPB + 9, seed=8)
    _write(writer, mem, stored, 40, sign=False)
    _publish(mem, time.time())
    core = _leader(mem, fleet_index_s=3600)
    try:
        _refreshed(core)
        digests = chain_digests(chain_root(core.namespace), stored, TPB)
        spine = core.geometry.groups[core.geometry.spine_group].fingerprint
        victim = core.scheme.object_key(spine, 0, digests[19])  # blocks 16..19
        mem.delete_many([victim])  # gc, after the index was published
        n, _ = core.get_num_new_matched_tokens(1, stored, len(stored), 0)
        assert n <= 16 * TPB and core.stats.lookup_summary_stale == 1
        assert core.index.get(victim) is MISSING
    finally:
        core.close_lookup()


def test_a_head_is_believed_only_while_gc_must_keep_the_object():
    """A HEAD says an object is there, not for how long: gc deletes what was last written or
    refreshed more than the retention and the promise (``index_ttl_s`` + ``lookup_summary_trust_s``)
    ago, a clock margin later, and the key index believes an answer for ``index_ttl_s``. An object
    past that age when asked is good for the lookup that asked (its load follows at once) but
    nothing is remembered of it: a later lookup's load promised on that memory might find it gone.
    One with less life left than the TTL is remembered only that long
    (``test_lookup_budget.py::test_the_index_keeps_an_answer_no_longer...``)."""
    from s3kv.core.cost import promise_s

    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0)
    stored = tokens_of(40 * TPB + 9, seed=9)
    keys = _write(writer, mem, stored, 40, sign=False)
    digests = chain_digests(chain_root(writer.namespace), stored, TPB)
    old = [k for k in keys if any(k.endswith(digests[end - 1].hex()) for end in range(24, 41, 4))]

    def lookup(rid: int, age_s: float) -> tuple[int, LeaderCore]:
        """Blocks 24..40's objects last written ``age_s`` ago; what a fresh engine serves."""
        for k in old:
            body, meta, _ = mem._objects[k]
            mem._objects[k] = (body, meta, time.time() - age_s)
        core = _leader(mem, fleet_index_s=0)
        try:
            return core.get_num_new_matched_tokens(rid, stored, len(stored), 0)[0], core
        finally:
            core.close_lookup()

    settings = writer.settings
    gone = settings.retention_h * 3600.0 + promise_s(settings)
    n, core = lookup(1, gone + 1)
    assert n == 40 * TPB and core.stats.old_objects > 0
    assert all(core.index.get(k) is None for k in old)
    n, core = lookup(2, gone - core.index.ttl_s / 2)  # half the TTL of life left
    assert n == 40 * TPB and core.stats.old_objects == 0 and any(core.index.get(k) is not None for k in old)


# ------------------------------------------------------------------------------ planted indexes
def test_a_planted_or_unsigned_index_never_makes_a_hit_free():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0, integrity_key=SECRET)
    stored = tokens_of(40 * TPB + 9, seed=9)
    _write(writer, mem, stored, 40)
    t0 = time.time()
    key = index_key(writer.scheme.namespace_prefix)

    def refresher(keys) -> IndexRefresher:
        return IndexRefresher(mem, key, writer.namespace, keys=keys, interval_s=5, max_objects=1000,
                              clock=lambda: t0 + 1)

    # A keyless writer's index (anyone with s3:PutObject): refused by a keyed engine.
    _publish(mem, t0)
    r = refresher(KEYS)
    assert not r.refresh() and r.refused == {"unsigned": 1} and r.current() is None
    assert not r.refresh() and r.refused == {"unsigned": 1}  # unchanged: a 304, not parsed again
    # Signed with another key: refused.
    _publish(mem, t0, integrity=IntegrityKeys.from_secrets(OTHER))
    r = refresher(KEYS)
    assert not r.refresh() and r.refused == {"unknown_key": 1}
    # An index of another namespace written at this one's key: refused.
    other_ns = bytes(16)
    assert other_ns != writer.namespace
    mem.delete_many([key])
    mem.put(key, encode(other_ns, {}, object_key=key, listed_at=t0, published_at=t0, every_s=10,
                        tag_key=KEYS.current))
    r = refresher(KEYS)
    assert not r.refresh() and r.refused == {"namespace": 1}
    # The genuine one is taken; an older signed one written back afterwards is refused.
    old = _publish(mem, t0 - 5, integrity=KEYS)
    old_bytes = mem.get(key)
    assert sum(old.indexed.values()) == 20
    _publish(mem, t0, integrity=KEYS)
    r = refresher(KEYS)
    assert r.refresh() and r.current() is not None
    mem.delete_many([key])
    mem.put(key, old_bytes)
    assert not r.refresh() and r.refused == {"older": 1} and r.current().listed_at == t0
    # An engine without a key takes an unsigned index, but its hits always cost a verify wave.
    counted = InstrumentedStore(mem)
    plain = _leader(counted, fleet_index_s=3600)
    plain_writer = _leader(mem, fleet_index_s=0)
    _write(plain_writer, mem, stored, 40, sign=False)
    _publish(mem, time.time())
    try:
        _refreshed(plain)
        before = counted.snapshot()
        assert plain.get_num_new_matched_tokens(1, stored, len(stored), 0)[0] == 40 * TPB
        assert (counted.snapshot() - before).head > 0 and plain.stats.lookup_trusted_hits == 0
    finally:
        plain.close_lookup()


def test_the_publisher_leaves_out_objects_its_head_refuses():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0, integrity_key=SECRET)
    good = tokens_of(40 * TPB + 9, seed=10)
    planted = tokens_of(40 * TPB + 9, seed=11)
    _write(writer, mem, good, 40)
    for k in _write(writer, mem, planted, 40):  # then replaced by a keyless writer: zeros, no tags
        size = mem.head(k).size
        mem.delete_many([k])
        mem.put(k, bytes(size))
    pub = Publisher(mem, "pfx/", integrity=KEYS, every_s=10)
    rep = pub.publish(time.time())
    assert sum(rep.indexed.values()) == 20 and rep.refused == 20
    # What a pass learned is kept: the next pass asks about nothing it has seen.
    again = pub.publish(time.time())
    assert again.heads == 0 and sum(again.indexed.values()) == 20


# ------------------------------------------------------------------------------ a publisher that stops
def test_a_publisher_that_stops_is_noticed_and_lookups_fall_back():
    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0)
    stored = tokens_of(40 * TPB + 9, seed=12)
    _write(writer, mem, stored, 40, sign=False)
    t0 = time.time()
    _publish(mem, t0, every_s=10)
    counted = InstrumentedStore(mem)
    core = _leader(counted, fleet_index_s=5, lookup_summary_s=3600)
    clock = _Clock(t0 + 1)
    try:
        fleet = _refreshed(core, clock)
        other = tokens_of(40 * TPB + 9, seed=13)
        assert core.get_num_new_matched_tokens(1, other, len(other), 0) == (0, False)
        assert core.stats.lookup_index_lookups == 1
        clock.t = t0 + 31  # three periods of 10 s: the publisher stopped
        assert fleet.current() is None and fleet.age_s() > fleet.max_age_s()
        before = counted.snapshot()
        other2 = tokens_of(40 * TPB + 9, seed=14)
        assert core.get_num_new_matched_tokens(2, other2, len(other2), 0) == (0, False)
        # Fell back to this engine's LIST (its first pass runs now; HEAD waves meanwhile).
        assert core.stats.lookup_index_lookups == 1
        assert (counted.snapshot() - before).head > 0 or core.stats.lookup_list_lookups == 1
        assert core.lookup_summary().refresh()
        core.get_num_new_matched_tokens(3, other2, len(other2), 0)
        assert core.stats.lookup_list_lookups >= 1
        # The publisher comes back: its new index is taken and used again.
        _publish(mem, t0 + 40, every_s=10)
        clock.t = t0 + 41
        assert fleet.refresh() and fleet.current() is not None
        core.get_num_new_matched_tokens(4, other2, len(other2), 0)
        assert core.stats.lookup_index_lookups == 2
    finally:
        core.close_lookup()


def test_each_streak_of_failed_index_refreshes_warns_once(caplog):
    """A store outage warns when it starts, not every refresh; the next outage, after the store
    answered again (here: no index yet), warns again -- only the process's first outage did."""
    import logging

    from s3kv.store.base import StoreError

    down = [False]

    class Flaky(MemoryStore):
        def get_if_changed(self, key, etag):
            if down[0]:
                raise StoreError("store down")
            return super().get_if_changed(key, etag)  # answers: no index there yet

    ref = IndexRefresher(Flaky(), "pfx/index", b"", keys=None, interval_s=5, max_objects=1000)
    warned = []
    with caplog.at_level(logging.DEBUG, logger="s3kv"):
        for state in (True, True, True, False, True, True):
            down[0] = state
            caplog.clear()
            ref.refresh()
            warned.append(any(r.levelno == logging.WARNING and "refresh failed" in r.getMessage()
                              for r in caplog.records))
    assert warned == [True, False, False, False, True, False]
    assert ref.failures == 5


# ------------------------------------------------------------------------------ stall priced as latency
def test_the_budget_with_requests_running_beside_it_is_what_the_overlap_hides_plus_the_slo_cap():
    core = _leader(MemoryStore(), fleet_index_s=0, lookup_timeout_s=-1, lookup_max_added_latency_ms=40,
                   prefill_tokens_per_s=1000.0)
    lk = core._lookups
    # 4,000 tokens at 1,000 tokens/s: the value rule alone allows the 500 ms cap.
    assert lk.lookup_budget_s(4000) == pytest.approx(0.5)
    assert lk.lookup_budget_s(4000, corunning=8, hidden_s=0.0) == pytest.approx(0.04)
    assert lk.lookup_budget_s(4000, corunning=8, hidden_s=0.025) == pytest.approx(0.065)
    assert lk.lookup_budget_s(20, corunning=8, hidden_s=0.025) == pytest.approx(0.01)  # value rule smaller
    t = [0.0]
    pace = Pace(overlap=True, clock=lambda: t[0])
    pace.others = 8
    for _ in range(20):
        t[0] += 0.03
        pace.iteration(6)
    assert pace.corunning() == 6 and pace.hidden_s() == pytest.approx(0.03)
    pace.stalled()
    t[0] += 0.2  # a pass with a lookup in it says nothing of the forward
    pace.iteration(6)
    assert pace.hidden_s() == pytest.approx(0.03)
    pace.others = 2  # requests finished since the last pass
    assert pace.corunning() == 2
    t[0] += 5  # idle
    assert pace.corunning() == 0
    assert Pace(overlap=False).hidden_s() == 0.0


def test_a_lookups_stall_is_counted_as_latency_added_to_the_requests_beside_it():
    core = _leader(MemoryStore(), fleet_index_s=0)
    core._lookups.pace.overlap = True
    core._lookups.pace.forward_s = 0.0
    rd = []
    # Three requests running: reported in a pass, then a fourth is looked up.
    for rid in range(3):
        p = tokens_of(8 * TPB + 3, seed=20 + rid)
        core.get_num_new_matched_tokens(rid, p, len(p), 0)
        rd.append(rid)
    core.build_connector_meta([], [])
    core._lookups.pace.batch = 3
    p = tokens_of(8 * TPB + 3, seed=30)
    core.get_num_new_matched_tokens(9, p, len(p), 0)
    rec = core.stats.recent_lookups[-1]
    assert rec.corunning == 3 and rec.added_s == pytest.approx(rec.stall_s)
    assert core.stats.lookup_added_latency_s == pytest.approx(3 * rec.stall_s)
    assert core.stats.lookup_unhidden_stall_s == pytest.approx(rec.stall_s)


# ------------------------------------------------------------------------------ end to end, simulated engine
MODEL = gemma3_like(64, kv_heads=2)


def _specs(first_id: int, n: int = 3) -> list[SimRequestSpec]:
    rng = random.Random(5)
    return [SimRequestSpec(first_id + i, tuple(rng.randrange(32000) for _ in range(16 * 12 + 5)), max_new_tokens=2)
            for i in range(n)]


def _replace_objects(store: MemoryStore, *, zero: bool) -> int:
    """Every s3kv object: deleted (gc), or replaced by zeros of its size and no metadata (a keyless
    writer planting at the signed size)."""
    n = 0
    for k in store.keys():
        if parse_key(k) is None:
            continue
        size = store.head(k).size
        store.delete_many([k])
        if zero:
            store.put(k, bytes(size))
        n += 1
    return n


def _one_by_one(eng, specs):
    reps = []
    with eng:
        for spec in specs:
            reps.append(eng.run([spec]).requests[0])
            for w in eng.workers:
                assert w.flush(30)
    return reps


def test_a_trusted_listing_vouches_only_for_objects_young_enough_that_no_gc_may_delete_them():
    """``lookup_summary_trust_s``: a LIST names objects, not how long gc keeps them. One listed
    younger than the floor (what gc keeps by every rule) is a free hit; one listed older may be
    deleted the moment after the listing (gc had not come round to it yet), so its hit is
    verified first -- and where gc did delete it, a miss rather than a promised load that fails."""
    from s3kv.core.retention import RETENTION_FLOOR_S

    mem = MemoryStore()
    writer = _leader(mem, fleet_index_s=0)
    stored = tokens_of(40 * TPB + 9, seed=6)
    keys = _write(writer, mem, stored, 40, sign=False)
    counted = InstrumentedStore(mem)

    def lookup(rid: int, after_listing: Any = None) -> tuple[int, Any, int]:
        core = _leader(counted, fleet_index_s=0, lookup_summary_s=3600, lookup_summary_trust_s=3600)
        try:
            assert core.lookup_summary().refresh()
            if after_listing is not None:
                after_listing()
            before = counted.snapshot()
            n = core.get_num_new_matched_tokens(rid, stored, len(stored), 0)[0]
            return n, counted.snapshot() - before, core.stats.lookup_trusted_hits
        finally:
            core.close_lookup()

    n, io, trusted = lookup(1)
    assert n == 40 * TPB and io.requests == 0 and trusted == 1
    for k in keys:  # the same objects, listed once older than the floor
        body, meta, _ = mem._objects[k]
        mem._objects[k] = (body, meta, time.time() - RETENTION_FLOOR_S - 1)
    n, io, trusted = lookup(2)
    assert n == 40 * TPB and io.head > 0 and trusted == 0
    n, io, trusted = lookup(3, after_listing=lambda: mem.delete_many(keys))  # gc, just after the LIST
    assert n == 0 and io.head > 0 and trusted == 0


def test_trust_mode_one_failed_load_of_a_planted_listed_object_ends_the_listings_trust():
    """Issue 37, trust mode: keyless zero-filled objects at the signed size were a summary hit for
    every request -- each one's load failed (on the layout line each parked, 4 retries, 9 s). Now the
    first failure takes the listing's trust: later requests are verified by HEAD (a planted object
    has no metadata tag) and are plain misses. (On the layout line the first request still parks
    until its client cancels it: the engine has no other safe outcome; the ones after it do not.)"""
    kw = dict(integrity_key=SECRET, lookup_summary_s=3600, lookup_summary_trust_s=3600, fleet_index_s=0)
    store = MemoryStore()
    _one_by_one(make_engine(store, MODEL, tpb=16, **kw), _specs(0))
    assert _replace_objects(store, zero=True) > 0
    eng = make_engine(store, MODEL, tpb=16, failed_load_hook=True, **kw)
    assert eng.leader.core.lookup_summary().refresh()
    reps = _one_by_one(eng, _specs(100))
    offered = [r.offered_tokens for r in reps]
    assert offered[0] > 0 and offered[1:] == [0, 0], offered  # was: every request promised
    assert [r.recomputed_failed_load for r in reps] == [True, False, False]
    assert eng.leader.core.stats.listing_trust_lost == 1


def test_an_object_deleted_behind_a_signed_index_costs_one_failed_load_never_a_wrong_byte():
    kw = dict(integrity_key=SECRET, fleet_index_s=3600)
    store = MemoryStore()
    _one_by_one(make_engine(store, MODEL, tpb=16, **kw), _specs(0))
    rep = Publisher(store, "", integrity=KEYS, every_s=10).publish()
    assert sum(rep.indexed.values()) > 0
    _replace_objects(store, zero=False)  # gc deleted them all after the index was published
    eng = make_engine(store, MODEL, tpb=16, failed_load_hook=True, **kw)
    eng.leader.core.fleet_index().refresh()
    with eng:
        reps = []
        for spec in _specs(100):
            r = eng.run([spec])
            assert r.kv_mismatches == 0
            reps.append(r.requests[0])
            for w in eng.workers:
                assert w.flush(30)
    assert [r.recomputed_failed_load for r in reps] == [True, False, False]
    assert [r.offered_tokens > 0 for r in reps] == [True, False, False]
    core = eng.leader.core
    assert core.stats.listing_trust_lost == 1 and core.stats.lookup_trusted_hits == 1


def test_gc_publishes_the_index_that_engines_then_read(tmp_path):
    """``s3kv gc ... --index EVERY``: the deployment's one publisher. After a pass the index holds
    what gc kept, signed with gc's key, and an engine reads it (what it deleted is not in it)."""
    from click.testing import CliRunner

    from s3kv.store.factory import open_store
    from s3kv.tools.ops import gc_command

    url = f"file://{tmp_path}/cache"
    store = open_store(url)
    writer = _leader(store, fleet_index_s=0, integrity_key=SECRET)
    writer.scheme = dataclasses.replace(writer.scheme, prefix="")  # file:// URLs carry no key prefix
    keep, drop = tokens_of(40 * TPB + 9, seed=40), tokens_of(40 * TPB + 9, seed=41)
    _write(writer, store, keep, 40)
    t = time.time() - 3 * 86400
    for k in _write(writer, store, drop, 40):
        os.utime(tmp_path / "cache" / k, (t, t))
    # Another deployment below this URL (s3://b/kv/teamB under s3://b/kv): gc keeps out of it.
    writer.scheme = dataclasses.replace(writer.scheme, prefix="teamB")
    _write(writer, store, tokens_of(8 * TPB + 9, seed=42), 8)
    writer.scheme = dataclasses.replace(writer.scheme, prefix="")
    env = {"S3KV_INTEGRITY_KEY": SECRET}
    r = CliRunner().invoke(gc_command, ["--url", url, "--older-than", "2", "--index", "10s", "--json"], env=env)
    assert r.exit_code == 0, r.output
    key = index_key(writer.scheme.namespace_prefix)
    idx = decode(store.get_if_changed(key).data, object_key=key, namespace=writer.namespace, keys=KEYS,
                 max_objects=1000)
    assert idx.verified and idx.objects == 20 and idx.every_s >= 10
    with pytest.raises(NotFound):  # none written into the other deployment's namespace
        store.get_if_changed(index_key(f"teamB/{writer.namespace.hex()}/"))
    r = CliRunner().invoke(gc_command, ["--url", url, "--older-than", "2", "--index", "0", "--json"], env=env)
    assert r.exit_code != 0 and "--index" in r.output


def test_stats_counts_what_the_engines_lookups_cost_the_requests_beside_them(tmp_path, monkeypatch):
    """``s3kv stats --engine URL``: scheduler stall beyond the overlap loop (GPU time lost) and the
    latency added to co-running requests, read from the engines' metrics and summed -- each
    endpoint read once (the tiers, lookup and value lines agree on one scrape)."""
    import json
    from collections import Counter

    from click.testing import CliRunner

    from s3kv.engine.leader.stats import LeaderStats
    from s3kv.engine.metrics import Metrics, start_http_server
    from s3kv.tools import tierstats
    from s3kv.tools.ops import stats_command

    reads: Counter[str] = Counter()
    real_read = tierstats.read_endpoint

    def counted(url, *a, **kw):
        reads[url] += 1
        return real_read(url, *a, **kw)

    monkeypatch.setattr(tierstats, "read_endpoint", counted)
    monkeypatch.setattr("s3kv.engine.metrics.read_endpoint", counted)

    servers = []
    for stalls in ((0.040, 0.010), (0.100,)):
        st = LeaderStats()
        for s in stalls:
            st.lookups += 1
            st.record_lookup(s, 0.5, 1000, 0, "miss", hidden_s=0.010, corunning=4)
        st.lookup_index_lookups = len(stalls)
        m = Metrics()
        m.observe_leader(st)
        servers.append(start_http_server(m, 0))
    try:
        (tmp_path / "cache").mkdir()
        urls = [f"http://127.0.0.1:{srv.server_port}/metrics" for srv in servers]
        args = ["--url", f"file://{tmp_path}/cache", "--json"] + [a for u in urls for a in ("--engine", u)]
        r = CliRunner().invoke(stats_command, [*args, "--engine", "http://127.0.0.1:1/metrics"])
        assert r.exit_code == 0, r.output
        lk = json.loads(r.stdout)["lookups"]
        # Beyond the 10 ms the overlap hid: 30 + 0 + 90 ms, each added to 4 requests.
        assert lk["engines"] == 2 and lk["lookups"] == 3 and lk["from_index_pct"] == 100.0
        assert lk["unhidden_stall_s"] == pytest.approx(0.120) and lk["added_latency_s"] == pytest.approx(0.480)
        assert lk["stall_s"] == pytest.approx(0.150) and list(lk["unreachable"]) == ["http://127.0.0.1:1/metrics"]
        assert set(reads.values()) == {1} and len(reads) == 3
    finally:
        for srv in servers:
            srv.shutdown()


def test_a_replay_publishes_on_its_own_clock_and_engines_judge_the_index_by_it():
    """``ReplayIndex``, a fleet replay's ``on_clock`` hook: the index published every ``every_s`` of
    the trace's clock, from a billed store that lists on that clock (expired objects gone), picked
    up by every engine at once."""
    from types import SimpleNamespace

    from s3kv.tools.bench.billing import BilledStore
    from s3kv.tools.bench.indexhook import ReplayIndex

    mem = MemoryStore()
    billed = BilledStore(mem, 1 << 30, 128 << 20, retention_s=100.0, expire_after_s=100.0)
    engine = _leader(billed, fleet_index_s=3600)
    billed.bind(engine.geometry, [g.page_bytes for g in engine.geometry.groups])
    fleet = SimpleNamespace(store=billed, engines=[SimpleNamespace(leader=SimpleNamespace(core=engine))])
    hook = ReplayIndex(every_s=10)
    old, new = tokens_of(40 * TPB + 9, seed=50), tokens_of(40 * TPB + 9, seed=51)
    try:
        hook(0.0, fleet)  # before anything is stored: an empty index, misses free from the start
        assert hook.passes == 1 and engine.fleet_index().current().objects == 0
        _write(engine, billed, old, 40, sign=False)
        billed.now = 150.0
        _write(engine, billed, new, 40, sign=False)
        hook(5.0, fleet)
        assert hook.passes == 1  # not due
        billed.now = 180.0
        hook(180.0, fleet)  # the old prompt's objects expired at 100 s on the trace's clock
        idx = engine.fleet_index().current()
        assert hook.passes == 2 and idx.objects == 20 and idx.listed_at == 180.0
        assert not any(k.endswith(chain_digests(chain_root(engine.namespace), old, TPB)[3].hex()) for k in mem.keys())
        hook(230.0, fleet)
        assert engine.fleet_index().current() is not None  # fresh on the trace's clock, whatever wall time says
        assert engine.get_num_new_matched_tokens(1, new, len(new), 0)[0] == 40 * TPB
        assert engine.get_num_new_matched_tokens(2, old, len(old), 0)[0] == 0
    finally:
        engine.close_lookup()
