"""Failure injection around any store, for tests of retries, deadlines and outages.

Random faults come from a seeded RNG (same seed + same call order = same faults); the
deterministic controls (:meth:`FaultInjectingStore.fail_next`, :meth:`set_down`) make exact
scenarios without any randomness.

Faults and where they strike (``op`` is one of head, put, get, delete, list, check):

* ``transient``: raises :class:`TransientError` (a 503 SlowDown / 500 lookalike) before the
  inner call. In ``head_many`` it strikes per key (each key is one HEAD request) and lands in
  ``HeadBatch.failed``, as a real partial failure would.
* ``permission``: raises :class:`PermissionDenied` (a 403) - not worth retrying.
* ``stall``: sleeps ``FaultPlan.stall_s`` and then raises :class:`TransientError`, like a
  read timeout.
* ``lost_response`` (put only): performs the inner put, then raises TransientError - the
  write landed but its answer was lost, so a retry meets the existing object (S3's "retried
  412"). The retry layer must still end in success.
* ``truncate`` (get only): returns the ranges with the last one cut short. Chosen over
  raising IntegrityError because that is how the fault looks on the wire: a body that ends
  early with nothing flagged. The caller must detect it (RetryingStore checks lengths and
  retries; object checksums catch the rest).
* ``latency_s``: added to every call before anything else (not a fault, a delay); once per
  ``head_many`` batch, since a real store sends those HEADs in parallel.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .base import (
    Buffer,
    ByteRange,
    Fetched,
    HeadBatch,
    ObjectInfo,
    ObjectStore,
    PermissionDenied,
    StoreError,
    StoreWrapper,
    TransientError,
)

#: ``fetch``: the fleet index's conditional GET (``get_if_changed``).
OPS = ("head", "put", "get", "delete", "list", "check", "fetch")


@dataclass(frozen=True)
class FaultRates:
    """Per-call probabilities (0..1) of each fault, and an added latency."""

    transient: float = 0.0
    permission: float = 0.0
    stall: float = 0.0
    lost_response: float = 0.0
    truncate: float = 0.0
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("transient", "permission", "stall", "lost_response", "truncate"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"FaultRates.{name} must be in [0, 1], got {p}")
        if self.latency_s < 0:
            raise ValueError("FaultRates.latency_s must be >= 0")


@dataclass(frozen=True)
class FaultPlan:
    """``default`` rates for every op, overridden per op by ``per_op`` (e.g. ``{"get": FaultRates(...)}``)."""

    seed: int = 0
    default: FaultRates = field(default_factory=FaultRates)
    per_op: Mapping[str, FaultRates] = field(default_factory=dict)
    stall_s: float = 0.05

    def __post_init__(self) -> None:
        unknown = set(self.per_op) - set(OPS)
        if unknown:
            raise ValueError(f"FaultPlan.per_op has unknown ops {sorted(unknown)}; known: {OPS}")

    def rates(self, op: str) -> FaultRates:
        return self.per_op.get(op, self.default)


class FaultInjectingStore(StoreWrapper):
    def __init__(self, inner: ObjectStore, plan: FaultPlan | None = None):
        super().__init__(inner)
        self.plan = plan or FaultPlan()
        self._rng = random.Random(self.plan.seed)
        self._lock = threading.Lock()
        self._down = False
        self._fail_next: dict[str, list[Callable[[str | None], StoreError]]] = {}
        self._injected: dict[str, int] = {}

    # -- controls ----------------------------------------------------------------------
    def set_down(self, down: bool = True) -> None:
        """While down, every call fails with TransientError (an outage, not a config error)."""
        with self._lock:
            self._down = down

    def fail_next(self, op: str, n: int = 1, error: Callable[[str | None], StoreError] | None = None) -> None:
        """Fail the next ``n`` calls of ``op`` (per key for head). ``error(key)`` builds the
        exception; default a 503-like TransientError."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known: {OPS}")
        make = error or (lambda key: TransientError("injected: 503 SlowDown (fail_next)", key=key))
        with self._lock:
            self._fail_next.setdefault(op, []).extend([make] * n)

    def injected(self) -> dict[str, int]:
        """How many faults of each kind were injected so far (``"<op>.<kind>"`` -> count)."""
        with self._lock:
            return dict(self._injected)

    # -- the decision ------------------------------------------------------------------
    def _count(self, what: str) -> None:
        self._injected[what] = self._injected.get(what, 0) + 1

    def _fault(self, op: str, key: str | None, latency: bool = True, draw: bool = True) -> StoreError | None:
        """The error to raise for this call (None: let it through). Sleeps for latency/stalls."""
        rates = self.plan.rates(op)
        if latency and rates.latency_s:
            time.sleep(rates.latency_s)
        stall = False
        with self._lock:
            if self._down:
                self._count(f"{op}.down")
                return TransientError("injected: store down (connection refused)", key=key)
            queued = self._fail_next.get(op)
            if queued:
                self._count(f"{op}.fail_next")
                return queued.pop(0)(key)
            if not draw:
                return None
            # One draw per kind, in a fixed order, so a seed replays exactly.
            draws = {name: self._rng.random() for name in ("permission", "transient", "stall")}
            if draws["permission"] < rates.permission:
                self._count(f"{op}.permission")
                return PermissionDenied("injected: 403 AccessDenied", key=key)
            if draws["transient"] < rates.transient:
                self._count(f"{op}.transient")
                return TransientError("injected: 503 SlowDown", key=key)
            if draws["stall"] < rates.stall:
                self._count(f"{op}.stall")
                stall = True
        if stall:
            time.sleep(self.plan.stall_s)
            return TransientError(f"injected: timed out after {self.plan.stall_s:g}s", key=key)
        return None

    def _roll(self, op: str, kind: str, rate: float) -> bool:
        with self._lock:
            hit = self._rng.random() < rate
            if hit:
                self._count(f"{op}.{kind}")
            return hit

    def _check(self, op: str, key: str | None) -> None:
        err = self._fault(op, key)
        if err is not None:
            raise err

    # -- the store ---------------------------------------------------------------------
    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        unique = list(dict.fromkeys(keys))
        failed: dict[str, StoreError] = {}
        latency = self.plan.rates("head").latency_s
        if latency and unique:
            time.sleep(latency)  # once per batch: a real store sends the HEADs in parallel
        for key in unique:
            err = self._fault("head", key, latency=False)
            if err is not None:
                failed[key] = err
        passed = [k for k in unique if k not in failed]
        batch = self.inner.head_many(passed) if passed else HeadBatch({}, frozenset(), {})
        return HeadBatch(batch.found, batch.missing, {**batch.failed, **failed})

    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        self._check("put", key)
        created = self.inner.put(key, data, metadata)
        if self._roll("put", "lost_response", self.plan.rates("put").lost_response):
            raise TransientError("injected: connection reset after the PUT was stored", key=key)
        return created

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        self._check("get", key)
        out = self.inner.get_ranges(key, ranges)
        if out and out[-1] and self._roll("get", "truncate", self.plan.rates("get").truncate):
            out = [*out[:-1], out[-1][: len(out[-1]) // 2]]
        return out

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        # Random faults only where the plan names "fetch": the index refresher polls in the
        # background, and draws of its own would shift what a seeded plan does to the data path.
        err = self._fault("fetch", key, draw="fetch" in self.plan.per_op)
        if err is not None:
            raise err
        return self.inner.get_if_changed(key, etag)

    def delete_many(self, keys: Sequence[str]) -> None:
        self._check("delete", keys[0] if len(keys) == 1 else None)
        self.inner.delete_many(keys)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._check("list", prefix)
        return self.inner.list(prefix)

    def check_access(self) -> None:
        self._check("check", None)
        self.inner.check_access()
