"""Load planning: what a promised load becomes once the engine allocated the request's pages.

The engine may honour less than offered, or nothing (the async flag then still parks the
request). A smaller honour is a smaller load when every group's pages for it are stored; when
they are not (a sliding group's tail for that point was never stored), or the engine gave a
page no verified object covers, the promise is **broken**: the workers take the failure rung
for the request (docs/failures.md) -- never a page of garbage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...config import Settings
from ...core.errors import PlanMismatch
from ...core.hitrule import required_range, servable
from ...core.plan import LoadOp, ObjectRef
from .context import LeaderContext
from .lookup import Lookups
from .requests import RequestState, group_lists
from .stats import LeaderStats

log = logging.getLogger("s3kv.leader")


class LoadPlanner:
    """Plans the loads of what the engine honoured; collects the promises it cannot keep."""

    def __init__(self, settings: Settings, stats: LeaderStats, lookups: Lookups):
        self.settings = settings
        self.stats = stats
        self.lookups = lookups
        #: Requests whose promise was broken since the last metadata (``failed_load_ids``).
        self.failed: set[int] = set()

    def take_failed(self) -> frozenset[int]:
        out = frozenset(self.failed)
        self.failed.clear()
        return out

    def after_alloc(
        self, ctx: LeaderContext, st: RequestState, block_ids_by_group: Any, honoured_tokens: int | None
    ) -> None:
        """``update_state_after_alloc`` for a request the lookup offered something to."""
        g = ctx.geometry
        ld = st.load
        tpb = g.tokens_per_block
        if honoured_tokens is not None:
            # Against the offer as made: an engine that reports a smaller honour by cancelling the
            # tail first (cancel_load) has shrunk offered_blocks already. A replayed request's grow
            # proves no pages are free: it takes back the pages it was just made to give up.
            self.lookups.pressure.honoured(needed_grow=ld.needs_grow and not ld.replayed,
                                           less=int(honoured_tokens) < ld.made_blocks * tpb)
        if ld.offered_blocks == 0:  # the engine took the whole offer back (cancel_load): nothing to plan
            return
        # The engine parks an async request whatever it honoured: declare it so the workers
        # return its id (at once when there is nothing to load).
        ld.parked = ld.declare_async = ld.load_async
        honoured = ld.offered_blocks * tpb if honoured_tokens is None else int(honoured_tokens)
        self.stats.honoured_less += honoured < ld.offered_blocks * tpb
        if honoured <= 0:
            ld.h_blocks = ld.d_blocks
            return
        if honoured % tpb or honoured > ld.offered_blocks * tpb:
            ld.h_blocks = ld.d_blocks
            self.broken(st, f"the engine honoured {honoured} tokens of {ld.offered_blocks * tpb} offered, "
                            f"not a whole number of {tpb}-token blocks")
            return
        h = ld.d_blocks + honoured // tpb
        ld.h_blocks = h
        lists = group_lists(block_ids_by_group, g.num_groups)
        if len(lists) != g.num_groups:
            self.broken(st, f"the engine reports {len(lists)} layer groups, the layout has {g.num_groups}")
            return
        margin = self.settings.window_margin_blocks
        if not servable(g, ld.coverage, ld.d_blocks, h, margin):
            # Honoured less than offered: a sliding group's tail for h lies below the tail the
            # lookup verified for the offer. Verify it now (the index answers the spine).
            try:
                more = self.lookups.recheck(st, h)
            except Exception as e:  # noqa: BLE001 - a failed re-check is a broken promise, not an error
                log.warning("s3kv: re-checking request %s after a smaller honour failed: %s", st.request_id, e)
                more = None
            if more is not None:
                for key, spans in more.coverage.items():
                    ld.coverage.setdefault(key, {}).update(spans)
            if more is None or more.h_blocks < h:
                self.broken(st, f"the engine honoured {(h - ld.d_blocks) * tpb} of the "
                                f"{ld.offered_blocks * tpb} tokens offered and the store holds no verified "
                                f"sliding-window tail ending at block {h}")
                return
        try:
            ld.pending = self._plan(ctx, st, lists)
        except PlanMismatch as e:
            self.broken(st, str(e))

    def broken(self, st: RequestState, reason: str) -> None:
        """A promise the leader cannot keep: the workers take the failure rung for it."""
        st.load.pending = []
        st.load.declare_async = st.load.declare_async or st.load.load_async
        self.failed.add(st.request_id)
        self.stats.promises_broken += 1
        log.error("s3kv: request %s: %s; the load cannot be served", st.request_id, reason,
                  extra={"request_id": st.request_id})

    def _plan(self, ctx: LeaderContext, st: RequestState, lists: Sequence[Sequence[int]]) -> list[LoadOp]:
        g = ctx.geometry
        assert st.chain is not None
        ld = st.load
        tpb = g.tokens_per_block
        ops: list[LoadOp] = []
        for grp in g.groups:
            gid = grp.group_id
            slots = lists[gid]
            lo, _hi = required_range(grp, tpb, ld.d_blocks, ld.h_blocks, self.settings.window_margin_blocks)
            by_end: dict[int, list[tuple[int, int]]] = {}
            for o in range(ld.d_blocks, ld.h_blocks):
                slot = slots[o] if o < len(slots) else -1
                if slot < 0:
                    if o >= lo and not grp.is_sliding:
                        raise PlanMismatch(
                            f"request {st.request_id}: full-attention group {gid} has no page for ordinal {o} "
                            f"inside the served history [{ld.d_blocks}, {ld.h_blocks})"
                        )
                    continue
                end = self._covering_end(ctx, st, gid, o)
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
                    (ld.coverage[(gid, s)][end].first, ld.coverage[(gid, s)][end].end - ld.coverage[(gid, s)][end].first)
                    for s in range(g.tp_size)
                )
                ref = ObjectRef(gid, st.chain.digests[end - 1], spans)
                ops.append(LoadOp(st.request_id, ref, tuple(o for o, _ in pairs), tuple(s for _, s in pairs),
                                  host=self.lookups.in_host(gid, ref.last_digest)))
            needed = sum(1 for o in range(ld.d_blocks, ld.h_blocks) if o < len(slots) and slots[o] >= 0)
            self.stats.hit_blocks_by_group[gid] = self.stats.hit_blocks_by_group.get(gid, 0) + needed
        self.stats.hit_tokens += (ld.h_blocks - ld.d_blocks) * tpb
        return ops

    @staticmethod
    def _covering_end(ctx: LeaderContext, st: RequestState, gid: int, o: int) -> int | None:
        """The smallest object end whose object holds ordinal ``o`` on every shard."""
        ends = None
        for s in range(ctx.geometry.tp_size):
            cov = st.load.coverage.get((gid, s), {})
            here = {e for e, sp in cov.items() if sp.first <= o < sp.end}
            ends = here if ends is None else ends & here
        return min(ends) if ends else None
