"""Retries with jittered exponential backoff inside a deadline, for any store.

One :class:`RetryPolicy` (built on tenacity) serves two places:

* :class:`s3kv.store.s3.S3Store` wraps every single S3 request in it (botocore's own
  retries are off, so there is exactly one retry loop and one deadline);
* :class:`RetryingStore` wraps a whole ``ObjectStore`` (fsspec back ends, or the memory
  store under :class:`~s3kv.store.faults.FaultInjectingStore` in tests).

Only :class:`TransientError` is retried (plus short reads for ``get_ranges``); ``NotFound``,
``PermissionDenied`` and ``BucketNotFound`` are answers, not faults, and surface at once.
When retries run out the caller gets :class:`DeadlineExceeded` naming the operation and the
key, with the last underlying error chained as ``__cause__``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from .base import (
    Buffer,
    ByteRange,
    DeadlineExceeded,
    Fetched,
    HeadBatch,
    IntegrityError,
    ObjectInfo,
    ObjectStore,
    StoreError,
    StoreWrapper,
    TransientError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# tenacity >= 8.3 has stop_before_delay: it refuses to start a sleep that would end past
# the deadline, so we give up *before* the deadline instead of one backoff after it.
_stop_by_deadline = getattr(tenacity, "stop_before_delay", tenacity.stop_after_delay)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one request.

    ``max_attempts`` counts the first try. Backoff before retry *n* is uniform in
    ``[0, min(max_backoff_s, base_s * 2**n)]`` ("full jitter"), so a fleet that failed
    together does not retry together. ``deadline_s`` bounds the whole loop (attempts plus
    sleeps); a single attempt is bounded separately by the transport's timeouts.
    """

    max_attempts: int = 6
    base_s: float = 0.05
    max_backoff_s: float = 2.0
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_s < 0 or self.max_backoff_s < 0 or self.deadline_s <= 0:
            raise ValueError(f"RetryPolicy times must be positive: {self}")

    # Why every call tries once before tenacity: a tenacity loop costs ~0.15 ms of Python per
    # request (measured: a 344-HEAD wave spent 55 of its 143 ms of CPU there) and nearly every
    # request succeeds at once. A first failure worth retrying is replayed as tenacity's first
    # attempt, with the deadline counted from the real start: the same attempts, backoff, deadline
    # and messages as a loop that ran from the beginning.

    def call(
        self,
        fn: Callable[[], T],
        *,
        op: str,
        key: str | None = None,
        retry_on: tuple[type[BaseException], ...] = (TransientError,),
    ) -> T:
        """Run ``fn`` until it returns, raises something not in ``retry_on``, or the budget ends."""
        start = time.monotonic()
        try:
            return fn()
        except retry_on as exc:
            first: BaseException | None = exc

        def again() -> T:
            nonlocal first
            if first is not None:
                e, first = first, None
                raise e
            return fn()

        try:
            return tenacity.Retrying(**self._tenacity(op, key, retry_on, start))(again)
        except tenacity.RetryError as exc:
            raise self._gave_up(exc, op, key, start) from exc.last_attempt.exception()

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        op: str,
        key: str | None = None,
        retry_on: tuple[type[BaseException], ...] = (TransientError,),
    ) -> T:
        """:meth:`call` for a coroutine function: the same attempts, backoff and deadline, with
        the backoff slept on the event loop (many requests wait at once without a thread each)."""
        start = time.monotonic()
        try:
            return await fn()
        except retry_on as exc:
            first: BaseException | None = exc

        async def again() -> T:
            nonlocal first
            if first is not None:
                e, first = first, None
                raise e
            return await fn()

        try:
            return await tenacity.AsyncRetrying(**self._tenacity(op, key, retry_on, start))(again)
        except tenacity.RetryError as exc:
            raise self._gave_up(exc, op, key, start) from exc.last_attempt.exception()

    def _tenacity(
        self, op: str, key: str | None, retry_on: tuple[type[BaseException], ...], start: float
    ) -> dict[str, Any]:
        left = self.deadline_s - (time.monotonic() - start)  # the first attempt's time counts
        return {
            "stop": tenacity.stop_after_attempt(self.max_attempts) | _stop_by_deadline(left),
            "wait": tenacity.wait_random_exponential(multiplier=self.base_s, max=self.max_backoff_s),
            "retry": tenacity.retry_if_exception_type(retry_on),
            "before_sleep": _log_retry(op, key),
            "reraise": False,
        }

    def _gave_up(self, exc: tenacity.RetryError, op: str, key: str | None, start: float) -> DeadlineExceeded:
        last = exc.last_attempt.exception()
        detail = str(last)
        if isinstance(last, StoreError) and key is not None:
            detail = detail.removesuffix(f" (object {key!r})")  # ours names the key once
        return DeadlineExceeded(
            f"{op} gave up after {exc.last_attempt.attempt_number} attempt(s) in "
            f"{time.monotonic() - start:.2f}s (limits: {self.max_attempts} attempts, "
            f"{self.deadline_s:g}s deadline); last error: {type(last).__name__}: {detail}",
            key=key,
        )


#: Retries sent so far in this process, by operation (``retries_by_op``): what the
#: ``store_retries_total`` metric reports. One count where every retry passes (a retry's sleep).
_RETRIES: dict[str, int] = {}
_RETRIES_LOCK = threading.Lock()


def retries_by_op() -> dict[str, int]:
    """Store requests retried in this process so far, by operation."""
    with _RETRIES_LOCK:
        return dict(_RETRIES)


def _log_retry(op: str, key: str | None) -> Callable[[tenacity.RetryCallState], None]:
    def before_sleep(state: tenacity.RetryCallState) -> None:
        with _RETRIES_LOCK:
            _RETRIES[op] = _RETRIES.get(op, 0) + 1
        exc = state.outcome.exception() if state.outcome else None
        sleep = state.next_action.sleep if state.next_action else 0.0
        log.debug(
            "retrying %s %s after attempt %d (%s); sleeping %.3fs", op, key, state.attempt_number, exc, sleep
        )

    return before_sleep


class _PartialHead(Exception):
    """Internal: some keys of a HEAD batch failed transiently; carries the last such error."""

    def __init__(self, last: StoreError):
        super().__init__(str(last))
        self.last = last


class RetryingStore(StoreWrapper):
    """Adds :class:`RetryPolicy` retries to any store.

    ``get_ranges`` also checks every returned length and retries a short read (a body cut
    short in transit is transient); a persistent short read ends in ``DeadlineExceeded``
    whose cause is an :class:`IntegrityError`. ``list`` retries the whole listing and then
    yields it, so a fault half-way through never yields a key twice.
    """

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None):
        super().__init__(inner)
        self.policy = policy or RetryPolicy()

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        pending = list(dict.fromkeys(keys))
        found: dict[str, ObjectInfo] = {}
        missing: set[str] = set()
        failed: dict[str, StoreError] = {}

        # One round HEADs every still-pending key; keys that failed transiently stay
        # pending for the next round, everything else is settled. Retrying per round (not
        # per key) keeps the batch parallel in the inner store.
        def round_() -> None:
            batch = self.inner.head_many(pending)
            found.update(batch.found)
            missing.update(batch.missing)
            last: StoreError | None = None
            retry_keys = []
            for k, err in batch.failed.items():
                if isinstance(err, TransientError):
                    retry_keys.append(k)
                    last = err
                else:
                    failed[k] = err
            pending[:] = retry_keys
            if last is not None:
                raise _PartialHead(last)

        try:
            self.policy.call(
                round_, op="head", key=pending[0] if len(pending) == 1 else None, retry_on=(_PartialHead,)
            )
        except DeadlineExceeded as exc:
            cause = exc.__cause__
            last = cause.last if isinstance(cause, _PartialHead) else cause
            for k in pending:
                err = DeadlineExceeded(
                    f"head gave up (limits: {self.policy.max_attempts} attempts, {self.policy.deadline_s:g}s "
                    f"deadline); last error: {type(last).__name__}: {last}",
                    key=k,
                )
                err.__cause__ = last
                failed[k] = err
        return HeadBatch(found, frozenset(missing), failed)

    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        return self.policy.call(lambda: self.inner.put(key, data, metadata), op="put", key=key)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        def attempt() -> list[bytes]:
            out = self.inner.get_ranges(key, ranges)
            for r, b in zip(ranges, out, strict=True):
                if len(b) != r.length:
                    raise _ShortRead(f"range {r.offset}+{r.length} returned {len(b)} bytes", key=key)
            return out

        return self.policy.call(attempt, op="get", key=key, retry_on=(TransientError, _ShortRead))

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        # Every attempt rewrites every buffer whole, so a retried read never leaves a mix.
        self.policy.call(
            lambda: self.inner.get_ranges_into(key, ranges, out),
            op="get",
            key=key,
            retry_on=(TransientError, _ShortRead),
        )

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        return self.policy.call(lambda: self.inner.get_if_changed(key, etag), op="get", key=key)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.policy.call(
            lambda: self.inner.delete_many(keys), op="delete", key=keys[0] if len(keys) == 1 else None
        )

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        items = self.policy.call(lambda: list(self.inner.list(prefix)), op="list", key=prefix)
        return iter(items)

    def check_access(self) -> None:
        self.policy.call(self.inner.check_access, op="check_access")


class _ShortRead(IntegrityError):
    """A range came back shorter than asked: retried once more before it counts as corruption."""
