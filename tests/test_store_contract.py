"""The ObjectStore contract, run on every back end: memory, file:// (fsspec), moto, SeaweedFS -
the S3 servers through both S3 clients (boto3's S3Store and obstore's ObstoreS3Store)."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import pytest

from s3kv.store.base import ByteRange, DeadlineExceeded, NotFound, StoreError, TransientError
from s3kv.store.faults import FaultInjectingStore, FaultPlan
from s3kv.store.instrument import InstrumentedStore
from s3kv.store.retrying import RetryingStore, RetryPolicy

if TYPE_CHECKING:
    from collections.abc import Iterator

    from conftest import StoreCase

from conftest import STORE_KINDS, make_case

#: Every kind of the shared fixture, plus the S3 servers through the obstore client.
CONTRACT_KINDS = (*STORE_KINDS, "moto-obstore", "seaweedfs-obstore", "seaweedfs-obstore+helpers")


@pytest.fixture(params=CONTRACT_KINDS)
def case(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreCase]:
    c = make_case(request, request.param, tmp_path)
    yield c
    c.store.close()


def test_head_present_missing_many(case: StoreCase) -> None:
    store = case.store
    present = [case.key(f"obj-{i:02d}") for i in range(12)]
    for i, k in enumerate(present):
        assert store.put(k, b"x" * i, {"S3KV-Group": f"g{i}", "size": str(i)}) is True
    missing = [case.key(f"nope-{i}") for i in range(5)]

    batch = store.head_many(present + missing + present[:2])  # duplicates are fine
    assert set(batch.found) == set(present)
    assert batch.missing == frozenset(missing)
    assert not batch.failed
    for i, k in enumerate(present):
        info = batch.found[k]
        assert info.size == i
        assert info.metadata == {"s3kv-group": f"g{i}", "size": str(i)}  # names come back lowercase
        assert info.last_modified is None or abs(info.last_modified - time.time()) < 600

    assert store.head(present[3]).size == 3
    assert store.head(missing[0]) is None
    assert store.head_many([]).found == {}


def test_put_is_write_once_and_accepts_buffer_lists(case: StoreCase) -> None:
    store = case.store
    k = case.key("parts")
    body = [b"abc", bytearray(b"defg"), memoryview(b"--hij--")[2:5], b""]
    assert store.put(k, body, {"a": "1"}) is True
    assert store.get(k) == b"abcdefghij"
    assert store.put(k, b"something else", {"a": "2"}) is False  # never an overwrite
    assert store.get(k) == b"abcdefghij"
    assert store.head(k).metadata == {"a": "1"}

    empty = case.key("empty")
    assert store.put(empty, b"") is True
    assert store.head(empty).size == 0
    assert store.get(empty) == b""


def test_get_if_changed_is_one_conditional_read_that_sees_a_replacement(case: StoreCase) -> None:
    """The fleet index's poll (``get_if_changed``): the whole object and an ETag, then None while
    that ETag still names it, the new bytes once the key was deleted and written again (how the
    publisher replaces an index under write-once rules), NotFound while it is gone."""
    store = InstrumentedStore(case.store)
    k = case.key("fleet-index")
    with pytest.raises(NotFound):
        store.get_if_changed(k)
    assert store.put(k, b"first version", {"a": "1"}) is True
    got = store.get_if_changed(k)
    assert got is not None and got.data == b"first version" and got.etag
    assert store.get_if_changed(k, got.etag) is None  # unchanged: no body
    assert store.get_if_changed(k, '"some-other-etag"').data == b"first version"
    store.delete_many([k])
    with pytest.raises(NotFound):
        store.get_if_changed(k, got.etag)
    assert store.put(k, b"second, longer version") is True
    again = store.get_if_changed(k, got.etag)
    assert again is not None and again.data == b"second, longer version" and again.etag != got.etag
    snap = store.snapshot()
    assert snap.fetch == 6 and snap.fetch_unchanged == 1 and snap.get == 0


def test_write_once_race(case: StoreCase) -> None:
    """Two writers, same key, same instant: both return cleanly, exactly one wins, body whole."""
    store = case.store
    bodies = [os.urandom(64 * 1024), os.urandom(64 * 1024)]
    for round_ in range(4):
        k = case.key(f"race-{round_}")
        gate = threading.Barrier(2)
        results: list[bool | BaseException] = [False, False]

        def write(i: int, k: str = k, gate: threading.Barrier = gate, results: list = results) -> None:
            gate.wait()
            try:
                results[i] = store.put(k, bodies[i], {"writer": str(i)})
            except BaseException as exc:  # reported by the assert below
                results[i] = exc

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(isinstance(r, bool) for r in results), results
        if case.atomic_write_once():
            assert sorted(results) == [False, True]
        else:
            assert True in results  # both may "win" (see StoreCase.atomic_write_once)
        got = store.get(k)
        assert got in bodies  # always one writer's whole body, never a mix
        winner = bodies.index(got)
        assert store.head(k).metadata == {"writer": str(winner)}


def test_ranged_reads(case: StoreCase) -> None:
    store = case.store
    k = case.key("ranges")
    body = os.urandom(3 * 1024 * 1024 + 123)  # > range_split_bytes (1 MiB) on S3: several sub-ranges
    assert store.put(k, [body[:1000], body[1000:]]) is True
    ranges = [
        ByteRange(0, 10),
        ByteRange(5, 0),
        ByteRange(len(body) - 7, 7),
        ByteRange(100_000, 2_500_000),  # split into 3 parallel GETs on S3
        ByteRange(0, len(body)),
        ByteRange(1, 1),
    ]
    got = store.get_ranges(k, ranges)
    assert [len(g) for g in got] == [r.length for r in ranges]
    for r, g in zip(ranges, got, strict=True):
        assert g == body[r.offset : r.end]
    with pytest.raises(StoreError):
        store.get_ranges(k, [ByteRange(len(body) - 5, 10)])  # runs past the end: never short bytes
    with pytest.raises(StoreError):
        store.get_ranges(k, [ByteRange(len(body) + 10, 10)])  # starts past the end
    with pytest.raises(NotFound):
        store.get_ranges(case.key("missing"), [ByteRange(0, 1)])


def test_delete_many_and_list(case: StoreCase) -> None:
    store = case.store
    names = ["a/1", "a/2", "a/sub/3", "ab/4", "b/5"]
    for i, n in enumerate(names):
        store.put(case.key(n), b"z" * (i + 1))
    listed = list(store.list(case.key("a/")))
    assert [o.key for o in listed] == [case.key(n) for n in ("a/1", "a/2", "a/sub/3")]
    assert [o.size for o in listed] == [1, 2, 3]
    # A prefix that ends mid-name matches like S3's (string prefix, not directory).
    assert {o.key for o in store.list(case.key("a"))} == {
        case.key(n) for n in ("a/1", "a/2", "a/sub/3", "ab/4")
    }
    assert list(store.list(case.key("zzz"))) == []

    store.delete_many([case.key("a/1"), case.key("a/sub/3"), case.key("never-existed")])
    assert [o.key for o in store.list(case.prefix + "/")] == [case.key(n) for n in ("a/2", "ab/4", "b/5")]
    store.delete_many([])
    store.delete_many([case.key(n) for n in names])
    assert list(store.list(case.prefix + "/")) == []
    assert store.head(case.key("b/5")) is None


def test_check_access_ok(case: StoreCase) -> None:
    case.store.check_access()  # the probe key is simply missing: that is success


def test_retried_503_through_fault_wrapper_succeeds(case: StoreCase) -> None:
    faulty = FaultInjectingStore(case.store, FaultPlan(seed=1))
    counted = InstrumentedStore(faulty)
    store = RetryingStore(
        counted, RetryPolicy(max_attempts=5, base_s=0.001, max_backoff_s=0.01, deadline_s=10)
    )
    k = case.key("flaky")
    faulty.fail_next("put", 2)
    assert store.put(k, b"payload") is True
    faulty.fail_next("head", 2)
    assert store.head(k).size == 7
    faulty.fail_next("get", 3, lambda key: TransientError("injected: 500 InternalError", key=key))
    assert store.get_ranges(k, [ByteRange(0, 7)]) == [b"payload"]
    assert faulty.injected() == {"put.fail_next": 2, "head.fail_next": 2, "get.fail_next": 3}
    stats = counted.snapshot()
    assert (stats.put, stats.head, stats.get, stats.errors) == (3, 3, 4, 7)


def test_deadline_names_the_key(case: StoreCase) -> None:
    faulty = FaultInjectingStore(case.store)
    policy = RetryPolicy(max_attempts=1000, base_s=0.01, max_backoff_s=0.05, deadline_s=0.3)
    store = RetryingStore(faulty, policy)
    k = case.key("unlucky")
    faulty.set_down(True)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        store.get_ranges(k, [ByteRange(0, 1)])
    assert time.monotonic() - t0 < 6.0  # the deadline's 0.3 s; 1,000 attempts would take 10 s or more
    assert k in str(info.value) and info.value.key == k
    assert isinstance(info.value.__cause__, TransientError)
    batch = store.head_many([k])
    assert isinstance(batch.failed[k], DeadlineExceeded) and k in str(batch.failed[k])
    faulty.set_down(False)
    assert store.head(k) is None


def test_ranges_land_in_caller_buffers(case: StoreCase) -> None:
    """get_ranges_into writes each range into its own buffer (the load path's staging)."""
    store = case.store
    k = case.key("into")
    body = os.urandom(2 * 1024 * 1024 + 77)
    assert store.put(k, body) is True
    ranges = [ByteRange(0, 33), ByteRange(1000, 1_500_000), ByteRange(len(body) - 5, 5)]
    bufs = [bytearray(r.length) for r in ranges]
    store.get_ranges_into(k, ranges, [memoryview(b) for b in bufs])
    assert [bytes(b) for b in bufs] == [body[r.offset : r.end] for r in ranges]
    with pytest.raises(StoreError):
        store.get_ranges_into(k, [ByteRange(len(body) - 5, 10)], [memoryview(bytearray(10))])
