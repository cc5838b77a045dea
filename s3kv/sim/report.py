"""What a simulator run hands back: per-request outcomes, checker verdicts, timings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KvMismatch:
    """One page region whose bytes differ from what recomputation would write.

    ``phase`` "load": found when the request's first forward after allocation /
    resume checked the pages it was promised; "audit": found when the engine
    freed the page (someone overwrote it after it was written or verified).
    ``source`` "connector" for ordinals the connector served, "device" for the
    engine's own pages. ``kind``: "junk" (a freed/never-filled page), "zero",
    or "wrong" (someone's KV, not this prefix's).
    """

    request_id: int
    rank: int
    layer_group: int
    ordinal: int
    slot: int
    region: int
    layers: tuple[int, ...]
    kind: str
    phase: str
    source: str


@dataclass(frozen=True)
class RequestReport:
    request_id: int
    prompt_tokens: int
    device_match_tokens: int
    offered_tokens: int  # what the connector offered (last admission)
    matched_tokens: int  # connector tokens honoured and used (0 if an async load was discarded)
    computed_tokens: int  # prompt tokens the model computed in the final attempt
    loaded_async: bool
    discarded: bool
    replays: int  # preemptions (each re-admitted from scratch)
    output_tokens: tuple[int, ...]
    ttft_s: float  # first admission -> first generated token
    latency_s: float  # first admission -> generation finished
    finished_iteration: int
    cancelled: bool = False  # cancelled before it finished (request_finished was still called)
    #: The manager returned it as a failed load; the engine rewound it to its device match and it
    #: recomputed (rung 1, ``failed_load_outcome="recompute"``).
    recomputed_failed_load: bool = False
    #: The manager returned it as a failed load and the engine failed it with this error
    #: (rung 1, ``failed_load_outcome="fail"``); "" otherwise.
    failed: str = ""


@dataclass(frozen=True)
class SimReport:
    requests: tuple[RequestReport, ...]
    iterations: int
    kv_mismatches: int
    mismatches: tuple[KvMismatch, ...]  # details, the first ``max_mismatch_details``
    pages_checked: int
    pages_audited: int
    guard_violations: int
    hook_seconds: Mapping[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    #: Requests whose pages the engine still holds for an async save when it went idle.
    held_while_idle: tuple[int, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def matched_tokens(self) -> int:
        return sum(r.matched_tokens for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        return sum(r.computed_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens the connector served."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ok(self) -> bool:
        return self.kv_mismatches == 0 and self.guard_violations == 0

    def by_id(self, request_id: int) -> RequestReport:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    def summary(self) -> str:
        return (
            f"{len(self.requests)} requests, {self.iterations} iterations, prompt {self.prompt_tokens} tok, "
            f"connector {self.matched_tokens} tok ({self.hit_rate:.0%}), computed {self.computed_tokens} tok, "
            f"{self.pages_checked} pages checked, {self.kv_mismatches} mismatches, "
            f"{self.guard_violations} guard bytes hit, {self.wall_s:.2f}s"
        )
