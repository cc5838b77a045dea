"""One URL (the ``S3KV_URL`` setting) to a store.

Accepted forms::

    s3://bucket[/prefix]        ObstoreS3Store (obstore installed; S3Options.client="auto"/"obstore")
                                or S3Store (boto3; client="boto3" / S3KV_S3_CLIENT=boto3);
                                either way endpoint, credentials and region from boto3's chain
                                (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID ...,
                                AWS_PROFILE; region AWS_REGION / AWS_DEFAULT_REGION, else us-east-1)
    file:///path                FsspecStore rooted at /path
    memory://name               a MemoryStore shared by name within this process (tests, demos)
    <proto>://...               any other fsspec protocol (gs, az, sftp, ...) -> FsspecStore, retried

``parse_store_url`` returns ``(scheme, bucket, prefix)``. For s3 the store is opened on the
bucket and the prefix is handed back for the caller's key scheme (stores take full keys). For
the other schemes "bucket" is the location the store is rooted at (the path for file://, the
name for memory://) and the prefix is empty.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from ..config import has_userinfo, redact_url
from .base import ObjectStore, StoreConfigError
from .memory import MemoryStore

SETTING = "S3KV_URL"
ACCEPTED = "s3://bucket/prefix, file:///path, memory://name, or another fsspec URL (gs://, az://, ...)"

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class StoreURL(NamedTuple):
    scheme: str
    bucket: str
    prefix: str


def _bad(url: str, why: str) -> StoreConfigError:
    return StoreConfigError(f"{SETTING}={redact_url(url)!r}: {why}. Accepted: {ACCEPTED}")


def _check_bucket(url: str, bucket: str) -> None:
    if not bucket:
        raise _bad(url, "missing bucket name (expected s3://bucket/prefix)")
    if len(bucket) < 3 or len(bucket) > 63:
        raise _bad(url, f"bucket name {bucket!r} must be 3 to 63 characters long")
    if not _BUCKET_RE.match(bucket) or ".." in bucket or ".-" in bucket or "-." in bucket:
        raise _bad(
            url,
            f"invalid bucket name {bucket!r}: use lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit",
        )
    try:
        ipaddress.ip_address(bucket)
    except ValueError:
        return
    raise _bad(url, f"invalid bucket name {bucket!r}: must not look like an IP address")


def _fsspec_known(scheme: str) -> bool:
    import fsspec

    return scheme in fsspec.available_protocols()


def parse_store_url(url: str) -> StoreURL:
    if not url or not url.strip():
        raise _bad(url, "empty URL")
    url = url.strip()
    if "://" not in url:
        raise _bad(url, "not a URL (no scheme://)")
    if has_userinfo(url):
        raise _bad(url, "credentials in the URL are not accepted; use the store's own credential chain")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("s3", "s3a"):
        if parts.query or parts.fragment:
            raise _bad(url, "query strings and fragments are not supported; put settings in env vars")
        bucket = parts.netloc
        _check_bucket(url, bucket)
        return StoreURL("s3", bucket, parts.path.strip("/"))
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _bad(url, f"file URLs need an absolute path (file:///path), got host {parts.netloc!r}")
        if not parts.path:
            raise _bad(url, "missing path (expected file:///path)")
        return StoreURL("file", parts.path.rstrip("/") or "/", "")
    if scheme == "memory":
        name = (parts.netloc + parts.path).strip("/")
        if not name:
            raise _bad(url, "missing store name (expected memory://name)")
        return StoreURL("memory", name, "")
    if _fsspec_known(scheme):
        location = (parts.netloc + parts.path).rstrip("/")
        if not location:
            raise _bad(url, f"missing location after {scheme}://")
        return StoreURL(scheme, location, "")
    raise _bad(url, f"unknown scheme {parts.scheme!r}")


def make_s3_store(bucket: str, *, options: Any | None = None, **kwargs: Any) -> ObjectStore:
    """The S3 store ``options.client`` names: obstore for "auto" when it imports (measured: a
    fraction of boto3's CPU per request and per GB, and no GIL held; see obstore_store.py),
    boto3 when asked or when obstore is missing. ``kwargs`` go to the store's constructor."""
    from .s3 import S3Options, S3Store

    opts = options or S3Options()
    if opts.client != "boto3":
        from . import obstore_store

        if obstore_store.available():
            return obstore_store.ObstoreS3Store(bucket, options=opts, **kwargs)
        if opts.client == "obstore":
            raise StoreConfigError(
                "S3KV_S3_CLIENT=obstore but the obstore package is not installed (pip install obstore)"
            )
    return S3Store(bucket, options=opts, **kwargs)


# The documented process-local registry behind memory:// URLs: two opens of one name share
# objects, which lets a test or demo run "two clusters" in one process on one store.
_MEMORY_STORES: dict[str, MemoryStore] = {}
_MEMORY_LOCK = threading.Lock()


def memory_store(name: str) -> MemoryStore:
    with _MEMORY_LOCK:
        store = _MEMORY_STORES.get(name)
        if store is None:
            store = _MEMORY_STORES[name] = MemoryStore(f"memory://{name}")
        return store


def open_store(
    url: str,
    *,
    options: Any | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ObjectStore:
    """Open the store behind ``url``. ``options``: an ``S3Options`` for s3:// (ignored elsewhere);
    ``storage_options``: passed to fsspec for other schemes. Does not probe the store: call
    ``check_access()`` at start-up for one clear error."""
    scheme, bucket, prefix = parse_store_url(url)
    if scheme == "s3":
        from .s3 import S3Options

        if options is not None and not isinstance(options, S3Options):
            raise TypeError(f"options for s3:// must be S3Options, got {type(options).__name__}")
        shown = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        if options is None or options.region is None:
            # Boto's chain has no default region; S3 itself does not care, so pick the classic one.
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            from dataclasses import replace

            options = replace(options or S3Options(), region=region) if region else options
        return make_s3_store(bucket, options=options, url=shown)
    if scheme == "memory":
        return memory_store(bucket)

    from .fsspec_store import FsspecStore

    try:
        store = FsspecStore(url, storage_options=storage_options)
    except ImportError as exc:
        raise _bad(url, f"the fsspec back end for {scheme}:// is not installed ({exc})") from exc
    if scheme == "file":
        return store
    # Remote file systems fail transiently like any network store.
    from .retrying import RetryingStore

    return RetryingStore(store)
