"""The leader's counters: what its lookups found, what it promised and planned, what it refused.

Cumulative and plain (read without a lock): ``s3kv.engine.metrics`` copies them into Prometheus,
``s3kv.core.cost`` weighs them into requests and dollars per token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class LookupRecord(NamedTuple):
    """One lookup as the scheduler paid for it."""

    seq: int
    #: Wall seconds the lookup held the scheduler's thread (hashing the prompt included).
    stall_s: float
    #: Its time budget (``Lookups.lookup_budget_s``; inf: none).
    budget_s: float
    #: Prompt tokens its best possible hit would have saved (past the device match).
    saveable_tokens: int
    hit_tokens: int
    #: How it ended: hit; miss (nothing servable found); ran_out (its time budget: a miss, finished
    #: in the background); busy (earlier waves still hang: a miss, nothing sent); error (a store
    #: error: a miss); skipped (store unavailable, or a device match ending mid-block); not_worth
    #: (found, but loading it would take longer than recomputing it: ``worth.py``).
    decision: str
    #: What the overlap loop hid of it (``pace.Pace.hidden_s``) and the requests it held back
    #: (the latest batch): ``added_s`` is the inter-token latency it added to each of them.
    hidden_s: float = 0.0
    corunning: int = 0

    @property
    def added_s(self) -> float:
        return max(0.0, self.stall_s - self.hidden_s) if self.corunning else 0.0


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
    #: Per lookup (``LookupRecord``): summed saveable tokens, decisions by name, and the
    #: latest records (bounded) for the metrics' histograms and the benchmarks.
    lookup_saveable_tokens: int = 0
    lookup_decisions: dict[str, int] = field(default_factory=dict)
    recent_lookups: deque[LookupRecord] = field(default_factory=lambda: deque(maxlen=4096))
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    #: Timed-out probe lookups finished in the background (every wave, no budget) to warm the
    #: index for the next lookup of the prefix.
    lookups_finished_late: int = 0
    #: Lookups answered "miss" at once because earlier waves still hang in the background.
    lookup_busy: int = 0
    #: Lookups answered from the namespace summary (a miss without a request, or a verified hit).
    lookup_summary_misses: int = 0
    lookup_summary_hits: int = 0
    #: Summary candidates the verify wave refuted (stale summary: fell back to probing).
    lookup_summary_stale: int = 0
    #: Lookups answered from the fleet index, and from this engine's LIST; hits that cost no
    #: request (a signed, young index or a trusted LIST vouched for them); and times a failed
    #: load of an object a listing vouched for took that listing's trust away.
    lookup_index_lookups: int = 0
    lookup_list_lookups: int = 0
    lookup_trusted_hits: int = 0
    listing_trust_lost: int = 0
    #: Background probes past a listing's answer (objects written since it), and those that found
    #: more than it listed (``lookup.Lookups._probe_past``).
    lookup_probes_past: int = 0
    lookup_probes_past_found: int = 0
    #: Stall priced as latency (``pace.py``): seconds of lookup stall beyond what the overlap loop
    #: hid while other requests were running (GPU time lost), and the inter-token latency it added
    #: to them, summed over those requests (request-seconds).
    lookup_unhidden_stall_s: float = 0.0
    lookup_added_latency_s: float = 0.0
    foreign_objects: int = 0
    #: Objects a HEAD found older than gc must keep them (``Listings.believable``): not remembered.
    old_objects: int = 0
    #: Objects refused on HEAD, by reason (foreign, untrusted, span, ...); their sum is foreign_objects.
    rejected: dict[str, int] = field(default_factory=dict)
    not_cacheable: int = 0
    #: Of those: LoRA requests whose adapter identity could not be established (s3kv.trtllm.lora).
    lora_unidentified: int = 0
    #: Finished requests whose finish plan would copy pages the engine no longer listed: dropped, never run
    #: (see FinishPlanner.plan_pages_held).
    finish_plan_mismatches: int = 0
    #: Requests reported without a lookup (no full identity): never saved.
    unkeyed_not_saved: int = 0
    #: Device matches ending inside a block (partial reuse): no S3 hit possible.
    partial_block_misses: int = 0
    requests_expired: int = 0
    #: Requests the engine freed with no connector call (a page of theirs went to another
    #: request, ``pages.py``): parked ones (their loads stopped) and running ones.
    loads_abandoned: int = 0
    requests_freed_silently: int = 0
    #: Requests told finished after the engine had freed their pages (one empty list per group:
    #: ``LeaderCore.request_finished``): nothing more of them is saved.
    finished_after_release: int = 0
    #: Requests the engine aborted through its failed-load path (``try_abort_request``).
    loads_aborted: int = 0
    honoured_less: int = 0
    #: Offers a failed allocation grow would cut to a point no stored tail serves
    #: (``pressure.py``); of those, cut while the engine showed memory pressure, and the tokens cut.
    offers_exposed: int = 0
    offers_cut: int = 0
    tokens_cut: int = 0
    #: Hits cut (to the part the host tier holds, or to nothing) because loading the rest would
    #: take longer than recomputing it at the measured tier speeds (``worth.py``).
    offers_not_worth: int = 0
    #: Promised loads the leader could not plan (failure rung taken).
    promises_broken: int = 0
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
    #: The one prefill-speed figure: prompt tokens per second, the engine's GPUs together
    #: (``s3kv.core.cost.Prefill.tokens_per_s``).
    prefill_tokens_per_s: float = 0.0
    #: The value policy's view per kind of object (``ValueModel.snapshot``: its estimates and the
    #: value line), refreshed every few lookups.
    value: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Reads by reuse-lag bin (``ValueModel.lag_reads``, ghost reads included): what the retention advice weighs.
    value_lag_reads: list[float] = field(default_factory=list)

    def record_lookup(self, stall_s: float, budget_s: float, saveable_tokens: int, hit_tokens: int,
                      decision: str, hidden_s: float = 0.0, corunning: int = 0) -> None:
        self.lookup_saveable_tokens += saveable_tokens
        self.lookup_decisions[decision] = self.lookup_decisions.get(decision, 0) + 1
        seq = self.recent_lookups[-1].seq + 1 if self.recent_lookups else 0
        rec = LookupRecord(seq, stall_s, budget_s, saveable_tokens, hit_tokens, decision, hidden_s, corunning)
        self.recent_lookups.append(rec)
        self.lookup_unhidden_stall_s += rec.added_s
        self.lookup_added_latency_s += rec.added_s * corunning
