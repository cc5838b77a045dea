"""S3KV_URL parsing and open_store: every bad URL / setting gives one clear message."""

from __future__ import annotations

from typing import Any

import pytest

from s3kv.store.base import BucketNotFound, StoreConfigError
from s3kv.store.factory import open_store, parse_store_url
from s3kv.store.fsspec_store import FsspecStore
from s3kv.store.memory import MemoryStore
from s3kv.store.retrying import RetryingStore, RetryPolicy
from s3kv.store.s3 import S3Options, S3Store


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://my-bucket/some/prefix/", ("s3", "my-bucket", "some/prefix")),
        ("s3://my.bucket.01", ("s3", "my.bucket.01", "")),
        ("S3://abc/x", ("s3", "abc", "x")),
        ("file:///var/cache/s3kv/", ("file", "/var/cache/s3kv", "")),
        ("file://localhost/tmp/x", ("file", "/tmp/x", "")),
        ("memory://shared", ("memory", "shared", "")),
        ("gs://bucket/path", ("gs", "bucket/path", "")),
    ],
)
def test_parse_good(url: str, expected: tuple[str, str, str]) -> None:
    assert tuple(parse_store_url(url)) == expected


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftpx://host/path", "unknown scheme 'ftpx'"),
        ("bucket/prefix", "no scheme"),
        ("", "empty"),
        ("s3://", "missing bucket name"),
        ("s3:///prefix", "missing bucket name"),
        ("s3://ab/prefix", "3 to 63 characters"),
        ("s3://" + "a" * 64, "3 to 63 characters"),
        ("s3://Bad_Bucket/x", "invalid bucket name 'Bad_Bucket'"),
        ("s3://-bucket/x", "invalid bucket name"),
        ("s3://a..b/x", "invalid bucket name"),
        ("s3://192.168.1.1/x", "IP address"),
        ("s3://bucket/x?region=eu", "query strings"),
        ("file://relative/path", "absolute path"),
        ("memory://", "missing store name"),
    ],
)
def test_parse_bad_names_the_setting(url: str, fragment: str) -> None:
    with pytest.raises(StoreConfigError) as info:
        parse_store_url(url)
    msg = str(info.value)
    assert fragment in msg
    assert "S3KV_URL" in msg and "s3://bucket/prefix" in msg and "file:///path" in msg
    assert isinstance(info.value, ValueError)


def test_memory_registry_shares_by_name() -> None:
    a = open_store("memory://reg-test")
    b = open_store("memory://reg-test")
    assert isinstance(a, MemoryStore) and a is b
    a.put("k", b"v")
    assert b.get("k") == b"v"
    assert open_store("memory://other-name") is not a


def test_file_url(tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path}/cache")
    assert isinstance(store, FsspecStore)
    store.check_access()  # creates the directory
    assert (tmp_path / "cache").is_dir()
    assert store.put("a/b", b"xyz") is True and store.get("a/b") == b"xyz"


def test_other_fsspec_scheme(tmp_path: Any) -> None:
    # "local://" is fsspec's other name for local files; it stands in for any scheme that goes
    # through FsspecStore and gets the retry layer (gs://, az://, sftp:// ...).
    store = open_store(f"local://{tmp_path}/x")
    assert isinstance(store, RetryingStore) and isinstance(store.inner, FsspecStore)
    assert store.put("k", b"v") is True and store.get("k") == b"v"
    with pytest.raises(StoreConfigError, match="S3KV_URL.*not installed"):
        open_store("gs://some-bucket/prefix")  # gcsfs is not installed here: one clear message


@pytest.mark.parametrize("client", ["auto", "boto3"])
def test_s3_url_uses_boto_env_chain(moto_s3: Any, monkeypatch: pytest.MonkeyPatch, client: str) -> None:
    from s3kv.store.obstore_store import ObstoreS3Store, available

    for name, value in moto_s3.env(prefix="team/a").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    url = moto_s3.store_url("team/a")
    scheme, bucket, prefix = parse_store_url(url)
    assert (scheme, bucket, prefix) == ("s3", moto_s3.bucket, "team/a")
    store = open_store(url, options=S3Options(retry=RetryPolicy(max_attempts=2, deadline_s=5), client=client))  # type: ignore[arg-type]
    try:
        # "auto" is the obstore client where it is installed; either way the same env chain.
        assert isinstance(store, ObstoreS3Store if client == "auto" and available() else S3Store)
        assert store.endpoint_url == moto_s3.endpoint_url
        assert store.region == "us-east-1"  # the default when nothing sets one
        assert store.url == url
        store.check_access()
        assert store.put(f"{prefix}/obj", b"hello") is True
        assert moto_s3.client().get_object(Bucket=bucket, Key="team/a/obj")["Body"].read() == b"hello"
        store.delete_many([f"{prefix}/obj"])
    finally:
        store.close()
    with pytest.raises(TypeError):
        open_store(url, options=RetryPolicy())


def test_s3_url_region_from_env(moto_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    with open_store(moto_s3.url) as store:
        assert store.region == "eu-west-3"


def test_unreachable_endpoint_from_env(monkeypatch: pytest.MonkeyPatch, closed_port: int) -> None:
    endpoint = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = S3Options(
        connect_timeout_s=0.5, read_timeout_s=0.5, retry=RetryPolicy(max_attempts=2, base_s=0.01)
    )
    with open_store("s3://s3kv-bucket/p", options=opts) as store:
        with pytest.raises(StoreConfigError) as info:
            store.check_access()
    msg = str(info.value)
    assert endpoint in msg and "AWS_ENDPOINT_URL_S3" in msg and "S3KV_URL=s3://s3kv-bucket/p" in msg


def test_missing_bucket_on_live_server(moto_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    with open_store("s3://s3kv-not-created/x") as store:
        with pytest.raises(BucketNotFound) as info:
            store.check_access()
    msg = str(info.value)
    assert "'s3kv-not-created' does not exist" in msg and "S3KV_URL=s3://s3kv-not-created/x" in msg
