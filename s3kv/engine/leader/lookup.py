"""The leader's lookups: the largest servable history, in few round trips, within a budget.

``s3kv.core.lookup.find_hit`` plans which objects to ask about; this module answers its asks:
from the local index (own uploads, HEAD answers), from a listing of the namespace -- the fleet
index, else this engine's LIST summary (``s3kv.engine.summary``: a cold miss then costs no
request, a hit one verify wave, or none where the listing is trusted) -- else with parallel HEAD
waves. A wave has what is left of the lookup's time budget (``lookup_budget_s``: a share of the
prefill its best possible hit would save, within a hard cap, and with requests running beside
it no more than what the overlap loop hides plus ``lookup_max_added_latency_ms``, ``pace.py``);
past it the wave keeps running on its thread and feeds the index when it ends, the rest of the
lookup is then finished in the background (so the next lookup of that prefix is local), and at
most ``lookup_max_pending`` such waves may run at once. Objects written since the listing are
found the same way, in the background, where what they may save is worth the HEADs
(``_probe_past``). A store error, a timeout or a full backlog is a miss, never an exception.
HEAD answers are checked against the object identity the key promises before they reach the
index or a plan.

Why this is one module: the index, the listings, the HEAD waves and what happens past the budget
all answer one lookup's asks and share its state (deadline, backlog, the wave that ran out);
split apart, each piece would reach into the others.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from itertools import repeat
from typing import Any

from ...config import Settings
from ...core.hitrule import Span, required_range, servable
from ...core.lookup import Ask, LookupResult, contiguous_end, find_hit, spine_end, stall_budget_s
from ...core.objects import ObjectFormatError, ObjectSpan, span_from_metadata
from ...store.base import HeadBatch, ObjectStore, SpanExpect, StoreError
from ..index import MISSING, KeyIndex, host_first
from ..summary import Listing
from .context import LeaderContext
from .listings import Listings
from .pace import Pace
from .pressure import PressureGauge, fallback_blocks
from .requests import RequestState
from .stats import LeaderStats
from .worth import weigh, worth_loading

log = logging.getLogger("s3kv.leader")

#: How many recent waves ``Lookups._hopeless`` judges by, and how many it needs first.
_RECENT_WAVES, _RECENT_MIN = 8, 3


class _LookupTimeout(Exception):
    """The lookup's HEAD budget ran out (a miss)."""


class _LookupBusy(Exception):
    """Too many timed-out HEAD waves still run in the background: skip the network (a miss)."""


#: What an engine assumes, before it has seen any, of probes past a listing finding more: a listing
#: is seconds old, and a prompt's objects written in those seconds by another engine are rare.
PAST_YIELD_PRIOR = 0.05
#: A listed candidate: its object key and when it was written (None: unknown).
_Pick = tuple[str, "float | None"]


class Lookups:
    """Answers a request's lookup; holds the HEAD pool, the time budget and the namespace summary."""

    def __init__(self, settings: Settings, store: ObjectStore, index: KeyIndex, stats: LeaderStats,
                 tiers: Any = None):
        """``tiers``: where rank 0's host tier (``host_tier``) and the workers' load speeds per
        tier (``speeds``) appear once the worker registered the layout (the engine runtime)."""
        self.settings = settings
        self.store = store
        self.index = index
        self.stats = stats
        self.ctx: LeaderContext | None = None  # bound when the geometry arrives
        self._pool: ThreadPoolExecutor | None = None
        self._deadline = float("inf")
        self._timed_out = False
        #: HEAD waves submitted to the lookup pool and not finished.
        self.pending_waves = 0
        self._pending_lock = threading.Lock()
        self._last_probe_used_network = False
        #: The wave this lookup's budget ran out on (still running), if any.
        self._late_wave: Future | None = None
        #: This lookup's budget (seconds, inf = none), the tokens its best hit would save, and
        #: what it decided (see ``LookupRecord.decision``); read by ``record``.
        self.budget_s = math.inf
        self.saveable_tokens = 0
        self.decision = ""
        #: Recent HEAD waves' wall time (moving average, each at most the cap): see ``_head_wave``.
        self._wave_s = 0.0
        #: The last few waves' wall times, uncapped: a wave slower than all of them is not sent
        #: on the scheduler's time (``_head_wave``). ``_slow``: that rule is holding waves back.
        self._recent_waves: deque[float] = deque(maxlen=_RECENT_WAVES)
        self._slow = False
        #: This answer re-checks a promise (``recheck``): the longest budget, always tried.
        self._promise = False
        #: What the engine's honours say of its KV memory (``pressure.py``); ``loads.py`` feeds it.
        self.pressure = PressureGauge()
        #: The namespace's listings: the fleet index, the LIST summary, and what they may vouch for.
        self.listings = Listings(settings, store, index, stats)
        #: Share of background probes past a listing that found more than it listed (moving average).
        self._past_yield = PAST_YIELD_PRIOR
        self._past_running = False
        #: The engine's passes (batch, forward time): what a stall costs the requests beside it.
        self.pace = Pace()
        self._hidden_s = 0.0
        self._corunning = 0
        #: The host tier answers before the index (``host_first``); the speeds decide how much of
        #: a hit is worth loading (``worth.py``).
        self.tiers = tiers
        #: This answer's asks the host tier answered.
        self._host_asks: set[Ask] = set()
        #: The engine's prefill speed (``LeaderCore.set_prefill``: the one figure, its TP ranks together).
        self.prefill_tokens_per_s = settings.prefill_tokens_per_s or 1.0

    def bind(self, ctx: LeaderContext) -> None:
        self.ctx = ctx
        self.listings.bind(ctx)

    # ------------------------------------------------------------------ one request's lookup
    def offer(
        self,
        st: RequestState,
        num_computed_tokens: int,
        *,
        store_available: bool,
        load_async: bool,
        first_chunk_tokens: int | None = None,
    ) -> tuple[int, bool]:
        """What the connector offers ``st`` on top of its device match: (tokens, async).
        ``first_chunk_tokens``: the request's first context chunk, when the engine chunks the
        prompt and says how much (``pressure.py`` guards offers that reach its end)."""
        ctx = self.ctx
        assert ctx is not None
        g = ctx.geometry
        tpb = g.tokens_per_block
        ld = st.load
        ld.d_blocks = num_computed_tokens // tpb
        ld.device_tokens = num_computed_tokens
        ld.h_blocks = ld.d_blocks
        self.stats.lookups += 1
        self.decision, self.saveable_tokens, self.budget_s = "skipped", 0, 0.0
        # What the engine's batch pays for this lookup (hashing the prompt included): ``pace.py``.
        self.pace.stalled()
        self._hidden_s, self._corunning = self.pace.hidden_s(), self.pace.corunning()
        if num_computed_tokens % tpb or not store_available:
            # A device match that ends mid-block (partial reuse) leaves nothing whole to
            # append to: an S3 load must start on a block boundary.
            self.stats.misses += 1
            if num_computed_tokens % tpb:
                self.stats.partial_block_misses += 1
            return 0, False
        prompt_len = st.prompt_len
        hmax = (prompt_len - 1) // tpb
        self._start_budget((hmax - ld.d_blocks) * tpb)
        result = self._find(st, prompt_len // tpb, hmax)
        ld.spine_blocks, ld.found_blocks = result.spine_blocks, result.h_blocks
        ld.stored_spine_blocks, ld.chain_stored_to = self._stored_spine(st, result)
        if first_chunk_tokens is not None and result.h_blocks - ld.d_blocks >= self.settings.min_hit_blocks:
            result = self._guard(st, result, int(first_chunk_tokens))
        self.stats.lookup_waves += result.waves
        gain = result.h_blocks - ld.d_blocks
        if (gain >= self.settings.min_hit_blocks and self.settings.lookup_timeout_s == -1
                and getattr(self.tiers, "speeds", None) is not None):  # -1: lookups follow the value
            gain = self._worth(st, result) - ld.d_blocks
        if gain < self.settings.min_hit_blocks:
            self.stats.misses += 1
            self.decision = self.decision or "miss"
            return 0, False
        self.decision = "hit"
        ld.coverage = result.coverage
        ld.offered_blocks = ld.made_blocks = gain
        ld.load_async = load_async
        self.stats.hits += 1
        log.debug(
            "s3kv: request %s hit %d of %d tokens (%d waves, %d asks)",
            st.request_id, gain * tpb, prompt_len, result.waves, result.asks,
            extra={"request_id": st.request_id, "hit_tokens": gain * tpb, "prompt_tokens": prompt_len},
        )
        return gain * tpb, ld.load_async

    def _stored_spine(self, st: RequestState, result: LookupResult) -> tuple[int, int]:
        """How far ``result`` saw the full-attention chain in the store: ``spine_blocks`` less what
        only the host tier holds (``host_only``: an object kept from S3). What a plan that writes
        to S3 counts as written there (``WritePolicy.spine``). And how far the store holds it from
        the start of the chunk that ends in (``LoadState.chain_stored_to``)."""
        tier, ctx = getattr(self.tiers, "host_tier", None), self.ctx
        if ctx is None:
            return result.spine_blocks, 0
        g = ctx.geometry
        sg = g.spine_group
        if tier is None or st.chain is None or not self._host_asks:
            return result.spine_blocks, self._whole_chunk(result.coverage, result.spine_blocks)
        digests = st.chain.digests
        coverage = {
            (sg, s): {e: x for e, x in result.coverage.get((sg, s), {}).items()
                      if (sg, s, e) not in self._host_asks or not self.host_only(sg, digests[e - 1], e, s)}
            for s in range(g.tp_size)
        }
        end = spine_end(g, coverage, st.load.d_blocks, result.spine_blocks)
        return end, self._whole_chunk(coverage, end)

    def _whole_chunk(self, coverage: Mapping[tuple[int, int], Mapping[int, Span]], end: int) -> int:
        """How far ``coverage`` holds the spine on every shard without a gap from the start of the
        chunk ``end`` falls in (not capped at what may be served), or 0 where that is not past the
        chunk's start. A writer may begin there, inside the chunk (``core.lookup``, objects that
        start inside a chunk); where the lookup did not see the chunk whole -- the part below the
        device match is not asked, only the host tier holds it -- it writes the chunk from its start."""
        ctx = self.ctx
        assert ctx is not None
        g = ctx.geometry
        sg = g.spine_group
        if g.groups[sg].is_sliding:
            return 0
        start = end // ctx.policy.bpo(sg) * ctx.policy.bpo(sg)
        got = min(contiguous_end(coverage.get((sg, s), {}), start) for s in range(g.tp_size))
        return got if got > start else 0

    def _guard(self, st: RequestState, result: LookupResult, first_chunk_tokens: int) -> LookupResult:
        """``result``, or a smaller hit inside the first chunk when the offer is exposed and the
        engine shows memory pressure (``pressure.py``: why, and when)."""
        ctx = self.ctx
        assert ctx is not None
        g = ctx.geometry
        tpb = g.tokens_per_block
        ld = st.load
        d = ld.d_blocks
        # V2 caps the chunk's end at the prompt: a chunk holding the rest never grows.
        first = min(first_chunk_tokens, st.prompt_len - ld.device_tokens)
        fb = fallback_blocks(d, result.h_blocks - d, first, tpb)
        ld.needs_grow = fb is not None
        margin = self.settings.window_margin_blocks
        if fb is None or fb <= d or servable(g, result.coverage, d, fb, margin):
            return result  # no grow; or a failed one honours nothing, or a point that is stored
        mode = self.settings.offer_guard
        self.stats.offers_exposed += 1
        if mode == "off" or (mode == "pressure" and not self.pressure.on()):
            return result
        # The largest servable point no further than the fallback: that is the fallback itself
        # when a tail ends there that the lookup did not ask about (then the offer is safe), else
        # a point inside the first chunk, which V2 honours in full.
        inside = find_hit(g, ctx.params, d, st.prompt_len // tpb, fb, lambda a: self._probe(st, a),
                          count_wave=lambda a: self._last_probe_used_network)
        for key, spans in inside.coverage.items():
            result.coverage.setdefault(key, {}).update(spans)
        result.waves += inside.waves
        result.asks += inside.asks
        if inside.h_blocks >= fb:
            return result
        kept = inside.h_blocks if inside.h_blocks - d >= self.settings.min_hit_blocks else d
        self.stats.offers_cut += 1
        self.stats.tokens_cut += (result.h_blocks - kept) * tpb
        why = ("no time was left to ask whether a stored sliding-window tail serves it" if self._timed_out
               else "no stored sliding-window tail serves it")
        log.info(
            "s3kv: request %s: offering %d of %d tokens: the engine shows KV memory pressure and a "
            "failed grow would honour block %d; %s",
            st.request_id, (kept - d) * tpb, (result.h_blocks - d) * tpb, fb, why,
            extra={"request_id": st.request_id},
        )
        ld.needs_grow = False
        result.h_blocks = inside.h_blocks
        return result

    def _worth(self, st: RequestState, result: LookupResult) -> int:
        """Cut ``result`` to what beats recomputing it at the tiers' measured speeds (``worth.py``):
        the whole hit, the longest point the host tier alone serves, or nothing. Its history."""
        ctx, s, d = self.ctx, self.settings, st.load.d_blocks
        assert ctx is not None
        g, speeds, tps = ctx.geometry, self.tiers.speeds, self.prefill_tokens_per_s
        full = weigh(g, result.coverage, self._host_asks, d, result.h_blocks, s.window_margin_blocks, speeds, tps)
        # The tier's part is sought where the store's part may not pay, or the tier holds some of it.
        asked = full.store_bytes and getattr(self.tiers, "host_tier", None) is not None
        host_h = self._host_hit(st, result) if asked and (full.saves_s <= 0 or self._host_asks) else None
        # Without the tier's part, coverage and the host asks are as ``full`` weighed them.
        w = worth_loading(g, result.coverage, self._host_asks, d, result.h_blocks, s.window_margin_blocks, speeds,
                          tps, host_h, whole=full if host_h is None else None)
        if w.h_blocks < result.h_blocks:
            self.stats.offers_not_worth += 1
            self.decision = "not_worth" if w.h_blocks == d else ""
            result.h_blocks = w.h_blocks
        return result.h_blocks

    def _host_hit(self, st: RequestState, result: LookupResult) -> int:
        """The longest point up to ``result``'s hit that the host tier alone serves, its objects
        added to ``result.coverage``: every block end asked of the tier only (no request), once
        per group on shard 0 (the other ranks hold their shards of the same objects)."""
        ctx, d, h = self.ctx, st.load.d_blocks, result.h_blocks
        assert ctx is not None and st.chain is not None
        g = ctx.geometry
        tier = self.tiers.host_tier
        digests = st.chain.digests
        local: dict[tuple[int, int], dict[int, Span]] = {}
        # Thousands of ends (a 128k-token hit): each one a dict read by digest (``HostTier.held``),
        # not a key made and a tier and index read per end (~5 ms on the scheduler's thread).
        for grp in g.groups:
            gid = grp.group_id
            held = tier.held(ctx.prefixes[(gid, 0)])
            if not held:
                continue
            found: dict[int, Span] = {}
            for e, digest in enumerate(digests[d:h], d + 1):
                x = held.get(digest)
                if x is not None and x.ready:
                    found[e] = Span(x.first, x.first + x.count)
            for shard in range(g.tp_size):
                local[(gid, shard)] = found if shard == 0 else dict(found)
                self._host_asks.update(zip(repeat(gid), repeat(shard), found))
        for e in sorted(local.get((g.spine_group, 0), {}), reverse=True):
            if servable(g, local, d, e, self.settings.window_margin_blocks):
                for key, spans in local.items():
                    result.coverage.setdefault(key, {}).update(spans)
                return e
        return d

    def in_host(self, group: int, digest: bytes) -> bool:
        """Rank 0's host tier holds the object of ``group`` ending at ``digest`` (``LoadOp.host``)."""
        tier = getattr(self.tiers, "host_tier", None)
        return tier is not None and self.ctx is not None and tier.holds(self.ctx.prefixes[(group, 0)] + digest.hex())

    def host_only(self, group: int, digest: bytes, end: int, shard: int = 0) -> bool:
        """Rank 0's host tier holds the object of ``group`` ending at block ``end`` (chain digest
        ``digest``) and the store is not known to: the tier neither wrote it through nor read it
        from there, the key index has not seen it, the namespace's listing does not list it (an
        object the write policy kept from S3, ``evict``/``never``). The tier answers a lookup
        before the index and the listing, so they are asked here."""
        tier, ctx = getattr(self.tiers, "host_tier", None), self.ctx
        if tier is None or ctx is None:
            return False
        key0 = ctx.prefixes[(group, 0)] + digest.hex()
        if not tier.holds(key0) or tier.stored(key0):
            return False
        if isinstance(self.index.get(ctx.prefixes[(group, shard)] + digest.hex()), ObjectSpan):
            return False
        listing = self.listings.current()
        return listing is None or listing.find(group, shard, digest, end) is None

    def record(self, stall_s: float, hit_tokens: int) -> None:
        """The lookup just offered held the scheduler ``stall_s``: note it beside its budget, what
        its best hit could have saved, and how it ended."""
        self.stats.record_lookup(stall_s, self.budget_s, self.saveable_tokens, hit_tokens, self.decision,
                                 self._hidden_s, self._corunning)

    def recheck(self, st: RequestState, h: int) -> LookupResult:
        """Verify a smaller history ``h`` than offered (the index answers most of it)."""
        ctx = self.ctx
        assert ctx is not None
        g = ctx.geometry
        # A budget of its own, as a lookup has: left with what the last lookup did not use (or
        # another request's), a wave to a slow store would run out at once and break a promise
        # the store can keep -- on an engine without the failed-load hook the request would then
        # stay parked until its client gave up. The longest budget any lookup gets, whatever the
        # hit is worth: a promise is at stake, not a hit.
        self._start_budget((h - st.load.d_blocks) * g.tokens_per_block, promise=True)
        return find_hit(g, ctx.params, st.load.d_blocks, st.prompt_len // g.tokens_per_block, h,
                        lambda asks: self._probe(st, asks))

    def lookup_budget_s(self, saveable_tokens: int, corunning: int = 0, hidden_s: float = 0.0) -> float:
        """The time budget of a lookup whose best possible hit saves ``saveable_tokens`` (inf: none),
        with ``corunning`` requests in the engine's batch and ``hidden_s`` of stall the overlap loop
        hides behind the forward (``pace.py``).

        Two prices, the smaller wins: the value rule (a share of the prefill the hit saves, within
        the cap) prices the stall in the GPU time of the request looked up; every request beside
        it waits too, each getting its next token later by the stall beyond what the overlap
        hides, and that latency is what ``lookup_max_added_latency_ms`` bounds -- an SLO, not a
        price, since the prefill a miss costs is spread over many passes' chunks while the stall
        lands on one token of every stream at once."""
        s = self.settings
        if s.lookup_timeout_s > 0:
            return s.lookup_timeout_s
        if s.lookup_timeout_s == 0:
            return math.inf
        budget = stall_budget_s(saveable_tokens, self.prefill_tokens_per_s, s.lookup_stall_fraction,
                                s.lookup_max_stall_ms / 1000.0)
        if corunning > 0:
            budget = min(budget, hidden_s + s.lookup_max_added_latency_ms / 1000.0)
        return budget

    def _max_budget_s(self) -> float:
        """The longest budget any lookup gets: the fixed one, else the cap."""
        s = self.settings
        return s.lookup_timeout_s if s.lookup_timeout_s > 0 else s.lookup_max_stall_ms / 1000.0

    def _start_budget(self, saveable_tokens: int, *, promise: bool = False) -> None:
        """One scheduler-path answer (a lookup, a re-check) starts: its time budget from now."""
        self.saveable_tokens = max(0, saveable_tokens)
        self._promise = promise
        if promise:
            self.budget_s = budget = math.inf if self.settings.lookup_timeout_s == 0 else self._max_budget_s()
        else:
            self.budget_s = budget = self.lookup_budget_s(self.saveable_tokens, self._corunning, self._hidden_s)
        self._deadline = time.monotonic() + budget
        self._timed_out = False
        self._late_wave = None
        self.decision = ""
        self._host_asks = set()

    def _find(self, st: RequestState, full_blocks: int, hmax: int) -> LookupResult:
        """The largest servable history: from a listing of the namespace when one is fresh (a miss
        costs no request, a hit one verify wave or none), else by probing with HEAD waves."""
        ctx = self.ctx
        assert ctx is not None
        g = ctx.geometry
        d = st.load.d_blocks
        self.listings.note_failed_loads()
        listing = self.listings.current()
        waves = asks = 0
        if listing is not None:
            if listing.source == "index":
                self.stats.lookup_index_lookups += 1
            else:
                self.stats.lookup_list_lookups += 1
            picked: dict[Ask, _Pick] = {}
            cand = find_hit(g, ctx.params, d, full_blocks, hmax,
                            lambda a: self._probe_local(st, a, listing, picked), count_wave=lambda a: False)
            if cand.h_blocks - d < self.settings.min_hit_blocks:
                self.stats.lookup_summary_misses += 1
                self._probe_past(st, d, full_blocks, hmax)
                return cand
            todo = self._loaded_picks(st, cand, picked)
            if self.listings.trusted(listing, [picked[a][1] for a in todo.values()]):
                # Vouched for by a listing trusted like a HEAD answer: no request.
                self.stats.lookup_summary_hits += 1
                self.stats.lookup_trusted_hits += 1
                self.listings.vouch(todo, listing)
                self._probe_past(st, cand.h_blocks, full_blocks, hmax)
                return cand
            verified, outcome = self._verify(st, cand, todo, picked)
            if outcome in ("ok", "refuted"):
                self.listings.trust.verified(listing.source, listing.generation, outcome == "ok")
            elif self._timed_out:
                # No time for the verify wave (or it ran out): finish the lookup in the background,
                # so the next lookup of this prefix is answered from the key index.
                self._finish_late(st, full_blocks, hmax)
            if verified is not None:  # confirmed, or a miss because the wave failed / timed out
                if verified.h_blocks > d:
                    self.stats.lookup_summary_hits += 1
                    self._probe_past(st, verified.h_blocks, full_blocks, hmax)
                return verified
            # A refuted candidate: the listing is stale here. The verify wave's answers are in
            # the key index now; probe what is left of the budget.
            self.stats.lookup_summary_stale += 1
            waves, asks = 1, len(todo)
        result = find_hit(
            g,
            ctx.params,
            d,
            full_blocks,
            hmax,
            lambda a: self._probe(st, a),
            count_wave=lambda a: self._last_probe_used_network,
        )
        if self._timed_out:
            self._finish_late(st, full_blocks, hmax)
        result.waves += waves
        result.asks += asks
        return result

    def _probe_past(self, st: RequestState, found: int, full_blocks: int, hmax: int) -> None:
        """Objects written since the listing are not in it: a lookup it answered found ``found``
        blocks where the prompt had ``hmax``. Probe the rest in the background (no budget, every
        HEAD wave, answers into the key index, as ``_finish_late``), so the next lookup of the
        prefix -- the next turn, another request sharing it -- finds them locally.

        Only where it pays: the prefill the rest would save, times the share of such probes that
        lately found anything (learned, so an engine whose listings are complete stops asking),
        against a first wave's HEADs at the store's price. Never on the scheduler's time."""
        s, ctx = self.settings, self.ctx
        assert ctx is not None
        tpb = ctx.geometry.tokens_per_block
        gain = (hmax - found) * tpb
        if hmax - found < s.min_hit_blocks:
            return
        worth = self._past_yield * gain / self.prefill_tokens_per_s * s.gpu_usd_per_hour / 3600.0
        if worth <= s.lookup_probe_budget * s.cost_get_per_1k_usd / 1000.0:
            return

        def done(result: LookupResult | None) -> None:
            with self._pending_lock:
                self._past_running = False
                if result is not None:
                    more = result.h_blocks > found
                    self.stats.lookup_probes_past_found += more
                    self._past_yield = 0.9 * self._past_yield + 0.1 * more

        with self._pending_lock:
            if self.pending_waves or self._past_running:
                return  # background work is the foreground's spare capacity: never its backlog
            self._past_running = True
        if self._finish_late(st, full_blocks, hmax, on_done=done):
            self.stats.lookup_probes_past += 1
        else:
            self._past_running = False

    def close(self) -> None:
        """Stop the background work (summary refresher, pool). Idempotent."""
        self.listings.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ answering asks
    def _indexed(self, st: RequestState, asks: set[Ask]) -> Iterator[tuple[Ask, str, Any]]:
        """(ask, object key, what the index knows of it) for every ask, read in one pass."""
        assert st.chain is not None and self.ctx is not None
        prefixes, digests = self.ctx.prefixes, st.chain.digests
        keys = {a: prefixes[(a[0], a[1])] + digests[a[2] - 1].hex() for a in asks}
        known = self.index.get_many(keys.values())
        tier = getattr(self.tiers, "host_tier", None)
        if tier is not None:
            known = host_first(tier, self.index, keys, known, lambda a: prefixes[(a[0], 0)] + digests[a[2] - 1].hex(),
                               self._host_asks)
        for (a, key), v in zip(keys.items(), known, strict=True):
            yield a, key, v

    def _probe_local(
        self, st: RequestState, asks: set[Ask], listing: Listing, picked: dict[Ask, _Pick]
    ) -> dict[Ask, Span | None]:
        """Answer asks from the key index, else the listing (noting which came from the listing)."""
        assert st.chain is not None and self.ctx is not None
        out: dict[Ask, Span | None] = {}
        digests = st.chain.digests
        find = listing.find
        for a, key, v in self._indexed(st, asks):
            grp, shard, end = a
            if v is MISSING:
                out[a] = None
            elif v is not None:
                out[a] = Span(v.first, v.end)  # type: ignore[union-attr]
            else:
                got = find(grp, shard, digests[end - 1], end)
                if got is None:
                    out[a] = None
                else:
                    out[a] = Span(end - got[0], end)
                    picked[a] = (key, got[1])
        return out

    def _loaded_picks(self, st: RequestState, cand: LookupResult, picked: dict[Ask, _Pick]) -> dict[str, Ask]:
        """key -> ask of every listed object the candidate hit would load."""
        assert self.ctx is not None
        g = self.ctx.geometry
        h, d, tpb = cand.h_blocks, st.load.d_blocks, g.tokens_per_block
        todo: dict[str, Ask] = {}
        for grp in g.groups:
            lo, hi = required_range(grp, tpb, d, h, self.settings.window_margin_blocks)
            if hi <= lo:
                continue
            for shard in range(g.tp_size):
                for end, span in cand.coverage.get((grp.group_id, shard), {}).items():
                    a = (grp.group_id, shard, end)
                    if a in picked and span.first < hi and span.end > lo:
                        todo[picked[a][0]] = a
        return todo

    def _verify(
        self, st: RequestState, cand: LookupResult, todo: dict[str, Ask], picked: dict[Ask, _Pick]
    ) -> tuple[LookupResult | None, str]:
        """HEAD (one wave) every listed object the candidate hit would load (``todo``): the hit
        with only confirmed objects in its coverage, or None if the store refuted any; and how
        the wave went: "ok", "refuted", "skipped" (no wave: out of time, busy, failed), or "local"
        (nothing listed to load: the key index answered it all)."""
        assert self.ctx is not None
        g = self.ctx.geometry
        h, d = cand.h_blocks, st.load.d_blocks
        result = LookupResult(
            h, coverage={k: dict(v) for k, v in cand.coverage.items()}, asks=len(todo), spine_blocks=cand.spine_blocks
        )
        # Only confirmed spans may reach a plan: drop every listed answer, re-add what the HEADs say.
        for a in picked:
            result.coverage.get((a[0], a[1]), {}).pop(a[2], None)
        if todo:
            asked = self.index.now()
            try:
                batch = self._head_wave(todo)
            except (_LookupTimeout, _LookupBusy) as e:
                self._note_skipped(st, e)
                return LookupResult(d, waves=1 if isinstance(e, _LookupTimeout) else 0, asks=len(todo)), "skipped"
            except StoreError as e:
                self.stats.lookup_errors += 1
                self.decision = "error"
                log.warning("s3kv: lookup verify wave failed (%s); treating as miss", e,
                            extra={"request_id": st.request_id})
                return LookupResult(d, waves=1, asks=len(todo)), "skipped"
            result.waves = 1
            spans = self._absorb(todo, batch, asked)
            for a in todo.values():
                got = spans.get(a)
                want = cand.coverage[(a[0], a[1])][a[2]]
                if got is None or got != want:
                    return None, "refuted"
                result.coverage.setdefault((a[0], a[1]), {})[a[2]] = got
        if not servable(g, result.coverage, d, h, self.settings.window_margin_blocks):
            return None, "refuted"
        return result, "ok" if todo else "local"

    def _note_skipped(self, st: RequestState, e: BaseException) -> None:
        if isinstance(e, _LookupBusy):
            self.stats.lookup_busy += 1
            self.decision = "busy"
            log.warning("s3kv: lookup of request %s skipped: %d earlier HEAD waves still running; a miss",
                        st.request_id, self.pending_waves, extra={"request_id": st.request_id})
        elif not self._timed_out:
            self._timed_out = True
            self.decision = "ran_out"
            self.stats.lookup_timeouts += 1
            # A warning when it waited as long as any lookup may (a slow store); a short budget
            # running out is the rule at work (a small hit was not worth a longer wait), and a
            # wave held back because the store is slow lately waited for nothing (``_hopeless``).
            waited = not e.args
            log.log(logging.WARNING if waited and self.budget_s >= self._max_budget_s() else logging.DEBUG,
                    "s3kv: lookup of request %s ran out of its %.3f s budget (%d tokens to save); a miss",
                    st.request_id, self.budget_s, self.saveable_tokens, extra={"request_id": st.request_id})

    def _split(
        self, st: RequestState, asks: set[Ask], trust_index: bool
    ) -> tuple[dict[Ask, Span | None], dict[str, Ask]]:
        """(what the index answers, key -> ask of what it does not)."""
        out: dict[Ask, Span | None] = {}
        todo: dict[str, Ask] = {}
        for a, key, v in self._indexed(st, asks):
            if v is MISSING:
                out[a] = None
            elif v is not None and (trust_index or a in self._host_asks):  # host memory needs no store
                out[a] = Span(v.first, v.end)  # type: ignore[union-attr]
            else:
                todo[key] = a
        return out, todo

    def _probe(self, st: RequestState, asks: set[Ask]) -> dict[Ask, Span | None]:
        assert st.chain is not None and self.ctx is not None
        # With the store in doubt (breaker not closed), a remembered object is no
        # promise: ask the store, which fails fast while open (a miss) and whose
        # answer closes a half-open breaker before anything is promised.
        out, todo = self._split(st, asks, self.store.available)
        self._last_probe_used_network = bool(todo)
        if not todo:
            return out
        asked = self.index.now()
        try:
            batch = self._head_wave(todo)
        except (_LookupTimeout, _LookupBusy) as e:
            self._note_skipped(st, e)
            return {**out, **{a: None for a in todo.values()}}
        except StoreError as e:
            # A store error during lookup is a miss, never an exception.
            self.stats.lookup_errors += 1
            self.decision = self.decision or "error"
            log.warning("s3kv: lookup HEAD wave failed (%s); treating as miss", e,
                        extra={"request_id": st.request_id})
            return {**out, **{a: None for a in todo.values()}}
        return {**out, **self._absorb(todo, batch, asked)}

    def _expect(self, todo: dict[str, Ask]) -> dict[str, SpanExpect]:
        """What each key's answer must say (``_absorb``'s check), for a store that checks answers
        where they arrive (HEAD helper processes; they leave integrity keys in this process)."""
        assert self.ctx is not None
        ids = self.ctx.identities
        return {k: (ids[(a[0], a[1])], a[2]) for k, a in todo.items()}

    def _head_wave(self, todo: dict[str, Ask]) -> HeadBatch:
        """One HEAD wave within what is left of the lookup's budget.

        Past the budget the wave keeps running on its thread and, when it ends,
        feeds the index, so the next lookup of this prefix is answered locally.
        """
        keys = list(todo)
        expect = self._expect(todo)
        if self._deadline == math.inf:
            return self.store.head_many_checked(keys, expect)
        remaining = self._deadline - time.monotonic()
        # Less left than half of what waves take lately: it would almost surely run out, so spend
        # none of the scheduler's time on it -- the lookup is finished in the background all the
        # same (a repeat of the prefix then hits from the index). A short prompt at 30 ms a
        # request otherwise stalled its whole few-ms budget for a certain miss.
        if remaining <= 0 or self._timed_out or (remaining < self._wave_s / 2 and not self._promise):
            self._last_probe_used_network = False  # nothing sent: not a round trip
            raise _LookupTimeout
        if not self._promise and self._hopeless(remaining):
            # Slower lately than what is left, every one of the last waves: a store that answers
            # slowly but never fails cost every lookup its whole budget, forever (500 ms at the
            # cap; its uploads kept succeeding, so the breaker never opened -- issue 37). The wave
            # goes to the background instead (when the backlog has room): it warms the index for
            # the next lookup of the prefix, and its time tells when the store is fast again.
            self._last_probe_used_network = False
            self._background_wave(keys, expect, dict(todo))
            raise _LookupTimeout("slow")
        with self._pending_lock:
            # Bounded backlog: waves that outlived their lookup still hold the pool. A store that
            # hangs must cost each lookup nothing more, not queue waves without end.
            if self.pending_waves >= max(1, self.settings.lookup_max_pending):
                self._last_probe_used_network = False
                raise _LookupBusy
            self.pending_waves += 1
        pool = self._lookup_pool()
        asks = dict(todo)
        timed_out = [False]
        sent, asked = time.monotonic(), self.index.now()

        def done(f: Future) -> None:
            self._note_wave(time.monotonic() - sent)
            with self._pending_lock:
                self.pending_waves -= 1
            if timed_out[0] and not f.cancelled() and f.exception() is None:
                # A late answer still warms the index: the next lookup of this prefix is local.
                self._absorb(asks, f.result(), asked, count=False)

        fut = pool.submit(self.store.head_many_checked, keys, expect)
        try:
            return fut.result(timeout=remaining)
        except FutureTimeout:
            timed_out[0] = True
            self._late_wave = fut
            # A hung store never fails a call, so count the timeout where health is judged -- when
            # the lookup waited as long as any may (the cap). A shorter budget ran out because its
            # hit was not worth a longer wait: a short prompt at 30 ms a request does so on a
            # healthy store, and counted, a few in a row would open the breaker on it.
            if self.budget_s >= self._max_budget_s():
                self.store.note_timeout("head")
            raise _LookupTimeout from None
        finally:
            fut.add_done_callback(done)

    def _lookup_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=max(1, self.settings.lookup_max_pending), thread_name_prefix="s3kv-lookup"
            )
        return self._pool

    def _note_wave(self, seconds: float) -> None:
        """A wave's wall time into the moving average. At most the cap: after a hang the average
        must not make every later lookup give up before sending (the background waves, which
        still run, bring it back down). Uncapped into the recent waves (``_hopeless``)."""
        with self._pending_lock:
            self._recent_waves.append(seconds)
            seconds = min(seconds, self._max_budget_s())
            self._wave_s = seconds if self._wave_s == 0.0 else 0.8 * self._wave_s + 0.2 * seconds

    def _hopeless(self, remaining: float) -> bool:
        """Whether even the fastest of the last waves (at least ``_RECENT_MIN`` of them) took longer
        than ``remaining``: such a wave would almost surely run out. Noted once per episode."""
        with self._pending_lock:
            recent = list(self._recent_waves)
        slow = len(recent) >= _RECENT_MIN and min(recent) > remaining
        if slow and not self._slow:
            log.warning("s3kv: HEAD waves took %.2f-%.2f s lately, longer than a lookup's %.3f s: lookups "
                        "wave in the background (a miss now, the index warmed for the next) until the store "
                        "answers faster", min(recent), max(recent), remaining)
        self._slow = slow
        return slow

    def _background_wave(self, keys: list[str], expect: dict[str, SpanExpect], asks: dict[str, Ask]) -> None:
        """Send a wave nobody waits for (when the backlog has room); its answers feed the index."""
        with self._pending_lock:
            if self.pending_waves >= max(1, self.settings.lookup_max_pending):
                return
            self.pending_waves += 1
        pool = self._lookup_pool()
        sent, asked = time.monotonic(), self.index.now()

        def done(f: Future) -> None:
            self._note_wave(time.monotonic() - sent)
            with self._pending_lock:
                self.pending_waves -= 1
            if not f.cancelled() and f.exception() is None:
                self._absorb(asks, f.result(), asked, count=False)

        try:
            fut = pool.submit(self.store.head_many_checked, keys, expect)
        except RuntimeError:  # the pool was shut down (closing)
            with self._pending_lock:
                self.pending_waves -= 1
            return
        self._late_wave = fut
        fut.add_done_callback(done)

    def _finish_late(
        self, st: RequestState, full_blocks: int, hmax: int,
        on_done: Callable[[LookupResult | None], None] | None = None,
    ) -> bool:
        """Run a probe lookup that ran out of its budget to its end in the background: every
        wave, no budget, answers into the index only (nothing is offered from it).

        Why: the budget cuts a long prompt's lookup after its first or second wave, and only the
        wave in flight finishes by itself. The next lookup of the prefix (the request's next
        turn, another request sharing it) would then pay the remaining waves on the scheduler's
        path and could run out again; finished here, it is answered from the index. It starts
        once the wave that ran out has ended and been absorbed (no HEAD asked twice; a store
        that hangs or fails gets no more work) and counts in ``lookup_max_pending``. ``on_done``
        gets what it found (None: it did not run), instead of counting it as a finished lookup.
        """
        ctx, pool, late = self.ctx, self._lookup_pool(), self._late_wave
        if ctx is None:
            return False
        d = st.load.d_blocks

        def run() -> None:
            found = None
            try:
                found = find_hit(ctx.geometry, ctx.params, d, full_blocks, hmax, lambda a: self._probe_late(st, a))
                if on_done is None:
                    with self._pending_lock:
                        self.stats.lookups_finished_late += 1
            except Exception:  # noqa: BLE001 - background warming must never fail anything
                log.debug("s3kv: finishing request %s's lookup in the background failed", st.request_id,
                          exc_info=True)
            finally:
                with self._pending_lock:
                    self.pending_waves -= 1
                if on_done is not None:
                    on_done(found)

        def start(f: Future | None = None) -> None:
            ran = False
            if f is None or not (f.cancelled() or f.exception() is not None):  # else the store failed that wave
                with self._pending_lock:
                    # the backlog bound holds for this too
                    if self.pending_waves < max(1, self.settings.lookup_max_pending):
                        self.pending_waves += 1
                        ran = True
            if ran:
                try:
                    pool.submit(run)
                    return
                except RuntimeError:  # the pool was shut down (closing)
                    with self._pending_lock:
                        self.pending_waves -= 1
            if on_done is not None:
                on_done(None)

        if late is None:  # the budget ran out between two waves: nothing in flight
            start()
        else:
            late.add_done_callback(start)  # after the wave's own callback has absorbed it
        return True

    def _probe_late(self, st: RequestState, asks: set[Ask]) -> dict[Ask, Span | None]:
        """``_probe`` for :meth:`_finish_late`: no budget, no foreground state, nothing counted."""
        out, todo = self._split(st, asks, trust_index=True)
        if todo:
            try:
                # Checked where the answers arrive, as the foreground waves are: this runs beside
                # the executor thread, and every answer checked here holds its GIL.
                sent, asked = time.monotonic(), self.index.now()
                batch = self.store.head_many_checked(list(todo), self._expect(todo))
                self._note_wave(time.monotonic() - sent)
            except StoreError:
                return {**out, **{a: None for a in todo.values()}}
            out.update(self._absorb(todo, batch, asked, count=False))
        return out

    def _absorb(self, todo: dict[str, Ask], batch: HeadBatch, asked: float, *, count: bool = True
                ) -> dict[Ask, Span | None]:
        """HEAD answers of a wave sent at ``asked`` (the index's clock) -> spans (foreign objects
        rejected) and the index, where a "missing" never hides what was learnt present since
        (``KeyIndex.put_many``: the wave raced an upload of this engine)."""
        assert self.ctx is not None
        out: dict[Ask, Span | None] = {}
        present: list[tuple[str, ObjectSpan]] = []
        missing: list[str] = []
        believable = self.listings.believable(
            {k: i.last_modified for k, i in batch.found.items() if i.last_modified is not None}
        )
        for key, a in todo.items():
            info = batch.found.get(key)
            left = believable.get(key, math.inf)
            if info is not None:
                try:
                    # The key names the object ending at block a[2]: its span must end there. A
                    # span already set was checked the same way where the answer arrived
                    # (``_expect``: this identity, this end).
                    span = info.span or span_from_metadata(self.ctx.identities[(a[0], a[1])], info.metadata,
                                                           info.size, key, end=a[2])
                except ObjectFormatError as e:
                    if count:
                        self.stats.foreign_objects += 1
                        self.stats.rejected[e.reason] = self.stats.rejected.get(e.reason, 0) + 1
                    log.warning("s3kv: ignoring object: %s", e)
                    out[a] = None
                    continue
                if left > 0:
                    present.append((key, span))
                elif count:
                    # Good for this lookup (its load follows at once), but gc may delete it any
                    # moment (``Listings.believable``): nothing remembered -- a later lookup asks
                    # again rather than promise a load on a memory the object may not outlive. (Not
                    # a miss: without gc, or before its next pass, the load finds it and refreshes it.)
                    self.stats.old_objects += 1
                out[a] = Span(span.first, span.end)
            elif key in batch.failed:
                if count:
                    self.stats.lookup_errors += 1
                out[a] = None
            else:
                missing.append(key)
                out[a] = None
        self.index.put_many(present, missing, asked_at=asked, believable=believable)
        return out
