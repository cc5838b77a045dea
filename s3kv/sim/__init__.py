"""Engine simulator: proves a KV-cache connector correct without TensorRT-LLM.

It drives real connector leader/worker classes in TensorRT-LLM's call order
over per-group paged pools (VSWA sliding pages freed by the V2 rule, chunked
prefill, TP shards, several regions per group), with a deterministic "model"
whose KV is a function of the full token prefix, and a checker that compares
every page a connector served with what recomputation would write.

    from s3kv.sim import SimEngine, SimCacheConfig, gemma3_like, shared_prefix_workload
    eng = SimEngine(gemma3_like(64), SimCacheConfig(tokens_per_block=16, max_seq_len=1024),
                    Leader, Worker, tp_size=2, chunk_size=48, connector_kwargs={...})
    cold = eng.run(shared_prefix_workload(first_id=0))
    warm = eng.run(shared_prefix_workload(first_id=100))
    assert warm.kv_mismatches == 0 and warm.matched_tokens > 0
"""

from .checker import KvChecker, PageCheck
from .config import GroupSpec, SimCacheConfig, SimModel, effective_windows, layer_groups, sliding_cutoff
from .engine import (
    EXECUTOR_LOOPS,
    DiscardHook,
    Honour,
    PreemptHook,
    SimContractError,
    SimEngine,
    SimEngineCrash,
    SimHang,
)
from .hooks import (
    discard_async,
    honour_at_most,
    honour_minus_blocks,
    honour_when_growth_fails,
    preempt_generation_once,
    preempt_once,
)
from .llm_args import SimKvCacheConfig, SimLlmArgs, SimMapping, SimParallelConfig, make_llm_args
from .model import (
    KvModel,
    PrefixHasher,
    adapter_weights,
    generate_tokens,
    next_token,
    request_root,
    token_bytes,
)
from .pools import GroupAllocator, RankPool, SimError
from .report import KvMismatch, RequestReport, SimReport
from .request import SimLlmRequest, SimRequestSpec
from .workload import (
    FULL_ATTENTION,
    flat_model,
    gemma3_like,
    multi_turn_workload,
    random_tokens,
    repeat_workload,
    shared_prefix_workload,
)

__all__ = [
    "FULL_ATTENTION",
    "DiscardHook",
    "EXECUTOR_LOOPS",
    "GroupAllocator",
    "GroupSpec",
    "Honour",
    "KvChecker",
    "KvMismatch",
    "KvModel",
    "PageCheck",
    "PreemptHook",
    "PrefixHasher",
    "RankPool",
    "RequestReport",
    "SimCacheConfig",
    "SimContractError",
    "SimEngine",
    "SimEngineCrash",
    "SimError",
    "SimHang",
    "SimKvCacheConfig",
    "SimLlmArgs",
    "SimLlmRequest",
    "SimMapping",
    "SimModel",
    "SimParallelConfig",
    "SimReport",
    "SimRequestSpec",
    "adapter_weights",
    "discard_async",
    "effective_windows",
    "flat_model",
    "gemma3_like",
    "generate_tokens",
    "honour_at_most",
    "honour_minus_blocks",
    "honour_when_growth_fails",
    "layer_groups",
    "make_llm_args",
    "multi_turn_workload",
    "next_token",
    "preempt_generation_once",
    "preempt_once",
    "random_tokens",
    "repeat_workload",
    "request_root",
    "shared_prefix_workload",
    "sliding_cutoff",
    "token_bytes",
]
