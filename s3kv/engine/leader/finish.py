"""Finish plans: what the workers save when a request ends, decided before it ends.

``request_finished`` and ``get_finished`` run in the same iteration with no metadata between
them, and the engine frees a finished request's pages as soon as every rank returned its id.
So every pass sends each computing request's **standing finish plan** (re-sent only when it
changes): close every open object and, for each sliding group whose history ran past the
prompt, stage the live tail a continuation of the conversation needs. The workers run it when
the id reaches ``get_finished``. At the end, :meth:`FinishPlanner.plan_pages_held` checks that the
pages the plan copies are still the request's (else the plan is dropped, never run), and
:meth:`FinishPlanner.finished` says whether workers still hold work for it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from ...core.hitrule import window_cut
from ...core.plan import FinishPlan
from .context import LeaderContext
from .requests import RequestState, SaveState
from .stats import LeaderStats
from .writes import WritePolicy

log = logging.getLogger("s3kv.leader")


class FinishPlanner:
    def __init__(self, stats: LeaderStats, writes: WritePolicy, inflight: int = 0):
        self.stats = stats
        self.writes = writes
        #: Tokens the engine advances a request past its last report before its finish plan runs:
        #: 1 on the overlap loop, whose request_finished comes a pass after the last forward
        #: (one token past that forward's report) and whose update_resources for that forward
        #: frees the block that left the window after request_finished, before get_finished.
        self.inflight = inflight

    def changed_plans(self, ctx: LeaderContext, reported: Iterable[RequestState]) -> list[FinishPlan]:
        """The standing finish plans that changed, for every request that computes in this pass
        (only they change); each becomes the plan the workers hold."""
        plans: list[FinishPlan] = []
        for st in reported:
            plan = self._plan(ctx, st)
            if plan != st.finish_sent and not (plan.empty and st.finish_sent is None):
                plans.append(plan)
                st.finish_sent = plan
        return plans

    def finished(self, st: RequestState) -> bool:
        """``st`` ended (finished or cancelled) still holding every page its plan copies (see
        :meth:`plan_pages_held`): True while workers still hold work for it.

        Nothing is planned here: the workers already hold the request's standing finish plan
        and run it when the id reaches ``get_finished`` in this same iteration. True keeps the
        pages until every rank returned the id: needed when the plan copies pages, when the
        request has staging buffers, and when an async load may still be landing in its pages
        (a request cancelled while parked).
        """
        sent = st.finish_sent
        if sent is not None:
            self.writes.on_seals(st, sent.seals, finish=True)
        return bool(
            st.saves.open or st.saves.evicted or st.branch.open or (sent is not None and not sent.empty)
            or st.load.parked
        )

    def plan_pages_held(self, st: RequestState, lists: list[list[int]]) -> bool:
        """Whether every page the standing finish plan copies is still listed as the request's.

        The plan was made from the page rule (sliding pages below ``(h+1-W)//tpb`` are freed);
        an engine that frees earlier would have it copy a page that may be another request's by
        now -- into an object every engine loads. No metadata reaches the workers before
        ``get_finished``, so the only safe answer is not to run the plan at all (the caller
        discards it); count it and log it, since it means s3kv's page rule is wrong."""
        plan = st.finish_sent
        bad = [
            op for op in (plan.stages if plan is not None else ())
            if op.buffer.group >= len(lists) or op.ordinal >= len(lists[op.buffer.group])
            or lists[op.buffer.group][op.ordinal] != op.slot
        ]
        if not bad:
            return True
        self.stats.finish_plan_mismatches += 1
        log.error(
            "s3kv: request %s finished without page(s) its finish plan copies (group %d ordinal %d); nothing more "
            "of it is saved. The engine's sliding-window page rule differs from the one s3kv assumes -- please "
            "report", st.request_id, bad[0].buffer.group, bad[0].ordinal, extra={"request_id": st.request_id},
        )
        return False

    def _plan(self, ctx: LeaderContext, st: RequestState) -> FinishPlan:
        """``_make``, recomputed only when what it reads changed.

        It runs for every request in every pass; during decode its inputs change once a block
        (a block completes, a page is added, a sliding page leaves the window), not once a token.
        """
        g = ctx.geometry
        tpb = g.tokens_per_block
        sv = st.saves
        key = (
            sv.completed,
            sv.save_from,
            st.lists_epoch,
            tuple(len(x) for x in st.slots),
            tuple(
                window_cut(st.kv_tokens + self.inflight, grp.window, tpb)
                for grp in g.groups if grp.window is not None
            ),
            tuple((gid, b.bid, b.count, b.sealed) for gid, b in sv.open.items()),
            tuple((gid, b.bid, b.count) for gid, b in sv.evicted.items()),
            tuple(b.bid for b in st.branch.open.values()),
        )
        if st.finish_memo is not None and st.finish_memo[0] == key:
            return st.finish_memo[1]
        plan = self._make(ctx, st)
        st.finish_memo = (key, plan)
        return plan

    def _make(self, ctx: LeaderContext, st: RequestState) -> FinishPlan:
        """What the workers must do if ``st`` finishes right after this iteration's pass.

        A dry run on a copy of the request's save state: close every open object and,
        for each sliding group whose history ran past the prompt, stage the live
        tail a continuation of the conversation needs -- the evicted copy of the
        block that left the window last, then the pages still live after this pass.
        """
        g = ctx.geometry
        policy = ctx.policy
        sv = st.saves
        sim = SaveState(
            st.request_id, st.chain, completed=sv.completed, save_from=sv.save_from,
            open={k: dataclasses.replace(v) for k, v in sv.open.items()},
            evicted={k: dataclasses.replace(v) for k, v in sv.evicted.items()},
        )
        e = sim.completed
        tpb = g.tokens_per_block
        prompt_blocks = st.prompt_len // tpb
        for grp in g.groups:
            gid = grp.group_id
            # Sliding group, history beyond the prompt: the live tail a continuation would need --
            # if the write policy keeps it.
            sliding_past = not policy.stores_everything(gid) and ctx.settings.save_decode and e > prompt_blocks
            to = self.writes.tail_to(st, self.writes.kind_at(st, e), e) if sliding_past else None
            if to is None:
                sim.close(gid)
                sim.release_evicted(gid)
                continue
            lo, hi = policy.tail(gid, e)
            start = max(lo, sim.save_from)
            buf = sim.open.get(gid)
            if buf is not None and buf.bid.first + buf.count == hi:
                # An open checkpoint tail already ends at the history end: it is the finish
                # tail if it reaches back far enough, else the finish tail replaces it (one
                # object per end block and request).
                if buf.bid.first <= start:
                    sim.seal(gid, close=True)
                    sim.release_evicted(gid)
                    continue
                sim.releases.append(buf.bid)
                del sim.open[gid]
            sim.close(gid)
            assert grp.window is not None
            # Pages the engine still holds when the plan runs: the page rule's cut at the history
            # (plus the overlap loop's in-flight token). (An engine that retains more keeps them
            # for nothing: the plan cannot know.)
            cut = max(0, window_cut(st.kv_tokens + self.inflight, grp.window, tpb))
            live = st.slots[gid] if gid < len(st.slots) else []
            first_live = next((o for o in range(max(start, cut), hi) if o < len(live) and live[o] >= 0), hi)
            ev = sim.evicted.pop(gid, None)
            if ev is not None:
                if start <= ev.bid.first and ev.bid.first + ev.count == first_live:
                    ev.to_s3 = to
                    sim.open[gid] = ev  # the evicted copy continues into the live pages
                    start = first_live
                else:
                    sim.releases.append(ev.bid)
            for o in range(start, hi):
                slot = live[o] if o >= cut and o < len(live) else -1
                if slot < 0:
                    sim.close(gid)
                    continue
                sim.stage(gid, o, slot, hi - o, to)
                buf = sim.open[gid]
                if o + 1 == buf.bid.first + buf.bid.capacity or o + 1 == hi:
                    sim.seal(gid, close=True)
            sim.close(gid)
        # A branch-point tail still open (the request ends before reaching it) is dropped.
        sim.releases += [buf.bid for buf in st.branch.open.values()]
        return FinishPlan(st.request_id, tuple(sim.stages), tuple(sim.seals), tuple(sim.releases))
