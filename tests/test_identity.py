"""Model identity in the namespace (s3kv/trtllm/identity.py): issue #17 point 3.

fp16 and bf16 loads of one model path used to share a namespace (KV dtype was
the literal "auto", the model identity just the ``model`` string)."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from s3kv.core.keys import namespace_digest
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.sim.config import SimCacheConfig, SimModel
from s3kv.sim.llm_args import SimKvCacheConfig, SimLlmArgs, make_llm_args
from s3kv.trtllm import weights
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


@pytest.fixture(autouse=True)
def _weights_env(tmp_path, monkeypatch):
    """Weights digests cached under the test's own directory, and files written by a test older
    than the "engine" that loads them (the digest trusts no file changed after the process started)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    monkeypatch.setattr(weights, "process_start", lambda: time.time() + 3600)


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


# ------------------------------------------------------------------ weights (issues #29.1, #37.4)


def safetensors(path, tensors: dict[str, bytes], metadata: dict | None = None, shapes: dict | None = None) -> None:
    """A safetensors file: 8-byte header length, JSON header, then the tensors' bytes."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    data, off = b"", 0
    for name, raw in tensors.items():
        shape = (shapes or {}).get(name, [len(raw) // 2])
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(raw)]}
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
    assert not ia.weak and not ib.weak  # every byte read: proof, not a sample


def _between_old_samples(length: int, span: int) -> int:
    """An offset where ``span`` bytes of a ``length``-byte tensor met none of the 64 windows of
    4 KiB the weights digest of #29.1 sampled (evenly spread, first and last included)."""
    step = (length - 4096) / 63
    starts = [int(i * step) for i in range(64)]
    for lo, hi in zip(starts, starts[1:], strict=False):
        if hi - (lo + 4096) >= span + 2048 and lo > length // 3:
            return lo + 4096 + 1024
    raise AssertionError("no gap that wide")


@pytest.mark.parametrize("evasion", ["moe_expert", "q_proj_band", "bin_only"])
def test_a_fine_tune_that_evaded_the_sample_gets_its_own_namespace(tmp_path, evasion):
    """Issue #37.4: three fine-tunes that shared their base's namespace under the sampled digest
    (64 windows of 4 KiB per tensor, embeddings whole; no digest at all without safetensors):
    one expert of a fused MoE tensor, a 24-row band of q_proj, a checkpoint of .bin files only."""
    rng = random.Random(evasion)
    if evasion == "moe_expert":  # [experts, 2 * intermediate, hidden] bf16, one expert retrained in part
        name, shape = "model.layers.0.mlp.experts.gate_up_proj", [8, 256, 512]
        base = rng.randbytes(8 * 256 * 512 * 2)
        off = _between_old_samples(len(base), 1024)
        expert = 256 * 512 * 2
        assert off // expert == (off + 1023) // expert  # inside one expert's block
        tuned = base[:off] + rng.randbytes(1024) + base[off + 1024 :]
    elif evasion == "q_proj_band":  # [4096 out, 2048 in] bf16: 24 rows of 4 KiB retrained
        name, shape = "model.layers.0.self_attn.q_proj.weight", [4096, 2048]
        row = 2048 * 2
        base = rng.randbytes(4096 * row)
        off = -(-_between_old_samples(len(base), 25 * row) // row) * row
        tuned = base[:off] + rng.randbytes(24 * row) + base[off + 24 * row :]
    d = hf_dir(tmp_path, "llama")  # one path, as /models/llama on two clusters
    idents, namespaces = [], []
    for label in ("base", "tuned"):
        for f in d.glob("*.safetensors"):
            f.unlink()
        if evasion == "bin_only":
            (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + rng.randbytes(4096))
        else:
            safetensors(d / "model.safetensors", {name: base if label == "base" else tuned}, shapes={name: shape})
        idents.append(model_identity(Args(model=str(d))))
        namespaces.append(ns(Args(model=str(d))))
    assert namespaces[0] != namespaces[1]
    assert all(i.weights_digest and not i.weak for i in idents)


@pytest.mark.parametrize("table", ["model.embed_tokens.weight", "lm_head.weight", "vocab-shaped"])
def test_a_fine_tune_of_a_few_token_rows_never_shares_its_bases_namespace(tmp_path, table):
    """Training only reserved special tokens changes rows far past any tensor's first KiBs."""
    vocab, row = 8192, 64
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


def test_the_same_tensors_sharded_otherwise_keep_the_digest_and_any_byte_changes_it(tmp_path):
    one, two = hf_dir(tmp_path, "one"), hf_dir(tmp_path, "two")
    t = {"a": os.urandom(4096), "b": os.urandom(1 << 20)}
    safetensors(one / "model.safetensors", t)
    safetensors(two / "model-00001-of-00002.safetensors", {"b": t["b"]})
    safetensors(two / "model-00002-of-00002.safetensors", {"a": t["a"]})
    first = model_identity(Args(model=str(one))).weights_digest
    assert first == model_identity(Args(model=str(two))).weights_digest
    for pos in (0, 12345, (1 << 20) - 1):  # the first, a middle and the last byte of b
        b = bytearray(t["b"])
        b[pos] ^= 1
        safetensors(one / "model.safetensors", {"a": t["a"], "b": bytes(b)})
        assert model_identity(Args(model=str(one))).weights_digest != first
    safetensors(one / "model.safetensors", t, metadata={"step": "2"})  # metadata counts too
    assert model_identity(Args(model=str(one))).weights_digest != first


def test_a_bin_checkpoint_is_hashed_whole_and_never_unpickled(tmp_path):
    """A .bin checkpoint is a pickle: loading one runs whatever it says. Its bytes are hashed."""
    import pickle

    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    d = hf_dir(tmp_path, "m")
    (d / "pytorch_model-00001-of-00002.bin").write_bytes(pickle.dumps(Payload()))
    (d / "pytorch_model-00002-of-00002.bin").write_bytes(os.urandom(1 << 16))
    first = model_identity(Args(model=str(d)))
    assert first.weights_digest and not first.weak and not marker.exists()
    with open(d / "pytorch_model-00002-of-00002.bin", "r+b") as f:
        f.seek(777)
        f.write(b"\x00\x01")
    assert model_identity(Args(model=str(d))).weights_digest != first.weights_digest
    st = hf_dir(tmp_path, "st")
    for where in (d, st):  # the loaders prefer safetensors where there are any: so does the digest
        safetensors(where / "model.safetensors", {"w": b"\x01" * 16})
    assert model_identity(Args(model=str(d))).weights_digest == model_identity(Args(model=str(st))).weights_digest


def test_the_digest_cache_is_reused_on_restart_and_invalidated_on_change(tmp_path, monkeypatch):
    d = hf_dir(tmp_path, "m")
    safetensors(d / "model-00001-of-00002.safetensors", {"w": os.urandom(1 << 20)})
    safetensors(d / "model-00002-of-00002.safetensors", {"v": os.urandom(1 << 16)})
    cache = tmp_path / "cache"
    hashed: list[str] = []
    real = weights._hash
    monkeypatch.setattr(weights, "_hash", lambda name, path, st: (hashed.append(name), real(name, path, st))[1])

    def restart() -> str:
        weights._memo.clear()  # a new process: only the cache directory survives
        return model_identity(Args(model=str(d)), cache_dir=str(cache)).weights_digest

    first = restart()
    assert len(hashed) == 2 and list((cache / "weights-v1").glob("*.json"))
    assert restart() == first and len(hashed) == 2  # a restart reads no weights
    w = d / "model-00002-of-00002.safetensors"
    st = os.stat(w)
    time.sleep(0.01)
    with open(w, "r+b") as f:  # rsync --inplace -t: same size, mtime restored; the ctime moves
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = restart()
    assert second != first and hashed[2:] == ["model-00002-of-00002.safetensors"]
    for entry in (cache / "weights-v1").glob("*.json"):
        entry.write_text("{not json")  # a damaged cache is read again, never trusted
    assert restart() == second and len(hashed) == 5
    hashed.clear()
    assert model_identity(Args(model=str(d)), cache_dir="off").weights_digest == second  # from memory
    weights._memo.clear()
    assert model_identity(Args(model=str(d)), cache_dir="off").weights_digest == second and len(hashed) == 2


def test_ranks_that_start_together_hash_each_file_once(tmp_path, monkeypatch):
    """TP ranks are processes: one hashes a file under its lock, the others wait and read its entry."""
    import threading

    d = hf_dir(tmp_path, "m")
    safetensors(d / "model.safetensors", {"w": os.urandom(1 << 20)})
    hashed: list[str] = []
    real = weights._hash

    def slow(name, path, st):
        hashed.append(name)
        time.sleep(0.2)
        return real(name, path, st)

    monkeypatch.setattr(weights, "_hash", slow)
    monkeypatch.setattr(weights, "_memo", {})  # as if each rank were a process of its own
    got: list[str] = []

    def rank():
        got.append(weights.weights_digest(d, str(tmp_path / "cache")).digest)

    ranks = [threading.Thread(target=rank) for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(30)
    assert len(set(got)) == 1 and got[0] and len(got) == 4
    assert hashed == ["model.safetensors"]


def test_weights_changed_after_the_engine_started_are_never_trusted(tmp_path, monkeypatch):
    """The engine read its weights after its process started: a weights file (or a link on its
    path) changed since may hold other bytes than the engine's, so there is no digest of it."""
    before = hf_dir(tmp_path, "before")
    safetensors(before / "model.safetensors", {"w": b"\x01" * 64})
    time.sleep(0.02)
    started = time.time()
    monkeypatch.setattr(weights, "process_start", lambda: started)
    time.sleep(0.02)
    assert model_identity(Args(model=str(before))).weights_digest  # written before the engine started
    after = hf_dir(tmp_path, "after")
    safetensors(after / "model.safetensors", {"w": b"\x02" * 64})
    ident = model_identity(Args(model=str(after)))
    assert ident.weights_digest == "" and "after this engine started" in ident.weak
    link = tmp_path / "current"
    os.symlink(before, link)  # old files behind a link made after the start: the same
    assert "after this engine started" in model_identity(Args(model=str(link))).weak
    os.symlink(before / "model.safetensors", after / "model.safetensors.link")  # not a weights name: ignored
    assert weights.weight_files(after) == [("model.safetensors", str(after / "model.safetensors"))]


def test_unreadable_weights_leave_a_weak_identity_never_an_error(tmp_path):
    d = hf_dir(tmp_path, "m")
    (d / "model.safetensors").write_bytes(b"\xff" * 32)  # a header longer than the file
    ident = model_identity(Args(model=str(d)))
    assert ident.weights_digest == "" and "cannot read" in ident.weak


@pytest.mark.parametrize(
    "case, weak",
    [
        ("hub id, no revision", True),
        ("hub id, branch revision", True),
        ("hub id, commit revision", False),
        ("local, no weights", True),
        ("local, safetensors", False),
        ("local, .bin", False),
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
        if case == "local, .bin":
            (d / "pytorch_model.bin").write_bytes(b"\x01" * 16)
        args = Args(model=str(d))
    elif case == "S3KV_MODEL_ID":
        override = "llama-3-8b@sha256:ab12"
    assert bool(model_identity(args, override).weak) is weak


@pytest.mark.parametrize("pinned", [False, True])
def test_a_weak_identity_is_never_shared(tmp_path, pinned, caplog, monkeypatch):
    """A weak identity (here a hub id without a commit revision) could name other weights on
    another engine: without S3KV_MODEL_ID the engine neither serves nor saves, and says why once."""
    import logging

    from test_connector_sim import make_engine, run

    import s3kv.sim.engine as sim_engine
    from s3kv.config import warn_once
    from s3kv.sim import SimRequestSpec, gemma3_like, random_tokens
    from s3kv.store.memory import MemoryStore

    unpinned = sim_engine.make_llm_args
    monkeypatch.setattr(sim_engine, "make_llm_args",
                        lambda *a, **k: dataclasses.replace(unpinned(*a, **k), revision=""))
    warn_once.cache_clear()
    override = {"model_id": "gemma-3@sha256:ab12"} if pinned else {}
    store = MemoryStore()
    rng = random.Random(3)
    prompts = [tuple(random_tokens(rng, 160, 32000)) for _ in range(2)]
    with caplog.at_level(logging.WARNING):
        cold = make_engine(store, gemma3_like(64), **override)
        run(cold, [SimRequestSpec(i, p) for i, p in enumerate(prompts)])
        warm = run(make_engine(store, gemma3_like(64), **override), [SimRequestSpec(10 + i, p) for i, p in enumerate(prompts)])
    said = [r.getMessage() for r in caplog.records if "identity is weak" in r.getMessage()]
    assert warm.kv_mismatches == 0
    if pinned:
        assert not said and warm.matched_tokens > 0
    else:
        assert len(said) == 1 and "S3KV_MODEL_ID" in said[0] and "neither serves nor saves" in said[0]
        assert warm.matched_tokens == 0 and store.keys() == []
        assert cold.leader.core.stats.not_cacheable == 2
