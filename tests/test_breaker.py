from __future__ import annotations

import logging
import threading
import time

import pytest

from s3kv.store.base import (
    ByteRange,
    DeadlineExceeded,
    HeadBatch,
    IntegrityError,
    LocalFailure,
    NotFound,
    PermissionDenied,
    StoreError,
    StoreWrapper,
    TransientError,
)
from s3kv.store.breaker import BreakerPolicy, BreakerState, CircuitBreakerStore, StoreUnavailable
from s3kv.store.faults import FaultInjectingStore
from s3kv.store.memory import MemoryStore

CLOSED, HALF_OPEN, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class Counting(StoreWrapper):
    """Counts calls that reach the inner store (to prove an open breaker does not call it)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls = 0

    def head_many(self, keys):
        self.calls += 1
        return super().head_many(keys)

    def put(self, key, data, metadata=None):
        self.calls += 1
        return super().put(key, data, metadata)

    def get_ranges(self, key, ranges):
        self.calls += 1
        return super().get_ranges(key, ranges)

    def delete_many(self, keys):
        self.calls += 1
        super().delete_many(keys)

    def list(self, prefix):
        self.calls += 1
        return super().list(prefix)


def make(failures=3, reset_s=10.0, probes=1):
    mem = MemoryStore()
    faults = FaultInjectingStore(mem)
    counting = Counting(faults)
    clock = FakeClock()
    seen: list[tuple[BreakerState, BreakerState]] = []
    breaker = CircuitBreakerStore(
        counting,
        BreakerPolicy(failures=failures, reset_s=reset_s, half_open_probes=probes),
        clock=clock,
        on_transition=lambda old, new: seen.append((old, new)),
    )
    return breaker, faults, counting, clock, seen, mem


def fail_puts(breaker, n):
    for i in range(n):
        with pytest.raises(TransientError):
            breaker.put(f"k{i}", b"x")


def test_policy_validation_and_from_settings():
    with pytest.raises(ValueError):
        BreakerPolicy(failures=0)
    with pytest.raises(ValueError):
        BreakerPolicy(reset_s=-1)
    with pytest.raises(ValueError):
        BreakerPolicy(half_open_probes=0)
    from s3kv.config import Settings

    p = BreakerPolicy.from_settings(Settings(breaker_failures=7, breaker_reset_s=2.5))
    assert (p.failures, p.reset_s) == (7, 2.5)


def test_opens_after_consecutive_failures_and_fails_fast(caplog):
    breaker, faults, counting, clock, seen, _ = make(failures=3)
    faults.set_down(True)
    caplog.set_level(logging.INFO, logger="s3kv.breaker")
    fail_puts(breaker, 2)
    assert breaker.state is CLOSED
    fail_puts(breaker, 1)
    assert breaker.state is OPEN
    assert seen == [(CLOSED, OPEN)]
    rec = [r for r in caplog.records if r.name == "s3kv.breaker"]
    assert rec and rec[-1].from_state == "closed" and rec[-1].to_state == "open"

    calls = counting.calls
    with pytest.raises(StoreUnavailable):
        breaker.put("x", b"x")
    with pytest.raises(StoreUnavailable):
        breaker.get_ranges("x", [ByteRange(0, 1)])
    with pytest.raises(StoreUnavailable):
        breaker.get("x")
    with pytest.raises(StoreUnavailable):
        breaker.delete_many(["x"])
    with pytest.raises(StoreUnavailable):
        breaker.list("")
    batch = breaker.head_many(["a", "b", "a"])
    assert not batch.found and not batch.missing
    assert set(batch.failed) == {"a", "b"}
    assert all(isinstance(e, StoreUnavailable) and isinstance(e, StoreError) for e in batch.failed.values())
    assert counting.calls == calls, "an open breaker must not touch the inner store"
    assert breaker.rejected == 6


def test_success_resets_the_consecutive_count():
    breaker, faults, _, _, seen, _ = make(failures=3)
    for _ in range(3):
        faults.fail_next("put", 2)
        fail_puts(breaker, 2)
        assert breaker.put("ok", b"x") in (True, False)
        assert breaker.consecutive_failures == 0
    assert breaker.state is CLOSED and seen == []


def test_answers_are_not_failures():
    breaker, faults, _, _, seen, _ = make(failures=2)
    for _ in range(5):
        with pytest.raises(NotFound):
            breaker.get_ranges("missing", [ByteRange(0, 1)])
        assert breaker.head_many(["missing"]).missing == {"missing"}
    # A write that finds its key present (S3's 412) returns False: success, not an error.
    assert breaker.put("k", b"1") is True
    assert breaker.put("k", b"2") is False
    assert breaker.state is CLOSED and seen == []


def _short_read() -> DeadlineExceeded:
    err = DeadlineExceeded("get gave up after 3 attempt(s); last error: range returned 10 bytes")
    err.__cause__ = IntegrityError("range 0+100 returned 10 bytes")
    return err


def _gave_up_on_5xx() -> DeadlineExceeded:
    err = DeadlineExceeded("get gave up after 3 attempt(s)")
    err.__cause__ = TransientError("503 SlowDown")
    return err


@pytest.mark.parametrize(
    "answer",
    [
        lambda key: IntegrityError("S3 get: range starts beyond the object's end (416)", key=key),
        lambda key: PermissionDenied("403 on this object", key=key),
        lambda key: StoreError("S3 get: PreconditionFailed (HTTP 412)", key=key),
        lambda key: StoreError("S3 get: InvalidArgument (HTTP 400)", key=key),
        lambda key: _short_read(),
    ],
    ids=["416", "403", "412", "400", "short-read"],
)
def test_content_answers_never_open_the_breaker(answer):
    """Issue 29.4: a 416 (range beyond the end of a crafted object), like any answer the store
    gives about one object's content, is the store answering; counted as a failure, one parked
    request retrying its load kept an engine's breaker open or half-open, so every lookup missed."""
    breaker, faults, _, clock, seen, _ = make(failures=2)
    faults.fail_next("get", 10, error=answer)
    for _ in range(10):
        with pytest.raises(StoreError):
            breaker.get_ranges("k", [ByteRange(0, 100)])
    assert breaker.state is CLOSED and seen == []
    # And a half-open breaker's probe that gets such an answer closes it: the store is alive.
    faults.fail_next("put", 2)
    fail_puts(breaker, 2)
    assert breaker.state is OPEN
    clock.advance(10)
    faults.fail_next("get", 1, error=answer)
    with pytest.raises(StoreError):
        breaker.promised_reads().get_ranges("k", [ByteRange(0, 100)])
    assert breaker.state is CLOSED


def test_a_range_beyond_a_real_objects_end_is_an_answer():
    breaker, _, _, _, seen, mem = make(failures=2)
    mem.put("short", b"0123456789")
    for _ in range(5):
        with pytest.raises(StoreError):
            breaker.promised_reads().get_ranges("short", [ByteRange(64, 64)])
    assert breaker.state is CLOSED and seen == []


@pytest.mark.parametrize("err", [lambda key: TransientError("503", key=key), lambda key: _gave_up_on_5xx(),
                                 lambda key: DeadlineExceeded("head wave gave up after 2s", key=key)],
                         ids=["5xx", "retries-ran-out", "timeout"])
def test_transport_errors_5xx_and_timeouts_do_open_it(err):
    breaker, faults, _, _, _, _ = make(failures=2)
    faults.fail_next("get", 2, error=err)
    for _ in range(2):
        with pytest.raises(StoreError):
            breaker.get_ranges("k", [ByteRange(0, 1)])
    assert breaker.state is OPEN


def test_head_batch_counts_once_and_only_when_every_key_failed():
    breaker, faults, _, _, seen, mem = make(failures=2)
    mem.put("present", b"x")
    faults.fail_next("head", 2)  # two of three keys fail: the store answered the third
    batch = breaker.head_many(["a", "b", "present"])
    assert len(batch.failed) == 2 and "present" in batch.found
    assert breaker.consecutive_failures == 0
    faults.fail_next("head", 3)  # every key of a batch fails: one failure, not three
    breaker.head_many(["a", "b", "c"])
    assert breaker.consecutive_failures == 1 and breaker.state is CLOSED
    faults.fail_next("head", 1)
    breaker.head_many(["a"])
    assert breaker.state is OPEN
    assert breaker.head_many([]) == HeadBatch({}, frozenset(), {})


def test_half_open_probe_success_closes():
    breaker, faults, counting, clock, seen, mem = make(failures=1, reset_s=10)
    faults.set_down(True)
    fail_puts(breaker, 1)
    assert breaker.state is OPEN
    clock.advance(9.9)
    assert breaker.state is OPEN
    with pytest.raises(StoreUnavailable):
        breaker.put("x", b"x")
    clock.advance(0.1)
    assert breaker.state is HALF_OPEN
    faults.set_down(False)
    calls = counting.calls
    assert breaker.put("x", b"x") is True
    assert counting.calls == calls + 1
    assert breaker.state is CLOSED
    assert seen == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert mem.keys() == ["x"]


def test_half_open_probe_failure_reopens_and_restarts_the_timer():
    breaker, faults, _, clock, seen, _ = make(failures=2, reset_s=5)
    faults.set_down(True)
    fail_puts(breaker, 2)
    clock.advance(5)
    # The probe is a HEAD batch whose keys all fail.
    batch = breaker.head_many(["a", "b"])
    assert all(isinstance(e, TransientError) for e in batch.failed.values())
    assert breaker.state is OPEN
    clock.advance(4.9)
    assert breaker.state is OPEN
    clock.advance(0.1)
    assert breaker.state is HALF_OPEN
    faults.set_down(False)
    assert breaker.head_many(["a"]).missing == {"a"}
    assert breaker.state is CLOSED
    assert seen == [
        (CLOSED, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, CLOSED),
    ]
    assert breaker.trips == 2


def test_half_open_admits_only_the_probe_count():
    gate = threading.Event()
    entered = threading.Event()

    class Slow(StoreWrapper):
        def put(self, key, data, metadata=None):
            entered.set()
            gate.wait(5)
            return super().put(key, data, metadata)

    mem = MemoryStore()
    faults = FaultInjectingStore(Slow(mem))
    clock = FakeClock()
    breaker = CircuitBreakerStore(
        faults, BreakerPolicy(failures=1, reset_s=1, half_open_probes=1), clock=clock
    )
    faults.set_down(True)
    fail_puts(breaker, 1)
    faults.set_down(False)
    clock.advance(1)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(breaker.put("probe", b"x")))
    t.start()
    assert entered.wait(5)
    assert breaker.state is HALF_OPEN
    with pytest.raises(StoreUnavailable):  # the one probe slot is taken
        breaker.put("other", b"x")
    gate.set()
    t.join(5)
    assert result == [True] and breaker.state is CLOSED
    assert breaker.put("other", b"x") is True


def test_list_is_guarded_eagerly_and_settles():
    breaker, faults, _, clock, _, mem = make(failures=1, reset_s=1)
    mem.put("p/a", b"1")
    assert [i.key for i in breaker.list("p/")] == ["p/a"]
    faults.set_down(True)
    with pytest.raises(TransientError):
        list(breaker.list("p/"))
    assert breaker.state is OPEN
    with pytest.raises(StoreUnavailable):
        breaker.list("p/")  # raised at call time, before iteration
    clock.advance(1)
    faults.set_down(False)
    it = breaker.list("p/")
    assert next(it).key == "p/a"
    assert breaker.state is CLOSED


def test_non_store_exceptions_are_neutral():
    class Boom(StoreWrapper):
        def put(self, key, data, metadata=None):
            raise RuntimeError("bug")

    breaker = CircuitBreakerStore(Boom(MemoryStore()), BreakerPolicy(failures=1))
    for _ in range(3):
        with pytest.raises(RuntimeError):
            breaker.put("k", b"x")
    assert breaker.state is CLOSED


def test_callback_errors_do_not_break_calls():
    def bad_callback(old, new):
        raise ValueError("callback bug")

    faults = FaultInjectingStore(MemoryStore())
    breaker = CircuitBreakerStore(faults, BreakerPolicy(failures=1), on_transition=bad_callback)
    faults.set_down(True)
    with pytest.raises(TransientError):
        breaker.put("k", b"x")
    assert breaker.state is OPEN


def test_thread_safety_under_concurrent_failures():
    breaker, faults, _, clock, seen, _ = make(failures=5, reset_s=100)
    faults.set_down(True)

    def hammer():
        for i in range(50):
            try:
                breaker.put(f"k{i}", b"x")
            except StoreError:
                pass

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert breaker.state is OPEN
    assert seen == [(CLOSED, OPEN)]
    assert breaker.trips == 1


def test_a_probe_that_never_settles_does_not_wedge_half_open():
    breaker, faults, _, clock, _, mem = make(failures=1, reset_s=2)
    faults.set_down(True)
    fail_puts(breaker, 1)
    faults.set_down(False)
    clock.advance(2)
    breaker.list("")  # admitted as the probe, then never iterated
    with pytest.raises(StoreUnavailable):
        breaker.put("k", b"x")
    clock.advance(2)
    assert breaker.put("k", b"x") is True
    assert breaker.state is CLOSED


def test_local_failures_count_neither_way():
    """A LocalFailure is this host's machinery failing (a lookup helper died), never the store's
    answer: however many, it neither opens the breaker nor closes a half-open one."""

    class HelperDied(StoreWrapper):
        def __init__(self, inner):
            super().__init__(inner)
            self.local = False

        def head_many(self, keys):
            if self.local:
                return HeadBatch({}, frozenset(), {k: LocalFailure("helper died", key=k) for k in keys})
            return super().head_many(keys)

        def put(self, key, data, metadata=None):
            if self.local:
                raise LocalFailure("no thread", key=key)
            return super().put(key, data, metadata)

    mem = MemoryStore()
    faults = FaultInjectingStore(mem)
    inner = HelperDied(faults)
    clock = FakeClock()
    breaker = CircuitBreakerStore(inner, BreakerPolicy(failures=2, reset_s=5), clock=clock)
    faults.fail_next("head", 1)
    breaker.head_many(["a"])  # one real failure
    inner.local = True
    for _ in range(10):
        batch = breaker.head_many(["a", "b"])
        assert all(isinstance(e, LocalFailure) for e in batch.failed.values())
        with pytest.raises(LocalFailure):
            breaker.put("k", b"x")
    assert breaker.state is CLOSED and breaker.consecutive_failures == 1  # not reset, not grown
    inner.local = False
    faults.fail_next("head", 1)
    breaker.head_many(["a"])
    assert breaker.state is OPEN  # the second real failure in a row
    clock.advance(5)
    inner.local = True
    breaker.head_many(["a", "b"])  # the half-open probe fails locally: no verdict
    assert breaker.state is HALF_OPEN
    inner.local = False
    breaker.head_many(["a"])
    assert breaker.state is CLOSED


def test_promised_reads_are_attempted_whatever_the_state():
    """A rank's loads are of hits the leader already promised (from another process's breaker):
    an open breaker still refuses everything else, but a promised read goes to the store, its
    outcome counts, and it moves no state by itself."""
    breaker, faults, counting, _, seen, _ = make(failures=2)
    mem_key = "k"
    breaker.put(mem_key, b"abc")
    faults.set_down(True)
    fail_puts(breaker, 2)
    assert breaker.state is OPEN
    faults.set_down(False)
    reads = breaker.promised_reads()
    calls = counting.calls
    assert reads.get_ranges(mem_key, [ByteRange(0, 3)]) == [b"abc"]
    assert counting.calls == calls + 1 and breaker.state is OPEN and breaker.consecutive_failures == 0
    with pytest.raises(StoreUnavailable):
        breaker.get_ranges(mem_key, [ByteRange(0, 3)])  # the breaker itself still refuses
    faults.set_down(True)
    with pytest.raises(StoreError):
        reads.get_ranges(mem_key, [ByteRange(0, 3)])
    assert breaker.consecutive_failures == 1 and breaker.state is OPEN


def test_an_excused_timeout_frees_a_half_open_probe_slot_once():
    """A probe's wave late on this side (the store answers HEADs asked since) is excused: its slot
    is freed then, and its own late settle must not free another -- found by review: a second
    probe was then joined by a third while still in flight, past ``half_open_probes``."""
    import time

    from s3kv.store.base import HeadBatch

    class Inner(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.gates: dict[str, threading.Event] = {}
            self.fail = True

        def head_many(self, keys):
            if self.fail:
                raise TransientError("down")
            gate = self.gates.get(keys[0])
            if gate is not None:
                gate.wait(5)
            return HeadBatch({}, frozenset(keys), {})

        def answered_since(self, t: float) -> bool:
            return True  # another helper's shares keep being answered

    now = [0.0]
    inner = Inner()
    b = CircuitBreakerStore(inner, BreakerPolicy(failures=1, reset_s=1.0, half_open_probes=1), clock=lambda: now[0])
    with pytest.raises(StoreError):
        b.head_many(["x"])  # one failed call: open
    assert b.state is BreakerState.OPEN
    inner.fail, now[0] = False, 2.0
    first, second = threading.Event(), threading.Event()
    inner.gates = {"p1": first, "p2": second}
    t1 = threading.Thread(target=b.head_many, args=(["p1"],))
    t1.start()
    time.sleep(0.1)
    b.note_timeout("head")  # excused; the slot is free again
    assert b.timeouts_excused == 1
    t2 = threading.Thread(target=b.head_many, args=(["p2"],))
    t2.start()
    time.sleep(0.1)
    first.set()
    t1.join(5)  # the late first probe settles: nothing more
    third = b.head_many(["p3"])  # probe 2 still holds the only slot: refused at once
    assert set(third.failed) == {"p3"} and isinstance(third.failed["p3"], StoreUnavailable)
    second.set()
    t2.join(5)
    assert b.state is BreakerState.CLOSED  # probe 2 answered


class _Hung(MemoryStore):
    """HEADs block until released; ``alive``: the store says it answered HEADs asked later
    (another helper's shares), as ``answered_since`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.alive = False

    def head_many(self, keys):
        self.release.wait(10)
        return super().head_many(keys)

    def answered_since(self, t: float) -> bool:
        return self.alive


def _hang_a_wave(breaker) -> threading.Thread:
    t = threading.Thread(target=breaker.head_many, args=(["k"],), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not breaker._heads_in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    return t


def test_a_store_that_answers_nothing_opens_the_breaker_after_stall_s():
    """Issue 29.5: a hung store fails no call; lookups past their backlog send none. A HEAD wave
    unanswered for ``stall_s`` with nothing answered since opens the breaker, whatever the count."""
    inner, clock = _Hung(), FakeClock()
    breaker = CircuitBreakerStore(inner, BreakerPolicy(failures=5, reset_s=10, stall_s=2.0), clock=clock)
    try:
        waves = [_hang_a_wave(breaker) for _ in range(4)]
        clock.advance(1.9)
        assert breaker.state is CLOSED and breaker.consecutive_failures == 0
        clock.advance(0.2)
        assert breaker.state is OPEN and breaker.stalls == 1
        # After the reset period the waves hung before it do not reopen it before a probe is sent.
        clock.advance(10)
        assert breaker.state is HALF_OPEN
        probe = _hang_a_wave(breaker)
        clock.advance(1)
        assert breaker.state is HALF_OPEN
        clock.advance(1.1)
        assert breaker.state is OPEN and breaker.stalls == 2  # the probe hung too
    finally:
        inner.release.set()
        for t in [*waves, probe]:
            t.join(5)


def test_a_list_that_answers_then_meets_a_missing_page_leaves_the_stall_rule_armed():
    """A LIST whose later page is an answer-error (NotFound) settles a second ticket as an answer;
    it must carry the LIST's own admission time, or the breaker would believe the store answered
    every call ever made, and no hung wave after it would open the breaker."""

    class Vanishing(_Hung):
        def list(self, prefix):
            yield from super().list(prefix)
            raise NotFound("page gone", key=prefix)

    inner, clock = Vanishing(), FakeClock()
    inner.put("a", b"1")
    breaker = CircuitBreakerStore(inner, BreakerPolicy(stall_s=2.0), clock=clock)
    with pytest.raises(NotFound):
        list(breaker.list(""))
    clock.advance(1)
    try:
        wave = _hang_a_wave(breaker)
        clock.advance(2.1)
        assert breaker.state is OPEN and breaker.stalls == 1
    finally:
        inner.release.set()
        wave.join(5)


def test_a_wave_late_while_the_store_answers_is_no_stall():
    inner, clock = _Hung(), FakeClock()
    breaker = CircuitBreakerStore(inner, BreakerPolicy(stall_s=2.0), clock=clock)
    try:
        wave = _hang_a_wave(breaker)
        inner.alive = True  # the store answered HEADs asked since (another helper's shares)
        clock.advance(5)
        assert breaker.state is CLOSED
        breaker.put("x", b"1")  # a call sent after the wave was answered: the store is alive
        inner.alive = False
        clock.advance(1)
        assert breaker.state is CLOSED
    finally:
        inner.release.set()
        wave.join(5)
    # stall_s=0: off
    breaker = CircuitBreakerStore(inner := _Hung(), BreakerPolicy(stall_s=0), clock=(clock := FakeClock()))
    try:
        wave = _hang_a_wave(breaker)
        clock.advance(100)
        assert breaker.state is CLOSED
    finally:
        inner.release.set()
        wave.join(5)


class _HungReads(_Hung):
    """GETs block until released; ``head_arrived``: the response head came back (the body still
    streams), which the S3 stores note for ``answered_since``."""

    def __init__(self) -> None:
        super().__init__()
        self.head_arrived = False

    def get_ranges(self, key, ranges):
        self.release.wait(10)
        return super().get_ranges(key, ranges)

    def answered_since(self, t: float) -> bool:
        return self.alive or self.head_arrived


def _hang_a_read(breaker, key="k", promised=False) -> threading.Thread:
    store = breaker.promised_reads() if promised else breaker
    t = threading.Thread(target=lambda: store.get_ranges(key, [ByteRange(0, 1)]), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not any(r.key == key for r in breaker._reads_in_flight) and time.monotonic() < deadline:
        time.sleep(0.001)
    return t


@pytest.mark.parametrize("promised", [False, True], ids=["read", "promised-read"])
def test_a_read_the_store_never_answers_opens_the_breaker_after_stall_s(promised):
    """Issue 37: behind a warm index no HEAD is sent, and the promised loads' GETs were the only
    calls a hung store held -- each failed only after its own load_stall_s, one failure at a time
    (the breaker opened 25 s in). A read unanswered for ``stall_s``, nothing answered since,
    opens it; ``hung_since`` then names the reads sent before."""
    inner, clock = _HungReads(), FakeClock()
    inner.put("k", b"1")
    breaker = CircuitBreakerStore(inner, BreakerPolicy(failures=5, reset_s=10, stall_s=2.0), clock=clock)
    sent = time.monotonic()
    try:
        read = _hang_a_read(breaker, promised=promised)
        clock.advance(1.9)
        assert breaker.state is CLOSED and not breaker.hung_since(sent)
        clock.advance(0.2)
        assert breaker.hung_since(sent) and breaker.state is OPEN and breaker.stalls == 1
        assert not breaker.hung_since(time.monotonic())  # a read sent from now on gets its own chance
        assert breaker.promised_reads().hung_since(sent)  # what the loader asks, through the wrapper
    finally:
        inner.release.set()
        read.join(5)
    clock.advance(10)
    breaker.head_many(["p"])  # the half-open probe is answered: closed, the store is well again
    assert breaker.state is CLOSED and not breaker.hung_since(sent)


def test_a_read_whose_answer_streams_for_long_is_no_stall():
    """A large object streams for seconds on a healthy store: its response head arrived, so the
    store answered -- the body's progress is the loader's stall rule, not the breaker's."""
    inner, clock = _HungReads(), FakeClock()
    inner.put("k", b"1")
    breaker = CircuitBreakerStore(inner, BreakerPolicy(stall_s=2.0), clock=clock)
    try:
        read = _hang_a_read(breaker)
        inner.head_arrived = True
        clock.advance(30)
        assert breaker.state is CLOSED and breaker.stalls == 0
    finally:
        inner.release.set()
        read.join(5)
    assert breaker.consecutive_failures == 0


def test_a_read_given_up_by_the_loader_settles_nothing_when_it_ends_late():
    """``note_timeout("get", key)`` counts that read once; its success seconds later must not reset
    the count (a hung store answering a few reads late would otherwise never trip the breaker)."""
    inner, clock = _HungReads(), FakeClock()
    inner.put("k", b"1")
    breaker = CircuitBreakerStore(inner, BreakerPolicy(failures=5, stall_s=0), clock=clock)
    read = _hang_a_read(breaker)
    breaker.note_timeout("get", "k")
    assert breaker.consecutive_failures == 1
    inner.release.set()
    read.join(5)
    assert breaker.consecutive_failures == 1 and not breaker._reads_in_flight
