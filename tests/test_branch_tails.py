"""Branch-point tails: a shared prefix that is not a checkpoint becomes servable under the window policy.

Three requests share a 1,536-token prefix (a system prompt or a document) and then ask different
questions. The first stores its prompt: every full-attention block, and sliding-window tails only
at its own prompt end, history end and checkpoints (every 4,096 tokens) -- none at 1,536. The
second finds the full-attention chain stored up to the branch point but no sliding tail there, so
it recomputes -- and, with branch tails, also stores the sliding tail ending at the branch point.
The third hits the whole shared prefix. The simulator's checker compares every served page with
what recomputation writes.
"""

from __future__ import annotations

import itertools
import random

import pytest

from s3kv.config import Settings
from s3kv.sim import SimCacheConfig, SimEngine, SimRequestSpec, gemma3_like
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

TPB = 32
WINDOW = 256
PREFIX = 1536  # 48 blocks: not a multiple of the 4,096-token checkpoint spacing
VOCAB = 32000
_ids = itertools.count(1)


def engine(store, *, tp=1, chunk=None, bpo=4, **settings):
    s = Settings(
        url="memory://unused", staging_mib=64, check_access=False, blocks_per_object=bpo, **settings
    )
    return SimEngine(
        gemma3_like(WINDOW, kv_heads=2, tp_size=tp),
        SimCacheConfig(tokens_per_block=TPB, max_seq_len=4096),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        chunk_size=chunk,
        connector_kwargs=dict(settings=s, store=store, engine_key=f"branch-{next(_ids)}"),
    )


def prompts(n: int = 3, suffix: int = 300, seed: int = 5) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    return [tuple(shared + [rng.randrange(VOCAB) for _ in range(suffix + 17 * i)]) for i in range(n)]


def serve_one_by_one(eng, ps):
    """Each request after the previous one finished and its uploads landed (users, one after another)."""
    reports = []
    with eng:
        for p in ps:
            rep = eng.run([SimRequestSpec(next(_ids), p, max_new_tokens=8)])
            for w in eng.workers:
                assert w.flush(30)
            reports.append(rep)
    return reports


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk", [None, 96])
def test_third_request_hits_the_shared_prefix(tp, chunk):
    reps = serve_one_by_one(engine(MemoryStore(), tp=tp, chunk=chunk), prompts())
    served = [r.requests[0].matched_tokens for r in reps]
    assert served == [0, 0, PREFIX]
    assert all(r.kv_mismatches == 0 for r in reps)
    assert sum(r.pages_checked for r in reps) > 0


def test_without_branch_tails_the_shared_prefix_is_never_served():
    reps = serve_one_by_one(engine(MemoryStore(), branch_tails=False), prompts(4))
    assert [r.requests[0].matched_tokens for r in reps] == [0, 0, 0, 0]


def test_a_fresh_engine_hits_it_too_and_stores_one_tail_per_sliding_group():
    """The tail is in the store (not only in the engine's index), and costs one object per sliding group."""
    store = MemoryStore()
    first = engine(store)
    serve_one_by_one(first, prompts(2))
    lstats = first.leader.core.stats
    sliding = sum(1 for g in first.workers[0].core.geometry.groups if g.window is not None)
    assert lstats.branch_tails == sliding and lstats.branch_tails_abandoned == 0
    tail_blocks = (WINDOW + TPB) // TPB  # the in-window tail for a hit at the branch point, and one below
    assert lstats.branch_tail_pages == sliding * tail_blocks
    reps = serve_one_by_one(engine(store), prompts(3, seed=5)[2:])
    assert reps[0].requests[0].matched_tokens == PREFIX and reps[0].kv_mismatches == 0


def test_no_branch_tail_where_a_tail_already_ends():
    """A shared prefix ending at a checkpoint is served by the checkpoint tail: nothing extra is stored."""
    store = MemoryStore()
    eng = engine(store, checkpoint_tokens=PREFIX)
    reps = serve_one_by_one(eng, prompts())
    assert [r.requests[0].matched_tokens for r in reps] == [0, PREFIX, PREFIX]
    assert eng.leader.core.stats.branch_tails == 0


def test_store_everything_needs_no_branch_tails():
    store = MemoryStore()
    eng = engine(store, storage_policy="all")
    reps = serve_one_by_one(eng, prompts())
    assert [r.requests[0].matched_tokens for r in reps] == [0, PREFIX, PREFIX]
    assert eng.leader.core.stats.branch_tails == 0


@pytest.mark.parametrize("device_match", [0, PREFIX])
def test_a_branch_no_object_ends_at_is_found_from_the_engines_own_prompts(device_match):
    """Objects of 64 blocks (2,048 tokens) hold the whole shared prefix: the first prompt's chain
    object ends at its own prompt end, so the second prompt's lookup finds no object ending on its
    chain and S3 shows it no branch point. Its engine remembers the first prompt: the second request
    ends a chain object at the point where the two part and stores the tails there, and a third
    request on a fresh engine (another memo, another index) hits the whole prefix. Also where the
    second request's device matched the shared prefix (the engine then gives no sliding page below
    the window there: the tail holds what a hit at the branch point needs)."""
    store = MemoryStore()
    first = engine(store, bpo=64)
    reps = []
    with first:
        for p, d in zip(prompts(2), (0, device_match), strict=True):
            reps.append(first.run([SimRequestSpec(next(_ids), p, max_new_tokens=8, device_match_tokens=d)]))
            for w in first.workers:
                assert w.flush(30)
    assert [r.requests[0].matched_tokens for r in reps] == [0, 0]  # S3 adds nothing to either
    lstats = first.leader.core.stats
    sliding = sum(1 for g in first.workers[0].core.geometry.groups if g.window is not None)
    assert lstats.branch_tails == sliding and lstats.branch_tails_abandoned == 0
    reps = serve_one_by_one(engine(store, bpo=64), prompts(3)[2:])
    assert reps[0].requests[0].matched_tokens == PREFIX and reps[0].kv_mismatches == 0
    assert sum(r.pages_checked for r in reps) > 0


def test_a_next_turn_or_a_repeat_is_no_branch():
    """A prompt that goes on where an earlier one ended (a conversation's next turn) or repeats it
    parts from nothing: no branch tail is stored."""
    rng = random.Random(9)
    base = tuple(rng.randrange(VOCAB) for _ in range(PREFIX))
    turn2 = base + tuple(rng.randrange(VOCAB) for _ in range(200))
    eng = engine(MemoryStore(), bpo=64)
    serve_one_by_one(eng, [base, turn2, turn2])
    assert eng.leader.core.stats.branch_tails == 0


def test_a_request_whose_device_matched_a_stored_prefix_writes_only_what_follows():
    """Once the chain object ending at the branch point is stored, a request whose device matched the
    shared prefix (its lookup asks only past it, so it never sees that object) writes its chain from
    there, not the prefix's pages again from the chunk's start into an object of its own."""
    store = MemoryStore()
    eng = engine(store, bpo=64)
    firsts: list[list[int]] = []  # per request: where each full-attention object it wrote begins
    with eng:
        for p, d in zip(prompts(3), (0, PREFIX, PREFIX), strict=True):
            before = set(store.keys())
            eng.run([SimRequestSpec(next(_ids), p, max_new_tokens=8, device_match_tokens=d)])
            for w in eng.workers:
                assert w.flush(30)
            fp = next(g.fingerprint for g in eng.leader.core.geometry.groups if g.window is None)
            firsts.append(sorted(int(store._objects[k][1]["s3kv-first"]) for k in set(store.keys()) - before
                                 if k.split("/")[-2].startswith(fp)))
    assert eng.leader.core.stats.branch_tails >= 1
    assert firsts[1][0] == 0 and PREFIX // TPB in firsts[1]  # the branch: an object ends there
    assert firsts[2] and min(firsts[2]) == PREFIX // TPB  # the third: from the branch point on


def test_requests_side_by_side_store_one_branch_between_them():
    """Two requests that part from the first at the same point run in one batch: both see the branch
    before either upload is known, and one of them stores it."""
    store = MemoryStore()
    eng = engine(store, bpo=64)
    a, b, c = prompts(3)
    with eng:
        eng.run([SimRequestSpec(next(_ids), a, max_new_tokens=8)])
        for w in eng.workers:
            assert w.flush(30)
        rep = eng.run([SimRequestSpec(next(_ids), p, max_new_tokens=8) for p in (b, c)])
        for w in eng.workers:
            assert w.flush(30)
    sliding = sum(1 for g in eng.workers[0].core.geometry.groups if g.window is not None)
    assert eng.leader.core.stats.branch_tails == sliding and rep.kv_mismatches == 0
    reps = serve_one_by_one(engine(store, bpo=64), prompts(4)[3:])
    assert reps[0].requests[0].matched_tokens == PREFIX
