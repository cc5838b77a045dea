"""``s3kv gc`` stays inside its deployment and ages by the store's clock (issue 37).

* ``s3kv gc --url s3://b/kv --older-than 1s`` while another deployment uses ``s3://b/kv/teamB``
  deleted 3/3 of that deployment's objects: gc walks namespaces at any depth (to show the demo's
  runs), and deleted them all.
* gc aged objects by its host's clock minus LastModified (the store's stamp): at +4,400 s of skew
  a fresh object read as over an hour old and ``--older-than 1h`` deleted it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from test_ops_cli import G_A1, G_B1, NS_A, NS_B, _put, cli

from s3kv.core.cost import EXPIRY_MARGIN_S
from s3kv.core.keys import KeyScheme
from s3kv.store.embedded import EmbeddedS3

BUCKET = "s3kv-gc-scope-test"


@pytest.fixture(scope="module")
def server():
    with EmbeddedS3("moto", bucket=BUCKET) as s:
        yield s


def _keys(store, prefix: str) -> list[str]:
    return sorted(i.key for i in store.list(prefix + "/"))


def _two_deployments(store, base: str) -> tuple[list[str], list[str]]:
    """Deployment A at ``{base}`` (two namespaces), deployment B at ``{base}/teamB`` (3 objects)."""
    mine = [_put(store, KeyScheme(base, NS_A, tp_size=1), G_A1, 0, 64, 4 * i, 4).key for i in range(2)]
    mine.append(_put(store, KeyScheme(base, NS_B, tp_size=1), G_B1, 0, 64, 0, 2).key)
    theirs = [_put(store, KeyScheme(f"{base}/teamB", NS_A, tp_size=1), G_A1, 0, 64, 4 * i, 4).key for i in range(3)]
    return mine, theirs


def test_gc_never_deletes_another_deployments_objects_under_a_sub_prefix(server):
    store = server.make_store()
    mine, theirs = _two_deployments(store, "kv")
    time.sleep(2.2)  # older than 1 s by the store's clock (HTTP dates and LastModified: whole seconds)
    r = CliRunner().invoke(cli(), ["gc", "--older-than", "1s", "--yes", "--json"], env=server.env("kv"))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["deleted"]["objects"] == len(mine)
    assert doc["left_in_sub_prefixes"] == {"teamB/": {"objects": 3, "bytes": doc["left_in_sub_prefixes"]["teamB/"]["bytes"]}}
    assert _keys(store, "kv") == sorted(theirs)  # 0 of the other deployment's objects deleted
    # The table says what it left and how to include it.
    text = CliRunner().invoke(cli(), ["gc", "--older-than", "1s", "--dry-run"], env=server.env("kv")).output
    assert "left 3 matching objects under 1 sub-prefix(es)" in text and "--include-sub-prefixes" in text
    # The other deployment's own gc, or an explicit flag, does delete them.
    r = CliRunner().invoke(cli(), ["gc", "--older-than", "1s", "--yes", "--json", "--include-sub-prefixes"],
                           env=server.env("kv"))
    assert r.exit_code == 0 and json.loads(r.stdout)["deleted"]["objects"] == 3, r.output
    assert _keys(store, "kv") == []
    store.close()


def test_gc_by_namespace_stays_inside_its_deployment_too(server):
    store = server.make_store()
    mine, theirs = _two_deployments(store, "ns-only")
    r = CliRunner().invoke(cli(), ["gc", "--namespace", NS_A.hex(), "--yes", "--json"], env=server.env("ns-only"))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["deleted"]["objects"] == 2
    assert _keys(store, "ns-only") == sorted([mine[2], *theirs])
    store.close()


def _gc_on_a_host_off_by(skew_s: float, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``s3kv gc`` in a process whose clock (``time.time``) is ``skew_s`` off the real one, set
    before s3kv is imported -- a host whose NTP is broken. The store keeps the real time."""
    code = (f"import sys, time; _t = time.time; time.time = lambda: _t() + {skew_s!r}; "
            "from s3kv.cli import main; main(sys.argv[1:], prog_name='s3kv')")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}
    return subprocess.run([sys.executable, "-c", code, "gc", *args], env={**run_env, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("where", ["s3", "file"])
def test_gc_on_a_host_whose_clock_runs_4400_s_ahead_refuses_and_deletes_nothing(server, where, tmp_path):
    """The Date of a request gc makes is the store's clock: 4,400 s off is past gc's safety margin,
    so it refuses by age, in one line, and deletes nothing (it deleted the fresh object)."""
    if where == "s3":
        store = server.make_store()
        env, url = server.env("skew"), f"s3://{BUCKET}/skew"
        key = _put(store, KeyScheme("skew", NS_A, tp_size=1), G_A1, 0, 64, 0, 4).key
    else:
        from s3kv.store.fsspec_store import FsspecStore

        store = FsspecStore(f"file://{tmp_path}")
        env, url = {}, f"file://{tmp_path}"
        key = _put(store, KeyScheme("", NS_A, tp_size=1), G_A1, 0, 64, 0, 4).key
    try:
        r = _gc_on_a_host_off_by(4400.0, ["--url", url, "--older-than", "1h", "--yes", "--json"], env)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
        assert r.returncode == 1 and len(errors) == 1, (r.stdout, r.stderr)
        assert "4400 s ahead of the store's" in errors[0] and f"{EXPIRY_MARGIN_S:g} s safety margin" in errors[0]
        assert store.head(key) is not None  # the fresh object is still there
        # Behind by as much: refused the same way.
        r = _gc_on_a_host_off_by(-4400.0, ["--url", url, "--older-than", "1h", "--yes", "--json"], env)
        assert r.returncode == 1 and "behind the store's" in r.stderr and store.head(key) is not None
        # gc by namespace alone reads no ages: it runs.
        r = _gc_on_a_host_off_by(4400.0, ["--url", url, "--namespace", NS_B.hex(), "--yes", "--json"], env)
        assert r.returncode == 0, r.stderr
    finally:
        store.close()


def test_gc_ages_by_the_stores_clock_within_the_margin(server):
    """30 s of skew is within the margin: gc runs, and ages by the store's clock -- an object a
    few seconds old is kept by ``--older-than 20s`` (by the host's clock it was 30 s old, deleted)."""
    store = server.make_store()
    key = _put(store, KeyScheme("aging", NS_A, tp_size=1), G_A1, 0, 64, 0, 4).key
    r = _gc_on_a_host_off_by(30.0, ["--url", f"s3://{BUCKET}/aging", "--older-than", "20s", "--yes", "--json"],
                             server.env("aging"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["deleted"]["objects"] == 0 and store.head(key) is not None
    time.sleep(3.2)
    r = _gc_on_a_host_off_by(30.0, ["--url", f"s3://{BUCKET}/aging", "--older-than", "2s", "--yes", "--json"],
                             server.env("aging"))
    assert r.returncode == 0 and json.loads(r.stdout)["deleted"]["objects"] == 1, r.stderr
    store.close()


def test_every_store_tells_its_clock(server, tmp_path):
    """``store_time``: what the store would stamp an object written now with, on every store."""
    from s3kv.store.factory import make_s3_store
    from s3kv.store.fsspec_store import FsspecStore
    from s3kv.store.memory import MemoryStore
    from s3kv.store.s3 import S3Options

    creds = dict(endpoint_url=server.endpoint_url, aws_access_key_id=server.access_key,
                 aws_secret_access_key=server.secret_key)
    stores = [MemoryStore(), FsspecStore(f"file://{tmp_path}"), FsspecStore("memory://clock/test"),
              make_s3_store(BUCKET, options=S3Options(client="boto3"), **creds),
              make_s3_store(BUCKET, options=S3Options(client="obstore"), **creds)]
    for store in stores:
        before = time.time()
        t = store.store_time()
        assert before - 1.0 <= t <= time.time() + 1.0, (store, t - before)
        store.put("clock/probe", b"x")
        stamped = store.head("clock/probe").last_modified
        assert stamped is not None and abs(stamped - t) < 2.0, (store, stamped - t)
        store.close()
    assert os.listdir(tmp_path) == ["clock"]  # the file system's probe file is gone
