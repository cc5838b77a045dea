"""Scheduler-side logic: what a request can be served, and what gets saved when.

``LeaderCore`` speaks in plain values (token lists, ordinal->slot lists,
``RequestData``-shaped reports) and emits ``plan.ConnectorMetadata``. The
TensorRT-LLM adapter only translates engine objects into these calls. The only
I/O is the lookup's HEAD waves, through the store and the local index.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..core.errors import PlanMismatch
from ..core.hitrule import Span, required_range, servable
from ..core.keys import Chain, KeyScheme, NotCacheable, chain_root, namespace_digest
from ..core.layout import CacheGeometry
from ..core.lookup import Ask, LookupParams, LookupResult, find_hit
from ..core.objects import ObjectFormatError, ObjectIdentity, span_from_metadata
from ..core.plan import BufferId, ConnectorMetadata, FinishPlan, LoadOp, ObjectRef, SealOp, StageOp
from ..core.policy import StoragePolicy, object_sizes
from ..store.base import HeadBatch, ObjectStore, StoreError
from .index import MISSING, KeyIndex
from .summary import NamespaceSummary, SummaryGroup

log = logging.getLogger("s3kv.leader")


def _group_lists(by_group: Any, num_groups: int) -> list[list[int]]:
    """Per-group page lists as a list indexed by group id.

    The merged API passes a list; one V2 branch passes a dict keyed by group id.
    Both name the group explicitly, so both are accepted; anything else is empty.
    """
    if not by_group:
        return []
    if isinstance(by_group, dict):
        return [list(by_group.get(g, ())) for g in range(num_groups)]
    return [list(x) for x in by_group]


class _LookupTimeout(Exception):
    """The lookup's HEAD budget ran out (a miss)."""


class _LookupBusy(Exception):
    """Too many timed-out HEAD waves still run in the background: skip the network (a miss)."""


@dataclass
class _Buffer:
    bid: BufferId
    count: int = 0  # pages staged
    sealed: int = 0  # pages covered by the last seal


@dataclass
class _Request:
    request_id: int
    root: bytes | None  # None: not cacheable
    chain: Chain | None
    tokens: list[int]
    prompt_len: int
    d_blocks: int = 0
    h_blocks: int = 0  # served history after honour (device match + connector)
    offered_blocks: int = 0
    load_async: bool = False
    coverage: dict[tuple[int, int], dict[int, Span]] = field(default_factory=dict)
    slots: list[list[int]] = field(default_factory=list)
    reported: bool = False
    completed: int = 0  # blocks whose completion has been planned
    save_from: int = 0
    open: dict[int, _Buffer] = field(default_factory=dict)
    #: Sliding groups: the block that most recently left the window during decode.
    evicted: dict[int, _Buffer] = field(default_factory=dict)
    kv_tokens: int = 0  # tokens whose KV exists on the device
    pending_loads: list[LoadOp] = field(default_factory=list)
    pending_stages: list[StageOp] = field(default_factory=list)
    pending_seals: list[SealOp] = field(default_factory=list)
    pending_releases: list[BufferId] = field(default_factory=list)
    #: The finish plan the workers hold for this request (the last one sent).
    finish_sent: FinishPlan | None = None
    #: An async load was promised and the request has not been reported since (still parked).
    parked: bool = False
    #: The next metadata must declare this request's async load (even with nothing to load).
    declare_async: bool = False
    #: time.monotonic() of the last call about it (state of requests the engine forgot expires).
    seen: float = 0.0
    #: How far the lookup saw the full-attention chain stored (``LookupResult.spine_blocks``).
    spine_blocks: int = 0
    #: Branch-point tail: its end ordinal (0: none) and, per sliding group, its buffer while open.
    branch_end: int = 0
    branch_open: dict[int, _Buffer] = field(default_factory=dict)
    #: Per sliding group: next ordinal of the branch tail to stage.
    branch_next: dict[int, int] = field(default_factory=dict)
    #: Bumped when the engine re-sends the whole page lists (a first report).
    lists_epoch: int = 0
    #: The last finish plan computed and what it was computed from (see ``_finish_plan``).
    finish_memo: tuple[Any, FinishPlan] | None = None


@dataclass
class LeaderStats:
    lookups: int = 0
    #: Prompt tokens of every request asked about (replays counted once).
    prompt_tokens: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_waves: int = 0
    lookup_asks: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
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
    #: Finished requests whose finish plan copied pages the engine no longer listed (see _check_live).
    finish_plan_mismatches: int = 0
    #: Requests reported without a lookup (no full identity): never saved.
    unkeyed_not_saved: int = 0
    #: Device matches ending inside a block (partial reuse): no S3 hit possible.
    partial_block_misses: int = 0
    requests_expired: int = 0
    loads_cancelled_by_engine: int = 0
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
    #: token (``s3kv.cost``).
    tokens_saved: int = 0
    #: Branch-point tails planned (one per sliding group and request) and the pages they hold.
    branch_tails: int = 0
    branch_tail_pages: int = 0
    #: Branch-point tails abandoned: a page of the tail was gone before it could be staged.
    branch_tails_abandoned: int = 0


class LeaderCore:
    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        key_prefix: str,
        *,
        tp_size: int,
        model_id: str,
        kv_dtype: str,
        index: KeyIndex | None = None,
        geometry: CacheGeometry | Callable[[], CacheGeometry | None] | None = None,
        on_lookup: Callable[[int, LookupResult], None] | None = None,
        sizing_page_bytes: Sequence[int] | None = None,
        failed_load_hook: bool = False,
    ):
        """``sizing_page_bytes`` (per group) replaces the real page sizes when choosing
        blocks per object -- for benchmarks that store tiny pages but model a real
        model's object structure."""
        self.settings = settings
        # A sync load that fails has no safe outcome unless the engine can be told to recompute
        # the request (a failed-load hook); without one every load is async, so a failure can
        # keep the request parked instead of serving unverified KV.
        self.load_async = settings.load_mode == "async" or not failed_load_hook
        self.store = store
        self.key_prefix = key_prefix
        self.tp_size = tp_size
        self.model_id = model_id
        self.kv_dtype = kv_dtype
        self.index = index if index is not None else KeyIndex(
            settings.index_max_entries, settings.index_ttl_s, settings.negative_ttl_s
        )
        self._geometry_source = geometry
        self._geometry: CacheGeometry | None = None
        self._requests: dict[int, _Request] = {}
        self._discards: set[int] = set()
        self._failed_promises: set[int] = set()
        self._iteration = 0
        self._lock = threading.Lock()
        self._on_lookup = on_lookup
        self._sizing_page_bytes = list(sizing_page_bytes) if sizing_page_bytes else None
        self._lookup_pool: ThreadPoolExecutor | None = None
        self._lookup_deadline = float("inf")
        self._timed_out = False
        self._pending_waves = 0  # HEAD waves submitted to the lookup pool and not finished
        self._pending_lock = threading.Lock()
        self._summary: NamespaceSummary | None = None
        self.stats = LeaderStats()

    # ------------------------------------------------------------------ geometry
    @property
    def geometry(self) -> CacheGeometry | None:
        if self._geometry is None:
            src = self._geometry_source
            g = src() if callable(src) else src
            if g is not None:
                self._set_geometry(g)
        return self._geometry

    def _set_geometry(self, g: CacheGeometry) -> None:
        if g.tp_size != self.tp_size:
            raise ValueError(f"geometry tp_size {g.tp_size} != leader tp_size {self.tp_size}")
        self._geometry = g
        self.namespace = namespace_digest(g, tagged=self.settings.integrity is not None)
        self.scheme = KeyScheme(self.key_prefix, self.namespace, g.tp_size)
        sizing = self._sizing_page_bytes or [x.page_bytes for x in g.groups]
        self.group_blocks, cp_blocks = object_sizes(sizing, g.tokens_per_block, self.settings)
        self.bpo = self.group_blocks[g.spine_group]
        self.policy = StoragePolicy(
            g, self.bpo, cp_blocks, self.settings.storage_policy, self.settings.window_margin_blocks,
            group_blocks=self.group_blocks, branch_tails=self.settings.branch_tails,
        )
        self.params = LookupParams(
            blocks_per_object=self.bpo,
            checkpoint_blocks=cp_blocks,
            margin=self.settings.window_margin_blocks,
            budget=self.settings.lookup_probe_budget,
            group_blocks=self.group_blocks,
        )
        self._identities = {
            (grp.group_id, s): ObjectIdentity(
                self.namespace, grp.fingerprint, s, g.tp_size, g.tokens_per_block, grp.page_bytes,
                self.settings.integrity, grp.window,
            )
            for grp in g.groups
            for s in range(g.tp_size)
        }
        log.info(
            "s3kv geometry: %d groups (%s), tpb=%d, tp=%d, blocks/object %s, checkpoints every %d blocks, ns=%s",
            g.num_groups,
            ", ".join(f"g{x.group_id}:w={x.window or 'full'},{x.page_bytes}B" for x in g.groups),
            g.tokens_per_block,
            g.tp_size,
            self.group_blocks,
            cp_blocks,
            self.namespace.hex()[:12],
        )

    # ------------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(
        self,
        request_id: int,
        tokens: Sequence[int],
        prompt_len: int,
        num_computed_tokens: int,
        *,
        cache_salt: Any = None,
        lora_id: int | None = None,
        multimodal_hashes: Sequence[Any] | None = None,
        has_multimodal: bool = False,
        store_available: bool = True,
    ) -> tuple[int, bool]:
        with self._lock:
            old = self._requests.pop(request_id, None)
            if old is not None:
                # A replay: the engine re-allocates from scratch; whatever we staged is stale.
                self._discards.add(request_id)
            else:
                # The denominator of "share of prompt tokens served from S3" (once per request).
                self.stats.prompt_tokens += int(prompt_len)
            g = self.geometry
            # One copy (a list's slice is already one); the request's token list is ours to extend.
            prompt = tokens[:prompt_len] if isinstance(tokens, list) else list(tokens[:prompt_len])
            if g is None:
                log.warning("s3kv: no KV cache layout registered yet; request %s is a miss", request_id,
                            extra={"request_id": request_id})
                self._requests[request_id] = _Request(request_id, None, None, prompt, prompt_len)
                return 0, False
            try:
                root = chain_root(
                    self.namespace,
                    cache_salt=cache_salt,
                    lora_id=lora_id,
                    multimodal_hashes=multimodal_hashes,
                    has_multimodal=has_multimodal,
                )
            except NotCacheable as e:
                self.stats.not_cacheable += 1
                log.info("s3kv: request %s not cached: %s", request_id, e, extra={"request_id": request_id})
                self._requests[request_id] = _Request(request_id, None, None, prompt, prompt_len)
                return 0, False
            chain = Chain(root, g.tokens_per_block)
            chain.extend_to(prompt)
            st = _Request(request_id, root, chain, prompt, prompt_len, seen=time.monotonic())
            self._requests[request_id] = st
            tpb = g.tokens_per_block
            st.d_blocks = num_computed_tokens // tpb
            st.h_blocks = st.d_blocks
            self.stats.lookups += 1
            if num_computed_tokens % tpb or not store_available:
                # A device match that ends mid-block (partial reuse) leaves nothing whole to
                # append to: an S3 load must start on a block boundary.
                self.stats.misses += 1
                if num_computed_tokens % tpb:
                    self.stats.partial_block_misses += 1
                return 0, False
            hmax = (prompt_len - 1) // tpb
            budget = self.settings.lookup_timeout_s
            self._lookup_deadline = time.monotonic() + budget if budget > 0 else float("inf")
            self._timed_out = False
            result = self._lookup(st, g, prompt_len // tpb, hmax)
            self.stats.lookup_waves += result.waves
            self.stats.lookup_asks += result.asks
            st.spine_blocks = result.spine_blocks
            if self._on_lookup:
                self._on_lookup(request_id, result)
            gain = result.h_blocks - st.d_blocks
            if gain < self.settings.min_hit_blocks:
                self.stats.misses += 1
                return 0, False
            st.coverage = result.coverage
            st.offered_blocks = gain
            st.load_async = self.load_async
            self.stats.hits += 1
            log.debug(
                "s3kv: request %s hit %d of %d tokens (%d waves, %d asks)",
                request_id, gain * tpb, prompt_len, result.waves, result.asks,
                extra={"request_id": request_id, "hit_tokens": gain * tpb, "prompt_tokens": prompt_len},
            )
            return gain * tpb, st.load_async

    _last_probe_used_network = False

    def _lookup(self, st: _Request, g: CacheGeometry, full_blocks: int, hmax: int) -> LookupResult:
        """The largest servable history: from the namespace summary when one is ready (a miss
        costs no request, a hit one verify wave), else by probing with HEAD waves."""
        summary = self._summary_snapshot(g)
        waves = asks = 0
        if summary is not None:
            picked: dict[Ask, str] = {}
            cand = find_hit(
                g, self.params, st.d_blocks, full_blocks, hmax,
                lambda a: self._probe_local(st, a, summary, picked),
                count_wave=lambda a: False,
            )
            if cand.h_blocks - st.d_blocks < self.settings.min_hit_blocks:
                self.stats.lookup_summary_misses += 1
                return cand
            trust = self.settings.lookup_summary_trust_s
            if trust > 0 and self._summary is not None and self._summary.age_s() <= trust:
                # A listing this fresh is the store's own answer, as a HEAD's is for the index.
                self.stats.lookup_summary_hits += 1
                return cand
            verified = self._verify(st, g, cand, picked)
            if verified is not None:  # confirmed, or a miss because the wave failed / timed out
                if verified.h_blocks > st.d_blocks:
                    self.stats.lookup_summary_hits += 1
                return verified
            # A refuted candidate: the summary is stale here. The verify wave's answers are in
            # the index now; probe what is left of the budget.
            self.stats.lookup_summary_stale += 1
            waves, asks = 1, len(picked)
        result = find_hit(
            g,
            self.params,
            st.d_blocks,
            full_blocks,
            hmax,
            lambda a: self._probe(st, a),
            count_wave=lambda a: self._last_probe_used_network,
        )
        result.waves += waves
        result.asks += asks
        return result

    def _summary_snapshot(self, g: CacheGeometry) -> Any:
        """The namespace summary's current snapshot, or None (off, not ready, or store in doubt)."""
        summary = self.lookup_summary()
        if summary is None or not self.store.available:
            return None
        return summary.start().snapshot()

    def lookup_summary(self) -> NamespaceSummary | None:
        """The namespace summary (made on first use; its refresher starts with the first
        lookup), or None when ``lookup_summary_s`` is 0 or the layout is not known yet.
        Call ``.refresh()`` on it to have a snapshot before the first lookup."""
        g = self.geometry
        if self.settings.lookup_summary_s <= 0 or g is None:
            return None
        if self._summary is None:
            groups = {x.fingerprint: SummaryGroup(x.group_id, x.page_bytes) for x in g.groups}
            self._summary = NamespaceSummary(
                self.store,
                self.scheme,
                groups,
                interval_s=self.settings.lookup_summary_s,
                max_objects=self.settings.lookup_summary_max_objects,
            )
            # The refresher holds no reference to the leader; it stops when the leader goes.
            weakref.finalize(self, self._summary.stop)
        return self._summary

    def close_lookup(self) -> None:
        """Stop the lookup's background work (summary refresher, pool). Idempotent."""
        if self._summary is not None:
            self._summary.stop()
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)

    def _key_prefixes(self) -> dict[tuple[int, int], str]:
        """(group, shard) -> the key prefix its objects share (``scheme.object_key`` less the
        digest), built once: a lookup names hundreds of keys on the scheduling path."""
        g = self._geometry
        assert g is not None
        cached = getattr(self, "_prefix_cache", None)
        if cached is None or cached[0] is not self.scheme:
            table = {
                (grp.group_id, s): self.scheme.group_prefix(grp.fingerprint, s)
                for grp in g.groups
                for s in range(g.tp_size)
            }
            cached = (self.scheme, table)
            self._prefix_cache = cached
        return cached[1]

    def _probe_local(
        self, st: _Request, asks: set[Ask], summary: Any, picked: dict[Ask, str]
    ) -> dict[Ask, Span | None]:
        """Answer asks from the index, else the summary (noting which came from the summary)."""
        assert st.chain is not None and self._geometry is not None
        out: dict[Ask, Span | None] = {}
        prefixes = self._key_prefixes()
        digests = st.chain.digests
        index_get = self.index.get
        for a in asks:
            grp, shard, end = a
            digest = digests[end - 1]
            key = prefixes[(grp, shard)] + digest.hex()
            v = index_get(key)
            if v is MISSING:
                out[a] = None
            elif v is not None:
                out[a] = Span(v.first, v.end)  # type: ignore[union-attr]
            else:
                count = summary.get((grp, shard), {}).get(digest)
                if count is None or count > end:
                    out[a] = None
                else:
                    out[a] = Span(end - count, end)
                    picked[a] = key
        return out

    def _verify(
        self, st: _Request, g: CacheGeometry, cand: LookupResult, picked: dict[Ask, str]
    ) -> LookupResult | None:
        """HEAD (one wave) every summary-derived object the candidate hit would load; the hit
        with only confirmed objects in its coverage, or None if the store refuted any."""
        h, d, tpb = cand.h_blocks, st.d_blocks, g.tokens_per_block
        todo: dict[str, Ask] = {}
        for grp in g.groups:
            lo, hi = required_range(grp, tpb, d, h, self.settings.window_margin_blocks)
            if hi <= lo:
                continue
            for shard in range(g.tp_size):
                for end, span in cand.coverage.get((grp.group_id, shard), {}).items():
                    a = (grp.group_id, shard, end)
                    if a in picked and span.first < hi and span.end > lo:
                        todo[picked[a]] = a
        result = LookupResult(
            h, coverage={k: dict(v) for k, v in cand.coverage.items()}, asks=len(todo), spine_blocks=cand.spine_blocks
        )
        # Only confirmed spans may reach a plan: drop every summary answer, re-add what the HEADs say.
        for a in picked:
            result.coverage.get((a[0], a[1]), {}).pop(a[2], None)
        if todo:
            try:
                batch = self._head_wave(todo)
            except (_LookupTimeout, _LookupBusy) as e:
                self._note_skipped(st, e)
                return LookupResult(d, waves=1 if isinstance(e, _LookupTimeout) else 0, asks=len(todo))
            except StoreError as e:
                self.stats.lookup_errors += 1
                log.warning("s3kv: lookup verify wave failed (%s); treating as miss", e,
                            extra={"request_id": st.request_id})
                return LookupResult(d, waves=1, asks=len(todo))
            result.waves = 1
            spans = self._absorb(todo, batch)
            for a in todo.values():
                got = spans.get(a)
                want = cand.coverage[(a[0], a[1])][a[2]]
                if got is None or got != want:
                    return None
                result.coverage.setdefault((a[0], a[1]), {})[a[2]] = got
        if not servable(g, result.coverage, d, h, self.settings.window_margin_blocks):
            return None
        return result

    def _note_skipped(self, st: _Request, e: BaseException) -> None:
        if isinstance(e, _LookupBusy):
            self.stats.lookup_busy += 1
            log.warning("s3kv: lookup of request %s skipped: %d earlier HEAD waves still running; a miss",
                        st.request_id, self._pending_waves, extra={"request_id": st.request_id})
        elif not self._timed_out:
            self._timed_out = True
            self.stats.lookup_timeouts += 1
            log.warning("s3kv: lookup of request %s ran out of its %.3f s budget; a miss",
                        st.request_id, self.settings.lookup_timeout_s, extra={"request_id": st.request_id})

    def _probe(self, st: _Request, asks: set[Ask]) -> dict[Ask, Span | None]:
        assert st.chain is not None
        out: dict[Ask, Span | None] = {}
        todo: dict[str, Ask] = {}
        # With the store in doubt (breaker not closed), a remembered object is no
        # promise: ask the store, which fails fast while open (a miss) and whose
        # answer closes a half-open breaker before anything is promised.
        trust_index = self.store.available
        for a in asks:
            grp, shard, end = a
            key = self._key_prefixes()[(grp, shard)] + st.chain.digests[end - 1].hex()
            v = self.index.get(key)
            if v is MISSING:
                out[a] = None
            elif v is not None and trust_index:
                out[a] = Span(v.first, v.end)  # type: ignore[union-attr]
            else:
                todo[key] = a
        self._last_probe_used_network = bool(todo)
        if not todo:
            return out
        try:
            batch = self._head_wave(todo)
        except (_LookupTimeout, _LookupBusy) as e:
            self._note_skipped(st, e)
            return {**out, **{a: None for a in todo.values()}}
        except StoreError as e:
            # A store error during lookup is a miss, never an exception.
            self.stats.lookup_errors += 1
            log.warning("s3kv: lookup HEAD wave failed (%s); treating as miss", e,
                        extra={"request_id": st.request_id})
            return {**out, **{a: None for a in todo.values()}}
        return {**out, **self._absorb(todo, batch)}

    def _head_wave(self, todo: dict[str, Ask]) -> HeadBatch:
        """One HEAD wave within what is left of the lookup's budget.

        Past the budget the wave keeps running on its thread and, when it ends,
        feeds the index, so the next lookup of this prefix is answered locally.
        """
        keys = list(todo)
        if self._lookup_deadline == float("inf"):
            return self.store.head_many(keys)
        remaining = self._lookup_deadline - time.monotonic()
        if remaining <= 0 or self._timed_out:
            self._last_probe_used_network = False  # nothing sent: not a round trip
            raise _LookupTimeout
        with self._pending_lock:
            # Bounded backlog: waves that outlived their lookup still hold the pool. A store that
            # hangs must cost each lookup nothing more, not queue waves without end.
            if self._pending_waves >= max(1, self.settings.lookup_max_pending):
                self._last_probe_used_network = False
                raise _LookupBusy
            self._pending_waves += 1
        if self._lookup_pool is None:
            self._lookup_pool = ThreadPoolExecutor(
                max_workers=max(1, self.settings.lookup_max_pending), thread_name_prefix="s3kv-lookup"
            )
        asks = dict(todo)
        timed_out = [False]

        def done(f: Future) -> None:
            with self._pending_lock:
                self._pending_waves -= 1
            if timed_out[0] and not f.cancelled() and f.exception() is None:
                # A late answer still warms the index: the next lookup of this prefix is local.
                self._absorb(asks, f.result(), count=False)

        fut = self._lookup_pool.submit(self.store.head_many, keys)
        try:
            return fut.result(timeout=remaining)
        except FutureTimeout:
            timed_out[0] = True
            # A hung store never fails a call, so count the timeout where health is judged.
            self.store.note_timeout("head")
            raise _LookupTimeout from None
        finally:
            fut.add_done_callback(done)

    def _absorb(self, todo: dict[str, Ask], batch: HeadBatch, *, count: bool = True) -> dict[Ask, Span | None]:
        """HEAD answers -> spans (foreign objects rejected) and the index."""
        out: dict[Ask, Span | None] = {}
        for key, a in todo.items():
            info = batch.found.get(key)
            if info is not None:
                try:
                    # The key names the object ending at block a[2]: its span must end there.
                    span = span_from_metadata(self._identities[(a[0], a[1])], info.metadata, info.size, key,
                                              end=a[2])
                except ObjectFormatError as e:
                    if count:
                        self.stats.foreign_objects += 1
                        self.stats.rejected[e.reason] = self.stats.rejected.get(e.reason, 0) + 1
                    log.warning("s3kv: ignoring object: %s", e)
                    out[a] = None
                    continue
                self.index.put_present(key, span)
                out[a] = Span(span.first, span.end)
            elif key in batch.failed:
                if count:
                    self.stats.lookup_errors += 1
                out[a] = None
            else:
                self.index.put_missing(key)
                out[a] = None
        return out

    # ------------------------------------------------------------------ allocation
    def update_state_after_alloc(
        self, request_id: int, block_ids_by_group: Any, honoured_tokens: int | None = None
    ) -> None:
        """Plan the loads of what the engine honoured. Never raises.

        The engine may honour less than offered, or nothing (the async flag then
        still parks the request). A smaller honour is a smaller load when every
        group's pages for it are stored; when they are not (a sliding group's
        tail for that point was never stored) the promise cannot be kept and the
        request takes the failure rung (see docs/failures.md) -- never a page of
        garbage.
        """
        with self._lock:
            st = self._requests.get(request_id)
            g = self._geometry
            if st is None or g is None or st.root is None or st.offered_blocks == 0:
                return
            tpb = g.tokens_per_block
            # The engine parks an async request whatever it honoured: declare it so the workers
            # return its id (at once when there is nothing to load).
            st.parked = st.declare_async = st.load_async
            honoured = st.offered_blocks * tpb if honoured_tokens is None else int(honoured_tokens)
            if honoured < st.offered_blocks * tpb:
                self.stats.honoured_less += 1
            if honoured <= 0:
                st.h_blocks = st.d_blocks
                return
            if honoured % tpb or honoured > st.offered_blocks * tpb:
                st.h_blocks = st.d_blocks
                self._broken(st, f"the engine honoured {honoured} tokens of {st.offered_blocks * tpb} offered, "
                                 f"not a whole number of {tpb}-token blocks")
                return
            h = st.d_blocks + honoured // tpb
            st.h_blocks = h
            lists = _group_lists(block_ids_by_group, g.num_groups)
            if len(lists) != g.num_groups:
                self._broken(st, f"the engine reports {len(lists)} layer groups, the layout has {g.num_groups}")
                return
            margin = self.settings.window_margin_blocks
            if not servable(g, st.coverage, st.d_blocks, h, margin):
                # Honoured less than offered: a sliding group's tail for h lies below the tail the
                # lookup verified for the offer. Verify it now (the index answers the spine).
                try:
                    more = find_hit(g, self.params, st.d_blocks, st.prompt_len // tpb, h,
                                    lambda asks: self._probe(st, asks))
                except Exception as e:  # noqa: BLE001 - a failed re-check is a broken promise, not an error
                    log.warning("s3kv: re-checking request %s after a smaller honour failed: %s", request_id, e)
                    more = None
                if more is not None:
                    for key, spans in more.coverage.items():
                        st.coverage.setdefault(key, {}).update(spans)
                if more is None or more.h_blocks < h:
                    self._broken(st, f"the engine honoured {(h - st.d_blocks) * tpb} of the "
                                     f"{st.offered_blocks * tpb} tokens offered and the store holds no verified "
                                     f"sliding-window tail ending at block {h}")
                    return
                self.stats.honoured_less_served += 1
            try:
                st.pending_loads = self._plan_loads(st, lists)
            except PlanMismatch as e:
                self._broken(st, str(e))

    def _expire(self, now: float) -> None:
        """Forget requests the engine has not mentioned for ``request_state_ttl_s``.

        The engine reports every running request each iteration and calls request_finished
        at the end; a request that does neither for that long was dropped without telling
        us (an aborted admission, an engine bug). Its worker-side buffers are discarded.
        """
        ttl = self.settings.request_state_ttl_s
        if ttl <= 0:
            return
        for st in self._requests.values():
            if not st.seen:
                st.seen = now  # first sweep since it appeared without a report
        stale = [rid for rid, st in self._requests.items() if now - st.seen > ttl and not st.parked]
        for rid in stale:
            del self._requests[rid]
            self._discards.add(rid)
        if stale:
            self.stats.requests_expired += len(stale)
            log.warning("s3kv: forgot %d request(s) not seen for %.0f s: %s", len(stale), ttl, stale[:8])

    def cancel_load(self, request_id: int, start: int, end: int) -> None:
        """Engine hook (some V2 lines): the offered tokens ``[start, end)`` will not be consumed.

        Nothing was loaded yet (the commit follows), so this only shrinks what the leader plans
        for; a cancel that takes the whole offer before any commit forgets the request."""
        with self._lock:
            st = self._requests.get(request_id)
            g = self._geometry
            if st is None or g is None or not st.offered_blocks:
                return
            tpb = g.tokens_per_block
            keep = max(0, min(st.offered_blocks, (int(start) - st.d_blocks * tpb) // tpb))
            if int(end) >= (st.d_blocks + st.offered_blocks) * tpb:
                st.offered_blocks = keep
            self.stats.loads_cancelled_by_engine += 1

    def request_reset(self, request_id: int) -> None:
        """Engine hook (some V2 lines): the request's allocation died and it will be replayed;
        drop what was staged for it (the replay starts from a fresh lookup)."""
        with self._lock:
            if self._requests.pop(request_id, None) is not None:
                self._discards.add(request_id)

    def break_promise(self, request_id: int, reason: str) -> None:
        """The adapter's fallback when planning a load raised: the request takes the failure rung."""
        with self._lock:
            st = self._requests.get(request_id)
            if st is not None and st.offered_blocks:
                st.parked = st.load_async
                self._broken(st, reason)

    def fail_safe_meta(self) -> ConnectorMetadata:
        """Metadata after ``build_connector_meta`` itself failed: every load it would have carried
        is declared failed (the workers take the failure rung), nothing is saved this iteration."""
        with self._lock:
            self._iteration += 1
            async_ids: set[int] = set()
            for rid, st in self._requests.items():
                if st.pending_loads or st.declare_async:
                    if st.load_async:
                        async_ids.add(rid)
                    self._broken(st, "building the connector metadata failed")
                    st.declare_async = False
                st.pending_stages, st.pending_seals = [], []
            broken = frozenset(self._failed_promises)
            self._failed_promises.clear()
            return ConnectorMetadata(
                iteration=self._iteration, async_load_ids=frozenset(async_ids), failed_load_ids=broken
            )

    def _broken(self, st: _Request, reason: str) -> None:
        """A promise the leader cannot keep: the workers take the failure rung for it."""
        st.pending_loads = []
        st.declare_async = st.declare_async or st.load_async
        self._failed_promises.add(st.request_id)
        self.stats.promises_broken += 1
        log.error("s3kv: request %s: %s; the load cannot be served", st.request_id, reason,
                  extra={"request_id": st.request_id})

    def _plan_loads(self, st: _Request, lists: Sequence[Sequence[int]]) -> list[LoadOp]:
        g = self._geometry
        assert g is not None and st.chain is not None
        tpb = g.tokens_per_block
        ops: list[LoadOp] = []
        for grp in g.groups:
            gid = grp.group_id
            slots = lists[gid]
            lo, _hi = required_range(grp, tpb, st.d_blocks, st.h_blocks, self.settings.window_margin_blocks)
            by_end: dict[int, list[tuple[int, int]]] = {}
            for o in range(st.d_blocks, st.h_blocks):
                slot = slots[o] if o < len(slots) else -1
                if slot < 0:
                    if o >= lo and not grp.is_sliding:
                        raise PlanMismatch(
                            f"request {st.request_id}: full-attention group {gid} has no page for ordinal {o} "
                            f"inside the served history [{st.d_blocks}, {st.h_blocks})"
                        )
                    continue
                end = self._covering_end(st, gid, o)
                if end is None:
                    # The engine gave a page the plan cannot fill (e.g. it retains
                    # more than the window). Filling it with anything would be a
                    # wrong answer; fail the request loudly instead.
                    raise PlanMismatch(
                        f"request {st.request_id}: group {gid} (window {grp.window}) got a page for ordinal {o} "
                        f"that no verified object covers; raise S3KV_WINDOW_MARGIN_BLOCKS"
                    )
                by_end.setdefault(end, []).append((o, slot))
            for end, pairs in sorted(by_end.items()):
                spans = tuple(
                    (st.coverage[(gid, s)][end].first, st.coverage[(gid, s)][end].end - st.coverage[(gid, s)][end].first)
                    for s in range(g.tp_size)
                )
                ref = ObjectRef(gid, st.chain.digests[end - 1], spans)
                ops.append(LoadOp(st.request_id, ref, tuple(o for o, _ in pairs), tuple(s for _, s in pairs)))
                self.stats.planned_pages_loaded += len(pairs)
            needed = sum(1 for o in range(st.d_blocks, st.h_blocks) if o < len(slots) and slots[o] >= 0)
            self.stats.hit_blocks_by_group[gid] = self.stats.hit_blocks_by_group.get(gid, 0) + needed
        self.stats.hit_tokens += (st.h_blocks - st.d_blocks) * tpb
        return ops

    def _covering_end(self, st: _Request, gid: int, o: int) -> int | None:
        """The smallest object end whose object holds ordinal ``o`` on every shard."""
        g = self._geometry
        assert g is not None
        ends = None
        for s in range(g.tp_size):
            cov = st.coverage.get((gid, s), {})
            here = {e for e, sp in cov.items() if sp.first <= o < sp.end}
            ends = here if ends is None else ends & here
        return min(ends) if ends else None

    # ------------------------------------------------------------------ per iteration
    def build_connector_meta(self, new_requests: Sequence[Any], cached_requests: Sequence[Any]) -> ConnectorMetadata:
        """``new_requests``/``cached_requests`` hold RequestData-shaped objects."""
        with self._lock:
            _ = self.geometry  # resolve a lazily supplied geometry (a report may precede any lookup)
            self._iteration += 1
            reported: list[_Request] = []
            for rd in new_requests:
                st = self._on_report(rd, first=True)
                if st is not None:
                    reported.append(st)
            for rd in cached_requests:
                st = self._on_report(rd, first=False)
                if st is not None:
                    reported.append(st)
            loads: list[LoadOp] = []
            async_ids: set[int] = set()
            stages: list[StageOp] = []
            seals: list[SealOp] = []
            releases: list[BufferId] = []
            for rid, st in self._requests.items():
                if st.pending_loads or st.declare_async:
                    loads.extend(st.pending_loads)
                    if st.load_async:
                        async_ids.add(rid)
                    st.pending_loads = []
                    st.declare_async = False
                stages.extend(st.pending_stages)
                seals.extend(st.pending_seals)
                releases.extend(st.pending_releases)
                st.pending_stages, st.pending_seals, st.pending_releases = [], [], []
            now = time.monotonic()
            for st in reported:
                st.seen = now
            if self._iteration % 256 == 0:
                self._expire(now)
            # Standing finish plans, for every request that computes in this pass (only they change).
            plans: list[FinishPlan] = []
            for st in reported:
                plan = self._finish_plan(st)
                if plan != st.finish_sent and not (plan.empty and st.finish_sent is None):
                    plans.append(plan)
                    st.finish_sent = plan
            discards = frozenset(self._discards)
            self._discards.clear()
            broken = frozenset(self._failed_promises)
            self._failed_promises.clear()
            self.stats.planned_pages_saved += len(stages)
            self.stats.planned_objects += len(seals)
            return ConnectorMetadata(
                iteration=self._iteration,
                loads=tuple(loads),
                async_load_ids=frozenset(async_ids),
                stages=tuple(stages),
                seals=tuple(seals),
                finish_plans=tuple(plans),
                discard_ids=discards,
                releases=tuple(releases),
                failed_load_ids=broken,
            )

    def _on_report(self, rd: Any, *, first: bool) -> _Request | None:
        """Fold one RequestData into the request's state and plan this pass's saves; the state, or None."""
        rid = rd.request_id
        st = self._requests.get(rid)
        g = self._geometry
        if st is None:
            if first and g is not None:
                # Reported without a lookup: we never learnt its LoRA id or multimodal hashes
                # (RequestData carries only the salt), so its KV has no key that names it fully.
                # Saving it under the salt alone would serve a LoRA's KV to base-model requests.
                self.stats.unkeyed_not_saved += 1
                log.info("s3kv: request %s reported without a lookup; not saved", rid, extra={"request_id": rid})
            return None
        if st.root is None or g is None:
            return None
        tpb = g.tokens_per_block
        by_group = _group_lists(getattr(rd, "new_block_ids_by_layer_group", None), g.num_groups)
        if not by_group and g.num_groups == 1:
            by_group = [list(rd.new_block_ids)]
        if first:
            if not st.reported:
                st.tokens = list(rd.new_tokens) if rd.new_tokens else st.tokens
            st.slots = [list(x) for x in by_group] if by_group else [[] for _ in g.groups]
            st.lists_epoch += 1
            loaded_end = max(st.h_blocks, rd.computed_position // tpb)
            st.save_from = (loaded_end // self.bpo) * self.bpo
            st.completed = max(st.completed, st.save_from)
            st.reported = True
            st.parked = False
            if not st.branch_end:
                self._open_branch(st)
        else:
            st.tokens.extend(rd.new_tokens)
            for gi, delta in enumerate(by_group):
                if gi < len(st.slots):
                    st.slots[gi].extend(delta)
        if len(st.slots) < g.num_groups:
            st.slots += [[] for _ in range(g.num_groups - len(st.slots))]
        begin = rd.computed_position
        if first and not st.load_async:
            # A sync load's first report has the honoured offer subtracted (it marks where the
            # load begins); this pass computes from h. (An async load's report is not reduced,
            # and a discarded async load really does restart at the device match.)
            begin = max(begin, st.h_blocks * tpb)
        upto = min(begin + rd.num_scheduled_tokens, max(st.prompt_len, begin + 1))
        upto = min(upto, len(st.tokens))
        self._plan_saves(st, upto // tpb)
        self._stage_evicted(st, upto)
        st.kv_tokens = max(st.kv_tokens, upto)
        return st

    # ------------------------------------------------------------------ saves
    def _plan_saves(self, st: _Request, complete_blocks: int) -> None:
        g = self._geometry
        assert g is not None and st.chain is not None
        if st.branch_next:
            self._plan_branch(st, complete_blocks)
        if complete_blocks <= st.completed:
            return
        prompt_blocks = st.prompt_len // g.tokens_per_block
        if not self.settings.save_decode:
            complete_blocks = min(complete_blocks, prompt_blocks)
            if complete_blocks <= st.completed:
                return
        st.chain.extend_to(st.tokens)
        self.stats.tokens_saved += max(0, complete_blocks - max(st.completed, st.h_blocks)) * g.tokens_per_block
        for o in range(st.completed, complete_blocks):
            for grp in g.groups:
                gid = grp.group_id
                slot = st.slots[gid][o] if o < len(st.slots[gid]) else -1
                if slot >= 0 and self.policy.keeps(gid, o, prompt_blocks):
                    cap = None
                    if not self.policy.stores_everything(gid):
                        cap = (self.policy.tail_end(gid, o, prompt_blocks) or o + 1) - o
                    self._stage(st, gid, o, slot, cap)
                else:
                    self._close(st, gid)
                buf = st.open.get(gid)
                if buf is None:
                    continue
                if o + 1 == buf.bid.first + buf.bid.capacity:
                    self._seal(st, gid, close=True)
                elif o + 1 == prompt_blocks:
                    # Prompt-end snapshot: exact repeats hit here even though the
                    # object keeps filling with generated blocks.
                    self._seal(st, gid, close=not self.policy.keeps(gid, o + 1, prompt_blocks))
        st.completed = complete_blocks

    def _open_branch(self, st: _Request) -> None:
        """Decide, at the request's first report (its served point is final), whether it stores a
        branch-point tail (``StoragePolicy.branch_end``); if so, start staging it per sliding group."""
        g = self._geometry
        assert g is not None
        end = self.policy.branch_end(st.spine_blocks, st.h_blocks, st.prompt_len // g.tokens_per_block)
        if end is None:
            return
        st.branch_end = end
        for grp in g.groups:
            if grp.is_sliding:
                st.branch_next[grp.group_id] = self.policy.tail(grp.group_id, end)[0]

    def _plan_branch(self, st: _Request, complete_blocks: int) -> None:
        """Stage the branch-point tail's pages as they complete, into one object per sliding group
        ending at the branch point.

        Its own buffer, beside the policy's regular ones: the pages below the served point were
        loaded, not computed, so the regular plan (which starts at ``save_from``) never sees them,
        and a regular tail that overlaps this one must stay whole for its own hits. A page with no
        slot (already freed) makes the tail useless: it is dropped and counted.
        """
        end = st.branch_end
        for gid, nxt in list(st.branch_next.items()):
            slots = st.slots[gid] if gid < len(st.slots) else []
            lo = self.policy.tail(gid, end)[0]
            o = nxt
            while o < min(end, complete_blocks):
                slot = slots[o] if o < len(slots) else -1
                if slot < 0:
                    old = st.branch_open.pop(gid, None)
                    if old is not None:
                        st.pending_releases.append(old.bid)
                    del st.branch_next[gid]
                    self.stats.branch_tails_abandoned += 1
                    break
                buf = st.branch_open.get(gid)
                if buf is None:
                    buf = st.branch_open[gid] = _Buffer(BufferId(st.request_id, gid, lo, end - lo))
                st.pending_stages.append(StageOp(buf.bid, o, slot))
                buf.count += 1
                o += 1
            else:
                if o < end:
                    st.branch_next[gid] = o
                    continue
                buf = st.branch_open.pop(gid)
                del st.branch_next[gid]
                assert st.chain is not None
                st.pending_seals.append(SealOp(buf.bid, buf.count, st.chain.digests[end - 1], True))
                self.stats.branch_tails += 1
                self.stats.branch_tail_pages += buf.count

    def _stage_evicted(self, st: _Request, upto: int) -> None:
        """Keep a host copy of the sliding block that leaves the window after this pass.

        A conversation's next turn needs, for history ``h``, the blocks from
        ``(h+1-W)//tpb``; when the request ends, the engine has already freed
        the one just below its live window whenever the last block is nearly
        full. Capturing each block as it leaves (one page per sliding group and
        request, replaced every block) lets ``request_finished`` store the whole
        tail without holding extra device pages.
        """
        g = self._geometry
        assert g is not None
        prompt_blocks = st.prompt_len // g.tokens_per_block
        if not self.settings.save_decode or self.settings.storage_policy != "window":
            return
        if upto <= prompt_blocks * g.tokens_per_block or self.settings.window_margin_blocks:
            return
        tpb = g.tokens_per_block
        for grp in g.groups:
            if not grp.is_sliding:
                continue
            gid = grp.group_id
            assert grp.window is not None
            leaving = (upto + 1 - grp.window) // tpb - 1  # highest ordinal freed after this pass
            before = (st.kv_tokens + 1 - grp.window) // tpb - 1
            if leaving <= before or leaving < st.save_from:
                continue
            slot = st.slots[gid][leaving] if leaving < len(st.slots[gid]) else -1
            old = st.evicted.pop(gid, None)
            if old is not None:
                st.pending_releases.append(old.bid)
            if slot < 0:
                continue
            # Room for the evicted block plus the live window the finish tail appends.
            cap = -(-grp.window // tpb) + 3  # type: ignore[operator]
            buf = _Buffer(BufferId(st.request_id, gid, leaving, cap))
            st.pending_stages.append(StageOp(buf.bid, leaving, slot))
            buf.count = 1
            st.evicted[gid] = buf

    def _stage(self, st: _Request, gid: int, o: int, slot: int, capacity: int | None = None) -> None:
        """Stage ``o`` into the group's open buffer, opening one (of ``capacity`` blocks,
        default: to the chunk end) when the run breaks or the buffer is full."""
        buf = st.open.get(gid)
        if buf is not None and (o != buf.bid.first + buf.count or buf.count >= buf.bid.capacity):
            self._close(st, gid)
            buf = None
        if buf is None:
            cap = capacity if capacity is not None else self.policy.chunk_end(o, gid) - o
            buf = _Buffer(BufferId(st.request_id, gid, o, cap))
            st.open[gid] = buf
        st.pending_stages.append(StageOp(buf.bid, o, slot))
        buf.count += 1

    def _seal(self, st: _Request, gid: int, *, close: bool) -> None:
        buf = st.open[gid]
        assert st.chain is not None
        if buf.count > buf.sealed:
            last = buf.bid.first + buf.count - 1
            st.pending_seals.append(SealOp(buf.bid, buf.count, st.chain.digests[last], close))
            buf.sealed = buf.count
        elif close:
            st.pending_releases.append(buf.bid)
        if close:
            del st.open[gid]

    def _close(self, st: _Request, gid: int) -> None:
        if gid in st.open:
            self._seal(st, gid, close=True)

    # ------------------------------------------------------------------ finish
    def request_finished(self, request_id: int, block_ids_by_group: Sequence[Sequence[int]]) -> bool:
        """The request ended (finished or cancelled): forget it; True while workers still hold work for it.

        Nothing is planned here: the workers already hold the request's standing
        finish plan (see :class:`plan.FinishPlan`) and run it when the id reaches
        ``get_finished`` in this same iteration. True keeps the pages until
        every rank returned the id: needed when the plan copies pages, when the
        request has staging buffers, and when an async load may still be
        landing in its pages (a request cancelled while parked).
        """
        with self._lock:
            st = self._requests.pop(request_id, None)
            if st is None or st.root is None:
                return False
            sent = st.finish_sent
            if sent is not None and sent.stages:
                self._check_live(st, sent, block_ids_by_group)
            return bool(
                st.open or st.evicted or st.branch_open or (sent is not None and not sent.empty) or st.parked
            )

    def _check_live(self, st: _Request, plan: FinishPlan, lists: Sequence[Sequence[int]]) -> None:
        """The finish plan copies pages it expects the engine to still hold; say so loudly if not.

        The plan was made from the page rule (sliding pages below ``(h+1-W)//tpb`` are
        freed); an engine that frees earlier would make it copy a page that is no
        longer the request's. Nothing can be done about it now (no metadata reaches
        the workers before get_finished), so count it, log it, and forget the keys
        locally so this engine never serves them.
        """
        bad = [
            op for op in plan.stages
            if op.buffer.group >= len(lists) or op.ordinal >= len(lists[op.buffer.group])
            or lists[op.buffer.group][op.ordinal] != op.slot
        ]
        if not bad:
            return
        self.stats.finish_plan_mismatches += 1
        log.error(
            "s3kv: request %s finished without page(s) its finish plan copies (group %d ordinal %d); "
            "the engine's sliding-window page rule differs from the one s3kv assumes -- please report",
            st.request_id, bad[0].buffer.group, bad[0].ordinal, extra={"request_id": st.request_id},
        )
        if st.chain is not None and self._geometry is not None:
            keys = [
                self.scheme.object_key(self._geometry.groups[seal.buffer.group].fingerprint, s, seal.last_digest)
                for seal in plan.seals for s in range(self._geometry.tp_size)
            ]
            self.index.quarantine(keys, self.settings.index_ttl_s)

    def _finish_plan(self, st: _Request) -> FinishPlan:
        """``_make_finish_plan``, recomputed only when what it reads changed.

        It runs for every request in every pass; during decode its inputs change once a block
        (a block completes, a page is added, a sliding page leaves the window), not once a token.
        """
        g = self._geometry
        assert g is not None
        tpb = g.tokens_per_block
        key = (
            st.completed,
            st.save_from,
            st.lists_epoch,
            tuple(len(x) for x in st.slots),
            tuple((st.kv_tokens + 1 - grp.window) // tpb for grp in g.groups if grp.window is not None),
            tuple((gid, b.bid, b.count, b.sealed) for gid, b in st.open.items()),
            tuple((gid, b.bid, b.count) for gid, b in st.evicted.items()),
            tuple(b.bid for b in st.branch_open.values()),
        )
        if st.finish_memo is not None and st.finish_memo[0] == key:
            return st.finish_memo[1]
        plan = self._make_finish_plan(st)
        st.finish_memo = (key, plan)
        return plan

    def _make_finish_plan(self, st: _Request) -> FinishPlan:
        """What the workers must do if ``st`` finishes right after this iteration's pass.

        A dry run on a copy of the request's buffers: close every open object and,
        for each sliding group whose history ran past the prompt, stage the live
        tail a continuation of the conversation needs -- the evicted copy of the
        block that left the window last, then the pages still live after this pass.
        """
        g = self._geometry
        assert g is not None
        sim = _Request(
            st.request_id, st.root, st.chain, st.tokens, st.prompt_len,
            save_from=st.save_from, completed=st.completed, kv_tokens=st.kv_tokens, slots=st.slots,
            open={k: dataclasses.replace(v) for k, v in st.open.items()},
            evicted={k: dataclasses.replace(v) for k, v in st.evicted.items()},
        )
        e = sim.completed
        tpb = g.tokens_per_block
        prompt_blocks = sim.prompt_len // tpb
        for grp in g.groups:
            gid = grp.group_id
            if self.policy.stores_everything(gid) or not self.settings.save_decode or e <= prompt_blocks:
                self._close(sim, gid)
                ev = sim.evicted.pop(gid, None)
                if ev is not None:
                    sim.pending_releases.append(ev.bid)
                continue
            # Sliding group, history beyond the prompt: the live tail a continuation would need.
            lo, hi = self.policy.tail(gid, e)
            start = max(lo, sim.save_from)
            buf = sim.open.get(gid)
            if buf is not None and buf.bid.first + buf.count == hi:
                # An open checkpoint tail already ends at the history end: it is the finish
                # tail if it reaches back far enough, else the finish tail replaces it (one
                # object per end block and request).
                if buf.bid.first <= start:
                    self._seal(sim, gid, close=True)
                    ev = sim.evicted.pop(gid, None)
                    if ev is not None:
                        sim.pending_releases.append(ev.bid)
                    continue
                sim.pending_releases.append(buf.bid)
                del sim.open[gid]
            self._close(sim, gid)
            assert grp.window is not None
            # Pages the engine still holds after this pass: the page rule's cut at the history.
            # (An engine that retains more keeps them for nothing: the plan cannot know.)
            cut = max(0, (sim.kv_tokens + 1 - grp.window) // tpb)
            live = sim.slots[gid] if gid < len(sim.slots) else []
            first_live = next((o for o in range(max(start, cut), hi) if o < len(live) and live[o] >= 0), hi)
            ev = sim.evicted.pop(gid, None)
            if ev is not None:
                if start <= ev.bid.first and ev.bid.first + ev.count == first_live:
                    sim.open[gid] = ev  # the evicted copy continues into the live pages
                    start = first_live
                else:
                    sim.pending_releases.append(ev.bid)
            for o in range(start, hi):
                slot = live[o] if o >= cut and o < len(live) else -1
                if slot < 0:
                    self._close(sim, gid)
                    continue
                self._stage(sim, gid, o, slot, hi - o)
                buf = sim.open[gid]
                if o + 1 == buf.bid.first + buf.bid.capacity or o + 1 == hi:
                    self._seal(sim, gid, close=True)
            self._close(sim, gid)
        # A branch-point tail still open (the request ends before reaching it) is dropped.
        sim.pending_releases += [buf.bid for buf in st.branch_open.values()]
        return FinishPlan(
            st.request_id, tuple(sim.pending_stages), tuple(sim.pending_seals), tuple(sim.pending_releases)
        )

    # ------------------------------------------------------------------ introspection
    def active_requests(self) -> int:
        with self._lock:
            return len(self._requests)
