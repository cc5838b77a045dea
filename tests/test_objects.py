"""The object format (s3kv/core/objects.py): round trips and named rejections."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from s3kv.core.objects import (
    FIXED_LEN,
    MAGIC,
    BadMagic,
    ChecksumMismatch,
    ForeignObject,
    HeaderCorrupt,
    ObjectFormatError,
    ObjectIdentity,
    ObjectSpan,
    TruncatedObject,
    UnsupportedVersion,
    decode_header,
    decode_object,
    encode_header,
    encode_object,
    header_len,
    object_metadata,
    span_from_metadata,
    verify_page,
)
from s3kv.store.memory import MemoryStore

PAGE = 64
IDENT = ObjectIdentity(
    namespace=bytes(range(16)),
    group_fingerprint="0123456789abcdef",
    shard=1,
    tp_size=2,
    tokens_per_block=32,
    page_bytes=PAGE,
)
DIGEST = bytes(range(100, 116))


def pages(n: int, seed: int = 0) -> list[bytes]:
    return [bytes(((seed + i) * 31 + j * 7) % 256 for j in range(PAGE)) for i in range(n)]


def encoded(n: int = 3, first: int = 8) -> tuple[bytes, list[bytes]]:
    ps = pages(n)
    return b"".join(bytes(b) for b in encode_object(IDENT, first, DIGEST, ps)), ps


def test_header_layout_constants():
    assert FIXED_LEN == 80
    assert header_len(0) == 88
    assert header_len(5) == 80 + 5 * 8 + 8


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("n", [1, 2, 7])
def test_round_trip_byte_exact(n):
    buffers = encode_object(IDENT, 40, DIGEST, pages(n, seed=n))
    # A buffer list: header, then the very page objects given (no join copy).
    assert len(buffers) == n + 1
    data = b"".join(bytes(b) for b in buffers)
    assert len(data) == header_len(n) + n * PAGE
    header, out = decode_object(data, IDENT, key="k")
    assert header.identity == IDENT
    assert header.first_ordinal == 40
    assert header.page_count == n
    assert header.last_digest == DIGEST
    assert header.total_len == len(data)
    assert [bytes(p) for p in out] == pages(n, seed=n)


def test_round_trip_memoryview_pages_and_memory_store():
    src = bytearray(b"".join(pages(4)))
    views = [memoryview(src)[i * PAGE : (i + 1) * PAGE] for i in range(4)]
    store = MemoryStore()
    store.put("obj", encode_object(IDENT, 0, DIGEST, views), object_metadata(IDENT, 0, 4))
    data = store.get("obj")
    header, out = decode_object(data, IDENT)
    assert b"".join(bytes(p) for p in out) == bytes(src)
    info = store.head("obj")
    assert span_from_metadata(IDENT, info.metadata, info.size) == ObjectSpan(0, 4)


def test_ranged_read_of_header_and_one_page():
    data, ps = encoded(5)
    header = decode_header(data[: header_len(5)], IDENT)
    for i in range(5):
        off = header.page_offset(i)
        page = data[off : off + PAGE]
        verify_page(header, i, page)
        assert page == ps[i]


def test_encode_rejects_wrong_page_size_and_digest():
    with pytest.raises(ValueError):
        encode_header(IDENT, 0, DIGEST, [b"x" * (PAGE - 1)])
    with pytest.raises(ValueError):
        encode_header(IDENT, 0, b"short", pages(1))


# ---------------------------------------------------------------- rejections


def _flip(data: bytes, offset: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 0x40
    return bytes(b)


def _restamp(data: bytes, n: int, fixed_changes: dict[int, object]) -> bytes:
    """Rewrite fixed-header fields (by struct index) and recompute the header checksum."""
    import xxhash

    from s3kv.core.objects import _FIXED

    hlen = header_len(n)
    vals = list(_FIXED.unpack(data[:FIXED_LEN]))
    for i, v in fixed_changes.items():
        vals[i] = v
    body = _FIXED.pack(*vals) + data[FIXED_LEN : hlen - 8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + data[hlen:]


def test_flipped_page_byte_is_checksum_mismatch():
    data, _ = encoded(3)
    last_page_byte = len(data) - 1
    for off in (header_len(3), header_len(3) + PAGE + 5, last_page_byte):
        with pytest.raises(ChecksumMismatch) as ei:
            decode_object(_flip(data, off), IDENT, key="my/key")
        assert "my/key" in str(ei.value)
        assert ei.value.key == "my/key"


def test_verify_page_checksum_and_size():
    data, ps = encoded(2)
    header = decode_header(data, IDENT)
    verify_page(header, 1, ps[1])
    with pytest.raises(ChecksumMismatch):
        verify_page(header, 1, ps[0])
    with pytest.raises(TruncatedObject):
        verify_page(header, 0, ps[0][:-1])
    with pytest.raises(HeaderCorrupt):
        verify_page(header, 2, ps[0])


@pytest.mark.parametrize("cut", [1, PAGE, PAGE + 1])
def test_truncated_body(cut):
    data, _ = encoded(3)
    with pytest.raises(TruncatedObject):
        decode_object(data[:-cut], IDENT)


def test_truncated_header():
    data, _ = encoded(3)
    for n in (0, 10, FIXED_LEN - 1, FIXED_LEN + 3, header_len(3) - 1):
        with pytest.raises(TruncatedObject):
            decode_object(data[:n], IDENT)


def test_extra_trailing_bytes_rejected():
    data, _ = encoded(2)
    with pytest.raises(TruncatedObject):
        decode_object(data + b"\0", IDENT)


def test_wrong_magic():
    data, _ = encoded(2)
    with pytest.raises(BadMagic):
        decode_object(b"XXXX" + data[4:], IDENT)
    assert data[:4] == MAGIC


def test_wrong_version():
    data, _ = encoded(2)
    with pytest.raises(UnsupportedVersion):
        decode_object(data[:4] + struct.pack("<H", 2) + data[6:], IDENT)
    # Even with a valid header checksum for version 2.
    with pytest.raises(UnsupportedVersion):
        decode_object(_restamp(data, 2, {1: 2}), IDENT)


@pytest.mark.parametrize(
    "field,value",
    [
        ("namespace", bytes(16)),
        ("group_fingerprint", "fedcba9876543210"),
        ("shard", 0),
        ("tp_size", 4),
        ("tokens_per_block", 64),
        ("page_bytes", PAGE * 2),
    ],
)
def test_foreign_object_each_identity_field(field, value):
    data, _ = encoded(2)
    other = dataclasses.replace(IDENT, **{field: value})
    with pytest.raises(ForeignObject) as ei:
        decode_object(data, other, key="k")
    assert field in str(ei.value)


@pytest.mark.parametrize(
    "offset",
    [
        6,  # flags
        8,  # header length
        12,  # namespace
        30,  # group fingerprint
        40,  # tokens per block
        44,  # first ordinal
        52,  # pad
        56,  # page bytes
        64,  # last digest
        FIXED_LEN + 3,  # a page checksum
    ],
)
def test_corrupted_header_byte(offset):
    data, _ = encoded(3)
    with pytest.raises(HeaderCorrupt):
        decode_object(_flip(data, offset), IDENT)


def test_header_length_inconsistent_with_count():
    data, _ = encoded(3)
    # page_count field (struct index 10) says 4, header_len field says 3 pages.
    bad = data[:48] + struct.pack("<I", 4) + data[52:]
    with pytest.raises(HeaderCorrupt):
        decode_object(bad, IDENT)


def test_errors_are_distinct_types_with_distinct_reasons():
    kinds = [BadMagic, UnsupportedVersion, HeaderCorrupt, ForeignObject, TruncatedObject, ChecksumMismatch]
    assert len({k.reason for k in kinds}) == len(kinds)
    for k in kinds:
        assert issubclass(k, ObjectFormatError)
        others = [o for o in kinds if o is not k]
        assert not any(issubclass(k, o) for o in others)


# ---------------------------------------------------------------- HEAD metadata


def test_span_from_metadata_accepts_matching():
    md = object_metadata(IDENT, 16, 3)
    size = header_len(3) + 3 * PAGE
    assert span_from_metadata(IDENT, md, size) == ObjectSpan(16, 3)
    assert ObjectSpan(16, 3).end == 19
    # Header names are case-insensitive (S3 lowercases them, others may not).
    assert span_from_metadata(IDENT, {k.upper(): v for k, v in md.items()}, size) == ObjectSpan(16, 3)


def test_metadata_matches_what_a_real_encoded_object_is():
    data, _ = encoded(3, first=8)
    md = object_metadata(IDENT, 8, 3)
    span = span_from_metadata(IDENT, md, len(data))
    header = decode_header(data, IDENT)
    assert (span.first, span.count) == (header.first_ordinal, header.page_count)


@pytest.mark.parametrize(
    "field,value",
    [
        ("namespace", bytes(16)),
        ("group_fingerprint", "fedcba9876543210"),
        ("shard", 0),
        ("tp_size", 4),
        ("tokens_per_block", 16),
        ("page_bytes", PAGE + 1),
    ],
)
def test_span_from_metadata_rejects_foreign(field, value):
    other = dataclasses.replace(IDENT, **{field: value})
    md = object_metadata(other, 0, 2)
    with pytest.raises(ForeignObject):
        span_from_metadata(IDENT, md, header_len(2) + 2 * PAGE, key="k")


def test_span_from_metadata_rejects_missing_or_bad_metadata():
    with pytest.raises(ForeignObject):
        span_from_metadata(IDENT, {}, 100)
    md = object_metadata(IDENT, 0, 2)
    md["s3kv-version"] = "9"
    with pytest.raises(UnsupportedVersion):
        span_from_metadata(IDENT, md, header_len(2) + 2 * PAGE)
    md = object_metadata(IDENT, 0, 2)
    del md["s3kv-count"]
    with pytest.raises(ForeignObject):
        span_from_metadata(IDENT, md, header_len(2) + 2 * PAGE)


@pytest.mark.parametrize("delta", [-1, 1, -PAGE, PAGE])
def test_span_from_metadata_rejects_size_mismatch(delta):
    md = object_metadata(IDENT, 0, 2)
    with pytest.raises(TruncatedObject):
        span_from_metadata(IDENT, md, header_len(2) + 2 * PAGE + delta)


def test_span_from_metadata_rejects_zero_count():
    md = object_metadata(IDENT, 0, 0)
    with pytest.raises(ObjectFormatError):
        span_from_metadata(IDENT, md, header_len(0))
