"""``s3kv ls/stats/verify/gc`` against a real local S3 server (moto), plus file:// for ages."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import click
import pytest
from click.testing import CliRunner

from s3kv.core.keys import KeyScheme
from s3kv.core.objects import ObjectIdentity, encode_object, header_len, object_metadata
from s3kv.store.base import ObjectStore
from s3kv.store.embedded import EmbeddedS3
from s3kv.tools.ops import ops_commands

BUCKET = "s3kv-ops-cli-test"
PREFIX = "cache/v1"


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


NS_A = _digest("namespace", "A")
NS_B = _digest("namespace", "B")
G_A1, G_A2, G_B1 = "a1a1a1a1a1a1a1a1", "a2a2a2a2a2a2a2a2", "b1b1b1b1b1b1b1b1"
TPB = 16


@dataclass(frozen=True)
class Obj:
    key: str
    namespace: str
    group: str  # "fp.{shard}of{tp}"
    size: int
    pages: int


def _pages(n: int, page_bytes: int, seed: object) -> list[bytes]:
    out = []
    for i in range(n):
        block = hashlib.sha256(repr((seed, i)).encode()).digest()
        out.append((block * (page_bytes // 32 + 1))[:page_bytes])
    return out


def _put(
    store: ObjectStore,
    scheme: KeyScheme,
    gfp: str,
    shard: int,
    page_bytes: int,
    first: int,
    count: int,
    *,
    identity: ObjectIdentity | None = None,
    corrupt: bool = False,
) -> Obj:
    last = _digest(scheme.namespace, gfp, shard, first, count)
    key = scheme.object_key(gfp, shard, last)
    ident = identity or ObjectIdentity(scheme.namespace, gfp, shard, scheme.tp_size, TPB, page_bytes)
    body = b"".join(bytes(b) for b in encode_object(ident, first, last, _pages(count, page_bytes, key)))
    if corrupt:
        b = bytearray(body)
        b[-5] ^= 0x40  # a bit in the last page; header and metadata stay valid
        body = bytes(b)
    assert store.put(key, body, object_metadata(ident, first, count)) is True
    assert len(body) == header_len(count) + count * ident.page_bytes
    return Obj(key, scheme.namespace.hex(), f"{gfp}.{shard}of{scheme.tp_size}", len(body), count)


@dataclass
class Population:
    good: list[Obj]
    corrupt: Obj
    foreign: Obj
    stray_key: str

    @property
    def all(self) -> list[Obj]:
        return [*self.good, self.corrupt, self.foreign]


def populate(store: ObjectStore, prefix: str) -> Population:
    """Two namespaces (tp 2 and tp 1), two groups each side, one corrupt, one foreign, one stray key."""
    a = KeyScheme(prefix, NS_A, tp_size=2)
    b = KeyScheme(prefix, NS_B, tp_size=1)
    good = [
        _put(store, a, G_A1, 0, 64, 0, 4),
        _put(store, a, G_A1, 0, 64, 4, 4),
        _put(store, a, G_A1, 0, 64, 8, 2),
        _put(store, a, G_A1, 1, 64, 0, 4),
        _put(store, a, G_A1, 1, 64, 4, 4),
        _put(store, a, G_A2, 0, 32, 6, 1),
        _put(store, a, G_A2, 1, 32, 6, 1),
        _put(store, b, G_B1, 0, 128, 0, 3),
        _put(store, b, G_B1, 0, 128, 3, 3),
        _put(store, b, "b2b2b2b2b2b2b2b2", 0, 256, 0, 2),
    ]
    corrupt = _put(store, b, G_B1, 0, 128, 6, 3, corrupt=True)
    # Under namespace A's key, but written for namespace B: the header and metadata name another namespace.
    foreign = _put(store, a, G_A2, 0, 32, 7, 1, identity=ObjectIdentity(NS_B, G_A2, 0, 2, TPB, 32))
    stray = f"{prefix}/README.txt" if prefix else "README.txt"
    store.put(stray, b"not an s3kv object")
    # Outside the prefix: never seen by the commands.
    _put(store, KeyScheme(f"elsewhere/{prefix}".rstrip("/"), NS_A, tp_size=2), G_A1, 0, 64, 0, 1)
    return Population(good, corrupt, foreign, stray)


@pytest.fixture(scope="module")
def s3():
    with EmbeddedS3("moto", bucket=BUCKET) as server:
        store = server.make_store()
        pop = populate(store, PREFIX)
        store.close()
        yield server, pop


def cli() -> click.Group:
    group = click.Group("s3kv")
    for name, cmd in ops_commands().items():
        group.add_command(cmd, name)
    return group


def run(server: EmbeddedS3, *args: str, prefix: str = PREFIX, expect: int = 0):
    env = server.env(prefix)  # AWS endpoint/keys for boto3's chain, and S3KV_URL
    result = CliRunner().invoke(cli(), list(args), env=env, catch_exceptions=False)
    assert result.exit_code == expect, result.output
    return result


def run_json(server: EmbeddedS3, *args: str, prefix: str = PREFIX, expect: int = 0) -> dict:
    result = run(server, *args, "--json", prefix=prefix, expect=expect)
    return json.loads(result.stdout)


def _sum(objs, **match):
    sel = [o for o in objs if all(getattr(o, k) == v for k, v in match.items())]
    return len(sel), sum(o.size for o in sel), sum(o.pages for o in sel)


def test_missing_url_names_the_setting():
    result = CliRunner().invoke(cli(), ["ls"], env={"S3KV_URL": None})
    assert result.exit_code == 2
    assert "S3KV_URL" in result.output


def test_ls_namespaces(s3):
    server, pop = s3
    doc = run_json(server, "ls")
    assert doc["url"] == f"s3://{BUCKET}/{PREFIX}"
    by_ns = {d["namespace"]: d for d in doc["namespaces"]}
    assert set(by_ns) == {NS_A.hex(), NS_B.hex()}
    for ns in (NS_A.hex(), NS_B.hex()):
        n, size, _ = _sum(pop.all, namespace=ns)
        assert (by_ns[ns]["objects"], by_ns[ns]["bytes"]) == (n, size)
        assert 0 <= by_ns[ns]["newest_age_s"] <= by_ns[ns]["oldest_age_s"] < 600
    assert doc["total"] == {"objects": len(pop.all), "bytes": sum(o.size for o in pop.all)}
    assert doc["unrecognised"]["objects"] == 1
    # --url beats the env, and the table names both namespaces.
    text = run(server, "ls", "--url", f"s3://{BUCKET}/{PREFIX}", prefix="nothing-here").output
    assert NS_A.hex() in text and NS_B.hex() in text and "unrecognised" in text


def test_ls_groups_of_one_namespace(s3):
    server, pop = s3
    doc = run_json(server, "ls", "--namespace", NS_A.hex()[:6])  # a unique prefix is enough
    assert doc["namespace"] == NS_A.hex()
    groups = {g["group"]: g for g in doc["groups"]}
    expected = {o.group for o in pop.all if o.namespace == NS_A.hex()}
    assert set(groups) == expected == {f"{G_A1}.0of2", f"{G_A1}.1of2", f"{G_A2}.0of2", f"{G_A2}.1of2"}
    for name, g in groups.items():
        n, size, _ = _sum(pop.all, group=name, namespace=NS_A.hex())
        assert (g["objects"], g["bytes"]) == (n, size)
        assert g["shard"] in (0, 1) and g["tp_size"] == 2
    run(server, "ls", "--namespace", "ffff", expect=1)  # no such namespace


@pytest.mark.parametrize("deep", [False, True])
def test_stats(s3, deep):
    server, pop = s3
    doc = run_json(server, "stats", *(["--deep"] if deep else []))
    assert doc["deep"] is deep
    assert doc["total"]["objects"] == len(pop.all)
    assert doc["total"]["pages"] == sum(o.pages for o in pop.all)
    for nd in doc["namespaces"]:
        n, size, pages = _sum(pop.all, namespace=nd["namespace"])
        assert (nd["objects"], nd["bytes"], nd["pages"]) == (n, size, pages)
        assert set(nd["age_s"]) == {"min", "median", "max"}
        assert nd["age_s"]["min"] <= nd["age_s"]["median"] <= nd["age_s"]["max"]
        for gd in nd["groups"]:
            n, size, pages = _sum(pop.all, namespace=nd["namespace"], group=gd["group"])
            assert (gd["objects"], gd["bytes"], gd["pages"]) == (n, size, pages)
            assert gd["tokens_per_block"] == TPB
    g = next(g for nd in doc["namespaces"] for g in nd["groups"] if g["group"] == f"{G_B1}.0of1")
    assert g["page_bytes"] == 128 and g["objects"] == 3 and g["pages"] == 9
    if deep:
        assert doc["inconsistent"] == 0
    text = run(server, "stats").output
    assert "PAGES" in text and f"{G_A1}.0of2" in text


def test_verify_finds_exactly_the_bad_objects(s3):
    server, pop = s3
    doc = run_json(server, "verify", expect=1)
    assert doc["checked"] == len(pop.all)
    assert doc["ok"] == len(pop.good)
    assert doc["pages_ok"] == sum(o.pages for o in pop.good)
    assert {b["key"]: b["reason"] for b in doc["bad"]} == {
        pop.corrupt.key: "checksum",
        pop.foreign.key: "foreign",
    }
    assert doc["bad_by_reason"] == {"checksum": 1, "foreign": 1}
    assert doc["errors"] == [] and doc["deleted"] == 0
    assert doc["unrecognised"] == 1
    # One namespace, a limit, and a sample.
    doc = run_json(server, "verify", "--namespace", NS_B.hex(), expect=1)
    assert [b["key"] for b in doc["bad"]] == [pop.corrupt.key]
    assert doc["checked"] == _sum(pop.all, namespace=NS_B.hex())[0]


def run_any(server, *args):
    result = CliRunner().invoke(cli(), [*args, "--json"], env=server.env(PREFIX), catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def test_verify_limit_and_sample(s3):
    server, pop = s3
    code, doc = run_any(server, "verify", "--limit", "3")
    assert doc["checked"] == 3
    assert code == (1 if doc["bad"] else 0)
    _, full = run_any(server, "verify", "--sample", "1.0")
    assert full["checked"] == len(pop.all)
    _, half = run_any(server, "verify", "--sample", "0.5")
    _, again = run_any(server, "verify", "--sample", "0.5")
    assert half["checked"] == again["checked"] < len(pop.all)  # repeatable, a subset
    text = run(server, "verify", expect=1).output
    assert "checksum" in text and "foreign" in text and pop.corrupt.key in text


def test_gc_filters_dry_run_and_namespace(s3):
    server, _ = s3
    prefix = "gc/v1"
    store = server.make_store()
    pop = populate(store, prefix)

    # A filter is required.
    result = CliRunner().invoke(cli(), ["gc"], env=server.env(prefix))
    assert result.exit_code == 2 and "--older-than" in result.output
    # gc wants the full namespace.
    run(server, "gc", "--namespace", NS_A.hex()[:6], prefix=prefix, expect=2)

    keys_before = sorted(i.key for i in store.list(prefix + "/"))
    doc = run_json(server, "gc", "--older-than", "0", "--dry-run", "-v", prefix=prefix)
    assert doc["dry_run"] is True
    assert doc["matched"]["objects"] == len(pop.all)
    assert doc["deleted"] == {"objects": 0, "bytes": 0}
    assert sorted(doc["keys"]) == sorted(o.key for o in pop.all)
    assert sorted(i.key for i in store.list(prefix + "/")) == keys_before

    # Everything is fresh: nothing is a day old.
    doc = run_json(server, "gc", "--older-than", "1", prefix=prefix)
    assert doc["matched"]["objects"] == 0 and doc["deleted"]["objects"] == 0

    doc = run_json(server, "gc", "--older-than", "0", "--namespace", NS_A.hex(), prefix=prefix)
    n_a, bytes_a, _ = _sum(pop.all, namespace=NS_A.hex())
    assert doc["deleted"] == {"objects": n_a, "bytes": bytes_a}
    assert doc["by_namespace"] == {NS_A.hex(): {"objects": n_a, "bytes": bytes_a}}
    left = sorted(i.key for i in store.list(prefix + "/"))
    assert left == sorted([o.key for o in pop.all if o.namespace == NS_B.hex()] + [pop.stray_key])
    # The other prefix is untouched.
    assert len(run_json(server, "ls")["namespaces"]) == 2

    # verify --delete-bad removes the corrupt object; afterwards verify passes.
    doc = run_json(server, "verify", "--delete-bad", prefix=prefix, expect=1)
    assert doc["deleted"] == 1 and [b["key"] for b in doc["bad"]] == [pop.corrupt.key]
    doc = run_json(server, "verify", prefix=prefix)
    assert doc["bad"] == [] and doc["checked"] == _sum(pop.good, namespace=NS_B.hex())[0]

    # gc by namespace alone, table output.
    text = run(server, "gc", "--namespace", NS_B.hex(), prefix=prefix).output
    assert "deleted" in text
    assert [i.key for i in store.list(prefix + "/")] == [pop.stray_key]  # non-layout keys are never deleted
    store.close()


def test_gc_by_age_on_file_store(tmp_path):
    """file:// has settable mtimes, so age filtering is tested for real."""
    from s3kv.store.factory import open_store

    url = f"file://{tmp_path}/cache"
    store = open_store(url)
    pop = populate(store, "")  # file:// URLs carry no key prefix
    old = {o.key for o in pop.all[:4]}
    three_days_ago = time.time() - 3 * 86400
    for key in old:
        path = os.path.join(tmp_path, "cache", key)
        assert os.path.exists(path), path
        os.utime(path, (three_days_ago, three_days_ago))
    runner = CliRunner()

    doc = json.loads(runner.invoke(cli(), ["ls", "--url", url, "--json"]).stdout)
    # The object under "elsewhere/" is s3kv layout one level down: found, under its path.
    assert doc["total"]["objects"] == len(pop.all) + 1
    assert [d["path"] for d in doc["namespaces"]].count("elsewhere/") == 1
    assert doc["unrecognised"]["objects"] == 1  # README.txt

    r = runner.invoke(cli(), ["gc", "--url", url, "--older-than", "2", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["deleted"]["objects"] == len(old)  # the "elsewhere/" object is new: kept
    remaining = {i.key for i in store.list("")}
    assert not remaining & old
    assert {o.key for o in pop.all} - old <= remaining


def test_commands_are_registered_on_the_main_cli():
    try:
        from s3kv.cli import main
    except ImportError as exc:  # the rest of the CLI may not be importable in a partial checkout
        pytest.skip(f"s3kv.cli not importable: {exc}")
    for name in ("ls", "stats", "verify", "gc"):
        assert main.get_command(click.Context(main), name) is not None


def test_store_only_commands_exit_without_the_interpreters_teardown(tmp_path) -> None:
    """The console script ends ls/stats/verify/gc with os._exit after flushing (the teardown with
    native client threads alive now and then aborted a command that had succeeded): the output and
    the exit code are still the command's."""
    import os
    import subprocess
    import sys

    from s3kv.cli import _command

    assert _command(["--log-level", "INFO", "ls", "--url", "x"]) == "ls"
    assert _command(["--debug", "stats"]) == "stats" and _command(["--version"]) is None
    ok = subprocess.run([sys.executable, "-m", "s3kv.cli", "ls", "--url", f"file://{tmp_path}"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "no s3kv objects" in (ok.stdout + ok.stderr)
    env = {k: v for k, v in os.environ.items() if k != "S3KV_URL"}
    missing = subprocess.run([sys.executable, "-m", "s3kv.cli", "ls"], capture_output=True, text=True, timeout=120,
                             env=env)
    assert missing.returncode == 2 and "no store URL" in missing.stderr  # a usage error keeps click's code
