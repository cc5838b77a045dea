"""s3kv/core/cost.py: requests as S3 bills them, dollars at list prices, and the counters that feed them."""

from __future__ import annotations

import math

import pytest

from s3kv.config import Settings
from s3kv.core.cost import (
    GiB,
    Gpu,
    MiB,
    Prices,
    Usage,
    cost,
    get_requests,
    put_requests,
    stream_share,
    summary,
    usage_from_stats,
    usd_per_million_tokens_served,
    value,
)
from s3kv.sim import SimCacheConfig, SimEngine, gemma3_like, repeat_workload, shared_prefix_workload
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker


def test_put_requests_single_and_multipart():
    assert put_requests(1) == 1
    # S3KV_MULTIPART_THRESHOLD_MIB's default: a ~430 MB sliding-window tail is one PUT (S3 takes 5 GiB)
    assert put_requests(1024 * MiB - 1) == 1
    # create + 8 parts of 128 MiB + complete
    assert put_requests(1024 * MiB) == 10
    assert put_requests(30 * MiB, threshold=16 * MiB, part_size=8 * MiB) == 2 + 4
    assert put_requests(30 * MiB, threshold=16 * MiB, part_size=16 * MiB) == 2 + 2


def test_get_requests_follow_the_range_split():
    assert get_requests(100) == 1
    assert get_requests(8 * MiB) == 1
    assert get_requests(13 * MiB, split=8 * MiB) == 2  # round(1.6)
    assert get_requests(117 * MiB, split=8 * MiB) == 15
    assert get_requests(26 * MiB) == 2  # S3KV_RANGE_SPLIT_MIB's default: 16
    assert get_requests(117 * MiB, split=64 * MiB) == 2
    # A load's share of the connections caps the parts (ByteRange.parts); 0 is no cap.
    assert get_requests(320 * MiB, cap=4) == 4
    assert get_requests(320 * MiB, cap=32) == 20
    assert get_requests(320 * MiB, cap=0) == 20
    assert get_requests(100, cap=4) == 1


def test_a_loads_objects_share_the_connections_wave_by_wave():
    """32 connections, 8 objects read at once: a lone object keeps all of them; a load of 9 reads
    8 with 4 each, then the ninth with all 32 (not alone on 4)."""
    assert stream_share(32, 8, 1) == 32
    assert [stream_share(32, 8, 3, i) for i in range(3)] == [10, 10, 10]
    assert [stream_share(32, 8, 9, i) for i in range(9)] == [4] * 8 + [32]
    assert [stream_share(32, 8, 12, i) for i in range(12)] == [4] * 8 + [8] * 4
    assert stream_share(4, 8, 16, 3) == 1  # never below one request


def test_cost_at_list_prices():
    p = Prices()
    assert (p.put_per_1k, p.get_per_1k, p.gb_month, p.retention_h) == (0.005, 0.0004, 0.023, 1.0)
    p = Prices(retention_h=30 * 24)
    c = cost(Usage(put_requests=2000, get_requests=5000, head_requests=10_000, bytes_stored=100 * GiB), p)
    assert math.isclose(c.put_usd, 0.01)
    assert math.isclose(c.get_usd, 0.002)
    assert math.isclose(c.head_usd, 0.004)
    # 100 GB for 30 days at $0.023 per GB-month (a month = 365.25 / 12 days)
    assert math.isclose(c.storage_usd, 100 * 0.023 * 30 / (365.25 / 12))
    assert math.isclose(c.total_usd, c.requests_usd + c.storage_usd)


def test_dollars_per_million_tokens_served():
    u = Usage(put_requests=1000, get_requests=0, head_requests=0, bytes_stored=0, tokens_served=2_000_000)
    assert math.isclose(usd_per_million_tokens_served(u, Prices()), 0.005 / 2)
    assert usd_per_million_tokens_served(Usage(), Prices()) is None
    free = Prices(0, 0, 0, 0)
    assert usd_per_million_tokens_served(u, free) == 0.0


def test_prices_refuse_nonsense():
    with pytest.raises(ValueError, match="put_per_1k"):
        Prices(put_per_1k=-1)
    with pytest.raises(ValueError, match="retention_h"):
        Prices(retention_h=float("nan"))


def test_prices_from_settings():
    s = Settings(url="memory://x", cost_put_per_1k_usd=0.001, retention_h=24)
    p = Prices.from_settings(s)
    assert p.put_per_1k == 0.001 and p.retention_h == 24 and p.get_per_1k == 0.0004


def test_the_value_line():
    g = Gpu()
    # The default MFU reproduces the H200 measurement: 81-90 us per token of Gemma-3-27B prefill.
    from s3kv.tools.models import GEMMA3_27B

    for n in (4096, 32768):
        assert 75e-6 < g.seconds(GEMMA3_27B.prefill_flops(n)) / n < 90e-6
    assert math.isclose(g.usd(g.peak_tflops * 1e12 * g.mfu * 3600), g.usd_per_hour)
    v = value(0.5, 2.0)
    assert v == {"s3_usd": 0.5, "gpu_usd_saved": 2.0, "ratio": 0.25}
    assert value(1.0, 0.0)["ratio"] is None
    with pytest.raises(ValueError, match="mfu"):
        Gpu(mfu=1.5)


def _engine(store, **settings):
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, blocks_per_object=2,
                 **{"lookup_timeout_s": 5.0, **settings})
    return SimEngine(
        gemma3_like(64, kv_heads=2),
        SimCacheConfig(tokens_per_block=16, max_seq_len=1024),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        connector_kwargs=dict(settings=s, store=store),
    )


def test_connector_counters_feed_the_estimate():
    """A cold and a warm cluster: the stats count every PUT and GET the store saw, and tokens."""
    from s3kv.store.instrument import InstrumentedStore

    store = InstrumentedStore(MemoryStore())
    specs = shared_prefix_workload(n_users=3, system_len=128, user_len=40)
    with _engine(store) as cold:
        cold.run(specs)
        for w in cold.workers:
            assert w.flush(30)
        cw = cold.workers[0].core.stats()
        cl = cold.leader.core.stats
    io = store.snapshot()
    assert cw.put_requests == io.put > 0  # tiny objects: one PUT each
    assert cl.tokens_saved > 0
    before = store.snapshot()
    with _engine(store) as warm:
        rep = warm.run(repeat_workload(specs, 100))
        ww = warm.workers[0].core.stats()
        wl = warm.leader.core.stats
    io = store.snapshot() - before
    assert rep.matched_tokens > 0 and rep.kv_mismatches == 0
    assert ww.get_requests == io.get > 0
    u = usage_from_stats(wl, [ww], head_requests=io.head)
    assert u.tokens_served == wl.hit_tokens == rep.matched_tokens
    assert u.get_requests == io.get and u.head_requests == io.head
    figures = summary(u)
    assert figures["usd_per_1m_tokens_served"] is not None and figures["usd_per_1m_tokens_served"] > 0
    assert figures["get_per_1k_tokens_served"] == pytest.approx(1000 * io.get / rep.matched_tokens)


def test_multipart_counted_at_the_configured_threshold():
    from s3kv.transfer.upload import Uploader

    up = Uploader(MemoryStore(), threads=1)
    try:
        assert (up.multipart_threshold, up.part_size) == (1024 * MiB, 128 * MiB)
    finally:
        up.close()
    store = MemoryStore()
    with _engine(store, multipart_threshold_mib=5, multipart_part_mib=5) as eng:
        assert eng.workers[0].core._uploader.multipart_threshold == 5 * MiB
        assert eng.workers[0].core._uploader.part_size == 5 * MiB
