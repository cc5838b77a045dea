"""Model identity in the namespace (s3kv/trtllm/identity.py): issue #17 point 3.

fp16 and bf16 loads of one model path used to share a namespace (KV dtype was
the literal "auto", the model identity just the ``model`` string)."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from s3kv.core.keys import namespace_digest
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.sim.config import SimCacheConfig, SimModel
from s3kv.sim.llm_args import SimKvCacheConfig, SimLlmArgs, make_llm_args
from s3kv.trtllm.identity import model_identity, normalize_dtype


class QuantAlgo(enum.Enum):  # stands in for tensorrt_llm's enum
    FP8 = "FP8"
    NVFP4 = "NVFP4"
    W4A16_AWQ = "W4A16_AWQ"


@dataclass
class QuantConfig:  # the shape of tensorrt_llm.models.modeling_utils.QuantConfig
    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None
    group_size: int = 128
    exclude_modules: list[str] | None = None


@dataclass
class KvCfg:
    dtype: str = "auto"
    tokens_per_block: int = 32


@dataclass
class Args:
    """A stand-in TorchLlmArgs with the fields identity.py reads."""

    model: Any = "org/model-7b"
    dtype: Any = "auto"
    revision: str | None = None
    quant_config: Any = None
    kv_cache_config: KvCfg = field(default_factory=KvCfg)


def geometry(model_id: str, kv_dtype: str) -> CacheGeometry:
    return CacheGeometry(32, (GroupGeometry(0, None, (0, 1), (4096,)),), 1, kv_dtype, model_id)


def ns(args: Any, override: str = "") -> bytes:
    ident = model_identity(args, override)
    return namespace_digest(geometry(ident.model_id, ident.kv_dtype))


def hf_dir(tmp_path, name="m", *, dtype="bfloat16", extra=None, quant=None):
    d = tmp_path / name
    d.mkdir()
    cfg = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "torch_dtype": dtype,
           "transformers_version": "4.50.0", **(extra or {})}
    (d / "config.json").write_text(json.dumps(cfg))
    if quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    return d


# ------------------------------------------------------------------ the hole, then the fix


def test_fp16_and_bf16_llm_args_never_share_a_namespace():
    fp16 = Args(dtype="float16")
    bf16 = Args(dtype="bfloat16")
    # The old helpers saw only these two strings -- identical for both loads.
    assert (fp16.model, fp16.kv_cache_config.dtype) == (bf16.model, bf16.kv_cache_config.dtype)
    a, b = model_identity(fp16), model_identity(bf16)
    assert (a.kv_dtype, b.kv_dtype) == ("float16", "bfloat16")
    assert ns(fp16) != ns(bf16)
    # Spelled differently, the same dtype is the same namespace.
    assert ns(Args(dtype="fp16")) == ns(fp16) == ns(Args(dtype="torch.float16"))


def test_simulator_llm_args_with_different_kv_dtypes_never_share_a_namespace():
    model = SimModel(num_layers=2, kv_heads=1, head_dim=8)
    a = make_llm_args(model, SimCacheConfig(kv_dtype="float16"), 1, 0)
    b = make_llm_args(model, SimCacheConfig(kv_dtype="bfloat16"), 1, 0)
    assert a.model == b.model
    assert ns(a) != ns(b)
    assert model_identity(a).kv_dtype == "float16"


def test_auto_dtypes_resolve_from_the_checkpoint_config(tmp_path):
    bf = hf_dir(tmp_path, "bf", dtype="bfloat16")
    fp = hf_dir(tmp_path, "fp", dtype="float16")
    a, b = model_identity(Args(model=str(bf))), model_identity(Args(model=str(fp)))
    assert (a.model_dtype, a.kv_dtype) == ("bfloat16", "bfloat16")
    assert (b.model_dtype, b.kv_dtype) == ("float16", "float16")
    # Nested text_config (multimodal checkpoints) and the newer "dtype" key.
    mm = tmp_path / "mm"
    mm.mkdir()
    (mm / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert model_identity(Args(model=str(mm))).kv_dtype == "bfloat16"
    # An explicit dtype wins over the config.
    assert model_identity(Args(model=str(bf), dtype="float16")).model_dtype == "float16"


def test_kv_quantization_resolves_auto_kv_dtype():
    q = QuantConfig(quant_algo=QuantAlgo.FP8, kv_cache_quant_algo=QuantAlgo.FP8)
    a = model_identity(Args(dtype="bfloat16", quant_config=q))
    assert a.kv_dtype == "fp8" and a.quantization.startswith("FP8/kv:FP8#")
    plain = model_identity(Args(dtype="bfloat16"))
    assert plain.kv_dtype == "bfloat16" and plain.quantization == "none"
    # Weight-only quantization: same KV dtype, different weights -> different namespace.
    awq = Args(dtype="bfloat16", quant_config=QuantConfig(quant_algo=QuantAlgo.W4A16_AWQ))
    assert model_identity(awq).kv_dtype == "bfloat16"
    assert ns(awq) != ns(Args(dtype="bfloat16"))
    # A default QuantConfig (no algorithm) is no quantization.
    assert model_identity(Args(dtype="bfloat16", quant_config=QuantConfig())).quantization == "none"
    # Explicit kv dtype wins.
    assert model_identity(Args(dtype="bfloat16", quant_config=q, kv_cache_config=KvCfg("nvfp4"))).kv_dtype == "nvfp4"


def test_hf_quant_config_file_is_read_when_llm_args_has_none(tmp_path):
    d = hf_dir(tmp_path, "q", quant={"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})
    ident = model_identity(Args(model=str(d)))
    assert ident.kv_dtype == "fp8" and ident.quantization.startswith("FP8/kv:FP8")


def test_revision_and_config_change_the_namespace(tmp_path):
    assert ns(Args(revision="abc123")) != ns(Args(revision="def456")) != ns(Args())
    d = hf_dir(tmp_path, "m", extra={"rope_scaling": {"factor": 8.0}})
    before = ns(Args(model=str(d)))
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                               "rope_scaling": {"factor": 4.0}}))
    assert ns(Args(model=str(d))) != before


def test_config_digest_ignores_resave_noise_and_path(tmp_path):
    a = hf_dir(tmp_path, "a")
    b = hf_dir(tmp_path, "b")
    cfg = json.loads((b / "config.json").read_text())
    cfg["transformers_version"] = "4.99.0"
    (b / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    ia, ib = model_identity(Args(model=str(a))), model_identity(Args(model=str(b)))
    assert ia.config_digest and ia.config_digest == ib.config_digest
    assert ia.name != ib.name  # paths still differ: the override joins them ...
    assert ns(Args(model=str(a)), "gemma-3-27b") == ns(Args(model=str(b)), "gemma-3-27b")
    # ... but never across dtypes.
    assert ns(Args(model=str(a), dtype="float16"), "gemma-3-27b") != ns(Args(model=str(b)), "gemma-3-27b")


@pytest.mark.parametrize(
    "args",
    [
        object(),
        Args(model=None, dtype=None, kv_cache_config=None),  # type: ignore[arg-type]
        Args(model=12345, quant_config=object()),
        Args(model="/nonexistent/dir/for/s3kv"),
        SimLlmArgs("m", None, SimKvCacheConfig(16, None, "bfloat16"), 1, None),  # type: ignore[arg-type]
    ],
    ids=["bare", "nones", "odd-types", "missing-dir", "sim"],
)
def test_odd_llm_args_never_raise_and_are_deterministic(args):
    a, b = model_identity(args), model_identity(args)
    assert a == b and a.model_id == b.model_id and a.kv_dtype


def test_unreadable_or_garbage_config_is_hashed_not_fatal(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    (d / "config.json").write_bytes(b"\xff not json")
    ident = model_identity(Args(model=str(d)))
    assert ident.config_digest and ident.model_dtype == "auto"


def test_normalize_dtype_spellings():
    import torch

    assert normalize_dtype(torch.bfloat16) == "bfloat16"
    assert normalize_dtype("BF16") == normalize_dtype("bfloat16") == "bfloat16"
    assert normalize_dtype(None) == normalize_dtype("auto") == "auto"
    assert normalize_dtype(QuantAlgo.FP8) == "fp8"
    assert normalize_dtype("float8_e4m3fn") == "fp8"


def test_model_id_is_canonical_json_without_kv_dtype():
    ident = model_identity(Args(dtype="bfloat16", revision="r1"))
    doc = json.loads(ident.model_id)
    # No weights to fingerprint: the field is absent, so such identities keep their namespaces.
    skip = ("kv_dtype", "weak", "weights_digest")
    assert doc == {k: v for k, v in dataclasses.asdict(ident).items() if k not in skip}


# ------------------------------------------------------------------ weights (issue #29.1)


def safetensors(path, tensors: dict[str, bytes], metadata: dict | None = None) -> None:
    """A safetensors file: 8-byte header length, JSON header, then the tensors' bytes."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    data, off = b"", 0
    for name, raw in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [len(raw) // 2], "data_offsets": [off, off + len(raw)]}
        data, off = data + raw, off + len(raw)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def test_a_fine_tune_under_the_bases_path_never_shares_its_namespace(tmp_path):
    """The attack: cluster A's /models/llama holds the base, cluster B's a fine-tune whose
    config.json differs only in re-save noise and whose safetensors headers are identical."""
    a, b = tmp_path / "a" / "llama", tmp_path / "b" / "llama"
    a.parent.mkdir()
    b.parent.mkdir()
    hf_dir(a.parent, "llama")
    hf_dir(b.parent, "llama", extra={"transformers_version": "4.99.0", "_name_or_path": "ft-run-12"})
    base = {"model.layers.0.q_proj.weight": bytes(range(256)) * 40, "lm_head.weight": b"\x01" * 64}
    safetensors(a / "model.safetensors", base)
    tuned = dict(base, **{"model.layers.0.q_proj.weight": bytes(reversed(range(256))) * 40})
    safetensors(b / "model.safetensors", tuned)
    ia, ib = model_identity(Args(model=str(a))), model_identity(Args(model=str(b)))
    assert ia.config_digest == ib.config_digest  # the config cannot tell them apart ...
    assert ia.weights_digest and ia.weights_digest != ib.weights_digest  # ... the weights can
    assert ns(Args(model=str(a))) != ns(Args(model=str(b)))  # a path is not an identity
    assert "sample" in ia.weak  # but a sample is no proof: warned, S3KV_MODEL_ID is the fix


@pytest.mark.parametrize("table", ["model.embed_tokens.weight", "lm_head.weight", "vocab-shaped"])
def test_a_fine_tune_of_a_few_token_rows_never_shares_its_bases_namespace(tmp_path, table):
    """Training only reserved special tokens changes rows far past any tensor's first KiBs; the
    tensors with one row per token are read whole."""
    vocab, row = 8192, 64  # 512 KiB: sampled, were it not read whole
    tok = vocab - 100  # a reserved token between two sample windows
    base = os.urandom(vocab * row)
    tuned = base[: tok * row] + bytes(row) + base[(tok + 1) * row :]
    name = "model.tok_table" if table == "vocab-shaped" else table
    digests = []
    for label, rows in (("base", base), ("tuned", tuned)):
        d = hf_dir(tmp_path, label, extra={"vocab_size": vocab} if table == "vocab-shaped" else None)
        h = json.dumps({name: {"dtype": "BF16", "shape": [vocab, row // 2], "data_offsets": [0, len(rows)]},
                        "w": {"dtype": "BF16", "shape": [8], "data_offsets": [len(rows), len(rows) + 16]}}).encode()
        (d / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + rows + b"\x01" * 16)
        digests.append(model_identity(Args(model=str(d))).weights_digest)
    assert digests[0] and digests[0] != digests[1]


def test_every_tensor_is_sampled_past_its_first_bytes(tmp_path):
    d = hf_dir(tmp_path, "m")
    big = bytearray(os.urandom(1 << 20))
    safetensors(d / "model.safetensors", {"w": bytes(big)})
    first = model_identity(Args(model=str(d))).weights_digest
    big[-100:] = bytes(100)  # the last window
    safetensors(d / "model.safetensors", {"w": bytes(big)})
    assert model_identity(Args(model=str(d))).weights_digest != first


def test_a_same_size_rewrite_with_its_mtime_restored_is_fingerprinted_again(tmp_path):
    d = hf_dir(tmp_path, "m")
    safetensors(d / "model.safetensors", {"w": b"\x01" * 64})
    first = model_identity(Args(model=str(d))).weights_digest
    st = os.stat(d / "model.safetensors")
    time.sleep(0.01)
    with open(d / "model.safetensors", "r+b") as f:  # rsync --inplace -t
        f.seek(-64, os.SEEK_END)
        f.write(b"\x02" * 64)
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_identity(Args(model=str(d))).weights_digest != first


def test_the_weights_fingerprint_is_stable_and_covers_headers_and_files(tmp_path):
    d = tmp_path / "m"
    hf_dir(tmp_path, "m")
    t = {"w": b"\x02" * 64}
    safetensors(d / "model-00001-of-00002.safetensors", t)
    safetensors(d / "model-00002-of-00002.safetensors", {"v": b"\x03" * 64})
    first = model_identity(Args(model=str(d))).weights_digest
    assert first == model_identity(Args(model=str(d))).weights_digest
    safetensors(d / "model-00002-of-00002.safetensors", {"v": b"\x03" * 64}, metadata={"step": "2"})
    assert model_identity(Args(model=str(d))).weights_digest != first


def test_an_unreadable_weights_file_leaves_a_weak_identity_never_an_error(tmp_path):
    d = hf_dir(tmp_path, "m")
    (d / "model.safetensors").write_bytes(b"\xff" * 32)  # a header longer than the file
    ident = model_identity(Args(model=str(d)))
    assert ident.weights_digest == "" and "no *.safetensors" in ident.weak


@pytest.mark.parametrize(
    "case, weak",
    [
        ("hub id, no revision", True),
        ("hub id, branch revision", True),
        ("hub id, commit revision", False),
        ("local, no safetensors", True),
        ("local, safetensors", True),  # a sampled fingerprint: warned
        ("S3KV_MODEL_ID", False),
    ],
)
def test_a_weak_identity_is_flagged(tmp_path, case, weak):
    args, override = Args(), ""
    if case == "hub id, branch revision":
        args = Args(revision="main")
    elif case == "hub id, commit revision":
        args = Args(revision="0123456789abcdef0123456789abcdef01234567")
    elif case.startswith("local"):
        d = hf_dir(tmp_path, "m")
        if case == "local, safetensors":
            safetensors(d / "model.safetensors", {"w": b"\x01" * 16})
        args = Args(model=str(d))
    elif case == "S3KV_MODEL_ID":
        override = "llama-3-8b@sha256:ab12"
    assert bool(model_identity(args, override).weak) is weak


@pytest.mark.parametrize("pinned", [False, True])
def test_a_weak_identity_warns_at_start_up(tmp_path, pinned, caplog):
    import logging

    from s3kv.config import Settings, warn_once
    from s3kv.sim import SimCacheConfig, gemma3_like
    from s3kv.store.memory import MemoryStore
    from s3kv.trtllm import S3KvConnectorLeader

    warn_once.cache_clear()
    args = make_llm_args(gemma3_like(64), SimCacheConfig(tokens_per_block=16, max_seq_len=2048), 1, 0)
    settings = Settings(url="memory://weak", check_access=False, model_id="gemma-3@abc" if pinned else "")
    with caplog.at_level(logging.WARNING):
        S3KvConnectorLeader(args, settings=settings, store=MemoryStore(), engine_key="weak",
                            engine_features=()).shutdown()
    said = [r.getMessage() for r in caplog.records if "identity is weak" in r.getMessage()]
    assert len(said) == (0 if pinned else 1)
    if said:
        assert "S3KV_MODEL_ID" in said[0]
