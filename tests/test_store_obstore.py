"""The obstore S3 client (s3kv/store/obstore_store.py) on real loopback servers.

The generic contract runs in test_store_contract.py (moto-obstore, seaweedfs-obstore); here
what is specific to this client: the multipart hand-off to boto3 stays write-once, SSE and
the HEAD-then-PUT fallback reach the wire, the factory's choice, the AWS env chain, and the
wire faults of test_faultproxy.py under this client.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any

import pytest
from test_faultproxy import OPTS, STALL_OPTS, run_ops, verify_behind

from s3kv.store.base import (
    ByteRange,
    DeadlineExceeded,
    ObjectChanged,
    PermissionDenied,
    StoreConfigError,
    StoreError,
)
from s3kv.store.embedded import EmbeddedS3
from s3kv.store.factory import make_s3_store, open_store
from s3kv.store.faultproxy import FaultProxy, WireFaultPlan
from s3kv.store.obstore_store import ObstoreS3Store
from s3kv.store.retrying import RetryPolicy
from s3kv.store.s3 import MiB, S3Options, S3Store

pytest.importorskip("obstore")

TEST_OPTS = S3Options(
    max_concurrency=8,
    connect_timeout_s=2.0,
    read_timeout_s=20.0,
    retry=RetryPolicy(max_attempts=4, base_s=0.005, max_backoff_s=0.05, deadline_s=10.0),
    multipart_threshold=5 * MiB,
    part_size=5 * MiB,
    range_split_bytes=1 * MiB,
)


def _native(server: EmbeddedS3, options: S3Options = TEST_OPTS, **kw: Any) -> ObstoreS3Store:
    args: dict[str, Any] = {
        "endpoint_url": server.endpoint_url,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        **kw,
    }
    return ObstoreS3Store(server.bucket, options=options, **args)


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"ob/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")


def _uploads(server: EmbeddedS3, key: str) -> list[Any]:
    r = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=key)
    return r.get("Uploads", [])


def test_multipart_is_write_once_through_the_boto3_hand_off(server: EmbeddedS3, prefix: str) -> None:
    with _native(server) as store:
        size = 12 * MiB + 777
        body = bytearray(os.urandom(size))
        cuts = [0, 3, 6 * MiB + 1, size]
        parts = [memoryview(body)[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        k = f"{prefix}/big"
        assert store.put(k, parts, {"Layout": "v1"}) is True
        info = store.head(k)
        assert info is not None and info.size == size and info.metadata == {"layout": "v1"}
        got = bytearray(size)
        store.get_ranges_into(k, [ByteRange(0, size)], [memoryview(got)])
        assert got == body
        # A second large writer: False, the first body stays, no upload left open.
        assert store.put(k, os.urandom(6 * MiB)) is False
        # Past the pre-upload HEAD (a race): CompleteMultipartUpload's If-None-Match says 412.
        store._boto._head_one = lambda key: None  # type: ignore[method-assign]
        assert store.put(k, os.urandom(6 * MiB)) is False
        assert store.get_ranges(k, [ByteRange(0, 64)])[0] == bytes(body[:64])
        assert _uploads(server, k) == []
        # Small bodies are one conditional PUT through obstore: also never an overwrite.
        small = f"{prefix}/small"
        assert store.put(small, [b"abc", memoryview(b"def")]) is True
        assert store.put(small, b"zzzzzz") is False
        assert store.get(small) == b"abcdef"


def test_sse_reaches_the_wire(moto_s3: EmbeddedS3, prefix: str) -> None:
    with _native(moto_s3, dataclasses.replace(TEST_OPTS, sse="AES256")) as store:
        k = f"{prefix}/sse"
        assert store.put(k, b"secret-ish") is True
        head = moto_s3.client().head_object(Bucket=moto_s3.bucket, Key=k)
        assert head["ServerSideEncryption"] == "AES256"


def test_conditional_fallback_never(server: EmbeddedS3, prefix: str) -> None:
    with _native(server, dataclasses.replace(TEST_OPTS, conditional_put="never")) as store:
        k = f"{prefix}/fallback"
        assert store.put(k, b"v1") is True
        assert store.put(k, b"v2") is False  # HEAD-then-PUT: it saw the object
        assert store.get(k) == b"v1"


def test_not_implemented_switches_to_fallback(moto_s3: EmbeddedS3, prefix: str) -> None:
    """A server answering 501 to If-None-Match: the store falls back (auto) or refuses (always)."""
    from obstore.exceptions import GenericError

    with _native(moto_s3) as store:
        import obstore

        real = obstore.put
        calls = [0]

        def old_server(st: Any, key: str, body: Any, **kw: Any) -> Any:
            if kw.get("mode") == "create":
                calls[0] += 1
                raise GenericError("Server returned non-2xx status code: 501 Not Implemented: If-None-Match")
            return real(st, key, body, **kw)

        store._obs = _Shim(obstore, put=old_server)
        k = f"{prefix}/old-server"
        assert store.put(k, b"v1") is True
        assert store.put(k, b"v2") is False
        assert calls[0] == 1 and store.get(k) == b"v1"


class _Shim:
    def __init__(self, module: Any, **over: Any):
        self._m = module
        self._over = over

    def __getattr__(self, name: str) -> Any:
        return self._over.get(name, getattr(self._m, name))


def test_missing_key_and_past_end(server: EmbeddedS3, prefix: str) -> None:
    with _native(server) as store:
        k = f"{prefix}/k"
        store.put(k, b"0123456789")
        assert store.head(f"{prefix}/none") is None
        with pytest.raises(StoreError):
            store.get_ranges(k, [ByteRange(8, 5)])  # runs past the end: never short bytes
        with pytest.raises(StoreError):
            store.get_ranges(k, [ByteRange(20, 1)])  # starts past the end (416)


def test_wrong_keys_are_permission_denied_on_seaweedfs(seaweed_s3: EmbeddedS3) -> None:
    with _native(seaweed_s3, aws_access_key_id="wrong", aws_secret_access_key="wrong") as store:
        with pytest.raises(PermissionDenied):
            store.get_ranges("x/y", [ByteRange(0, 1)])
        batch = store.head_many(["x/y"])
        assert isinstance(batch.failed["x/y"], PermissionDenied)


def test_deadline_when_nobody_listens(closed_port: int) -> None:
    opts = dataclasses.replace(TEST_OPTS, retry=RetryPolicy(max_attempts=3, base_s=0.001, deadline_s=2))
    store = ObstoreS3Store(
        "s3kv-nowhere", endpoint_url=f"http://127.0.0.1:{closed_port}", options=opts,
        aws_access_key_id="k", aws_secret_access_key="s",
    )
    with store:
        with pytest.raises(DeadlineExceeded) as info:
            store.get_ranges("a/b", [ByteRange(0, 1)])
        assert "a/b" in str(info.value)
        assert isinstance(store.head_many(["a/b"]).failed["a/b"], DeadlineExceeded)
        batch = store.head_many(["a/1", "a/2", "a/3"])  # a wave (the event loop's path)
    assert set(batch.failed) == {"a/1", "a/2", "a/3"}
    assert all(isinstance(e, DeadlineExceeded) and k in str(e) for k, e in batch.failed.items())


def test_factory_picks_the_client(moto_s3: EmbeddedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in moto_s3.env().items():
        monkeypatch.setenv(k, v)  # the usual AWS env chain: AWS_ENDPOINT_URL_S3, keys, region
    with open_store(moto_s3.store_url("p")) as auto:
        assert isinstance(auto, ObstoreS3Store) and auto.endpoint_url == moto_s3.endpoint_url
        auto.check_access()
        assert auto.put("p/env", b"1") is True and auto.head("p/env") is not None
    boto = open_store(moto_s3.store_url("p"), options=S3Options(client="boto3"))
    with boto:
        assert isinstance(boto, S3Store) and boto.head("p/env") is not None
    monkeypatch.setattr("s3kv.store.obstore_store.available", lambda: False)
    assert isinstance(make_s3_store(moto_s3.bucket), S3Store)  # auto without obstore: boto3
    with pytest.raises(StoreError, match="S3KV_S3_CLIENT"):
        make_s3_store(moto_s3.bucket, options=S3Options(client="obstore"))
    with pytest.raises(ValueError, match="client"):
        S3Options(client="curl")  # type: ignore[arg-type]


# -- wire faults (s3kv/store/faultproxy.py) under this client ------------------------------


def _through(server: EmbeddedS3, px: FaultProxy, options: S3Options) -> ObstoreS3Store:
    return ObstoreS3Store(
        server.bucket, endpoint_url=px.endpoint_url, options=options,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
    )


@pytest.mark.parametrize("fault", ["slowdown_503", "error_500", "reset", "stall", "truncate", "truncate_head"])
def test_fault_at_30_percent(moto_s3: EmbeddedS3, proxies: list, prefix: str, fault: str) -> None:
    stall = fault == "stall"
    px = FaultProxy.for_url(moto_s3.endpoint_url, WireFaultPlan(**{fault: 0.3}, stall_s=1.0), seed=11).start()
    proxies.append(px)
    with _through(moto_s3, px, STALL_OPTS if stall else OPTS) as store:
        out = run_ops(store, prefix, 50, big=0 if stall else 6 * MiB)
    verify_behind(moto_s3, out)
    st = px.stats()
    assert st["faults"][fault] >= 5, st
    assert out.ok >= 40, [str(e) for e in out.errors]


def test_outage_fails_fast_and_recovers(moto_s3: EmbeddedS3, proxies: list, prefix: str) -> None:
    import time

    px = FaultProxy.for_url(moto_s3.endpoint_url).start()
    proxies.append(px)
    with _through(moto_s3, px, OPTS) as store:
        store.put(f"{prefix}/k", b"v" * 10)
        px.set_down(True, mode="503")
        for op in (lambda: store.get(f"{prefix}/k"), lambda: store.put(f"{prefix}/k2", b"x")):
            t0 = time.monotonic()
            with pytest.raises(StoreError):
                op()
            assert time.monotonic() - t0 < 3.0
        px.set_down(False)
        assert store.get(f"{prefix}/k") == b"v" * 10
        assert store.put(f"{prefix}/k2", b"x") is True


def test_seaweedfs_through_proxy(seaweed_s3: EmbeddedS3, proxies: list, prefix: str) -> None:
    px = FaultProxy.for_url(
        seaweed_s3.endpoint_url, WireFaultPlan(slowdown_503=0.1, error_500=0.1, reset=0.1, truncate=0.1), seed=3
    ).start()
    proxies.append(px)
    with _through(seaweed_s3, px, OPTS) as store:
        out = run_ops(store, prefix, 30, big=6 * MiB)
    verify_behind(seaweed_s3, out)
    assert px.stats()["faults_total"] >= 5 and out.ok >= 25, [str(e) for e in out.errors]


def test_an_object_replaced_mid_read_is_read_again_and_never_called_corrupt(moto_s3: EmbeddedS3, prefix: str) -> None:
    """As test_store_s3's namesake: two ETags in one split read: read again once; twice is
    ObjectChanged (transient), never IntegrityError (quarantined as corrupt)."""
    with _native(moto_s3) as store:
        k = f"{prefix}/retagged"
        body = os.urandom(3 * MiB)
        assert store.put(k, body)
        real = store._get_part
        seen = [0]
        lock = threading.Lock()

        def once(*a: Any) -> str:
            with lock:  # parts run on a pool
                seen[0] += 1
                first = seen[0] == 1
            etag = real(*a)
            return etag + "-before" if first else etag

        store._get_part = once  # type: ignore[method-assign]
        assert store.get_ranges(k, [ByteRange(0, len(body))]) == [body]
        store._get_part = lambda *a: real(*a) + f"-{a[1]}"  # type: ignore[method-assign]
        with pytest.raises(ObjectChanged):
            store.get_ranges(k, [ByteRange(0, len(body))])


def test_a_large_single_put_heads_first_and_skips_a_stored_object(moto_s3: EmbeddedS3, prefix: str) -> None:
    """As test_store_s3's namesake, on object_store's single PUT."""
    import obstore

    opts = dataclasses.replace(TEST_OPTS, head_before_put_bytes=64 * 1024)
    with _native(moto_s3, opts) as store:
        k = f"{prefix}/big"
        assert store.put(k, os.urandom(64 * 1024))
        puts: list[str] = []

        class Counting:
            def __getattr__(self, name: str) -> Any:
                return getattr(obstore, name)

            def put(self, st: Any, key: str, *a: Any, **kw: Any) -> Any:
                puts.append(key)
                return obstore.put(st, key, *a, **kw)

        store._obs = Counting()
        assert store.put(k, os.urandom(64 * 1024)) is False
        assert puts == []


def test_a_failed_part_never_writes_after_the_read_returns(moto_s3: EmbeddedS3, prefix: str) -> None:
    """One part of a split read fails at once while another is still downloading: the call
    must not return before that other part is done, and the other part must not copy into
    the buffer (the downloader frees a failed load's staging, and the next load may own it)."""
    import obstore

    with _native(moto_s3) as store:
        k = f"{prefix}/split"
        body = bytes(range(256)) * (3 * MiB // 256)
        assert store.put(k, body)
        real = obstore.get
        failed = threading.Event()

        def get(st: Any, key: str, options: Any = None, **kw: Any) -> Any:
            start = (options or {}).get("range", (0, 0))[0]
            if start == 0:
                failed.set()
                raise PermissionError("403 Forbidden")  # the first part fails, not retried
            r = real(st, key, options=options, **kw)
            # The other parts' answers arrive after the first part has failed.
            failed.wait(10)
            time.sleep(0.2)
            return r

        store._obs = _Shim(obstore, get=get)
        buf = bytearray(len(body))
        with pytest.raises(StoreError):
            store.get_ranges_into(k, [ByteRange(0, len(body))], [memoryview(buf)])
        time.sleep(0.5)  # a straggler would copy now
        assert not any(buf), "a part wrote into the buffer after the read had failed"


# -- HEAD waves on the event loop ------------------------------------------------------------


@pytest.mark.parametrize("fault", ["slowdown_503", "error_500", "reset", "stall"])
def test_head_wave_answers_every_key_through_faults(
    moto_s3: EmbeddedS3, proxies: list, prefix: str, fault: str
) -> None:
    """A wave of HEADs (the lookup's path) retries each key on its own under the same policy as
    a single request: every stored key is found with its metadata, every other one missing."""
    stall = fault == "stall"
    with _native(moto_s3) as direct:
        stored = [f"{prefix}/in/{i:03d}" for i in range(24)]
        for k in stored:
            assert direct.put(k, b"v", {"s3kv-n": k[-3:]})
    absent = [f"{prefix}/out/{i:03d}" for i in range(24)]
    px = FaultProxy.for_url(
        moto_s3.endpoint_url, WireFaultPlan(**{fault: 0.3}, stall_s=1.0, ops={"HEAD"}), seed=5
    ).start()
    proxies.append(px)
    opts = dataclasses.replace(STALL_OPTS if stall else OPTS, head_concurrency=16)
    with _through(moto_s3, px, opts) as store:
        batch = store.head_many(stored + absent)
    assert px.stats()["faults"][fault] >= 5, px.stats()
    assert not batch.failed, {k: str(e) for k, e in batch.failed.items()}
    assert set(batch.found) == set(stored)
    assert all(batch.found[k].metadata["s3kv-n"] == k[-3:] for k in stored)
    assert set(batch.missing) == set(absent)


def test_head_wave_is_in_flight_at_once_up_to_the_bound(moto_s3: EmbeddedS3, proxies: list, prefix: str) -> None:
    """``head_concurrency`` HEADs are in flight together, whatever ``max_concurrency`` (the
    ranged-GET threads) is: a wave of 32 at 0.4 s per request is one round, not 32/4 = 8; and
    never more than the bound: 12 keys at a bound of 4 take at least 3 rounds."""
    lat = 0.4
    px = FaultProxy.for_url(moto_s3.endpoint_url, WireFaultPlan(latency_s=lat)).start()
    proxies.append(px)
    keys = [f"{prefix}/k{i:02d}" for i in range(32)]
    wide = dataclasses.replace(OPTS, max_concurrency=4, head_concurrency=32)
    with _through(moto_s3, px, wide) as store:
        store.head_many(keys[:2])  # connections and credentials up
        waves = []
        for _ in range(3):  # a descheduled wave on a loaded host is slow once; 4 at a time, always
            t0 = time.monotonic()
            batch = store.head_many(keys)
            waves.append(time.monotonic() - t0)
            assert set(batch.missing) == set(keys)
            if waves[-1] < 3 * lat:
                break
    assert min(waves) < 3 * lat, f"{waves}s for one round of {lat}s"
    narrow = dataclasses.replace(OPTS, max_concurrency=32, head_concurrency=4)
    with _through(moto_s3, px, narrow) as store:
        t0 = time.monotonic()
        batch = store.head_many(keys[:12])
        narrow_s = time.monotonic() - t0
    assert set(batch.missing) == set(keys[:12])
    assert narrow_s >= 3 * lat, f"{narrow_s:.2f}s: more than 4 HEADs were in flight at once"


def test_closing_during_a_head_wave_answers_it(moto_s3: EmbeddedS3, proxies: list, prefix: str) -> None:
    """A wave still waiting when the store closes (a lookup wave that outlived its budget, at
    shutdown) gets every key back as failed at once; it never hangs its thread."""
    px = FaultProxy.for_url(moto_s3.endpoint_url, WireFaultPlan(latency_s=30.0)).start()
    proxies.append(px)
    store = _through(moto_s3, px, OPTS)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(store.head_many([f"{prefix}/a", f"{prefix}/b"])))
    waiter.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    store.close()
    waiter.join(10)
    assert not waiter.is_alive() and time.monotonic() - t0 < 8
    assert set(got[0].failed) == {f"{prefix}/a", f"{prefix}/b"}
    after = store.head_many([f"{prefix}/a", f"{prefix}/b"])  # closed: answered, not raised
    assert set(after.failed) == {f"{prefix}/a", f"{prefix}/b"}


def test_head_width_stays_within_the_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each HEAD in flight holds a socket the engine's own files share: under a low ``ulimit -n``
    the wave's width is cut to a quarter of it, with a warning naming the setting."""
    import resource

    from s3kv.store import obstore_store

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert obstore_store._fd_bounded(512) == 256
    assert "S3KV_LOOKUP_HEAD_CONCURRENCY=512 lowered to 256" in caplog.text
    assert obstore_store._fd_bounded(200) == 200
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert obstore_store._fd_bounded(512) == 512


def test_a_head_wave_that_never_ends_is_given_up(moto_s3: EmbeddedS3, prefix: str) -> None:
    """Past the retry deadline and one attempt's timeouts (plus slack) a wave's caller stops
    waiting: its keys fail with DeadlineExceeded (the loop would have to be wedged for this)."""
    import asyncio

    opts = dataclasses.replace(
        TEST_OPTS, connect_timeout_s=0.1, read_timeout_s=0.1, retry=RetryPolicy(max_attempts=2, deadline_s=0.2)
    )
    with _native(moto_s3, options=opts) as store:
        async def wedged(key: str, slots: Any) -> None:
            await asyncio.sleep(60)

        store._head_async = wedged  # type: ignore[method-assign]
        store._WAVE_SLACK_S = 0.3
        t0 = time.monotonic()
        batch = store.head_many([f"{prefix}/a", f"{prefix}/b"])
        # Given up in about a second; wedged, 60. The bound leaves a loaded CI host its room
        # (3 s failed there once at 4.9 s, with replays running beside the suite).
        assert time.monotonic() - t0 < 20
    assert set(batch.failed) == {f"{prefix}/a", f"{prefix}/b"}
    assert all(isinstance(e, DeadlineExceeded) for e in batch.failed.values())


@pytest.mark.parametrize("value", ["", "0", "two", " 4", "4 ", "99999999999999999999999", "200000"])
def test_a_tokio_thread_count_obstore_cannot_start_with_is_refused_at_start_up(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """obstore's runtime panics on the first request with such a value (Rust's integer parser:
    no spaces, nothing past 64 bits; tokio: not 0); refuse it up front, by name."""
    monkeypatch.setenv("TOKIO_WORKER_THREADS", value)
    with pytest.raises(StoreConfigError, match="TOKIO_WORKER_THREADS"):
        ObstoreS3Store("bkt", endpoint_url="http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b")
    for fine in ("2", "+4"):  # what Rust's parser takes
        monkeypatch.setenv("TOKIO_WORKER_THREADS", fine)
        ObstoreS3Store("bkt", endpoint_url="http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b").close()


def test_a_panic_inside_obstore_is_a_failed_request_not_an_escape(closed_port: int) -> None:
    """A real Rust panic (the runtime refusing its thread count, set after start-up so the check
    above cannot catch it) reaches s3kv as pyo3's PanicException, a BaseException that no
    ``except Exception`` stops: every operation must turn it into a StoreError (a miss, a failed
    load), never let it out to the engine's loop. In a fresh process: the runtime starts once."""
    code = textwrap.dedent(
        f"""
        import os, sys
        from s3kv.store.base import ByteRange, StoreError
        from s3kv.store.obstore_store import ObstoreS3Store
        st = ObstoreS3Store("bkt", endpoint_url="http://127.0.0.1:{closed_port}",
                            aws_access_key_id="a", aws_secret_access_key="b")
        os.environ["TOKIO_WORKER_THREADS"] = ""  # read by the runtime at its first request
        out = []
        batch = st.head_many(["k1", "k2"])  # the wave, on the event loop
        out.append(sorted(type(e).__name__ for e in batch.failed.values()))
        out.append(sorted(type(e).__name__ for e in st.head_many(["k3"]).failed.values()))  # one key: sync
        for op in (lambda: st.get_ranges("k4", [ByteRange(0, 4)]), lambda: st.put("k5", b"x", {{}})):
            try:
                op()
                out.append("no error")
            except StoreError as e:
                out.append(type(e).__name__ + (" panicked" if "panicked" in str(e) else ""))
        print(out)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TOKIO_WORKER_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PanicException" in r.stderr or "panicked" in r.stdout, "no panic happened: the test proves nothing"
    assert r.stdout.strip() == str([["StoreError", "StoreError"], ["StoreError"], "StoreError panicked", "StoreError panicked"]), r.stdout


def test_a_head_loop_that_cannot_start_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread to be had for the HEAD loop (the process is at its limit): the wave's keys fail
    as StoreErrors, nothing escapes, and no event loop is left open per attempt."""
    import asyncio

    from s3kv.store import obstore_store

    made: list[Any] = []
    real_loop = asyncio.new_event_loop

    def tracked() -> Any:
        loop = real_loop()
        made.append(loop)
        return loop

    def no_thread(self: Any) -> None:
        raise RuntimeError("can't start new thread")

    st = ObstoreS3Store("bkt", endpoint_url="http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b")
    try:
        monkeypatch.setattr(obstore_store.asyncio, "new_event_loop", tracked)
        monkeypatch.setattr(obstore_store.threading.Thread, "start", no_thread)
        for _ in range(3):
            batch = st.head_many(["k1", "k2", "k3"])
            assert set(batch.failed) == {"k1", "k2", "k3"}
            assert all(isinstance(e, StoreError) and "HEAD loop" in str(e) for e in batch.failed.values())
        assert len(made) == 3 and all(loop.is_closed() for loop in made)
    finally:
        monkeypatch.undo()
        st.close()


def test_a_forked_child_gets_store_errors_not_a_hang(moto_s3: EmbeddedS3, prefix: str) -> None:
    """obstore's runtime, the ranged-read pool and the HEAD loop are threads, which a fork does
    not copy: in a child the engine forks, a call on the parent's store would wait for ever (a
    plain obstore GET there never returned). Every operation is a StoreError at once instead;
    the parent's store is untouched."""
    code = textwrap.dedent(
        """
        import os, sys, time
        from s3kv.store.base import ByteRange, StoreError
        from s3kv.store.obstore_store import ObstoreS3Store
        from s3kv.store.s3 import S3Options
        bucket, endpoint, ak, sk, key = sys.argv[1:]
        st = ObstoreS3Store(bucket, endpoint_url=endpoint, options=S3Options(range_split_bytes=4),
                            aws_access_key_id=ak, aws_secret_access_key=sk)
        assert st.put(key, b"0123456789abcdef", {})
        assert st.head_many([key, key + "-none"]).found.keys() == {key}  # the parent's loop is running
        r, w = os.pipe()
        if os.fork() == 0:
            t0, out = time.monotonic(), []
            batch = st.head_many([key, key + "-2", key + "-3"])
            out.append(sorted(type(e).__name__ for e in batch.failed.values()))
            for op in (lambda: st.head(key), lambda: st.get_ranges(key, [ByteRange(0, 16)]),
                       lambda: st.put(key + "-new", b"x", {})):
                try:
                    op()
                    out.append("no error")
                except StoreError as e:
                    out.append(type(e).__name__ + (" forked" if "forked" in str(e) else ""))
            out.append(time.monotonic() - t0 < 5)
            os.write(w, repr(out).encode())
            os._exit(0)
        os.close(w)
        print(os.read(r, 4096).decode())
        print(st.get_ranges(key, [ByteRange(0, 16)]) == [b"0123456789abcdef"])  # the parent's store still works
        st.close()
        """
    )
    key = f"{prefix}/forked"
    r = subprocess.run(
        [sys.executable, "-c", code, moto_s3.bucket, moto_s3.endpoint_url, moto_s3.access_key, moto_s3.secret_key, key],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    child, parent = r.stdout.strip().splitlines()
    # LocalFailure: this host's machinery, not the store (the breaker counts it neither way).
    assert child == str([["LocalFailure"] * 3, "LocalFailure forked", "LocalFailure forked", "LocalFailure forked", True]), child
    assert parent == "True"


def test_a_capped_range_is_read_in_at_most_that_many_requests(server: EmbeddedS3, prefix: str) -> None:
    """``ByteRange.parts`` (a load's share of the connections, ``stream_share``) caps the split:
    the same bytes, in fewer billed GETs; without it the 1 MiB split holds."""
    st = _native(server)
    try:
        k = f"{prefix}/capped"
        body = os.urandom(4 * MiB + 5)
        assert st.put(k, body, {})
        parts: list[int] = []
        real = st._get_part

        def counting(key: str, offset: int, length: int, *a: Any) -> str:
            parts.append(length)
            return real(key, offset, length, *a)

        st._get_part = counting  # type: ignore[method-assign]
        for cap, want in ((0, 4), (2, 2), (1, 1), (9, 4)):
            parts.clear()
            assert st.get_ranges(k, [ByteRange(0, len(body), parts=cap)]) == [body]
            assert len(parts) == want and sum(parts) == len(body)
    finally:
        st.close()
