"""Save planning: which of a request's pages are staged and sealed into objects, and when.

Each report of what the engine computed (``build_connector_meta``'s ``RequestData``) is folded
into the request's state, then the blocks it completed are planned under the storage policy:
full-attention groups store every block, sliding groups only the tails a future hit can use
(before every checkpoint, at the prompt's end). Two extras keep sliding tails whole: the block
that leaves the window during decode is kept in host staging (``stage_evicted``) so the
finish plan can store the whole history-end tail, and a request served short of where the
full-attention chain is stored stages a tail ending at that branch point (``BranchTail``).
What of this goes to S3, and what is staged at all, the write policy decides (``writes.py``):
its plan is made at the request's first report, when its served point and stored chain are known.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ...core.hitrule import window_cut
from ...core.plan import TO_S3, BufferId, SealOp, StageOp
from ...core.value import BRANCH, HISTORY_END
from .context import LeaderContext
from .requests import Buffer, RequestState, group_lists
from .stats import LeaderStats
from .writes import WritePolicy

#: An own branch point another request of this engine set out to store is left to it this long
#: (seconds: its upload is known to the index by then), and at most this many are remembered.
_BRANCH_PENDING_S = 60.0
_BRANCH_PENDING_MAX = 4096


class SavePlanner:
    def __init__(self, stats: LeaderStats, writes: WritePolicy, inflight: int = 0):
        self.stats = stats
        self.writes = writes
        #: Tokens a forward may have written beyond what its report says (1 on the overlap loop).
        self.inflight = inflight
        #: Own branch points this engine set out to store lately: digest -> when (``_own_branch``).
        self._branching: OrderedDict[bytes, float] = OrderedDict()

    def on_report(self, ctx: LeaderContext, st: RequestState, rd: Any, *, first: bool) -> None:
        """Fold one RequestData into the request's state and plan this pass's saves."""
        g = ctx.geometry
        tpb = g.tokens_per_block
        by_group = group_lists(getattr(rd, "new_block_ids_by_layer_group", None), g.num_groups)
        if not by_group and g.num_groups == 1:
            by_group = [list(rd.new_block_ids)]
        if first:
            if not st.reported:
                st.tokens = list(rd.new_tokens) if rd.new_tokens else st.tokens
            st.slots = [list(x) for x in by_group] if by_group else [[] for _ in g.groups]
            st.lists_epoch += 1
            loaded_end = max(st.load.h_blocks, rd.computed_position // tpb)
            st.saves.save_from = (loaded_end // ctx.bpo) * ctx.bpo
            st.saves.completed = max(st.saves.completed, st.saves.save_from)
            st.reported = True
            st.load.parked = False
            self.writes.note_chain_below_device(st)
            if not st.branch.end:
                self._open_branch(ctx, st)
            self.writes.decide(st)
            to = self.writes.tail_to(st, BRANCH, st.branch.end) if st.branch.end else None
            if st.branch.next and to is None:
                st.branch.next.clear()  # refused: nothing staged for it
            # The chain ends an object at the branch point only for a tail stored with it.
            st.branch.chain = st.branch.chain and to is not None
            if st.branch.chain:
                self._note_branching(st)
        else:
            st.tokens.extend(rd.new_tokens)
            for gi, delta in enumerate(by_group):
                if gi < len(st.slots):
                    st.slots[gi].extend(delta)
        if len(st.slots) < g.num_groups:
            st.slots += [[] for _ in range(g.num_groups - len(st.slots))]
        begin = rd.computed_position
        if first and not st.load.load_async:
            # A sync load's first report has the honoured offer subtracted (it marks where the
            # load begins); this pass computes from h. (An async load's report is not reduced,
            # and a discarded async load really does restart at the device match.)
            begin = max(begin, st.load.h_blocks * tpb)
        upto = min(begin + rd.num_scheduled_tokens, max(st.prompt_len, begin + 1))
        upto = min(upto, len(st.tokens))
        sealed = len(st.saves.seals)
        self._plan(ctx, st, upto // tpb)
        self.writes.on_seals(st, st.saves.seals[sealed:])
        self._stage_evicted(ctx, st, upto)
        st.kv_tokens = max(st.kv_tokens, upto)

    def _where(self, ctx: LeaderContext, st: RequestState, gid: int, o: int, prompt_blocks: int) -> tuple[int, str] | None:
        """(end of the object block ``o`` of group ``gid`` goes into, where that object goes), or
        None when it is not staged: a chain block whose object the policy does not write, a
        sliding block no kept tail holds."""
        policy = ctx.policy
        if policy.stores_everything(gid):
            to = self.writes.chain_to(st, gid, o)
            return None if to is None else (policy.chunk_end(o, gid), to)
        # The furthest tail S3 gets, else the furthest one the host tier keeps. A tail kept from S3
        # must not take a block from one written to S3: it cut that tail short there (a useless
        # object in S3, the boundary never servable), where without a tier the refused tail is not
        # staged at all -- the tier must not change what S3 gets (the tier holds S3's objects too).
        kept = None
        for end in policy.tail_ends(gid, o, prompt_blocks):
            to = self.writes.tail_to(st, self.writes.kind_at(st, end), end)
            if to == TO_S3[0]:
                return end, to
            kept = kept or (None if to is None else (end, to))
        return kept

    def _plan(self, ctx: LeaderContext, st: RequestState, complete_blocks: int) -> None:
        g = ctx.geometry
        policy = ctx.policy
        sv = st.saves
        assert st.chain is not None
        if st.branch.next:
            self._plan_branch(ctx, st, complete_blocks)
        if complete_blocks <= sv.completed:
            return
        prompt_blocks = st.prompt_len // g.tokens_per_block
        if not ctx.settings.save_decode:
            complete_blocks = min(complete_blocks, prompt_blocks)
            if complete_blocks <= sv.completed:
                return
        st.chain.extend_to(st.tokens)
        self.stats.tokens_saved += max(0, complete_blocks - max(sv.completed, st.load.h_blocks)) * g.tokens_per_block
        for o in range(sv.completed, complete_blocks):
            for grp in g.groups:
                gid = grp.group_id
                slot = st.slots[gid][o] if o < len(st.slots[gid]) else -1
                where = self._where(ctx, st, gid, o, prompt_blocks) if slot >= 0 else None
                if where is not None:
                    sv.stage(gid, o, slot, where[0] - o, where[1])
                else:
                    sv.close(gid)
                buf = sv.open.get(gid)
                if buf is None:
                    continue
                if o + 1 == buf.bid.first + buf.bid.capacity:
                    sv.seal(gid, close=True)
                elif o + 1 == st.branch.end and st.branch.chain and policy.stores_everything(gid):
                    # The chain's object ends at the branch point (``_own_branch``); the rest of the
                    # chunk starts there, as after a prompt-end snapshot.
                    sv.seal(gid, close=True)
                elif o + 1 == prompt_blocks:
                    # Prompt-end snapshot: exact repeats hit here even though the object keeps
                    # filling (a chunk with generated blocks, a tail up to the next checkpoint) --
                    # where the write policy keeps the prompt-end boundary it serves.
                    to = self.writes.tail_to(st, self.writes.kind_at(st, prompt_blocks), prompt_blocks)
                    if to is not None and policy.stores_everything(gid):
                        # A chain's snapshot goes no further than its boundary's tail: in S3 alone it
                        # serves nothing, and shows other engines a chain past every tail there
                        # (they then place no branch tail where S3's tails end).
                        to = max(to, buf.to_s3, key=TO_S3.index)
                    more = self._where(ctx, st, gid, o + 1, prompt_blocks) is not None
                    # A full-attention snapshot that goes where the rest of its chunk goes ends the
                    # object: the rest starts at the prompt's end (``core.lookup``, objects that
                    # start inside a chunk) instead of storing the snapshot's pages twice.
                    split = not grp.is_sliding and to == buf.to_s3
                    if to is not None:
                        sv.seal(gid, close=not more or split, to_s3=to)
                    elif not more:
                        sv.close(gid)
        sv.completed = complete_blocks

    def _open_branch(self, ctx: LeaderContext, st: RequestState) -> None:
        """Decide, at the request's first report (its served point is final), whether it stores a
        branch-point tail (``StoragePolicy.branch_end``); if so, start staging it per sliding group."""
        g = ctx.geometry
        # A tail ends where the lookup found one even when less was served (a cut, a smaller honour).
        served = max(st.load.h_blocks, st.load.found_blocks)
        prompt_blocks = st.prompt_len // g.tokens_per_block
        end = ctx.policy.branch_end(self.writes.spine(st), served, prompt_blocks)
        if end is None:
            end = self._own_branch(ctx, st, prompt_blocks)
            if end is None:
                return
            st.branch.chain = True
        st.branch.end = end
        for grp in g.groups:
            if grp.is_sliding:
                st.branch.next[grp.group_id] = ctx.policy.tail(grp.group_id, end)[0]

    def _own_branch(self, ctx: LeaderContext, st: RequestState, prompt_blocks: int) -> int | None:
        """A branch point S3's chain cannot show: where this prompt left a recent prompt of this
        engine that went on past it too (``ChainMemo``, ``Chain.branch``), when S3 holds no tail
        ending there. Why: the chain objects of a shared document or system prompt end at the first
        prompt's end or at a chunk end, so a second prompt's lookup finds no object ending where the
        two part, and no later request of that prefix hits past the checkpoint below it (with
        checkpoints 8,192 tokens apart, none of a 4-8k document). This request has the prefix's
        pages (loaded, on the device or computed), so it writes the chain to the branch point as an
        object ending there, and the tail -- when the write policy finds them worth it (kind
        ``branch``). Only inside what this request writes anyway (from ``save_from``)."""
        assert st.chain is not None
        b = st.chain.branch
        if not b or b <= st.saves.save_from or b <= self.writes.chain_from(st):
            return None
        if ctx.policy.branch_end(b, 0, prompt_blocks) != b:
            return None  # a checkpoint, the prompt's end, no sliding group, or branch tails off
        g = ctx.geometry
        digest = st.chain.digests[b - 1]
        if all(self.writes.lookups.listings.holds(grp.group_id, digest, b) for grp in g.groups if grp.is_sliding):
            return None
        # Requests running side by side (a burst over one template) see the same branch before the
        # first one's upload is known: one of them stores it. Another may after a while, in case
        # that upload never landed.
        since = self._branching.get(digest)
        return b if since is None or self.writes.clock() - since >= _BRANCH_PENDING_S else None

    def _note_branching(self, st: RequestState) -> None:
        """``st`` stores its own branch point (the plan kept its tail): others leave it to it."""
        assert st.chain is not None
        digest = st.chain.digests[st.branch.end - 1]
        self._branching[digest] = self.writes.clock()
        self._branching.move_to_end(digest)
        while len(self._branching) > _BRANCH_PENDING_MAX:
            self._branching.popitem(last=False)

    def _plan_branch(self, ctx: LeaderContext, st: RequestState, complete_blocks: int) -> None:
        """Stage the branch-point tail's pages as they complete, into one object per sliding group
        ending at the branch point.

        Its own buffer, beside the policy's regular ones: the pages below the served point were
        loaded, not computed, so the regular plan (which starts at ``save_from``) never sees them,
        and a regular tail that overlaps this one must stay whole for its own hits. A page with no
        slot (already freed) makes the tail useless: it is dropped and counted -- except the block
        below what a hit at the branch point needs. That block serves only a prompt of exactly the
        branch's blocks (served one block short); where the request's history began at the branch
        point (its device match ended there, the usual own branch), the window there starts above
        it and the engine gives it no page: the tail starts at the first block a hit there needs.
        """
        br, sv = st.branch, st.saves
        end = br.end
        for gid, nxt in list(br.next.items()):
            slots = st.slots[gid] if gid < len(st.slots) else []
            lo_at = ctx.policy.hit_lo(gid, end)
            o = nxt
            while o < min(end, complete_blocks):
                slot = slots[o] if o < len(slots) else -1
                if slot < 0 and o < lo_at and gid not in br.open:
                    o = lo_at
                    continue
                if slot < 0:
                    old = br.open.pop(gid, None)
                    if old is not None:
                        sv.releases.append(old.bid)
                    del br.next[gid]
                    self.stats.branch_tails_abandoned += 1
                    break
                buf = br.open.get(gid)
                if buf is None:
                    to = self.writes.tail_to(st, BRANCH, end) or "now"
                    buf = br.open[gid] = Buffer(BufferId(st.request_id, gid, o, end - o), to_s3=to)
                sv.stages.append(StageOp(buf.bid, o, slot))
                buf.count += 1
                o += 1
            else:
                if o < end:
                    br.next[gid] = o
                    continue
                buf = br.open.pop(gid)
                del br.next[gid]
                assert st.chain is not None
                sv.seals.append(SealOp(buf.bid, buf.count, st.chain.digests[end - 1], True, buf.to_s3))
                self.stats.branch_tails += 1
                self.stats.branch_tail_pages += buf.count

    def _stage_evicted(self, ctx: LeaderContext, st: RequestState, upto: int) -> None:
        """Keep a host copy of the sliding block that leaves the window after this pass.

        A conversation's next turn needs, for history ``h``, the blocks from
        ``(h+1-W)//tpb``; when the request ends, the engine has already freed
        the one just below its live window whenever the last block is nearly
        full. Capturing each block as it leaves (one page per sliding group and
        request, replaced every block) lets ``request_finished`` store the whole
        tail without holding extra device pages.
        """
        g = ctx.geometry
        settings = ctx.settings
        sv = st.saves
        prompt_blocks = st.prompt_len // g.tokens_per_block
        if not settings.save_decode or settings.storage_policy != "window":
            return
        if upto <= prompt_blocks * g.tokens_per_block or settings.window_margin_blocks:
            return
        if self.writes.tail_to(st, HISTORY_END, prompt_blocks + 1) is None:
            return  # its history-end tail is not written: nothing to keep for it
        tpb = g.tokens_per_block
        for grp in g.groups:
            if not grp.is_sliding:
                continue
            gid = grp.group_id
            assert grp.window is not None
            # Highest ordinal freed after this pass (overlap loop: after the next, which may be
            # the finish: the forward ran one token past the report and the engine frees by it).
            leaving = window_cut(upto + self.inflight, grp.window, tpb) - 1
            before = window_cut(st.kv_tokens + self.inflight, grp.window, tpb) - 1
            if leaving <= before or leaving < sv.save_from:
                continue
            slot = st.slots[gid][leaving] if leaving < len(st.slots[gid]) else -1
            sv.release_evicted(gid)
            if slot < 0:
                continue
            # Room for the evicted block plus the live window the finish tail appends.
            cap = -(-grp.window // tpb) + 3
            buf = Buffer(BufferId(st.request_id, gid, leaving, cap))
            sv.stages.append(StageOp(buf.bid, leaving, slot))
            buf.count = 1
            sv.evicted[gid] = buf
