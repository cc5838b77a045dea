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
