"""Scheduler-side logic: what a request can be served, and what gets saved when.

``LeaderCore`` speaks in plain values (token lists, ordinal->slot lists,
``RequestData``-shaped reports) and emits ``plan.ConnectorMetadata``. The
TensorRT-LLM adapter only translates engine objects into these calls. The only
I/O is the lookup's HEAD waves, through the store and the local index.

This facade holds the requests and the lock and runs each hook; what a hook decides lives in
the module named for it: ``requests`` (per-request state), ``context`` (what the geometry
fixes), ``lookup`` (HEAD waves, the namespace summary), ``loads`` (load plans, broken
promises), ``saves`` (save plans, evicted capture, branch tails), ``writes`` (what goes to S3:
the value policy) and ``finish`` (standing finish plans).

Why this is one module: it is the one object the adapter's hooks call, and every hook takes its
lock and finds its requests here; what a hook decides already lives in the modules above.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...config import Settings
from ...core.keys import ChainMemo, NotCacheable, chain_root
from ...core.layout import CacheGeometry
from ...core.plan import BufferId, ConnectorMetadata, FinishPlan, LoadOp, SealOp, StageOp
from ...store.base import ObjectStore
from ..fleetindex import IndexRefresher
from ..index import KeyIndex
from ..summary import NamespaceSummary
from ..verdicts import VerdictBoard
from .context import LeaderContext
from .finish import FinishPlanner
from .loads import LoadPlanner
from .lookup import Lookups
from .pages import PageOwners
from .requests import RequestState, group_lists
from .saves import SavePlanner
from .stats import LeaderStats
from .writes import WritePolicy

log = logging.getLogger("s3kv.leader")


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
        sizing_page_bytes: Sequence[int] | None = None,
        failed_load_hook: bool = False,
        overlap: bool = False, tiers: Any = None,
        model_ref: Any = None,
        recompute_hook: bool | None = None,
    ):
        """``sizing_page_bytes`` (per group) replaces the real page sizes when choosing blocks per
        object and pricing them (benchmarks of a real model's object structure); ``overlap``: the
        overlap loop; ``tiers``: see Lookups; ``model_ref``: see ``WritePolicy``;
        ``recompute_hook``: the engine has the failed-load hook (None: ``failed_load_hook``, which
        is False where loads stay async even so) -- ``WritePolicy.host_only_safe``."""
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
        self.index = index if index is not None else KeyIndex.from_settings(settings)
        self._geometry_source = geometry
        self._ctx: LeaderContext | None = None
        self._requests: dict[int, RequestState] = {}
        self._discards: set[int] = set()
        self._iteration = 0
        self._lock = threading.Lock()
        self._sizing_page_bytes = list(sizing_page_bytes) if sizing_page_bytes else None
        self.stats = LeaderStats()
        self._lookups = Lookups(settings, store, self.index, self.stats, tiers)
        self._lookups.pace.overlap = overlap  # what a lookup's stall costs the batch (pace.py)
        self._loads = LoadPlanner(settings, self.stats, self._lookups)
        inflight = 1 if overlap else 0  # the overlap loop's forward runs a token past its report
        self.writes = WritePolicy(settings, self.stats, self._lookups, model_ref, tp_size,
                                  failed_load_hook if recompute_hook is None else recompute_hook)
        self._saves = SavePlanner(self.stats, self.writes, inflight)
        self._finish = FinishPlanner(self.stats, self.writes, inflight)
        self._pages = PageOwners()  # requests freed with no connector call
        self._chains = ChainMemo()  # recent prompts' chains: a repeated prefix is not hashed again
        # Where ranks past 0 (processes of their own) say which objects they found bad.
        self.verdicts = VerdictBoard.make(self.index, tp_size) if tp_size > 1 else None

    @property
    def _verdicts_path(self) -> str:
        """The verdict directory every metadata names ("" with one rank, or none could be made)."""
        return self.verdicts.path if self.verdicts is not None else ""

    # ------------------------------------------------------------------ geometry
    @property
    def geometry(self) -> CacheGeometry | None:
        if self._ctx is None:
            src = self._geometry_source
            g = src() if callable(src) else src
            if g is not None:
                self._set_geometry(g)
        return self._ctx.geometry if self._ctx is not None else None

    def _set_geometry(self, g: CacheGeometry) -> None:
        if g.tp_size != self.tp_size:
            raise ValueError(f"geometry tp_size {g.tp_size} != leader tp_size {self.tp_size}")
        ctx = LeaderContext.build(g, self.settings, self.key_prefix, self._sizing_page_bytes)
        self._ctx = ctx
        self._lookups.bind(ctx)
        self.writes.bind(ctx, self._sizing_page_bytes or [x.page_bytes for x in g.groups])
        # What callers read off the leader (tests, benchmarks, the demo's bucket listing).
        self.namespace, self.scheme, self.policy, self.params = ctx.namespace, ctx.scheme, ctx.policy, ctx.params
        self.group_blocks, self.bpo = ctx.group_blocks, ctx.bpo
        log.info(
            "s3kv geometry: %d groups (%s), tpb=%d, tp=%d, blocks/object %s, checkpoints every %d blocks, ns=%s",
            g.num_groups,
            ", ".join(f"g{x.group_id}:w={x.window or 'full'},{x.page_bytes}B" for x in g.groups),
            g.tokens_per_block,
            g.tp_size,
            ctx.group_blocks,
            ctx.checkpoint_blocks,
            ctx.namespace.hex()[:12],
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
        lora: str | None = None,
        multimodal_hashes: Sequence[Any] | None = None,
        has_multimodal: bool = False,
        not_cacheable: str = "",
        store_available: bool = True, owned: bool = False, first_chunk_tokens: int | None = None,
    ) -> tuple[int, bool]:
        """What the connector can add to the device match: (tokens, load async). ``owned``: the
        caller hands ``tokens`` over (a list nobody else changes), so it is kept, not copied.
        ``first_chunk_tokens``: its first context chunk, if known (``pressure.py``). ``not_cacheable``:
        why the caller cannot name all its KV depends on (never served or saved)."""
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            with self._lock:
                old = self._requests.pop(request_id, None)
                if old is not None:  # a replay: the engine re-allocates from scratch, what we staged is stale
                    self._discards.add(request_id)
                    self._lookups.pressure.replayed(ran=old.reported)
                else:  # the denominator of "share of prompt tokens served from S3" (once per request)
                    self.stats.prompt_tokens += int(prompt_len)
                if self.verdicts is not None:  # before anything is promised from the index
                    self.verdicts.poll()
                g = self.geometry
                # The request's token list is ours to extend: at most one copy (a list's slice is one).
                # 128k tokens copy in ~0.3 ms and the copy is traversed again by the next garbage
                # collection, on the scheduler's thread - so a list handed over is kept as it is.
                if owned and isinstance(tokens, list) and len(tokens) == prompt_len:
                    prompt = tokens
                else:
                    prompt = tokens[:prompt_len] if isinstance(tokens, list) else list(tokens[:prompt_len])
                if g is None:
                    log.warning("s3kv: no KV cache layout registered yet; request %s is a miss", request_id,
                                extra={"request_id": request_id})
                    self._requests[request_id] = RequestState(request_id, None, None, prompt, prompt_len)
                    return 0, False
                try:
                    if not_cacheable:  # e.g. a LoRA adapter of unknown identity (trtllm/lora.py)
                        raise NotCacheable(not_cacheable)
                    root = chain_root(self.namespace, cache_salt=cache_salt, lora=lora,
                                      multimodal_hashes=multimodal_hashes, has_multimodal=has_multimodal)
                except NotCacheable as e:
                    self.stats.not_cacheable += 1
                    log.info("s3kv: request %s not cached: %s", request_id, e, extra={"request_id": request_id})
                    self._requests[request_id] = RequestState(request_id, None, None, prompt, prompt_len)
                    return 0, False
                h0 = time.thread_time()
                # The whole chain first, then any request. Why not send HEADs for the hashed part
                # while the rest is hashed (a 128k prompt hashes for 7-10 ms): tried, three waves at
                # quarters of the prompt, and the 128k verify path went from 63 to 92-100 ms on a
                # 16-core host. Hashing holds the GIL, so the threads that send and answer those
                # waves wait for it in 5 ms switch intervals; nothing overlaps. What a recent
                # prompt began with is not hashed again (``ChainMemo``).
                chain = self._chains.chain(root, g.tokens_per_block, prompt)
                self.stats.lookup_hash_cpu_s += time.thread_time() - h0
                st = RequestState(request_id, root, chain, prompt, prompt_len, seen=time.monotonic())
                st.load.replayed = old is not None
                self._requests[request_id] = st
                self._lookups.pace.others = len(self._requests) - 1
                offer = self._lookups.offer(st, num_computed_tokens, store_available=store_available,
                                            load_async=self.load_async, first_chunk_tokens=first_chunk_tokens)
                self.writes.on_lookup(st)  # which kind of object ended the hit (the value policy)
                self._lookups.record(time.perf_counter() - w0, offer[0])  # what the scheduler paid
                return offer
        finally:  # all of it runs on the scheduler thread: what the engine's batch waited for
            self.stats.lookup_cpu_s += time.thread_time() - c0

    def lookup_summary(self) -> NamespaceSummary | None:
        """The namespace summary (made on first use; its refresher starts with the first
        lookup), or None when ``lookup_summary_s`` is 0 or the layout is not known yet.
        Call ``.refresh()`` on it to have a snapshot before the first lookup."""
        return self._lookups.listings.summary() if self.geometry is not None else None

    def fleet_index(self) -> IndexRefresher | None:
        """The fleet index's refresher, or None when ``fleet_index_s`` is 0 or the layout is not
        known yet. A replay on its own clock sets its ``clock`` and calls ``refresh()`` after it
        publishes (``s3kv.engine.fleetindex``)."""
        return self._lookups.listings.fleet_index() if self.geometry is not None else None

    def close_lookup(self) -> None:
        """Stop the lookup's background work (summary refresher, pool). Idempotent."""
        self._lookups.close()

    @property
    def _pending_waves(self) -> int:
        """HEAD waves submitted to the lookup pool and not finished."""
        return self._lookups.pending_waves

    # ------------------------------------------------------------------ allocation
    def update_state_after_alloc(
        self, request_id: int, block_ids_by_group: Any, honoured_tokens: int | None = None
    ) -> None:
        """Plan the loads of what the engine honoured (``loads.py``). Never raises."""
        with self._lock:
            st = self._requests.get(request_id)
            ctx = self._ctx
            if st is None or ctx is None or st.root is None or st.load.made_blocks == 0:
                return
            self._loads.after_alloc(ctx, st, block_ids_by_group, honoured_tokens)
            if st.load.parked:
                self._pages.loading(st, st.load.pending, self._requests)

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
        stale = [rid for rid, st in self._requests.items() if now - st.seen > ttl and not st.load.parked]
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
            ctx = self._ctx
            if st is None or ctx is None or not st.load.offered_blocks:
                return
            ld = st.load
            tpb = ctx.geometry.tokens_per_block
            keep = max(0, min(ld.offered_blocks, (int(start) - ld.d_blocks * tpb) // tpb))
            if int(end) >= (ld.d_blocks + ld.offered_blocks) * tpb:
                ld.offered_blocks = keep

    def request_reset(self, request_id: int, aborted: str = "") -> None:
        """Engine hook (some V2 lines): the request's allocation died and it will be replayed; or the
        engine aborted it (``aborted``: why) once every worker released its load. Drop its state."""
        with self._lock:
            if self._requests.pop(request_id, None) is not None:
                self._discards.add(request_id)
                self.stats.loads_aborted += bool(aborted)

    def break_promise(self, request_id: int, reason: str) -> None:
        """The adapter's fallback when planning a load raised: the request takes the failure rung."""
        with self._lock:
            st = self._requests.get(request_id)
            if st is not None and st.load.offered_blocks:
                st.load.parked = st.load.load_async
                self._loads.broken(st, reason)

    def fail_safe_meta(self) -> ConnectorMetadata:
        """Metadata after ``build_connector_meta`` itself failed: every load it would have carried
        is declared failed (the workers take the failure rung), nothing is saved this iteration."""
        with self._lock:
            self._iteration += 1
            async_ids: set[int] = set()
            for rid, st in self._requests.items():
                if st.load.pending or st.load.declare_async:
                    if st.load.load_async:
                        async_ids.add(rid)
                    self._loads.broken(st, "building the connector metadata failed")
                    st.load.declare_async = False
                st.saves.stages, st.saves.seals = [], []
            self._pages.settle(self._requests, self.stats, self._discards)
            return ConnectorMetadata(
                iteration=self._iteration, async_load_ids=frozenset(async_ids), failed_load_ids=self._loads.take_failed(),
                verdicts=self._verdicts_path, abandoned_ids=self._pages.take_abandoned(),
            )

    # ------------------------------------------------------------------ per iteration
    def build_connector_meta(self, new_requests: Sequence[Any], cached_requests: Sequence[Any]) -> ConnectorMetadata:
        """``new_requests``/``cached_requests`` hold RequestData-shaped objects."""
        with self._lock:
            _ = self.geometry  # resolve a lazily supplied geometry (a report may precede any lookup)
            self._iteration += 1
            self._lookups.pace.iteration(len(new_requests) + len(cached_requests))
            reported: list[RequestState] = []
            for rd in new_requests:
                st = self._on_report(rd, first=True)
                if st is not None:
                    reported.append(st)
            for rd in cached_requests:
                st = self._on_report(rd, first=False)
                if st is not None:
                    reported.append(st)
            if self._ctx is not None:
                reports = [(rd, True) for rd in new_requests] + [(rd, False) for rd in cached_requests]
                self._pages.reported(self._ctx.geometry, self._requests, reports, self._pages.gone)
            self._pages.settle(self._requests, self.stats, self._discards)
            loads: list[LoadOp] = []
            async_ids: set[int] = set()
            stages: list[StageOp] = []
            seals: list[SealOp] = []
            releases: list[BufferId] = []
            for rid, st in self._requests.items():
                ld, sv = st.load, st.saves
                if ld.pending or ld.declare_async:
                    loads.extend(ld.pending)
                    if ld.load_async:
                        async_ids.add(rid)
                    ld.pending = []
                    ld.declare_async = False
                stages.extend(sv.stages)
                seals.extend(sv.seals)
                releases.extend(sv.releases)
                sv.stages, sv.seals, sv.releases = [], [], []
            now = time.monotonic()
            for st in reported:
                st.seen = now
            if self._iteration % 256 == 0:
                self._expire(now)
            # Standing finish plans, for every request that computes in this pass (only they change).
            plans: list[FinishPlan] = self._finish.changed_plans(self._ctx, reported) if self._ctx is not None else []
            discards = frozenset(self._discards)
            self._discards.clear()
            broken = self._loads.take_failed()
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
                verdicts=self._verdicts_path,
                abandoned_ids=self._pages.take_abandoned(),
                refresh_s=self._lookups.listings.refresh_s(),
            )

    def _on_report(self, rd: Any, *, first: bool) -> RequestState | None:
        """Fold one RequestData into the request's state and plan this pass's saves; the state, or None."""
        rid = rd.request_id
        st = self._requests.get(rid)
        ctx = self._ctx
        if st is None:
            if first and ctx is not None:
                # Reported without a lookup: we never learnt its LoRA id or multimodal hashes
                # (RequestData carries only the salt), so its KV has no key that names it fully.
                # Saving it under the salt alone would serve a LoRA's KV to base-model requests.
                self.stats.unkeyed_not_saved += 1
                log.info("s3kv: request %s reported without a lookup; not saved", rid, extra={"request_id": rid})
            return None
        if st.root is None or ctx is None:
            return None
        self._saves.on_report(ctx, st, rd, first=first)
        return st

    # ------------------------------------------------------------------ finish
    def request_finished(self, request_id: int, block_ids_by_group: Sequence[Sequence[int]]) -> bool:
        """The request ended (finished or cancelled): forget it; True while workers still hold work
        for it (see :meth:`FinishPlanner.finished`)."""
        with self._lock:
            st = self._requests.pop(request_id, None)
            if st is None or st.root is None:
                return False
            lists = group_lists(block_ids_by_group, len(st.slots))
            if any(st.slots) and not any(lists):
                return self._finished_after_release(st)
            if not self._finish.plan_pages_held(st, lists):
                return self._drop_finish(st)
            return self._finish.finished(st)

    def _drop_finish(self, st: RequestState) -> bool:
        """The request ended and its finish plan must not run (its pages may be another request's):
        False keeps its id from ``get_finished``, and the next metadata's ``discard_ids`` have the
        workers drop its plan and open objects, uploading nothing more of it. (Only a request that
        computed comes here, so none whose async load may still be landing in its pages.)"""
        self._discards.add(st.request_id)
        return False

    def _finished_after_release(self, st: RequestState) -> bool:
        """``request_finished`` with one empty list per group for a request that held pages: the
        engine freed them first. On the KVCacheManagerV2 line that is a request failed by
        ``_handle_errors`` after its forward raised (the non-overlap loop still sends the batch to
        ``_send_kv_async``), or one cancelled while the overlap loop held it in its previous batch.
        Its pages may be another request's by now, and the last forward may not have written
        them: the standing finish plan must not run (its stages copy those pages -- into objects
        every engine would load). So False keeps its id from ``get_finished``, and the workers drop
        its plan and open objects with the next metadata, uploading nothing. (A parked request
        has no pages reported yet: it never comes here, and its load stops at ``get_finished``.)"""
        rid = st.request_id
        self.stats.finished_after_release += 1
        log.warning("s3kv: request %s finished after the engine freed its pages (it failed, or was cancelled "
                    "in flight); nothing more of it is saved", rid, extra={"request_id": rid})
        return self._drop_finish(st)

    # ------------------------------------------------------------------ introspection
    def active_requests(self) -> int:
        with self._lock:
            return len(self._requests)
