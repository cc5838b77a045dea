"""The write policy at work in the simulator (s3kv/engine/leader/writes.py, s3kv/core/value.py).

The real adapter serves conversations (each turn continues the last: its history-end tail is
read), then one-shot prompts nobody comes back to, then conversations again. Under the default
policy the history-end tails stop going to S3 once no next turn reads them -- only an
exploration share still does -- and go again once next turns come back; every page served is
checked against recomputation. ``S3KV_WRITE_POLICY=through`` keeps writing them all.
"""

from __future__ import annotations

import itertools
import random

import pytest

from s3kv.config import Settings
from s3kv.core.value import AT_PROMPT_END, HISTORY_END, PROMPT_END
from s3kv.sim import SimCacheConfig, SimEngine, SimRequestSpec, gemma3_like
from s3kv.sim.model import generate_tokens, request_root
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

TPB = 16
WINDOW = 64
PROMPT = 1024
ANSWER = 24
VOCAB = 32000
#: Gemma-3-27B's pages at 16 tokens a block: 10 full-attention layers, 52 sliding ones.
REAL_FULL_PAGE = 10 * 2 * 16 * 128 * 2 * TPB
REAL_SLIDING_PAGE = 52 * 2 * 16 * 128 * 2 * TPB
_ids = itertools.count(1)


class SizedLeader(S3KvConnectorLeader):
    """Objects priced at Gemma-3-27B's page sizes, as `s3kv bench trace` does (the simulator moves
    tiny pages, whose bill would be PUTs alone); the full-attention group is group 0."""

    def __init__(self, llm_args, **kw):
        super().__init__(llm_args, **kw)
        self.core._sizing_page_bytes = [REAL_FULL_PAGE, REAL_SLIDING_PAGE]


def engine(store, *, tp=1, **settings):
    # The policy under test, not the wall clock: a CI host starved for seconds once turned every
    # lookup of a test's last phase into a miss (a lookup budget or the breaker's stall rule).
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, blocks_per_object=32,
                 checkpoint_tokens=1 << 16, write_min_return=1.0, lookup_timeout_s=30.0, breaker_stall_s=0.0,
                 **settings)
    eng = SimEngine(
        gemma3_like(WINDOW, kv_heads=2, tp_size=tp),
        SimCacheConfig(tokens_per_block=TPB, max_seq_len=4 * PROMPT),
        SizedLeader,
        S3KvConnectorWorker,
        connector_kwargs=dict(settings=s, store=store, engine_key=f"value-{next(_ids)}"),
    )
    # A test's scale: learn within tens of requests, explore one refused boundary in eight; the
    # policy's clock (seconds) is the test's: ``serve`` moves it 10 s a request (a think time).
    eng.leader.core.writes.model.half_life = 1000.0
    eng.leader.core.writes.model.explore_share = 1 / 8
    eng.clock = [0.0]
    eng.leader.core.writes.clock = lambda: eng.clock[0]
    return eng


def sessions(rng: random.Random, n: int, turns: int) -> list[list[int]]:
    """``n`` conversations of ``turns`` turns, turn-major within each conversation, each turn half a
    prompt longer than the last."""
    root = request_root()
    out = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)]
        for _ in range(turns):
            out.append(list(prompt))
            prompt = prompt + list(generate_tokens(root, tuple(prompt), ANSWER, VOCAB))
            # A new message worth its tail: a read of the next turn's tail adds only what is above
            # the tail its lookup found (core/value.py), and a few dozen tokens never pay for one.
            prompt += [rng.randrange(VOCAB) for _ in range(PROMPT // 2)]
    return out


def serve(eng, prompts, device: list[int] | None = None) -> list[tuple[int, int]]:
    """Each prompt after the previous one finished (uploads landed): (history-end tails written to
    S3 for it, tokens served) per request. ``device``: each one's device match (tokens)."""
    out = []
    totals = eng.leader.core.writes.model.totals[HISTORY_END]
    for i, p in enumerate(prompts):
        eng.clock[0] += 10.0
        before = totals.objects
        d = device[i] if device else 0
        rep = eng.run([SimRequestSpec(next(_ids), tuple(p), max_new_tokens=ANSWER, device_match_tokens=d)])
        for w in eng.workers:
            assert w.flush(30)
        assert rep.kv_mismatches == 0
        out.append((totals.objects - before, rep.requests[0].matched_tokens))
    return out


def share_written(rows) -> float:
    return sum(1 for n, _ in rows if n) / len(rows)


def read_turns(rows, turns: int) -> list:
    """The rows of turns a next turn reads (``rows`` start at a conversation's first turn)."""
    return [r for i, r in enumerate(rows) if i % turns != turns - 1]


@pytest.mark.parametrize("policy", ["auto", "through"])
def test_history_end_tails_follow_the_next_turns_that_read_them(policy):
    rng = random.Random(3)
    eng = engine(MemoryStore(), write_policy=policy)
    with eng:
        talk = serve(eng, sessions(rng, 30, 3))
        quiet = serve(eng, [[rng.randrange(VOCAB) for _ in range(PROMPT)] for _ in range(200)])
        back = serve(eng, sessions(rng, 60, 3)) if policy == "auto" else []
    # A turn with a next one is written (its reads pay); a last turn is read by nobody, and once its
    # depth is learnt unread its tail may be refused.
    assert share_written(read_turns(talk[-30:], 3)) == 1.0
    assert sum(t for _, t in talk[-30:]) > 0  # next turns were served their history
    if policy == "through":
        assert share_written(quiet[-50:]) == 1.0
        return
    # Nobody came back: only the exploration share is still written ...
    assert share_written(quiet[-50:]) < 0.3
    # ... and once next turns come back, reads of explored tails bring the kind back.
    assert share_written(read_turns(back[-45:], 3)) == 1.0
    assert sum(t for _, t in back[-45:]) > 0.5 * sum(t for _, t in talk[-45:])
    d = eng.leader.core.stats.value[HISTORY_END]
    assert d["refused"] > 0 and d["explored"] > 0 and d["written"] > 0


def test_next_turns_the_device_serves_stop_history_end_tails_going_to_s3():
    """One engine whose own device cache holds each conversation's history when its next turn
    comes (TensorRT-LLM asks the connector only past that match): S3 serves none of those next
    turns, and the leader counts each as a reuse the device served (``ValueModel.device_reuse``),
    so history-end tails stop going to S3 -- where the same next turns are read from S3 they all
    go on."""
    turns = 3
    prompts = sessions(random.Random(6), 40, turns)
    device = [0 if i % turns == 0 else (len(prompts[i - 1]) + ANSWER) // TPB * TPB for i in range(len(prompts))]
    rows = {}
    for name, match in (("device", device), ("s3", None)):
        eng = engine(MemoryStore())
        with eng:
            rows[name] = serve(eng, prompts, match)
        rows[name + " reuses"] = eng.leader.core.stats.value[HISTORY_END]["device_reads"]
    assert rows["device reuses"] > 0 and rows["s3 reuses"] == 0
    assert sum(t for _, t in rows["device"]) == 0 < sum(t for _, t in rows["s3"])
    assert share_written(read_turns(rows["s3"][-45:], turns)) == 1.0
    assert share_written(read_turns(rows["device"][-45:], turns)) < 0.5


def test_tensor_parallel_ranks_store_the_same_objects():
    """The leader decides for every rank: under refusals and exploration each rank stores its
    shard of exactly the same objects."""
    store = MemoryStore()
    rng = random.Random(4)
    eng = engine(store, tp=2)
    with eng:
        serve(eng, [[rng.randrange(VOCAB) for _ in range(PROMPT)] for _ in range(60)])
        serve(eng, sessions(rng, 5, 2))
    keys = [k for k in store.keys() if "of2/" in k]
    by_shard: dict[str, set[str]] = {"0of2": set(), "1of2": set()}
    for k in keys:
        head, _, digest = k.rpartition("/")
        group, _, shard = head.rpartition("/")[2].partition(".")
        by_shard[shard].add(f"{group}/{digest}")
    assert by_shard["0of2"] and by_shard["0of2"] == by_shard["1of2"]
    assert eng.leader.core.stats.value[HISTORY_END]["refused"] > 0


def test_a_next_turn_ending_in_the_block_its_history_ended_in_is_no_exact_repeat():
    """Engine B serves the next turn of a conversation engine A served, with a message of a few
    tokens: B's hit, on A's history-end tail, reaches B's own prompt end -- what an exact repeat of
    a prompt-end tail also does. B cannot tell the two apart (the key names no kind), so the read
    is split over the kinds it may be; credited to prompt-end whole, such reads kept prompt-end
    tails looking read where next turns read history-end tails (core/value.py)."""
    rng = random.Random(5)
    store = MemoryStore()
    first = [rng.randrange(VOCAB) for _ in range(PROMPT)]
    history = first + list(generate_tokens(request_root(), tuple(first), ANSWER, VOCAB))
    nxt = history + [rng.randrange(VOCAB) for _ in range(4)]
    assert (len(nxt) - 1) // TPB == len(history) // TPB  # the new message stays in the last block
    a, b = engine(store), engine(store)
    with a:
        assert serve(a, [first])[0][0] == 1  # A wrote its history-end tail
    hints = []
    with b:
        model = b.leader.core.writes.model
        read = model.read
        model.read = lambda digest, hint, *args, **kw: hints.append(hint) or read(digest, hint, *args, **kw)
        (_, served), = serve(b, [nxt])
        credit = {k: model._reads[k].get(model.clock, model.half_life) for k in (PROMPT_END, HISTORY_END)}
    assert served == len(history) // TPB * TPB  # the whole history, from A's tail
    assert hints == [AT_PROMPT_END]
    assert credit[PROMPT_END] < 1 and credit[HISTORY_END] > 0  # not a whole read of a prompt-end tail
