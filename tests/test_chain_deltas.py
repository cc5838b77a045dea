"""Chain objects that start inside a chunk: a conversation's turns store each full-attention page once.

A full-attention object covers at most one chunk (``blocks_per_object``), and a conversation's
history ends inside one. A request that finds the chain stored up to a point inside a chunk --
whole from the chunk's start -- writes only what follows it, and a prompt-end snapshot ends its
object at the prompt's end rather than being stored again inside the chunk's final object. The
lookup follows an object's first block down to the object that ends there (``core.lookup``).

Checked here: every turn of a conversation, each on a fresh engine (the store the only source of
reuse), is served its whole history, bit-exact, at TP 1 and 2 and with chunked prefill -- while
the full-attention group stores every page once (before, every turn stored its chunk again from
its start); and the lookup core finds a chain whose chunk-end object starts inside the chunk only
by following it.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from test_connector_sim import make_engine

from s3kv.core.hitrule import Span
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.core.lookup import LookupParams, find_hit
from s3kv.sim import SimRequestSpec, gemma3_like, multi_turn_workload
from s3kv.store.memory import MemoryStore

TPB = 32
WINDOW = 128
BPO = 8  # a chunk of 256 tokens: every turn below ends inside one
_ids = itertools.count(1000)


def engine(store, *, tp=1, chunk=None):
    # No lookup time budget: a busy machine must not turn a hit into a miss here.
    return make_engine(store, gemma3_like(WINDOW, kv_heads=2, tp_size=tp), tp=tp, chunk=chunk, tpb=TPB,
                       max_seq_len=4096, blocks_per_object=BPO, lookup_timeout_s=0)


def full_pages(store: MemoryStore) -> Counter:
    """How many full-attention objects hold each (group, shard, ordinal)."""
    held: Counter = Counter()
    for info in store.list(""):
        md = info.metadata
        if md.get("s3kv-window") != "full":
            continue
        first, count = int(md["s3kv-first"]), int(md["s3kv-count"])
        for o in range(first, first + count):
            held[(md["s3kv-group"], md["s3kv-shard"], o)] += 1
    return held


@pytest.mark.parametrize("tp,chunk", [(1, None), (2, None), (1, 96)])
def test_each_turn_is_served_whole_and_stores_its_pages_once(tp, chunk):
    specs = multi_turn_workload(n_conversations=1, turns=4, system_len=150, first_len=70, turn_len=45,
                                max_new_tokens=40, seed=3)
    store = MemoryStore()
    history = 0
    for k, spec in enumerate(specs):
        spec = SimRequestSpec(next(_ids), spec.prompt, max_new_tokens=spec.max_new_tokens)
        with engine(store, tp=tp, chunk=chunk) as eng:  # a fresh engine: only the store serves
            rep = eng.run([spec])
            for w in eng.workers:
                assert w.flush(30)
        r = rep.requests[0]
        assert rep.kv_mismatches == 0, k
        if k:
            # The whole history of the turn before, to its last whole block.
            assert r.matched_tokens >= history // TPB * TPB, (k, r.matched_tokens, history)
        history = len(spec.prompt) + len(r.output_tokens) - 1  # the last token has no KV
    held = full_pages(store)
    assert held and max(held.values()) == 1, [k for k, n in held.items() if n > 1][:8]
    # Some object does start inside a chunk (else this test checks nothing new).
    starts = {int(i.metadata["s3kv-first"]) for i in store.list("") if i.metadata.get("s3kv-window") == "full"}
    assert any(s % BPO for s in starts), starts


def _geometry() -> CacheGeometry:
    groups = (GroupGeometry(0, None, (0,), (64,)), GroupGeometry(1, 64, (1,), (64,)))
    return CacheGeometry(tokens_per_block=16, groups=groups, tp_size=1, kv_dtype="bf16", model_id="m")


def test_the_lookup_follows_an_object_down_to_the_one_below_it():
    """Spine objects [0, 5) and [5, 8) (the second ends at a chunk end, found by the probe), a
    sliding tail ending at 8: the whole 8 blocks are servable only through the object ending at 5,
    which no chunk end names -- the lookup asks for it because the object at 8 starts there."""
    g = _geometry()
    stored = {(0, 0, 5): Span(0, 5), (0, 0, 8): Span(5, 8), (1, 0, 8): Span(4, 8)}
    asked: list[set] = []

    def probe(asks):
        asked.append(set(asks))
        return {a: stored.get(a) for a in asks}

    params = LookupParams(blocks_per_object=8, checkpoint_blocks=8)
    res = find_hit(g, params, 0, 12, 11, probe)
    assert res.h_blocks == 8, res
    assert any((0, 0, 5) in wave for wave in asked)
