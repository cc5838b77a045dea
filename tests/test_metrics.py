from __future__ import annotations

import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from s3kv.engine.leader import LeaderStats
from s3kv.engine.metrics import Metrics, MetricsStore, start_http_server
from s3kv.store.base import ByteRange, NotFound, TransientError
from s3kv.store.breaker import BreakerPolicy, CircuitBreakerStore, StoreUnavailable
from s3kv.store.faults import FaultInjectingStore
from s3kv.store.memory import MemoryStore


def scrape(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse the exposition text the way Prometheus would."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(scraped, name, **labels):
    return scraped.get((name, tuple(sorted(labels.items()))))


class Ticks:
    """A clock that advances 0.25 s per reading (exact in binary): every timed call takes 0.25 s."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.25
        return self.t


def test_metrics_store_counts_every_call_and_scrape_shows_it():
    m = Metrics()
    mem = MemoryStore()
    store = MetricsStore(mem, m, clock=Ticks())
    assert store.put("a/1", [b"abc", b"de"], {"x": "1"}) is True
    assert store.put("a/1", b"zz") is False
    assert store.get_ranges("a/1", [ByteRange(0, 2), ByteRange(3, 2)]) == [b"ab", b"de"]
    assert store.get("a/1") == b"abcde"  # one HEAD + one range
    batch = store.head_many(["a/1", "nope", "nope2"])
    assert set(batch.missing) == {"nope", "nope2"}
    with pytest.raises(NotFound):
        store.get_ranges("nope", [ByteRange(0, 1)])
    assert [i.key for i in store.list("a/")] == ["a/1"]
    store.delete_many(["a/1", "nope"])

    s = scrape(m)
    assert sample(s, "s3kv_store_requests_total", op="put") == 2
    assert sample(s, "s3kv_store_requests_total", op="get") == 4
    assert sample(s, "s3kv_store_requests_total", op="head") == 4
    assert sample(s, "s3kv_store_requests_total", op="list") == 1
    assert sample(s, "s3kv_store_requests_total", op="delete") == 2
    assert sample(s, "s3kv_store_bytes_total", op="put", direction="up") == 7
    assert sample(s, "s3kv_store_bytes_total", op="get", direction="down") == 9
    assert sample(s, "s3kv_store_errors_total", op="get", type="NotFound") == 1
    # One observation per call; every call took 0.25 s on the tick clock.
    assert sample(s, "s3kv_store_request_seconds_count", op="get") == 3
    assert sample(s, "s3kv_store_request_seconds_count", op="head") == 2
    assert sample(s, "s3kv_store_request_seconds_sum", op="put") == 0.5
    assert sample(s, "s3kv_store_request_seconds_bucket", op="put", le="0.25") == 2
    assert sample(s, "s3kv_store_request_seconds_bucket", op="put", le="0.1") == 0
    # snapshot() agrees with the scrape and hides *_created.
    snap = m.snapshot()
    assert snap['s3kv_store_requests_total{op="put"}'] == 2
    assert not any("_created" in k for k in snap)
    assert m.value("s3kv_store_bytes_total", op="get", direction="down") == 9


def test_failed_calls_are_counted_by_type():
    m = Metrics()
    faults = FaultInjectingStore(MemoryStore())
    store = MetricsStore(faults, m)
    faults.fail_next("put", 1)
    with pytest.raises(TransientError):
        store.put("k", b"1234")
    faults.fail_next("head", 2)
    batch = store.head_many(["x", "y", "z"])
    assert len(batch.failed) == 2
    faults.set_down(True)
    with pytest.raises(TransientError):
        list(store.list(""))
    s = scrape(m)
    assert sample(s, "s3kv_store_errors_total", op="put", type="TransientError") == 1
    assert sample(s, "s3kv_store_errors_total", op="head", type="TransientError") == 2
    assert sample(s, "s3kv_store_errors_total", op="list", type="TransientError") == 1
    assert sample(s, "s3kv_store_bytes_total", op="put", direction="up") == 4


def test_breaker_transitions_reach_the_gauge_and_counter():
    m = Metrics()
    faults = FaultInjectingStore(MemoryStore())
    now = [0.0]
    breaker = CircuitBreakerStore(
        faults,
        BreakerPolicy(failures=2, reset_s=5),
        clock=lambda: now[0],
        on_transition=m.on_breaker_transition,
    )
    store = MetricsStore(breaker, m)
    assert m.value("s3kv_breaker_state") == 0
    faults.set_down(True)
    for _ in range(2):
        with pytest.raises(TransientError):
            store.put("k", b"x")
    with pytest.raises(StoreUnavailable):
        store.put("k", b"x")
    s = scrape(m)
    assert sample(s, "s3kv_breaker_state") == 2
    assert sample(s, "s3kv_breaker_transitions_total", from_state="closed", to_state="open") == 1
    assert sample(s, "s3kv_store_errors_total", op="put", type="StoreUnavailable") == 1
    now[0] = 5
    assert breaker.state.value == "half_open"
    assert m.value("s3kv_breaker_state") == 1
    faults.set_down(False)
    assert store.put("k", b"x") is True
    s = scrape(m)
    assert sample(s, "s3kv_breaker_state") == 0
    assert sample(s, "s3kv_breaker_transitions_total", from_state="open", to_state="half_open") == 1
    assert sample(s, "s3kv_breaker_transitions_total", from_state="half_open", to_state="closed") == 1


def test_two_instances_do_not_collide_and_global_registry_is_untouched():
    before = {m.name for m in REGISTRY.collect()}
    a, b = Metrics(), Metrics()
    MetricsStore(MemoryStore(), a).put("k", b"xyz")
    assert a.value("s3kv_store_requests_total", op="put") == 1
    assert b.value("s3kv_store_requests_total", op="put") == 0
    a.observe_worker({"saves_dropped_staging_full": 3})
    assert b.value("s3kv_saves_dropped_total", reason="staging_full") == 0
    assert {m.name for m in REGISTRY.collect()} == before
    assert not any(n.startswith("s3kv") for n in before)


def test_zero_series_exist_before_anything_happens():
    s = scrape(Metrics())
    for reason in ("staging_full", "store_error", "breaker_open"):
        assert sample(s, "s3kv_saves_dropped_total", reason=reason) == 0
    for op in ("head", "put", "get", "delete", "list"):
        assert sample(s, "s3kv_store_requests_total", op=op) == 0
    assert sample(s, "s3kv_breaker_state") == 0


def test_each_lookup_is_observed_once_with_its_stall_budget_saveable_tokens_and_decision():
    m = Metrics()
    st = LeaderStats()
    st.record_lookup(0.030, 0.100, 1500, 1472, "hit")
    st.record_lookup(0.200, 0.200, 9000, 0, "ran_out")
    m.observe_leader(st)
    m.observe_leader(st)  # nothing new: no change
    st.record_lookup(0.001, 0.002, 30, 0, "miss")
    m.observe_leader(st)
    s = scrape(m)
    assert sample(s, "s3kv_lookup_stall_seconds_count", decision="hit") == 1
    assert sample(s, "s3kv_lookup_stall_seconds_sum", decision="ran_out") == 0.2
    assert sample(s, "s3kv_lookup_budget_seconds_count") == 3
    assert sample(s, "s3kv_lookup_saveable_tokens_total", decision="hit") == 1500
    assert sample(s, "s3kv_lookup_saveable_tokens_total", decision="ran_out") == 9000
    assert sample(s, "s3kv_lookup_decisions_total", decision="miss") == 1


def test_observe_leader_adds_deltas():
    m = Metrics()
    st = LeaderStats()
    st.lookups, st.hits, st.misses, st.hit_tokens = 3, 2, 1, 512
    st.foreign_objects = 1
    st.hit_blocks_by_group = {0: 16, 1: 4}
    st.lookup_cpu_s, st.lookup_hash_cpu_s = 0.25, 0.125
    st.lookup_timeouts, st.lookup_busy, st.lookups_finished_late = 3, 1, 2
    st.not_cacheable, st.lora_unidentified = 4, 3
    m.observe_leader(st)
    m.observe_leader(st)  # nothing new: no change
    s = scrape(m)
    assert sample(s, "s3kv_lookup_not_cacheable_total") == 4
    assert sample(s, "s3kv_lora_unidentified_total") == 3
    assert sample(s, "s3kv_lookup_timeouts_total") == 3
    assert sample(s, "s3kv_lookup_busy_total") == 1
    assert sample(s, "s3kv_lookups_finished_late_total") == 2
    assert sample(s, "s3kv_lookup_cpu_seconds_total") == 0.25
    assert sample(s, "s3kv_lookup_hash_cpu_seconds_total") == 0.125
    assert sample(s, "s3kv_lookups_total") == 3
    assert sample(s, "s3kv_lookup_hits_total") == 2
    assert sample(s, "s3kv_lookup_misses_total") == 1
    assert sample(s, "s3kv_hit_tokens_total") == 512
    assert sample(s, "s3kv_hit_blocks_total", group="0") == 16
    assert sample(s, "s3kv_hit_blocks_total", group="1") == 4
    assert sample(s, "s3kv_objects_rejected_total", reason="foreign") == 1
    st.lookups, st.hits, st.hit_tokens = 5, 4, 1024
    st.hit_blocks_by_group[1] = 10
    st.hit_blocks_by_group[2] = 1
    m.observe_leader(st)
    s = scrape(m)
    assert sample(s, "s3kv_lookups_total") == 5
    assert sample(s, "s3kv_hit_tokens_total") == 1024
    assert sample(s, "s3kv_hit_blocks_total", group="1") == 10
    assert sample(s, "s3kv_hit_blocks_total", group="2") == 1
    # Two leaders feeding one Metrics keep separate baselines.
    other = LeaderStats(lookups=2)
    m.observe_leader(other, source="leader-2")
    assert m.value("s3kv_lookups_total") == 7


@dataclass
class _WorkerStats:
    """The fields of ``WorkerStats`` that observe_worker reads (every one is optional)."""

    pages_staged: int = 0
    objects_uploaded: int = 0
    bytes_uploaded: int = 0
    saves_dropped_staging_full: int = 0
    saves_dropped_store_error: int = 0
    saves_dropped_other: int = 0
    objects_loaded: int = 0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    loads_failed_objects: int = 0
    staging_capacity: int = 1 << 20
    staging_in_use: int = 4096
    staging_high_water: int = 8192


def test_observe_worker_dataclass_and_mapping():
    m = Metrics()
    w = _WorkerStats(
        pages_staged=10,
        objects_uploaded=2,
        bytes_uploaded=1000,
        saves_dropped_staging_full=1,
        saves_dropped_other=4,
        objects_loaded=3,
        pages_loaded=12,
        bytes_loaded=600,
        loads_failed_objects=1,
    )
    m.observe_worker(w)
    w.objects_uploaded = 5
    w.saves_dropped_store_error = 2
    w.staging_in_use = 0
    m.observe_worker(w)
    s = scrape(m)
    assert sample(s, "s3kv_pages_staged_total") == 10
    assert sample(s, "s3kv_objects_saved_total") == 5
    assert sample(s, "s3kv_saved_bytes_total") == 1000
    assert sample(s, "s3kv_saves_dropped_total", reason="staging_full") == 1
    assert sample(s, "s3kv_saves_dropped_total", reason="store_error") == 2
    assert sample(s, "s3kv_saves_dropped_total", reason="other") == 4
    assert sample(s, "s3kv_saves_dropped_total", reason="breaker_open") == 0
    assert sample(s, "s3kv_objects_loaded_total") == 3
    assert sample(s, "s3kv_pages_loaded_total") == 12
    assert sample(s, "s3kv_loaded_bytes_total") == 600
    assert sample(s, "s3kv_load_failures_total") == 1
    assert sample(s, "s3kv_staging_bytes_in_use") == 0
    assert sample(s, "s3kv_staging_capacity_bytes") == 1 << 20
    assert sample(s, "s3kv_staging_high_water_bytes") == 8192

    # A mapping with the same names; unknown fields are ignored.
    m2 = Metrics()
    m2.observe_worker(
        {
            "objects_uploaded": 4,
            "saves_dropped_store_error": 1,
            "loads_failed_objects": 2,
            "whatever": "x",
        }
    )
    assert m2.value("s3kv_objects_saved_total") == 4
    assert m2.value("s3kv_saves_dropped_total", reason="store_error") == 1
    assert m2.value("s3kv_load_failures_total") == 2
    # A counter that went backwards (a restarted worker) counts from zero.
    m3 = Metrics()
    m3.observe_worker({"saves_dropped_staging_full": 5})
    m3.observe_worker({"saves_dropped_staging_full": 2})
    assert m3.value("s3kv_saves_dropped_total", reason="staging_full") == 7
    m3.observe_worker(object())  # nothing known: nothing happens
    # The real snapshot's names are the ones read.
    from s3kv.engine.worker.stats import worker_stats

    m4 = Metrics()
    c = {"objects_uploaded": 3, "bytes_uploaded": 30, "loads_failed_objects": 1, "saves_dropped_other": 2}
    m4.observe_worker(worker_stats(c, None, uploads_pending=0, parked_now=0))
    assert m4.value("s3kv_objects_saved_total") == 3 and m4.value("s3kv_saved_bytes_total") == 30
    assert m4.value("s3kv_load_failures_total") == 1
    assert m4.value("s3kv_saves_dropped_total", reason="other") == 2


def test_http_server_serves_its_own_registry():
    m = Metrics()
    m.record_request("get", 0.01, requests=3)
    server = start_http_server(m, 0, addr="127.0.0.1")
    try:
        port = server.server_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 's3kv_store_requests_total{op="get"} 3.0' in body
    assert "python_gc_objects_collected_total" not in body  # not the default registry


# --------------------------------------------------------------------------- issue 13.5 / 17.7


def test_prompt_tokens_counter_gives_the_share_served_from_the_store():
    m = Metrics()
    m.observe_leader({"hit_tokens": 600, "prompt_tokens": 1000})
    m.observe_leader({"hit_tokens": 750, "prompt_tokens": 1500})  # cumulative: the deltas are added
    s = scrape(m)
    assert sample(s, "s3kv_prompt_tokens_total") == 1500
    assert sample(s, "s3kv_hit_tokens_total") == 750
    from s3kv.engine.metrics import figures

    f = figures(m.snapshot())
    assert (f["hit_tokens"], f["prompt_tokens"]) == (750, 1500) and f["hit_share"] == 0.5


def test_metrics_server_binds_loopback_by_default():
    m = Metrics()
    server = start_http_server(m, 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()


def test_every_rank_serves_on_its_own_port():
    """TP > 1: rank r serves on base + r and says which rank it is; a scrape reads its figures."""
    from s3kv.engine.metrics import rank_port, read_endpoint, serve_for_rank
    from s3kv.store.embedded import free_port_pair

    base = free_port_pair(set(), offset=1)  # base and base + 1 both free
    ranks = [Metrics(), Metrics()]
    servers = []
    try:
        for r, m in enumerate(ranks):
            m.observe_worker({"bytes_loaded": 100 * (r + 1)})
            servers.append(serve_for_rank(m, base, rank=r, tp_size=2))
        assert [srv.server_port for srv in servers] == [base, base + 1]
        for r in range(2):
            got = read_endpoint(f"http://127.0.0.1:{base + r}/metrics")
            assert got[f's3kv_rank_info{{rank="{r}",tp_size="2"}}'] == 1
            assert got["s3kv_loaded_bytes_total"] == 100 * (r + 1)
    finally:
        for srv in servers:
            srv.shutdown()
    assert serve_for_rank(Metrics(), 0, rank=3) is None and rank_port(0, 3) == 0
    with pytest.raises(ValueError, match="past the last TCP port"):
        rank_port(65535, 1)


def test_a_ranks_unshared_verdicts_are_counted():
    m = Metrics()
    m.observe_worker({"verdicts_unshared": 1}, source="rank1")
    m.observe_worker({"verdicts_unshared": 3}, source="rank1")
    assert sample(scrape(m), "s3kv_verdicts_unshared_total") == 3


def test_store_retries_reach_the_retries_counter_once_per_process():
    """Every retry is counted where it is slept for (``RetryPolicy``); two workers of one process
    observing the same count report it once."""
    from s3kv.store.retrying import RetryingStore, RetryPolicy

    faults = FaultInjectingStore(MemoryStore())
    store = RetryingStore(faults, RetryPolicy(max_attempts=4, base_s=0.0, max_backoff_s=0.0))
    m = Metrics()
    m.observe_worker(_WorkerStats(), "rank0")
    before = sample(scrape(m), "s3kv_store_retries_total", op="put")
    faults.fail_next("put", 2)
    store.put("k", b"x")
    m.observe_worker(_WorkerStats(), "rank0")
    m.observe_worker(_WorkerStats(), "rank1")
    assert sample(scrape(m), "s3kv_store_retries_total", op="put") - before == 2


def test_objects_a_load_found_corrupt_are_rejections():
    m = Metrics()
    m.observe_worker({"objects_quarantined": 2})
    m.observe_worker({"objects_quarantined": 3})
    assert sample(scrape(m), "s3kv_objects_rejected_total", reason="corrupt") == 3


def test_saves_dropped_sums_every_reason_a_save_is_dropped_for():
    """Every report (demo, e2e, replay, fault matrix) prints ``WorkerStats.saves_dropped``; a reason
    left out of it reads as a save kept (the demo's figure once left ``other`` out)."""
    from dataclasses import fields, replace

    from s3kv.engine.worker.stats import worker_stats

    zero = worker_stats({}, None, uploads_pending=0, parked_now=0)
    reasons = [f.name for f in fields(zero) if f.name.startswith("saves_dropped_")]
    assert len(reasons) >= 4
    for i, name in enumerate(reasons):
        assert replace(zero, **{name: i + 1}).saves_dropped == i + 1, name
