"""What the leader writes to S3, and where each object goes: the value policy at work.

``S3KV_WRITE_POLICY`` decides per seal whether an object goes to S3 now, to the host tier only
until it proves itself ("evict"), to the host tier only ("never"), or -- with no host tier --
whether it is staged at all:

* ``auto`` (default): the value policy (``s3kv.core.value``). At a request's first report (its
  served point and the stored chain are known) the leader lists the request's boundaries --
  checkpoints, prompt end, branch point, history end -- with their real object sizes, and the
  model picks those worth their bill and how far the chain goes; the rest are refused ("evict"
  with a host tier, not staged without). The leader feeds the model: its clock (seconds: the engine's
  monotonic time, a replay's trace time), every hit of an S3 object says which boundary ended it
  (``on_lookup``, whichever tier served it; one only the host tier could serve is counted
  apart: ``core.value``), every boundary written is
  remembered (``on_seals``, ``on_finish``);
* ``through``: everything now (what s3kv did before the policy);
* ``back`` / ``local``: everything to the host tier, to S3 on eviction if read / never. Without a
  host tier nothing is staged (a warning at start-up).

Chain objects the lookup saw stored are never written again in any mode (a conditional PUT of
an existing key still bills a PUT and changes nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...core.cost import Prefill
from ...core.plan import SealOp
from ...core.value import (
    AT_PROMPT_END,
    BRANCH,
    CHAIN,
    CHECKPOINT,
    GC_WATCH_S,
    HISTORY_END,
    PROMPT_END,
    WRITE_ALL,
    Bill,
    Boundary,
    ValueModel,
)
from ..prefill import prefill_for
from .context import LeaderContext
from .lookup import Lookups
from .requests import RequestState
from .stats import LeaderStats

log = logging.getLogger("s3kv.leader")


#: The value line in ``LeaderStats.value`` is refreshed every this many lookups (and at each plan).
_SNAPSHOT_EVERY = 16


class WritePolicy:
    """``model_ref``: the engine's model (``llm_args.model``: its config.json gives the prefill FLOPs,
    ``s3kv.engine.prefill``); ``failed_load_hook``: the engine can be told to recompute a request
    whose promised load failed (``host_only_safe``)."""

    def __init__(self, settings: Any, stats: LeaderStats, lookups: Lookups, model_ref: Any = None,
                 tp_size: int = 1, failed_load_hook: bool = False):
        self.settings, self.stats, self.lookups, self.index = settings, stats, lookups, lookups.index
        self.mode = getattr(settings, "write_policy", "auto")
        self.model = ValueModel(prefill_for(settings, model_ref, tp_size), Bill.from_settings(settings),
                                min_return=settings.write_min_return)
        self.set_prefill(self.model.prefill)
        self._ceiling_life = self.model.bill.lifetime_s
        lookups.listings.reads = lambda: list(self.model.lag_reads)  # read reports (core.retention)
        lookups.listings.evidence = lambda: self.model.shared  # and what gc pools (core.value)
        #: The model's clock, in seconds (a trace replay sets its own: the trace's).
        self.clock: Callable[[], float] = time.monotonic
        self._lookups_seen = 0
        self.ctx: LeaderContext | None = None
        #: Real bytes of one page of each group on one shard (a benchmark's sizing pages: a real model's).
        self.page_bytes: list[int] = []
        # Why host-only objects need one rank or the hook: the lookup promises what rank 0's tier
        # holds, and each rank's tier holds its own shard. Another rank's copy can be missing (not
        # ready yet, evicted, refused); for an object also in S3 that rank reads S3, for a
        # host-only one nothing can answer -- without the hook the engine cannot be told to
        # recompute, and the request would stay parked until its client gave up.
        self.host_only_safe = tp_size == 1 or failed_load_hook
        if self.mode in ("back", "local") and not self.host_only_safe:
            log.warning("s3kv: S3KV_WRITE_POLICY=%s keeps objects in the host tier only, which at "
                        "tensor parallelism %d needs an engine with the failed-load hook (this one has "
                        "none): %s", self.mode, tp_size,
                        "writing through to S3" if self.mode == "back" else "nothing is saved")
        if self.mode in ("back", "local") and getattr(settings, "host_cache_gb", 0) == 0:
            log.warning("s3kv: S3KV_WRITE_POLICY=%s writes to the host tier only, and there is none: "
                        "nothing is saved (set S3KV_HOST_CACHE_GB, or S3KV_WRITE_POLICY=auto)", self.mode)

    @property
    def host_tier(self) -> bool:
        """A host tier stands in front of the store: rank 0's tier once the runtime made it at
        registration (an automatic size is known only then), else as the settings say
        (``S3KV_HOST_CACHE_GB`` > 0, where that setting exists)."""
        if getattr(getattr(self.lookups, "tiers", None), "host_tier", None) is not None:
            return True
        v = getattr(self.settings, "host_cache_gb", 0) or 0
        return isinstance(v, int | float) and v > 0

    def set_prefill(self, prefill: Prefill) -> None:
        """The one prefill-speed figure (``s3kv.core.cost.Prefill``) for the lookup budget and this
        policy; a benchmark that models a real model with a tiny one sets it here."""
        self.model.prefill = prefill
        self.lookups.prefill_tokens_per_s = prefill.tokens_per_s
        self.stats.prefill_tokens_per_s = prefill.tokens_per_s

    def bind(self, ctx: LeaderContext, page_bytes: Sequence[int]) -> None:
        self.ctx = ctx
        self.page_bytes = list(page_bytes)

    # ------------------------------------------------------------------ where an object goes
    @property
    def refused_to(self) -> str | None:
        """Where a refused object goes: the host tier until evicted (written to S3 if it was read
        there), or nowhere (None: not staged) without a tier."""
        return "evict" if self.host_tier and self.host_only_safe else None

    def default_to(self) -> str | None:
        """Where an object goes under the modes that do not weigh it."""
        if self.mode == "back":
            if not self.host_only_safe:
                return "now"  # __init__: host-only is unsafe here; write-back becomes write-through
            return "evict" if self.host_tier else None
        if self.mode == "local":
            return "never" if self.host_tier and self.host_only_safe else None
        return "now"

    def spine(self, st: RequestState) -> int:
        """How far ``st``'s lookup saw its chain stored where this engine's writes go: what its plan
        counts as written (``chain_to``, ``boundaries``) and where a branch tail may end. That is
        the store's part of it unless every write goes to the host tier first (``back``, ``local``):
        an object only the tier holds (one the value policy kept from S3) is no chain in S3 -- counted,
        a request skipped writing a chain its plan sends there (its tails reached S3 with no chain
        below them) and ended branch tails where only the tier has the chain, so engines reading S3
        missed what they hit without a tier (issue 39's trace row)."""
        return st.load.spine_blocks if self.default_to() in ("evict", "never") else st.load.stored_spine_blocks

    def chain_from(self, st: RequestState) -> int:
        """The first block of the spine this request writes: where the stored chain ends, even
        inside a chunk when the store holds that chunk from its start (``LoadState.chain_stored_to``);
        else that chunk's start, the whole chunk written again. Why not always the chunk: each
        turn of a conversation ends inside one, and rewriting it from its start stored the same
        pages again at every turn (a 4-turn conversation: one page six times; the stand-in
        conversation trace: 9% of the full-attention pages billed)."""
        ctx = self.ctx
        assert ctx is not None
        spine = self.spine(st)
        if st.load.chain_stored_to >= spine and spine == st.load.stored_spine_blocks:
            return st.load.chain_stored_to
        return spine // ctx.bpo * ctx.bpo

    def note_chain_below_device(self, st: RequestState) -> None:
        """At the first report: where the device match ends inside a chunk and the store holds the
        full-attention object ending there (every shard, as the index or listing knows it), the
        request's chain objects begin there (``chain_from``), not at the chunk's start. Why: the
        lookup asks only past the device match and never sees that object, and each request whose
        device matched a few-shot template stored it again (twice the full-attention bytes)."""
        ctx, ld = self.ctx, st.load
        d = ld.d_blocks
        if (ctx is None or st.chain is None or not d or d % ctx.bpo == 0 or ld.chain_stored_to >= d
                or ld.stored_spine_blocks != d or self.spine(st) != d or d > len(st.chain.digests)):
            return
        if self.lookups.listings.holds(ctx.geometry.spine_group, st.chain.digests[d - 1], d,
                                       range(ctx.geometry.tp_size)):
            ld.chain_stored_to = d

    def chain_to(self, st: RequestState, gid: int, ordinal: int) -> str | None:
        """Where full-attention block ``ordinal`` of group ``gid`` goes (None: not staged)."""
        ctx = self.ctx
        assert ctx is not None
        if gid == ctx.geometry.spine_group and ordinal < self.chain_from(st):
            return None  # its object is stored: the lookup saw it
        plan = st.saves.plan
        if self.mode != "auto" or plan is None:
            return self.default_to()
        if plan.chain_to is None or ordinal < plan.chain_to // self.ctx_tpb:
            return "now"
        return self.refused_to

    def tail_to(self, st: RequestState, kind: str, end: int) -> str | None:
        """Where the tail (or boundary object) of ``kind`` ending at block ``end`` goes."""
        plan = st.saves.plan
        if self.mode != "auto" or plan is None:
            return self.default_to()
        if kind == HISTORY_END or (kind == CHECKPOINT and end * self.ctx_tpb > st.prompt_len):
            # Past the prompt (its end unknown when the plan was made): a later turn is served
            # from there only with the whole history's chain, which the plan writes for these.
            return "now" if plan.chain_to is None else self.refused_to
        return "now" if plan.writes(kind, end * self.ctx_tpb) else self.refused_to

    @property
    def ctx_tpb(self) -> int:
        return self.ctx.geometry.tokens_per_block if self.ctx is not None else 1

    def kind_at(self, st: RequestState, end: int) -> str:
        """The kind of the boundary ending at block ``end`` for ``st``."""
        assert self.ctx is not None
        if end % self.ctx.checkpoint_blocks == 0:
            return CHECKPOINT
        prompt_blocks = st.prompt_len // self.ctx_tpb
        if end == prompt_blocks:
            return PROMPT_END
        if st.branch.end and end == st.branch.end:
            return BRANCH
        return HISTORY_END if end > prompt_blocks else BRANCH

    # ------------------------------------------------------------------ deciding
    def decide(self, st: RequestState) -> None:
        """At the request's first report: its plan (``auto``), from its boundaries' real sizes."""
        ctx = self.ctx
        self._keep_known(st)
        self.model.advance_to(self.clock())
        if ctx is None or self.mode != "auto" or ctx.policy.mode != "window" or st.chain is None:
            st.saves.plan = WRITE_ALL if self.mode == "auto" else None
            if self.mode in ("auto", "through") and st.chain is not None:
                self.model.count_write(CHAIN)
            return
        self._follow_fleet()
        plan = st.saves.plan = self.model.plan(self.boundaries(st))
        tpb = ctx.geometry.tokens_per_block
        if plan.chain_to is None or plan.chain_to >= st.prompt_len // tpb * tpb:
            self.model.count_write(CHAIN)  # its chain reaches the prompt's end: a branch may follow
        self._publish_value()

    def _follow_fleet(self) -> None:
        """Pool the other engines' evidence (``core.value``); bill storage for the life gc gives objects
        now: where it learns the retention (``core.retention``), shorter than the ceiling by as much,
        ended within half the index's period, not half gc's ``--watch`` (its publisher deletes) -- a
        policy billing the ceiling would refuse objects worth their real, shorter keep."""
        listings = self.lookups.listings
        self.model.pool(*listings.fleet_evidence())
        shorter = self.settings.retention_h * 3600.0 - listings.retention_s()
        period = listings.gc_period_s()
        sooner = 0.0 if period is None else max(0.0, (GC_WATCH_S - period) / 2)
        life = self._ceiling_life - max(0.0, shorter) - sooner
        if life != self.model.bill.lifetime_s:
            self.model.bill = dataclasses.replace(self.model.bill, lifetime_s=life)

    def _publish_value(self) -> None:
        """The value line and the dated reads, as ``LeaderStats`` carries them to the metrics."""
        self.stats.value, self.stats.value_lag_reads = self.model.snapshot(), list(self.model.lag_reads)

    def _keep_known(self, st: RequestState) -> None:
        """The chain objects this request does not write again (its lookup saw them stored) stay
        known to the index another TTL, as far as their HEAD answers allow (``KeyIndex.keep``):
        the next request of that prefix is then answered locally, not with HEADs (without it
        the lookups of a prefix asked 20% more HEADs on the chat trace)."""
        ctx = self.ctx
        spine = st.load.stored_spine_blocks  # the index answers for the store alone
        if ctx is None or st.chain is None or spine <= st.saves.save_from:
            return
        g = ctx.geometry
        fp = g.groups[g.spine_group].fingerprint
        digests = st.chain.digests
        self.index.keep(
            ctx.scheme.object_key(fp, shard, digests[end - 1])
            for shard in range(g.tp_size)
            for end in st.load.coverage.get((g.spine_group, shard), {})
            if st.saves.save_from < end <= spine and end <= len(digests)
        )

    def boundaries(self, st: RequestState) -> list[Boundary]:
        """The points ``st`` could make servable, above what is already stored or served."""
        ctx = self.ctx
        assert ctx is not None and st.chain is not None
        g = ctx.geometry
        tpb = g.tokens_per_block
        prompt_blocks = st.prompt_len // tpb
        start = st.saves.save_from
        have = st.load.h_blocks  # served: stored (the tail the lookup found too, further on)
        found = st.load.found_blocks
        ends: list[tuple[int, str]] = []
        cp = ctx.checkpoint_blocks
        ends += [(e, CHECKPOINT) for e in range(cp, prompt_blocks + 1, cp) if e > have]
        if prompt_blocks % cp and prompt_blocks > have:
            ends.append((prompt_blocks, PROMPT_END))
        # A branch the request's own chain ends (``saves.SavePlanner._own_branch``) may lie inside
        # what the device matched: S3 holds nothing ending there, whatever was served.
        own = st.branch.chain and st.branch.end
        if st.branch.end and (st.branch.end > have or own):
            ends.append((st.branch.end, BRANCH))
        ends = [(e, k) for e, k in ends if e != found or (own and k == BRANCH)]
        if prompt_blocks > have and prompt_blocks > 0:
            ends.append((prompt_blocks, CHAIN))  # the prompt's chain, for later requests' branch tails
        if self.settings.save_decode and prompt_blocks > 0:
            ends.append((prompt_blocks, HISTORY_END))  # its end is past the prompt: unknown yet
        ends.sort(key=lambda x: (x[0], x[1] == HISTORY_END))
        full, sliding = [x for x in g.groups if not x.is_sliding], [x for x in g.groups if x.is_sliding]
        stored_below = found * tpb if found > st.load.d_blocks else 0
        per_token = sum(self.page_bytes[grp.group_id] for grp in full) * g.tp_size / tpb
        out, prev = [], max(start, self.chain_from(st))
        for end, kind in ends:
            tail: list[int] = []
            for grp in sliding:
                lo = ctx.policy.tail(grp.group_id, end)[0]
                n = end - max(lo, start)
                tail += [n * self.page_bytes[grp.group_id]] * g.tp_size if n > 0 else []
            chain: list[int] = []
            n = end - prev
            if n > 0:
                for grp in full:
                    objs = math.ceil(n / ctx.policy.bpo(grp.group_id))
                    chain += [n * self.page_bytes[grp.group_id] // objs] * (objs * g.tp_size)
                prev = end
            # A prompt-end or branch tail below the chain's end ends its object (``SavePlanner._plan``).
            cuts = kind in (PROMPT_END, BRANCH)
            splits = sum(g.tp_size for grp in full if cuts and end % ctx.policy.bpo(grp.group_id))
            out.append(Boundary(kind, end * tpb, st.chain.digests[end - 1], tuple(tail), tuple(chain), per_token,
                                splits, stored_below))
        return out

    # ------------------------------------------------------------------ learning
    def on_lookup(self, st: RequestState) -> None:
        """A lookup was answered: a hit says which boundary ended it, and whether S3 holds it."""
        self.model.advance_to(self.clock())
        self._lookups_seen += 1
        if self._lookups_seen % _SNAPSHOT_EVERY == 0:
            self._publish_value()
        ctx = self.ctx
        ld = st.load
        if ctx is None or st.chain is None or ld.replayed:
            return
        g = ctx.geometry
        tpb = g.tokens_per_block
        h = ld.d_blocks + ld.offered_blocks
        sliding = [grp for grp in g.groups if grp.is_sliding]
        ender = sliding[0].group_id if sliding else g.spine_group
        # An object past the hit that gc deleted: a read the retention cut off, which gc must see
        # to keep objects longer (core.retention, ghost reads).
        age = self.lookups.listings.deleted_age_s(g.groups[ender].fingerprint, st.chain.digests, h,
                                                  st.prompt_len // tpb)
        if age is not None:
            self.model.ghost(age)
        if ld.offered_blocks <= 0:  # (with an S3 hit, a reader without this device hit there, past it)
            self.model.device_reuse(st.chain.digests, ld.d_blocks)
            return
        end = h
        tail_bytes = 0
        if sliding:
            spans = ld.coverage.get((sliding[0].group_id, 0), {})
            end = h if h in spans else h + 1
            for grp in sliding:
                lo = ctx.policy.tail(grp.group_id, end)[0]
                tail_bytes += max(0, h - max(lo, ld.d_blocks)) * self.page_bytes[grp.group_id] * g.tp_size
        if end > len(st.chain.digests):
            return
        chain_bytes = (h - ld.d_blocks) * g.tp_size * sum(
            self.page_bytes[grp.group_id] for grp in g.groups if not grp.is_sliding)
        digest = st.chain.digests[end - 1]
        # What the reader can tell of another engine's boundary (core.value, "reads per write"): a
        # checkpoint by its end; a hit that reached this prompt's own end (a repeat, or a next turn).
        hint: str | None = CHECKPOINT if end % ctx.checkpoint_blocks == 0 else None
        if hint is None and end >= (st.prompt_len - 1) // tpb:
            hint = AT_PROMPT_END
        if self.host_tier and self.lookups.host_only(ender, digest, end):
            self.model.host_read(hint)  # only host memory could serve it: no reason to write S3 now
            return
        self.model.read(digest, hint, h * tpb, ld.device_tokens, tail_bytes, chain_bytes,
                        lag_s=self.lookups.listings.age_s(ender, 0, digest, end), end_tokens=end * tpb)

    def on_seals(self, st: RequestState, seals: Sequence[SealOp], *, finish: bool = False) -> None:
        """Seals just emitted for ``st`` (``finish``: its finish plan's, run as it ended): the objects
        written to S3 now, by kind -- a boundary's objects as one write of its kind, remembered."""
        ctx = self.ctx
        if ctx is None or not seals:
            return
        self.model.advance_to(self.clock())
        g = ctx.geometry
        prompt_blocks = st.prompt_len // self.ctx_tpb
        has_sliding = any(x.is_sliding for x in g.groups)
        bounds: dict[int, list[int]] = {}
        for s in seals:
            if s.to_s3 != "now":
                continue
            grp = g.groups[s.buffer.group]
            sizes = [s.count * self.page_bytes[grp.group_id]] * g.tp_size
            end = s.buffer.first + s.count
            if grp.is_sliding:
                bounds.setdefault(end, []).extend(sizes)
                continue
            self.model.wrote(CHAIN, sizes)
            if not has_sliding and (
                end % ctx.checkpoint_blocks == 0 or end == prompt_blocks or end == st.branch.end
                or (finish and end > prompt_blocks)
            ):
                bounds.setdefault(end, [])  # a full-attention model's boundary is its chain object
        for end, sizes in bounds.items():
            digest = st.chain.digests[end - 1] if st.chain is not None and end <= len(st.chain.digests) else None
            self.model.wrote(self.kind_at(st, end), sizes, digest, end * self.ctx_tpb)
