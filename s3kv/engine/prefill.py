"""Which model an engine prefills, for the one prefill-speed figure (``s3kv.core.cost.Prefill``).

An engine knows its model as ``llm_args.model``: a local directory (its ``config.json`` is read),
or a Hugging Face name whose snapshot the engine downloaded into the Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``: the ``main`` ref's
snapshot, else the newest). From the config come the FLOPs per token (``s3kv.core.model``). Where
no config can be found or read, the figure is the default model's (Gemma-3-27B, what s3kv's other
defaults describe) and says so in its ``source``; ``S3KV_PREFILL_TOKENS_PER_S`` > 0 overrides it all.
Never raises: a wrong guess costs a lookup budget and a value estimate, never a request.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..core.cost import REFERENCE_PROMPT_TOKENS, Prefill
from ..core.model import ModelConfigError, ModelSpec, spec_from_config

log = logging.getLogger("s3kv.prefill")

#: A config.json larger than this is not a model config (it is not read).
_MAX_CONFIG_BYTES = 4 << 20


def _hub_dirs() -> list[Path]:
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path("~/.cache/huggingface/hub").expanduser())
    return out


def config_path(model_ref: Any) -> Path | None:
    """The ``config.json`` of ``model_ref`` (a directory, a config file, or a cached Hugging Face
    name), or None."""
    if model_ref is None or str(model_ref) == "":
        return None
    try:
        p = Path(str(model_ref)).expanduser()
        if p.is_dir():
            return p / "config.json" if (p / "config.json").is_file() else None
        if p.is_file() and p.suffix == ".json":
            return p
        name = str(model_ref).strip("/")
        if name.count("/") != 1:
            return None
        for hub in _hub_dirs():
            repo = hub / ("models--" + name.replace("/", "--"))
            snaps = repo / "snapshots"
            if not snaps.is_dir():
                continue
            ref = repo / "refs" / "main"
            if ref.is_file():
                c = snaps / ref.read_text().strip() / "config.json"
                if c.is_file():
                    return c
            found = sorted(snaps.glob("*/config.json"), key=lambda x: x.stat().st_mtime, reverse=True)
            if found:
                return found[0]
    except (OSError, ValueError):
        return None
    return None


def model_spec(model_ref: Any) -> tuple[ModelSpec | None, str]:
    """(the model's geometry, where it came from), or (None, why not)."""
    path = config_path(model_ref)
    if path is None:
        return None, f"no config.json for model {str(model_ref)!r}"
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            return None, f"{path} is too large to be a model config"
        cfg = json.loads(path.read_text())
        return spec_from_config(cfg, str(path), path.parent.name or "model"), str(path)
    except (OSError, ValueError, ModelConfigError) as e:  # JSONDecodeError is a ValueError
        return None, f"{path}: {e}"


def prefill_for(settings: Any, model_ref: Any, tp: int = 1) -> Prefill:
    """The prefill figure for an engine of ``tp`` GPUs running ``model_ref`` under ``settings``."""
    try:
        spec, where = model_spec(model_ref)
    except Exception as e:  # noqa: BLE001 - an estimate: never fail a start-up over it
        spec, where = None, repr(e)
    if spec is None:
        out = Prefill.from_settings(settings, None, tp, "default model (Gemma-3-27B)")
        if out.tokens_per_s_override <= 0:
            log.info("s3kv: prefill speed from the default model (%s); set S3KV_PREFILL_TOKENS_PER_S to "
                     "override", where)
    else:
        out = Prefill.from_settings(settings, spec, tp, f"config {where}")
    log.info("s3kv: prefill %.0f tokens/s on %d GPU(s), for a %d-token prompt (%s)", out.tokens_per_s, out.tp,
             REFERENCE_PROMPT_TOKENS, out.source)
    return out
