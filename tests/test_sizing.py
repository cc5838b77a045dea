"""``s3kv size``: the numbers follow from the model's geometry and the connector's own rules."""

from __future__ import annotations

import json

from click.testing import CliRunner

from s3kv.cli import main
from s3kv.tools.sizing import PRESETS, size


def test_bytes_per_token_from_the_geometry():
    s = size(PRESETS["gemma-3-27b"], prompt_tokens=(8192,))
    # 2 (K and V) x 16 KV heads x 128 dims x 2 bytes per layer; 10 full-attention, 52 sliding layers.
    assert s.kv_bytes_per_token == {"full": 10 * 8192, "window 1024": 52 * 8192}


def test_policies_and_tensor_parallelism():
    g = size(PRESETS["gemma-3-27b"], prompt_tokens=(32768,))
    win, allp = (next(r for r in g.prompts if r["policy"] == p) for p in ("window", "all"))
    per_token = sum(g.kv_bytes_per_token.values())
    assert allp["stored_bytes"] >= 32768 * per_token  # every block of every layer (+ headers)
    assert win["stored_bytes"] < 0.5 * allp["stored_bytes"] and win["objects"] < allp["objects"]
    assert win["loaded_bytes"] == allp["loaded_bytes"]  # a hit reads the same pages either way
    # A hit of the whole prompt: every full-attention block, and only the last window of sliding ones.
    h = (32768 - 1) // 32 * 32
    # Sliding: blocks from (h + 1 - 1024) // 32 = 991 up to 1023, i.e. 32 blocks = 1024 tokens.
    assert win["loaded_bytes"] == h * g.kv_bytes_per_token["full"] + 1024 * g.kv_bytes_per_token["window 1024"]
    llama1 = size(PRESETS["llama-3.1-70b"], prompt_tokens=(8192,))
    llama4 = size(PRESETS["llama-3.1-70b"], tp=4, prompt_tokens=(8192,))
    w1, a1 = llama1.prompts
    assert (w1["stored_bytes"], w1["objects"]) == (a1["stored_bytes"], a1["objects"])  # no sliding layers
    # TP shards split the bytes of every page and each writes its own objects.
    assert abs(llama4.prompts[0]["stored_bytes"] - w1["stored_bytes"]) < 0.01 * w1["stored_bytes"]
    assert llama4.prompts[0]["objects"] > w1["objects"]
    assert llama4.prompts[0]["prefill_s"] < w1["prefill_s"]


def test_monthly_cost_scales_with_traffic_and_retention():
    def month(**kw):
        r = CliRunner().invoke(main, ["size", "--prompt-tokens", "8192", "--json", *kw.get("args", [])])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["monthly"]

    assert month() is None  # no traffic given: no monthly estimate
    a = month(args=["--new-tokens-per-day", "1e7", "--retention-days", "7"])
    b = month(args=["--new-tokens-per-day", "1e7", "--retention-days", "14"])
    assert abs(b["storage_usd"] - 2 * a["storage_usd"]) < 1e-6 and b["put_usd"] == a["put_usd"]
    c = month(args=["--hit-tokens-per-day", "1e8"])
    assert c["storage_usd"] == 0 and c["get_head_usd"] > 0


def test_unknown_model_is_one_line():
    r = CliRunner().invoke(main, ["size", "--model", "gpt-9"])
    assert r.exit_code == 2 and "presets: gemma-3-27b" in r.output
