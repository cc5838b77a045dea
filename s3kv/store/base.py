"""The one narrow object-store interface everything in s3kv talks to.

Implementations: ``memory`` (tests), ``s3`` (boto3), ``fsspec`` (``file://`` and
any fsspec URL). Wrappers that take an ``ObjectStore`` and are one themselves:
``faults`` (failure injection), ``throttle`` (latency / bandwidth), ``instrument``
(request and byte counters). Nothing above this layer knows which store it has.

Error model: every failure surfaces as a subclass of :class:`StoreError`. Callers
above the store treat a failed lookup as a miss and a failed save as a dropped
save; only a *promised* load turns a store error into a request failure.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..core.objects import ObjectIdentity, ObjectSpan

Buffer = bytes | bytearray | memoryview


class StoreError(Exception):
    """Base of every store failure. ``key`` names the object when there is one."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message if key is None else f"{message} (object {key!r})")
        self.key = key


class NotFound(StoreError):
    """The object does not exist (404)."""


class TransientError(StoreError):
    """Throttling, 5xx, connection reset, timeout: worth retrying."""


class LocalFailure(StoreError):
    """The request failed in this host's own machinery, not at the store: a lookup helper
    process died or hung, no thread could be started, the store was used in a forked child.
    It says nothing about the store's health, so the circuit breaker counts it neither way
    (one helper dying with waves in flight must not cut every engine off a healthy store).
    Not a TransientError: retrying the store would not mend it (a lookup is a miss)."""


class PermissionDenied(StoreError):
    """403 / access denied: retrying will not help; usually a setup problem."""


class BucketNotFound(StoreError):
    """The bucket itself is missing."""


class DeadlineExceeded(StoreError):
    """Retries ran out of time; carries the last underlying error as __cause__."""


class IntegrityError(StoreError):
    """Bytes came back that do not match what the store promised (short read, etc.)."""


class ObjectChanged(StoreError):
    """The object's ETag changed between the parts of one ranged read, twice in a row: it was
    replaced meanwhile (a refresh's self-copy re-tags a multipart object; gc deleted it and
    another writer stored it again). Nothing is wrong with either version, so a load that
    meets it failed for now -- never a sign of corruption (no quarantine, no delete). The
    store answered, so it is no store failure either (the circuit breaker's _ANSWERS)."""


class StoreConfigError(StoreError, ValueError):
    """The store location or its settings are unusable: bad URL, unknown scheme, unreachable endpoint.

    Raised at start-up (``open_store`` / ``check_access``); the message names the setting to fix.
    Also a ValueError so config-validation code can catch it with other bad-value errors.
    """


#: What :meth:`ObjectStore.touch` did (the ``outcome`` label of ``s3kv_refresh_total``).
TOUCH_REFRESHED = "refreshed"  # LastModified is now
TOUCH_YOUNG = "young"  # modified less than min_age_s ago (another engine refreshed it): no copy
TOUCH_GONE = "gone"  # deleted, or replaced since the HEAD (the copy's If-Match failed)
TOUCH_UNSUPPORTED = "unsupported"  # the store cannot bump an age


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    metadata: Mapping[str, str] = field(default_factory=dict)
    last_modified: float | None = None  # POSIX seconds
    #: Set by ``head_many_checked`` where the answer was checked where it arrived (a HEAD helper
    #: process): the span its metadata gave for the expectation asked, ``metadata`` then empty.
    span: ObjectSpan | None = None


#: What a found object's HEAD answer must say to be used (``ObjectStore.head_many_checked``):
#: the identity its key promises, and the block its key names as its end.
SpanExpect = tuple[ObjectIdentity, int]


@dataclass(frozen=True)
class HeadBatch:
    """Outcome of a batched HEAD: every asked key lands in exactly one of the three."""

    found: Mapping[str, ObjectInfo]
    missing: frozenset[str]
    failed: Mapping[str, StoreError]

    @classmethod
    def from_outcomes(
        cls, keys: Sequence[str], outcomes: Iterable[ObjectInfo | StoreError | None]
    ) -> HeadBatch:
        """Fold per-key outcomes (info, None = missing, or the error) into a batch."""
        found: dict[str, ObjectInfo] = {}
        missing: set[str] = set()
        failed: dict[str, StoreError] = {}
        for key, outcome in zip(keys, outcomes, strict=True):
            if isinstance(outcome, ObjectInfo):
                found[key] = outcome
            elif outcome is None:
                missing.add(key)
            else:
                failed[key] = outcome
        return cls(found, frozenset(missing), failed)


@dataclass(frozen=True)
class Fetched:
    """A whole object read by :meth:`ObjectStore.get_if_changed`: its bytes and the ETag that
    names this version (what the next conditional read sends back)."""

    data: bytes
    etag: str


@dataclass(frozen=True)
class ByteRange:
    offset: int
    length: int
    #: At most this many requests for this range (0: the store's own split, ``range_split``). A
    #: load of several objects sets it: the store's connections are shared by the objects read at
    #: once, so sub-ranges past their share add requests (billed) and no speed (``LoadJobs.start``).
    parts: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"invalid byte range offset={self.offset} length={self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length


class ObjectStore(abc.ABC):
    """Keys are full object keys (bucket-relative, prefix included by the caller's key scheme)."""

    #: Human-readable location, e.g. ``s3://bucket/prefix`` (for logs and errors).
    url: str = ""

    @abc.abstractmethod
    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        """Existence, size and metadata of many keys, in parallel where the store allows."""

    def head_many_checked(self, keys: Sequence[str], expect: Mapping[str, SpanExpect]) -> HeadBatch:
        """``head_many``, where a store may check each found object against ``expect[key]``
        (``core.objects.span_from_metadata``) where the answer arrives and hand back only the
        span (``ObjectInfo.span``): HEAD helper processes do, off the engine's GIL. An object
        that fails the check comes back whole, for the caller to check and report. The default
        is ``head_many``: the caller checks every answer."""
        return self.head_many(keys)

    def head(self, key: str) -> ObjectInfo | None:
        batch = self.head_many([key])
        if key in batch.failed:
            raise batch.failed[key]
        return batch.found.get(key)

    @abc.abstractmethod
    def put(self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None) -> bool:
        """Write once. ``data`` may be several buffers, written back to back (no join copy needed).

        Returns True if this call created the object, False if it already existed
        (a concurrent or earlier writer won; that is success, never an overwrite).
        """

    @abc.abstractmethod
    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        """Bytes of each range, in order. Raises NotFound if the object is gone."""

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        """Bytes of each range written into ``out[i]`` (a writable buffer of exactly that length).

        The load path reads into pinned staging through this, so a store that can land bytes
        in the caller's memory (obstore: one copy from the response) saves the intermediate
        ``bytes``. This default reads with :meth:`get_ranges` and copies - correct for any
        store, and the one wrappers get unless they forward this call themselves.
        """
        if len(out) != len(ranges):
            raise ValueError(f"{len(ranges)} ranges but {len(out)} buffers")
        for r, dst, data in zip(ranges, out, self.get_ranges(key, ranges), strict=True):
            view = memoryview(dst).cast("B")
            got = memoryview(data).nbytes
            if got != r.length or view.nbytes != r.length:
                raise IntegrityError(
                    f"range {r.offset}+{r.length} returned {got} bytes into a {view.nbytes}-byte buffer", key=key
                )
            view[:] = memoryview(data).cast("B")

    @abc.abstractmethod
    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        """The whole object with its ETag, or None when its ETag is still ``etag`` (one
        conditional GET, ``If-None-Match``: a 304 sends no body). Raises NotFound when the
        object does not exist. The fleet index's refresh (``s3kv.engine.fleetindex``): every
        engine asks every few seconds, and an unchanged index costs one small request.

        The ETag is opaque and only compared for equality: a store without one makes one up
        that changes whenever the object is replaced (``file://``: inode, mtime and size)."""

    def note_timeout(self, op: str, key: str | None = None) -> None:  # noqa: B027 - optional hook
        """A caller gave up waiting on a call of this store (e.g. a lookup's HEAD wave ran past
        its budget while the call itself still runs). Wrappers that judge the store's health
        (the circuit breaker) count it as a failure; plain stores ignore it."""

    def note_verified(self, key: str) -> None:  # noqa: B027 - optional hook
        """A load of ``key`` passed its checks (header, span, every page it read: checksum and
        tag): what refresh on hit (``store/refresh.py``) waits for before keeping the object
        alive. Called by the loader, never for bytes that failed; plain stores ignore it."""

    def answered_since(self, t: float) -> bool | None:
        """Whether the store has answered a request that was asked at or after ``t``
        (``time.monotonic``): a HEAD (found or missing), or a read whose response head arrived
        (its body may still stream); None where this store does not keep track. The breaker asks
        it of a HEAD wave its caller gave up on -- the store answered HEADs asked later, so it is
        alive, and the wave is late on this side (a HEAD helper stopped) or for a few keys -- and
        of a read before its stall rule calls the store hung."""
        return None

    def hung_since(self, t: float) -> bool:
        """Whether the store was found hung (it answered nothing for the circuit breaker's stall
        limit) after ``t`` (``time.monotonic``) and has not recovered since: a read sent before
        then will most likely never end, so the loader fails it at once. Only the breaker
        judges; other stores say False."""
        return False

    def store_time(self) -> float:
        """The store's own clock now (POSIX seconds): the time it would stamp an object written
        now with (``LastModified``). Ages of objects are differences of the store's own stamps,
        so ``s3kv gc`` reads them against this rather than against its host's clock, which may be
        off by more than gc's safety margin (issue 37). Costs one request; raises StoreError
        where it cannot be read."""
        raise StoreError(f"{type(self).__name__} cannot tell its clock")

    def get(self, key: str) -> bytes:
        info = self.head(key)
        if info is None:
            raise NotFound("no such object", key=key)
        return self.get_ranges(key, [ByteRange(0, info.size)])[0]

    def touch(self, key: str, min_age_s: float = 0.0) -> str:
        """Bump the object's last-modified time to now, keeping its bytes and metadata (refresh
        on hit, ``s3kv.store.refresh``), unless it was last modified less than ``min_age_s``
        ago. Returns a ``TOUCH_*`` outcome; raises StoreError on a failed request
        (PermissionDenied where the bucket refuses the copy)."""
        return TOUCH_UNSUPPORTED

    @abc.abstractmethod
    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete keys (missing keys are fine)."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (metadata may be empty: listing does not return it)."""

    @property
    def available(self) -> bool:
        """False while the store is known to be unusable (an open or half-open breaker).

        Callers then must not promise loads from cached knowledge (the local index):
        a dead store should cost a miss, not a failed request.
        """
        return True

    def check_access(self) -> None:
        """Fail fast at start-up with one clear error if the location is unusable.

        Default: a HEAD of a key that should not exist must answer "missing", not
        "denied" or "no bucket".
        """
        self.head(self._probe_key())

    def _probe_key(self) -> str:
        return "s3kv-access-probe/does-not-exist"

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreWrapper(ObjectStore):
    """Forwards everything to ``inner``; wrappers override what they change."""

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.url = inner.url

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        return self.inner.head_many(keys)

    def put(self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None) -> bool:
        return self.inner.put(key, data, metadata)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        return self.inner.get_ranges(key, ranges)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.inner.delete_many(keys)

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        return self.inner.get_if_changed(key, etag)

    def touch(self, key: str, min_age_s: float = 0.0) -> str:
        return self.inner.touch(key, min_age_s)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    @property
    def available(self) -> bool:
        return self.inner.available

    def note_timeout(self, op: str, key: str | None = None) -> None:
        self.inner.note_timeout(op, key)

    def note_verified(self, key: str) -> None:
        self.inner.note_verified(key)

    def answered_since(self, t: float) -> bool | None:
        return self.inner.answered_since(t)

    def hung_since(self, t: float) -> bool:
        return self.inner.hung_since(t)

    def store_time(self) -> float:
        return self.inner.store_time()

    def check_access(self) -> None:
        self.inner.check_access()

    def close(self) -> None:
        self.inner.close()


class AnswerClock:
    """When the latest request that the store answered was asked -- a HEAD (found or missing), or
    a read whose response head (a file: its open) arrived: what a store tells
    :meth:`ObjectStore.answered_since` from. Errors are no answer: a store that only fails
    is not shown alive.

    No lock: the compare and the store race between threads, and a lost update only leaves the
    clock earlier than it could be -- a timeout then counts against the store, as it did before
    stores kept this clock."""

    __slots__ = ("asked_at",)

    def __init__(self) -> None:
        self.asked_at = float("-inf")

    def note(self, asked_at: float) -> None:
        if asked_at > self.asked_at:
            self.asked_at = asked_at

    def since(self, t: float) -> bool:
        return self.asked_at >= t


def as_buffers(data: Buffer | Sequence[Buffer]) -> list[memoryview]:
    """Normalise ``put`` input into a list of byte views without copying."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(d).cast("B") for d in data]


def total_size(data: Buffer | Sequence[Buffer]) -> int:
    return sum(b.nbytes for b in as_buffers(data))
