"""Credentials in a store URL are refused and never shown, even when the secret holds a ``/`` (issue 29.2).

About half of AWS secret access keys contain a ``/``. A URL parser ends the authority at the first
``/``, so ``s3://AKIA…:wJal…/K7MD…@bucket/p`` has host ``AKIA…:wJal…`` and no ``@`` in it: the
check that looked for ``@`` in the host passed it, and ``s3kv ls`` printed it whole.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from click.testing import CliRunner

from s3kv.cli import main
from s3kv.config import ConfigError, check_url, load_settings, redact
from s3kv.store.base import StoreConfigError
from s3kv.store.factory import parse_store_url
from s3kv.tools.logs import KeyValueFormatter, TextFormatter

# AWS's documented example key pair: the secret holds two '/'.
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PIECES = (KEY_ID, "wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYEXAMPLEKEY")
LEAKY = [
    f"s3://{KEY_ID}:{SECRET}@my-bucket/kv",
    f"s3://{SECRET}@my-bucket/kv",  # a bare token
    f"gs://{KEY_ID}:{SECRET}@bucket/kv",
    f"memory://{KEY_ID}:{SECRET}@name",
    f"{KEY_ID}:{SECRET}@my-bucket/kv",  # no scheme at all
]


def _leaks(text: str) -> list[str]:
    return [p for p in PIECES if p in text]


@pytest.mark.parametrize("url", LEAKY)
def test_a_secret_with_a_slash_is_refused_without_being_shown(url):
    with pytest.raises(ConfigError) as ei:
        load_settings({"S3KV_URL": url})
    msg = str(ei.value)
    assert "S3KV_URL" in msg, msg
    assert "credentials in the URL are not accepted" in msg or "://" not in url, msg
    assert "\n" not in msg and _leaks(msg) == [], msg


@pytest.mark.parametrize("url", LEAKY[:4])
def test_the_store_factory_refuses_it_too_without_echo(url):
    with pytest.raises(StoreConfigError) as ei:
        parse_store_url(url)
    assert _leaks(str(ei.value)) == [] and "credentials" in str(ei.value)


@pytest.mark.parametrize("cmd", [["ls"], ["stats"], ["verify"], ["gc", "--older-than", "0"]])
def test_operator_commands_refuse_it_in_one_line(cmd):
    env = {k: None for k in os.environ if k.startswith("S3KV_")}
    for how in ("env", "flag"):
        url = LEAKY[0]
        args = [*cmd, "--url", url] if how == "flag" else cmd
        r = CliRunner().invoke(main, args, env={**env, "S3KV_URL": url} if how == "env" else env)
        assert r.exit_code != 0, r.output
        errs = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert len(errs) == 1 and "credentials in the URL are not accepted" in errs[0], r.output
        assert _leaks(r.output) == [], r.output


def test_check_url_still_passes_plain_urls_and_file_paths_with_an_at():
    for url in ("s3://bucket/kv", "file:///data/run@1/kv", "file://localhost/d", "memory://x", "gs://b/p"):
        assert check_url(url) == url


def test_redact_hides_everything_up_to_the_last_at_of_each_url():
    text = f"open {LEAKY[0]} failed; endpoint 'http://u:p/w@minio:9000/x' and s3://b/p, file:///d@1 ok"
    out = redact(text)
    assert _leaks(out) == [] and "p/w" not in out, out
    assert out == "open s3://***@my-bucket/kv failed; endpoint 'http://***@minio:9000/x' and s3://b/p, file:///d@1 ok"


def test_log_lines_never_carry_a_secret_with_a_slash():
    rec = logging.LogRecord("s3kv.x", logging.WARNING, __file__, 1, "cannot open %s", (LEAKY[0],), None)
    rec.url = LEAKY[2]
    out = KeyValueFormatter().format(rec)
    assert _leaks(out) == [] and json.loads(out)["msg"] == "cannot open s3://***@my-bucket/kv"
    assert _leaks(TextFormatter().format(rec)) == []


def test_an_endpoint_url_with_credentials_is_refused_without_echo(monkeypatch):
    """The endpoint (AWS_ENDPOINT_URL_S3, the AWS config file) is printed in start-up errors and
    the client's own messages, which an engine's log handlers do not redact: refused."""
    from s3kv.store.s3 import S3Store

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{KEY_ID}:{SECRET}@127.0.0.1:9")
    with pytest.raises(StoreConfigError) as ei:
        S3Store("my-bucket", aws_access_key_id="a", aws_secret_access_key="b")
    msg = str(ei.value)
    assert "AWS_ENDPOINT_URL_S3" in msg and "credentials" in msg and _leaks(msg) == [], msg


def test_a_mistyped_scheme_still_hides_the_key_pair():
    """``s3:/…`` (one slash) or ``s3:…`` (none) is a typo that carries a key pair as well as ``s3://``."""
    text = f"open s3:/{KEY_ID}:{SECRET}@my-bucket/kv and s3:{KEY_ID}:{SECRET}@b, file:/d ok"
    out = redact(text)
    assert _leaks(out) == [] and KEY_ID not in out, out
    assert out == "open s3:/***@my-bucket/kv and ***@b, file:/d ok"
    with pytest.raises(ConfigError) as ei:
        check_url(f"s3:/{KEY_ID}:{SECRET}@my-bucket/kv")
    assert _leaks(str(ei.value)) == [] and KEY_ID not in str(ei.value), ei.value


# -- issue 37: secrets in a URL's query string or fragment --------------------------------------
TOKEN = "SECRETtok3n"
QUERIED = [f"gs://b/p?token={TOKEN}", f"az://c/p?sv=2024&sig={TOKEN}", f"gs://b/p#access_token={TOKEN}",
           f"s3://{KEY_ID}:{SECRET}@b/p?x={TOKEN}"]


@pytest.mark.parametrize("url", QUERIED)
def test_redact_hides_a_urls_query_string_and_fragment(url):
    """``redact('gs://b/p?token=SECRET')`` printed the secret: a query or fragment is hidden whole,
    in a URL alone and inside any text, with or without credentials before the host."""
    from s3kv.config import redact_url

    for shown in (redact_url(url), redact(f"cannot open {url}: 404"), redact(f"'{url}'")):
        assert TOKEN not in shown and _leaks(shown) == [], shown
    assert redact(f"open {url} failed") == f"open {redact_url(url)} failed"
    assert redact_url(f"gs://b/p?token={TOKEN}") == "gs://b/p?***"
    assert redact_url("s3://b/kv") == "s3://b/kv" and redact("s3kv: ok; file:///d@1 ok") == "s3kv: ok; file:///d@1 ok"


def _fsspec_errors(store) -> list[str]:
    """Everything an fsspec store shows: its URL, repr, and the errors (and their causes) of a
    read, a HEAD, a bad key and a start-up check that fail."""
    from s3kv.store.base import ByteRange

    shown = [store.url, repr(store)]
    for call in (lambda: store.get_ranges("ns/g/k", [ByteRange(0, 1)]), store.check_access,
                 lambda: store.get_ranges("../k", [ByteRange(0, 1)])):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - every error is what is shown
            shown += [str(exc), repr(exc), str(exc.__cause__), repr(exc.__cause__)]
    failed = store.head_many(["ns/g/k"]).failed
    shown += [str(e) for e in failed.values()]
    return shown


def test_fsspec_store_errors_never_print_the_urls_secret(tmp_path):
    """fsspec keeps a URL's query as part of its root path, so every error that names a file
    printed it: the store shows its URL redacted, and scrubs the root's secret from its errors
    and from the OSErrors chained to them (an engine's own log handlers print those)."""
    from s3kv.store.fsspec_store import FsspecStore

    (tmp_path / f"c?token={TOKEN}").write_text("a file where the cache directory should be")
    local = FsspecStore(f"file://{tmp_path}/c?token={TOKEN}")
    remote = FsspecStore(f"memory://b/p?token={TOKEN}")  # fsspec's in-memory fs: the remote code path
    for store in (local, remote):
        shown = _fsspec_errors(store)
        assert len(shown) > 4 and all(TOKEN not in s for s in shown), shown
    assert local.url == f"file://{tmp_path}/c?***"


def test_the_breakers_log_lines_and_refusals_never_print_the_urls_secret(caplog):
    """The engine's breaker is named by its engine key (which holds S3KV_URL) in every
    transition's WARNING and every refusal -- lines that reach the host's log handlers."""
    from s3kv.store.breaker import BreakerPolicy, CircuitBreakerStore
    from s3kv.store.memory import MemoryStore

    b = CircuitBreakerStore(MemoryStore(), BreakerPolicy(failures=1), name=repr((QUERIED[0], "model", 16)))
    with caplog.at_level("WARNING", logger="s3kv.breaker"):
        b.note_timeout("head")
    assert b.state.value == "open"
    refused = b.head_many(["k"]).failed["k"]
    assert "circuit breaker for" in str(refused) and TOKEN not in str(refused)
    assert caplog.records and all(TOKEN not in r.getMessage() and TOKEN not in str(r.__dict__) for r in caplog.records)


@pytest.mark.parametrize("cmd", [["ls"], ["stats"], ["verify"], ["gc", "--older-than", "0", "--dry-run"]])
def test_operator_commands_never_print_a_urls_query(cmd, tmp_path, monkeypatch):
    """``--url file:///…?token=…`` (accepted: fsspec takes it as a path): neither the JSON, nor
    the table, nor the one-line error when the store fails shows the secret."""
    import s3kv.store.fsspec_store as fs

    env = {k: None for k in os.environ if k.startswith("S3KV_")}
    (tmp_path / "c").mkdir()
    (tmp_path / f"c?token={TOKEN}").mkdir()
    url = f"file://{tmp_path}/c?token={TOKEN}"
    for extra in ([], ["--json"]):
        r = CliRunner().invoke(main, [*cmd, "--url", url, *extra], env=env)
        assert r.exit_code == 0 and TOKEN not in r.output, r.output

    def denied(base, *a, **k):  # the listing fails the way a real one does: an OSError naming the root
        raise PermissionError(13, "Permission denied", base)

    monkeypatch.setattr(fs.os, "walk", denied)
    r = CliRunner().invoke(main, [*cmd, "--url", url], env=env)
    assert r.exit_code == 1 and "denied access" in r.output, r.output
    assert TOKEN not in r.output, r.output


def test_the_demos_progress_lines_never_print_a_urls_query(capsys):
    from s3kv.tools.demo import _progress

    _progress(f"demo: cluster A (cold), then cluster B (warm), on {QUERIED[1]}/demo-1 (your store)")
    assert TOKEN not in capsys.readouterr().err


def test_a_benchmarks_store_line_never_prints_a_urls_query(tmp_path):
    """``s3kv bench … --url`` prints where it ran (JSON ``store.where`` and the table)."""
    from s3kv.tools.bench.common import bench_store

    (tmp_path / f"c?token={TOKEN}").mkdir()
    with bench_store(f"file://{tmp_path}/c?token={TOKEN}", name="secrets") as bs:
        shown = json.dumps(bs.info())
    assert TOKEN not in shown and "c?***" in shown, shown
