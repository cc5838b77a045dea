"""S3 (and S3-compatible) object store on boto3's classic transfer path.

Why not ``boto3.s3.transfer`` / awscrt: write-once needs ``If-None-Match`` on the final
CompleteMultipartUpload, an abort on every failure path, and parts cut from the caller's
buffers; the transfer manager hides those steps behind its own threads and retry loop (and
awscrt is a heavy native dependency). Here every request is one botocore call wrapped in one
:class:`RetryPolicy` (botocore retries are off), so a request has exactly one deadline and
one place that decides what is transient.

Behaviour of the loopback servers the tests run against (checked with moto 5.2.5 and
SeaweedFS 4.48 ``weed mini``):

* both honour ``If-None-Match: *`` on PutObject and on CompleteMultipartUpload (412
  PreconditionFailed; after a 412 on completion the upload stays open and must be aborted);
* SeaweedFS enforces it atomically; moto checks and then stores without a lock, so two
  *truly concurrent* writers can both get 200 (each body is still stored whole - the race
  tests allow that for moto only);
* both serve ``Range: bytes=a-b`` with 206 and clamp a range that runs past the end (so
  every length is checked here), and answer a range that starts past the end with 416;
* both answer a HEAD on a missing bucket with a bare 404 - a HEAD cannot tell "no bucket"
  from "no key", which is why :meth:`S3Store.check_access` probes with a GET, whose error
  body says NoSuchBucket or NoSuchKey;
* SeaweedFS enforces SigV4 against the keys it was started with (403 InvalidAccessKeyId
  otherwise); moto accepts any keys.

Why this is one module: one ``ObjectStore`` implementation on boto3, with the multipart and
write-once protocol its methods share.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from ..config import has_userinfo, redact_url
from ..core.cost import get_requests
from .base import (
    TOUCH_GONE,
    TOUCH_REFRESHED,
    TOUCH_YOUNG,
    AnswerClock,
    BucketNotFound,
    Buffer,
    ByteRange,
    DeadlineExceeded,
    Fetched,
    HeadBatch,
    IntegrityError,
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectStore,
    PermissionDenied,
    StoreConfigError,
    StoreError,
    TransientError,
    as_buffers,
)
from .retrying import RetryPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024
#: S3's floor for every part but the last.
MIN_PART_SIZE = 5 * MiB
#: S3's ceiling on the number of parts of one upload.
MAX_PARTS = 10_000
#: DeleteObjects takes at most this many keys per request.
DELETE_BATCH = 1000
#: Keys per ListObjectsV2 page (S3's maximum).
LIST_PAGE_SIZE = 1000

# Error codes worth a retry. 503 SlowDown is S3's throttle; the others are what various
# S3-compatible servers and proxies send for "busy, try again".
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AccountProblem",
    }
)
# Botocore transport failures: the request may or may not have reached the server.
_TRANSIENT_BOTOCORE = (
    bexc.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError
    bexc.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    bexc.IncompleteReadError,
)
# Transport failures that mean "nobody answered at that address" (for check_access).
_UNREACHABLE_BOTOCORE = (bexc.EndpointConnectionError, bexc.ConnectTimeoutError, bexc.ProxyConnectionError)


@dataclass(frozen=True)
class S3Options:
    """Tuning and policy of :class:`S3Store`. Every size is in bytes."""

    #: Threads for HEAD / GET fan-out (lookups and loads, latency-critical).
    max_concurrency: int = 32
    #: Threads for UploadPart fan-out, a separate pool so a big background save never
    #: queues lookups and loads behind its parts.
    upload_concurrency: int = 8
    #: The HTTP connection pool holds both pools' threads plus this many, so no pool thread
    #: waits for a socket while callers' own threads (single PUTs, one-range GETs run inline)
    #: still get one.
    extra_connections: int = 8
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    #: One policy per request; see :class:`RetryPolicy`.
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: Bodies at least this large go up as multipart (parts in parallel). The defaults are the
    #: settings' (S3KV_MULTIPART_*, S3KV_RANGE_SPLIT_MIB; why: s3kv/config.py).
    multipart_threshold: int = 1024 * MiB
    part_size: int = 128 * MiB
    #: A range much longer than this is fetched as parallel sub-ranges of about this size.
    range_split_bytes: int = 16 * MiB
    #: A single PUT at least this large HEADs first: another cluster usually stored the same
    #: prefix, and a HEAD costs far less than uploading hundreds of MiB a 412 throws away (a
    #: multipart upload always HEADs first). If-None-Match still settles a race.
    head_before_put_bytes: int = 64 * MiB
    #: Server-side encryption: None (bucket default), "AES256" (SSE-S3) or "aws:kms".
    sse: Literal["AES256", "aws:kms"] | None = None
    sse_kms_key_id: str | None = None
    #: "auto": send If-None-Match and fall back to HEAD-then-PUT if the server answers 501;
    #: "always": never fall back; "never": HEAD-then-PUT only (servers that mishandle it).
    conditional_put: Literal["auto", "always", "never"] = "auto"
    #: None: path-style for any non-AWS endpoint (loopback and most S3-compatible servers
    #: have no wildcard DNS), botocore's default on AWS.
    addressing_style: Literal["auto", "virtual", "path"] | None = None
    #: None: the boto3 chain (AWS_REGION / AWS_DEFAULT_REGION / profile), else us-east-1.
    region: str | None = None
    #: Which client ``open_store`` builds for s3:// (S3KV_S3_CLIENT): "auto" (obstore when it is
    #: installed, else boto3), "obstore" or "boto3". See s3kv/store/obstore_store.py for why.
    client: Literal["auto", "obstore", "boto3"] = "auto"
    #: HEADs in flight at once on the obstore client, over all batches (they run on one event
    #: loop and hold no GIL, so a lookup's wave goes out in one round trip); the boto3 store fans
    #: out over max_concurrency threads.
    head_concurrency: int = 512
    #: Helper processes that run the obstore client's HEAD waves (s3kv/store/headprocs.py says
    #: why): 0 = in this process.
    head_processes: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.upload_concurrency < 1:
            raise ValueError(
                f"S3Options.max_concurrency and upload_concurrency must be >= 1, got "
                f"{self.max_concurrency} and {self.upload_concurrency}"
            )
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(
                f"S3Options.part_size must be >= 5 MiB (S3's minimum part), got {self.part_size}"
            )
        if self.multipart_threshold < MIN_PART_SIZE:
            raise ValueError(
                f"S3Options.multipart_threshold must be >= 5 MiB, got {self.multipart_threshold}"
            )
        if self.client not in ("auto", "obstore", "boto3"):
            raise ValueError(f"S3Options.client must be auto|obstore|boto3, got {self.client!r}")
        if self.head_concurrency < 1:
            raise ValueError(f"S3Options.head_concurrency must be >= 1, got {self.head_concurrency}")
        if self.head_processes < 0:
            raise ValueError(f"S3Options.head_processes must be >= 0, got {self.head_processes}")
        if self.range_split_bytes < 1:
            raise ValueError(f"S3Options.range_split_bytes must be >= 1, got {self.range_split_bytes}")
        if self.sse not in (None, "AES256", "aws:kms"):
            raise ValueError(f"S3Options.sse must be None, 'AES256' or 'aws:kms', got {self.sse!r}")
        if self.sse_kms_key_id and self.sse != "aws:kms":
            raise ValueError("S3Options.sse_kms_key_id needs sse='aws:kms'")
        if self.conditional_put not in ("auto", "always", "never"):
            raise ValueError(
                f"S3Options.conditional_put must be auto|always|never, got {self.conditional_put!r}"
            )


class _ConditionalUnsupported(Exception):
    """Internal: the server rejected If-None-Match as not implemented."""


class _BufferReader(io.RawIOBase):
    """A seekable, read-only file over several byte views, so a body made of many buffers
    (pages of one chunk, or the slice of them that is one part) is streamed without first
    being joined into one big copy. Seekable because SigV4 over plain HTTP hashes the body
    and rewinds it before sending."""

    def __init__(self, views: Sequence[memoryview]):
        super().__init__()
        self._views = [v for v in views if v.nbytes]
        self._starts = []
        pos = 0
        for v in self._views:
            self._starts.append(pos)
            pos += v.nbytes
        self._size = pos
        self._pos = 0
        self._idx = 0  # index of the view holding _pos (a hint; reset by seek)

    def __len__(self) -> int:
        return self._size - self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + offset, 0), self._size)
        self._idx = 0
        while self._idx < len(self._views) - 1 and self._starts[self._idx + 1] <= self._pos:
            self._idx += 1
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < out.nbytes and self._pos < self._size:
            v, start = self._views[self._idx], self._starts[self._idx]
            within = self._pos - start
            take = min(v.nbytes - within, out.nbytes - n)
            out[n : n + take] = v[within : within + take]
            n += take
            self._pos += take
            if self._pos - start == v.nbytes and self._idx < len(self._views) - 1:
                self._idx += 1
        return n

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        buf = bytearray(min(size, self._size - self._pos))
        n = self.readinto(buf)
        return bytes(buf[:n])


def _slice_views(views: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The views covering ``[offset, offset+length)`` of the concatenation, without copying."""
    out: list[memoryview] = []
    pos = 0
    end = offset + length
    for v in views:
        v_end = pos + v.nbytes
        if v_end > offset and pos < end:
            out.append(v[max(offset - pos, 0) : min(end, v_end) - pos])
        pos = v_end
        if pos >= end:
            break
    return out


def _body(views: Sequence[memoryview]) -> bytes | _BufferReader:
    # A single whole ``bytes`` object is handed over as is (botocore sends it without copies).
    if len(views) == 1 and isinstance(views[0].obj, bytes) and views[0].nbytes == len(views[0].obj):
        return views[0].obj
    if not views:
        return b""
    return _BufferReader(views)


def http_date(value: str, where: str) -> float:
    """An HTTP ``Date`` header (whole seconds) as POSIX seconds, the middle of its second."""
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value).timestamp() + 0.5
    except (TypeError, ValueError, IndexError) as exc:
        raise StoreError(f"{where}: the store's answer carries no usable Date header ({value!r})") from exc


def _is_aws_host(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")


def _error_code(exc: bexc.ClientError) -> tuple[str, int]:
    err = exc.response.get("Error", {})
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return str(err.get("Code", "")), status


def _is_precondition_failed(exc: bexc.ClientError) -> bool:
    code, status = _error_code(exc)
    return status == 412 or code == "PreconditionFailed"


def _is_not_implemented(exc: bexc.ClientError) -> bool:
    code, status = _error_code(exc)
    return status == 501 or code == "NotImplemented"


class S3Store(ObjectStore):
    """An :class:`ObjectStore` over one S3 bucket. Keys are full object keys.

    Credentials, endpoint and region come from boto3's own chain unless given here
    (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ..., profiles,
    instance roles). Thread-safe; one instance per process is the intended use.
    """

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        options: S3Options | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        session: boto3.session.Session | None = None,
        url: str | None = None,
    ):
        if not bucket:
            raise StoreConfigError("S3Store needs a bucket name (set S3KV_URL=s3://bucket/prefix)")
        self.bucket = bucket
        self.options = opts = options or S3Options()
        self.url = url or f"s3://{bucket}"
        self._explicit_endpoint = endpoint_url
        self._session = session or boto3.session.Session(
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
        )
        self.region = opts.region or self._session.region_name or "us-east-1"
        style = opts.addressing_style
        if style is None:
            guess = (
                endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            )
            style = "path" if guess and not _is_aws_host(guess) else "auto"
        self._client = self._make_client(style)
        if opts.addressing_style is None and style != "path" and not self._is_aws_endpoint():
            # The endpoint came from somewhere we did not look (the AWS config file): rebuild.
            self._client.close()
            self._client = self._make_client("path")
        self.endpoint_url: str = self._client.meta.endpoint_url
        if has_userinfo(self.endpoint_url):
            # Refused, not just hidden: the endpoint is printed in start-up errors and in the
            # client's own messages, which reach the engine's log handlers unredacted.
            self._client.close()
            raise StoreConfigError(
                f"the S3 endpoint {redact_url(self.endpoint_url)!r} (set by {self._endpoint_source()}) holds "
                "credentials: not accepted; use the credential chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, roles)"
            )
        self._pool = cf.ThreadPoolExecutor(max_workers=opts.max_concurrency, thread_name_prefix="s3kv-s3")
        self._upload_pool = cf.ThreadPoolExecutor(
            max_workers=opts.upload_concurrency, thread_name_prefix="s3kv-s3-up"
        )
        self._conditional = opts.conditional_put != "never"
        self._closed = False
        self._lock = threading.Lock()
        self._answers = AnswerClock()  # HEADs and reads answered (``answered_since``)

    # -- set-up ------------------------------------------------------------------------
    def _make_client(self, addressing_style: str) -> Any:
        opts = self.options
        config = Config(
            connect_timeout=opts.connect_timeout_s,
            read_timeout=opts.read_timeout_s,
            # Exactly one retry loop (ours): botocore's would multiply attempts and blow the deadline.
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=opts.max_concurrency + opts.upload_concurrency + opts.extra_connections,
            # Non-AWS servers often reject or mangle the default flexible checksums (CRC trailers).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": addressing_style},  # type: ignore[typeddict-item,arg-type]  # a Literal in the stubs
            tcp_keepalive=True,
        )
        return self._session.client(
            "s3", endpoint_url=self._explicit_endpoint, region_name=self.region, config=config
        )

    def _is_aws_endpoint(self) -> bool:
        return _is_aws_host(self._client.meta.endpoint_url)

    def _endpoint_source(self) -> str:
        """Which setting chose the endpoint, for error messages."""
        if self._explicit_endpoint:
            return "the endpoint_url argument"
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(var):
                return f"${var}"
        if not self._is_aws_endpoint():
            return "the AWS config file (endpoint_url)"
        return f"the AWS default for region {self.region} (override with AWS_ENDPOINT_URL_S3)"

    def _sse_args(self) -> dict[str, str]:
        args: dict[str, str] = {}
        if self.options.sse:
            args["ServerSideEncryption"] = self.options.sse
        if self.options.sse_kms_key_id:
            args["SSEKMSKeyId"] = self.options.sse_kms_key_id
        return args

    # -- request plumbing --------------------------------------------------------------
    def _translate(self, exc: BaseException, op: str, key: str | None) -> StoreError:
        """Map a boto/transport exception onto the store's error classes."""
        where = f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"
        if isinstance(exc, bexc.ClientError):
            code, status = _error_code(exc)
            msg = exc.response.get("Error", {}).get("Message", "") or str(exc)
            text = f"S3 {op} {where}: {code or status} {msg} (HTTP {status})"
            if code == "NoSuchBucket":
                return BucketNotFound(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint_url} (S3 {op}; check S3KV_URL)"
                )
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                return NotFound(text, key=key)
            if code in _DENIED_CODES or status == 403:
                return PermissionDenied(text, key=key)
            if code in _THROTTLE_CODES or status == 429 or status >= 500:
                return TransientError(text, key=key)
            return StoreError(text, key=key)
        if isinstance(exc, _TRANSIENT_BOTOCORE):
            return TransientError(f"S3 {op} {where}: {type(exc).__name__}: {exc}", key=key)
        if isinstance(exc, (ConnectionError, TimeoutError)):  # raw socket resets that escaped botocore
            return TransientError(f"S3 {op} {where}: {type(exc).__name__}: {exc}", key=key)
        return StoreError(f"S3 {op} {where}: {type(exc).__name__}: {exc}", key=key)

    def _call(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        """One request under the retry policy; boto errors come out as StoreErrors."""

        def attempt() -> T:
            try:
                return fn()
            except (bexc.BotoCoreError, bexc.ClientError, OSError) as exc:  # OSError: SSL, raw sockets
                raise self._translate(exc, op, key) from exc
            except (KeyError, ValueError) as exc:
                # A response whose head was cut off by a closed connection parses as a
                # complete 200 without its fields (http.client only warns), missing
                # fields or half a header value: a transport fault like a reset, so retry it.
                raise TransientError(f"S3 {op}: malformed response, missing {exc}", key=key) from exc

        return self.options.retry.call(attempt, op=f"S3 {op}", key=key)

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``fn`` over ``items`` on the pool; a single item runs inline (no thread hop)."""
        if len(items) <= 1:
            return [fn(i) for i in items]
        return list(self._pool.map(fn, items))

    # -- HEAD --------------------------------------------------------------------------
    def _head_raw(self, key: str) -> dict[str, Any] | None:
        """One HEAD's response, None for a 404."""
        try:
            return dict(self._client.head_object(Bucket=self.bucket, Key=key))
        except bexc.ClientError as exc:
            # A HEAD error has no body, so the code is the bare status. A 404 is an answer; note
            # that a missing bucket also reads as 404 here (check_access tells them apart at start-up).
            if _error_code(exc)[1] != 404:
                raise
            return None

    def _head_one(self, key: str) -> ObjectInfo | None | StoreError:
        def attempt() -> ObjectInfo | None:
            asked = time.monotonic()
            r = self._head_raw(key)
            self._answers.note(asked)
            if r is None:
                return None
            meta = {k.lower(): v for k, v in (r.get("Metadata") or {}).items()}
            lm = r.get("LastModified")
            return ObjectInfo(key, int(r["ContentLength"]), meta, lm.timestamp() if lm else None)

        try:
            return self._call("head", key, attempt)
        except StoreError as exc:
            return exc

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        unique = list(dict.fromkeys(keys))
        return HeadBatch.from_outcomes(unique, self._map(self._head_one, unique))

    def answered_since(self, t: float) -> bool:
        return self._answers.since(t)

    # -- PUT ---------------------------------------------------------------------------
    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        """Write once. True: this call's request created the object. False: it exists - another
        writer's, or ours from an earlier attempt whose answer was lost (a retried 412)."""
        views = [v for v in as_buffers(data) if v.nbytes]
        size = sum(v.nbytes for v in views)
        # S3 lowercases user-metadata names; do it here so what HEAD returns equals what we sent.
        meta = {str(k).lower(): str(v) for k, v in (metadata or {}).items()}
        try:
            if size >= self.options.multipart_threshold:
                return self._put_multipart(key, views, size, meta)
            return self._put_single(key, views, meta)
        except _ConditionalUnsupported:
            self._disable_conditional()
            return self.put(key, data, metadata)

    def _disable_conditional(self) -> None:
        if self.options.conditional_put == "always":
            raise StoreConfigError(
                f"{self.endpoint_url} does not support conditional writes (If-None-Match) and "
                "S3Options.conditional_put='always'"
            )
        with self._lock:
            if self._conditional:
                log.warning(
                    "%s rejected If-None-Match as not implemented; falling back to HEAD-then-PUT "
                    "(two writers racing on one key may both write; see S3Store._put_single)",
                    self.endpoint_url,
                )
            self._conditional = False

    def _exists(self, key: str) -> bool:
        outcome = self._head_one(key)
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome is not None

    def _put_single(self, key: str, views: list[memoryview], meta: dict[str, str]) -> bool:
        args = dict(Bucket=self.bucket, Key=key, Metadata=meta, **self._sse_args())
        if not self._conditional:
            # Fallback without If-None-Match. RACE: two writers can both see "missing" and both
            # PUT; S3 keeps the last whole body (a PUT is atomic, never a mix). s3kv tolerates
            # that because a key names the exact token prefix, group and shard, so both bodies
            # are valid KV for it; it only costs a duplicate upload. Never a torn object.
            if self._exists(key):
                return False
            self._call("put", key, lambda: self._client.put_object(Body=_body(views), **args))
            return True

        if sum(v.nbytes for v in views) >= self.options.head_before_put_bytes and isinstance(
            self._head_one(key), ObjectInfo
        ):
            return False  # (a failed HEAD: the conditional PUT decides)

        def attempt() -> bool:
            try:
                # A fresh body per attempt: a failed attempt may have consumed the stream.
                self._client.put_object(Body=_body(views), IfNoneMatch="*", **args)
                return True
            except bexc.ClientError as exc:
                # 412 means the key exists: another writer won, or an earlier attempt of ours
                # landed but its answer was lost. Either way the object is whole and ours to
                # skip - success, never an overwrite.
                if _is_precondition_failed(exc):
                    return False
                if self.options.conditional_put == "auto" and _is_not_implemented(exc):
                    raise _ConditionalUnsupported() from exc
                raise

        return self._call("put", key, attempt)

    def _put_multipart(self, key: str, views: list[memoryview], size: int, meta: dict[str, str]) -> bool:
        # Stay under S3's 10,000-part limit for huge bodies by growing the part size.
        part_size = max(self.options.part_size, math.ceil(size / MAX_PARTS))
        parts = [(n + 1, off, min(part_size, size - off)) for n, off in enumerate(range(0, size, part_size))]
        conditional = self._conditional
        # One HEAD first: it costs far less than uploading megabytes that a 412 would throw
        # away (another cluster usually saved the same prefix). The conditional completion
        # still settles a race; without it (fallback) this check is all there is - same race
        # as in _put_single.
        existing = self._head_one(key)
        if isinstance(existing, ObjectInfo):
            return False
        if isinstance(existing, StoreError) and not conditional:
            raise existing
        upload_id: str = self._call(
            "create_multipart_upload",
            key,
            lambda: self._client.create_multipart_upload(
                Bucket=self.bucket, Key=key, Metadata=meta, **self._sse_args()
            )["UploadId"],
        )
        done = False
        try:
            etags = self._upload_parts(key, upload_id, views, parts)
            created = self._complete(key, upload_id, etags, conditional)
            done = created
            return created
        finally:
            # Whatever went wrong (a part, the completion, a 412, an interrupt), abort so no
            # upload is left holding storage; a completed upload has nothing to abort.
            if not done:
                self._abort(key, upload_id)

    def _upload_parts(
        self, key: str, upload_id: str, views: list[memoryview], parts: list[tuple[int, int, int]]
    ) -> list[dict[str, Any]]:
        def one(part: tuple[int, int, int]) -> dict[str, Any]:
            number, offset, length = part
            piece = _slice_views(views, offset, length)
            r = self._call(
                f"upload_part {number}/{len(parts)}",
                key,
                lambda: self._client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=_body(piece),
                    ContentLength=length,
                ),
            )
            return {"PartNumber": number, "ETag": r["ETag"]}

        futures = [self._upload_pool.submit(one, p) for p in parts]
        finished, pending = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        if any(f.exception() is not None for f in finished):
            # Stop queued parts and let running ones end before the caller aborts, so no
            # part lands after the abort and resurrects a stray upload.
            for f in pending:
                f.cancel()
            cf.wait(pending)
            for f in futures:
                if not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]

    def _complete(self, key: str, upload_id: str, etags: list[dict[str, Any]], conditional: bool) -> bool:
        attempts = 0

        def attempt() -> bool:
            nonlocal attempts
            attempts += 1
            extra = {"IfNoneMatch": "*"} if conditional else {}
            try:
                self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": etags},
                    **extra,
                )
                return True
            except bexc.ClientError as exc:
                if _is_precondition_failed(exc):
                    return False  # someone else's object is there; the caller aborts ours
                code, _ = _error_code(exc)
                if code == "NoSuchUpload" and attempts > 1 and self._exists(key):
                    # Most likely an earlier attempt completed the upload and its answer was
                    # lost. The object is there and whole; as with a retried 412 we cannot
                    # prove it is ours, so report "already existed" (False), never an error.
                    return False
                if conditional and self.options.conditional_put == "auto" and _is_not_implemented(exc):
                    raise _ConditionalUnsupported() from exc
                raise

        return self._call("complete_multipart_upload", key, attempt)

    def _abort(self, key: str, upload_id: str) -> None:
        def attempt() -> None:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except bexc.ClientError as exc:
                if _error_code(exc)[0] != "NoSuchUpload":
                    raise

        try:
            self._call("abort_multipart_upload", key, attempt)
        except StoreError as exc:
            # The bucket's AbortIncompleteMultipartUpload lifecycle rule reclaims it eventually.
            log.warning("could not abort multipart upload %s of %s: %s", upload_id, key, exc)

    # -- GET ---------------------------------------------------------------------------
    def _get_one(self, key: str, offset: int, length: int) -> tuple[bytes, str]:
        def attempt() -> tuple[bytes, str]:
            asked = time.monotonic()
            try:
                r = self._client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
                )
                self._answers.note(asked)  # the response head arrived: alive, however long the body
            except bexc.ClientError as exc:
                if _error_code(exc)[0] == "InvalidRange":
                    raise IntegrityError(
                        f"range {offset}+{length} starts beyond the object's end", key=key
                    ) from exc
                raise
            if "ContentLength" not in r or "ETag" not in r:
                raise KeyError("ContentLength/ETag")  # truncated response head: retried by _call
            # Reading the body inside the attempt: a reset mid-body is retried like any other.
            data = r["Body"].read()
            status = r.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 200 and not r.get("ContentRange"):
                # A server that ignores Range sends the whole object; take our slice of it.
                data = data[offset : offset + length]
            if len(data) != length:
                raise IntegrityError(
                    f"range {offset}+{length} returned {len(data)} bytes "
                    f"(Content-Range {r.get('ContentRange')!r}): object shorter than expected",
                    key=key,
                )
            return data, str(r.get("ETag", ""))

        return self._call("get", key, attempt)

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        def attempt() -> Fetched | None:
            args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
            if etag:
                args["IfNoneMatch"] = etag
            try:
                r = self._client.get_object(**args)
            except bexc.ClientError as exc:
                if _error_code(exc)[1] == 304:  # botocore raises a 304 as an error: not modified
                    return None
                raise
            if "ETag" not in r or "ContentLength" not in r:
                raise KeyError("ContentLength/ETag")  # truncated response head: retried by _call
            data = r["Body"].read()
            if len(data) != int(r["ContentLength"]):
                raise IntegrityError(f"GET returned {len(data)} of {r['ContentLength']} bytes", key=key)
            return Fetched(data, str(r["ETag"]))

        return self._call("get", key, attempt)

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        split = self.options.range_split_bytes
        # (range index, absolute offset, length) of every request; a long range becomes
        # several so one object's bytes come down over several connections at once. Parts
        # are equal, about ``split`` long: a whole object is its pages plus a small header,
        # and a fixed-size split would fetch that header's worth in a request of its own.
        jobs = []
        for i, r in enumerate(ranges):
            parts = get_requests(r.length, split, r.parts)
            step = max(1, -(-r.length // parts))
            jobs += [(i, r.offset + off, min(step, r.length - off)) for off in range(0, r.length, step)]
        for _ in range(2):
            results = self._map(lambda j: self._get_one(key, j[1], j[2]), jobs)
            etags = {etag for _, etag in results if etag}
            if len(etags) <= 1:
                break
            # The object was replaced between our reads (a refresh's self-copy re-tags a
            # multipart object; gc deleted it and another writer stored it again): mixing two
            # bodies would be wrong KV, and neither is corrupt. Read it all again, once.
        else:
            raise ObjectChanged(f"object changed during a ranged read, twice (ETags {sorted(etags)})", key=key)
        pieces: list[list[bytes]] = [[] for _ in ranges]
        for (i, _, _), (data, _) in zip(jobs, results, strict=True):
            pieces[i].append(data)
        return [p[0] if len(p) == 1 else b"".join(p) for p in pieces]

    # -- TOUCH -------------------------------------------------------------------------
    def touch(self, key: str, min_age_s: float = 0.0) -> str:
        """Copy the object onto itself (S3 refuses a self-copy that changes nothing, so the
        metadata is replaced -- by the same metadata, read with a HEAD first): LastModified
        becomes now, bytes and metadata stay. One HEAD and, unless the object is younger than
        ``min_age_s`` (another engine refreshed it), one PUT-class request; objects are far
        below CopyObject's 5 GiB limit.

        The copy is conditional on the HEAD's ETag: between the two, gc may delete the object
        and another writer store it again, and that object is young anyway. Its encryption is
        the object's (from the HEAD), not this engine's sse settings: a copy re-encrypts."""
        r = self._call("head", key, lambda: self._head_raw(key))
        if r is None:
            return TOUCH_GONE
        lm = r.get("LastModified")
        if min_age_s > 0 and lm is not None and time.time() - lm.timestamp() < min_age_s:
            return TOUCH_YOUNG
        enc: dict[str, Any] = {}
        if r.get("ServerSideEncryption"):
            enc["ServerSideEncryption"] = r["ServerSideEncryption"]
        if r.get("SSEKMSKeyId"):
            enc["SSEKMSKeyId"] = r["SSEKMSKeyId"]
        if r.get("BucketKeyEnabled"):
            enc["BucketKeyEnabled"] = True
        meta = {k.lower(): v for k, v in (r.get("Metadata") or {}).items()}

        def copy() -> bool:
            try:
                self._client.copy_object(
                    Bucket=self.bucket,
                    Key=key,
                    CopySource={"Bucket": self.bucket, "Key": key},
                    CopySourceIfMatch=r["ETag"],
                    MetadataDirective="REPLACE",
                    Metadata=meta,
                    **enc,
                )
            except bexc.ClientError as exc:
                if _is_precondition_failed(exc):
                    return False  # replaced since the HEAD (or our own retried copy re-tagged it)
                if _is_not_implemented(exc):
                    # AWS answers 501 to a CopyObject that a write-once bucket policy forces to
                    # carry If-None-Match: a refusal by configuration, as a 403 is.
                    raise PermissionDenied(f"S3 copy s3://{self.bucket}/{key}: NotImplemented (HTTP 501)", key=key) from exc
                raise
            return True

        try:
            return TOUCH_REFRESHED if self._call("copy", key, copy) else TOUCH_GONE
        except NotFound:
            return TOUCH_GONE

    # -- CLOCK -------------------------------------------------------------------------
    def store_time(self) -> float:
        """The ``Date`` header of a HEAD of the probe key (a 404 carries one too). HTTP dates
        count whole seconds: the middle of that second, so the error is at most half a second
        plus half the round trip."""
        probe = self._probe_key()

        def date_of(r: Mapping[str, Any]) -> str:
            return str(dict(r.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date", ""))

        def attempt() -> str:
            try:
                return date_of(self._client.head_object(Bucket=self.bucket, Key=probe))
            except bexc.ClientError as exc:  # an answer all the same: its head has the store's date
                if not date_of(exc.response):
                    raise
                return date_of(exc.response)

        return http_date(self._call("clock", probe, attempt), self.url)

    # -- DELETE / LIST -----------------------------------------------------------------
    def delete_many(self, keys: Sequence[str]) -> None:
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), DELETE_BATCH):
            batch = unique[start : start + DELETE_BATCH]
            resp = self._call(
                "delete",
                batch[0] if len(batch) == 1 else None,
                lambda batch=batch: self._client.delete_objects(  # type: ignore[misc]
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                ),
            )
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                text = f"S3 delete failed for {len(errors)} of {len(batch)} keys; first: {first.get('Code')} {first.get('Message')}"
                cls = PermissionDenied if first.get("Code") in _DENIED_CODES else StoreError
                raise cls(text, key=first.get("Key"))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE_SIZE}
            if token:
                args["ContinuationToken"] = token
            # Each page is one retried request, so a fault mid-listing repeats one page only.
            page = self._call(
                "list", prefix, lambda args=args: self._client.list_objects_v2(**args)  # type: ignore[misc]
            )
            for obj in page.get("Contents", []):
                lm = obj.get("LastModified")
                yield ObjectInfo(obj["Key"], int(obj["Size"]), {}, lm.timestamp() if lm else None)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    # -- start-up ----------------------------------------------------------------------
    def check_access(self) -> None:
        """One clear error if the bucket is unusable; a missing probe key is success.

        A GET (not a HEAD) because a GET's error body says NoSuchBucket vs NoSuchKey.
        """
        probe = self._probe_key()

        def attempt() -> None:
            try:
                r = self._client.get_object(Bucket=self.bucket, Key=probe, Range="bytes=0-0")
                r["Body"].close()
            except bexc.ClientError as exc:
                if _error_code(exc)[0] == "InvalidRange":  # an empty probe object: readable
                    return
                raise

        try:
            self._call("check_access", probe, attempt)
        except NotFound:
            return
        except BucketNotFound as exc:
            raise BucketNotFound(
                f"S3KV_URL={self.url}: bucket {self.bucket!r} does not exist at {self.endpoint_url} "
                f"(endpoint from {self._endpoint_source()}); create it or fix the bucket name"
            ) from exc
        except PermissionDenied as exc:
            raise PermissionDenied(
                f"S3KV_URL={self.url}: access denied to bucket {self.bucket!r} at {self.endpoint_url}: {exc}. "
                "Check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE / role) and that the policy grants "
                "engines s3:GetObject, s3:PutObject, s3:AbortMultipartUpload and s3:ListBucket on the prefix "
                "(without ListBucket a missing key reads as 403, not 404); engines need no delete "
                "(docs/operations.md)"
            ) from exc
        except DeadlineExceeded as exc:
            root = exc.__cause__.__cause__ if exc.__cause__ is not None else None
            if isinstance(root, _UNREACHABLE_BOTOCORE):
                raise StoreConfigError(
                    f"S3KV_URL={self.url}: cannot reach the S3 endpoint {self.endpoint_url} "
                    f"(set by {self._endpoint_source()}): {root}"
                ) from exc
            raise DeadlineExceeded(
                f"S3KV_URL={self.url}: the S3 endpoint {self.endpoint_url} (set by {self._endpoint_source()}) "
                f"keeps failing: {exc}"
            ) from exc

    def probe_conditional_put(self) -> bool:
        """Whether the server really enforces ``If-None-Match: *`` (writes and deletes one probe key).

        Some servers ignore the header silently (200 + overwrite), which no single request
        can detect; call this once where that matters and set ``conditional_put='never'``.
        """
        key = f"{self._probe_key().rsplit('/', 1)[0]}/conditional-{uuid.uuid4().hex}"
        try:
            first = self._put_single(key, [memoryview(b"1")], {})
            second = self._put_single(key, [memoryview(b"2")], {})
            return first and not second and self.get_ranges(key, [ByteRange(0, 1)])[0] == b"1"
        finally:
            self.delete_many([key])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._upload_pool.shutdown(wait=True)
        self._client.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint_url!r})"
