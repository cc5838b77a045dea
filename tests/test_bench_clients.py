"""The client comparison in ``s3kv bench transfer|lookup|jitter`` (issue 16), at --quick sizes.

Keys and sanity only (numbers depend on the machine; targets_met is recorded, not asserted).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from test_bench_cli import assert_common, positive, run_json

from s3kv.store.headprocs import auto_processes

pytest.importorskip("obstore")


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_transfer_compares_every_client() -> None:
    res = run_json("transfer", "--quick")
    assert_common(res, "transfer")
    assert res["s3kv_client"] == "obstore"
    clients = res["clients"]
    for name in ("s3kv", "s3kv_boto3", "raw_boto3", "raw_obstore"):
        c = clients[name]
        assert positive(c["save_gb_s"]) and positive(c["load_gb_s"]), name
        assert finite(c["save_cpu_s_per_gb"]) and finite(c["load_cpu_s_per_gb"]), name
    assert positive(clients["upstream_example"]["save_gb_s"])
    assert "raw_crt" in clients or "crt" in res["clients_missing"]
    assert res["fastest_raw_save_client"] in ("boto3", "obstore", "crt")
    assert positive(res["save_ratio_vs_fastest_raw"]) and positive(res["load_ratio_vs_fastest_raw"])
    assert res["bit_exact"] is True


def test_lookup_reports_summary_paths_per_client() -> None:
    res = run_json("lookup", "--quick", "--latency-ms", "5", "--prompts", "1k", "--repeats", "2")
    (row,) = res["results"]
    helpers = auto_processes() > 0
    assert res["geometry"]["head_processes"] == auto_processes()
    assert res["s3kv_client"] == ("obstore_helpers" if helpers else "obstore")
    for name in ("boto3", "obstore", *(["obstore_helpers"] if helpers else [])):
        c = row["clients"][name]
        # The probe's waves ran in the helpers (their CPU is counted beside the engine's), or not.
        assert (c["probe"]["helper_cpu_ms"] > 0) == (name == "obstore_helpers"), (name, c["probe"])
        assert c["summary_objects"] > 0 and c["repeats"] == 2
        for path in ("probe", "summary_hit", "summary_trusted_hit", "summary_miss"):
            x = c[path]
            assert finite(x["executor_cpu_ms"]) and finite(x["client_cpu_ms"]) and positive(x["latency_ms"])
            assert positive(x["wall_round_trips"])
            # Hashing is measured inside the lookup: part of the process's CPU, never more.
            assert 0 < x["chain_cpu_ms"] <= x["process_cpu_ms"]
        assert c["probe"]["hit_tokens"] == c["summary_hit"]["hit_tokens"] == row["expected_hit_tokens"]
        assert c["summary_trusted_hit"]["hit_tokens"] == row["expected_hit_tokens"]
        assert c["summary_trusted_hit"]["requests"] == 0  # a fresh listing: no request
        assert c["summary_miss"]["requests"] == 0 and c["summary_miss"]["hit_tokens"] == 0
        assert 0 < c["summary_hit"]["requests"] < c["probe"]["requests"] + 1
    assert "summary_wall_le_2.5_rt" in res["targets_met"]


def test_jitter_quick_json() -> None:
    res = run_json("jitter", "--quick")
    assert_common(res, "jitter")
    assert set(res["clients"]) >= {"boto3", "obstore"}
    assert res["s3kv_client"] == ("obstore_helpers" if auto_processes() > 0 else "obstore")
    for r in res["clients"].values():
        for phase in ("idle", "lookups", "download", "upload"):
            assert positive(r[phase]["p50_ms"]) and positive(r[phase]["p99_ms"]) and r[phase]["iterations"] > 10
        assert positive(r["download"]["gb_s"]) and positive(r["upload"]["gb_s"])
        assert r["lookups"]["lookups_per_s"] > 0
    assert isinstance(res["targets_met"]["transfer_p99_le_2x_idle"], bool)
