"""Retention that matches reuse: ``s3kv gc --expired/--older-than`` deletes by LastModified, and an
engine's refresh on hit (a copy of the object onto itself) keeps a hot prefix alive -- against the
embedded S3 server, with gc's clock injected (no real hours slept)."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from test_ops_cli import NS_A, _put, cli

from s3kv.config import Settings
from s3kv.core.cost import expiry_age_s
from s3kv.core.keys import KeyScheme
from s3kv.store.embedded import EmbeddedS3
from s3kv.store.memory import MemoryStore
from s3kv.store.refresh import RefreshOnHit
from s3kv.tools.ops import Duration

BUCKET = "s3kv-retention-test"
PREFIX = "kv"


@pytest.fixture(scope="module")
def server():
    with EmbeddedS3("moto", bucket=BUCKET) as s:
        yield s


def test_gc_drops_what_expired_and_keeps_a_prefix_refreshed_on_hit(server):
    store = server.make_store()
    scheme = KeyScheme(PREFIX, NS_A, tp_size=1)
    cold = _put(store, scheme, "c0c0c0c0c0c0c0c0", 0, 64, 0, 4)
    hot = _put(store, scheme, "d0d0d0d0d0d0d0d0", 0, 64, 0, 4)
    before = store.head(hot.key)
    body = store.get(hot.key)
    time.sleep(1.2)  # LastModified counts whole seconds
    engine_side = RefreshOnHit(store, interval_s=0.0, background=False)
    engine_side.note_verified(hot.key)  # a hit: the engine loaded it and its checks passed
    assert engine_side.refreshed == 1
    after = store.head(hot.key)
    lm_cold = store.head(cold.key).last_modified
    assert after.last_modified > before.last_modified >= lm_cold - 1
    # The copy kept the bytes and the metadata (the integrity of the object is unchanged).
    assert store.get(hot.key) == body and dict(after.metadata) == dict(before.metadata)

    # An hour (plus the index_ttl_s an engine trusts a HEAD and a 60 s margin) later by gc's clock,
    # minus what separates the two: the cold object is that + ~1 s old, the refreshed one - 0.5 s.
    age = expiry_age_s(Settings(retention_h=1.0))
    assert age == 3600 + Settings().index_ttl_s + 60
    now = after.last_modified + age - 0.5
    env = {**server.env(PREFIX), "S3KV_RETENTION_H": "1"}
    r = CliRunner().invoke(cli(), ["gc", "--expired", "--now", str(now), "--yes", "--json"], env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["deleted"]["objects"] == 1 and doc["older_than_s"] == age
    assert store.head(cold.key) is None
    assert store.head(hot.key) is not None
    store.close()


def test_refresh_is_rate_limited_per_object():
    t = [0.0]
    inner = MemoryStore()
    touched: list[str] = []
    real_touch = inner.touch
    inner.touch = lambda key, age=0.0: touched.append(key) or real_touch(key, age)  # type: ignore[method-assign]
    s = RefreshOnHit(inner, interval_s=1800, clock=lambda: t[0], background=False)
    s.put("own", b"x" * 8)
    inner.put("theirs", b"y" * 8)  # written by another cluster
    s.note_verified("own")  # this engine wrote it a moment ago: young enough
    s.note_verified("theirs")  # age unknown here: refreshed once...
    s.note_verified("theirs")  # ...not on every hit
    assert touched == ["theirs"]
    t[0] = 1801.0
    s.note_verified("own")
    s.note_verified("theirs")
    assert touched == ["theirs", "own", "theirs"]


def test_a_load_refreshes_only_an_object_that_passed_its_checks():
    """Issue 37: refresh on hit ran after the GET and before the bytes were verified, so a
    garbage object that a load read (and refused) had its life extended by a copy. Now only a
    load whose header and pages passed refreshes; a failed one touches nothing."""
    from test_worker import _saved, load_md, make_core, step

    mem = MemoryStore()
    touched: list[str] = []
    real_touch = mem.touch
    mem.touch = lambda key, age=0.0: touched.append(key) or real_touch(key, age)  # type: ignore[method-assign]
    good, d_good, _ = _saved(mem, seed=1)
    bad, d_bad, _ = _saved(mem, n=4, seed=3)
    mem.corrupt(bad, len(mem.get(bad)) - 5)  # a flipped bit in its last page: a checksum mismatch
    engine_side = RefreshOnHit(mem, interval_s=0.0, background=False)
    b, _ = make_core(engine_side, seed=2)
    try:
        step(b, load_md(7, 0, d_bad, ((0, 4),), range(4), [10, 11, 12, 13]))
        assert b.take_failed_load_request_ids() == {7}
        assert touched == [] and engine_side.refreshed == 0  # garbage read, refused, not refreshed
        step(b, load_md(8, 0, d_good, ((0, 3),), range(3), [20, 21, 22]))
        assert b.take_failed_load_request_ids() == set()
        assert touched == [good] and engine_side.refreshed == 1
    finally:
        b.close()


def test_a_refresh_that_fails_is_dropped_never_raised():
    class Broken(MemoryStore):
        def touch(self, key: str, min_age_s: float = 0.0) -> str:
            from s3kv.store.base import TransientError

            raise TransientError("copy failed", key=key)

    inner = Broken()
    inner.put("k", b"abc")
    s = RefreshOnHit(inner, interval_s=0.0, background=False)
    s.note_verified("k")
    assert s.dropped == 1 and s.refreshed == 0


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172800), ("1", 86400), ("0", 0)]
)
def test_gc_ages(text, seconds):
    assert Duration().convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["1w", "-1h", "h", "nan", "inf"])
def test_gc_rejects_a_bad_age_in_one_line(text, tmp_path):
    r = CliRunner().invoke(cli(), ["gc", "--url", f"file://{tmp_path}", "--older-than", text])
    assert r.exit_code == 2 and "is not an age" in r.output


def test_an_engine_refreshes_what_it_loads_and_gc_keeps_it(tmp_path):
    """End to end on a file:// cache: a cold cluster saves; three hours pass (mtimes set back);
    a warm cluster is served a shared prefix -- its loads refresh those objects -- and
    ``s3kv gc --expired`` (1 h) then deletes everything else; a third cluster still hits."""
    import os

    from s3kv.config import Settings
    from s3kv.sim import SimCacheConfig, SimEngine, gemma3_like, repeat_workload, shared_prefix_workload
    from s3kv.store.fsspec_store import FsspecStore
    from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    url = f"file://{tmp_path}/cache"

    def engine(store):
        s = Settings(url=url, staging_mib=64, check_access=False, blocks_per_object=2, lookup_timeout_s=5.0,
                     retention_h=1.0)
        return SimEngine(gemma3_like(64, kv_heads=2), SimCacheConfig(tokens_per_block=16, max_seq_len=1024),
                         S3KvConnectorLeader, S3KvConnectorWorker, connector_kwargs=dict(settings=s, store=store))

    store = FsspecStore(url)
    specs = shared_prefix_workload(n_users=3, system_len=128, user_len=40)
    with engine(store) as cold:
        cold.run(specs)
        for w in cold.workers:
            assert w.flush(30)
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cache") for f in fs]
    old = time.time() - 3 * 3600
    for f in files:
        os.utime(f, (old, old))
    with engine(store) as warm:
        rep = warm.run(repeat_workload(specs[:1], 100))  # one user again: its prefix is loaded
        assert rep.matched_tokens > 0 and rep.kv_mismatches == 0
        refresher = warm.leader._runtime.store  # the engine's store stack
        while not isinstance(refresher, RefreshOnHit):
            refresher = refresher.inner
        assert refresher.wait_idle(10)
        assert refresher.refreshed > 0
    young = [f for f in files if os.path.getmtime(f) > old + 60]
    assert 0 < len(young) < len(files)
    r = CliRunner().invoke(cli(), ["gc", "--url", url, "--expired", "--yes", "--json"], env={"S3KV_RETENTION_H": "1"})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["deleted"]["objects"] == len(files) - len(young)
    assert sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cache") for f in fs) == sorted(young)
    with engine(store) as third:
        rep = third.run(repeat_workload(specs[:1], 200))
        assert rep.matched_tokens > 0 and rep.kv_mismatches == 0


def test_gc_watch_runs_a_pass_every_period(tmp_path, monkeypatch):
    """``--watch 10m``: one JSON line per pass, then it sleeps the period (here: stopped after two)."""
    import s3kv.tools.ops as ops
    from s3kv.store.fsspec_store import FsspecStore

    url = f"file://{tmp_path}/cache"
    store = FsspecStore(url)
    _put(store, KeyScheme("", NS_A, tp_size=1), "e0e0e0e0e0e0e0e0", 0, 64, 0, 2)
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 2:
            raise KeyboardInterrupt

    # gc's own clock module, not the global time.sleep: a thread another test left behind may
    # sleep meanwhile (a 0.001 s sleep once landed here in CI).
    import types

    monkeypatch.setattr(ops, "time", types.SimpleNamespace(time=time.time, monotonic=time.monotonic, sleep=sleep))
    r = CliRunner().invoke(cli(), ["gc", "--url", url, "--older-than", "1h", "--watch", "10m", "--json",
                                   "--now", str(time.time() + 7200)])
    passes = [json.loads(line) for line in r.stdout.splitlines()]
    assert slept == [600.0, 600.0] and len(passes) == 2
    assert passes[0]["deleted"]["objects"] == 1 and passes[1]["deleted"]["objects"] == 0


def test_gc_expired_outlives_what_an_engine_may_still_believe(tmp_path):
    """An engine promises loads from a HEAD up to index_ttl_s old (a listing up to
    lookup_summary_trust_s): an object it saw young must not be deleted before that runs out."""
    from s3kv.store.fsspec_store import FsspecStore

    url = f"file://{tmp_path}/cache"
    _put(FsspecStore(url), KeyScheme("", NS_A, tp_size=1), "e0e0e0e0e0e0e0e0", 0, 64, 0, 2)
    env = {"S3KV_RETENTION_H": "1", "S3KV_INDEX_TTL_S": "120", "S3KV_LOOKUP_SUMMARY_TRUST_S": "30"}

    def gc(age: float) -> dict:
        r = CliRunner().invoke(cli(), ["gc", "--url", url, "--expired", "--dry-run", "--json",
                                       "--now", str(time.time() + age)], env=env)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    kept = gc(3600 + 120 + 30)  # past the retention, within what an engine may believe
    assert kept["older_than_s"] == 3600 + 120 + 30 + 60 and kept["matched"]["objects"] == 0
    assert gc(3600 + 120 + 30 + 62)["matched"]["objects"] == 1


def test_a_write_that_found_another_writers_object_does_not_count_as_fresh():
    """put() -> False: the object there is another writer's, of unknown age; this engine's first
    hit must refresh it (else it expires while this engine reads it)."""
    t = [0.0]
    inner = MemoryStore()
    inner.put("k", b"x" * 8)  # another cluster's, stored long ago
    touched: list[str] = []
    real_touch = inner.touch
    inner.touch = lambda key, age=0.0: touched.append(key) or real_touch(key, age)  # type: ignore[method-assign]
    s = RefreshOnHit(inner, interval_s=1800, clock=lambda: t[0], background=False)
    assert s.put("k", b"x" * 8) is False
    s.note_verified("k")
    assert touched == ["k"]


def test_outcomes_are_counted_and_a_refused_copy_warns_once(caplog):
    from s3kv.engine.metrics import Metrics
    from s3kv.store.base import PermissionDenied

    class Refusing(MemoryStore):
        def touch(self, key: str, min_age_s: float = 0.0) -> str:
            raise PermissionDenied("S3 copy: AccessDenied (HTTP 403)", key=key)

    m = Metrics()
    inner = Refusing()
    for k in ("a", "b"):
        inner.put(k, b"abc")
    s = RefreshOnHit(inner, interval_s=0.0, background=False, on_outcome=m.on_refresh)
    with caplog.at_level("WARNING", logger="s3kv.store.refresh"):
        s.note_verified("a")
        s.note_verified("b")
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "enforce_write_once" in warnings[0].getMessage()
    assert m.registry.get_sample_value("s3kv_refresh_total", {"outcome": "denied"}) == 2

    ok = RefreshOnHit(MemoryStore(), interval_s=0.0, background=False, on_outcome=m.on_refresh)
    ok.inner.put("c", b"abc")
    ok.note_verified("c")
    assert m.registry.get_sample_value("s3kv_refresh_total", {"outcome": "refreshed"}) == 1


def test_a_copy_refused_by_a_write_once_policy_is_denied(server, monkeypatch):
    """AWS answers 501 to a CopyObject a write-once policy forces to carry If-None-Match (403
    without it): both are a refusal by configuration, not a transient fault to retry."""
    import botocore.exceptions as bexc

    from s3kv.store.base import PermissionDenied

    store = server.make_store()
    store.put("kv/refused", b"abc")

    def refuse(**kw):
        raise bexc.ClientError({"Error": {"Code": "NotImplemented", "Message": "no"},
                                "ResponseMetadata": {"HTTPStatusCode": 501}}, "CopyObject")

    monkeypatch.setattr(store._client, "copy_object", refuse)
    with pytest.raises(PermissionDenied):
        store.touch("kv/refused")
    store.close()


def test_touch_skips_the_copy_of_an_object_refreshed_recently(server):
    store = server.make_store()
    store.put("kv/young", b"abc")
    before = store.head("kv/young")
    time.sleep(1.1)
    assert store.touch("kv/young", 1800.0) == "young"
    assert store.head("kv/young").last_modified == before.last_modified
    assert store.touch("kv/young", 0.5) == "refreshed"
    assert store.head("kv/young").last_modified > before.last_modified
    store.close()


def test_touch_does_not_copy_an_object_replaced_after_its_head(seaweed_s3, monkeypatch):
    """gc deletes the object and another writer stores it again between touch's HEAD and its
    copy: the copy is conditional on the HEAD's ETag, so the new object is left alone.
    (SeaweedFS: moto ignores x-amz-copy-source-if-match.)"""
    store = seaweed_s3.make_store()
    store.put("kv/raced", b"old")
    real_copy = store._client.copy_object

    def copy(**kw):
        store.delete_many(["kv/raced"])
        store.put("kv/raced", b"new", {"s3kv-w": "2"})
        return real_copy(**kw)

    monkeypatch.setattr(store._client, "copy_object", copy)
    assert store.touch("kv/raced") == "gone"
    assert dict(store.head("kv/raced").metadata) == {"s3kv-w": "2"}
    store.close()


def test_touch_keeps_the_objects_encryption(server):
    """The copy re-encrypts: it must ask for the object's encryption, not the engine's settings."""
    from s3kv.store.s3 import S3Options

    writer = server.make_store(options=S3Options(sse="AES256"))
    writer.put("kv/sse", b"abc")
    plain = server.make_store()
    assert plain.touch("kv/sse") == "refreshed"
    assert server.client().head_object(Bucket=BUCKET, Key="kv/sse").get("ServerSideEncryption") == "AES256"
    writer.close()
    plain.close()


def test_the_write_once_policy_says_it_turns_refresh_off():
    """The module's enforce_write_once denies CopyObject (403; 501 with If-None-Match), so refresh
    on hit cannot work under it: its README and docs/operations.md must say so, and not that
    s3kv never copies."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    module = (root / "infra/terraform/modules/s3kv-bucket/README.md").read_text()
    ops = (root / "docs/operations.md").read_text()
    assert "never copies" not in module
    for text in (module, ops):
        assert "S3KV_REFRESH_ON_HIT" in text and "enforce_write_once = false" in text
