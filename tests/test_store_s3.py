"""S3Store against real loopback S3 servers (moto and SeaweedFS): multipart, conditional writes,
retries inside the store, error mapping and start-up checks."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import botocore.exceptions as bexc
import pytest

import s3kv.store.s3 as s3mod
from s3kv.store.base import (
    BucketNotFound,
    ByteRange,
    DeadlineExceeded,
    ObjectChanged,
    PermissionDenied,
    StoreConfigError,
    TransientError,
)
from s3kv.store.retrying import RetryPolicy
from s3kv.store.s3 import MiB, S3Options, S3Store

if TYPE_CHECKING:
    from conftest import StoreCase


def _events(store: S3Store) -> Any:
    return store._client.meta.events


def _count_calls(store: S3Store, operation: str) -> list[dict[str, Any]]:
    """Record the params of every ``operation`` request the store sends."""
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def hook(params: dict[str, Any], **_: Any) -> None:
        with lock:
            seen.append(params)

    _events(store).register(f"provide-client-params.s3.{operation}", hook)
    return seen


def _fail(store: S3Store, operation: str, times: int, error: Callable[[], Exception]) -> list[int]:
    """Make the next ``times`` ``operation`` requests fail before they are sent (``times < 0``: all)."""
    count = [0]
    lock = threading.Lock()

    def hook(**_: Any) -> None:
        with lock:
            count[0] += 1
            if times >= 0 and count[0] > times:
                return
        raise error()

    _events(store).register(f"before-call.s3.{operation}", hook)
    return count


def _slowdown(operation: str) -> Callable[[], Exception]:
    return lambda: bexc.ClientError(
        {
            "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        },
        operation,
    )


def _uploads(case: StoreCase, key: str) -> list[dict[str, Any]]:
    client = case.server.client()
    return [
        u
        for u in client.list_multipart_uploads(Bucket=case.server.bucket).get("Uploads", [])
        if u["Key"] == key
    ]


def test_multipart_round_trip(s3case: StoreCase) -> None:
    store = s3case.store
    assert isinstance(store, S3Store)
    size = 21 * MiB + 12345
    body = bytearray(os.urandom(size))
    # Buffers of odd sizes so parts straddle buffer boundaries (assembled from memoryview slices).
    cuts = [0, 3, 7 * MiB + 1, 7 * MiB + 2, 13 * MiB, size]
    parts = [memoryview(body)[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    uploads = _count_calls(store, "UploadPart")
    k = s3case.key("big")
    assert store.put(k, parts, {"Layout": "v1"}) is True
    assert len(uploads) == 5  # 21 MiB in 5 MiB parts
    info = store.head(k)
    assert info.size == size and info.metadata == {"layout": "v1"}
    assert store.get(k) == bytes(body)
    assert _uploads(s3case, k) == []

    # A second writer of a large body stops at the pre-upload HEAD...
    heads = _count_calls(store, "HeadObject")
    assert store.put(k, os.urandom(6 * MiB)) is False
    assert len(heads) == 1 and len(uploads) == 5
    # ...and if it missed the first writer there (a race), CompleteMultipartUpload gets 412:
    # still False, and the upload is aborted.
    store._head_one = lambda key: None  # type: ignore[method-assign]
    assert store.put(k, os.urandom(6 * MiB)) is False
    assert len(uploads) == 7
    assert store.get_ranges(k, [ByteRange(0, 64)])[0] == bytes(body[:64])
    assert _uploads(s3case, k) == []


def test_multipart_write_race(s3case: StoreCase) -> None:
    store = s3case.store
    k = s3case.key("big-race")
    bodies = [os.urandom(6 * MiB), os.urandom(6 * MiB)]
    gate = threading.Barrier(2)
    results: list[Any] = [None, None]

    def write(i: int) -> None:
        gate.wait()
        try:
            results[i] = store.put(k, bodies[i])
        except BaseException as exc:  # reported by the assert below
            results[i] = exc

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, bool) for r in results), results
    if s3case.atomic_write_once(multipart=True):
        assert sorted(results) == [False, True], results
        assert store.get(k) == bodies[results.index(True)]
    else:
        assert True in results
        assert store.get(k) in bodies
    assert _uploads(s3case, k) == []


def test_failed_multipart_leaves_nothing(s3case: StoreCase) -> None:
    store = s3case.store
    k = s3case.key("doomed")
    # Part 3 always fails with a 500: retries run out, the upload must be aborted.
    real = store._client.upload_part

    def flaky_upload_part(**kwargs: Any) -> Any:
        if kwargs["PartNumber"] == 3:
            raise bexc.ClientError(
                {
                    "Error": {"Code": "InternalError", "Message": "boom"},
                    "ResponseMetadata": {"HTTPStatusCode": 500},
                },
                "UploadPart",
            )
        return real(**kwargs)

    store._client.upload_part = flaky_upload_part  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded) as info:
        store.put(k, os.urandom(16 * MiB))
    assert k in str(info.value)
    assert isinstance(info.value.__cause__, TransientError)
    assert store.head(k) is None
    assert _uploads(s3case, k) == []


def test_split_ranges_are_parallel_sub_requests(s3case: StoreCase) -> None:
    store = s3case.store
    k = s3case.key("split")
    body = os.urandom(4 * MiB + 5)
    store.put(k, body)
    gets = _count_calls(store, "GetObject")
    out = store.get_ranges(k, [ByteRange(0, len(body)), ByteRange(MiB // 2, 2 * MiB), ByteRange(7, 3)])
    assert out == [body, body[MiB // 2 : MiB // 2 + 2 * MiB], body[7:10]]
    # 1 MiB split: 4 + 2 + 1 requests, each a bytes=a-b range.
    assert len(gets) == 7
    assert all(p["Range"].startswith("bytes=") for p in gets)
    # The whole object's 4 MiB + 5 come in 4 about-equal parts that tile it, not 4 full
    # parts and a 5-byte request of its own.
    gets.clear()
    assert store.get_ranges(k, [ByteRange(0, len(body))]) == [body]
    spans = sorted(tuple(int(x) for x in p["Range"][6:].split("-")) for p in gets)
    assert len(spans) == 4 and spans[0][0] == 0 and spans[-1][1] == len(body) - 1
    assert all(b + 1 == a for (_, b), (a, _) in zip(spans, spans[1:], strict=False))
    sizes = [b - a + 1 for a, b in spans]
    assert max(sizes) - min(sizes) < len(sizes)
    # A range capped at fewer parts (a load of several objects: ByteRange.parts) tiles the same
    # bytes in that many requests; a cap above the split's count changes nothing.
    for cap, want in ((2, 2), (1, 1), (9, 4)):
        gets.clear()
        assert store.get_ranges(k, [ByteRange(0, len(body), parts=cap)]) == [body]
        assert len(gets) == want


def test_an_object_replaced_mid_read_is_read_again_and_never_called_corrupt(s3case: StoreCase) -> None:
    """A refresh's self-copy re-tags a multipart object (moto; AWS for multipart and SSE-KMS):
    a split read that sees two ETags reads again once, and twice is a transient failure, not an
    IntegrityError (which would quarantine the object as corrupt and, with delete_corrupt, delete it)."""
    from s3kv.engine.worker.loads import _kind, describe
    from s3kv.store.breaker import is_store_failure

    store = s3case.store
    assert isinstance(store, S3Store)
    k = s3case.key("retagged")
    body = os.urandom(3 * MiB)
    store.put(k, body)
    real = store._get_one
    seen = [0]
    lock = threading.Lock()

    def once(key: str, offset: int, length: int) -> tuple[bytes, str]:
        with lock:  # parts run on a pool
            seen[0] += 1
            first = seen[0] == 1
        data, etag = real(key, offset, length)
        return data, etag + "-before" if first else etag

    store._get_one = once  # type: ignore[method-assign]
    assert store.get_ranges(k, [ByteRange(0, len(body))]) == [body]
    store._get_one = lambda key, o, n: (real(key, o, n)[0], f"e{o}")  # type: ignore[method-assign]
    with pytest.raises(ObjectChanged) as err:
        store.get_ranges(k, [ByteRange(0, len(body))])
    assert _kind(describe(err.value)) == "transient"  # a failed load, no quarantine
    assert not is_store_failure(err.value)  # the store answered: not toward the breaker


def test_a_large_single_put_heads_first_and_skips_a_stored_object(s3case: StoreCase) -> None:
    """Single PUTs go up to 1 GiB: one another cluster already stored is found with a HEAD, not
    uploaded in full just to get a 412. Small ones PUT at once (If-None-Match settles it)."""
    store = s3case.store
    assert isinstance(store, S3Store)
    store.options = replace(store.options, head_before_put_bytes=64 * 1024)
    big, small = s3case.key("big"), s3case.key("small")
    assert store.put(big, os.urandom(64 * 1024)) and store.put(small, b"s" * 100)
    puts, heads = _count_calls(store, "PutObject"), _count_calls(store, "HeadObject")
    assert store.put(big, os.urandom(64 * 1024)) is False
    assert (len(puts), len(heads)) == (0, 1)
    assert store.put(small, b"s" * 100) is False
    assert (len(puts), len(heads)) == (1, 1)


def test_throttled_put_is_retried_inside_the_store(s3case: StoreCase) -> None:
    store = s3case.store
    k = s3case.key("throttled")
    count = _fail(store, "PutObject", 2, _slowdown("PutObject"))
    assert store.put(k, b"data") is True
    assert count[0] == 3
    conn = _fail(store, "GetObject", 1, lambda: bexc.ConnectionClosedError(endpoint_url=store.endpoint_url))
    assert store.get(k) == b"data"
    assert conn[0] == 2


def test_lost_put_response_then_412_is_success(s3case: StoreCase) -> None:
    """The PUT lands but its answer is lost; the retry meets 412 and must report "exists", not fail."""
    store = s3case.store
    k = s3case.key("lost-answer")
    lost = [0]

    def drop_answer(**_: Any) -> None:
        if lost[0] == 0:
            lost[0] += 1
            raise bexc.ReadTimeoutError(endpoint_url=store.endpoint_url)

    _events(store).register("after-call.s3.PutObject", drop_answer)
    assert store.put(k, b"once") is False
    assert store.get(k) == b"once"


def test_store_deadline_names_the_key(s3case: StoreCase, s3_store_for: Callable[..., S3Store]) -> None:
    opts = replace(
        s3case.store.options,
        retry=RetryPolicy(max_attempts=50, base_s=0.01, max_backoff_s=0.02, deadline_s=0.25),
    )
    store = s3_store_for(s3case.server, opts)
    k = s3case.key("never")
    _fail(store, "GetObject", -1, _slowdown("GetObject"))
    with pytest.raises(DeadlineExceeded) as info:
        store.get_ranges(k, [ByteRange(0, 10)])
    msg = str(info.value)
    assert k in msg and "SlowDown" in msg and "deadline" in msg
    assert isinstance(info.value.__cause__, TransientError)


def test_check_access_missing_bucket(s3case: StoreCase, s3_store_for: Callable[..., S3Store]) -> None:
    store = s3_store_for(s3case.server, bucket="s3kv-no-such-bucket")
    with pytest.raises(BucketNotFound) as info:
        store.check_access()
    msg = str(info.value)
    assert "s3kv-no-such-bucket" in msg and "S3KV_URL" in msg and s3case.server.endpoint_url in msg
    # A HEAD cannot tell a missing bucket from a missing key: it reads as missing.
    assert store.head("x") is None


def test_check_access_unreachable_endpoint(
    s3_store_for: Callable[..., S3Store], moto_s3: Any, closed_port: int
) -> None:
    endpoint = f"http://127.0.0.1:{closed_port}"
    opts = S3Options(
        connect_timeout_s=0.5,
        read_timeout_s=0.5,
        retry=RetryPolicy(max_attempts=2, base_s=0.01, deadline_s=2),
    )
    store = s3_store_for(moto_s3, opts, endpoint_url=endpoint)
    with pytest.raises(StoreConfigError) as info:
        store.check_access()
    msg = str(info.value)
    assert endpoint in msg and "endpoint_url" in msg and "S3KV_URL" in msg


def test_check_access_denied_on_seaweedfs(seaweed_s3: Any, s3_store_for: Callable[..., S3Store]) -> None:
    """SeaweedFS enforces SigV4 with the static keys it was started with (moto accepts any)."""
    store = s3_store_for(seaweed_s3, aws_access_key_id="wrong-key", aws_secret_access_key="wrong-secret")
    with pytest.raises(PermissionDenied) as info:
        store.check_access()
    assert "access denied" in str(info.value) and "S3KV_URL" in str(info.value)
    batch = store.head_many(["a", "b"])
    assert set(batch.failed) == {"a", "b"} and all(
        isinstance(e, PermissionDenied) for e in batch.failed.values()
    )
    with pytest.raises(PermissionDenied):
        store.put("a", b"x")


def test_conditional_put_support_and_fallback(
    s3case: StoreCase, s3_store_for: Callable[..., S3Store]
) -> None:
    assert s3case.store.probe_conditional_put() is True  # both moto and SeaweedFS enforce If-None-Match

    # HEAD-then-PUT fallback: sequential writes stay write-once; a race may let both "win"
    # but the object is always one whole body.
    store = s3_store_for(s3case.server, replace(s3case.store.options, conditional_put="never"))
    heads = _count_calls(store, "HeadObject")
    k = s3case.key("fallback")
    assert store.put(k, b"first") is True
    assert store.put(k, b"second") is False
    assert store.get(k) == b"first" and len(heads) >= 2

    bodies = [os.urandom(32 * 1024), os.urandom(32 * 1024)]
    k2 = s3case.key("fallback-race")
    gate = threading.Barrier(2)
    results: list[Any] = [None, None]

    def write(i: int) -> None:
        gate.wait()
        results[i] = store.put(k2, bodies[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert True in results
    assert store.get(k2) in bodies


def test_not_implemented_switches_to_fallback(
    s3case: StoreCase, s3_store_for: Callable[..., S3Store]
) -> None:
    store = s3_store_for(s3case.server)
    calls = [0]

    def reject_conditional(params: dict[str, Any], **_: Any) -> None:
        if "IfNoneMatch" in params:
            calls[0] += 1
            raise bexc.ClientError(
                {
                    "Error": {"Code": "NotImplemented", "Message": "If-None-Match"},
                    "ResponseMetadata": {"HTTPStatusCode": 501},
                },
                "PutObject",
            )

    _events(store).register("provide-client-params.s3.PutObject", reject_conditional)
    k = s3case.key("old-server")
    assert store.put(k, b"v1") is True
    assert store.put(k, b"v2") is False
    assert calls[0] == 1 and store.get(k) == b"v1"


def test_delete_and_list_paginate(s3case: StoreCase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3mod, "DELETE_BATCH", 3)
    monkeypatch.setattr(s3mod, "LIST_PAGE_SIZE", 2)
    store = s3case.store
    keys = [s3case.key(f"p/{i}") for i in range(7)]
    for k in keys:
        store.put(k, b"1")
    lists = _count_calls(store, "ListObjectsV2")
    assert [o.key for o in store.list(s3case.key("p/"))] == keys
    assert len(lists) == 4
    deletes = _count_calls(store, "DeleteObjects")
    store.delete_many(keys + keys[:2])
    assert len(deletes) == 3
    assert list(store.list(s3case.key("p/"))) == []


def test_sse_aes256_on_moto(
    moto_s3: Any, s3_store_for: Callable[..., S3Store], s3_options: S3Options
) -> None:
    store = s3_store_for(moto_s3, replace(s3_options, sse="AES256"))
    puts = _count_calls(store, "PutObject")
    assert store.put("sse/obj", b"secret-ish") is True
    assert puts[0]["ServerSideEncryption"] == "AES256"
    assert (
        moto_s3.client().head_object(Bucket=moto_s3.bucket, Key="sse/obj")["ServerSideEncryption"] == "AES256"
    )
    store.delete_many(["sse/obj"])


def test_options_validation() -> None:
    with pytest.raises(ValueError, match="5 MiB"):
        S3Options(part_size=MiB)
    with pytest.raises(ValueError, match="sse"):
        S3Options(sse="rot13")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aws:kms"):
        S3Options(sse="AES256", sse_kms_key_id="k")
    with pytest.raises(StoreConfigError, match="S3KV_URL"):
        S3Store("")
