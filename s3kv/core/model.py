"""A real model's geometry: page bytes per layer group and the FLOPs its prefill costs. Pure.

The one description of a model that sizing (``s3kv size``), the benchmarks and the engine share:
layers (which are full attention, which slide over a window), KV heads and head dim (page bytes),
and the matmul shapes (prefill FLOPs, which ``s3kv.core.cost.Prefill`` turns into the package's
one prefill-speed figure). :func:`spec_from_config` reads a Hugging Face ``config.json``'s
fields (the file is read at the edge: ``s3kv.tools.models`` for the tools, ``s3kv.engine.prefill``
for an engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """A real model's geometry, for page sizes and the prefill FLOP model.

    Gemma-3-27B (text decoder), from its published config: 62 layers, hidden 5376, MLP 21504
    (gated, 3 matrices), 32 query heads and 16 KV heads of dim 128, vocab 262,144 (tied
    embedding), sliding window 1024 on 5 of every 6 layers (layer ``i`` is global when
    ``(i + 1) % 6 == 0``: 10 global, 52 local). KV in bf16.
    """

    name: str = "Gemma-3-27B"
    layers: int = 62
    hidden: int = 5376
    intermediate: int = 21504
    q_heads: int = 32
    kv_heads: int = 16
    head_dim: int = 128
    vocab: int = 262_144
    window: int = 1024
    global_every: int = 6
    kv_dtype_bytes: int = 2
    #: Explicit full-attention layers (a config's ``layer_types``); empty: every ``global_every``-th.
    global_ids: tuple[int, ...] = ()

    def is_global(self, layer: int) -> bool:
        if self.global_ids or not self.window:
            return not self.window or layer in self.global_ids
        return self.global_every > 0 and (layer + 1) % self.global_every == 0

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if self.is_global(i))

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if not self.is_global(i))

    @property
    def matmul_params_per_layer(self) -> int:
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return attn + mlp

    @property
    def matmul_params(self) -> int:
        """Weights every prefill token multiplies (decoder layers; the embedding is a lookup and the
        LM head only runs for the last prompt token, so neither counts for skipped tokens)."""
        return self.layers * self.matmul_params_per_layer

    def page_bytes(self, tokens_per_block: int, tp_size: int = 1) -> dict[str, int]:
        """Bytes of one block's page per layer group on one shard (K and V of every layer in the group)."""
        per_layer = 2 * tokens_per_block * (self.kv_heads // tp_size) * self.head_dim * self.kv_dtype_bytes
        return {"full": per_layer * len(self.global_layers), "sliding": per_layer * len(self.local_layers)}

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs to prefill ``tokens`` tokens from nothing (causal): 2 x params x tokens + attention.

        Attention per layer: QK^T and AV cost 2 x head_dim FLOPs each per (query, key) pair and
        query head, so 4 x q_heads x head_dim x (sum over query positions of keys attended):
        ``t + 1`` keys for a global layer, ``min(t + 1, window)`` for a local one.
        """
        n = max(0, int(tokens))
        full_pairs = n * (n + 1) / 2
        w = self.window
        local_pairs = n * (n + 1) / 2 if n <= w else w * (w + 1) / 2 + (n - w) * w
        per_pair = 4 * self.q_heads * self.head_dim
        attn = per_pair * (len(self.global_layers) * full_pairs + len(self.local_layers) * local_pairs)
        return 2.0 * self.matmul_params * n + attn


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class ModelConfigError(ValueError):
    """A config.json s3kv cannot read; the message names the file and the field."""


def spec_from_config(cfg: Any, where: str, fallback_name: str = "model") -> ModelSpec:
    """A geometry from a Hugging Face ``config.json``'s parsed content (a multimodal one's
    ``text_config``); ``where`` names the file in errors.

    Reads ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: the attention heads), ``head_dim`` (default: hidden / heads),
    ``vocab_size``, ``sliding_window`` and which layers slide: ``layer_types`` where given, else
    ``sliding_window_pattern`` (Gemma-3: every 6th layer is full attention), else every layer
    when ``sliding_window`` is set (Mistral-style) -- and ``torch_dtype`` for the KV bytes.
    """
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"{where}: expected a JSON object")
    text = cfg.get("text_config")
    c: Mapping[str, Any] = {**cfg, **text} if isinstance(text, dict) else cfg

    def num(field: str, default: int | None = None) -> int:
        v = c.get(field, default)
        if v is None and default is not None:
            v = default
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ModelConfigError(f"{where}: {field} must be a positive integer, got {v!r}")
        return v

    layers, hidden = num("num_hidden_layers"), num("hidden_size")
    heads = num("num_attention_heads")
    kv = num("num_key_value_heads", heads)
    head_dim = num("head_dim", hidden // heads)
    window = c.get("sliding_window") or 0
    if not isinstance(window, int) or window < 0:
        raise ModelConfigError(f"{where}: sliding_window must be an integer, got {window!r}")
    types = c.get("layer_types")
    global_ids: tuple[int, ...] = ()
    every = 1
    if window:
        if isinstance(types, list) and len(types) == layers:
            global_ids = tuple(i for i, t in enumerate(types) if t != "sliding_attention")
            if len(global_ids) == layers:
                window = 0
        elif c.get("sliding_window_pattern"):
            every = num("sliding_window_pattern")
        else:
            every = 0  # every layer slides
    dtype = str(c.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16")
    name = str(cfg.get("_name_or_path") or (cfg.get("architectures") or [fallback_name])[0])
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        intermediate=num("intermediate_size"),
        q_heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        vocab=num("vocab_size", 1),
        window=window,
        global_every=every,
        kv_dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        global_ids=global_ids,
    )
