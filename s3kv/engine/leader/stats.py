"""The leader's counters: what its lookups found, what it promised and planned, what it refused.

Cumulative and plain (read without a lock): ``s3kv.engine.metrics`` copies them into Prometheus,
``s3kv.core.cost`` weighs them into requests and dollars per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LeaderStats:
    lookups: int = 0
    #: Prompt tokens of every request asked about (replays counted once).
    prompt_tokens: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_waves: int = 0
    #: CPU seconds of the calling (executor) thread inside lookups, and of that, hashing the
    #: prompts' block chains (which the saves need anyway). Measured where they run, so the
    #: lookup's own cost is the difference.
    lookup_cpu_s: float = 0.0
    lookup_hash_cpu_s: float = 0.0
    lookup_asks: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    #: Timed-out probe lookups finished in the background (every wave, no budget) to warm the
    #: index for the next lookup of the prefix; and those skipped because the backlog was full.
    lookups_finished_late: int = 0
    lookups_not_finished: int = 0
    #: Lookups answered "miss" at once because earlier waves still hang in the background.
    lookup_busy: int = 0
    #: Lookups answered from the namespace summary (a miss without a request, or a verified hit).
    lookup_summary_misses: int = 0
    lookup_summary_hits: int = 0
    #: Summary candidates the verify wave refuted (stale summary: fell back to probing).
    lookup_summary_stale: int = 0
    foreign_objects: int = 0
    #: Objects refused on HEAD, by reason (foreign, untrusted, span, ...); their sum is foreign_objects.
    rejected: dict[str, int] = field(default_factory=dict)
    not_cacheable: int = 0
    #: Of those: LoRA requests whose adapter identity could not be established (s3kv.trtllm.lora).
    lora_unidentified: int = 0
    #: Finished requests whose finish plan copied pages the engine no longer listed (see _check_live).
    finish_plan_mismatches: int = 0
    #: Requests reported without a lookup (no full identity): never saved.
    unkeyed_not_saved: int = 0
    #: Device matches ending inside a block (partial reuse): no S3 hit possible.
    partial_block_misses: int = 0
    requests_expired: int = 0
    loads_cancelled_by_engine: int = 0
    #: Requests the engine freed with no connector call (a page of theirs went to another
    #: request, ``pages.py``): parked ones (their loads stopped) and running ones.
    loads_abandoned: int = 0
    requests_freed_silently: int = 0
    #: Requests the engine aborted through its failed-load path (``try_abort_request``).
    loads_aborted: int = 0
    honoured_less: int = 0
    #: Smaller honours served by a correct smaller load.
    honoured_less_served: int = 0
    #: Promised loads the leader could not plan (failure rung taken).
    promises_broken: int = 0
    planned_pages_saved: int = 0
    planned_objects: int = 0
    planned_pages_loaded: int = 0
    #: Per group id: blocks a hit needed from that group (its in-window tail for sliding groups).
    hit_blocks_by_group: dict[int, int] = field(default_factory=dict)
    #: Tokens whose KV this leader planned to save for the first time on this engine: blocks of
    #: the full-attention group (every group under ``storage_policy=all``) past what was served,
    #: times tokens per block. With ``hit_tokens`` the denominators of requests and dollars per
    #: token (``s3kv.core.cost``).
    tokens_saved: int = 0
    #: Branch-point tails planned (one per sliding group and request) and the pages they hold.
    branch_tails: int = 0
    branch_tail_pages: int = 0
    #: Branch-point tails abandoned: a page of the tail was gone before it could be staged.
    branch_tails_abandoned: int = 0
