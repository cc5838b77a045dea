"""LeaderCore's per-iteration plans, driven directly with RequestData-shaped fakes (s3kv/engine/leader/)."""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import pytest

from s3kv.config import Settings
from s3kv.core.hitrule import Span, servable
from s3kv.core.keys import KeyScheme, chain_digests, chain_root, namespace_digest
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.core.objects import ObjectIdentity, encode_object, object_metadata
from s3kv.core.plan import ConnectorMetadata
from s3kv.engine.leader import LeaderCore
from s3kv.store.base import StoreWrapper
from s3kv.store.memory import MemoryStore

TPB = 16
WINDOW = 64  # 4 blocks
BPO = 4
SLIDING, FULL = 0, 1


def geometry(tp: int = 1) -> CacheGeometry:
    return CacheGeometry(
        tokens_per_block=TPB,
        groups=(
            GroupGeometry(0, WINDOW, (0, 1, 2), (96,)),
            GroupGeometry(1, None, (3,), (32,)),
        ),
        tp_size=tp,
        kv_dtype="bf16",
        model_id="test-model",
    )


def make_core(g: CacheGeometry | None = None, store=None, **settings) -> LeaderCore:
    g = g or geometry()
    base = {"blocks_per_object": BPO, "checkpoint_tokens": 8 * BPO * TPB, "storage_policy": "all"}
    base.update(settings)
    s = Settings(url="memory://t", **{"lookup_timeout_s": 5.0, **base})
    # Sync loads exist only on engines with a failed-load hook (else the leader loads async).
    return LeaderCore(s, store if store is not None else MemoryStore(), "pfx", tp_size=g.tp_size,
                      model_id=g.model_id, kv_dtype=g.kv_dtype, geometry=g,
                      failed_load_hook=s.load_mode == "sync")


def toks(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7_919 + i * 104_729) % 151_000 for i in range(n)]


def rd(rid, new_tokens=(), slots=None, cp=0, ns=0, salt=None):
    return SimpleNamespace(
        request_id=rid,
        new_tokens=list(new_tokens),
        new_block_ids=[],
        computed_position=cp,
        num_scheduled_tokens=ns,
        block_hashes=[],
        priorities=None,
        cache_salt=salt,
        new_block_ids_by_layer_group=slots if slots is not None else [],
    )


class Slots:
    """Hands out unique page slots per group (distinct ranges so a mix-up shows)."""

    def __init__(self, g: CacheGeometry):
        self.next = [itertools.count(1000 * (grp.group_id + 1)) for grp in g.groups]
        self.g = g

    def alloc(self, n: int) -> list[list[int]]:
        return [[next(self.next[grp.group_id]) for _ in range(n)] for grp in self.g.groups]


def digests_for(g: CacheGeometry, tokens, salt=None) -> list[bytes]:
    return chain_digests(chain_root(namespace_digest(g), cache_salt=salt), tokens, g.tokens_per_block)


def stages_of(metas) -> list:
    return [op for m in metas for op in m.stages]


def check_seals(g, metas, tokens, salt=None, bpo=BPO) -> None:
    """Every seal names the chain digest of its object's last block and covers staged pages only."""
    d = digests_for(g, tokens, salt)
    staged: dict = {}
    for m in metas:
        for op in m.stages:
            staged.setdefault(op.buffer, set()).add(op.ordinal)
        for seal in m.seals:
            last = seal.buffer.first + seal.count - 1
            assert seal.last_digest == d[last], f"seal of {seal.buffer} names the wrong digest"
            assert set(range(seal.buffer.first, last + 1)) <= staged.get(seal.buffer, set())
            assert seal.count <= seal.buffer.capacity
            if g.groups[seal.buffer.group].window is None:
                # Full-attention objects end on chunk bounds (sliding tails end at their boundary).
                assert (seal.buffer.first + seal.buffer.capacity) % bpo == 0


def finish(core, rid, lists, metas):
    """``request_finished``, then what each worker runs for ``rid`` in that iteration's ``get_finished``:
    the last standing finish plan the metadata carried, as metadata ops (stages, seals, releases)."""
    busy = core.request_finished(rid, lists)
    plan = None
    for m in metas:
        for p in m.finish_plans:
            if p.request_id == rid:
                plan = p
    if plan is None:
        return busy, ConnectorMetadata()
    return busy, ConnectorMetadata(stages=plan.stages, seals=plan.seals, releases=plan.releases)


def run_prefill(core, rid, tokens, slots_by_group, *, chunk=None, salt=None):
    """Report a prompt in chunks (None = one pass); returns the metadata of each iteration."""
    P = len(tokens)
    chunk = chunk or P
    metas = []
    cp = 0
    reported = [0] * len(slots_by_group)
    first = True
    while cp < P:
        ns = min(chunk, P - cp)
        upto_blocks = -(-(cp + ns) // TPB)
        delta = [lst[reported[i] : upto_blocks] for i, lst in enumerate(slots_by_group)]
        reported = [max(r, upto_blocks) for r in reported]
        r = rd(rid, tokens if first else [], delta, cp, ns, salt)
        metas.append(core.build_connector_meta([r], []) if first else core.build_connector_meta([], [r]))
        first = False
        cp += ns
    return metas


# ---------------------------------------------------------------- prefill, "all" policy


@pytest.mark.parametrize("prompt_len", [10 * TPB + 3, 8 * TPB, 1 * TPB + 1, TPB - 1, 37 * TPB + 15])
@pytest.mark.parametrize("chunk", [None, 2 * TPB, WINDOW // 2 + 8, 3 * TPB + 5, 5 * TPB, 8 * TPB, 5 * TPB + 3])
def test_every_block_of_every_group_staged_exactly_once(prompt_len, chunk):
    g = geometry()
    core = make_core(g)
    tokens = toks(prompt_len, seed=prompt_len)
    assert core.get_num_new_matched_tokens(7, tokens, prompt_len, 0) == (0, False)
    slots = Slots(g).alloc(-(-prompt_len // TPB))
    metas = run_prefill(core, 7, tokens, slots, chunk=chunk)
    # Each block is staged in the iteration its last token is computed.
    cp = 0
    for m in metas:
        ns = min(chunk or prompt_len, prompt_len - cp)
        want = set(range(cp // TPB, (cp + ns) // TPB))
        for grp in g.groups:
            got = sorted(op.ordinal for op in m.stages if op.buffer.group == grp.group_id)
            assert set(got) == want and len(got) == len(want)
        cp += ns
    busy, final = finish(core, 7, slots, metas)
    metas.append(final)
    blocks = prompt_len // TPB
    for grp in g.groups:
        ops = [op for op in stages_of(metas) if op.buffer.group == grp.group_id]
        assert sorted(op.ordinal for op in ops) == list(range(blocks))
        assert all(op.slot == slots[grp.group_id][op.ordinal] for op in ops)
        assert all(op.buffer.first <= op.ordinal < op.buffer.first + op.buffer.capacity for op in ops)
    check_seals(g, metas, tokens)
    # Every staged page ends up in a sealed object (nothing staged is silently dropped).
    sealed = {(s.buffer, o) for m in metas for s in m.seals for o in range(s.buffer.first, s.buffer.first + s.count)}
    assert {(op.buffer, op.ordinal) for op in stages_of(metas)} <= sealed
    assert busy == bool(metas[-1].seals or metas[-1].stages or metas[-1].releases)
    assert core.active_requests() == 0


def test_seals_and_prompt_end_snapshot():
    g = geometry()
    core = make_core(g)
    P = 10 * TPB + 3  # 10 full blocks: chunks [0,4) [4,8), then [8,10) is a snapshot
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    slots = Slots(g).alloc(11)
    (meta,) = run_prefill(core, 1, tokens, slots)
    d = digests_for(g, tokens)
    for grp in g.groups:
        seals = sorted((s for s in meta.seals if s.buffer.group == grp.group_id), key=lambda s: s.buffer.first)
        # A full-attention snapshot ends its object (the rest of the chunk starts at block 10); a
        # sliding group's keeps filling its buffer (its hits need whole tails, not chains).
        assert [(s.buffer.first, s.count, s.close) for s in seals] == [
            (0, 4, True), (4, 4, True), (8, 2, not grp.is_sliding)]
        assert [s.last_digest for s in seals] == [d[3], d[7], d[9]]
    check_seals(g, [meta], tokens)


def test_salted_request_seals_salted_digests():
    g = geometry()
    core = make_core(g)
    P = 8 * TPB + 1
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0, cache_salt="tenant")
    metas = run_prefill(core, 1, tokens, Slots(g).alloc(9), salt="tenant")
    check_seals(g, metas, tokens, salt="tenant")
    assert metas[0].seals[0].last_digest != digests_for(g, tokens)[3]


def test_report_without_lookup_is_never_saved():
    """RequestData carries the salt but not the LoRA id or multimodal hashes: KV of a request the
    connector never looked up has no key that names it fully (a LoRA's KV would be served to the
    base model). It is not saved, and counted."""
    g = geometry()
    core = make_core(g)
    P = 8 * TPB + 1
    tokens = toks(P)
    metas = run_prefill(core, 3, tokens, Slots(g).alloc(9))
    assert not any(m.stages or m.seals or m.finish_plans for m in metas)
    assert core.stats.unkeyed_not_saved == 1 and core.active_requests() == 0


# ---------------------------------------------------------------- decode


def decode(core, rid, tokens, slots, slot_src, n, *, start_extra=0):
    """Generate ``n`` tokens one step at a time; returns metadata per step (tokens/slots grow in place)."""
    metas = []
    for i in range(n):
        tokens.append(90_000 + start_extra + i)
        cp = len(tokens) - 1
        delta = [[] for _ in slots]
        if cp // TPB >= len(slots[0]):
            new = slot_src.alloc(1)
            for gi in range(len(slots)):
                slots[gi].extend(new[gi])
                delta[gi] = new[gi]
        metas.append(core.build_connector_meta([], [rd(rid, [tokens[-1]], delta, cp, 1)]))
    return metas


@pytest.mark.parametrize("save_decode", [True, False])
def test_decode_blocks_staged_as_generation_fills_them(save_decode):
    g = geometry()
    core = make_core(g, save_decode=save_decode)
    P = 10 * TPB + 3
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    src = Slots(g)
    slots = src.alloc(11)
    metas = run_prefill(core, 1, tokens, slots)
    steps = decode(core, 1, tokens, slots, src, 3 * TPB)
    for m in steps:
        assert m.iteration > metas[0].iteration
    # Which step completes which block: after step i, cp + 1 tokens have KV.
    for i, m in enumerate(steps):
        valid = P + 1 + i  # tokens with KV after this step's forward
        completes = {valid // TPB - 1} if valid % TPB == 0 else set()
        got = {op.ordinal for op in m.stages}
        if save_decode:
            assert got == completes, f"step {i}: staged {got}, expected {completes}"
            for op in m.stages:
                assert op.slot == slots[op.buffer.group][op.ordinal]
        else:
            assert got == set()
    all_metas = metas + steps
    if save_decode:
        # The [8, 12) chunk: the snapshot at 10 (prompt end) ends its object, and the generated
        # blocks go in [10, 12), sealed when block 11 completes -- no page stored twice.
        full_seals = [(s.buffer.first, s.count, s.close) for m in all_metas for s in m.seals if s.buffer.group == FULL]
        assert (8, 2, True) in full_seals and (10, 2, True) in full_seals and (8, 4, True) not in full_seals
        check_seals(g, all_metas, tokens)
    busy, final = finish(core, 1, slots, all_metas)
    if save_decode:
        # Block 12 is open in buffer [12, 16) and gets sealed at finish.
        assert busy
        assert {(s.buffer.first, s.count) for s in final.seals} == {(12, 1)}
        check_seals(g, all_metas + [final], tokens)
    else:
        # The snapshot buffer is released without another upload.
        assert busy and {b.first for b in final.releases} == {8}
        assert not final.seals and not final.stages
    assert core.active_requests() == 0


def test_window_policy_stages_live_sliding_tail_at_finish():
    g = geometry()
    core = make_core(g, storage_policy="window", checkpoint_tokens=64 * TPB, window_margin_blocks=1)
    P = 20 * TPB + 3
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    src = Slots(g)
    slots = src.alloc(21)
    metas = run_prefill(core, 1, tokens, slots)
    sliding = sorted(op.ordinal for op in metas[0].stages if op.buffer.group == SLIDING)
    full = sorted(op.ordinal for op in metas[0].stages if op.buffer.group == FULL)
    assert full == list(range(20))
    # Tail before the prompt end only: hits at 20 and 19 need [(19*16+1-64)//16 - 1, 20) = [14, 20).
    assert sliding == list(range(14, 20))
    metas += decode(core, 1, tokens, slots, src, 4 * TPB)
    history = len(tokens) // TPB  # 24 full blocks
    # The engine keeps only the window live: older sliding slots are -1 at finish.
    live = [[s if o >= history - WINDOW // TPB - 2 else -1 for o, s in enumerate(slots[SLIDING])], slots[FULL]]
    busy, final = finish(core, 1, live, metas)
    assert busy is True
    tail = sorted(op.ordinal for op in final.stages if op.buffer.group == SLIDING)
    # The plan is made before the engine says what it still holds: it copies what the page rule
    # keeps after the last pass ([cut, history)), never a page the rule says is gone. (With a
    # margin no evicted block is kept in staging: such a tail cannot serve its history end.)
    cut = (len(tokens) - 1 + 1 - WINDOW) // TPB
    assert tail == list(range(cut, history))
    assert all(op.slot == slots[SLIDING][op.ordinal] for op in final.stages)
    check_seals(g, metas + [final], tokens)
    assert core.active_requests() == 0


def sealed_pages(metas, group) -> set[int]:
    return {o for m in metas for s in m.seals if s.buffer.group == group
            for o in range(s.buffer.first, s.buffer.first + s.count)}


def test_window_policy_decode_seals_sliding_tails_before_checkpoints_only():
    g = geometry()
    cp_blocks = 2 * BPO  # 8
    core = make_core(g, storage_policy="window", checkpoint_tokens=cp_blocks * TPB, window_margin_blocks=0)
    P = 5 * TPB + 5
    tokens = toks(P, seed=21)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    src = Slots(g)
    slots = src.alloc(6)
    metas = run_prefill(core, 1, tokens, slots)
    metas += decode(core, 1, tokens, slots, src, 20 * TPB - P)
    assert len(tokens) == 20 * TPB

    def lo(b):  # first real sliding page for history b blocks (engine rule, no margin)
        return max(0, (b * TPB + 1 - WINDOW) // TPB)

    want = set(range(lo(4), 5))  # hits at the prompt end (5) and one block below
    # A tail is one object ending at its checkpoint, sealed when the checkpoint is
    # reached: the tail before checkpoint 24 (from block 19) is still open here.
    for c in (8, 16):
        want |= set(range(lo(c - 1), c))
    want = {o for o in want if o < 20}
    # Before the request ends, only prompt-end and checkpoint tails become objects.
    assert sealed_pages(metas, SLIDING) == want, "sliding group sealed outside prompt-end/checkpoint tails"
    # Host copies beyond those tails are at most one page per sliding group (the block leaving the window).
    extra = {op.ordinal for op in stages_of(metas) if op.buffer.group == SLIDING} - want
    assert len(extra) <= 20 - 5
    assert sealed_pages(metas, FULL) == set(range(20))
    ends = {s.buffer.first + s.count for m in metas for s in m.seals if s.buffer.group == SLIDING}
    assert {8, 16} <= ends  # each checkpoint tail ends exactly at its checkpoint
    check_seals(g, metas, tokens)


def test_not_cacheable_request_is_a_miss_and_never_saved():
    g = geometry()
    core = make_core(g)
    tokens = toks(9 * TPB + 1)
    assert core.get_num_new_matched_tokens(1, tokens, len(tokens), 0, has_multimodal=True) == (0, False)
    assert core.stats.not_cacheable == 1
    metas = run_prefill(core, 1, tokens, Slots(g).alloc(10))
    assert not metas[0].stages and not metas[0].seals
    assert core.request_finished(1, [[], []]) is False
    assert core.active_requests() == 0


def test_geometry_arriving_late():
    g = geometry()
    box: dict = {}
    s = Settings(url="memory://t", blocks_per_object=BPO, storage_policy="all")
    core = LeaderCore(s, MemoryStore(), "pfx", tp_size=1, model_id=g.model_id, kv_dtype=g.kv_dtype,
                      geometry=lambda: box.get("g"))
    tokens = toks(9 * TPB + 1)
    assert core.get_num_new_matched_tokens(1, tokens, len(tokens), 0) == (0, False)
    assert core.build_connector_meta([rd(1, tokens, Slots(g).alloc(10), 0, len(tokens))], []).empty
    core.request_finished(1, [[], []])
    box["g"] = g
    core.get_num_new_matched_tokens(2, tokens, len(tokens), 0)
    m = core.build_connector_meta([rd(2, tokens, Slots(g).alloc(10), 0, len(tokens))], [])
    assert {op.ordinal for op in m.stages} == set(range(9))


def test_tp_size_mismatch_rejected():
    g = geometry(tp=2)
    s = Settings(url="memory://t")
    core = LeaderCore(s, MemoryStore(), "pfx", tp_size=1, model_id="m", kv_dtype="bf16", geometry=g)
    with pytest.raises(ValueError, match="tp_size"):
        _ = core.geometry


# ---------------------------------------------------------------- request lifetime


def test_request_finished_false_when_nothing_pending_and_state_released():
    g = geometry()
    core = make_core(g)
    P = 8 * TPB + 2  # 8 full blocks: two whole chunks, nothing left open
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    slots = Slots(g).alloc(9)
    run_prefill(core, 1, tokens, slots)
    assert core.request_finished(1, slots) is False  # the pages it holds (empty lists: freed first)
    assert core.active_requests() == 0
    assert core.build_connector_meta([], []).empty


def test_request_finished_true_when_workers_hold_its_finish_plan():
    g = geometry()
    core = make_core(g)
    P = 9 * TPB + 2
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    slots = Slots(g).alloc(10)
    metas = run_prefill(core, 1, tokens, slots)
    # The standing finish plan went out with the pass: the [8, 12) buffer (block 8, already uploaded
    # as the prompt-end snapshot) is released at finish -- the workers hold it until then.
    assert [p.request_id for p in metas[-1].finish_plans] == [1]
    busy, final = finish(core, 1, slots, metas)
    assert busy is True and {b.first for b in final.releases} == {8} and not final.seals
    assert core.active_requests() == 0  # nothing is left for a later metadata
    assert core.build_connector_meta([], []).empty


def test_unknown_request_finished_is_false():
    core = make_core()
    assert core.request_finished(12345, [[], []]) is False


def test_no_state_growth_over_many_short_requests():
    g = geometry()
    core = make_core(g)
    src = Slots(g)
    n = 10_000
    for rid in range(n):
        P = TPB * (1 + rid % 3) + 1 + rid % 5
        tokens = toks(P, seed=rid)
        core.get_num_new_matched_tokens(rid, tokens, P, 0)
        slots = src.alloc(-(-P // TPB))
        core.build_connector_meta([rd(rid, tokens, slots, 0, P)], [])
        core.request_finished(rid, slots)
        assert core.active_requests() == 0
    core.build_connector_meta([], [])
    assert core.active_requests() == 0
    assert not core._discards


# ---------------------------------------------------------------- replays


def test_replay_discards_and_resets():
    g = geometry()
    core = make_core(g)
    P = 10 * TPB + 3
    tokens = toks(P)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    slots = Slots(g).alloc(11)
    first = run_prefill(core, 1, tokens, slots, chunk=4 * TPB)[:1]  # one chunk, then replay
    assert 1 not in first[0].discard_ids
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    slots2 = Slots(g).alloc(11)
    slots2 = [[s + 50_000 for s in lst] for lst in slots2]
    again = run_prefill(core, 1, tokens, slots2)
    assert 1 in again[0].discard_ids
    # The replay restarts the save plan from scratch with the new slots.
    for grp in g.groups:
        ops = [op for op in again[0].stages if op.buffer.group == grp.group_id]
        assert sorted(op.ordinal for op in ops) == list(range(10))
        assert all(op.slot == slots2[grp.group_id][op.ordinal] for op in ops)
    # Discards are reported once.
    assert 1 not in core.build_connector_meta([], []).discard_ids


def test_replay_before_any_build_reports_discard():
    core = make_core()
    tokens = toks(5 * TPB)
    core.get_num_new_matched_tokens(4, tokens, len(tokens), 0)
    core.get_num_new_matched_tokens(4, tokens, len(tokens), 0)
    assert core.build_connector_meta([], []).discard_ids == frozenset({4})
    assert core.active_requests() == 1


# ---------------------------------------------------------------- loads (store with a saved prefix)


def save_through_store(g, store, tokens, *, salt=None, rid=900, **settings):
    """Plan a prompt's saves with a LeaderCore and write exactly the sealed objects into ``store``."""
    core = make_core(g, store, **settings)
    core.get_num_new_matched_tokens(rid, tokens, len(tokens), 0, cache_salt=salt)
    slots = Slots(g).alloc(-(-len(tokens) // TPB))
    metas = run_prefill(core, rid, tokens, slots, salt=salt)
    metas.append(finish(core, rid, slots, metas)[1])
    ns = namespace_digest(g)
    scheme = KeyScheme("pfx", ns, g.tp_size)
    for m in metas:
        for seal in m.seals:
            grp = g.groups[seal.buffer.group]
            for s in range(g.tp_size):
                ident = ObjectIdentity(ns, grp.fingerprint, s, g.tp_size, TPB, grp.page_bytes)
                pages = [bytes(grp.page_bytes)] * seal.count
                store.put(scheme.object_key(grp.fingerprint, s, seal.last_digest),
                          encode_object(ident, seal.buffer.first, seal.last_digest, pages),
                          object_metadata(ident, seal.buffer.first, seal.count))
    return metas


def engine_slots(g, src, n_blocks, h_blocks):
    """Slots as the engine allocates them for a request served up to ``h_blocks``."""
    out = src.alloc(n_blocks)
    first_real = max(0, (h_blocks * TPB + 1 - WINDOW) // TPB)
    out[SLIDING] = [-1 if o < first_real else s for o, s in enumerate(out[SLIDING])]
    return out


@pytest.mark.parametrize("policy", ["all", "window"])
@pytest.mark.parametrize("tp", [1, 2])
def test_exact_repeat_loads_whole_history(policy, tp):
    g = geometry(tp)
    store = MemoryStore()
    P = 20 * TPB  # block aligned: hmax = 19 blocks
    tokens = toks(P, seed=3)
    save_through_store(g, store, tokens, storage_policy=policy)
    core = make_core(g, store, storage_policy=policy)
    n, is_async = core.get_num_new_matched_tokens(5, tokens, P, 0)
    h = (P - 1) // TPB
    assert (n, is_async) == (h * TPB, True)
    slots = engine_slots(g, Slots(g), 20, h)
    core.update_state_after_alloc(5, slots)
    meta = core.build_connector_meta([rd(5, tokens, slots, h * TPB, P - h * TPB)], [])
    assert meta.async_load_ids == frozenset({5})
    d = digests_for(g, tokens)
    for grp in g.groups:
        loaded = {}
        for op in meta.loads:
            if op.obj.group != grp.group_id:
                continue
            assert op.request_id == 5
            end = d.index(op.obj.last_digest) + 1
            for first, count in op.obj.spans:
                assert first + count == end
                assert all(first <= o < end for o in op.ordinals)
            assert len(op.obj.spans) == tp
            for o, s in zip(op.ordinals, op.slots, strict=True):
                assert o not in loaded
                loaded[o] = s
        want = {o: s for o, s in enumerate(slots[grp.group_id][:h]) if s >= 0}
        assert loaded == want
    # Only the sliding group's in-window tail is loaded.
    assert min(op_o for op in meta.loads if op.obj.group == SLIDING for op_o in op.ordinals) == (
        (h * TPB + 1 - WINDOW) // TPB
    )
    # The last block (19) is computed, and its chunk [16, 20) -- stored whole, the lookup saw it --
    # is not staged again (it once was: a second PUT of an object the store holds).
    assert not [op.ordinal for op in meta.stages if op.buffer.group == FULL]


def test_honoured_less_than_offered():
    g = geometry()
    store = MemoryStore()
    tokens = toks(20 * TPB + 5, seed=4)
    save_through_store(g, store, tokens)
    core = make_core(g, store)
    n, _ = core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)
    assert n == 20 * TPB
    slots = engine_slots(g, Slots(g), 21, 12)
    core.update_state_after_alloc(5, slots, honoured_tokens=12 * TPB)
    assert core.stats.honoured_less == 1
    meta = core.build_connector_meta([rd(5, tokens, slots, 12 * TPB, len(tokens) - 12 * TPB)], [])
    full = sorted(o for op in meta.loads if op.obj.group == FULL for o in op.ordinals)
    assert full == list(range(12))


class CountingStore(StoreWrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.head_calls = 0

    def head_many(self, keys):
        self.head_calls += 1
        return self.inner.head_many(keys)


def test_full_honour_needs_no_more_io_and_less_honour_verifies_lower_tail():
    g = geometry(tp=2)
    mem = MemoryStore()
    tokens = toks(20 * TPB + 5, seed=4)
    save_through_store(g, mem, tokens)
    store = CountingStore(mem)
    core = make_core(g, store)
    assert core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)[0] == 20 * TPB
    calls = store.head_calls
    core.update_state_after_alloc(5, engine_slots(g, Slots(g), 21, 20))
    assert store.head_calls == calls  # honoured as offered: the lookup's coverage suffices
    assert core.get_num_new_matched_tokens(6, tokens, len(tokens), 0)[0] == 20 * TPB
    slots = engine_slots(g, Slots(g), 21, 9)
    core.update_state_after_alloc(6, slots, honoured_tokens=9 * TPB)
    meta = core.build_connector_meta([rd(6, tokens, slots, 0, len(tokens) - 9 * TPB)], [])
    loaded = {(op.obj.group, o) for op in meta.loads if op.request_id == 6 for o in op.ordinals}
    want = {(gi, o) for gi in (SLIDING, FULL) for o in range(9) if slots[gi][o] >= 0}
    assert loaded == want


def test_a_smaller_honours_recheck_has_a_budget_of_its_own():
    """The re-check after a smaller honour runs on the scheduler path like a lookup and gets a
    budget like one. Left with what the lookup did not use, a slow store made it run out and
    break a promise the store could keep (on an engine without the failed-load hook, the request
    would then stay parked until its client gave up)."""
    import time as _time

    class SlowHeads(CountingStore):
        def head_many(self, keys):
            _time.sleep(0.15)
            return super().head_many(keys)

    g = geometry(tp=2)
    mem = MemoryStore()
    tokens = toks(20 * TPB + 5, seed=4)
    save_through_store(g, mem, tokens)
    store = SlowHeads(mem)
    probe = make_core(g, store, lookup_timeout_s=0)
    assert probe.get_num_new_matched_tokens(5, tokens, len(tokens), 0)[0] == 20 * TPB
    waves = store.head_calls
    probe.close_lookup()
    # A budget the lookup's waves fit in, with less than one wave's time left over.
    core = make_core(g, store, lookup_timeout_s=0.15 * waves + 0.07)
    try:
        assert core.get_num_new_matched_tokens(6, tokens, len(tokens), 0)[0] == 20 * TPB
        before = store.head_calls
        slots = engine_slots(g, Slots(g), 21, 9)
        core.update_state_after_alloc(6, slots, honoured_tokens=9 * TPB)
        assert store.head_calls > before  # the lower tail was not known: the store was asked
        assert core.stats.promises_broken == 0
        meta = core.build_connector_meta([rd(6, tokens, slots, 0, len(tokens) - 9 * TPB)], [])
        loaded = {(op.obj.group, o) for op in meta.loads if op.request_id == 6 for o in op.ordinals}
        assert loaded == {(gi, o) for gi in (SLIDING, FULL) for o in range(9) if slots[gi][o] >= 0}
    finally:
        core.close_lookup()


def test_a_recheck_gets_the_longest_budget_not_a_share_of_the_smaller_hit():
    """Under the value rule a lookup's budget is a share of the prefill its hit saves; a re-check
    keeps a promise, so it gets the cap whatever the smaller honour is worth."""
    g = geometry(tp=2)
    mem = MemoryStore()
    tokens = toks(20 * TPB + 5, seed=4)
    save_through_store(g, mem, tokens)
    store = CountingStore(mem)
    # 80 ms: a share of the hit far under the 300 ms cap, yet room for an in-memory lookup on a
    # loaded machine (at 1e6 tokens/s it was 160 us, and a busy CI box ran out of it).
    core = make_core(g, store, lookup_timeout_s=-1, lookup_max_stall_ms=300.0, prefill_tokens_per_s=2e3)
    try:
        assert core.get_num_new_matched_tokens(6, tokens, len(tokens), 0)[0] == 20 * TPB
        assert core.stats.recent_lookups[-1].budget_s == pytest.approx(0.5 * 20 * TPB / 2e3)
        slots = engine_slots(g, Slots(g), 21, 9)
        core.update_state_after_alloc(6, slots, honoured_tokens=9 * TPB)
        assert core._lookups.budget_s == 0.3 and core.stats.promises_broken == 0
    finally:
        core.close_lookup()


def test_honoured_less_without_stored_tail_is_a_broken_promise_not_an_error():
    """Window policy: sliding tails exist only at checkpoints and prompt ends. An honour that
    lands elsewhere cannot be served: never a load of garbage, never an exception into the
    engine -- the request is named in ``failed_load_ids`` and takes the failure rung."""
    g = geometry()
    store = MemoryStore()
    tokens = toks(20 * TPB + 5, seed=4)
    save_through_store(g, store, tokens, storage_policy="window")
    core = make_core(g, store, storage_policy="window")
    assert core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)[0] == 20 * TPB
    slots = engine_slots(g, Slots(g), 21, 10)
    core.update_state_after_alloc(5, slots, honoured_tokens=10 * TPB)
    meta = core.build_connector_meta([], [])
    assert meta.loads == () and meta.failed_load_ids == frozenset({5}) and 5 in meta.async_load_ids
    assert core.stats.promises_broken == 1 and core.stats.honoured_less == 1


def test_honoured_zero_means_no_loads():
    g = geometry()
    store = MemoryStore()
    tokens = toks(12 * TPB + 5, seed=6)
    save_through_store(g, store, tokens)
    core = make_core(g, store)
    assert core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)[0] > 0
    slots = Slots(g).alloc(13)
    core.update_state_after_alloc(5, slots, honoured_tokens=0)
    # The async flag passes through a zero honour: the request is parked with nothing to load, so it
    # is declared (the workers return it at once) and nothing fails.
    meta = core.build_connector_meta([], [])
    assert meta.loads == () and meta.async_load_ids == frozenset({5}) and not meta.failed_load_ids
    # When it resumes it computes everything itself, and saves what is not stored yet: the sliding
    # group's blocks (the "all" policy stores them all), not the full-attention objects the lookup
    # saw stored (a conditional PUT of an existing key bills a request and changes nothing).
    meta = core.build_connector_meta([rd(5, tokens, slots, 0, len(tokens))], [])
    assert {op.ordinal for op in meta.stages if op.buffer.group == SLIDING} == set(range(12))
    assert not [op for op in meta.stages if op.buffer.group == FULL]


def test_sync_hit_first_report_saves_every_block_computed_in_that_pass():
    """A sync load's first report has computed_position = device match (the offer subtracted,
    API doc); the pass computes from h to the prompt end, and every block it completes must be
    staged in that same iteration (a sliding page may be freed right after it)."""
    g = geometry()
    store = MemoryStore()
    shared = toks(8 * TPB, seed=9)
    save_through_store(g, store, shared + toks(TPB + 3, seed=10))
    prompt = shared + toks(12 * TPB + 3, seed=11)  # 20 full blocks, first 8 shared
    core = make_core(g, store, load_mode="sync")
    n, is_async = core.get_num_new_matched_tokens(6, prompt, len(prompt), 0)
    assert (n, is_async) == (8 * TPB, False)
    slots = engine_slots(g, Slots(g), 21, 8)
    core.update_state_after_alloc(6, slots)
    ns = len(prompt) - n
    meta = core.build_connector_meta([rd(6, prompt, slots, 0, ns)], [])
    assert meta.loads and not meta.async_load_ids
    for grp in g.groups:
        got = sorted(op.ordinal for op in meta.stages if op.buffer.group == grp.group_id)
        assert got == list(range(8, 20)), f"group {grp.group_id}: staged {got}"


def test_sync_hit_chunked_prefill_stages_each_chunk_when_computed():
    g = geometry()
    store = MemoryStore()
    shared = toks(8 * TPB, seed=9)
    save_through_store(g, store, shared + toks(TPB + 3, seed=10))
    prompt = shared + toks(12 * TPB + 3, seed=11)
    core = make_core(g, store, load_mode="sync")
    n, _ = core.get_num_new_matched_tokens(6, prompt, len(prompt), 0)
    assert n == 8 * TPB
    src = Slots(g)
    slots = engine_slots(g, src, 13, 8)  # the first chunk's allocation
    core.update_state_after_alloc(6, slots)
    chunk = 5 * TPB  # > window
    # Report 0: computed_position = d (offer subtracted); the pass computes [8, 13) blocks.
    m0 = core.build_connector_meta([rd(6, prompt, slots, 0, chunk)], [])
    # Report 1: computed_position = h + chunk; the pass computes [13, 18).
    more = src.alloc(5)
    m1 = core.build_connector_meta([], [rd(6, [], more, n + chunk, chunk)])
    # Report 2: the rest, [18, 20) full blocks and a partial one.
    rest = src.alloc(3)
    m2 = core.build_connector_meta([], [rd(6, [], rest, n + 2 * chunk, len(prompt) - n - 2 * chunk)])
    for m, want in ((m0, range(8, 13)), (m1, range(13, 18)), (m2, range(18, 20))):
        for grp in g.groups:
            got = sorted(op.ordinal for op in m.stages if op.buffer.group == grp.group_id)
            assert got == list(want), f"group {grp.group_id}: staged {got}, expected {list(want)}"
    check_seals(g, [m0, m1, m2], prompt)


def test_async_hit_first_report_with_full_computed_position():
    """After an async load the engine reports computed_position = d + offer (nothing subtracted)."""
    g = geometry()
    store = MemoryStore()
    shared = toks(8 * TPB, seed=9)
    save_through_store(g, store, shared + toks(TPB + 3, seed=10))
    prompt = shared + toks(12 * TPB + 3, seed=11)
    core = make_core(g, store)
    n, is_async = core.get_num_new_matched_tokens(6, prompt, len(prompt), 0)
    assert (n, is_async) == (8 * TPB, True)
    slots = engine_slots(g, Slots(g), 21, 8)
    core.update_state_after_alloc(6, slots)
    meta = core.build_connector_meta([rd(6, prompt, slots, n, len(prompt) - n)], [])
    for grp in g.groups:
        got = sorted(op.ordinal for op in meta.stages if op.buffer.group == grp.group_id)
        assert got == list(range(8, 20))
    check_seals(g, [meta], prompt)


def test_discarded_async_load_chunked_never_stages_uncomputed_blocks():
    """V2 may discard an async load and recompute from the device match: the first report then
    has computed_position = d and a chunk starting at d. Blocks past d + chunk are not computed
    yet; staging them would store garbage under a valid key."""
    g = geometry()
    store = MemoryStore()
    prompt = toks(20 * TPB + 3, seed=12)
    save_through_store(g, store, prompt[: 12 * TPB + 1])
    core = make_core(g, store)
    n, is_async = core.get_num_new_matched_tokens(6, prompt, len(prompt), 0)
    assert (n, is_async) == (12 * TPB, True)
    slots = engine_slots(g, Slots(g), 21, 12)
    core.update_state_after_alloc(6, slots)
    core.build_connector_meta([], [])  # the load goes out while the request is parked
    full_slots = Slots(g).alloc(21)  # discarded: every page recomputed, sliding ones re-filled
    chunk = 4 * TPB
    meta = core.build_connector_meta([rd(6, prompt, [x[:4] for x in full_slots], 0, chunk)], [])
    staged = {op.ordinal for op in meta.stages}
    assert staged <= set(range(4)), f"staged blocks not computed yet: {sorted(staged - set(range(4)))}"


def test_plan_mismatch_on_uncovered_sliding_page():
    g = geometry()
    store = MemoryStore()
    tokens = toks(12 * TPB + 5, seed=4)
    save_through_store(g, store, tokens)
    core = make_core(g, store)
    assert core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)[0] == 12 * TPB
    slots = Slots(g).alloc(13)  # the engine kept every sliding page: ordinal 0 has no verified object
    core.update_state_after_alloc(5, slots)
    meta = core.build_connector_meta([], [])
    assert meta.loads == () and meta.failed_load_ids == frozenset({5})


def test_plan_mismatch_on_missing_full_page_and_group_count():
    g = geometry()
    store = MemoryStore()
    tokens = toks(12 * TPB + 5, seed=4)
    save_through_store(g, store, tokens)
    core = make_core(g, store)
    assert core.get_num_new_matched_tokens(5, tokens, len(tokens), 0)[0] > 0
    slots = engine_slots(g, Slots(g), 13, 12)
    slots[FULL][3] = -1
    core.update_state_after_alloc(5, slots)
    core.get_num_new_matched_tokens(6, tokens, len(tokens), 0)
    core.update_state_after_alloc(6, [slots[FULL]])
    meta = core.build_connector_meta([], [])
    assert meta.loads == () and meta.failed_load_ids == frozenset({5, 6})
    assert core.stats.promises_broken == 2


def test_metadata_is_picklable_and_empty_when_idle():
    import pickle

    g = geometry()
    core = make_core(g)
    assert core.build_connector_meta([], []).empty
    tokens = toks(9 * TPB + 1)
    core.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    m = run_prefill(core, 1, tokens, Slots(g).alloc(10))[0]
    assert isinstance(m, ConnectorMetadata) and not m.empty
    assert pickle.loads(pickle.dumps(m)) == m


# ---------------------------------------------------------------- whole-life fuzz: plan vs engine vs worker


def simulate_worker(metas) -> list[str]:
    """Replay metadata the way a worker keys staging buffers; return protocol violations.

    A seal whose buffer is gone counts only if the same object (group, first, count) was not
    sealed before: re-sealing an already uploaded object is a harmless no-op (write-once).
    """
    problems = []
    open_: dict = {}
    uploaded: set = set()
    for i, m in enumerate(metas):
        for rid in m.discard_ids:
            for bid in [b for b in open_ if b.request_id == rid]:
                del open_[bid]
        for op in m.stages:
            idx = op.ordinal - op.buffer.first
            if not 0 <= idx < op.buffer.capacity:
                problems.append(f"meta {i}: stage {op} outside its buffer")
            open_.setdefault(op.buffer, set()).add(idx)
        for s in m.seals:
            obj = (s.buffer.group, s.buffer.first, s.count)
            staged = open_.get(s.buffer)
            if staged is not None and set(range(s.count)) <= staged:
                uploaded.add(obj)
            elif obj not in uploaded:
                problems.append(f"meta {i}: seal {s.buffer} x{s.count} finds pages {sorted(staged or ())}")
            if s.close:
                open_.pop(s.buffer, None)
        for bid in m.releases:
            open_.pop(bid, None)
    if open_:
        problems.append(f"buffers never closed: {sorted(open_, key=lambda b: (b.group, b.first))}")
    return problems


def _one_life(rng):
    settings = dict(
        blocks_per_object=rng.choice([1, 2, 4, 8]),
        checkpoint_tokens=rng.choice([8, 16, 24]) * TPB,
        window_margin_blocks=rng.choice([0, 0, 1]),
        storage_policy=rng.choice(["window", "all"]),
    )
    P = rng.randint(TPB + 1, 40 * TPB)
    n_decode = rng.choice([0, rng.randint(1, 40 * TPB)])
    chunk = rng.choice([None, 2 * TPB, 5 * TPB])
    return life(settings, P, n_decode, chunk, seed=rng.randint(0, 10**6))


def life(settings, P, n_decode, chunk=None, seed=0):
    """One request: (chunked) prefill, ``n_decode`` generated tokens, finish with the live window."""
    g = geometry()
    core = make_core(g, **settings)
    tokens = toks(P, seed=seed)
    core.get_num_new_matched_tokens(1, tokens, P, 0)
    src = Slots(g)
    slots = [[] for _ in g.groups]
    metas, kv = [], []  # kv: (tokens with KV before the pass, after it) per meta
    cp, first = 0, True
    while cp < P:
        ns = min(chunk or P, P - cp)
        need = -(-(cp + ns) // TPB)
        new = src.alloc(need - len(slots[0]))
        for gi in range(len(slots)):
            slots[gi].extend(new[gi])
        r = rd(1, tokens if first else [], new if not first else [list(x) for x in slots], cp, ns)
        metas.append(core.build_connector_meta([r], []) if first else core.build_connector_meta([], [r]))
        kv.append((cp, cp + ns))
        cp, first = cp + ns, False
    for i in range(n_decode):
        tokens.append(70_000 + i)
        pos = len(tokens) - 1
        delta = [[] for _ in slots]
        if pos // TPB >= len(slots[0]):
            new = src.alloc(1)
            for gi in range(len(slots)):
                slots[gi].extend(new[gi])
                delta[gi] = new[gi]
        metas.append(core.build_connector_meta([], [rd(1, [tokens[-1]], delta, pos, 1)]))
        kv.append((pos, pos + 1))
    final_kv = kv[-1][1]
    first_live = max(0, (final_kv + 1 - WINDOW) // TPB)
    live = [[s if o >= first_live else -1 for o, s in enumerate(slots[SLIDING])], list(slots[FULL])]
    metas.append(finish(core, 1, live, metas)[1])
    kv.append((final_kv, final_kv))
    return g, core, settings, P, tokens, slots, metas, kv


@pytest.mark.parametrize("seed", range(int(os.environ.get("S3KV_FUZZ_SEEDS", "40"))))
def test_whole_request_life_fuzz(seed):
    import random

    rng = random.Random(seed)
    g, core, settings, P, tokens, slots, metas, kv = _one_life(rng)
    ctx = f"settings={settings} P={P} tokens={len(tokens)}"
    assert simulate_worker(metas) == [], ctx
    check_seals(g, metas, tokens, bpo=core.bpo)
    assert core.active_requests() == 0
    # Every staged page is a completed block copied from its own slot while the engine still held it.
    for (before, after), m in zip(kv, metas, strict=True):
        for op in m.stages:
            assert op.slot == slots[op.buffer.group][op.ordinal], ctx
            assert op.ordinal < after // TPB, f"{ctx}: block {op.ordinal} staged before it was computed"
            if op.buffer.group == SLIDING:
                assert op.ordinal >= (before + 1 - WINDOW) // TPB, f"{ctx}: sliding page {op.ordinal} already freed"
    # What was sealed serves the hits the policy promises. Objects are write-once and keyed by their
    # last block: of two seals ending at the same block, the first upload wins (uploads run in order).
    cov = {}
    for m in metas:
        for s in m.seals:
            end = s.buffer.first + s.count
            cov.setdefault((s.buffer.group, 0), {}).setdefault(end, Span(s.buffer.first, end))
    margin = settings["window_margin_blocks"]
    hmax = (P - 1) // TPB
    if hmax > 0:
        assert servable(g, cov, 0, hmax, margin), f"{ctx}: exact repeat not servable"
    done = len(tokens) // TPB
    cpb = core.params.checkpoint_blocks
    for c in range(cpb, done + 1, cpb):
        assert servable(g, cov, 0, c, margin), f"{ctx}: checkpoint {c} not servable"
    if settings["storage_policy"] == "all":
        assert sealed_pages(metas, SLIDING) == sealed_pages(metas, FULL) == set(range(done))


@pytest.mark.parametrize(
    "bpo,cp_blocks,P,n_decode,chunk",
    [
        (4, 24, 280, 50, 2 * TPB),  # checkpoint-24 fragment [19,20) shadows the finish tail [16,20)
        (8, 16, 411, 592, 5 * TPB),  # finish closes the open checkpoint buffer [59,62), then seals [57,62)
        (2, 8, 426, 163, 5 * TPB),  # checkpoint-40 fragment [35,36) shadows the finish piece [34,36)
    ],
)
def test_history_end_tail_survives_write_once(bpo, cp_blocks, P, n_decode, chunk):
    settings = dict(blocks_per_object=bpo, checkpoint_tokens=cp_blocks * TPB, window_margin_blocks=0,
                    storage_policy="window")
    g, core, _, P, tokens, _, metas, _ = life(settings, P, n_decode, chunk)
    done = len(tokens) // TPB
    assert done > P // TPB
    cov: dict = {}
    for m in metas:
        for s in m.seals:  # first upload of a key wins
            end = s.buffer.first + s.count
            cov.setdefault((s.buffer.group, 0), {}).setdefault(end, Span(s.buffer.first, end))
    # Each object key (group, last block) is sealed at most once per request...
    ends = [(s.buffer.group, s.buffer.first + s.count) for m in metas for s in m.seals]
    dup = {e for e in ends if ends.count(e) > 1}
    firsts = {e: {s.buffer.first for m in metas for s in m.seals if (s.buffer.group, s.buffer.first + s.count) == e}
              for e in dup}
    assert all(len(f) == 1 for f in firsts.values()), f"same key sealed with different spans: {firsts}"
    # ...and a next turn can hit the whole history.
    assert servable(g, cov, 0, done, 0)
