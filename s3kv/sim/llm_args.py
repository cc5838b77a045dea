"""Duck-typed ``TorchLlmArgs`` the simulator hands each connector constructor.

Only what trtllm-connector-api.md says a connector may read is offered; an
adapter that reaches for anything else fails here as it would on a real build
where that field differs. One instance per rank: only the rank differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .config import SimCacheConfig, SimModel


@dataclass(frozen=True)
class SimMapping:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_size: int = 1
    cp_size: int = 1


@dataclass(frozen=True)
class SimParallelConfig:
    tp_size: int
    rank: int

    def to_mapping(self) -> SimMapping:
        # TP only: pipeline and context parallelism are rejected with a connector.
        return SimMapping(rank=self.rank, world_size=self.tp_size, tp_rank=self.rank, tp_size=self.tp_size)


@dataclass(frozen=True)
class SimKvCacheConfig:
    tokens_per_block: int
    max_attention_window: list[int] | None
    dtype: str
    enable_block_reuse: bool = True
    use_kv_cache_manager_v2: bool = True
    #: The simulator's device matches are whole blocks; the connector's own default stands.
    enable_partial_reuse: bool = False


@dataclass(frozen=True)
class SimLlmArgs:
    model: str
    max_seq_len: int | None
    kv_cache_config: SimKvCacheConfig
    tensor_parallel_size: int
    parallel_config: SimParallelConfig
    enable_attention_dp: bool = False
    pipeline_parallel_size: int = 1
    backend: str = "pytorch"
    #: A hub id's pinned commit: the simulated model's "weights" (its KV function) never change
    #: for a name, so its identity is strong without S3KV_MODEL_ID (s3kv/trtllm/identity.py).
    revision: str = ""
    #: False when the simulator runs the overlap executor loop (TensorRT-LLM's default).
    disable_overlap_scheduler: bool = True


def make_llm_args(
    model: SimModel, config: SimCacheConfig, tp_size: int, rank: int, *, overlap: bool = False,
    attention_dp: tuple[int, int] | None = None,
) -> SimLlmArgs:
    """The llm_args rank ``rank`` of a ``tp_size`` engine would be built with; ``attention_dp``
    (owner rank, size): that owner's rank of an attention-DP engine (attention not sharded)."""
    dp = attention_dp is not None
    if attention_dp is not None:
        rank, tp_size = attention_dp
    windows = list(model.max_attention_window) if model.max_attention_window is not None else None
    return SimLlmArgs(
        model=model.name,
        max_seq_len=config.max_seq_len,
        kv_cache_config=SimKvCacheConfig(
            tokens_per_block=config.tokens_per_block,
            max_attention_window=windows,
            dtype=config.kv_dtype or model.dtype,
        ),
        tensor_parallel_size=tp_size,
        parallel_config=SimParallelConfig(tp_size=tp_size, rank=rank),
        disable_overlap_scheduler=not overlap,
        enable_attention_dp=dp,
        revision=hashlib.sha1(f"s3kv-sim/{model.name}".encode()).hexdigest(),
    )
