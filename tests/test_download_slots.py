"""The download threads' GET-request gate: streams on the wire, not objects, are bounded."""

from __future__ import annotations

import threading
import time

from s3kv.transfer.slots import RequestSlots


def _start(slots: RequestSlots, n: int, got: list[int]) -> threading.Thread:
    t = threading.Thread(target=lambda: got.append(slots.acquire(n)), daemon=True)
    t.start()
    return t


def _settle(t: threading.Thread, timeout: float = 0.2) -> bool:
    """True if ``t`` finished within ``timeout`` (its acquire returned)."""
    t.join(timeout)
    return not t.is_alive()


def test_jobs_take_one_slot_per_request_and_wait_for_free_ones():
    slots = RequestSlots(4)
    assert slots.acquire(3) == 3
    got: list[int] = []
    t = _start(slots, 2, got)
    assert not _settle(t), "2 requests were let through with 1 slot free"
    slots.release(3)
    assert _settle(t, 5) and got == [2]


def test_a_job_larger_than_the_gate_takes_all_of_it_not_forever():
    slots = RequestSlots(4)
    assert slots.acquire(10) == 4
    got: list[int] = []
    t = _start(slots, 1, got)
    assert not _settle(t)
    slots.release(4)
    assert _settle(t, 5) and got == [1]
    assert RequestSlots(0).capacity == 1  # a zero setting still lets loads run


def test_first_come_first_served_a_large_job_is_not_overtaken():
    slots = RequestSlots(4)
    assert slots.acquire(2) == 2
    order: list[str] = []
    lock = threading.Lock()

    def job(name: str, n: int) -> None:
        slots.acquire(n)
        with lock:
            order.append(name)

    big = threading.Thread(target=job, args=("big", 4), daemon=True)
    big.start()
    time.sleep(0.05)  # big is first in line
    small = threading.Thread(target=job, args=("small", 1), daemon=True)
    small.start()
    assert not _settle(small), "a later 1-slot job overtook the waiting 4-slot job"
    slots.release(2)
    assert _settle(big, 5)
    assert not _settle(small), "the small job ran while the big one held every slot"
    slots.release(4)
    assert _settle(small, 5) and order == ["big", "small"]
