"""The model geometries s3kv's tools know: ONE registry for ``s3kv size`` and the benchmarks
(``s3kv bench trace --model``), and ``--model-config PATH`` to read a Hugging Face ``config.json``.

A geometry is what sizing and the cost model need: layers (which are full attention, which slide
over a window), KV heads and head dim (page bytes), and the matmul shapes (prefill FLOPs). The
presets are from the models' published configs (text decoder; KV in 16-bit). The geometry itself,
and how a config's fields are read, is ``s3kv.core.model`` (an engine reads its model's config too).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.model import ModelConfigError, ModelSpec, spec_from_config

__all__ = ["GEMMA3_27B", "MODELS", "ModelConfigError", "ModelSpec", "from_hf_config", "resolve"]


GEMMA3_27B = ModelSpec()

#: name -> geometry (published configs). Gemma-3: sliding window 1024 on 5 of every 6 layers;
#: Llama 3.1: every layer full attention.
MODELS: dict[str, ModelSpec] = {
    "gemma-3-27b": GEMMA3_27B,
    "gemma-3-12b": ModelSpec("Gemma-3-12B", 48, 3840, 15360, 16, 8, 256, vocab=262_208, window=1024),
    "gemma-3-4b": ModelSpec("Gemma-3-4B", 34, 2560, 10240, 8, 4, 256, vocab=262_208, window=1024),
    "llama-3.1-8b": ModelSpec("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, vocab=128_256, window=0, global_every=1),
    "llama-3.1-70b": ModelSpec("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, vocab=128_256, window=0, global_every=1),
}


def from_hf_config(path: str | Path) -> ModelSpec:
    """A geometry from a Hugging Face ``config.json`` file (the fields: ``s3kv.core.model.spec_from_config``)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except OSError as e:
        raise ModelConfigError(f"--model-config {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"--model-config {path}: not a JSON config.json ({e})") from None
    return spec_from_config(cfg, f"--model-config {path}", p.parent.name or "model")


def resolve(name: str | None, config_path: str | None) -> ModelSpec:
    """``--model NAME`` or ``--model-config PATH`` (the file wins); a one-line error otherwise."""
    if config_path:
        return from_hf_config(config_path)
    key = (name or "gemma-3-27b").lower()
    if key not in MODELS:
        raise ModelConfigError(f"--model {name!r} is not a preset ({', '.join(MODELS)}); or pass --model-config PATH")
    return MODELS[key]
