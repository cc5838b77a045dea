"""The namespace summary with integrity on (issue 29.3).

It read page counts off object sizes without the trailer of keyed tags: a keyed fleet's summary
listed none of its genuine objects (no summary hit ever), and in trust mode it listed a keyless
writer's objects planted at the untagged size -- every lookup of that prompt promised a load that
then failed (a 416 on the trailer read past the object's end).
"""

from __future__ import annotations

import dataclasses

from test_integrity import KEYS, PAGE, SECRET, TPB, _leader, _plant, _tokens

from s3kv.core.objects import MAX_PAGES_PER_OBJECT, ObjectIdentity, object_len
from s3kv.engine.summary import count_from_size
from s3kv.store.memory import MemoryStore

SPANS = {4: (0, 4), 8: (4, 4), 12: (8, 4)}


def _ident(leader, signed: bool) -> ObjectIdentity:
    g = leader.geometry
    ident = ObjectIdentity(leader.namespace, g.groups[0].fingerprint, 0, 1, TPB, PAGE)
    return dataclasses.replace(ident, integrity=KEYS) if signed else ident


def test_count_from_size_reads_signed_and_plain_sizes_exactly():
    for n in (1, 4, MAX_PAGES_PER_OBJECT):
        assert count_from_size(object_len(n, PAGE, True), PAGE, tagged=True) == n
        assert count_from_size(object_len(n, PAGE, False), PAGE, tagged=False) == n
        assert count_from_size(object_len(n, PAGE, False), PAGE, tagged=True) is None
        assert count_from_size(object_len(n, PAGE, True), PAGE, tagged=False) is None
    assert count_from_size(object_len(MAX_PAGES_PER_OBJECT + 1, PAGE, True), PAGE, tagged=True) is None


def test_a_keyed_summary_lists_signed_objects_and_hits_from_them():
    tokens = _tokens(12)
    store = MemoryStore()
    writer = _leader(store, integrity_key=SECRET)
    _plant(store, writer, tokens, SPANS, _ident(writer, signed=True))
    reader = _leader(store, integrity_key=SECRET, lookup_summary_s=3600)  # another engine
    try:
        summary = reader.lookup_summary()
        assert summary is not None and summary.refresh()
        assert summary.objects == len(SPANS)  # was 0: sizes read without the trailer
        n, _ = reader.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
        assert n == 12 * TPB and reader.stats.lookup_summary_hits == 1 and not reader.stats.rejected
    finally:
        reader.close_lookup()


def test_trust_mode_never_promises_a_keyless_writers_unsigned_objects():
    tokens = _tokens(12)
    store = MemoryStore()
    keyed = _leader(store, integrity_key=SECRET, lookup_summary_s=3600, lookup_summary_trust_s=3600)
    try:
        # The attacker knows the prompt (hence the keys) and the format, not the key: objects at
        # the size an unsigned object of that span has.
        _plant(store, keyed, tokens, SPANS, _ident(keyed, signed=False))
        summary = keyed.lookup_summary()
        assert summary is not None and summary.refresh()
        assert summary.objects == 0
        n, _ = keyed.get_num_new_matched_tokens(1, tokens, len(tokens), 0)
        assert n == 0  # never a promise of a load that cannot succeed
    finally:
        keyed.close_lookup()
