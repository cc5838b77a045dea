"""Simulated model geometry, cache settings, and the engine's windows → layer-groups rule.

Everything here is a frozen value: an engine is built from these and never
changes them, so two engines built from equal configs behave identically.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per element for the dtype strings TorchLlmArgs' kv_cache_config.dtype may carry.
_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
    "float32": 4,
    "float": 4,
}

# Bytes of one per-token-per-head scale in the optional second ("scales") region.
SCALE_BYTES = 4


@dataclass(frozen=True)
class SimModel:
    """The model geometry the KV cache is shaped by.

    ``max_attention_window`` is the *configured* vector (one entry per layer,
    repeated cyclically; ``None`` = full attention everywhere), exactly what
    ``llm_args.kv_cache_config.max_attention_window`` carries. Entries may exceed
    ``max_seq_len``: the engine clamps them (see :func:`layer_groups`).

    ``regions_per_group`` 2 adds a "scales" region to every group (as FP8 KV with
    per-token scales would), so a page is the concatenation of two slots of
    different sizes. Tensor parallelism splits ``kv_heads`` (``tp_size`` must
    divide it), so a shard's page is ``1/tp`` of the full one. ``tp_size`` here
    is the default an engine runs with; ``SimEngine(tp_size=...)`` may set it
    instead (one or the other, not two different values).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    max_attention_window: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    regions_per_group: int = 1
    vocab_size: int = 32000
    name: str = "s3kv-sim/model"
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.max_attention_window is not None:
            # Accept a list for convenience but keep the frozen value hashable.
            object.__setattr__(self, "max_attention_window", tuple(int(w) for w in self.max_attention_window))
            if not self.max_attention_window or any(w <= 0 for w in self.max_attention_window):
                raise ValueError(
                    f"max_attention_window must be positive ints, got {self.max_attention_window}"
                )
        if self.num_layers <= 0 or self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError("num_layers, kv_heads and head_dim must be positive")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {sorted(_DTYPE_BYTES)}")
        if self.regions_per_group not in (1, 2):
            raise ValueError("regions_per_group must be 1 or 2")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        self.heads_per_shard(self.tp_size)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def heads_per_shard(self, tp_size: int) -> int:
        if tp_size <= 0 or self.kv_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide kv_heads {self.kv_heads}")
        return self.kv_heads // tp_size

    def region_bytes_per_layer(self, tokens_per_block: int, tp_size: int) -> tuple[int, ...]:
        """Bytes one layer occupies in one page of each region, on one shard (K and V together)."""
        heads = self.heads_per_shard(tp_size)
        kv = 2 * tokens_per_block * heads * self.head_dim * self.dtype_bytes
        if self.regions_per_group == 1:
            return (kv,)
        return (kv, 2 * tokens_per_block * heads * SCALE_BYTES)


@dataclass(frozen=True)
class SimCacheConfig:
    """Cache-manager settings the engine is run with.

    ``pages_per_group`` None sizes each group's pool from ``max_batch`` and
    ``max_seq_len`` (every admitted request reserves its worst case, so a run can
    never dead-lock on pages). ``slot_padding`` makes ``stride > size`` for every
    other region, so a connector that assumes packed slots is caught. ``audit``
    re-verifies every page when the engine frees it, which catches a connector
    that scribbles over pages it does not own (it doubles the model's cost; a
    benchmark may turn it off). ``salt_changes_kv`` puts the cache salt into the
    model's KV, so serving one salt's pages to another is a mismatch (isolation
    is part of the contract even though a real model's KV ignores the salt).
    """

    tokens_per_block: int = 32
    max_seq_len: int = 4096
    pages_per_group: int | None = None
    slot_padding: int = 64
    junk_byte: int = 0xDB
    guard_byte: int = 0xAB
    audit: bool = True
    salt_changes_kv: bool = True
    seed: int = 0
    kv_dtype: str | None = None  # None: the model's dtype

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0 or self.tokens_per_block % 4:
            # Multiples of 4 keep every per-layer segment a multiple of 8 bytes.
            raise ValueError("tokens_per_block must be a positive multiple of 4")
        if self.max_seq_len < self.tokens_per_block:
            raise ValueError("max_seq_len must hold at least one block")
        if self.slot_padding < 0 or self.slot_padding % 8:
            raise ValueError("slot_padding must be a non-negative multiple of 8")
        if self.junk_byte == self.guard_byte:
            raise ValueError("junk_byte and guard_byte must differ")


@dataclass(frozen=True)
class GroupSpec:
    """One layer group as the cache forms it: id, effective window (None = full), layers."""

    group_id: int
    window: int | None
    layer_ids: tuple[int, ...]

    @property
    def sliding(self) -> bool:
        return self.window is not None


def effective_windows(model: SimModel, max_seq_len: int) -> tuple[int | None, ...]:
    """Per global layer: the configured window clamped to ``max_seq_len``, None when it reaches it."""
    vec = model.max_attention_window or (max_seq_len,)
    out: list[int | None] = []
    for layer in range(model.num_layers):
        w = min(int(vec[layer % len(vec)]), max_seq_len)
        out.append(None if w >= max_seq_len else w)
    return tuple(out)


def layer_groups(model: SimModel, max_seq_len: int) -> tuple[GroupSpec, ...]:
    """One group per distinct effective window, ids dense from 0.

    Ids are assigned full attention first, then windows descending -- on
    purpose *not* the configured order (Gemma-3 configures the sliding window
    first), so a connector that maps group ids from the config is caught.
    """
    per_layer = effective_windows(model, max_seq_len)
    distinct = sorted(set(per_layer), key=lambda w: (w is not None, -(w or 0)))
    return tuple(
        GroupSpec(gid, w, tuple(layer for layer, lw in enumerate(per_layer) if lw == w))
        for gid, w in enumerate(distinct)
    )


def sliding_cutoff(history: int, window: int | None, tokens_per_block: int, extra_blocks: int = 0) -> int:
    """First block ordinal a sliding group keeps a page for at ``history`` tokens (V2 rule, no sinks).

    Ordinals below it hold no page: ``(h + 1 - W) // tpb``, less ``extra_blocks``
    the engine retains beyond the window. Full attention keeps everything (0).
    """
    if window is None:
        return 0
    return max(0, (history + 1 - window) // tokens_per_block - extra_blocks)
