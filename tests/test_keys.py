"""Namespaces, chained-prefix digests and object keys (s3kv/core/keys.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from s3kv.core.keys import (
    DIGEST_SIZE,
    Chain,
    ChainMemo,
    KeyScheme,
    NotCacheable,
    ParsedKey,
    chain_digests,
    chain_root,
    namespace_digest,
    parse_key,
)
from s3kv.core.layout import CacheGeometry, GroupGeometry

TPB = 4


def geometry(**changes) -> CacheGeometry:
    base = dict(
        tokens_per_block=TPB,
        groups=(
            GroupGeometry(0, 64, (0, 1, 2, 3, 4), (1024, 1024)),
            GroupGeometry(1, None, (5,), (1024, 1024)),
        ),
        tp_size=2,
        kv_dtype="bfloat16",
        model_id="org/model-7b",
    )
    base.update(changes)
    return CacheGeometry(**base)


def root(**kw) -> bytes:
    return chain_root(namespace_digest(geometry()), **kw)


# ---------------------------------------------------------------- the chain


def test_chain_digest_depends_on_every_earlier_token():
    r = root()
    a = list(range(100, 100 + 4 * TPB))
    b = list(a)
    b[0] += 1  # differs only in block 0
    da, db = chain_digests(r, a, TPB), chain_digests(r, b, TPB)
    assert len(da) == len(db) == 4
    # Blocks 1..3 hold identical tokens, but their prefixes differ: every digest differs.
    assert a[TPB:] == b[TPB:]
    for i in range(4):
        assert da[i] != db[i], f"block {i} digest ignores an earlier token"


@pytest.mark.parametrize("pos", range(3 * TPB))
def test_any_single_earlier_token_changes_later_digest(pos):
    r = root()
    a = list(range(7, 7 + 4 * TPB))
    b = list(a)
    b[pos] = 99_999
    da, db = chain_digests(r, a, TPB), chain_digests(r, b, TPB)
    blk = pos // TPB
    assert da[:blk] == db[:blk]  # blocks before the change are shared
    assert all(da[i] != db[i] for i in range(blk, 4))


def test_shared_block_different_prefix_gives_different_digest():
    r = root()
    shared = [5, 6, 7, 8]
    p1 = [1, 2, 3, 4] + shared
    p2 = [9, 9, 9, 9] + shared
    assert chain_digests(r, p1, TPB)[1] != chain_digests(r, p2, TPB)[1]
    # ...while equal prefixes give equal digests (determinism).
    assert chain_digests(r, p1, TPB) == chain_digests(r, list(p1), TPB)


def test_chain_ignores_partial_block_and_is_incremental():
    r = root()
    toks = list(range(3 * TPB + 2))
    c = Chain(r, TPB)
    assert c.extend_to(toks[: TPB + 1]) and len(c) == 1
    c.extend_to(toks)
    assert len(c) == 3
    assert c.digests == chain_digests(r, toks[: 3 * TPB], TPB)
    assert all(len(d) == DIGEST_SIZE for d in c.digests)


def test_chain_digests_are_stable_across_versions():
    # Keys name objects other engines and earlier versions wrote: the digest of a fixed prompt
    # must never change unnoticed. The constants were produced by the array("q") conversion
    # s3kv used before the struct one (tokens spanning 0 to 2**40, a partial last block).
    toks = [0, 1, 31999, 2**31, 2**40, 7] * 11 + [5]
    r = chain_root(b"ns-golden", cache_salt="t")
    assert r.hex() == "301d54f99794ec05070ca742608e97ae"
    digests = chain_digests(r, toks, 8)
    assert len(digests) == 8
    assert digests[-1].hex() == "4b7b4c2b7aa6e63c37b9b43225c92ba7"


def test_a_remembered_chain_gives_exactly_the_digests_hashing_gives():
    # Reused digests stop at the first block whose tokens differ, by one token anywhere in it,
    # and never cross roots (a salt, an adapter) or block sizes.
    import random

    rng = random.Random(3)
    memo = ChainMemo()
    r, other = root(), root(cache_salt="tenant-b")
    base = [rng.randrange(1 << 20) for _ in range(40 * TPB + 3)]
    first = memo.chain(r, TPB, base)
    assert first.digests == chain_digests(r, base, TPB) and memo.reused == 0
    for cut in (0, 1, 17, 39):  # a token inside block ``cut`` differs
        p = list(base)
        p[cut * TPB + rng.randrange(TPB)] ^= 1
        p += [rng.randrange(1 << 20) for _ in range(5 * TPB)]
        before = memo.reused
        got = memo.chain(r, TPB, p)
        assert got.digests == chain_digests(r, p, TPB)
        assert memo.reused - before == cut  # every block before it, none from it on
    longer = base + [1, 2, 3] * (8 * TPB)
    before = memo.reused
    assert memo.chain(r, TPB, longer).digests == chain_digests(r, longer, TPB)
    assert memo.reused - before == len(base) // TPB  # a next turn: the whole history reused
    assert memo.chain(other, TPB, base).digests == chain_digests(other, base, TPB)
    assert memo.chain(r, 2 * TPB, base).digests == chain_digests(r, base, 2 * TPB)
    assert memo.chain(r, TPB, base[:TPB - 1]).digests == []


def test_a_remembered_chain_that_grew_is_reused_as_far_as_it_digested():
    r = root()
    memo = ChainMemo()
    toks = list(range(10 * TPB))
    c = memo.chain(r, TPB, toks[: 4 * TPB])
    c.extend_to(toks)  # the request's decode blocks, as its saves digest them
    before = memo.reused
    assert memo.chain(r, TPB, toks + [7] * TPB).digests == chain_digests(r, toks + [7] * TPB, TPB)
    assert memo.reused - before == 10


def test_the_memo_keeps_within_its_token_bound():
    r = root()
    memo = ChainMemo(max_tokens=10 * TPB, per_key=2)
    for i in range(6):
        memo.chain(r, TPB, [i] * (4 * TPB))  # six first blocks, six keys
    assert memo._tokens <= 10 * TPB and len(memo._lru) == 2
    for _ in range(4):
        memo.chain(r, TPB, [9] * (2 * TPB))  # one key, at most per_key chains
    assert all(len(same) <= 2 for same in memo._by_first.values())
    assert memo._tokens == sum(t for _, t in memo._lru.values()) <= 10 * TPB


def test_the_memo_finds_where_a_prompt_parts_from_any_recent_one():
    """The branch point is the longest prefix shared with any recent prompt that went on past it:
    found though many prompts with the same first blocks came between (more than the chains the memo
    compares), not where the earlier prompt ended (a next turn), and none for a repeat."""
    import random

    rng = random.Random(4)
    r = root()
    memo = ChainMemo(per_key=2)
    system = [rng.randrange(1 << 20) for _ in range(3 * TPB)]
    doc = [rng.randrange(1 << 20) for _ in range(5 * TPB + 7)]
    first = memo.chain(r, TPB, system + doc + [1] * (2 * TPB))
    assert first.branch == 0  # nothing recent
    for _ in range(6):
        other = memo.chain(r, TPB, system + [rng.randrange(1 << 20) for _ in range(4 * TPB)])
        assert other.branch == 3
    second = memo.chain(r, TPB, system + doc + [2] * (2 * TPB))
    assert second.branch == len(system + doc) // TPB
    turn = system + doc + [2] * (2 * TPB) + [5] * (3 * TPB)
    assert memo.chain(r, TPB, turn).branch == 0  # the second prompt ended where this one goes on
    assert memo.chain(r, TPB, turn).branch == 0  # a repeat
    assert memo.chain(root(cache_salt="b"), TPB, system + doc + [3] * TPB).branch == 0  # another root


def test_chain_rejects_a_token_that_is_not_an_int64():
    with pytest.raises((OverflowError, TypeError, ValueError)):
        chain_digests(root(), [2**63] * TPB, TPB)
    with pytest.raises((OverflowError, TypeError, ValueError)):
        chain_digests(root(), ["a"] * TPB, TPB)


def test_chain_digest_is_per_block_not_token_concatenation():
    # [1,2,3,4 | 5,6,7,8] vs a different split of the same token stream is not
    # possible with a fixed tpb, but token values that concatenate ambiguously
    # as text must not collide: 1,23 vs 12,3.
    r = root()
    a = [1, 23, 0, 0]
    b = [12, 3, 0, 0]
    assert chain_digests(r, a, TPB) != chain_digests(r, b, TPB)


def test_large_token_ids_supported_and_distinct():
    r = root()
    a = [2**40, 1, 2, 3]
    b = [2**40 + 1, 1, 2, 3]
    assert chain_digests(r, a, TPB) != chain_digests(r, b, TPB)


# ---------------------------------------------------------------- the root


def test_a_lora_root_takes_an_adapter_identity_never_an_integer_id():
    """TensorRT-LLM's lora_task_id is numbered per deployment; passing it as the identity is refused."""
    with pytest.raises(TypeError, match="identity"):
        root(lora=7)
    # Base requests keep the digests they had before adapters were keyed by identity.
    assert root() == root(lora=None)


def test_root_changes_with_salt_lora_and_multimodal():
    base = root()
    variants = {
        "salt": root(cache_salt="tenant-a"),
        "salt2": root(cache_salt="tenant-b"),
        "salt_int": root(cache_salt=7),
        "lora": root(lora="adapter-a"),
        "lora2": root(lora="adapter-b"),
        "mm": root(multimodal_hashes=[[1, 2, 3]], has_multimodal=True),
        "mm2": root(multimodal_hashes=[[1, 2, 4]], has_multimodal=True),
    }
    values = [base, *variants.values()]
    assert len(set(values)) == len(values), "some root input is ignored"
    # Deterministic.
    assert root(cache_salt="tenant-a") == variants["salt"]
    # A different root gives a different chain for the same tokens.
    toks = list(range(TPB * 2))
    assert chain_digests(base, toks, TPB)[1] != chain_digests(variants["salt"], toks, TPB)[1]


def test_multimodal_without_hashes_is_not_cacheable():
    ns = namespace_digest(geometry())
    with pytest.raises(NotCacheable):
        chain_root(ns, has_multimodal=True)
    with pytest.raises(NotCacheable):
        chain_root(ns, has_multimodal=True, multimodal_hashes=[])
    # Hashes given: fine.
    assert len(chain_root(ns, has_multimodal=True, multimodal_hashes=[b"\x01\x02"])) == DIGEST_SIZE


def test_multimodal_hash_forms_normalise():
    ns = namespace_digest(geometry())
    assert chain_root(ns, multimodal_hashes=[[1, 2]], has_multimodal=True) == chain_root(
        ns, multimodal_hashes=[(1, 2)], has_multimodal=True
    )
    assert chain_root(ns, multimodal_hashes=[b"\xab"], has_multimodal=True) == chain_root(
        ns, multimodal_hashes=[bytearray(b"\xab")], has_multimodal=True
    )


def test_root_depends_on_namespace():
    ns1 = namespace_digest(geometry())
    ns2 = namespace_digest(geometry(model_id="other"))
    assert chain_root(ns1) != chain_root(ns2)


# ---------------------------------------------------------------- namespace


def _group_variant(field: str, value):
    g0, g1 = geometry().groups
    return geometry(groups=(dataclasses.replace(g0, **{field: value}), g1))


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(lambda: geometry(tokens_per_block=TPB * 2), id="tpb"),
        pytest.param(lambda: geometry(tp_size=4), id="tp"),
        pytest.param(lambda: geometry(kv_dtype="float8_e4m3"), id="dtype"),
        pytest.param(lambda: geometry(model_id="org/model-8b"), id="model"),
        pytest.param(lambda: _group_variant("window", 128), id="window"),
        pytest.param(lambda: _group_variant("window", None), id="window-none"),
        pytest.param(lambda: _group_variant("region_sizes", (1024, 2048)), id="page-bytes"),
        pytest.param(lambda: _group_variant("region_sizes", (2048,)), id="region-split"),
        pytest.param(lambda: _group_variant("layer_ids", (0, 1, 2, 3, 6)), id="layer-ids"),
        pytest.param(
            lambda: geometry(groups=(GroupGeometry(0, 64, (0, 1, 2, 3, 4), (1024, 1024)),)), id="group-count"
        ),
    ],
)
def test_namespace_changes_with_any_geometry_field(variant):
    assert namespace_digest(variant()) != namespace_digest(geometry())


def test_namespace_deterministic():
    assert namespace_digest(geometry()) == namespace_digest(geometry())
    assert len(namespace_digest(geometry())) == DIGEST_SIZE


def test_group_fingerprint_ignores_group_id():
    a = GroupGeometry(0, 64, (1, 2), (100,))
    b = GroupGeometry(3, 64, (1, 2), (100,))
    assert a.fingerprint == b.fingerprint
    assert re.fullmatch(r"[0-9a-f]{16}", a.fingerprint)
    assert a.fingerprint != GroupGeometry(0, 32, (1, 2), (100,)).fingerprint


# ---------------------------------------------------------------- object keys


def test_object_key_holds_no_token_ids():
    g = geometry()
    ns = namespace_digest(g)
    scheme = KeyScheme("kv/prod", ns, g.tp_size)
    # Distinctive token values that would be easy to spot in a key.
    tokens = [987_654_321, 123_454_321, 555_666_777, 424_242_424] * 2
    digests = chain_digests(chain_root(ns), tokens, TPB)
    keys = [scheme.object_key(grp.fingerprint, s, d) for grp in g.groups for s in range(2) for d in digests]
    for key in keys:
        for t in set(tokens):
            assert str(t) not in key
            assert f"{t:x}" not in key
    # Shape: prefix/ns/gfp.shardoftp/digest
    assert re.fullmatch(r"kv/prod/[0-9a-f]{32}/[0-9a-f]{16}\.[01]of2/[0-9a-f]{32}", keys[0])


def test_object_keys_distinct_per_group_shard_and_digest():
    g = geometry()
    scheme = KeyScheme("p", namespace_digest(g), g.tp_size)
    d1, d2 = bytes(range(16)), bytes(range(1, 17))
    keys = {
        scheme.object_key(grp.fingerprint, s, d) for grp in g.groups for s in range(g.tp_size) for d in (d1, d2)
    }
    assert len(keys) == g.num_groups * g.tp_size * 2
    assert all(k.startswith(scheme.namespace_prefix) for k in keys)


@pytest.mark.parametrize("prefix", ["", "kv", "a/b/c"])
def test_parse_key_inverts_object_key(prefix):
    g = geometry()
    ns = namespace_digest(g)
    scheme = KeyScheme(prefix, ns, g.tp_size)
    digest = bytes(range(200, 216))
    grp = g.groups[0]
    key = scheme.object_key(grp.fingerprint, 1, digest)
    assert parse_key(key) == ParsedKey(ns.hex(), grp.fingerprint, 1, g.tp_size, digest.hex())
    if prefix:
        assert key.startswith(prefix + "/")
    else:
        assert not key.startswith("/")


@pytest.mark.parametrize(
    "key",
    [
        "",
        "justone",
        "a/b",
        "p/" + "0" * 32 + "/" + "1" * 16 + ".0of2/" + "z" * 32,  # digest not hex
        "p/" + "0" * 31 + "/" + "1" * 16 + ".0of2/" + "2" * 32,  # short namespace
        "p/" + "0" * 32 + "/" + "1" * 15 + ".0of2/" + "2" * 32,  # short fingerprint
        "p/" + "0" * 32 + "/" + "1" * 16 + ".xof2/" + "2" * 32,  # shard not int
        "p/" + "0" * 32 + "/" + "1" * 16 + "/" + "2" * 32,  # no shard part
    ],
)
def test_parse_key_rejects_foreign(key):
    assert parse_key(key) is None
