"""The user's path through the ``s3kv`` command line, run as a user runs it (issue 13).

Each test drives the real command (click's runner, or a subprocess where processes matter) and
asserts the one line a user reads, or the corrected output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from s3kv import __version__
from s3kv.cli import main

REPO = Path(__file__).resolve().parents[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """The test process's env without any S3KV_* / AWS_* leftovers, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("S3KV_", "AWS_"))}
    env.update(AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def s3kv(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``s3kv ARGS`` in a fresh process, as typed at a shell."""
    return subprocess.run(
        [sys.executable, "-m", "s3kv.cli", *args],
        env=env or _clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def invoke(*args: str, env: dict[str, str | None] | None = None, input: str | None = None):
    base: dict[str, str | None] = {k: None for k in os.environ if k.startswith("S3KV_")}
    base.update(env or {})
    return CliRunner().invoke(main, list(args), env=base, input=input)


def error_line(result) -> str:
    """The one 'Error: ...' line of a failed command (and check that it is only one)."""
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errs) == 1, result.output
    assert "Traceback" not in result.output, result.output
    return errs[0]


# --------------------------------------------------------------------------- 2: one-line errors


def test_bad_setting_fails_the_demo_in_one_line_before_any_cluster():
    # S3KV_STAGING_MIB=-1 used to exit 0: the demo overrode it silently.
    r = invoke("demo", env={"S3KV_STAGING_MIB": "-1"})
    assert r.exit_code == 1
    assert error_line(r) == "Error: S3KV_STAGING_MIB / staging_mib: must be > 0, got -1"
    assert "cluster" not in r.output


def test_disallowed_scheme_is_one_line_and_hides_credentials():
    for cmd in (["ls"], ["demo"], ["verify"]):
        r = invoke(*cmd, env={"S3KV_URL": "ftp://alice:hunter2@files.example.com/kv"})
        assert r.exit_code == 1, r.output
        line = error_line(r)
        assert "scheme 'ftp://' is not allowed" in line and "s3://" in line
        assert "hunter2" not in r.output and "alice" not in r.output
        assert "ftp://***@files.example.com/kv" in line


def test_bad_config_file_is_one_line(tmp_path):
    bad = tmp_path / "s3kv.json"
    bad.write_text("{not json")
    r = invoke("demo", env={"S3KV_CONFIG_FILE": str(bad)})
    assert r.exit_code == 1
    assert error_line(r).startswith(f"Error: S3KV_CONFIG_FILE='{bad}': cannot parse it as JSON: ")
    bad.write_text(json.dumps({"url": "file:///tmp/x", "stagin_mib": 4}))
    r = invoke("ls", env={"S3KV_CONFIG_FILE": str(bad)})
    assert "unknown setting 'stagin_mib'" in error_line(r) and "did you mean staging_mib?" in r.output


def test_unknown_env_var_warns_with_a_did_you_mean(tmp_path):
    r = s3kv("ls", "--url", f"file://{tmp_path}", env=_clean_env(S3KV_STAGNG_MIB="64"))
    assert r.returncode == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if "S3KV_STAGNG_MIB" in ln]
    assert warnings == [
        "s3kv: warning: S3KV_STAGNG_MIB is not an s3kv setting and is ignored; did you mean S3KV_STAGING_MIB?"
    ]


def test_missing_bucket_and_dead_endpoint_are_one_line(seaweed_s3):
    env = {k: v for k, v in seaweed_s3.env().items() if k != "S3KV_URL"}
    r = invoke("demo", "--url", "s3://no-such-bucket-here/kv", env=env)
    assert r.exit_code == 1
    line = error_line(r)
    assert "bucket 'no-such-bucket-here' does not exist" in line and "cluster" not in r.output

    dead = dict(env, AWS_ENDPOINT_URL_S3="http://127.0.0.1:9", S3KV_MAX_ATTEMPTS="1")
    r = invoke("demo", "--url", "s3://some-bucket/kv", env=dead)
    assert r.exit_code == 1
    assert "cannot reach the S3 endpoint http://127.0.0.1:9" in error_line(r)


def test_a_failing_cluster_is_one_line_and_debug_shows_the_traceback(tmp_path):
    """A cluster process reports its failure as one line; --debug (S3KV_DEBUG) adds the traceback."""
    out = tmp_path / "result.json"
    bad_shape = json.dumps({"window": -5})  # the model cannot be built
    cmd = [sys.executable, "-m", "s3kv.tools.demo", "A", str(out), bad_shape, "{}"]
    env = _clean_env(S3KV_URL=f"file://{tmp_path}/c")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    err = json.loads(out.read_text())["error"]
    assert "\n" not in err and "window" in err
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(cmd, env=dict(env, S3KV_DEBUG="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr

    # And the parent turns it into one line naming the cluster.
    import click

    from s3kv.tools.demo import DemoShape, _spawn

    with pytest.raises(click.ClickException) as ei:
        _spawn("A", DemoShape(window=-5), {}, env)
    assert ei.value.message.startswith("demo cluster A (cold) failed: ")
    assert "\n" not in ei.value.message


def test_unexpected_errors_are_one_line_unless_debug(monkeypatch, tmp_path):
    import s3kv.tools.ops

    def boom(*a, **k):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(s3kv.tools.ops, "_walk", boom)
    url = f"file://{tmp_path}"
    r = invoke("ls", "--url", url)
    assert r.exit_code == 1
    assert error_line(r) == "Error: disk on fire"  # the message, never the class name (issue 40.6)
    assert "s3kv --debug" in r.output
    r = invoke("--debug", "ls", "--url", url)
    assert isinstance(r.exception, RuntimeError)  # --debug lets the traceback through


# --------------------------------------------------------------------------- 7: memory:// is per process


def test_demo_refuses_memory_urls_and_ops_warn():
    r = invoke("demo", "--url", "memory://shared")
    assert r.exit_code == 2
    assert "separate processes" in r.output and "file:///" in r.output
    r = invoke("ls", "--url", "memory://shared")
    assert r.exit_code == 0
    assert "lives inside one process" in r.output


# --------------------------------------------------------------------------- 8: ops honour settings, --version


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and r.output.splitlines()[0] == f"s3kv, version {__version__}"
    assert r.output.splitlines()[1].startswith("TensorRT-LLM")


def test_ops_read_the_url_and_settings_from_the_config_file(tmp_path):
    from s3kv.core.keys import KeyScheme
    from s3kv.store.factory import open_store

    cache = tmp_path / "cache"
    store = open_store(f"file://{cache}")
    store.put(KeyScheme("", b"\x01" * 16, 1).object_key("ab" * 8, 0, b"\x02" * 16), b"x" * 200)
    cfg = tmp_path / "s3kv.json"
    cfg.write_text(json.dumps({"url": f"file://{cache}"}))
    r = invoke("ls", "--json", env={"S3KV_CONFIG_FILE": str(cfg)})
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["total"]["objects"] == 1
    # A bad value in the same file stops the command with its name.
    cfg.write_text(json.dumps({"url": f"file://{cache}", "max_attempts": 0}))
    r = invoke("ls", env={"S3KV_CONFIG_FILE": str(cfg)})
    assert f"S3KV_CONFIG_FILE='{cfg}', key 'max_attempts': must be > 0, got 0" in error_line(r)


def test_ops_use_the_retry_settings():
    """S3KV_MAX_ATTEMPTS reaches the ops' store: a server that drops every connection is tried
    exactly that many times."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    accepted: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(1)
            conn.close()  # no answer: a transport fault worth retrying

    threading.Thread(target=serve, daemon=True).start()
    env = {
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    try:
        for attempts in (1, 3):
            accepted.clear()
            r = invoke("ls", "--url", "s3://bucket-x/kv", env={**env, "S3KV_MAX_ATTEMPTS": str(attempts)})
            assert r.exit_code == 1
            error_line(r)
            assert len(accepted) == attempts, (attempts, len(accepted))
    finally:
        srv.close()


def _population(tmp_path, n: int) -> str:
    from s3kv.core.keys import KeyScheme
    from s3kv.core.objects import ObjectIdentity, encode_object, object_metadata
    from s3kv.store.factory import open_store

    url = f"file://{tmp_path}/gc"
    store = open_store(url)
    scheme = KeyScheme("", b"\x07" * 16, 1)
    ident = ObjectIdentity(scheme.namespace, "cd" * 8, 0, 1, 16, 32)
    for i in range(n):
        last = bytes([i]) * 16
        store.put(scheme.object_key("cd" * 8, 0, last), encode_object(ident, i, last, [b"p" * 32]),
                  object_metadata(ident, i, 1))
    return url


def _count(url: str) -> int:
    from s3kv.store.factory import open_store

    return sum(1 for _ in open_store(url).list(""))


def test_gc_asks_before_deleting_many_objects(tmp_path):
    url = _population(tmp_path, 5)
    args = ["gc", "--url", url, "--older-than", "0", "--confirm-above", "3"]
    r = invoke(*args, input="n\n")
    assert r.exit_code == 1 and "Delete 5 objects" in r.output
    assert "not deleting 5 objects" in error_line(r) and "--yes" in r.output
    assert _count(url) == 5
    r = invoke(*args, "--json")  # a script cannot answer: refused, nothing deleted
    assert r.exit_code == 1 and _count(url) == 5
    r = invoke(*args, input="y\n")
    assert r.exit_code == 0, r.output
    assert "deleted 5 objects" in r.output and _count(url) == 0
    url = _population(tmp_path / "again", 5)
    r = invoke("gc", "--url", url, "--older-than", "0", "--confirm-above", "3", "--yes")
    assert r.exit_code == 0 and _count(url) == 0
    url = _population(tmp_path / "few", 3)  # at most --confirm-above: no question asked
    r = invoke("gc", "--url", url, "--older-than", "0", "--confirm-above", "3")
    assert r.exit_code == 0 and _count(url) == 0


def test_ls_and_stats_show_group_windows(tmp_path):
    from s3kv.core.keys import KeyScheme
    from s3kv.core.objects import ObjectIdentity, encode_object, object_metadata
    from s3kv.store.factory import open_store

    url = f"file://{tmp_path}/w"
    store = open_store(url)
    scheme = KeyScheme("", b"\x05" * 16, 1)
    for gfp, window in (("aa" * 8, "full"), ("bb" * 8, "256")):
        ident = ObjectIdentity(scheme.namespace, gfp, 0, 1, 16, 32)
        last = bytes.fromhex(gfp) * 2
        md = {**object_metadata(ident, 0, 1), "s3kv-window": window}
        store.put(scheme.object_key(gfp, 0, last), encode_object(ident, 0, last, [b"q" * 32]), md)
    r = invoke("ls", "--url", url)
    assert r.exit_code == 0, r.output
    assert re.search(r"^0505\S+\s+full \+ w=256\s+2\s", r.output, re.M), r.output
    r = invoke("ls", "--url", url, "-n", "0505")
    assert re.search(rf"^{'aa' * 8}\.0of1\s+full\s", r.output, re.M), r.output
    assert re.search(rf"^{'bb' * 8}\.0of1\s+w=256\s", r.output, re.M), r.output
    doc = json.loads(invoke("stats", "--url", url, "--json").output)
    assert {g["group"]: g["window"] for g in doc["namespaces"][0]["groups"]} == {
        f"{'aa' * 8}.0of1": "full",
        f"{'bb' * 8}.0of1": "w=256",
    }


# --------------------------------------------------------------------------- 1: the demo's prefix, --keep, server


def test_demo_url_prints_the_real_prefix_and_ls_finds_it(tmp_path):
    url = f"file://{tmp_path}/kv"
    r = s3kv("demo", "--url", url, "--keep", env=_clean_env())
    assert r.returncode == 0, r.stderr
    run_url = re.search(r"^store: (\S+) \(your store\)$", r.stdout, re.M).group(1)
    assert re.fullmatch(re.escape(url) + r"/demo-\d+-[0-9a-f]{6}", run_url), run_url
    assert f"kept; look with: s3kv ls --url {run_url}" in r.stdout
    # ls at the URL the user gave finds what the demo wrote, one level down.
    doc = json.loads(s3kv("ls", "--url", url, "--json").stdout)
    assert doc["unrecognised"]["objects"] == 0
    [ns] = doc["namespaces"]
    assert ns["path"] == run_url[len(url) + 1 :] + "/" and ns["objects"] > 0
    text = s3kv("ls", "--url", url).stdout
    assert f"{ns['path']}{ns['namespace']}" in text
    stats = json.loads(s3kv("stats", "--url", url, "--json").stdout)
    assert stats["total"]["objects"] == ns["objects"] and stats["unrecognised"]["objects"] == 0
    dry = json.loads(s3kv("gc", "--url", url, "--older-than", "0", "--dry-run", "--json").stdout)
    assert dry["matched"]["objects"] == ns["objects"]

    # Without --keep the run cleans up after itself and says so.
    r = s3kv("demo", "--url", url, "--json", env=_clean_env())
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["cleanup"].startswith("deleted the demo's ") and res["store_url"].startswith(url + "/demo-")
    assert res["warm"]["kv_mismatches"] == 0 and res["warm"]["matched_tokens"] > 0
    for phase in ("cold", "warm"):  # what the engine would have suffered: nothing
        assert res[phase]["engine_crashes"] == 0 and res[phase]["hung_engines"] == 0
        assert res[phase]["contained_errors"] == 0 and set(res[phase]["failed_load_rungs"]) == {
            "engine_recompute", "parked_retry", "parked_recovered"}
    after = json.loads(s3kv("ls", "--url", url, "--json").stdout)
    assert after["total"]["objects"] == ns["objects"]  # only the kept run is left


def test_demo_keeps_user_settings_and_says_so(tmp_path):
    r = s3kv("demo", "--url", f"file://{tmp_path}/kv", "--json",
             env=_clean_env(S3KV_CHECKPOINT_TOKENS="256", S3KV_LOAD_MODE="sync"))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["user_settings"] == {"checkpoint_tokens": "S3KV_CHECKPOINT_TOKENS", "load_mode": "S3KV_LOAD_MODE"}


def _wait_for(proc: subprocess.Popen[str], pattern: str, timeout: float = 120) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(lines))


def _exports(lines: list[str]) -> dict[str, str]:
    out = {}
    for ln in lines:
        m = re.match(r"\s*export (\w+)=(\S+)$", ln)
        if m:
            out[m.group(1)] = m.group(2).strip("'")
    return out


def test_demo_keep_leaves_the_embedded_server_running_for_inspection():
    proc = subprocess.Popen(
        [sys.executable, "-m", "s3kv.cli", "demo", "--keep", "--server", "moto"],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
    )
    try:
        lines = _wait_for(proc, r"Press Ctrl-C")
        env = _exports(lines)
        assert env["S3KV_URL"] == "s3://s3kv-demo/demo" and env["AWS_ENDPOINT_URL_S3"].startswith("http://127.0.0.1:")
        doc = json.loads(s3kv("ls", "--json", env=_clean_env(**env)).stdout)
        assert doc["total"]["objects"] > 0 and doc["unrecognised"]["objects"] == 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_server_command_prints_a_usable_env(tmp_path):
    env_file = tmp_path / "s3kv.env"
    proc = subprocess.Popen(
        [sys.executable, "-m", "s3kv.cli", "server", "--kind", "moto", "--env-file", str(env_file)],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
    )
    try:
        lines = _wait_for(proc, r"Press Ctrl-C")
        env = _exports(lines)
        assert env == _exports(env_file.read_text().splitlines())
        assert env["S3KV_URL"] == "s3://s3kv/kv"
        r = s3kv("ls", env=_clean_env(**env))
        assert r.returncode == 0 and r.stdout.strip() == "no s3kv objects under s3://s3kv/kv", r.stdout + r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert proc.stdout.read().strip().endswith("s3kv server: stopped")  # type: ignore[union-attr]


# --------------------------------------------------------------------------- 10: log level reaches clusters


def test_log_level_reaches_the_demo_clusters(tmp_path):
    r = s3kv("--log-level", "INFO", "demo", "--url", f"file://{tmp_path}/kv", "--json")
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # stdout stays one JSON object
    # Both cluster processes log their geometry at INFO.
    assert len(re.findall(r"^s3kv: info: s3kv geometry: ", r.stderr, re.M)) == 2, r.stderr
    quiet = s3kv("demo", "--url", f"file://{tmp_path}/kv", "--json")
    assert "s3kv: info:" not in quiet.stderr


# --------------------------------------------------------------------------- 9: docs stand alone


def test_no_links_outside_the_repository():
    """A clone has no ../shared: nothing a user reads may point there."""
    offenders = []
    for path in [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("s3kv/**/*.py"),
                 *REPO.glob("examples/*.py"), *REPO.glob("infra/**/*.md")]:
        text = path.read_text()
        for m in re.finditer(r"\.\./shared/|/work/shared", text):
            offenders.append(f"{path.relative_to(REPO)}: {text[max(0, m.start() - 30) : m.end() + 30]!r}")
    assert offenders == []
