"""The model half of the namespace: everything about the loaded model that shapes its KV bytes.

Page size, layers and windows are in the cache geometry already; what they miss
is what changes the *values* of pages of the very same size: the KV dtype
(fp16 and bf16 pages are both 2 bytes an element), the model dtype the
projections run in, the quantization of weights and KV, and which weights
(revision, config). Two engines that differ in any of these must never share a
key, so all of it goes into ``CacheGeometry.model_id`` / ``kv_dtype`` and from
there into ``keys.namespace_digest``.

Read defensively from ``TorchLlmArgs`` (duck-typed; any field may be missing or
``None`` on another build): ``model``, ``revision``, ``dtype``,
``kv_cache_config.dtype``, ``quant_config``; plus, when ``model`` is a local
Hugging Face directory, ``config.json`` (dtype, ``quantization_config``) and
``hf_quant_config.json`` (ModelOpt checkpoints: the weight and KV quantization).
``"auto"`` dtypes are resolved the way the engine resolves them: KV follows the
KV-cache quantization if any, else the model dtype; the model dtype follows the
checkpoint's config.

Config files say which *architecture*, not which *weights*: a fine-tune keeps its base's
``config.json`` bar fields dropped here as re-save noise. So a local checkpoint's weights are
digested too (``weights.py``: every byte of every weights file, safetensors per tensor, ``.bin``
whole, cached between runs by file identity).

``S3KV_MODEL_ID`` replaces the *name, revision, config and weights digests* -- the
operator vouches that the weights are the same wherever they are loaded from
(e.g. one checkpoint under two paths). The dtypes and quantization are runtime
choices and always count. Without it, an identity that cannot prove the weights is ``weak``: a
hub id with no pinned commit (the weights behind a name or branch change), a local directory
whose weights s3kv cannot read or that changed after the engine started. A weak identity is
never shared: the connector neither serves nor saves (``weak_identity_warning`` says so, once).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .weights import weights_digest

log = logging.getLogger("s3kv.identity")

#: Config files hashed into the identity (small JSON; larger files are not config).
CONFIG_FILES = ("config.json", "hf_quant_config.json")
_MAX_CONFIG_BYTES = 4 << 20
#: Keys that change when a checkpoint is merely re-saved, not when its weights change.
_VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})

_DTYPE_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8", "fp8_e4m3": "fp8",
    "nvfp4": "nvfp4", "fp4": "nvfp4",
    "int8": "int8", "int4": "int4",
}  # fmt: skip
_UNSET = ("", "auto", "none", "null")


def normalize_dtype(value: Any) -> str:
    """A dtype as one spelling: torch.bfloat16, "bf16", "BFLOAT16" -> "bfloat16"; unset -> "auto"."""
    if value is None:
        return "auto"
    v = getattr(value, "value", value)  # enums (QuantAlgo, DataType)
    s = str(v).strip().lower()
    s = s.removeprefix("torch.")
    if s in _UNSET:
        return "auto"
    return _DTYPE_ALIASES.get(s, s)


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    revision: str
    model_dtype: str
    kv_dtype: str
    #: "none", or the weight/KV algorithms plus a digest of the whole quantization config.
    quantization: str
    #: Digest of the checkpoint's config files ("" when ``model`` is not a local directory).
    config_digest: str
    #: Digest of the checkpoint's weights files ("" when there are none it can trust).
    weights_digest: str = ""
    #: Why this identity may not tell two checkpoints' weights apart ("" when it can).
    weak: str = field(default="", compare=False)

    @property
    def model_id(self) -> str:
        """What goes into ``CacheGeometry.model_id``: canonical JSON, readable in logs."""
        fields = dataclasses.asdict(self)
        del fields["kv_dtype"]  # carried separately (CacheGeometry.kv_dtype)
        del fields["weak"]
        if not fields["weights_digest"]:  # absent, not empty: identities without one keep their digests
            del fields["weights_digest"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def model_identity(llm_args: Any, model_id_override: str = "", cache_dir: str = "") -> ModelIdentity:
    """The identity of the model ``llm_args`` loads. Never raises on odd input: unknowns stay unknown.
    ``cache_dir``: ``S3KV_IDENTITY_CACHE_DIR``."""
    model = getattr(llm_args, "model", None)
    directory = _local_dir(model)
    configs = _read_configs(directory) if directory is not None else {}
    hf_config = _mapping(configs.get("config.json"))
    quant_file = _mapping(configs.get("hf_quant_config.json"))

    model_dtype = normalize_dtype(getattr(llm_args, "dtype", None))
    if model_dtype == "auto":
        model_dtype = _config_dtype(hf_config)

    quant = _no_algorithm_is_none(_quant_fields(getattr(llm_args, "quant_config", None)))
    if not quant:
        quant = _plain(_mapping(quant_file.get("quantization")))
    if not quant and isinstance(hf_config.get("quantization_config"), Mapping):
        quant = _plain(hf_config["quantization_config"])
    quant = {k: v for k, v in quant.items() if v not in (None, [], {}, "")}

    kv = getattr(llm_args, "kv_cache_config", None)
    kv_dtype = normalize_dtype(getattr(kv, "dtype", None))
    if kv_dtype == "auto":
        kv_algo = quant.get("kv_cache_quant_algo")
        kv_dtype = normalize_dtype(kv_algo) if kv_algo else model_dtype

    weak = ""
    if model_id_override:
        name, revision, config_digest, weights = model_id_override, "", "", ""
    else:
        name = str(model) if model not in (None, "") else "unknown-model"
        revision = str(getattr(llm_args, "revision", None) or "")
        config_digest = _digest_configs(configs)
        weights = ""
        if directory is not None:
            w = weights_digest(directory, cache_dir)
            weights = w.digest
            if w.weak:
                weak = f"model directory {name!r}: {w.weak}"
            elif w.read_bytes:
                log.info("s3kv: weights digest of %s: %d files, %.1f GB read in %.1f s (%.2f GB/s), the rest "
                         "from the cache", name, w.files, w.read_bytes / 1e9, w.seconds,
                         w.read_bytes / 1e9 / max(w.seconds, 1e-9))
        elif not _COMMIT.fullmatch(revision):
            weak = (f"model {name!r} is not a local directory and its revision "
                    f"{revision or '(none)'!r} is not a commit hash, so the weights behind it can change")
    return ModelIdentity(
        name=name,
        revision=revision,
        model_dtype=model_dtype,
        kv_dtype=kv_dtype,
        quantization=_quant_label(quant),
        config_digest=config_digest,
        weights_digest=weights,
        weak=weak,
    )


def weak_identity_warning(identity: ModelIdentity) -> str:
    """The start-up warning for a weak identity ("" for a strong one): one line."""
    if not identity.weak:
        return ""
    return (f"s3kv: the model's identity is weak: {identity.weak}. Engines with other weights could share "
            "its cache namespace and serve each other wrong KV, so this engine neither serves nor saves KV: "
            "set S3KV_MODEL_ID to a name that changes whenever the weights do (e.g. a content hash from "
            "your model registry), or load a hub id at revision=<commit hash> (docs/security.md)")


_COMMIT = re.compile(r"[0-9a-f]{40}")


# ------------------------------------------------------------------ helpers


def _mapping(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


def _local_dir(model: Any) -> Path | None:
    if model is None or model == "":
        return None
    try:
        p = Path(str(model)).expanduser()
        return p if p.is_dir() else None
    except (OSError, ValueError):
        return None


def _read_configs(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in CONFIG_FILES:
        p = directory / name
        try:
            if not p.is_file() or p.stat().st_size > _MAX_CONFIG_BYTES:
                continue
            raw = p.read_bytes()
        except OSError as e:
            log.warning("s3kv: cannot read %s for the model identity: %s", p, e)
            continue
        try:
            out[name] = json.loads(raw)
        except ValueError:
            out[name] = raw  # hashed as bytes; nothing resolved from it
    return out


def _canonical(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in obj.items() if str(k) not in _VOLATILE_KEYS}
    if isinstance(obj, (list, tuple)):
        return [_canonical(x) for x in obj]
    return obj


def _digest_configs(configs: Mapping[str, Any]) -> str:
    if not configs:
        return ""
    h = hashlib.blake2b(digest_size=8, person=b"s3kv-model-cfg")
    for name in sorted(configs):
        c = configs[name]
        body = c if isinstance(c, bytes) else json.dumps(_canonical(c), sort_keys=True, default=str).encode()
        h.update(name.encode() + b"\0" + len(body).to_bytes(8, "little") + body)
    return h.hexdigest()


def _config_dtype(cfg: Mapping[str, Any]) -> str:
    # Newer transformers write "dtype", older "torch_dtype"; multimodal models nest the text model's.
    for c in (cfg, cfg.get("text_config")):
        if isinstance(c, Mapping):
            for key in ("torch_dtype", "dtype"):
                if c.get(key):
                    return normalize_dtype(c[key])
    return "auto"


def _scalar(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value if isinstance(v.value, (str, int, float, bool)) else v.name
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, Mapping):
        return {str(k): _scalar(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_scalar(x) for x in v]
        return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
    return str(v)


def _plain(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): _scalar(v) for k, v in obj.items()}


def _quant_fields(qc: Any) -> dict[str, Any]:
    """A QuantConfig (dataclass, pydantic model, or plain object) as plain data."""
    if qc is None:
        return {}
    try:
        if isinstance(qc, Mapping):
            return _plain(qc)
        if dataclasses.is_dataclass(qc) and not isinstance(qc, type):
            return _plain({f.name: getattr(qc, f.name) for f in dataclasses.fields(qc)})
        for method in ("model_dump", "to_dict"):
            fn = getattr(qc, method, None)
            if callable(fn):
                d = fn()
                if isinstance(d, Mapping):
                    return _plain(d)
        return _plain({k: v for k, v in vars(qc).items() if not k.startswith("_")})
    except Exception as e:  # noqa: BLE001 - an odd build's config must not stop the engine
        log.warning("s3kv: cannot read quant_config (%s); hashing its repr", type(e).__name__)
        return {"repr": repr(qc)}


def _no_algorithm_is_none(quant: dict[str, Any]) -> dict[str, Any]:
    # A default QuantConfig carries tuning defaults (group size, ...) but no algorithm: unquantized.
    if "quant_algo" in quant and not quant.get("quant_algo") and not quant.get("kv_cache_quant_algo"):
        return {}
    return quant


def _quant_label(quant: Mapping[str, Any]) -> str:
    if not quant:
        return "none"
    h = hashlib.blake2b(json.dumps(quant, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()
    algo = quant.get("quant_algo") or quant.get("quant_method") or "custom"
    kv = quant.get("kv_cache_quant_algo")
    return f"{algo}" + (f"/kv:{kv}" if kv else "") + f"#{h}"
