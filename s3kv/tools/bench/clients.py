"""The S3 clients the benchmarks compare, side by side on one server: boto3, obstore, awscrt.

* ``s3kv_stores(bs)``: s3kv's own store on each client it ships (boto3's ``S3Store`` and
  obstore's ``ObstoreS3Store``), on the bench store's endpoint, bucket and credentials;
* ``raw_clients(bs)``: the plainest parallel-friendly put/get of each client library - boto3
  ``put_object``/``get_object``, obstore ``put``/``get``, awscrt's ``S3Client`` (only measured:
  s3kv does not use it) - with no s3kv work at all, the ceiling each client sets.

Every raw client pays the bench's injected latency per request, like s3kv's requests do.
awscrt is optional (``pip install awscrt``); without it its rows are left out and said so.
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ...store.base import ObjectStore
from .common import BenchStore, RawClient, RegionLatency


def s3_endpoint(bs: BenchStore) -> tuple[str, str, Any] | None:
    """(bucket, endpoint URL, boto3 session) of the bench store, or None if it is not S3."""
    from ...store.s3 import S3Store

    raw = bs.raw
    boto = getattr(raw, "_boto", raw)
    if not isinstance(boto, S3Store):
        return None
    return boto.bucket, boto.endpoint_url, boto._session


def s3kv_stores(
    bs: BenchStore, *, head_concurrency: int | None = None, head_processes: int = 0
) -> dict[str, ObjectStore]:
    """s3kv's store on every client it ships, same server (raw: no latency, no counting); with
    ``head_processes``, obstore once more as ``obstore_helpers``: its HEAD waves in that many
    helper processes (ready when this returns)."""
    ep = s3_endpoint(bs)
    if ep is None:
        return {"store": bs.raw}
    bucket, endpoint, session = ep
    from ...store.obstore_store import ObstoreS3Store, available
    from ...store.s3 import S3Options, S3Store

    out: dict[str, ObjectStore] = {}
    opts = S3Options(max_concurrency=bs.concurrency)
    if head_concurrency is not None:
        opts = dataclasses.replace(opts, head_concurrency=head_concurrency)
    out["boto3"] = S3Store(bucket, endpoint_url=endpoint, options=opts, session=session)
    if available():
        out["obstore"] = ObstoreS3Store(bucket, endpoint_url=endpoint, options=opts, session=session)
        if head_processes > 0:
            procs = dataclasses.replace(opts, head_processes=head_processes)
            st = out["obstore_helpers"] = ObstoreS3Store(bucket, endpoint_url=endpoint, options=procs, session=session)
            st.head_helpers.wait_ready()
    return out


def fan_out(client: str, bs: BenchStore, store: ObjectStore) -> int:
    """HEADs ``store`` (made by :func:`s3kv_stores` for ``client``) has in flight at once; the
    latency model charges ceil(n / this) round trips."""
    return int(store.options.head_concurrency) if client.startswith("obstore") else bs.concurrency  # type: ignore[attr-defined]


def helper_cpu_s(store: ObjectStore) -> float:
    """CPU seconds spent so far by ``store``'s HEAD helper processes (0 without any)."""
    helpers = getattr(store, "head_helpers", None)
    return float(helpers.cpu_s()) if helpers is not None else 0.0


def shaped(bs: BenchStore, store: ObjectStore, concurrency: int) -> tuple[Any, RegionLatency | None]:
    """``InstrumentedStore(RegionLatency(store))`` as the bench store is built, for another client."""
    from ...store.instrument import InstrumentedStore

    lat = RegionLatency(store, bs.latency_ms / 1000.0, concurrency) if bs.latency_ms else None
    return InstrumentedStore(lat if lat is not None else store), lat


def raw_clients(bs: BenchStore) -> tuple[dict[str, RawClient], dict[str, str]]:
    """Raw put/get of every client library that is installed; and why any is missing."""
    out: dict[str, RawClient] = {"boto3": bs.raw_client}
    missing: dict[str, str] = {}
    ep = s3_endpoint(bs)
    if ep is None:
        return out, {"obstore": "not an S3 store", "crt": "not an S3 store"}
    bucket, endpoint, session = ep
    creds = session.get_credentials().get_frozen_credentials()
    lat = bs.latency_ms / 1000.0
    try:
        out["obstore"] = _obstore_raw(bucket, endpoint, creds, lat)
    except ImportError as e:
        missing["obstore"] = str(e)
    try:
        out["crt"] = _crt_raw(bucket, endpoint, creds, lat)
    except ImportError as e:
        missing["crt"] = f"awscrt not installed ({e})"
    return out, missing


def _obstore_raw(bucket: str, endpoint: str, creds: Any, latency_s: float) -> RawClient:
    import obstore as obs
    from obstore.store import S3Store

    extra = {"session_token": creds.token} if creds.token else {}
    store = S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=creds.access_key,
        secret_access_key=creds.secret_key,
        **extra,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": endpoint.startswith("http://"), "pool_max_idle_per_host": "256"},
    )

    def put(key: str, body: bytes) -> None:
        obs.put(store, key, body, use_multipart=False)

    def get(key: str) -> bytes:
        return obs.get(store, key).bytes()  # type: ignore[return-value]  # a buffer, not copied

    return RawClient(put, get, latency_s, "obstore put/get")


def _crt_raw(bucket: str, endpoint: str, creds: Any, latency_s: float) -> RawClient:
    from awscrt import auth, http, s3
    from awscrt import io as crt_io

    parts = urlsplit(endpoint)
    host = parts.netloc
    elg = crt_io.EventLoopGroup()
    boot = crt_io.ClientBootstrap(elg, crt_io.DefaultHostResolver(elg))
    client = s3.S3Client(
        bootstrap=boot,
        region="us-east-1",
        credential_provider=auth.AwsCredentialsProvider.new_static(creds.access_key, creds.secret_key, creds.token),
        tls_mode=s3.S3RequestTlsMode.DISABLED if parts.scheme == "http" else s3.S3RequestTlsMode.ENABLED,
        part_size=8 << 20,
        throughput_target_gbps=100.0,
    )

    def request(method: str, key: str, headers: list[tuple[str, str]], body: Any = None) -> Any:
        return http.HttpRequest(method, f"/{bucket}/{key}", http.HttpHeaders([("Host", host), *headers]), body)

    def put(key: str, body: bytes) -> None:
        req = request("PUT", key, [("Content-Length", str(len(body)))], io.BytesIO(body))
        client.make_request(type=s3.S3RequestType.PUT_OBJECT, request=req).finished_future.result()

    def get(key: str) -> bytes:
        chunks: list[tuple[int, bytes]] = []
        # awscrt hands the body to Python in chunks (under the GIL): collect, then join.
        r = client.make_request(
            type=s3.S3RequestType.GET_OBJECT,
            request=request("GET", key, []),
            on_body=lambda chunk, offset, **_: chunks.append((offset, bytes(chunk))),
        )
        r.finished_future.result()
        return b"".join(c for _, c in sorted(chunks))

    return RawClient(put, get, latency_s, "awscrt S3Client")


def timed_cpu(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds - every thread, native ones too) of ``fn()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0
