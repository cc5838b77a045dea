"""The object format: a small verified header, then pages back to back.

    offset 0   magic b"S3KV" | version u16 | flags u16 | header_len u32
           12  namespace (16) | group fingerprint (8) | shard u16 | tp_size u16
           40  tokens_per_block u32 | first_ordinal u32 | page_count u32 | pad u32
           56  page_bytes u64 | last chain digest (16)
           80  page_count x xxh3_64 page checksum (u64)
           ..  xxh3_64 of everything above (u64)
    header_len  pages

The header is tiny and its length follows from ``page_count``, so a ranged read
of header + only the wanted pages is one parallel GET wave. Nothing returned by
``decode_*`` was left unverified: a page's bytes are handed out only after its
checksum and the header (magic, version, fingerprint, geometry, digest) matched.
The same facts are mirrored in object metadata so a HEAD can reject a foreign
object without downloading it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"S3KV"
VERSION = 1
_FIXED = struct.Struct("<4sHHI16s8sHHIIIIQ16s")
FIXED_LEN = _FIXED.size  # 80
assert FIXED_LEN == 80


class ObjectFormatError(Exception):
    """Base: the object must not be loaded. ``key`` names it when known."""

    reason = "format"

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message if key is None else f"{message} (object {key!r})")
        self.key = key


class BadMagic(ObjectFormatError):
    reason = "bad_magic"


class UnsupportedVersion(ObjectFormatError):
    reason = "unsupported_version"


class HeaderCorrupt(ObjectFormatError):
    reason = "header_corrupt"


class ForeignObject(ObjectFormatError):
    """Well-formed, but for another namespace / group / shard / geometry / prefix."""

    reason = "foreign"


class TruncatedObject(ObjectFormatError):
    reason = "truncated"


class ChecksumMismatch(ObjectFormatError):
    reason = "checksum"


@dataclass(frozen=True)
class ObjectIdentity:
    """What a reader expects an object to be; compared field by field."""

    namespace: bytes
    group_fingerprint: str  # 16 hex chars
    shard: int
    tp_size: int
    tokens_per_block: int
    page_bytes: int


@dataclass(frozen=True)
class ObjectHeader:
    identity: ObjectIdentity
    first_ordinal: int
    page_count: int
    last_digest: bytes
    checksums: tuple[int, ...]

    @property
    def header_len(self) -> int:
        return header_len(self.page_count)

    def page_offset(self, index: int) -> int:
        return self.header_len + index * self.identity.page_bytes

    @property
    def total_len(self) -> int:
        return self.header_len + self.page_count * self.identity.page_bytes


def header_len(page_count: int) -> int:
    return FIXED_LEN + 8 * page_count + 8


def page_checksum(page: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(page)


def encode_header(
    identity: ObjectIdentity, first_ordinal: int, last_digest: bytes, pages: Sequence[bytes | memoryview]
) -> bytes:
    if len(last_digest) != 16:
        raise ValueError("last_digest must be 16 bytes")
    for i, p in enumerate(pages):
        if memoryview(p).nbytes != identity.page_bytes:
            raise ValueError(f"page {i} has {memoryview(p).nbytes} bytes, expected {identity.page_bytes}")
    count = len(pages)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        0,
        header_len(count),
        identity.namespace,
        bytes.fromhex(identity.group_fingerprint),
        identity.shard,
        identity.tp_size,
        identity.tokens_per_block,
        first_ordinal,
        count,
        0,
        identity.page_bytes,
        last_digest,
    )
    sums = struct.pack(f"<{count}Q", *(page_checksum(p) for p in pages))
    body = fixed + sums
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def encode_object(
    identity: ObjectIdentity, first_ordinal: int, last_digest: bytes, pages: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """Header + pages as a list of buffers (no join copy; stores accept buffer lists)."""
    return [encode_header(identity, first_ordinal, last_digest, pages), *pages]


def object_metadata(identity: ObjectIdentity, first_ordinal: int, page_count: int) -> dict[str, str]:
    return {
        "s3kv-version": str(VERSION),
        "s3kv-ns": identity.namespace.hex(),
        "s3kv-group": identity.group_fingerprint,
        "s3kv-shard": f"{identity.shard}of{identity.tp_size}",
        "s3kv-tpb": str(identity.tokens_per_block),
        "s3kv-page-bytes": str(identity.page_bytes),
        "s3kv-first": str(first_ordinal),
        "s3kv-count": str(page_count),
    }


@dataclass(frozen=True)
class ObjectSpan:
    """Which block ordinals an object holds, as its metadata (or header) says."""

    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count


def span_from_metadata(
    identity: ObjectIdentity, metadata: Mapping[str, str], size: int, key: str | None = None
) -> ObjectSpan:
    """Accept a HEAD result only if its mirrored metadata matches what we expect.

    Raises a named ``ObjectFormatError`` otherwise (the caller counts it and
    treats the object as missing).
    """
    md = {k.lower(): v for k, v in metadata.items()}
    try:
        version = int(md["s3kv-version"])
    except (KeyError, ValueError) as e:
        raise ForeignObject("object has no s3kv metadata", key) from e
    if version != VERSION:
        raise UnsupportedVersion(f"object format version {version}, this build reads {VERSION}", key)
    expected = object_metadata(identity, 0, 0)
    for field in ("s3kv-ns", "s3kv-group", "s3kv-shard", "s3kv-tpb", "s3kv-page-bytes"):
        if md.get(field) != expected[field]:
            raise ForeignObject(f"metadata {field}={md.get(field)!r}, expected {expected[field]!r}", key)
    try:
        span = ObjectSpan(int(md["s3kv-first"]), int(md["s3kv-count"]))
    except (KeyError, ValueError) as e:
        raise ForeignObject("object metadata lacks first/count", key) from e
    if span.count <= 0 or size != header_len(span.count) + span.count * identity.page_bytes:
        raise TruncatedObject(f"object size {size} does not match {span.count} pages", key)
    return span


def decode_header(data: bytes | memoryview, expected: ObjectIdentity, key: str | None = None) -> ObjectHeader:
    """Parse and verify a header; ``data`` must start at offset 0 and hold the whole header."""
    buf = bytes(data[:FIXED_LEN]) if len(data) >= FIXED_LEN else b""
    if len(buf) < FIXED_LEN:
        raise TruncatedObject(f"header needs {FIXED_LEN} bytes, got {len(data)}", key)
    (magic, version, _flags, hlen, ns, gfp, shard, tp, tpb, first, count, _pad, page_bytes, last) = _FIXED.unpack(
        buf
    )
    if magic != MAGIC:
        raise BadMagic(f"bad magic {magic!r}", key)
    if version != VERSION:
        raise UnsupportedVersion(f"object format version {version}, this build reads {VERSION}", key)
    if hlen != header_len(count):
        raise HeaderCorrupt(f"header length {hlen} inconsistent with page count {count}", key)
    if len(data) < hlen:
        raise TruncatedObject(f"header is {hlen} bytes, got {len(data)}", key)
    body = bytes(data[: hlen - 8])
    (stored,) = struct.unpack("<Q", bytes(data[hlen - 8 : hlen]))
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise HeaderCorrupt("header checksum mismatch", key)
    got = ObjectIdentity(ns, gfp.hex(), shard, tp, tpb, page_bytes)
    if got != expected:
        diffs = [f for f in ObjectIdentity.__dataclass_fields__ if getattr(got, f) != getattr(expected, f)]
        raise ForeignObject(f"object identity differs in {', '.join(diffs)}", key)
    sums = struct.unpack(f"<{count}Q", body[FIXED_LEN:])
    return ObjectHeader(got, first, count, last, tuple(sums))


def verify_page(header: ObjectHeader, index: int, page: bytes | memoryview, key: str | None = None) -> None:
    if not 0 <= index < header.page_count:
        raise HeaderCorrupt(f"page index {index} outside object of {header.page_count} pages", key)
    if memoryview(page).nbytes != header.identity.page_bytes:
        raise TruncatedObject(
            f"page {index} has {memoryview(page).nbytes} bytes, expected {header.identity.page_bytes}", key
        )
    if page_checksum(page) != header.checksums[index]:
        raise ChecksumMismatch(f"checksum mismatch on page {index} (ordinal {header.first_ordinal + index})", key)


def decode_object(
    data: bytes | memoryview, expected: ObjectIdentity, key: str | None = None
) -> tuple[ObjectHeader, list[memoryview]]:
    """Whole-object decode: every page verified before any is returned."""
    mv = memoryview(data)
    header = decode_header(mv, expected, key)
    if mv.nbytes != header.total_len:
        raise TruncatedObject(f"object is {mv.nbytes} bytes, header says {header.total_len}", key)
    pages = []
    for i in range(header.page_count):
        off = header.page_offset(i)
        page = mv[off : off + expected.page_bytes]
        verify_page(header, i, page, key)
        pages.append(page)
    return header, pages
