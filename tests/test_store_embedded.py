"""EmbeddedS3: reachable from other processes, isolated instances, clean stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from s3kv.store.embedded import EmbeddedS3, weed_binary

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import os, sys
from s3kv.store.factory import open_store, parse_store_url
url = os.environ["S3KV_URL"]
_, _, prefix = parse_store_url(url)
with open_store(url) as store:
    store.check_access()
    print(store.put(prefix + "/from-child", b"hello from " + sys.argv[1].encode()))
"""


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3KV_URL"}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_server_is_usable_from_another_process(kind: str, request: pytest.FixtureRequest) -> None:
    server: EmbeddedS3 = request.getfixturevalue({"moto": "moto_s3", "seaweedfs": "seaweed_s3"}[kind])
    prefix = f"child-{kind}-{os.getpid()}"
    env = _child_env(server.env(prefix=prefix))
    assert env["S3KV_URL"] == f"s3://{server.bucket}/{prefix}"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, kind], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    body = server.client().get_object(Bucket=server.bucket, Key=f"{prefix}/from-child")["Body"].read()
    assert body == f"hello from {kind}".encode()


def test_second_seaweedfs_instance_is_isolated(seaweed_s3: EmbeddedS3) -> None:
    with EmbeddedS3("seaweedfs", bucket="s3kv-second") as other:
        assert other.endpoint_url != seaweed_s3.endpoint_url
        store = other.make_store()
        try:
            assert store.put("only-here", b"x") is True
        finally:
            store.close()
        proc = other._proc
        tmpdir = other._tmpdir
    assert proc is not None and proc.poll() is not None  # stopped
    assert tmpdir is not None and not os.path.exists(tmpdir)  # cleaned up
    assert "s3kv-second" not in [b["Name"] for b in seaweed_s3.client().list_buckets()["Buckets"]]


def test_auto_kind() -> None:
    expected = "seaweedfs" if weed_binary() else "moto"
    assert EmbeddedS3("auto").kind == expected
    with pytest.raises(ValueError):
        EmbeddedS3("minio")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not started"):
        _ = EmbeddedS3("moto").endpoint_url


def test_module_entry_point_runs_a_shared_server() -> None:
    """``python -m s3kv.store.embedded`` is how a demo shares one server between processes."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s3kv.store.embedded",
            "--kind",
            "moto",
            "--bucket",
            "s3kv-cli",
            "--until-stdin-closes",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env({}),
        cwd=REPO,
    )
    try:
        info: dict[str, Any] = json.loads(proc.stdout.readline())
        assert info["kind"] == "moto" and info["S3KV_URL"] == "s3://s3kv-cli"
        out = subprocess.run(
            [sys.executable, "-c", _CHILD.replace('prefix + "/from-child"', '"from-child"'), "cli"],
            env=_child_env({k: v for k, v in info.items() if k != "kind"}),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "True"
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0


def test_weed_volume_size_fits_the_disk(monkeypatch) -> None:
    """Large volumes (fewer growth stalls under a benchmark), but never so large that weed's
    free-space / volume-size rule leaves fewer than 8 on the data disk."""
    import collections

    from s3kv.store import embedded

    usage = collections.namedtuple("usage", "total used free")
    for free_mb, want in ((1 << 20, 4096), (8 * 1000, 1000), (100, 128)):
        monkeypatch.setattr(embedded.shutil, "disk_usage", lambda p, f=free_mb: usage(0, 0, f << 20))
        assert embedded._volume_limit_mb("/data") == want
