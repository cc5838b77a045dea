"""Structured logs: one JSON object per line, request ids as fields, no tokens or secrets."""

from __future__ import annotations

import json
import logging

from s3kv.tools.logs import KeyValueFormatter


def test_log_lines_are_json_with_request_ids():
    rec = logging.LogRecord("s3kv.leader", logging.WARNING, __file__, 1, "lookup of request %s timed out", (7,), None)
    rec.request_id = 7
    out = json.loads(KeyValueFormatter().format(rec))
    assert out["request_id"] == 7 and out["level"] == "WARNING" and out["msg"] == "lookup of request 7 timed out"
    assert out["logger"] == "s3kv.leader" and "ts" in out


def test_credentials_never_reach_a_log_line():
    from s3kv.tools.logs import TextFormatter

    rec = logging.LogRecord("s3kv.x", logging.WARNING, __file__, 1, "cannot open %s", ("s3://AK:SECRET@b/kv",), None)
    rec.url = "gs://token@bucket/p"
    out = json.loads(KeyValueFormatter().format(rec))
    assert out["msg"] == "cannot open s3://***@b/kv" and out["url"] == "gs://***@bucket/p"
    assert TextFormatter().format(rec) == "s3kv: warning: cannot open s3://***@b/kv"
