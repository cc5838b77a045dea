"""``s3kv size``: the numbers follow from the model's geometry and the connector's own rules."""

from __future__ import annotations

import json

import pytest
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
    # (Not more objects than TP 1 writes: a shard's object holds 4x the blocks of the same size.)
    assert llama4.prompts[0]["objects"] >= 4 and llama4.prompts[0]["objects"] % 4 == 0
    assert llama4.prompts[0]["prefill_s"] < w1["prefill_s"]


def test_monthly_cost_scales_with_traffic_and_retention():
    def month(**kw):
        r = CliRunner().invoke(main, ["size", "--prompt-tokens", "8192", "--json", *kw.get("args", [])])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["monthly"]

    assert month() is None  # no traffic given: no monthly estimate
    a = month(args=["--new-tokens-per-day", "1e7", "--retention-h", "7"])
    b = month(args=["--new-tokens-per-day", "1e7", "--retention-h", "14"])
    assert abs(b["storage_usd"] - 2 * a["storage_usd"]) < 1e-6 and b["put_usd"] == a["put_usd"]
    c = month(args=["--hit-tokens-per-day", "1e8"])
    assert c["storage_usd"] == 0 and c["get_head_usd"] > 0
    # The value line: GPU dollars the hits saved, and the ratio.
    d = month(args=["--new-tokens-per-day", "1e7", "--hit-tokens-per-day", "1e8"])
    assert d["gpu_usd_saved"] > 0 and d["ratio"] == pytest.approx(d["total_usd"] / d["gpu_usd_saved"])
    cheap = month(args=["--new-tokens-per-day", "1e7", "--hit-tokens-per-day", "1e8", "--gpu-usd-per-hour", "1.5"])
    assert cheap["ratio"] == pytest.approx(2 * d["ratio"])


def test_unknown_model_is_one_line():
    r = CliRunner().invoke(main, ["size", "--model", "gpt-9"])
    assert r.exit_code == 1 and "--model 'gpt-9' is not a preset (gemma-3-27b" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_one_registry_for_size_and_bench_trace():
    from s3kv.tools.bench import trace
    from s3kv.tools.models import MODELS

    assert PRESETS is MODELS and trace.MODELS is MODELS
    # Gemma-3-12B is the same geometry for both (the two lists once disagreed on its vocab).
    assert MODELS["gemma-3-12b"].vocab == 262_208


GEMMA3_CONFIG = {  # google/gemma-3-27b-it's config.json, abridged: the text decoder is nested
    "architectures": ["Gemma3ForConditionalGeneration"],
    "text_config": {
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
        "num_hidden_layers": 62, "num_key_value_heads": 16, "sliding_window": 1024,
        "sliding_window_pattern": 6, "vocab_size": 262208,
    },
    "torch_dtype": "bfloat16",
}


def test_model_config_reads_a_hugging_face_config(tmp_path):
    from s3kv.tools.models import GEMMA3_27B, from_hf_config

    p = tmp_path / "config.json"
    p.write_text(json.dumps(GEMMA3_CONFIG))
    m = from_hf_config(p)
    assert (m.global_layers, m.local_layers) == (GEMMA3_27B.global_layers, GEMMA3_27B.local_layers)
    assert m.page_bytes(32) == GEMMA3_27B.page_bytes(32)
    assert m.matmul_params == GEMMA3_27B.matmul_params
    # layer_types (newer configs) name each layer; Llama-style configs have no window.
    types = ["sliding_attention", "full_attention"] * 4
    p.write_text(json.dumps({**GEMMA3_CONFIG["text_config"], "num_hidden_layers": 8, "layer_types": types}))
    assert from_hf_config(p).global_layers == (1, 3, 5, 7)
    p.write_text(json.dumps({**GEMMA3_CONFIG["text_config"], "sliding_window": None}))
    assert from_hf_config(p).local_layers == ()
    r = CliRunner().invoke(main, ["size", "--model-config", str(p), "--prompt-tokens", "8192", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kv_bytes_per_token"] == {"full": 62 * 2 * 16 * 128 * 2}


@pytest.mark.parametrize(
    ("body", "words"),
    [("{", "not a JSON config.json"), ('{"hidden_size": 8}', "num_hidden_layers must be a positive integer")],
)
def test_a_bad_model_config_is_one_line(tmp_path, body, words):
    p = tmp_path / "config.json"
    p.write_text(body)
    for cmd in (["size"], ["bench", "trace", "tests/fixtures/mooncake_slice.jsonl"]):
        r = CliRunner().invoke(main, [*cmd, "--model-config", str(p)])
        assert r.exit_code == 1 and words in r.output and str(p) in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_bench_trace_refuses_a_model_without_sliding_layers():
    r = CliRunner().invoke(main, ["bench", "trace", "tests/fixtures/mooncake_slice.jsonl", "--model", "llama-3.1-8b"])
    assert r.exit_code == 1 and "Llama-3.1-8B has no sliding-window layers" in r.output
