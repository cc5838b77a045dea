"""``s3kv bench ...`` end to end through the CLI, at --quick sizes.

These check that every command runs, prints ONE JSON object with the documented keys and sane
values, and draws a PNG -- never performance thresholds (numbers depend on the machine; the
targets_met booleans are recorded, not asserted). lookup and transfer run on the embedded S3
server (SeaweedFS, else moto); e2e runs on a memory:// store to keep the file fast.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from s3kv.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["bench", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, (
        f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return json.loads(result.stdout)  # stdout holds exactly one JSON object; progress went to stderr


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, f"{path} is not a real chart"


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def assert_common(res: dict[str, Any], bench: str) -> None:
    assert res["bench"] == bench
    assert "kind" in res["store"]
    assert "latency_ms_injected" in res
    assert res["machine"]["cores"] >= 1
    assert res["targets_met"] and all(isinstance(v, bool) for v in res["targets_met"].values())
    assert set(res["targets_met"]) <= set(res["targets"])


def test_lookup_quick_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "lookup.png"
    res = run_json("lookup", "--quick", "--latency-ms", "5", "--plot", str(png))
    assert_common(res, "lookup")
    assert res["store"]["kind"] in ("seaweedfs", "moto")
    assert res["latency_ms_injected"] == 5
    assert [r["tokens"] for r in res["results"]] == [1024, 4096]
    for r in res["results"]:
        for key in (
            "tokens",
            "round_trips",
            "requests",
            "latency_ms",
            "warm_round_trips",
            "sequential_requests",
            "sequential_latency_ms",
            "speedup_vs_sequential",
        ):
            assert key in r, key
        assert 1 <= r["round_trips"] <= 3
        assert r["warm_round_trips"] == 0
        assert r["requests"] >= r["round_trips"]
        assert positive(r["latency_ms"]) and positive(r["sequential_latency_ms"])
        assert positive(r["speedup_vs_sequential"])
        # The seed's scan: one HEAD per full block per group (two groups).
        assert r["sequential_requests"] == 2 * (r["tokens"] // 32)
        assert r["hit_tokens"] == r["expected_hit_tokens"] == (r["tokens"] - 1) // 32 * 32
        assert r["warm_hit_tokens"] == r["hit_tokens"]
        for c in r["clients"].values():
            # Out of the box (default budget): whether or not the first lookup ran out, the
            # next one of the prefix is answered from the index in full.
            assert c["budget_next"]["hit_tokens"] == r["hit_tokens"] and c["budget_next"]["requests"] == 0
            assert c["budget_first"]["hit_tokens"] in (0, r["hit_tokens"])
            assert c["probe_miss"]["hit_tokens"] == 0 and c["probe_miss"]["requests"] > 0  # a prompt never stored
    assert res["targets_met"]["round_trips_le_3"] and res["targets_met"]["full_hit"]
    assert_png(png)


def test_lookup_with_latency_on_the_wire() -> None:
    """Issue 30: ``--s3-latency-ms`` puts the fault proxy in front of the server; each lookup row
    says its time budget (which follows the value) and how it ended."""
    res = run_json("lookup", "--quick", "--prompts", "1k", "--s3-latency-ms", "5", "--seq-cap", "8")
    assert res["store"]["s3_latency_ms"] == 5 and "fault proxy" in res["store"]["where"]
    assert res["latency_ms_injected"] == 0  # on the wire instead of the in-process model
    # The budget's prefill speed is the one figure (issue 38): Gemma-3-27B at 0.65 x 989.4 TFLOP/s.
    tps = res["lookup_budget"]["prefill_tokens_per_s"]
    assert 11_000 < tps < 13_500
    assert res["lookup_budget"] == {"stall_fraction": 0.5, "max_stall_ms": 500.0, "prefill_tokens_per_s": tps}
    (r,) = res["results"]
    for c in r["clients"].values():
        first = c["budget_first"]
        assert first["budget_ms"] == pytest.approx(0.5 * 992 / tps * 1e3, abs=0.1)
        assert first["decision"] in ("hit", "ran_out") and c["probe"]["decision"] == "hit"
        assert c["probe"]["wall_round_trips"] >= 1  # every round trip paid 5 ms on the wire


def test_lookup_table_on_memory_store() -> None:
    result = CliRunner().invoke(
        main,
        ["bench", "lookup", "--quick", "--url", "memory://bench-test-lookup", "--latency-ms", "1"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "s3kv bench lookup" in out and "speedup" in out and "targets:" in out
    assert "memory://bench-test-lookup" in out


def test_transfer_quick_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "transfer.png"
    res = run_json("transfer", "--quick", "--plot", str(png))
    assert_common(res, "transfer")
    assert res["latency_ms_injected"] == 0
    for key in (
        "save_mib_s",
        "load_mib_s",
        "raw_save_mib_s",
        "raw_load_mib_s",
        "seed_save_mib_s",
        "seed_load_mib_s",
        "save_ratio_vs_raw",
        "load_ratio_vs_raw",
        "speedup_vs_seed_path",
        "save_ratio_vs_fastest_raw_paired",
        "load_ratio_vs_fastest_raw_paired",
    ):
        assert positive(res[key]), key
    assert res["bit_exact"] is True
    (row,) = res["results"]
    assert positive(row["save_ratio_vs_fastest_raw_paired"]) and positive(row["load_ratio_vs_fastest_raw_paired"])
    assert row["object_mib"] == 4 and row["objects"] == 4 and row["pages"] == 16
    assert_png(png)


def test_staging_quick_json(tmp_path: Path) -> None:
    import torch

    png = tmp_path / "staging.png"
    res = run_json("staging", "--quick", "--plot", str(png))
    if torch.cuda.is_available():
        assert_common(res, "staging")
        assert positive(res["d2h_ratio_vs_memcpy"]) and positive(res["h2d_ratio_vs_memcpy"])
        assert positive(res["d2h_gbps"]) and positive(res["h2d_gbps"])
    else:
        assert res["skipped"] == "needs CUDA"
    assert_png(png)


def test_staging_copy_path_on_cpu() -> None:
    res = run_json("staging", "--quick", "--device", "cpu", "--page-mib", "0.25")
    assert_common(res, "staging")
    assert res["device"] == "cpu"
    assert positive(res["d2h_gbps"]) and positive(res["h2d_gbps"])


def test_staging_without_cuda_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    result = CliRunner().invoke(main, ["bench", "staging", "--quick"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "needs a CUDA device" in result.stdout


def test_e2e_quick_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "e2e.png"
    res = run_json("e2e", "--quick", "--url", "memory://bench-test-e2e", "--plot", str(png))
    assert_common(res, "e2e")
    assert res["store"]["kind"] == "memory"
    assert res["kv_mismatches"] == 0
    for policy in ("window", "all"):
        for phase in ("cold", "warm"):
            r = res["policies"][policy][phase]
            assert r["kv_mismatches"] == 0 and r["load_failures"] == 0
            assert positive(r["mean_request_latency_ms"]) and r["requests"] > 0
            assert 0.0 <= r["hit_rate"] <= 1.0
    assert res["tokens_served"] > 0 and res["hit_rate_warm"] > 0
    assert set(res["stored_bytes_by_group"]) == {"window", "all"}
    for groups in res["stored_bytes_by_group"].values():
        assert len(groups) == 2 and all(v["bytes"] > 0 for v in groups.values())
    assert 0 < res["stored_ratio_window_vs_all"] <= 1.0
    assert positive(res["prefill_tflops_saved"]) and positive(res["prefill_seconds_saved_est"])
    assert positive(res["rss_mib_start"]) and positive(res["rss_mib_end"])
    assert res["staging_high_water_bytes"] > 0
    assert res["memory"]["staging_high_water_bytes"] <= res["memory"]["staging_capacity_bytes"]
    assert len(res["memory"]["rss_mib_samples"]) == res["memory"]["rounds"]
    assert_png(png)


def test_prefill_flop_model_matches_hand_count() -> None:
    from s3kv.tools.bench.common import GEMMA3_27B as m

    assert len(m.global_layers) == 10 and len(m.local_layers) == 52
    # ~25.6 B matmul weights in the decoder layers (27 B with the tied 262k x 5376 embedding).
    assert 25.0e9 < m.matmul_params < 26.0e9
    n = 4096
    attn = 4 * 32 * 128 * (10 * n * (n + 1) / 2 + 52 * (1024 * 1025 / 2 + (n - 1024) * 1024))
    assert m.prefill_flops(n) == pytest.approx(2 * m.matmul_params * n + attn)
    assert m.prefill_flops(0) == 0
    # A 13 MiB local-group page at TP 1 -> 2 blocks per object (s3kv's ~32 MiB target).
    assert m.page_bytes(32) == {"full": 10 * 262144, "sliding": 52 * 262144}


def test_transfer_single_object_times_every_raw_put() -> None:
    """One object per size: the raw baseline's one PUT is timed (it once warmed the connection with
    the only object and timed nothing, printing ~190 GB/s). Both sides PUT the same bytes to the
    same server, so the raw rate stays within a small factor of s3kv's."""
    res = run_json(
        "transfer", "--quick", "--object-mib", "4", "--total-mib", "4", "--device", "cpu",
        "--upload-threads", "2", "--download-threads", "3",
    )
    (row,) = res["results"]
    assert row["objects"] == 1 and res["device"] == "cpu"
    assert res["concurrency"] == {"save": 2, "load": 3}
    for client, rate in row["mib_s"].items():
        if client.startswith("raw_") and client.endswith("_save"):
            assert rate < 20 * row["save_mib_s"], (client, rate, row["save_mib_s"])


def test_transfer_device_cuda_without_a_gpu_is_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = CliRunner().invoke(main, ["bench", "transfer", "--quick", "--device", "cuda"])
    assert r.exit_code == 2 and "--device" in r.output and "no CUDA device" in r.output
    assert "transfer: store" not in r.output  # refused before any server started


# --------------------------------------------------------------------------- issue 13.6: words for users


@pytest.mark.parametrize("bench", ["lookup", "transfer", "staging", "e2e"])
def test_plot_dependency_is_checked_before_the_run(bench: str, tmp_path: Path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    r = CliRunner().invoke(main, ["bench", bench, "--quick", "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2
    assert "--plot needs matplotlib: pip install matplotlib" in r.output
    assert f"{bench}: store" not in r.output and "staging:" not in r.output  # nothing ran


def test_help_texts_speak_plainly() -> None:
    for args in (["bench", "--help"], *([["bench", b, "--help"] for b in ("lookup", "transfer", "staging", "e2e")])):
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 0
        assert "seed" not in r.output.lower(), (args, r.output)
    r = CliRunner().invoke(main, ["bench", "transfer", "--help"])
    assert "one object per block, synchronous" in " ".join(r.output.split())


@pytest.mark.parametrize(
    "bench,args,columns",
    [
        ("lookup", ["--quick", "--latency-ms", "2", "--prompts", "1k"],
         ["speedup", "warm RTs", "seq HEADs", "wall RTs", "client"]),
        ("transfer", ["--quick", "--total-mib", "4"], ["vs fastest", "vs example", "CPU s/GB"]),
        ("e2e", ["--quick", "--url", "memory://bench-legend", "--rounds", "1"], ["hit", "window / all"]),
    ],
)
def test_every_printed_ratio_is_explained(bench: str, args: list[str], columns: list[str]) -> None:
    r = CliRunner().invoke(main, ["bench", bench, *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    table, _, legend = r.stdout.partition("what the numbers mean:")
    assert legend, r.stdout
    explained = [ln.strip() for ln in legend.splitlines() if ln.strip()]
    for col in columns:
        assert col in table, (col, table)
        assert any(ln.startswith(col) or f" {col} " in f" {ln} " for ln in explained), (col, explained)
    assert any(ln.startswith("targets:") for ln in explained)


def test_bench_url_scheme_is_checked_first() -> None:
    r = CliRunner().invoke(main, ["bench", "lookup", "--quick", "--url", "http://u:pw@example.com/kv"])
    assert r.exit_code == 2
    assert "scheme 'http://' is not allowed" in r.output and "pw" not in r.output


def test_transfer_paired_ratios_pair_each_repeat_with_its_own_raw_runs() -> None:
    from s3kv.tools.bench.transfer import paired_ratios

    # Repeat 2 ran on a server twice as slow for everyone: paired, s3kv is still at 0.8x of the
    # fastest raw client (save) and 0.5x (load). Repeat 3 has one raw outlier: the median of
    # three ignores it. Each repeat is paired with its own fastest raw client.
    runs = [
        {"s3kv_save": 1.25, "raw_a_save": 1.0, "raw_b_save": 1.1, "s3kv_load": 1.0, "raw_a_load": 1.0, "raw_b_load": 0.5},
        {"s3kv_save": 2.5, "raw_a_save": 2.0, "raw_b_save": 2.2, "s3kv_load": 2.0, "raw_a_load": 2.0, "raw_b_load": 1.0},
        {"s3kv_save": 1.25, "raw_a_save": 0.1, "raw_b_save": 1.1, "s3kv_load": 1.0, "raw_a_load": 1.0, "raw_b_load": 0.5},
    ]
    got = paired_ratios(runs, ["a", "b"])
    assert got["save"] == pytest.approx(0.8) and got["load"] == pytest.approx(0.5)
    assert math.isnan(paired_ratios([{"s3kv_save": 1.0}], ["a"])["save"])  # no raw run in that repeat
