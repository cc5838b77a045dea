"""Operator CLI and metrics over objects written by the connector itself, on a real S3 server."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner

from s3kv.cli import main
from s3kv.config import Settings
from s3kv.core.keys import parse_key
from s3kv.sim import SimCacheConfig, SimEngine, gemma3_like, repeat_workload, shared_prefix_workload
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker


@pytest.fixture(scope="module")
def written(moto_s3):
    """A cold and a warm cluster through the real adapter; returns the URL, keys and metrics."""
    prefix = f"ops-{uuid.uuid4().hex[:8]}"
    store = moto_s3.make_store()
    specs = shared_prefix_workload(n_users=3, system_len=160, user_len=64)
    metrics = {}
    for role, wl in (("cold", specs), ("warm", repeat_workload(specs, 100))):
        # A generous lookup budget: the assertions count hits, and moto on a busy 2-core machine can
        # take longer than the default 50 ms (then a lookup is a miss, by design).
        s = Settings(url=moto_s3.store_url(prefix), staging_mib=32, check_access=False, lookup_timeout_s=5)
        eng = SimEngine(gemma3_like(64), SimCacheConfig(tokens_per_block=16, max_seq_len=1024),
                        S3KvConnectorLeader, S3KvConnectorWorker, tp_size=2,
                        connector_kwargs=dict(settings=s, store=store, key_prefix=prefix,
                                              engine_key=f"ops-{role}-{prefix}"))
        with eng:
            rep = eng.run(wl)
            for w in eng.workers:
                assert w.flush(60)
                w.observe_metrics()
            eng.leader._runtime.observe(leader_stats=eng.leader.core.stats)
            metrics[role] = (rep, eng.workers[0].metrics)
    keys = [i.key for i in moto_s3.make_store().list(prefix + "/")]
    return moto_s3, prefix, keys, metrics


def _cli(s3, prefix, *args):
    env = s3.env(prefix)
    res = CliRunner().invoke(main, [*args, "--json"], env=env, catch_exceptions=False)
    return res.exit_code, (json.loads(res.output) if res.output.strip().startswith("{") else res.output)


def test_metrics_after_a_workload(written):
    _, _, _, metrics = written
    rep, m = metrics["warm"]
    assert rep.kv_mismatches == 0 and rep.matched_tokens > 0
    assert m.value("s3kv_lookups_total") == 3
    assert m.value("s3kv_lookup_hits_total") == 3
    assert m.value("s3kv_hit_tokens_total") == rep.matched_tokens
    assert m.value("s3kv_store_requests_total", op="head") > 0
    assert m.value("s3kv_store_requests_total", op="get") > 0
    assert m.value("s3kv_pages_loaded_total") > 0
    assert m.value("s3kv_breaker_state") == 0
    cold_rep, cm = metrics["cold"]
    assert cm.value("s3kv_objects_saved_total") > 0
    assert cm.value("s3kv_store_requests_total", op="put") >= cm.value("s3kv_objects_saved_total")
    assert cm.value("s3kv_lookup_misses_total") == 3


def test_ls_stats_verify_gc_on_connector_objects(written):
    s3, prefix, keys, _ = written
    parsed = [parse_key(k) for k in keys]
    assert keys and all(p is not None for p in parsed)
    namespaces = {p.namespace for p in parsed}
    assert len(namespaces) == 1
    ns = namespaces.pop()

    code, ls = _cli(s3, prefix, "ls")
    assert code == 0 and ls["total"]["objects"] == len(keys)
    assert [n["namespace"] for n in ls["namespaces"]] == [ns]

    code, st = _cli(s3, prefix, "stats", "--deep")
    assert code == 0
    groups = st["namespaces"][0]["groups"]
    assert {(g["shard"], g["tp_size"]) for g in groups} == {(0, 2), (1, 2)}  # TP=2 wrote both shards
    assert sum(g["objects"] for g in groups) == len(keys)
    # Cost figures at list prices: storage a month from the bytes, bytes per stored token.
    total = st["total"]["bytes"]
    assert abs(st["cost"]["storage_usd_per_month"] - total / 2**30 * 0.023) < 1e-3
    tokens = max(g["pages"] * g["tokens_per_block"] for g in groups)
    assert st["cost"]["bytes_per_token"] == round(total / tokens, 1)
    # The value line: the GPU-hours a month of saved prefill at which keeping it pays ($3 / GPU-h).
    assert st["cost"]["break_even_gpu_hours_per_month"] == pytest.approx(total / 2**30 * 0.023 / 3, abs=1e-4)

    code, ver = _cli(s3, prefix, "verify")
    assert code == 0 and ver["checked"] == len(keys) and ver["bad_count"] == 0

    # Flip one byte of one object behind the connector's back: verify names it.
    victim = keys[0]
    client = s3.client()
    body = bytearray(client.get_object(Bucket=s3.bucket, Key=victim)["Body"].read())
    meta = client.head_object(Bucket=s3.bucket, Key=victim)["Metadata"]
    body[-1] ^= 0xFF
    client.put_object(Bucket=s3.bucket, Key=victim, Body=bytes(body), Metadata=meta)
    code, ver = _cli(s3, prefix, "verify")
    assert code == 1 and [b["key"] for b in ver["bad"]] == [victim] and ver["bad"][0]["reason"] == "checksum"

    code, dry = _cli(s3, prefix, "gc", "--namespace", ns, "--dry-run")
    assert code == 0 and dry["matched"]["objects"] == len(keys)
    assert len(list(s3.make_store().list(prefix + "/"))) == len(keys)
    code, gc = _cli(s3, prefix, "gc", "--namespace", ns)
    assert code == 0 and gc["deleted"]["objects"] == len(keys)
    assert list(s3.make_store().list(prefix + "/")) == []
