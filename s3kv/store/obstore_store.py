"""S3 through obstore (Rust ``object_store``): the data and lookup paths without the GIL.

Why (measured with ``s3kv bench transfer`` / ``bench lookup`` / ``bench jitter``, which run
boto3, awscrt and obstore side by side on one server): botocore is pure Python, so every
request costs the process about a millisecond of CPU under the GIL (a HEAD: ~1.1 ms here,
~2.2 ms on the 16-core GPU host) and large transfers cap near 0.6 GB/s per process while the
engine's executor loop stalls behind them. obstore signs, sends, retries and parses in Rust
with the GIL released: a HEAD costs ~0.15 ms of client CPU, a GB ~0.6-0.8 CPU-seconds. awscrt
is close on bulk transfers but its body callbacks run in Python (jitter) and a HEAD costs
~0.4 ms; it is only measured, not used.

What stays on boto3 (one :class:`~s3kv.store.s3.S3Store` held inside, sharing the endpoint,
region, credentials chain and options):

* **multipart uploads** - write-once needs ``If-None-Match: *`` on CompleteMultipartUpload
  and an abort on every failure path; object_store only offers conditional single PUTs. So
  bodies at or above ``multipart_threshold`` go through the boto3 path, everything below is one
  conditional PUT here. (A single PUT is also one billed request instead of parts + 2.)
* ``check_access`` (its GET-based "no bucket" vs "no key" diagnosis), ``delete_many``, the
  conditional-write probe, and the HEAD-then-PUT fallback's shared switch.

Everything else - HEAD (a GET with ``head``, so user metadata comes back), conditional PUT,
ranged GET straight into the caller's buffers, LIST - is obstore. Each request runs under
the same :class:`~s3kv.store.retrying.RetryPolicy` as the boto3 store (object_store's own
retries are off), so there is one retry loop and one deadline per request, and errors map
onto the same :class:`~s3kv.store.base.StoreError` classes.

Endpoint, region, addressing style and credentials come from the boto3 store's resolution
(``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / profiles / roles ...), so both clients
always talk to the same place with the same identity. The payload is signed (SHA-256) over
plain HTTP, as botocore does; over HTTPS it is sent as UNSIGNED-PAYLOAD (TLS protects it, and
every page carries its own checksum). No flexible-checksum headers are sent
(``when_required``), which non-AWS servers often reject.

Why this is one module: one ``ObjectStore`` implementation; each method maps one store call onto
obstore, and its errors onto the store's.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures as cf
import contextlib
import ctypes
import datetime as dt
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ..core.cost import get_requests
from .base import (
    AnswerClock,
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
    StoreConfigError,
    StoreError,
    TransientError,
    as_buffers,
)
from .s3 import LIST_PAGE_SIZE, S3Options, S3Store, _ConditionalUnsupported, _is_aws_host

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Copies at least this large release the GIL (ctypes calls do), so a big GET landing in
#: staging does not stall the engine's Python threads for the length of a memcpy.
_GIL_FREE_COPY = 256 * 1024
#: Smaller waves stay in this process even with helpers: a few HEADs cost less Python than
#: the hand-off's two socket hops and the wake-ups around them.
_OFFLOAD_MIN_KEYS = 4
_STATUS_RE = re.compile(r"status code: (\d{3})|\b(\d{3}) (?:[A-Z][A-Za-z ]+):")


def _is_panic(exc: BaseException) -> bool:
    """A Rust panic inside obstore, as pyo3 raises it (``pyo3_runtime.PanicException``)."""
    return type(exc).__name__ == "PanicException" and type(exc).__module__ == "pyo3_runtime"


#: The most runtime threads ``TOKIO_WORKER_THREADS`` may ask for (far above any host's cores).
_MAX_TOKIO_THREADS = 4096


def _check_tokio_env() -> None:
    """obstore's Rust runtime reads ``TOKIO_WORKER_THREADS`` on the first request and panics on a
    value that is not a positive integer (an empty string included). Refuse it at start-up,
    naming it, instead of failing every request after the model has loaded."""
    raw = os.environ.get("TOKIO_WORKER_THREADS")
    if raw is None:
        return
    # What Rust's usize parser takes (no spaces, an optional "+"), not 0 (tokio refuses it), and
    # not absurdly many: 2**32 aborted the process, 10**7 hung the first request (measured).
    if not (re.fullmatch(r"\+?[0-9]+", raw) and 0 < int(raw) <= _MAX_TOKIO_THREADS):
        raise StoreConfigError(
            f"TOKIO_WORKER_THREADS={raw!r} is not a positive integer; obstore's runtime (the S3 client) "
            f"cannot start with it: unset it or give a thread count from 1 to {_MAX_TOKIO_THREADS}"
        )


def available() -> bool:
    """Whether obstore is importable (the ``auto`` client choice falls back to boto3 if not)."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


class _Credentials:
    """obstore credential provider over botocore's chain (refreshing roles included)."""

    def __init__(self, session: Any):
        self._creds = session.get_credentials()

    def __call__(self) -> dict[str, Any]:
        if self._creds is None:
            raise StoreConfigError("no AWS credentials found (AWS_ACCESS_KEY_ID / AWS_PROFILE / role)")
        frozen = self._creds.get_frozen_credentials()
        # botocore refreshes expiring credentials inside get_frozen_credentials; asking again
        # every few minutes picks a refresh up long before the old ones lapse.
        expires = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }


class _Abandoned(StoreError):
    """A part of a ranged read stopped because another part failed (never retried)."""


class _Closed(Exception):
    """The store was closed (internal: a HEAD wave then answers every key as failed)."""


def _fd_bounded(head_concurrency: int) -> int:
    """``head_concurrency``, or a quarter of the process's file-descriptor limit if that is less.

    Why: every HEAD in flight holds a socket, and the engine shares the process's descriptors;
    at a default ``ulimit -n`` of 1024, 512 sockets of ours could make the engine's own opens
    fail (EMFILE), which is worse than a wave taking two round trips."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return head_concurrency
    if soft == resource.RLIM_INFINITY or head_concurrency <= soft // 4:
        return head_concurrency
    width = max(1, soft // 4)
    log.warning(
        "s3kv: S3KV_LOOKUP_HEAD_CONCURRENCY=%d lowered to %d: the process may open only %d files "
        "(ulimit -n), and each HEAD in flight holds a socket; raise the limit to use more",
        head_concurrency, width, soft,
    )
    return width


def _status(exc: BaseException) -> int:
    m = _STATUS_RE.search(str(exc))
    if not m:
        return 0
    return int(m.group(1) or m.group(2))


def _copy_into(dst: memoryview, src: Any) -> None:
    """``dst[:] = src`` (same length), releasing the GIL for large copies."""
    n = dst.nbytes
    np = _numpy()
    if n < _GIL_FREE_COPY or dst.readonly or np is None:
        dst[:] = memoryview(src).cast("B")
        return

    d = np.frombuffer(dst, dtype=np.uint8)
    s = np.frombuffer(src, dtype=np.uint8)
    if s.nbytes != n:
        raise ValueError(f"copy of {s.nbytes} bytes into {n}")
    ctypes.memmove(d.ctypes.data, s.ctypes.data, n)


def _numpy() -> Any:
    """numpy, for buffer addresses (torch brings it in practice; without it copies hold the GIL)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class ObstoreS3Store(ObjectStore):
    """An :class:`ObjectStore` over one S3 bucket through obstore; same contract and options as
    :class:`~s3kv.store.s3.S3Store` (which it holds for multipart writes and start-up checks)."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        options: S3Options | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        session: Any = None,
        url: str | None = None,
    ):
        import obstore
        from obstore.store import S3Store as _ObS3

        _check_tokio_env()

        self._obs = obstore
        self._boto = S3Store(
            bucket,
            endpoint_url=endpoint_url,
            options=options,
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            session=session,
            url=url,
        )
        self.bucket = bucket
        self.options = opts = self._boto.options
        self.url = self._boto.url
        self.endpoint_url = self._boto.endpoint_url
        self.region = self._boto.region
        style = self._boto._client.meta.config.s3.get("addressing_style", "auto")
        on_aws = _is_aws_host(self.endpoint_url)
        https = self.endpoint_url.lower().startswith("https://")
        config: dict[str, Any] = {
            "endpoint": self.endpoint_url,
            "region": self.region,
            # AWS: virtual-hosted unless asked otherwise (path-style is deprecated there); any
            # other server: what the boto3 store resolved (path-style by default).
            "virtual_hosted_style_request": style == "virtual" or (on_aws and style != "path"),
            "unsigned_payload": https,
        }
        if opts.sse:
            config["server_side_encryption"] = opts.sse
        if opts.sse_kms_key_id:
            config["sse_kms_key_id"] = opts.sse_kms_key_id
        pool = opts.max_concurrency + opts.upload_concurrency + opts.extra_connections
        self._head_width = _fd_bounded(opts.head_concurrency)
        client_options = {
            "allow_http": not https,
            "connect_timeout": dt.timedelta(seconds=opts.connect_timeout_s),
            "read_timeout": dt.timedelta(seconds=opts.read_timeout_s),
            "pool_max_idle_per_host": str(max(pool, self._head_width)),
        }
        self._store = _ObS3(
            bucket,
            config=config,  # type: ignore[arg-type]
            client_options=client_options,  # type: ignore[arg-type]
            # Exactly one retry loop (ours), as in the boto3 store.
            retry_config={"max_retries": 0, "retry_timeout": dt.timedelta(seconds=opts.retry.deadline_s)},
            credential_provider=_Credentials(self._boto._session),  # type: ignore[arg-type]
        )
        # Ranged GET parts and LIST pages; HEAD waves run on the event loop below instead.
        self._pool = cf.ThreadPoolExecutor(max_workers=opts.max_concurrency, thread_name_prefix="s3kv-obs")
        self._closed = False
        self._lock = threading.Lock()
        #: The process that opened the store: obstore's runtime, the pool and the HEAD loop are
        #: threads, which a fork does not copy, so in a forked child every call would hang.
        self._pid = os.getpid()
        # HEAD waves: one event loop on its own thread (made on first use), with at most
        # ``head_concurrency`` HEADs in flight across all waves. Why not the thread pool: a
        # blocking HEAD holds a thread for a whole round trip, so a wave of n HEADs on t threads
        # costs ceil(n/t) round trips; a 128k-token Gemma-3 prompt's wave is ~344 HEADs. On the
        # loop the whole wave is in flight at once, with no thread per request (and it never
        # queues behind a load's ranged GETs on the pool).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._head_slots: asyncio.Semaphore | None = None
        # Or in helper processes (started on first use), so the engine's process spends next to
        # no CPU on a wave; see s3kv/store/headprocs.py.
        self._helpers: Any = None
        #: HEADs answered in this process (the helpers keep their own).
        self._answers = AnswerClock()
        if opts.head_processes > 0:
            from .headprocs import HeadHelpers, recipe_for

            try:
                self._helpers = HeadHelpers(recipe_for(self, opts.head_processes), opts.head_processes)
            except Exception as exc:  # an optimisation: never the reason a store cannot open
                log.warning("s3kv: HEAD waves stay in this process (no helper recipe: %s)", _short(exc))

    @property
    def head_helpers(self) -> Any:
        """The :class:`~s3kv.store.headprocs.HeadHelpers` running HEAD waves, or None (in-process)."""
        return self._helpers

    def answered_since(self, t: float) -> bool:
        helpers = self._helpers
        return self._answers.since(t) or (helpers is not None and helpers.answers.since(t))

    # -- request plumbing ----------------------------------------------------------------
    def _translate(self, exc: BaseException, op: str, key: str | None) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        ob = self._obs.exceptions
        where = f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"
        text = f"S3 {op} {where}: {type(exc).__name__}: {_short(exc)}"
        status = _status(exc)
        if "NoSuchBucket" in str(exc):
            return BucketNotFound(f"bucket {self.bucket!r} does not exist at {self.endpoint_url} (S3 {op}; check S3KV_URL)")
        if isinstance(exc, (FileNotFoundError, ob.NotFoundError)) or status == 404:
            return NotFound(text, key=key)
        if isinstance(exc, (ob.PermissionDeniedError, ob.UnauthenticatedError, PermissionError)) or status == 403:
            return PermissionDenied(text, key=key)
        if status == 416:
            return IntegrityError(f"S3 {op} {where}: range starts beyond the object's end", key=key)
        if status == 429 or status >= 500 and status != 501:
            return TransientError(text, key=key)
        if status == 0 and isinstance(exc, (ob.GenericError, OSError, TimeoutError, ConnectionError)):
            # No HTTP answer at all: refused, reset, timed out, body cut short. Worth a retry.
            return TransientError(text, key=key)
        return StoreError(text, key=key)

    @contextlib.contextmanager
    def _errors(self, op: str, key: str | None) -> Iterator[None]:
        """obstore's and builtin exceptions -> the store's (ours pass through)."""
        if os.getpid() != self._pid:
            raise self._forked(op, key)
        try:
            yield
        except (StoreError, _ConditionalUnsupported):
            raise
        except Exception as exc:  # noqa: BLE001 - obstore raises its own and builtin classes
            raise self._translate(exc, op, key) from exc
        except BaseException as exc:
            if not _is_panic(exc):
                raise  # KeyboardInterrupt, SystemExit, a cancelled task: not ours to turn into a miss
            # A failed request like any other (a miss, a failed load), not an exception that
            # would escape the connector: pyo3 raises Rust panics as a BaseException, past every
            # ``except Exception`` up to the engine's loop, which then dies.
            raise StoreError(f"S3 {op} s3://{self.bucket}/{key or ''}: the S3 client (obstore) panicked: {_short(exc)}",
                             key=key) from exc

    def _forked(self, op: str, key: str | None) -> LocalFailure:
        return LocalFailure(
            f"S3 {op} s3://{self.bucket}/{key or ''}: this store was opened by process {self._pid}; in a "
            f"process forked from it its client threads do not exist (every request would hang): a miss",
            key=key,
        )

    def _call(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        def attempt() -> T:
            with self._errors(op, key):
                return fn()

        return self.options.retry.call(attempt, op=f"S3 {op}", key=key)

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """``fn`` over ``items`` on the pool; returns or raises only once every call has ended.

        Not ``Executor.map``: on the first error it returns while other calls still run, and a
        ranged read's part could then copy into staging that a later load owns.
        """
        if len(items) <= 1:
            return [fn(i) for i in items]
        if os.getpid() != self._pid:  # the pool's threads are the parent's: nothing would run
            raise self._forked("get", None)
        futures = [self._pool.submit(fn, i) for i in items]
        cf.wait(futures)
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            # The root cause, not a part that stopped because of it.
            raise next((e for e in errors if not isinstance(e, _Abandoned)), errors[0])
        return [f.result() for f in futures]

    # -- HEAD ----------------------------------------------------------------------------
    # A GET with ``head``: one HEAD request whose answer keeps the user metadata (obstore's
    # head() returns only size / etag / mtime).
    _HEAD: Mapping[str, Any] = {"head": True}
    _WAVE_SLACK_S = 5.0

    @staticmethod
    def _info(key: str, r: Any) -> ObjectInfo:
        meta = r.meta
        md = {str(k).lower(): str(v) for k, v in r.attributes.items() if str(k).lower() not in _STANDARD_ATTRIBUTES}
        lm = meta.get("last_modified")
        return ObjectInfo(key, int(meta["size"]), md, lm.timestamp() if lm else None)

    def _head_one(self, key: str) -> ObjectInfo | None | StoreError:
        obs = self._obs

        def attempt() -> ObjectInfo | None:
            asked = time.monotonic()
            try:
                r = obs.get(self._store, key, options=self._HEAD)
            except FileNotFoundError:  # an answer: missing
                r = None
            self._answers.note(asked)
            return None if r is None else self._info(key, r)

        try:
            return self._call("head", key, attempt)
        except StoreError as exc:
            return exc

    async def _head_async(self, key: str, slots: asyncio.Semaphore) -> ObjectInfo | None | StoreError:
        """:meth:`_head_one` on the event loop: the same request, retries and deadline. A slot is
        held for each attempt only, not through the backoff between attempts."""
        obs = self._obs

        async def attempt() -> ObjectInfo | None:
            with self._errors("head", key):
                async with slots:
                    asked = time.monotonic()
                    try:
                        r = await obs.get_async(self._store, key, options=self._HEAD)
                    except FileNotFoundError:  # an answer: missing
                        r = None
                self._answers.note(asked)
                return None if r is None else self._info(key, r)

        try:
            return await self.options.retry.acall(attempt, op="S3 head", key=key)
        except StoreError as exc:
            return exc

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        return self._head_many(keys, None)

    def head_many_checked(self, keys: Sequence[str], expect: Mapping[str, SpanExpect]) -> HeadBatch:
        """Checked in the HEAD helpers where the wave goes to them; in this process (no gain
        here: the check would cost the engine's GIL either way) the caller checks."""
        return self._head_many(keys, expect)

    def _head_many(self, keys: Sequence[str], expect: Mapping[str, SpanExpect] | None) -> HeadBatch:
        unique = list(dict.fromkeys(keys))
        if len(unique) <= 1:
            return HeadBatch.from_outcomes(unique, [self._head_one(k) for k in unique])
        outcomes: list[ObjectInfo | None | StoreError]

        async def wave(slots: asyncio.Semaphore) -> list[ObjectInfo | None | StoreError]:
            return list(await asyncio.gather(*(self._head_async(k, slots) for k in unique)))

        # Every HEAD ends within the retry deadline plus one attempt's timeouts; waiting longer
        # would mean the loop is gone (closed under us), and no caller may hang on that.
        if os.getpid() != self._pid:  # the HEAD loop's thread is the parent's: the wave would never run
            return HeadBatch.from_outcomes(unique, [self._forked("head", k) for k in unique])
        opts = self.options
        limit = opts.retry.deadline_s + opts.connect_timeout_s + opts.read_timeout_s + self._WAVE_SLACK_S
        helpers = self._helpers
        if helpers is not None and len(unique) >= _OFFLOAD_MIN_KEYS and not self._closed:
            offloaded = helpers.head_many(unique, limit, expect)
            if offloaded is not None:
                return HeadBatch.from_outcomes(unique, offloaded)
        try:
            fut = self._submit(wave)
            outcomes = fut.result(timeout=limit)
        except (cf.CancelledError, _Closed):
            outcomes = [StoreError(f"S3 head s3://{self.bucket}: the store was closed")] * len(unique)
        except cf.TimeoutError:
            fut.cancel()
            outcomes = [DeadlineExceeded(f"S3 head wave gave up after {limit:g}s", key=k) for k in unique]
        # After TimeoutError, which is an OSError: no thread or descriptor for the HEAD loop is a miss.
        except (OSError, RuntimeError) as exc:
            outcomes = [LocalFailure(f"S3 head s3://{self.bucket}: could not start the HEAD loop: {exc}", key=k)
                        for k in unique]
        return HeadBatch.from_outcomes(unique, outcomes)

    def _submit(self, wave: Callable[[asyncio.Semaphore], Any]) -> cf.Future:
        """Start ``wave(slots)`` on the HEAD loop (made on first use). Under the lock, so a
        ``close`` cannot slip between the closed check and the submission: what was submitted
        is then cancelled by ``_stop_loop``, never left waiting on a stopped loop."""
        with self._lock:
            if self._closed:
                raise _Closed
            if self._loop is None or self._head_slots is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="s3kv-obs-heads", daemon=True)
                try:
                    thread.start()
                except BaseException:
                    loop.close()  # not one leaked loop (and its descriptors) per failed attempt
                    raise
                self._loop, self._loop_thread = loop, thread
                self._head_slots = asyncio.Semaphore(self._head_width)
            return asyncio.run_coroutine_threadsafe(wave(self._head_slots), self._loop)

    def _stop_loop(self) -> None:
        """Cancel what runs on the HEAD loop (a waiting ``head_many`` then answers "closed",
        never hangs), then stop the loop and its thread."""
        loop, thread = self._loop, self._loop_thread
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5.0)
        if not thread.is_alive():
            loop.close()

    # -- PUT -----------------------------------------------------------------------------
    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        """Write once; same contract as :meth:`S3Store.put`."""
        views = [v for v in as_buffers(data) if v.nbytes]
        size = sum(v.nbytes for v in views)
        if size >= self.options.multipart_threshold:
            return self._boto.put(key, views, metadata)
        meta = {str(k).lower(): str(v) for k, v in (metadata or {}).items()}
        try:
            return self._put_single(key, views, meta)
        except _ConditionalUnsupported:
            self._boto._disable_conditional()
            return self._put_single(key, views, meta)

    def _put_single(self, key: str, views: list[memoryview], meta: dict[str, str]) -> bool:
        obs = self._obs
        # A list of views goes to object_store as a multi-chunk payload: staging pages are
        # signed and sent as they lie, never joined into one copy here.
        body: Any = views[0] if len(views) == 1 else (views or b"")

        if not self._boto._conditional:
            # Same documented race as S3Store's fallback: both bodies are valid KV for the key.
            outcome = self._head_one(key)
            if isinstance(outcome, StoreError):
                raise outcome
            if outcome is not None:
                return False
            self._call("put", key, lambda: obs.put(self._store, key, body, attributes=meta, use_multipart=False))
            return True
        if sum(v.nbytes for v in views) >= self.options.head_before_put_bytes and isinstance(
            self._head_one(key), ObjectInfo
        ):
            return False  # S3Options.head_before_put_bytes says why; a failed HEAD: the PUT decides

        def attempt() -> bool:
            try:
                obs.put(self._store, key, body, mode="create", attributes=meta, use_multipart=False)
                return True
            except (obs.exceptions.AlreadyExistsError, obs.exceptions.PreconditionError):
                # 412: the key exists (another writer, or our earlier attempt whose answer was
                # lost). The object is whole; success, never an overwrite.
                return False
            except obs.exceptions.NotSupportedError as exc:
                if self.options.conditional_put == "auto":
                    raise _ConditionalUnsupported() from exc
                raise
            except obs.exceptions.GenericError as exc:
                if _status(exc) == 501 and self.options.conditional_put == "auto":
                    raise _ConditionalUnsupported() from exc
                raise

        return self._call("put", key, attempt)

    # -- GET -----------------------------------------------------------------------------
    def _jobs(self, ranges: Sequence[ByteRange]) -> list[tuple[int, int, int, int]]:
        """(range index, offset within the range, absolute offset, length) of every request."""
        split = self.options.range_split_bytes
        jobs = []
        for i, r in enumerate(ranges):
            if r.length == 0:
                continue
            parts = get_requests(r.length, split, r.parts)
            step = max(1, -(-r.length // parts))
            jobs += [(i, off, r.offset + off, min(step, r.length - off)) for off in range(0, r.length, step)]
        return jobs

    def _get_part(self, key: str, offset: int, length: int, dst: memoryview, abandon: threading.Event) -> str:
        obs = self._obs

        def attempt() -> str:
            if abandon.is_set():
                raise _Abandoned("another part of this read failed", key=key)
            asked = time.monotonic()
            r = obs.get(self._store, key, options={"range": (offset, offset + length)})
            self._answers.note(asked)  # the response head arrived: alive, however long the body
            data = r.bytes()
            got = len(data)
            if got != length:
                raise IntegrityError(
                    f"range {offset}+{length} returned {got} bytes: object shorter than expected", key=key
                )
            if abandon.is_set():
                # The caller is about to hand ``dst`` back (a failed load frees its staging,
                # and the next load may reuse it): never write into it now.
                raise _Abandoned("another part of this read failed", key=key)
            _copy_into(dst, data)
            return str(r.meta.get("e_tag") or "")

        return self._call("get", key, attempt)

    def get_ranges_into(self, key: str, ranges: Sequence[ByteRange], out: Sequence[memoryview]) -> None:
        """Each range straight into ``out[i]``: sub-ranges in parallel, one host copy each.

        Returns or raises only once no part will write into ``out`` any more: a part that
        failed stops the others before their copy, and the call waits for every part.
        """
        if len(out) != len(ranges):
            raise ValueError(f"{len(ranges)} ranges but {len(out)} buffers")
        dsts = [memoryview(o).cast("B") for o in out]
        for r, d in zip(ranges, dsts, strict=True):
            if d.nbytes != r.length:
                raise ValueError(f"buffer of {d.nbytes} bytes for range {r.offset}+{r.length}")
        jobs = self._jobs(ranges)
        abandon = threading.Event()

        def part(j: tuple[int, int, int, int]) -> str:
            try:
                return self._get_part(key, j[2], j[3], dsts[j[0]][j[1] : j[1] + j[3]], abandon)
            except BaseException:
                abandon.set()
                raise

        for _ in range(2):
            etags = self._map(part, jobs)
            if len({e for e in etags if e}) <= 1:
                return
            # Replaced between our reads (s3.py's get_ranges says how): read it all again, once.
        raise ObjectChanged(f"object changed during a ranged read, twice (ETags {sorted(set(etags))})", key=key)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        bufs = [bytearray(r.length) for r in ranges]
        self.get_ranges_into(key, ranges, [memoryview(b) for b in bufs])
        return [bytes(b) for b in bufs]

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        # One small request every few seconds, off the lookup path: boto3's client does it (a
        # 304 is an answer there, where object_store raises it as an error of its own).
        return self._boto.get_if_changed(key, etag)

    def store_time(self) -> float:
        return self._boto.store_time()  # object_store shows no response headers

    def touch(self, key: str, min_age_s: float = 0.0) -> str:
        # object_store's copy sends no metadata directive, which S3 refuses for a self-copy.
        return self._boto.touch(key, min_age_s)

    # -- DELETE / LIST -------------------------------------------------------------------
    def delete_many(self, keys: Sequence[str]) -> None:
        self._boto.delete_many(keys)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            # object_store lists directories (it appends "/"); S3's string-prefix match for a
            # prefix that ends mid-name (operators' tools only) stays on boto3.
            yield from self._boto.list(prefix)
            return
        # Page by page, each page one retried request that resumes after the last key seen
        # (ListObjectsV2 start-after), so a fault mid-listing repeats one page, never a key.
        last: str | None = None
        while True:
            page: Sequence[ObjectInfo] = self._call("list", prefix, functools.partial(self._list_page, prefix, last))
            yield from page
            if len(page) < LIST_PAGE_SIZE:
                return
            last = page[-1].key

    def _list_page(self, prefix: str, after: str | None) -> Sequence[ObjectInfo]:
        stream = self._obs.list(
            self._store, prefix=prefix.rstrip("/") or None, offset=after, chunk_size=LIST_PAGE_SIZE
        )
        batch: Any = next(iter(stream), [])
        out: builtins.list[ObjectInfo] = []
        for m in batch:
            path = str(m["path"])
            if path.startswith(prefix):
                lm = m.get("last_modified")
                out.append(ObjectInfo(path, int(m["size"]), {}, lm.timestamp() if lm else None))
        return out

    # -- start-up ------------------------------------------------------------------------
    def check_access(self) -> None:
        self._boto.check_access()

    def probe_conditional_put(self) -> bool:
        return self._boto.probe_conditional_put()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._helpers is not None:
            self._helpers.close()
        self._stop_loop()
        self._pool.shutdown(wait=True)
        self._boto.close()

    def __repr__(self) -> str:
        return f"ObstoreS3Store({self.url!r}, endpoint={self.endpoint_url!r})"


#: Response headers obstore reports as attributes that are not user metadata.
_STANDARD_ATTRIBUTES = frozenset(
    {"content-type", "content-encoding", "content-disposition", "content-language", "cache-control", "storage-class"}
)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."
