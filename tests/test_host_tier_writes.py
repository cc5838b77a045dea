"""A host tier changes nothing the store gets (issue 39's trace row).

The value policy refuses some of a request's boundaries. Without a host tier a refused one is not
staged at all; with one it is kept there ("evict") -- and that must leave every object written to
S3 as it is without the tier: other engines read only S3. Each case serves the same requests under
the same fixed plan on an engine with a host tier and on one without, then a fresh engine (no
tier, the same store) serves a request that can reuse them: the store must hold the same objects
and the fresh engine be served the same tokens. And the policy learns from the same reads: a
repeat the tier serves of an object S3 holds is a read S3 serves without it.

Before the fixes the public trace (4 clusters, affinity) served fewer tokens with host tiers than
without: a refused prompt-end tail took the blocks of a checkpoint tail the plan wrote (the
checkpoint never servable in S3); a refused prompt end still sent its chain's snapshot to S3
(other engines saw the chain reach past every tail and placed no branch tail); a chain only the
tier held -- or the tier answered for before the listing could say S3 has it -- counted as
stored, or not, the wrong way; and repeats the tier served were no reads to the policy.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence

import pytest

from s3kv.config import Settings
from s3kv.core.value import CHECKPOINT, HISTORY_END, PROMPT_END, WRITE_ALL, Boundary, Plan
from s3kv.engine.fleetindex import Publisher
from s3kv.sim import SimCacheConfig, SimEngine, SimRequestSpec, gemma3_like
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

TPB = 16
WINDOW = 64  # 4 blocks
CP_BLOCKS = 16  # checkpoint_tokens / TPB, a multiple of blocks_per_object
VOCAB = 32000
_ids = itertools.count(1)

Planner = Callable[[Sequence[Boundary]], Plan]


def refuse_all(bs: Sequence[Boundary]) -> Plan:
    return Plan({}, 0)


def checkpoint_only(bs: Sequence[Boundary]) -> Plan:
    """The checkpoints written (and the chain up to the last), every other boundary refused."""
    cps = [b.tokens for b in bs if b.kind == CHECKPOINT]
    return Plan({(CHECKPOINT, t): "write" for t in cps}, max(cps, default=0))


def history_end_only(bs: Sequence[Boundary]) -> Plan:
    """The whole chain and the history-end tail written (a next turn is expected), the prompt end
    refused -- what the value policy decided on the trace where the chain's snapshot leaked."""
    return Plan({(b.kind, b.tokens): "write" for b in bs if b.kind == HISTORY_END}, None)


def engine(store, *, tier: bool, planner: list[Planner]) -> SimEngine:
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, host_cache_gb=0.05 if tier else 0,
                 blocks_per_object=4, checkpoint_tokens=CP_BLOCKS * TPB, lookup_timeout_s=5.0)
    e = SimEngine(gemma3_like(WINDOW, kv_heads=2), SimCacheConfig(tokens_per_block=TPB, max_seq_len=2048),
                  S3KvConnectorLeader, S3KvConnectorWorker,
                  connector_kwargs=dict(settings=s, store=store, key_prefix="tw", engine_key=f"tierwrites-{next(_ids)}"))
    e.leader.core.writes.model.plan = lambda bs: planner[0](bs)  # the plan under test, not a learnt one
    return e


def serve(e: SimEngine, prompt: list[int], new_tokens: int = 4) -> int:
    rep = e.run([SimRequestSpec(next(_ids), tuple(prompt), max_new_tokens=new_tokens)])
    for w in e.workers:
        assert w.flush(30)
    assert rep.kv_mismatches == 0 and rep.guard_violations == 0
    return rep.requests[0].matched_tokens


def drop_tails(e: SimEngine) -> None:
    """Evict the sliding-window tails from the tier, as its eviction by value does first (a tail
    holds few tokens for its bytes), leaving the full-attention chain there."""
    g = e.workers[0].core.geometry
    sliding = {grp.fingerprint for grp in g.groups if grp.window is not None}
    for w in e.workers:
        tier = w.core.host_tier
        for k in tier.keys():
            if any(f"/{fp}." in k for fp in sliding):
                tier.discard(k)


def publish(e: SimEngine, store) -> None:
    """The fleet index of what ``store`` holds now (``s3kv gc --index``), taken up by ``e``."""
    core = e.leader.core
    Publisher(store, "tw/", namespaces=[core.scheme.namespace_prefix]).publish(time.time())
    fleet = core.fleet_index()
    assert fleet is not None and fleet.refresh()


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def world(case: str, tier: bool) -> tuple[set[str], int]:
    """(the objects in the store, the tokens a fresh engine without a tier was then served)."""
    rng = random.Random(case)
    store = MemoryStore()
    planner: list[Planner] = [refuse_all]
    with engine(store, tier=tier, planner=planner) as a:
        if case == "checkpoint-and-refused-prompt-end":
            # The prompt ends 2 blocks past a checkpoint: its refused prompt-end tail and the
            # checkpoint's tail share blocks.
            prompt = words(rng, (CP_BLOCKS + 2) * TPB + 5)
            planner[0] = checkpoint_only
            serve(a, prompt)
            reader = prompt[: (CP_BLOCKS + 1) * TPB] + words(rng, 3 * TPB)
        elif case == "refused-prompt-end-of-a-written-chain":
            # 14 blocks: chain objects end at 4, 8, 12; the prompt end (14) is refused.
            prompt = words(rng, 14 * TPB + 5)
            planner[0] = history_end_only
            serve(a, prompt, new_tokens=24)
            # Another engine with the same prompt finds S3's chain ending at 12 and stores a
            # branch tail there (the prompt-end chain snapshot in S3 hid that point) ...
            planner[0] = lambda bs: WRITE_ALL
            with engine(store, tier=False, planner=planner) as b:
                serve(b, prompt)
            # ... which a prompt that leaves this one within block 13 hits.
            reader = prompt[: 13 * TPB + 3] + words(rng, 3 * TPB)
        elif case == "chain-another-engine-wrote":
            # The tier holds a chain the policy kept from S3, and another engine wrote part of it
            # to S3 since (a prompt sharing 12 blocks); the fleet index lists it.
            prompt = words(rng, 20 * TPB + 5)
            publish(a, store)  # (a cold miss then asks the store nothing, so A remembers no miss)
            serve(a, prompt)  # everything refused
            if tier:
                drop_tails(a)
            planner[0] = lambda bs: WRITE_ALL
            with engine(store, tier=False, planner=planner) as b:
                serve(b, prompt[: 12 * TPB + 3] + words(rng, 2 * TPB))
            publish(a, store)
            # A misses (its tails are gone) and stores a branch tail where S3's chain ends -- the
            # listing says it does, though the tier answered for those chain objects first.
            assert serve(a, prompt) == 0
            reader = prompt[: 13 * TPB + 3] + words(rng, 3 * TPB)
        else:  # "chain-held-only-by-the-tier"
            prompt = words(rng, 24 * TPB + 9)
            serve(a, prompt)  # everything refused: with a tier all of it is kept there only
            if tier:
                drop_tails(a)
            planner[0] = lambda bs: WRITE_ALL
            assert serve(a, prompt) == 0  # its tails are gone: a miss, the whole prompt computed
            reader = prompt
    planner[0] = refuse_all
    with engine(store, tier=False, planner=planner) as fresh:
        served = serve(fresh, reader)
    return {k for k in store.keys() if "/.s3kv" not in k}, served


@pytest.mark.parametrize("case", ["checkpoint-and-refused-prompt-end", "refused-prompt-end-of-a-written-chain",
                                  "chain-held-only-by-the-tier", "chain-another-engine-wrote"])
def test_the_store_gets_what_it_gets_without_a_tier(case):
    keys_without, served_without = world(case, tier=False)
    keys_with, served_with = world(case, tier=True)
    assert served_without > 0  # the case reuses something from the store
    assert served_with == served_without
    assert keys_with == keys_without


def test_the_value_policy_learns_from_the_same_reads_with_a_tier_as_without():
    """A repeat the host tier serves of an object S3 holds is a read S3 serves without the tier:
    the value policy counts it alike (left out, an engine whose router sends it a prefix's repeats
    judged that prefix's boundaries unread and stopped writing them to S3, and the engines the
    router later sent the prefix to missed). Only a hit no S3 object could serve is counted apart."""
    rng = random.Random(5)
    prompt = words(rng, 10 * TPB + 5)
    lines = []
    for tier in (False, True):
        planner: list[Planner] = [lambda bs: WRITE_ALL]
        with engine(MemoryStore(), tier=tier, planner=planner) as e:
            serve(e, prompt)
            assert serve(e, prompt) == 10 * TPB  # the repeat: from the tier, or from S3 without one
            if tier:
                assert e.workers[0].core.stats().host_hits > 0
            t = e.leader.core.writes.model.totals[PROMPT_END]
            lines.append((t.reads, t.host_reads))
    assert lines[0] == lines[1] == (1, 0)
