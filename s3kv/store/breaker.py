"""A circuit breaker around any store: stop calling a dead store, probe it, recover.

States::

    CLOSED ──(policy.failures consecutive failed calls)──▶ OPEN
    OPEN ──(policy.reset_s elapsed; checked on the next call or `state` read)──▶ HALF_OPEN
    HALF_OPEN ──(a probe call succeeds)──▶ CLOSED
    HALF_OPEN ──(a probe call fails)──▶ OPEN (the reset timer starts again)

What counts as a failure (:func:`is_store_failure`): only what says the store itself is unwell --
a transport error, a 5xx, throttling (all :class:`TransientError`) or a timeout (a
:class:`DeadlineExceeded` whose retries ran out on those, or a caller's ``note_timeout``). Any other
answer the store gives about one object's content -- 404, 403 on that object, 416 "range beyond the
end", a length or ETag that does not match, a 4xx we do not know -- means the store is alive and
counts as a success: one crafted object that answers 416 kept an engine's breaker open or half-open
for a minute while its parked load retried, so every lookup on it missed (issue 29.4). A
:class:`~s3kv.store.base.LocalFailure` (this host's machinery failed and the store never answered)
counts neither way, in a HEAD batch too. A write that found its key already present is not an
error at all (``put`` returns False; the S3 store turns a 412 into that). ``head_many`` reports
per-key failures inside its result instead of raising: a batch whose every key failed counts as
**one** failed call; a batch in which any key got an answer (found or missing) counts as a success. A call that raises
something that is not a StoreError (a bug, KeyboardInterrupt) is neither.

A store that hangs fails no call, so counting failures alone finds it late: a lookup counts its
timeout (``note_timeout``), but once ``lookup_max_pending`` hung waves fill its backlog, further
lookups send nothing and count nothing -- with the defaults (4 < 5 failures) the breaker opened
only when the hung HEADs' own client timeouts and retries ran out, 40 s on (issue 29.5). So a HEAD
wave of this period (``_epoch``) still unanswered ``policy.stall_s`` after it was sent, with no
call of the store answered since -- not by this breaker's calls, not by the store's own account
(``answered_since``: a wave held by a stopped HEAD helper while the store answers the others is
late on this side) -- opens the breaker. It is checked whenever the state is read or a call is
admitted (lookups read ``available`` before they trust the index), as the reset timer is.

Reads count the same way (issue 37): behind a warm index no lookup sends a HEAD, so the only
calls a hung store holds are the promised loads' GETs, each failing only after its own
``load_stall_s`` (5 s) and one failure at a time -- the breaker opened 25 s in, and parked
requests waited on. So a GET still unanswered ``policy.stall_s`` after it was sent, with nothing
answered since, opens it too. "Answered" is the store's first byte, not the last: the S3 stores
note a read's answer when its response head arrives (``answered_since``), so a large object that
streams for seconds is no stall; a body that stops mid-stream is the loader's own stall rule's
(``engine/worker/loads.py``). While the breaker stays open after its stall rule fired,
:meth:`hung_since` tells the loader which reads were sent before: it fails them at once (their
failure rung) instead of waiting out their own limit. PUTs and LISTs do not count: a PUT's
answer comes only after its whole body, which may take seconds on a healthy store.

While OPEN nothing reaches the inner store: ``head_many`` returns every key in ``failed``
with a :class:`StoreUnavailable`, every other call raises it. Callers above already treat a
failed lookup as a miss and a failed save as a dropped save, so a dead store costs them
nothing but a counter. While HALF_OPEN, up to ``policy.half_open_probes`` calls at a time go
through as probes; further calls fail fast until a probe settles.

``StoreUnavailable`` is deliberately not a :class:`TransientError`: put the breaker *outside*
the retry layer (``CircuitBreakerStore(RetryingStore(...))`` or around an S3Store, which
retries inside), so a fast failure is never retried and a failure the breaker counts is one
whose retries already ran out.

Every transition is logged on logger ``s3kv.breaker`` (with ``from_state``/``to_state``
extras) and passed to ``on_transition(old, new)`` (e.g. :meth:`s3kv.engine.metrics.Metrics.
on_breaker_transition`). The callback runs under the breaker's lock, so transitions are
reported in order; it must be quick and must not call into the store.

Why this is one module: the state machine and every store call it guards share one lock and
one ticket per call (admitted, then settled by the call's outcome); split apart, each store
method would reach into the state machine's internals.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import redact
from .base import (
    BucketNotFound,
    Buffer,
    ByteRange,
    DeadlineExceeded,
    Fetched,
    HeadBatch,
    IntegrityError,
    LocalFailure,
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectStore,
    PermissionDenied,
    SpanExpect,
    StoreError,
    StoreWrapper,
    TransientError,
)

log = logging.getLogger("s3kv.breaker")

T = TypeVar("T")


class StoreUnavailable(StoreError):
    """The circuit breaker is open: the store was failing, so the call was not attempted."""


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"

    def __str__(self) -> str:
        return self.value

    @property
    def level(self) -> int:
        """The value exported as a gauge: 0 closed, 1 half-open, 2 open."""
        return _LEVELS[self]


_LEVELS = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(frozen=True)
class BreakerPolicy:
    #: Consecutive failed calls that open the breaker.
    failures: int = 5
    #: Seconds the breaker stays open before letting a probe through.
    reset_s: float = 10.0
    #: Calls let through at once while half-open.
    half_open_probes: int = 1
    #: A HEAD wave unanswered this long, the store answering nothing since, opens it (0 = off).
    stall_s: float = 2.0

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"BreakerPolicy.failures must be >= 1, got {self.failures}")
        if self.reset_s < 0:
            raise ValueError(f"BreakerPolicy.reset_s must be >= 0, got {self.reset_s}")
        if self.half_open_probes < 1:
            raise ValueError(f"BreakerPolicy.half_open_probes must be >= 1, got {self.half_open_probes}")
        if self.stall_s < 0:
            raise ValueError(f"BreakerPolicy.stall_s must be >= 0, got {self.stall_s}")

    @classmethod
    def from_settings(cls, settings: Any) -> BreakerPolicy:
        """From :class:`s3kv.config.Settings` (``breaker_failures``, ``breaker_reset_s``, ``breaker_stall_s``)."""
        return cls(failures=int(settings.breaker_failures), reset_s=float(settings.breaker_reset_s),
                   stall_s=float(settings.breaker_stall_s))


Transition = Callable[[BreakerState, BreakerState], None]


class _Probe:
    """Admission ticket of one call; settles exactly once (success, failure or neutral)."""

    __slots__ = ("probe", "epoch", "done", "timed_out", "asked_at", "admitted", "key")

    def __init__(self, probe: bool, epoch: int = -1, admitted: float = float("inf"), key: str | None = None):
        self.probe = probe
        self.key = key  # a read's object (``note_timeout("get", key)`` finds its ticket by it)
        self.epoch = epoch  # the state period (a half-open period for a probe) it was admitted in
        self.admitted = admitted  # the breaker's clock
        self.done = False
        #: When a HEAD batch or a read went to the inner store (``time.monotonic``, the stores' clock).
        self.asked_at = float("inf")
        #: A caller gave up on this call (``note_timeout``): already counted as a failure, so its
        #: late outcome settles nothing more (a slow success must not reset the count).
        self.timed_out = False


class CircuitBreakerStore(StoreWrapper):
    def __init__(
        self,
        inner: ObjectStore,
        policy: BreakerPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Transition | None = None,
        name: str | None = None,
    ):
        super().__init__(inner)
        self.policy = policy or BreakerPolicy()
        self._clock = clock
        self._on_transition = on_transition
        # Shown in every transition's log line and refusal: never a URL's secret (issue 37).
        self.name = redact(name or inner.url)
        self._lock = threading.RLock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probes_in_flight = 0
        self._epoch = 0
        self._probe_at = 0.0
        #: Calls refused while open (or half-open with every probe slot taken).
        self.rejected = 0
        #: How many times the breaker opened.
        self.trips = 0
        #: Caller timeouts not counted: the store answered HEADs asked after the late batch.
        self.timeouts_excused = 0
        #: HEAD batches admitted and not settled, oldest first (``note_timeout``, the stall rule).
        self._heads_in_flight: list[_Probe] = []
        #: Reads (GETs, promised or not) admitted and not settled, oldest first (the stall rule).
        self._reads_in_flight: list[_Probe] = []
        #: When the stall rule last opened the breaker (``time.monotonic``), until it closes again.
        self._hung_at: float | None = None
        #: The latest admission time (breaker clock) of a call the store answered.
        self._answered_admitted = float("-inf")
        #: Times the stall rule opened the breaker.
        self.stalls = 0

    # -- state -------------------------------------------------------------------------
    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._maybe_half_open()
            self._check_stall()
            return self._state

    @property
    def available(self) -> bool:
        return self.state is BreakerState.CLOSED and self.inner.available

    @property
    def consecutive_failures(self) -> int:
        with self._lock:
            return self._consecutive

    def _transition(self, new: BreakerState, why: str) -> None:
        old = self._state
        if old is new:
            return
        self._state = new
        self._epoch += 1
        if new is BreakerState.OPEN:
            self._opened_at = self._clock()
            self.trips += 1
            self._probes_in_flight = 0
        elif new is BreakerState.CLOSED:
            self._consecutive = 0
            self._probes_in_flight = 0
            self._hung_at = None
        level = logging.WARNING if new is BreakerState.OPEN else logging.INFO
        log.log(
            level,
            "s3kv circuit breaker for %s: %s -> %s (%s)",
            self.name,
            old.value,
            new.value,
            why,
            extra={"from_state": old.value, "to_state": new.value, "store": self.name},
        )
        if self._on_transition is not None:
            try:
                self._on_transition(old, new)
            except Exception:  # noqa: BLE001 - reporting must never break the data path
                log.exception("s3kv: breaker on_transition callback failed")

    def _maybe_half_open(self) -> None:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.policy.reset_s:
            self._transition(BreakerState.HALF_OPEN, f"{self.policy.reset_s:g}s since it opened; probing")

    def _check_stall(self) -> None:
        """The stall rule (module docstring). Called under the lock."""
        stall = self.policy.stall_s
        if stall <= 0 or self._state is BreakerState.OPEN:
            return
        # Only calls of this period: after a reset, calls hung before it must not reopen the
        # breaker before its probe is even sent (it would never recover).
        heads = [t for t in self._heads_in_flight if t.epoch == self._epoch]
        reads = [t for t in self._reads_in_flight if t.epoch == self._epoch]
        oldest = min(heads[:1] + reads[:1], key=lambda t: t.admitted, default=None)
        if oldest is None:
            return
        waited = self._clock() - oldest.admitted
        if waited < stall or self._answered_admitted >= oldest.admitted:
            return
        if self.inner.answered_since(oldest.asked_at):
            return
        self.stalls += 1
        self._transition(
            BreakerState.OPEN,
            f"no answer from the store for {waited:.1f}s with {len(heads)} HEAD wave(s) and {len(reads)} read(s) waiting",
        )
        self._hung_at = time.monotonic()

    def hung_since(self, t: float) -> bool:
        """Whether the stall rule found the store answering nothing after ``t``
        (``time.monotonic``) and the breaker has not closed since: a read sent before then
        is held by a hung store (module docstring)."""
        with self._lock:
            self._maybe_half_open()
            self._check_stall()
            return self._hung_at is not None and self._hung_at >= t

    def _admit(self, op: str, key: str | None, promised: bool = False) -> _Probe:
        with self._lock:
            self._maybe_half_open()
            self._check_stall()
            if self._state is BreakerState.CLOSED:
                return _Probe(False, self._epoch, self._clock(), key)
            if (
                self._state is BreakerState.HALF_OPEN
                and self._probes_in_flight >= self.policy.half_open_probes
                and self._clock() - self._probe_at >= self.policy.reset_s
            ):
                # Probes that never settled (a hung call, a listing never iterated) must not
                # wedge the breaker: after another reset period they no longer hold their slots.
                self._epoch += 1
                self._probes_in_flight = 0
            if (
                self._state is BreakerState.HALF_OPEN
                and self._probes_in_flight < self.policy.half_open_probes
            ):
                self._probes_in_flight += 1
                self._probe_at = self._clock()
                return _Probe(True, self._epoch, self._probe_at, key)
            if promised:
                # Attempted as a plain call: its outcome counts, it moves no state by itself.
                return _Probe(False, self._epoch, self._clock(), key)
            self.rejected += 1
        raise self._unavailable(op, key)

    def _unavailable(self, op: str, key: str | None) -> StoreUnavailable:
        return StoreUnavailable(
            f"{op} not attempted: circuit breaker for {self.name} is {self._state.value} after "
            f"{self.policy.failures} consecutive failures (next probe within {self.policy.reset_s:g}s)",
            key=key,
        )

    def _settle(self, ticket: _Probe, ok: bool | None, why: str = "") -> None:
        """ok: True success, False failure, None neutral (not a store outcome)."""
        if ticket.done:
            return
        ticket.done = True
        with self._lock:
            if ticket in self._heads_in_flight:
                self._heads_in_flight.remove(ticket)
            elif ticket in self._reads_in_flight:
                self._reads_in_flight.remove(ticket)
            if ok:  # answered, even late: the store was alive when it was asked
                self._answered_admitted = max(self._answered_admitted, ticket.admitted)
            if ticket.timed_out:
                ok = None  # counted when the caller gave up
            # A probe only speaks for the half-open period it was admitted in.
            probe = ticket.probe and ticket.epoch == self._epoch and self._state is BreakerState.HALF_OPEN
            if probe:
                self._probes_in_flight = max(0, self._probes_in_flight - 1)
            if ok is None:
                return
            if ok:
                self._consecutive = 0
                if probe:
                    self._transition(BreakerState.CLOSED, "probe succeeded")
                return
            self._consecutive += 1
            if probe:
                self._transition(BreakerState.OPEN, f"probe failed: {why}")
            elif self._state is BreakerState.CLOSED and self._consecutive >= self.policy.failures:
                self._transition(BreakerState.OPEN, f"{self._consecutive} consecutive failures; last: {why}")

    def _guard(self, op: str, key: str | None, fn: Callable[[], T], promised: bool = False) -> T:
        return self._run(self._admit(op, key, promised), fn)

    def _read(self, key: str, fn: Callable[[], T], promised: bool = False) -> T:
        """A GET: guarded, and in flight for the stall rule until it settles."""
        ticket = self._admit("get", key, promised)
        with self._lock:
            self._reads_in_flight.append(ticket)
        ticket.asked_at = time.monotonic()
        return self._run(ticket, fn)

    def _run(self, ticket: _Probe, fn: Callable[[], T]) -> T:
        try:
            out = fn()
        except LocalFailure:
            self._settle(ticket, None)
            raise
        except StoreError as exc:
            self._settle(ticket, not is_store_failure(exc), _describe(exc))
            raise
        except BaseException:
            self._settle(ticket, None)
            raise
        self._settle(ticket, True)
        return out

    # -- the store ---------------------------------------------------------------------
    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        return self._head(keys, self.inner.head_many)

    def head_many_checked(self, keys: Sequence[str], expect: Mapping[str, SpanExpect]) -> HeadBatch:
        return self._head(keys, lambda unique: self.inner.head_many_checked(unique, expect))

    def _head(self, keys: Sequence[str], call: Callable[[list[str]], HeadBatch]) -> HeadBatch:
        unique = list(dict.fromkeys(keys))
        if not unique:
            return HeadBatch({}, frozenset(), {})
        try:
            ticket = self._admit("head", unique[0] if len(unique) == 1 else None)
        except StoreUnavailable:
            return HeadBatch({}, frozenset(), {k: self._unavailable("head", k) for k in unique})
        with self._lock:
            self._heads_in_flight.append(ticket)
        ticket.asked_at = time.monotonic()
        try:
            batch = call(unique)
        except StoreError as exc:
            self._settle(ticket, not is_store_failure(exc), _describe(exc))
            raise
        except BaseException:
            self._settle(ticket, None)
            raise
        answered = len(batch.found) + len(batch.missing)
        # Keys that failed on this side (a helper died) were never the store's answer.
        from_store = [e for e in batch.failed.values() if not isinstance(e, LocalFailure)]
        failures = [e for e in from_store if is_store_failure(e)]
        if answered == 0 and not from_store:
            self._settle(ticket, None)
        elif answered == 0 and failures and len(failures) == len(from_store):
            self._settle(ticket, False, f"all {len(unique)} HEADs failed; e.g. {_describe(failures[0])}")
        else:
            self._settle(ticket, True)
        return batch

    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        return self._guard("put", key, lambda: self.inner.put(key, data, metadata))

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        return self._read(key, lambda: self.inner.get_ranges(key, ranges))

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        self._read(key, lambda: self.inner.get_ranges_into(key, ranges, out))

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        # Refused while open (a dead store gets no polls), but its outcome is neither way: a
        # background poll of one small object, every few seconds, says little about the store
        # the lookups and loads judge, and an answer from it must not reset their count.
        ticket = self._admit("get", key)
        try:
            return self.inner.get_if_changed(key, etag)
        finally:
            self._settle(ticket, None)

    def promised_reads(self) -> ObjectStore:
        """This store, but its reads are attempted whatever the breaker's state: for the loads of
        hits already promised. Why: each TensorRT-LLM rank is its own process with its own
        breaker, and the leader promises from rank 0's. A rank whose breaker is still open or
        half-open after an outage (its own failed uploads opened it; no lookup of its own closes
        it) refused its share of the load -- the request failed (recomputed, or parked on the
        merged line) though the store was back and rank 0 had just read from it. A read that is
        attempted costs at most the store's timeout, and a refused one fails the request anyway.
        Outcomes still count (``_settle``), so the breaker sees the store come back or stay down."""
        return _PromisedReads(self)

    def note_timeout(self, op: str, key: str | None = None) -> None:
        """A caller gave up on a call that still runs (a hung store answers nothing, so no
        call of it ever fails): count it as one failed call, so a store whose every lookup
        times out opens the breaker like one that errors. The oldest unsettled HEAD batch is
        taken to be that call; its late answer then settles nothing (a success arriving
        seconds late must not reset the count).

        Unless the store has answered HEADs asked after that batch: then it is alive, and the
        batch is late on this side -- a HEAD helper process stopped, whose share no other
        helper's answer can make up for -- or for a few of its keys; ended, it would count as a
        success (some key answered). Counted, one wedged helper opened the breaker within a
        second of steady lookups, cutting loads and saves off a healthy store for its reset
        time, before the helper's ping could find it out.
        """
        with self._lock:
            if op == "head":
                late = next((t for t in self._heads_in_flight if not t.timed_out), None)
            else:  # a read the loader gave up on (its stall limit): the ticket of that object's read
                late = next((t for t in self._reads_in_flight if t.key == key and not t.timed_out), None)
            if late is not None:
                late.timed_out = True
            probe = late is not None and late.probe
        if late is not None and op == "head" and self.inner.answered_since(late.asked_at):
            self.timeouts_excused += 1
            # Settled now, neither way (a probe's slot freed once): its late outcome settles nothing.
            self._settle(late, None)
        else:
            self._settle(_Probe(probe, late.epoch if late is not None else -1), False, f"{op} timed out in the caller")
        self.inner.note_timeout(op, key)

    def delete_many(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        self._guard("delete", keys[0] if len(keys) == 1 else None, lambda: self.inner.delete_many(keys))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        ticket = self._admit("list", prefix)  # eager: an open breaker raises here, not on first next()
        return self._list(prefix, ticket)

    def _list(self, prefix: str, ticket: _Probe) -> Iterator[ObjectInfo]:
        try:
            for info in self.inner.list(prefix):
                self._settle(ticket, True)  # the store answered; later pages settle nothing more
                yield info
        except StoreError as exc:
            if ticket.done:  # failed after answering: still a failed call, asked when the LIST was
                # (a ticket admitted "never" would, settled as an answer, disarm the stall rule for good)
                ticket = _Probe(False, ticket.epoch, ticket.admitted)
            self._settle(ticket, not is_store_failure(exc), _describe(exc))
            raise
        except GeneratorExit:
            self._settle(ticket, None)
            raise
        except BaseException:
            self._settle(ticket, None)
            raise
        self._settle(ticket, True)

    def check_access(self) -> None:
        self._guard("check_access", None, self.inner.check_access)


def is_store_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the store is unwell (see the module docstring): a TransientError, or an
    error raised because of one (a DeadlineExceeded whose retries ran out on 5xx, a start-up check
    that could not reach the endpoint), or a timeout with no answer behind it."""
    for _ in range(8):  # a cause chain is short; the bound only guards against a cycle
        if exc is None or isinstance(exc, _ANSWERS):
            return False
        if isinstance(exc, TransientError):
            return True
        if exc.__cause__ is None:
            return isinstance(exc, (DeadlineExceeded, TimeoutError, ConnectionError))
        exc = exc.__cause__
    return False


#: What the store says about one object: it is alive (LocalFailure: it never answered).
_ANSWERS = (NotFound, PermissionDenied, IntegrityError, ObjectChanged, BucketNotFound, LocalFailure)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _PromisedReads(StoreWrapper):
    """:meth:`CircuitBreakerStore.promised_reads`: reads always attempted, all else the breaker's."""

    def __init__(self, breaker: CircuitBreakerStore):
        super().__init__(breaker)
        self._breaker = breaker

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        inner = self._breaker.inner
        return self._breaker._read(key, lambda: inner.get_ranges(key, ranges), promised=True)

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        inner = self._breaker.inner
        self._breaker._read(key, lambda: inner.get_ranges_into(key, ranges, out), promised=True)
