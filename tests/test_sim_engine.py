"""The simulator's own mechanics: geometry, the V2 page rule, reports/deltas, call order, async parking."""

from __future__ import annotations

import random

import pytest
import torch
from sim_connectors import OracleLeader, OracleStore, OracleWorker, RecordingLeader, RecordingWorker

from s3kv.sim import (
    FULL_ATTENTION,
    SimCacheConfig,
    SimContractError,
    SimEngine,
    SimHang,
    SimModel,
    SimRequestSpec,
    gemma3_like,
    generate_tokens,
    honour_minus_blocks,
    layer_groups,
    make_llm_args,
    preempt_once,
    random_tokens,
    request_root,
    sliding_cutoff,
)

# Window 64 + full attention, tokens_per_block 32: the contract's test fact geometry.
TWO_GROUPS = SimModel(num_layers=4, kv_heads=2, head_dim=8, max_attention_window=(64, FULL_ATTENTION))
CFG32 = SimCacheConfig(tokens_per_block=32, max_seq_len=1024)


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(random_tokens(random.Random(seed), n, 32000))


def engine(model=TWO_GROUPS, config=CFG32, *, log=None, tp_size=1, leader_kw=None, **kw) -> SimEngine:
    log = [] if log is None else log
    return SimEngine(
        model,
        config,
        RecordingLeader,
        RecordingWorker,
        tp_size=tp_size,
        connector_kwargs={"log": log, **(leader_kw or {})},
        **kw,
    )


def metas(log):
    return [e[1] for e in log if e[0] == "meta"]


# ------------------------------------------------------------------------------------------ geometry


def test_layer_groups_follow_the_engine_rule():
    g = layer_groups(SimModel(4, 2, 8, max_attention_window=(1024, 32768)), 8192)
    assert [(x.group_id, x.window, x.layer_ids) for x in g] == [(0, None, (1, 3)), (1, 1024, (0, 2))]
    g = layer_groups(SimModel(4, 2, 8, max_attention_window=(8192, 32768)), 8192)
    assert [(x.window, x.layer_ids) for x in g] == [(None, (0, 1, 2, 3))]
    assert [x.window for x in layer_groups(SimModel(3, 2, 8), 512)] == [None]
    # Ids are full first, then windows descending -- not the configured order.
    g = layer_groups(SimModel(6, 2, 8, max_attention_window=(32, 64, 32)), 1024)
    assert [(x.window, x.layer_ids) for x in g] == [(64, (1, 4)), (32, (0, 2, 3, 5))]
    g = layer_groups(gemma3_like(64), 1024)
    assert [(x.window, x.layer_ids) for x in g] == [(None, (5,)), (64, (0, 1, 2, 3, 4))]


def test_llm_args_per_rank():
    model = gemma3_like(64, kv_heads=4)
    args = [make_llm_args(model, CFG32, 2, r) for r in range(2)]
    for r, a in enumerate(args):
        m = a.parallel_config.to_mapping()
        assert (m.rank, m.world_size, m.tp_rank, m.tp_size) == (r, 2, r, 2)
        assert a.tensor_parallel_size == 2 and a.enable_attention_dp is False
        assert a.kv_cache_config.tokens_per_block == 32 and a.kv_cache_config.dtype == "bfloat16"
        assert a.kv_cache_config.max_attention_window == [64] * 5 + [FULL_ATTENTION]
        assert a.max_seq_len == 1024 and a.model == model.name


def test_tp_size_from_the_model_or_the_engine():
    model = gemma3_like(64, kv_heads=4, tp_size=2)
    assert SimEngine(model, CFG32, RecordingLeader, RecordingWorker).tp_size == 2
    assert (
        SimEngine(gemma3_like(64, kv_heads=4), CFG32, RecordingLeader, RecordingWorker, tp_size=4).tp_size
        == 4
    )
    with pytest.raises(ValueError, match="contradicts"):
        SimEngine(model, CFG32, RecordingLeader, RecordingWorker, tp_size=4)
    with pytest.raises(ValueError, match="divide"):
        gemma3_like(64, kv_heads=4, tp_size=3)


def test_layout_regions_padding_and_tp_shard_size():
    model = gemma3_like(64, kv_heads=4, regions_per_group=2)
    eng = engine(model, tp_size=2)
    w0, w1 = eng.workers
    assert w0.layout is not w1.layout
    for layout in (w0.layout, w1.layout):
        assert [g.window_size for g in layout.groups] == [None, 64]
        sizes = [(r.size, r.stride) for g in layout.groups for r in g.regions]
        assert any(s < st for s, st in sizes) and any(s == st for s, st in sizes)
        assert all(r.base > 0 for g in layout.groups for r in g.regions)
        full = layout.group(0)
        # One layer, K+V, 32 tokens, 2 of 4 heads (TP 2), head_dim 8, bf16 -> 2048 bytes; scales 2*32*2*4.
        assert [r.size for r in full.regions] == [2048, 512]
        assert [len(r.buffers) for r in layout.group(1).regions] == [10, 10]
        assert layout.group_of_layer(5).layer_group_id == 0
        # Fresh pages hold junk.
        assert bool((full.regions[0].slot_tensor(3) == 0xDB).all())


# ------------------------------------------------------------------------------------------ the page rule


def test_page_rule_contract_example():
    """window 64, tpb 32, prompt 256, offer 128 -> ordinals 0-1 are -1, 2-7 real."""
    log: list = []
    eng = engine(log=log, leader_kw={"offer": 128})
    rep = eng.run([SimRequestSpec(1, prompt(256), max_new_tokens=1)])
    alloc = [e for e in log if e[0] == "alloc"][0]
    _, rid, honoured, lists = alloc
    assert honoured == 128
    full, sliding = lists
    assert len(full) == 8 and all(s >= 0 for s in full)
    assert sliding[:2] == [-1, -1] and all(s >= 0 for s in sliding[2:]) and len(sliding) == 8
    # The recording leader promised 128 tokens and loaded nothing: the checker sees junk there.
    assert rep.kv_mismatches > 0
    assert {(m.kind, m.source, m.phase) for m in rep.mismatches} == {("junk", "connector", "load")}
    assert {m.ordinal for m in rep.mismatches} == {0, 1, 2, 3}  # full 0-3, sliding 2-3
    assert rep.by_id(1).matched_tokens == 128 and rep.by_id(1).computed_tokens == 128


def test_honour_fewer_changes_the_page_rule_and_matched_tokens():
    log: list = []
    eng = engine(log=log, leader_kw={"offer": 128}, honour=honour_minus_blocks(1, 32))
    rep = eng.run([SimRequestSpec(1, prompt(256), max_new_tokens=1)])
    _, _, honoured, (full, sliding) = [e for e in log if e[0] == "alloc"][0]
    assert honoured == 96
    assert sliding[:1] == [-1] and all(s >= 0 for s in sliding[1:])  # (96+1-64)//32 = 1
    new = [rd for out in metas(log) for rd in out.new_requests][0]
    assert new.computed_position == 0  # device match 0: the offer is subtracted on the first report
    assert rep.by_id(1).matched_tokens == 96 and rep.by_id(1).offered_tokens == 128


def test_contract_violations_fail_loudly():
    with pytest.raises(SimContractError, match="last prompt token"):
        engine(leader_kw={"offer": 256}).run([SimRequestSpec(1, prompt(256))])
    with pytest.raises(SimContractError, match="block"):
        engine(leader_kw={"offer": 40}).run([SimRequestSpec(1, prompt(256))])
    with pytest.raises(SimContractError, match=r"\(0, True\)"):

        class ZeroAsync(RecordingLeader):
            def get_num_new_matched_tokens(self, request, n):
                return 0, True

        SimEngine(TWO_GROUPS, CFG32, ZeroAsync, RecordingWorker).run([SimRequestSpec(1, prompt(64))])
    with pytest.raises(SimContractError, match="picklable"):
        engine(leader_kw={"unpicklable": True}).run([SimRequestSpec(1, prompt(64))])

    class Liar(RecordingWorker):
        def get_finished(self, a, b):
            return [], [12345]

    with pytest.raises(SimContractError, match="not handed"):
        SimEngine(TWO_GROUPS, CFG32, RecordingLeader, Liar).run([SimRequestSpec(1, prompt(64))])

    class NoGrouped:
        def __init__(self, llm_args, **kw):
            pass

        def get_num_new_matched_tokens(self, r, n):
            return 0, False

        def build_connector_meta(self, out):
            return None

    with pytest.raises(SimContractError, match="bring-up"):
        SimEngine(TWO_GROUPS, CFG32, NoGrouped, RecordingWorker)


# ------------------------------------------------------------------------------------------ reports


def rebuild(reports):
    """Per-group lists from a request's RequestData reports, as a connector must rebuild them."""
    lists: list[list[int]] = []
    for rd in reports:
        if not lists:
            lists = [list(d) for d in rd.new_block_ids_by_layer_group]
        else:
            for g, d in enumerate(rd.new_block_ids_by_layer_group):
                lists[g].extend(d)
    return lists


def test_chunked_prefill_reports_and_deltas():
    log: list = []
    p = prompt(256)
    rep = engine(log=log, chunk_size=128).run([SimRequestSpec(1, p, max_new_tokens=3)])
    reports = [
        (rd, first)
        for out in metas(log)
        for first, lst in ((True, out.new_requests), (False, out.cached_requests))
        for rd in lst
    ]
    assert [first for _, first in reports] == [True, False, False, False]
    r0, r1, g1, g2 = (rd for rd, _ in reports)
    # Report 0: computed_position 0, the whole prompt, this chunk's length; only the first chunk's pages.
    assert (r0.computed_position, r0.new_tokens, r0.num_scheduled_tokens) == (0, list(p), 128)
    assert [len(x) for x in r0.new_block_ids_by_layer_group] == [4, 4]
    assert r0.new_block_ids == [] and r0.block_hashes == [] and r0.priorities is None
    # Report 1: computed 128, no new tokens, the next four pages of each group as deltas.
    assert (r1.computed_position, r1.new_tokens, r1.num_scheduled_tokens) == (128, [], 128)
    assert [len(x) for x in r1.new_block_ids_by_layer_group] == [4, 4]
    out = generate_tokens(request_root(), p, 3, 32000)
    assert rep.by_id(1).output_tokens == tuple(out)
    # Generation: computed_position = len(tokens) - 1, one token scheduled, the tokens appended since.
    assert (g1.computed_position, g1.num_scheduled_tokens, g1.new_tokens) == (256, 1, out[:1])
    assert [len(x) for x in g1.new_block_ids_by_layer_group] == [1, 1]  # ordinal 8 for token 256
    assert (g2.computed_position, g2.new_tokens, g2.new_block_ids_by_layer_group) == (257, out[1:2], [[], []])
    # Ordinals number by adding the entries already seen; request_finished shows freed sliding pages as -1.
    full, sliding = rebuild([rd for rd, _ in reports])
    fin = [e for e in log if e[0] == "finished"][0][2]
    assert fin[0] == full
    cut = sliding_cutoff(258, 64, 32)  # history after the last step
    assert cut == 6
    assert fin[1] == [-1] * cut + sliding[cut:]
    assert len(set(full)) == 9 and all(s >= 0 for s in sliding)


def test_single_group_fills_flat_new_block_ids_too():
    log: list = []
    eng = engine(SimModel(2, 2, 8), log=log)
    eng.run([SimRequestSpec(1, prompt(100), max_new_tokens=1)])
    rd = metas(log)[0].new_requests[0]
    assert rd.new_block_ids == rd.new_block_ids_by_layer_group[0] and len(rd.new_block_ids) == 4


def test_call_order_per_iteration_and_pickled_metadata():
    log: list = []
    eng = engine(log=log, tp_size=2)
    eng.run([SimRequestSpec(1, prompt(64), max_new_tokens=2)])
    L = TWO_GROUPS.num_layers
    for rank in (0, 1):
        seq = [e for e in log if e[0] not in ("meta", "match", "alloc", "finished") and e[1] == rank]
        one = [("start_load_kv", rank)]
        for layer in range(L):
            one += [("wait_layer", rank, layer), ("save_layer", rank, layer)]
        one += [("wait_for_save", rank)]
        assert [e[:3] if e[0] != "get_finished" else e[:2] for e in seq[: len(one) + 1]] == one + [
            ("get_finished", rank)
        ]
    # Metadata goes through pickle: equal on every rank, never the same object.
    w0, w1 = eng.workers
    assert w0.bound[0] == w1.bound[0] and w0.bound[0] is not w1.bound[0]
    # Order of leader calls: match -> alloc -> meta, in the first iteration.
    assert [e[0] for e in log[:3]] == ["match", "alloc", "meta"]


def test_output_is_deterministic_across_engines():
    specs = [SimRequestSpec(i, prompt(90, seed=i), max_new_tokens=5) for i in range(3)]
    a = engine().run(specs)
    b = engine(chunk_size=32, max_batch=1).run(
        [SimRequestSpec(i + 10, s.prompt, max_new_tokens=5) for i, s in enumerate(specs)]
    )
    assert [r.output_tokens for r in a.requests] == [r.output_tokens for r in b.requests]
    assert a.kv_mismatches == b.kv_mismatches == 0 and a.pages_audited > 0


# ------------------------------------------------------------------------------------------ sliding frees


class JunkProbeLeader(RecordingLeader):
    """Tells the worker which sliding pages must be junk (freed) and which must still hold KV."""

    def __init__(self, llm_args, *, extra: int = 0, **kw):
        super().__init__(llm_args, **kw)
        self.extra = extra
        self.lists: dict[int, list[list[int]]] = {}

    def build_connector_meta(self, out):
        probe = {"junk": [], "live": []}
        for rd in out.new_requests:
            self.lists[rd.request_id] = [list(x) for x in rd.new_block_ids_by_layer_group]
        for rd in out.cached_requests:
            lists = self.lists[rd.request_id]
            for g, d in enumerate(rd.new_block_ids_by_layer_group):
                lists[g].extend(d)
            # Pages of ordinals left of the window at this history were freed after the last forward.
            cut = sliding_cutoff(rd.computed_position, 64, 32)
            sliding = lists[1]
            new = set(rd.new_block_ids_by_layer_group[1])
            for o, slot in enumerate(sliding):
                if (
                    slot < 0 or slot in new
                ):  # a freed slot may be reused for a new ordinal: it is junk until written
                    continue
                if o < cut - self.extra:
                    probe["junk"].append(slot)
                elif o < cut:
                    probe["live"].append(slot)
            lists[1] = [-1 if o < cut - self.extra else s for o, s in enumerate(sliding)]
        super().build_connector_meta(out)
        return probe


class JunkProbeWorker(RecordingWorker):
    def __init__(self, llm_args, **kw):
        super().__init__(llm_args, **kw)
        self.seen = {"junk": 0, "live": 0}

    def start_load_kv(self, stream):
        region = self.layout.group(1).regions[0]
        for slot in self._metadata["junk"]:
            assert bool((region.slot_tensor(slot) == 0xDB).all()), f"freed slot {slot} not junked"
            self.seen["junk"] += 1
        for slot in self._metadata["live"]:
            assert not bool((region.slot_tensor(slot) == 0xDB).all()), f"retained slot {slot} was junked"
            self.seen["live"] += 1


@pytest.mark.parametrize("extra", [0, 1])
def test_sliding_pages_are_freed_and_junked_after_leaving_the_window(extra):
    eng = SimEngine(
        TWO_GROUPS,
        CFG32,
        JunkProbeLeader,
        JunkProbeWorker,
        connector_kwargs={"extra": extra},
        extra_retained_blocks=extra,
    )
    rep = eng.run([SimRequestSpec(1, prompt(40), max_new_tokens=200)])
    seen = eng.workers[0].seen
    assert seen["junk"] >= 3 and (seen["live"] > 0) == bool(extra)
    assert rep.ok and rep.pages_audited > 0
    # Live sliding pages never exceed ceil(W/tpb) + 1 (+ extra): the pool got them back.
    assert eng.allocators[1].in_use == 0


# ------------------------------------------------------------------------------------------ async, holds, replays


class DelayRank1(RecordingWorker):
    """Rank 1 returns ids three get_finished calls late."""

    def __init__(self, llm_args, **kw):
        super().__init__(llm_args, **kw)
        self.pending: dict[int, int] = {}
        self.pending_save: dict[int, int] = {}

    def get_finished(self, fin, started):
        self.log.append(("get_finished", self.rank, list(fin), list(started)))
        if self.rank == 0:
            return list(fin), list(started)
        out = []
        for w, ids in ((self.pending_save, fin), (self.pending, started)):
            for rid in ids:
                w[rid] = 3
            due = [rid for rid, n in w.items() if n == 0]
            for rid in list(w):
                w[rid] -= 1
                if rid in due:
                    del w[rid]
            out.append(due)
        return out[0], out[1]


def test_async_request_is_parked_and_resumes_after_every_rank():
    log: list = []
    eng = SimEngine(
        TWO_GROUPS,
        CFG32,
        RecordingLeader,
        DelayRank1,
        tp_size=2,
        connector_kwargs={"log": log, "offer": 128, "is_async": True, "hold_on_finish": True},
    )
    rep = eng.run([SimRequestSpec(7, prompt(256), max_new_tokens=2)])
    outs = metas(log)
    # Iteration 0: parked -> not in the scheduler output; its id goes to get_finished on every rank.
    assert outs[0].new_requests == [] and outs[0].cached_requests == []
    gf0 = [e for e in log if e[0] == "get_finished"][:2]
    assert [e[3] for e in gf0] == [[7], [7]]
    # It resumes only after rank 1 returned it, reported new with computed_position = match + honoured.
    first = next(i for i, o in enumerate(outs) if o.new_requests)
    assert first == 1  # iterations that schedule nothing build no metadata
    at = next(i for i, e in enumerate(log) if e[0] == "meta" and e[1].new_requests)
    assert sum(1 for e in log[:at] if e[0] == "get_finished" and e[1] == 0) == 4  # rank 1 returned it in iteration 3
    rd = outs[first].new_requests[0]
    assert (rd.computed_position, rd.num_scheduled_tokens, len(rd.new_tokens)) == (128, 128, 256)
    # request_finished returned True: its id is handed over as finished-generating, pages held until both return.
    handed = [e for e in log if e[0] == "get_finished" and e[2]]
    assert {e[1] for e in handed} == {0, 1} and all(e[2] == [7] for e in handed)
    r = rep.by_id(7)
    assert r.loaded_async and r.matched_tokens == 128
    # Rank 1 returns a saving id 3 calls later; the engine went idle first (it calls nothing then),
    # so the pages stay held until traffic makes the loop run again.
    assert rep.held_while_idle == (7,) and eng.allocators[0].in_use > 0
    assert eng.drain_held(prompt_len=256) >= 1 and 7 not in eng.held_request_ids
    assert eng.allocators[0].in_use + eng.allocators[1].in_use == eng.held_pages()


def test_async_discard_recomputes_and_is_reported():
    log: list = []
    eng = SimEngine(
        TWO_GROUPS,
        CFG32,
        RecordingLeader,
        RecordingWorker,
        connector_kwargs={"log": log, "offer": 128, "is_async": True},
        discard_hook=lambda rid, attempt: True,
    )
    rep = eng.run([SimRequestSpec(3, prompt(256), max_new_tokens=1)])
    rd = [o for o in metas(log) if o.new_requests][0].new_requests[0]
    assert rd.computed_position == 0 and rd.num_scheduled_tokens == 256
    full, sliding = rd.new_block_ids_by_layer_group
    assert all(s >= 0 for s in sliding)  # the discarded load's -1 ordinals got pages to recompute into
    r = rep.by_id(3)
    assert r.discarded and r.matched_tokens == 0 and r.computed_tokens == 256
    assert rep.kv_mismatches == 0  # the recording connector loaded nothing, and nothing was promised now


def test_preempted_request_is_replayed_from_scratch():
    log: list = []
    eng = engine(log=log, chunk_size=64, preempt_hook=preempt_once(after_chunks=2))
    rep = eng.run([SimRequestSpec(5, prompt(256), max_new_tokens=2)])
    assert [e[0] for e in log if e[0] in ("match", "alloc")] == ["match", "alloc", "match", "alloc"]
    news = [rd for o in metas(log) for rd in o.new_requests]
    assert [rd.request_id for rd in news] == [5, 5]
    assert all(rd.computed_position == 0 and len(rd.new_tokens) == 256 for rd in news)
    assert rep.by_id(5).replays == 1 and rep.ok
    assert rep.by_id(5).output_tokens == tuple(generate_tokens(request_root(), prompt(256), 2, 32000))


def test_device_match_prefills_pages_and_is_checked():
    log: list = []
    rep = engine(log=log).run([SimRequestSpec(1, prompt(200), max_new_tokens=1, device_match_tokens=128)])
    assert ("match", 1, 128) in log
    rd = metas(log)[0].new_requests[0]
    assert rd.computed_position == 128
    # Device pages: full group 4 ordinals, sliding group ordinals >= (129-64)//32 = 2 of the 4.
    assert rep.pages_checked == 6 and rep.kv_mismatches == 0
    r = rep.by_id(1)
    assert (r.device_match_tokens, r.matched_tokens, r.computed_tokens) == (128, 0, 72)


# ------------------------------------------------------------------------------------------ bounded runs


def test_unsatisfiable_dependency_raises_simhang():
    with pytest.raises(SimHang) as e:
        engine().run([SimRequestSpec(1, prompt(64), after=(999,))])
    assert 1 in e.value.stuck and "999" in str(e.value)


def test_pool_too_small_raises_simhang_not_a_hang():
    eng = engine(config=SimCacheConfig(tokens_per_block=32, max_seq_len=1024, pages_per_group=4))
    with pytest.raises(SimHang, match="nothing can be admitted"):
        eng.run([SimRequestSpec(1, prompt(300))])


def test_guard_bytes_catch_a_write_past_a_slot():
    class Scribbler(RecordingWorker):
        def start_load_kv(self, stream):
            for g in self.layout.groups:
                for r in g.regions:
                    if r.stride > r.size:  # the padding after slot 0
                        r.storage[r.base + r.size] = 0

    eng = SimEngine(TWO_GROUPS, CFG32, RecordingLeader, Scribbler)
    rep = eng.run([SimRequestSpec(1, prompt(64), max_new_tokens=1)])
    assert rep.guard_violations > 0 and not rep.ok


def test_oracle_smoke_on_cpu_tensors_only():
    """The pools live on the requested device; here CPU, and stream is None."""
    store = OracleStore()
    seen = []

    class StreamCheck(OracleWorker):
        def start_load_kv(self, stream):
            seen.append(stream)
            super().start_load_kv(stream)

    eng = SimEngine(
        gemma3_like(64),
        SimCacheConfig(tokens_per_block=16, max_seq_len=512),
        OracleLeader,
        StreamCheck,
        connector_kwargs={"store": store},
    )
    eng.run([SimRequestSpec(1, prompt(100))])
    assert set(seen) == {None} and eng.pools[0].arena.device == torch.device("cpu")


# ------------------------------------------------------------------------------------------ overlap loop


def _passes(log):
    """The log split at each get_finished (the last call of every pass), as lists of calls."""
    out, cur = [], []
    for e in log:
        cur.append(e)
        if e[0] == "get_finished":
            out.append(cur)
            cur = []
    return out


@pytest.mark.parametrize("stop_after", [None, 3])
def test_overlap_loop_call_order(stop_after):
    """py_executor @0004396 ``_executor_loop_overlap``: generation reports are one token behind the
    position the forward writes; a length-limited request is not scheduled after its last token
    (GENERATION_TO_COMPLETE) and gets request_finished in the next pass, after that pass's
    metadata and forward for the others; one ending on a stop token gets one extra forward."""
    log: list = []
    a = SimRequestSpec(1, prompt(40, 1), max_new_tokens=5, stop_after=stop_after)
    b = SimRequestSpec(2, prompt(40, 2), max_new_tokens=12)
    eng = engine(log=log, overlap=True)
    assert eng.llm_args[0].disable_overlap_scheduler is False
    rep = eng.run([a, b])
    want = generate_tokens(request_root(), a.prompt, stop_after or 5, 32000)
    assert rep.by_id(1).output_tokens == tuple(want)  # the extra forward's token never shows
    reports = [rd for m in metas(log) for rd in m.new_requests + m.cached_requests if rd.request_id == 1]
    # Pass 1: the prompt (40 tokens) computes, the first token is sampled on the device.
    assert (reports[0].computed_position, reports[0].num_scheduled_tokens) == (0, 40)
    # Generation: the forward of report k writes position 40 + k - 1; the host knows one token less.
    for k, rd in enumerate(reports[1:], start=1):
        assert rd.computed_position == 40 + k - 2 and rd.num_scheduled_tokens == 1
        assert len(rd.new_tokens) == (0 if k == 1 else 1)
    n_out = stop_after or 5
    # Length-limited: forwards for the prompt and for tokens 1..4 (the 5th is sampled, never read);
    # a stop token after 3 tokens is read by one extra forward the host did not know to skip.
    assert len(reports) == (n_out + 1 if stop_after else n_out)
    passes = _passes(log)
    last_fwd = max(i for i, p in enumerate(passes) if any(
        e[0] == "meta" and any(rd.request_id == 1 for rd in e[1].cached_requests + e[1].new_requests) for e in p))
    fin = next(i for i, p in enumerate(passes) if any(e[0] == "finished" and e[1] == 1 for e in p))
    p = passes[fin]
    kinds = [e[0] for e in p]
    if stop_after:
        assert fin == last_fwd  # the extra forward's pass processes the stop token: request_finished there
    else:
        assert fin == last_fwd + 1
    # request_finished comes after this pass's metadata and forward (b still decodes).
    assert kinds.index("meta") < kinds.index("wait_for_save") < kinds.index("finished") < kinds.index("get_finished")


def test_overlap_frees_the_block_that_left_the_window_after_request_finished():
    """(h + 1) % tpb == 0: update_resources of the last batch frees a sliding page after
    request_finished (lists still hold it) and before get_finished, also for a held request."""
    log: list = []
    a = SimRequestSpec(1, prompt(100, 3), max_new_tokens=28)  # 128 tokens: h = 127
    eng = engine(log=log, overlap=True, leader_kw={"hold_on_finish": True})
    freed: list = []
    orig = eng._free_page

    def spy(st, gi, o):
        freed.append((len(log), gi, o))
        orig(st, gi, o)

    eng._free_page = spy  # type: ignore[method-assign]
    eng.run([a])
    fin = next(i for i, e in enumerate(log) if e[0] == "finished")
    sliding = next(g.group_id for g in eng.groups if g.sliding)
    lists = log[fin][2]
    cut_before = sliding_cutoff(126, 64, 32)  # the history the last forward's report implies
    cut_after = sliding_cutoff(127, 64, 32)
    assert cut_after == cut_before + 1
    assert lists[sliding][cut_before] >= 0  # request_finished still sees the page ...
    gf = next(i for i, e in enumerate(log) if e[0] == "get_finished" and i > fin)
    assert any(fin < at <= gf and gi == sliding and o == cut_before for at, gi, o in freed)  # ... freed before get_finished
