"""The store wrappers on the memory store: faults, retries, throttling, instrumentation."""

from __future__ import annotations

import threading
import time
from dataclasses import FrozenInstanceError
from typing import Any

import pytest

from s3kv.store.base import (
    ByteRange,
    DeadlineExceeded,
    IntegrityError,
    NotFound,
    PermissionDenied,
    TransientError,
)
from s3kv.store.faults import FaultInjectingStore, FaultPlan, FaultRates
from s3kv.store.instrument import InstrumentedStore, StoreStats
from s3kv.store.memory import MemoryStore
from s3kv.store.retrying import RetryingStore, RetryPolicy
from s3kv.store.throttle import ThrottledStore

FAST = RetryPolicy(max_attempts=8, base_s=0.001, max_backoff_s=0.005, deadline_s=5.0)


def _filled(n: int = 10) -> MemoryStore:
    store = MemoryStore()
    for i in range(n):
        store.put(f"k{i}", bytes([i]) * 100, {"i": str(i)})
    return store


def test_random_faults_are_seeded_and_retried_to_success() -> None:
    plan = FaultPlan(
        seed=7, default=FaultRates(transient=0.3), per_op={"get": FaultRates(transient=0.3, truncate=0.3)}
    )

    def run() -> dict[str, int]:
        faulty = FaultInjectingStore(_filled(), plan)
        store = RetryingStore(faulty, FAST)
        for _ in range(3):
            batch = store.head_many([f"k{i}" for i in range(10)] + ["nope"])
            assert len(batch.found) == 10 and batch.missing == {"nope"} and not batch.failed
            for i in range(10):
                assert store.get_ranges(f"k{i}", [ByteRange(0, 100), ByteRange(10, 5)]) == [
                    bytes([i]) * 100,
                    bytes([i]) * 5,
                ]
        return faulty.injected()

    first = run()
    assert first == run()  # same seed, same calls -> same faults
    assert first["head.transient"] > 0 and first["get.transient"] > 0 and first["get.truncate"] > 0


def test_truncated_read_is_detected() -> None:
    faulty = FaultInjectingStore(_filled(), FaultPlan(per_op={"get": FaultRates(truncate=1.0)}))
    # Unwrapped: the fault shows as short bytes - the caller must notice.
    assert len(faulty.get_ranges("k1", [ByteRange(0, 100)])[0]) == 50
    with pytest.raises(DeadlineExceeded) as info:
        RetryingStore(faulty, RetryPolicy(max_attempts=3, base_s=0.001)).get_ranges("k1", [ByteRange(0, 100)])
    assert isinstance(info.value.__cause__, IntegrityError) and "k1" in str(info.value)


def test_permission_error_is_not_retried() -> None:
    faulty = FaultInjectingStore(_filled(), FaultPlan(default=FaultRates(permission=1.0)))
    counted = InstrumentedStore(faulty)
    with pytest.raises(PermissionDenied):
        RetryingStore(counted, FAST).put("x", b"1")
    assert counted.snapshot().put == 1
    batch = RetryingStore(faulty, FAST).head_many(["k1"])
    assert isinstance(batch.failed["k1"], PermissionDenied)


def test_stall_then_transient() -> None:
    faulty = FaultInjectingStore(_filled(), FaultPlan(per_op={"list": FaultRates(stall=1.0)}, stall_s=0.05))
    t0 = time.monotonic()
    with pytest.raises(TransientError, match="timed out"):
        list(faulty.list(""))
    assert time.monotonic() - t0 >= 0.05


def test_lost_put_response_retries_to_existing_object() -> None:
    inner = MemoryStore()
    faulty = FaultInjectingStore(inner, FaultPlan(per_op={"put": FaultRates(lost_response=1.0)}))
    with pytest.raises(TransientError):
        faulty.put("a", b"x")
    assert inner.get("a") == b"x"  # it landed all the same
    faulty2 = FaultInjectingStore(
        MemoryStore(), FaultPlan(seed=3, per_op={"put": FaultRates(lost_response=0.5)})
    )
    results = [RetryingStore(faulty2, FAST).put(f"k{i}", b"v") for i in range(20)]
    # A put whose answer was lost comes back False on the retry (the "retried 412"), never an error.
    assert 0 < results.count(False) <= faulty2.injected()["put.lost_response"]
    assert all(faulty2.inner.get(f"k{i}") == b"v" for i in range(20))


def test_fail_next_and_store_down() -> None:
    faulty = FaultInjectingStore(_filled())
    faulty.fail_next("head", 2)
    batch = faulty.head_many(["k1", "k2", "k3"])
    assert set(batch.failed) == {"k1", "k2"} and set(batch.found) == {"k3"}
    faulty.set_down(True)
    for call in (
        lambda: faulty.put("z", b""),
        lambda: faulty.get_ranges("k1", [ByteRange(0, 1)]),
        lambda: faulty.delete_many(["k1"]),
        lambda: list(faulty.list("")),
        faulty.check_access,
    ):
        with pytest.raises(TransientError, match="down"):
            call()
    assert set(faulty.head_many(["k1", "k2"]).failed) == {"k1", "k2"}
    faulty.set_down(False)
    assert faulty.head("k1").size == 100
    with pytest.raises(ValueError):
        faulty.fail_next("bogus")
    with pytest.raises(ValueError):
        FaultRates(transient=2.0)


def test_retry_policy_deadline_bounds_time() -> None:
    policy = RetryPolicy(max_attempts=10_000, base_s=0.02, max_backoff_s=0.05, deadline_s=0.3)
    calls = [0]

    def always_503() -> None:
        calls[0] += 1
        raise TransientError("503 SlowDown", key="obj")

    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        policy.call(always_503, op="get", key="obj")
    assert time.monotonic() - t0 < 3.0  # the deadline's 0.3 s; 10,000 attempts would take minutes
    assert calls[0] > 1 and "obj" in str(info.value) and "SlowDown" in str(info.value)
    with pytest.raises(DeadlineExceeded, match="1 attempt"):
        RetryPolicy(max_attempts=1).call(always_503, op="get", key="obj")
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


@pytest.mark.parametrize("flavour", ["call", "acall"])
def test_retry_policy_counts_attempts_and_time_from_the_first(flavour: str) -> None:
    """Sync and async: the first attempt runs before any retry machinery and still counts, as
    an attempt and against the deadline; answers (not ``retry_on``) are raised at once."""
    import asyncio

    def run(policy: RetryPolicy, fn: Any) -> Any:
        if flavour == "call":
            return policy.call(fn, op="get", key="obj")

        async def afn() -> Any:
            return fn()

        return asyncio.run(policy.acall(afn, op="get", key="obj"))

    calls = [0]

    def flaky(fails: int, sleep_s: float = 0.0) -> Any:
        def fn() -> str:
            calls[0] += 1
            time.sleep(sleep_s)
            if calls[0] <= fails:
                raise TransientError("503 SlowDown", key="obj")
            return "ok"

        calls[0] = 0
        return fn

    fast = RetryPolicy(max_attempts=4, base_s=0.001, max_backoff_s=0.002, deadline_s=10.0)
    assert run(fast, flaky(0)) == "ok" and calls[0] == 1
    assert run(fast, flaky(3)) == "ok" and calls[0] == 4
    with pytest.raises(DeadlineExceeded, match="after 4 attempt"):
        run(fast, flaky(4))
    assert calls[0] == 4
    # A first attempt that used up the deadline: no second one.
    with pytest.raises(DeadlineExceeded, match="after 1 attempt"):
        run(RetryPolicy(max_attempts=5, base_s=0.001, deadline_s=0.2), flaky(9, sleep_s=0.3))
    assert calls[0] == 1

    def gone() -> None:
        calls[0] += 1
        raise NotFound("no such key", key="obj")

    calls[0] = 0
    with pytest.raises(NotFound):
        run(fast, gone)
    assert calls[0] == 1


def test_retrying_head_many_keeps_settled_keys() -> None:
    faulty = FaultInjectingStore(_filled())
    faulty.fail_next("head", 3)
    store = RetryingStore(faulty, FAST)
    batch = store.head_many(["k1", "k2", "nope", "k3"])
    assert set(batch.found) == {"k1", "k2", "k3"} and batch.missing == {"nope"} and not batch.failed


def test_throttle_latency_and_shared_bandwidth() -> None:
    store = ThrottledStore(_filled(), latency_s=0.02, bandwidth_bytes_per_s=1_000_000)
    t0 = time.monotonic()
    store.head_many(["k1", "k2"])
    assert time.monotonic() - t0 >= 0.02
    big = b"x" * 50_000  # 50 ms of link each

    def put(i: int) -> None:
        store.put(f"b{i}", big)

    t0 = time.monotonic()
    threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Four 50 KB uploads share one 1 MB/s link: ~0.2 s together, not 0.05 s in parallel.
    assert time.monotonic() - t0 >= 0.19
    with pytest.raises(ValueError):
        ThrottledStore(MemoryStore(), bandwidth_bytes_per_s=0)


def test_instrumented_counts() -> None:
    inner = FaultInjectingStore(MemoryStore())
    store = InstrumentedStore(inner)
    assert store.put("a", [b"12", b"345"]) is True
    assert store.put("a", b"zz") is False
    store.head_many(["a", "b", "c"])
    store.get_ranges("a", [ByteRange(0, 2), ByteRange(1, 3)])
    store.delete_many(["x", "y"])
    assert [o.key for o in store.list("")] == ["a"]
    inner.fail_next("get")
    with pytest.raises(TransientError):
        store.get_ranges("a", [ByteRange(0, 1)])
    snap = store.snapshot()
    assert snap == StoreStats(
        head=3,
        put=2,
        get=3,
        delete=2,
        list=1,
        bytes_up=7,
        bytes_down=5,
        errors=1,
        head_missing=2,
        put_existing=1,
    )
    assert snap.requests == 11
    with pytest.raises(FrozenInstanceError):
        snap.put = 0  # type: ignore[misc]
    store.put("b", b"1")
    assert (store.snapshot() - snap).put == 1
    store.reset()
    assert store.snapshot() == StoreStats()


def test_instrumented_is_thread_safe() -> None:
    store = InstrumentedStore(MemoryStore())

    def work(i: int) -> None:
        for j in range(200):
            store.head_many([f"{i}-{j}"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.snapshot().head == 1600
