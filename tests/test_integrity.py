"""Keyed integrity tags (s3kv/core/integrity.py, s3kv/core/objects.py) and span checks: the attacks of
issue #17 points 1 and 2 reproduced, then refused -- as counted misses, never loads."""

from __future__ import annotations

import dataclasses
import logging
import random
import struct

import pytest
import xxhash
from test_connector_sim import make_engine, run
from test_worker import digest, load_md, make_core, save_object, step

from s3kv.config import ConfigError, Settings, load_settings
from s3kv.core.errors import LoadFailed
from s3kv.core.integrity import IntegrityKeys, TagKey, keys_from_settings
from s3kv.core.keys import chain_digests, chain_root, parse_key
from s3kv.core.layout import CacheGeometry, GroupGeometry
from s3kv.core.objects import (
    FIXED_LEN,
    MAX_PAGES_PER_OBJECT,
    ObjectFormatError,
    ObjectIdentity,
    SpanMismatch,
    Unauthenticated,
    UnsupportedVersion,
    decode_header,
    decode_object,
    encode_object,
    header_len,
    object_metadata,
    span_from_metadata,
    trailer_len,
    trailer_range,
    verify_page,
)
from s3kv.engine.leader import LeaderCore
from s3kv.sim import gemma3_like, multi_turn_workload, repeat_workload
from s3kv.sim.layouts import page_bytes
from s3kv.store.base import ByteRange
from s3kv.store.memory import MemoryStore
from s3kv.tools.ops import identity_from

SECRET = "0123456789abcdef" * 4
OLD_SECRET = "fedcba9876543210" * 4
KEYS = IntegrityKeys.from_secrets(SECRET)
PAGE = 64
BASE = ObjectIdentity(bytes(range(16)), "0123456789abcdef", 1, 2, 32, PAGE)
SIGNED = dataclasses.replace(BASE, integrity=KEYS)
DIGEST = bytes(range(100, 116))
KEY = "pfx/ns/0123456789abcdef.1of2/" + DIGEST.hex()


def pages(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(PAGE) for _ in range(n)]


def joined(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def signed_object(n: int = 3, first: int = 8, ident: ObjectIdentity = SIGNED, key: str = KEY):
    ps = pages(n)
    return joined(encode_object(ident, first, DIGEST, ps, key)), object_metadata(ident, first, n, key), ps


def forged(n: int = 3, first: int = 8, seed: int = 99):
    """What anyone with PutObject can write: chosen pages, recomputed xxh3, mirrored metadata."""
    ps = pages(n, seed)
    return joined(encode_object(BASE, first, DIGEST, ps)), object_metadata(BASE, first, n), ps


# ------------------------------------------------------------------ point 1: planted KV


def test_forged_object_passes_unkeyed_checks_then_is_refused_with_a_key():
    data, md, ps = forged()
    # The hole: without a key, recomputed checksums pass every check.
    assert span_from_metadata(BASE, md, len(data), KEY).count == 3
    _, got = decode_object(data, BASE, KEY)
    assert [bytes(p) for p in got] == ps
    # The fix: a key holder refuses it on HEAD and on load.
    with pytest.raises(Unauthenticated, match="no integrity tag"):
        span_from_metadata(SIGNED, md, len(data), KEY)
    with pytest.raises(Unauthenticated):
        decode_object(data, SIGNED, KEY)
    assert Unauthenticated.reason == "untrusted"


def test_signed_object_round_trips_whole_and_ranged():
    data, md, ps = signed_object(4)
    assert span_from_metadata(SIGNED, md, len(data), KEY).count == 4
    header, got = decode_object(data, SIGNED, KEY)
    assert header.tagged and [bytes(p) for p in got] == ps
    # Ranged: header + one page + the trailer, as the downloader fetches them.
    store = MemoryStore()
    store.put(KEY, encode_object(SIGNED, 8, DIGEST, ps, KEY), md)
    off, n = trailer_range(SIGNED, 4)
    hl = header_len(4)
    head, page2, trailer = store.get_ranges(KEY, [ByteRange(0, hl), ByteRange(hl + 2 * PAGE, PAGE), ByteRange(off, n)])
    h = decode_header(head, SIGNED, KEY, trailer)
    verify_page(h, 2, page2, KEY)
    # Even where an xxh3 collides (simulated: the checksum list says page 1 looks like page 2),
    # the page tag tells them apart.
    sums = list(h.checksums)
    sums[1] = sums[2]
    with pytest.raises(Unauthenticated, match="page 1"):
        verify_page(dataclasses.replace(h, checksums=tuple(sums)), 1, page2, KEY)
    # A header decoded without its trailer verifies no page (fail closed).
    with pytest.raises(Unauthenticated):
        decode_header(head, SIGNED, KEY)


def test_reader_without_key_still_reads_tagged_objects():
    data, md, ps = signed_object(2)
    assert span_from_metadata(BASE, md, len(data), KEY).count == 2
    _, got = decode_object(data, BASE, KEY)
    assert [bytes(p) for p in got] == ps
    head = data[: header_len(2)]
    h = decode_header(head, BASE, KEY)
    verify_page(h, 0, ps[0], KEY)


def test_signed_object_copied_to_another_key_is_refused():
    data, md, _ = signed_object()
    other = KEY[:-1] + ("0" if KEY[-1] != "0" else "1")
    with pytest.raises(Unauthenticated, match="metadata"):
        span_from_metadata(SIGNED, md, len(data), other)
    with pytest.raises(Unauthenticated, match="object integrity tag"):
        decode_object(data, SIGNED, other)


@pytest.mark.parametrize("field,value", [("s3kv-first", "0"), ("s3kv-count", "2"), ("s3kv-tag", "00.00")])
def test_metadata_edits_break_the_metadata_tag(field, value):
    data, md, _ = signed_object(3)
    md = {**md, field: value}
    with pytest.raises(Unauthenticated):
        span_from_metadata(SIGNED, md, len(data), KEY)


def _restamp_header(data: bytes, n: int) -> bytes:
    """An attacker's edit kept self-consistent: recompute the header's xxh3."""
    hl = header_len(n)
    body = data[: hl - 8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + data[hl:]


def _recompute_page_sums(data: bytes, n: int) -> bytes:
    hl = header_len(n)
    sums = [xxhash.xxh3_64_intdigest(data[hl + i * PAGE : hl + (i + 1) * PAGE]) for i in range(n)]
    return _restamp_header(data[:FIXED_LEN] + struct.pack(f"<{n}Q", *sums) + data[hl - 8 :], n)


def test_seeded_tamper_fuzz_never_yields_wrong_pages():
    """Random edits anywhere (pages, header fields, trailer), with every xxh3 recomputed."""
    n = 3
    data, md, ps = signed_object(n)
    rng = random.Random(1717)
    refused = 0
    for _ in range(600):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cand = _recompute_page_sums(bytes(b), n)
        try:
            _, got = decode_object(cand, SIGNED, KEY)
        except ObjectFormatError:
            refused += 1
            continue
        # Accepted only if the edit was undone by the recompute (e.g. it hit an xxh3 field).
        assert [bytes(p) for p in got] == ps
    assert refused > 500


def test_swapped_pages_and_trailer_from_another_object_are_refused():
    n = 3
    data, _, ps = signed_object(n)
    hl = header_len(n)
    swapped = data[:hl] + data[hl + PAGE : hl + 2 * PAGE] + data[hl : hl + PAGE] + data[hl + 2 * PAGE :]
    with pytest.raises(ObjectFormatError):
        decode_object(_recompute_page_sums(swapped, n), SIGNED, KEY)
    # Forged body with a trailer lifted from a genuine object (same key): object tag mismatch.
    f, _, _ = forged(n)
    flagged = bytearray(f)
    flagged[6:8] = struct.pack("<H", 1)  # set the TAGGED flag, as the genuine one has
    lifted = _restamp_header(bytes(flagged), n) + data[-trailer_len(n) :]
    with pytest.raises(Unauthenticated):
        decode_object(lifted, SIGNED, KEY)


def test_rotation_previous_keys_accepted_unknown_refused():
    old = dataclasses.replace(BASE, integrity=IntegrityKeys.from_secrets(OLD_SECRET))
    data, md, ps = signed_object(ident=old)
    rotated = dataclasses.replace(BASE, integrity=IntegrityKeys.from_secrets(SECRET, [OLD_SECRET]))
    assert span_from_metadata(rotated, md, len(data), KEY).count == 3
    _, got = decode_object(data, rotated, KEY)
    assert [bytes(p) for p in got] == ps
    with pytest.raises(Unauthenticated, match="unknown key"):
        span_from_metadata(SIGNED, md, len(data), KEY)
    with pytest.raises(Unauthenticated, match="unknown key"):
        decode_object(data, SIGNED, KEY)
    # Writers sign with the current key only.
    new_data, new_md, _ = signed_object(ident=rotated)
    assert new_md["s3kv-tag"].startswith(TagKey.from_secret(SECRET).key_id.hex())
    decode_object(new_data, SIGNED, KEY)


def test_unknown_header_flag_is_unsupported_not_corrupt():
    data, _, _ = signed_object()
    b = bytearray(data)
    b[6:8] = struct.pack("<H", 0x8001)
    with pytest.raises(UnsupportedVersion, match="flags"):
        decode_object(_restamp_header(bytes(b), 3), BASE, KEY)


def test_tag_key_repr_and_settings_repr_hide_secrets(tmp_path):
    assert SECRET not in repr(KEYS) and SECRET not in repr(TagKey.from_secret(SECRET))
    s = Settings(integrity_key=SECRET, integrity_previous_keys=OLD_SECRET)
    assert SECRET not in repr(s) and OLD_SECRET not in repr(s)


# ------------------------------------------------------------------ settings


def test_keys_from_settings_inline_files_and_errors(tmp_path):
    assert Settings().integrity is None
    kf = tmp_path / "key"
    kf.write_text(SECRET + "\n")
    pf = tmp_path / "previous"
    pf.write_text(f"# retired 2025-01\n{OLD_SECRET}\n\n")
    s = load_settings(
        {"S3KV_INTEGRITY_KEY_FILE": str(kf), "S3KV_INTEGRITY_PREVIOUS_KEYS_FILE": str(pf)}, require_url=False
    )
    assert s.integrity is not None
    assert s.integrity.current.key_id == TagKey.from_secret(SECRET).key_id
    assert [k.key_id for k in s.integrity.previous] == [TagKey.from_secret(OLD_SECRET).key_id]
    inline = load_settings(
        {"S3KV_INTEGRITY_KEY": SECRET, "S3KV_INTEGRITY_PREVIOUS_KEYS": f"{OLD_SECRET},{SECRET}"}, require_url=False
    )
    assert inline.integrity is not None and len(inline.integrity.accepted) == 2  # current listed twice: dropped
    with pytest.raises(ConfigError, match="set only one"):
        Settings(integrity_key=SECRET, integrity_key_file=str(kf))
    with pytest.raises(ConfigError, match="need a current key"):
        Settings(integrity_previous_keys=OLD_SECRET)
    two = tmp_path / "two"
    two.write_text(f"{SECRET}\n{OLD_SECRET}\n")
    with pytest.raises(ConfigError, match="exactly one secret") as ei:
        Settings(integrity_key_file=str(two))
    assert SECRET not in str(ei.value)
    short = tmp_path / "short"
    short.write_text("tiny\n")
    with pytest.raises(ConfigError, match="S3KV_INTEGRITY_KEY_FILE.*32 characters"):
        Settings(integrity_key_file=str(short))
    assert keys_from_settings(Settings(integrity_key=SECRET)) is not None


# ------------------------------------------------------------------ point 2: span poisoning


def test_span_must_end_at_the_block_the_key_names():
    md = object_metadata(BASE, 0, 16)
    size = header_len(16) + 16 * PAGE
    # Before: a reader that did not say which block it asked for accepts any span.
    assert span_from_metadata(BASE, md, size, KEY).end == 16
    with pytest.raises(SpanMismatch, match="ending at block 5"):
        span_from_metadata(BASE, md, size, KEY, end=5)
    assert span_from_metadata(BASE, md, size, KEY, end=16).first == 0
    big = object_metadata(BASE, 0, MAX_PAGES_PER_OBJECT + 1)
    with pytest.raises(SpanMismatch):
        span_from_metadata(BASE, big, header_len(MAX_PAGES_PER_OBJECT + 1) + (MAX_PAGES_PER_OBJECT + 1) * PAGE, KEY)
    with pytest.raises(ValueError):
        encode_object(BASE, -1, DIGEST, pages(1))


TPB = 16


def _geometry() -> CacheGeometry:
    return CacheGeometry(TPB, (GroupGeometry(0, None, (0,), (PAGE,)),), 1, "bfloat16", "m")


def _leader(store, **kw) -> LeaderCore:
    s = Settings(url="memory://t", blocks_per_object=4, checkpoint_tokens=16 * TPB, **{"lookup_timeout_s": 5.0, **kw})
    g = _geometry()
    leader = LeaderCore(s, store, "pfx", tp_size=1, model_id=g.model_id, kv_dtype=g.kv_dtype, geometry=g)
    assert leader.geometry is not None  # sets the namespace
    return leader


def _tokens(n_blocks: int, seed: int = 3) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(n_blocks * TPB + 5)]


def _plant(store, leader: LeaderCore, tokens, spans: dict[int, tuple[int, int]], ident: ObjectIdentity | None = None):
    """Objects at the keys ``leader`` will ask for (key named by ``end``), with the given spans."""
    g = leader.geometry
    assert g is not None
    grp = g.groups[0]
    digests = chain_digests(chain_root(leader.namespace), tokens, TPB)
    ident = ident or ObjectIdentity(leader.namespace, grp.fingerprint, 0, 1, TPB, PAGE)
    for end, (first, count) in spans.items():
        key = leader.scheme.object_key(grp.fingerprint, 0, digests[end - 1])
        rng = random.Random(end)
        body = encode_object(ident, first, digests[end - 1], [rng.randbytes(PAGE) for _ in range(count)], key)
        store.put(key, body, object_metadata(ident, first, count, key))


def test_planted_objects_are_a_counted_miss_for_a_keyed_leader():
    tokens = _tokens(12)
    store = MemoryStore()
    open_leader = _leader(store)
    _plant(store, open_leader, tokens, {4: (0, 4), 8: (4, 4), 12: (8, 4)})
    # The hole: an engine without a key serves the planter's pages.
    n, _ = open_leader.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    assert n == 12 * TPB
    # Keyed engines: the planter (no key) writes into their namespace too -- a miss, counted.
    keyed = _leader(store, integrity_key=SECRET)
    assert keyed.namespace != open_leader.namespace
    _plant(store, keyed, tokens, {4: (0, 4), 8: (4, 4), 12: (8, 4)})
    n, _ = keyed.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    assert n == 0 and keyed.stats.misses == 1
    assert keyed.stats.rejected.get("untrusted", 0) >= 1
    assert keyed.stats.foreign_objects == sum(keyed.stats.rejected.values())


def test_signed_objects_hit_for_a_keyed_leader():
    tokens = _tokens(12)
    store = MemoryStore()
    keyed = _leader(store, integrity_key=SECRET)
    g = keyed.geometry
    assert g is not None
    ident = ObjectIdentity(keyed.namespace, g.groups[0].fingerprint, 0, 1, TPB, PAGE, KEYS)
    _plant(store, keyed, tokens, {4: (0, 4), 8: (4, 4), 12: (8, 4)}, ident)
    n, _ = keyed.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    assert n == 12 * TPB and not keyed.stats.rejected


def test_span_poisoned_object_is_a_counted_miss():
    tokens = _tokens(20)
    store = MemoryStore()
    leader = _leader(store)
    # Stored under the key of the object ending at block 4, claiming blocks 0..16.
    _plant(store, leader, tokens, {4: (0, 16)})
    n, _ = leader.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    assert n == 0
    assert leader.stats.rejected == {"span": 1} and leader.stats.misses == 1
    # Behind an honest object, a poisoned one ends the hit where the honest one ends.
    store2 = MemoryStore()
    leader2 = _leader(store2)
    _plant(store2, leader2, tokens, {4: (0, 4), 8: (0, 16)})
    n, _ = leader2.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    assert n == 4 * TPB and leader2.stats.rejected == {"span": 1}


def test_index_never_holds_a_poisoned_span():
    tokens = _tokens(8)
    store = MemoryStore()
    leader = _leader(store)
    _plant(store, leader, tokens, {4: (2, 4)})  # ends at 6, key names 4
    leader.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
    digests = chain_digests(chain_root(leader.namespace), tokens, TPB)
    key = leader.scheme.object_key(leader.geometry.groups[0].fingerprint, 0, digests[3])  # type: ignore[union-attr]
    assert leader.index.get(key) is None



# ------------------------------------------------------------------ the worker's load path


def _failed_load(core, md, caplog) -> str:
    """Run one iteration whose load must fail; the logged reason. (Builds differ in the outcome
    of a failed sync load -- raised LoadFailed, or the engine's failure rung -- never in the log.)"""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="s3kv"):
        try:
            step(core, md)
        except LoadFailed as e:
            return str(e)
    assert "promised load failed" in caplog.text, caplog.text
    return caplog.text


def test_worker_load_verifies_tags_and_refuses_an_overwritten_object(caplog):
    store = MemoryStore()
    a, la = make_core(store, seed=1, integrity_key=SECRET)
    d = digest("signed", 3)
    step(a, save_object(a, 1, 0, 0, [1, 2, 3], d))
    a.flush(5)
    key = a.object_key(0, d)
    original, meta = store.get(key), store.head(key).metadata
    assert "s3kv-tag" in meta
    b, lb = make_core(store, seed=2, integrity_key=SECRET)
    step(b, load_md(7, 0, d, ((0, 3),), [0, 1, 2], [20, 21, 22]))
    assert [page_bytes(lb, 0, s) for s in (20, 21, 22)] == [page_bytes(la, 0, s) for s in (1, 2, 3)]

    # Overwritten in place (a bucket without write-once enforcement): genuine metadata and
    # trailer, chosen pages, every xxh3 recomputed.
    pb = a.identity(0).page_bytes
    n, hl = 3, header_len(3)
    body = bytearray(original)
    body[hl : hl + pb] = random.Random(5).randbytes(pb)
    sums = [xxhash.xxh3_64_intdigest(bytes(body[hl + i * pb : hl + (i + 1) * pb])) for i in range(n)]
    body[FIXED_LEN : FIXED_LEN + 8 * n] = struct.pack(f"<{n}Q", *sums)
    body[hl - 8 : hl] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body[: hl - 8])))
    store.delete_many([key])
    store.put(key, bytes(body), meta)
    c, lc = make_core(store, seed=3, integrity_key=SECRET)
    before = [page_bytes(lc, 0, s) for s in (20, 21, 22)]
    reason = _failed_load(c, load_md(7, 0, d, ((0, 3),), [0, 1, 2], [20, 21, 22]), caplog)
    assert "Unauthenticated" in reason and key in reason
    assert [page_bytes(lc, 0, s) for s in (20, 21, 22)] == before  # nothing reached a slot
    assert c.stats().loads_failed_objects == 1
    for core in (a, b, c):
        core.close()


def test_worker_refuses_a_plan_whose_shard_spans_end_at_different_blocks(caplog):
    store = MemoryStore()
    a, _ = make_core(store, seed=1)
    d = digest("spans", 3)
    step(a, save_object(a, 1, 0, 0, [1, 2, 3], d))
    a.flush(5)
    b, lb = make_core(store, seed=2, tp_rank=0, tp_size=1)
    before = page_bytes(lb, 0, 20)
    reason = _failed_load(b, load_md(7, 0, d, ((0, 3), (0, 5)), [0], [20]), caplog)
    assert "do not end at one block" in reason
    assert page_bytes(lb, 0, 20) == before
    for core in (a, b):
        core.close()


# ------------------------------------------------------------------ the cost, measured


def test_bench_integrity_cli_reports_sign_and_verify_rates():
    import json

    from click.testing import CliRunner

    from s3kv.cli import main

    out = CliRunner().invoke(main, ["bench", "integrity", "--quick", "--json", "--object-mib", "1"],
                             catch_exceptions=False)
    assert out.exit_code == 0, out.output
    res = json.loads(out.stdout)
    (row,) = res["results"]
    for k in ("sign_gbps", "verify_gbps", "sign_xxh3_only_gbps", "verify_xxh3_only_gbps", "sign_parallel_gbps",
              "verify_parallel_gbps", "blake2b_keyed_gbps", "hmac_sha256_gbps"):
        assert row[k] > 0, k
    assert row["object_bytes"] == row["pages_per_object"] * int(row["page_mib"] * (1 << 20))


# ------------------------------------------------------------------ end to end on the simulator


def _forge_every_object(store: MemoryStore) -> int:
    """The attack of #17 point 1: rewrite each object with other pages, recomputed checksums,
    and metadata mirrored as a writer without the key would produce it."""
    rng = random.Random(17)
    n = 0
    for key in store.keys():
        info = store.head(key)
        parsed = parse_key(key)
        assert info is not None and parsed is not None
        ident = identity_from(parsed, info.metadata, key)
        data = store.get(key)
        h = decode_header(data, ident, key)
        fake = [rng.randbytes(ident.page_bytes) for _ in range(h.page_count)]
        store.delete_many([key])
        store.put(key, encode_object(ident, h.first_ordinal, h.last_digest, fake),
                  object_metadata(ident, h.first_ordinal, h.page_count))
        n += 1
    return n


@pytest.mark.parametrize("key", [None, SECRET], ids=["no-key", "keyed"])
def test_simulated_fleet_planted_kv(key):
    kw = {"integrity_key": key} if key else {}
    specs = multi_turn_workload(n_conversations=2, turns=2, system_len=160, first_len=96, turn_len=64,
                                max_new_tokens=16)
    store = MemoryStore()
    cold = run(make_engine(store, gemma3_like(64, kv_heads=2), tp=2, **kw), specs)
    warm = run(make_engine(store, gemma3_like(64, kv_heads=2), tp=2, **kw), repeat_workload(specs, 10_000))
    assert cold.kv_mismatches == 0 and warm.kv_mismatches == 0 and warm.hit_rate >= 0.9
    assert _forge_every_object(store) > 0
    eng = make_engine(store, gemma3_like(64, kv_heads=2), tp=2, **kw)
    planted = run(eng, repeat_workload(specs, 20_000))
    if key is None:
        # The hole: wrong pages served, no error anywhere.
        assert planted.kv_mismatches > 0
    else:
        assert planted.kv_mismatches == 0 and planted.matched_tokens == 0
        assert eng.leader.core.stats.rejected.get("untrusted", 0) > 0


def test_operator_check_reads_tagged_objects_without_the_key():
    from s3kv.tools.ops import _verify_streamed

    store = MemoryStore()
    key = "kv/" + "00" * 16 + "/0123456789abcdef.1of2/" + DIGEST.hex()
    ident = dataclasses.replace(SIGNED, namespace=bytes(16))
    store.put(key, encode_object(ident, 8, DIGEST, pages(3), key), object_metadata(ident, 8, 3, key))
    info = store.head(key)
    parsed = parse_key(key)
    assert info is not None and parsed is not None
    assert _verify_streamed(store, parsed, info) == 3


def test_metadata_names_in_any_case_are_read_as_s3_sends_them() -> None:
    """Stores hand names over lowercased (taken as they are, on the lookup's hot path); a caller's
    mixed-case dict is lowercased first, keyed objects included."""
    data, md, _ = signed_object(4)
    upper = {k.upper(): v for k, v in md.items()}
    assert upper != md and span_from_metadata(SIGNED, upper, len(data), KEY).count == 4
    assert span_from_metadata(SIGNED, md, len(data), KEY).count == 4


# ------------------------------------------------------------------ integrity off by default (#29.6)


@pytest.mark.parametrize(
    "url, key, warns",
    [
        ("s3://acme-kv/p", "", True),
        ("s3://acme-kv/p", "k" * 32, False),
        ("memory://one-process", "", False),
        ("file:///var/cache/s3kv", "", False),
        ("", "", False),  # a store handed in without a URL (the benchmarks' own): none to name (issue 40.5)
    ],
)
def test_a_shared_store_without_a_key_warns_once_at_start_up(url, key, warns, caplog):
    from s3kv.config import warn_once
    from s3kv.sim import SimCacheConfig, make_llm_args
    from s3kv.trtllm import S3KvConnectorLeader

    warn_once.cache_clear()
    args = make_llm_args(gemma3_like(64), SimCacheConfig(tokens_per_block=16, max_seq_len=2048), 1, 0)
    settings = Settings(url=url, check_access=False, integrity_key=key)
    with caplog.at_level(logging.WARNING):
        for i in range(2):  # a second engine in the process says nothing new
            leader = S3KvConnectorLeader(args, settings=settings, store=MemoryStore(), engine_key=f"warn-{i}",
                                         engine_features=())
            leader.shutdown()
    said = [r.getMessage() for r in caplog.records if "integrity tags are off" in r.getMessage()]
    assert len(said) == (1 if warns else 0)
    if warns:
        assert "S3KV_INTEGRITY_KEY_FILE" in said[0] and "s3://acme-kv/p" in said[0]
