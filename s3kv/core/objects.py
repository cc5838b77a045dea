"""The object format: a small verified header, then pages back to back.

    offset 0   magic b"S3KV" | version u16 | flags u16 | header_len u32
           12  namespace (16) | group fingerprint (8) | shard u16 | tp_size u16
           40  tokens_per_block u32 | first_ordinal u32 | page_count u32 | pad u32
           56  page_bytes u64 | last chain digest (16)
           80  page_count x xxh3_64 page checksum (u64)
           ..  xxh3_64 of everything above (u64)
    header_len  pages
    [flags & TAGGED]  trailer: key id (8) | page_count x page tag (16) | object tag (32)

The header is tiny and its length follows from ``page_count``, so a ranged read
of header + only the wanted pages is one parallel GET wave. Nothing returned by
``decode_*`` was left unverified: a page's bytes are handed out only after its
checksum and the header (magic, version, flags, fingerprint, geometry, digest)
matched. The same facts are mirrored in object metadata so a HEAD can reject a
foreign object without downloading it.

Integrity (``s3kv.core.integrity``): xxh3 catches corruption, not forgery. With a
secret configured, writers append a trailer of keyed tags (why a trailer: the
header and its length stay what every reader expects, so a reader without the
key still reads a tagged object) and a metadata tag; a reader holding the key
refuses -- as a miss -- any object whose tags are absent, made with an unknown
key, or wrong. Tags bind the object key, so a valid object copied to another key
is refused too.

Spans: an object is named by the chain digest of its LAST block, so a reader
that asked for the object ending at block ``e`` accepts only a span ending
exactly at ``e`` (``span_from_metadata(..., end=e)``), starting at >= 0 and no
longer than ``MAX_PAGES_PER_OBJECT``. Otherwise a planted object could claim
blocks its key never named.

Versions and flags a build does not know are ``UnsupportedVersion`` (skip the
object, never delete it): a newer writer may change the layout behind them.

Why this is one module: the format is one contract -- the encoder, the decoder and the metadata
mirror must change together.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from .integrity import KEY_ID_BYTES, OBJECT_TAG_BYTES, PAGE_TAG_BYTES, IntegrityKeys, TagKey, equal

MAGIC = b"S3KV"
VERSION = 1
#: Header flag: a trailer of keyed integrity tags follows the pages.
FLAG_TAGGED = 0x0001
KNOWN_FLAGS = FLAG_TAGGED
#: The most pages one object may hold (honest writers stay far below: a checkpoint's worth of
#: blocks, or a sliding window's tail). Bounds what a planted header can make a reader allocate.
MAX_PAGES_PER_OBJECT = 16384
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


class Unauthenticated(ObjectFormatError):
    """Integrity is on and the object's tag is missing, made with an unknown key, or wrong."""

    reason = "untrusted"


class SpanMismatch(ObjectFormatError):
    """The object claims blocks its key does not name (span poisoning) or too many of them."""

    reason = "span"


@dataclass(frozen=True)
class ObjectIdentity:
    """What a reader expects an object to be; compared field by field.

    ``integrity`` is not part of the object's identity (not compared): it is how the
    reader checks it. Set, every object is signed on write and must carry valid tags
    on read.
    """

    namespace: bytes
    group_fingerprint: str  # 16 hex chars
    shard: int
    tp_size: int
    tokens_per_block: int
    page_bytes: int
    integrity: IntegrityKeys | None = field(default=None, compare=False, repr=False)
    #: The group's attention window (None: full attention), written to the metadata for operators
    #: (``s3kv ls``); the group fingerprint already binds it, so it is not compared.
    window: int | None = field(default=None, compare=False)

    @functools.cached_property
    def metadata_fields(self) -> tuple[tuple[str, str], ...]:
        """The identity's fields as every object's metadata carries them (``object_metadata``).
        Computed once: a long prompt's HEAD wave checks hundreds of objects of one identity."""
        md = object_metadata(_without_integrity(self), 0, 0)
        return tuple((f, md[f]) for f in ("s3kv-ns", "s3kv-group", "s3kv-shard", "s3kv-tpb", "s3kv-page-bytes"))


@dataclass(frozen=True)
class ObjectHeader:
    identity: ObjectIdentity
    first_ordinal: int
    page_count: int
    last_digest: bytes
    checksums: tuple[int, ...]
    flags: int = 0
    #: Verified page tags and the key that made them (set when the reader checked the trailer).
    page_tags: tuple[bytes, ...] | None = field(default=None, repr=False)
    tag_key: TagKey | None = field(default=None, repr=False)

    @property
    def header_len(self) -> int:
        return header_len(self.page_count)

    def page_offset(self, index: int) -> int:
        return self.header_len + index * self.identity.page_bytes

    @property
    def tagged(self) -> bool:
        return bool(self.flags & FLAG_TAGGED)

    @property
    def total_len(self) -> int:
        return object_len(self.page_count, self.identity.page_bytes, self.tagged)


def header_len(page_count: int) -> int:
    return FIXED_LEN + 8 * page_count + 8


def trailer_len(page_count: int) -> int:
    return KEY_ID_BYTES + PAGE_TAG_BYTES * page_count + OBJECT_TAG_BYTES


def object_len(page_count: int, page_bytes: int, tagged: bool) -> int:
    return header_len(page_count) + page_count * page_bytes + (trailer_len(page_count) if tagged else 0)


def trailer_range(identity: ObjectIdentity, page_count: int) -> tuple[int, int] | None:
    """(offset, length) of the trailer a reader of ``identity`` must fetch; None without integrity."""
    if identity.integrity is None:
        return None
    return header_len(page_count) + page_count * identity.page_bytes, trailer_len(page_count)


def page_checksum(page: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(page)


def encode_header(
    identity: ObjectIdentity, first_ordinal: int, last_digest: bytes, pages: Sequence[bytes | memoryview]
) -> bytes:
    if len(last_digest) != 16:
        raise ValueError("last_digest must be 16 bytes")
    if not 0 < len(pages) <= MAX_PAGES_PER_OBJECT:
        raise ValueError(f"an object holds 1..{MAX_PAGES_PER_OBJECT} pages, got {len(pages)}")
    if first_ordinal < 0:
        raise ValueError(f"first ordinal must be >= 0, got {first_ordinal}")
    for i, p in enumerate(pages):
        if memoryview(p).nbytes != identity.page_bytes:
            raise ValueError(f"page {i} has {memoryview(p).nbytes} bytes, expected {identity.page_bytes}")
    count = len(pages)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        FLAG_TAGGED if identity.integrity is not None else 0,
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


def encode_trailer(key: TagKey, object_key: str, header: bytes, pages: Sequence[bytes | memoryview]) -> bytes:
    tags = [key.page_tag(p) for p in pages]
    return key.key_id + b"".join(tags) + key.object_tag(object_key, header, tags)


def encode_object(
    identity: ObjectIdentity,
    first_ordinal: int,
    last_digest: bytes,
    pages: Sequence[bytes | memoryview],
    key: str | None = None,
) -> list[bytes | memoryview]:
    """Header + pages (+ the integrity trailer) as a list of buffers (no join copy).

    ``key`` (the object key) is required when ``identity.integrity`` is set: the tags bind it.
    """
    header = encode_header(identity, first_ordinal, last_digest, pages)
    if identity.integrity is None:
        return [header, *pages]
    if key is None:
        raise ValueError("signing an object needs its object key")
    return [header, *pages, encode_trailer(identity.integrity.current, key, header, pages)]


_META_TAG = "s3kv-tag"


def object_metadata(
    identity: ObjectIdentity, first_ordinal: int, page_count: int, key: str | None = None
) -> dict[str, str]:
    md = {
        "s3kv-version": str(VERSION),
        "s3kv-ns": identity.namespace.hex(),
        "s3kv-group": identity.group_fingerprint,
        "s3kv-shard": f"{identity.shard}of{identity.tp_size}",
        "s3kv-tpb": str(identity.tokens_per_block),
        "s3kv-page-bytes": str(identity.page_bytes),
        "s3kv-first": str(first_ordinal),
        "s3kv-count": str(page_count),
        "s3kv-window": "full" if identity.window is None else str(identity.window),
    }
    if identity.integrity is not None:
        if key is None:
            raise ValueError("signing an object's metadata needs its object key")
        tk = identity.integrity.current
        md[_META_TAG] = f"{tk.key_id.hex()}.{tk.metadata_tag(key, md).hex()}"
    return md


def _check_metadata_tag(identity: ObjectIdentity, md: Mapping[str, str], key: str | None) -> None:
    assert identity.integrity is not None
    raw = md.get(_META_TAG)
    if not raw:
        raise Unauthenticated("object carries no integrity tag (integrity is on)", key)
    if key is None:
        raise Unauthenticated("no object key to check the integrity tag against", key)
    try:
        kid_hex, tag_hex = raw.split(".", 1)
        kid, tag = bytes.fromhex(kid_hex), bytes.fromhex(tag_hex)
    except ValueError:
        raise Unauthenticated("malformed integrity tag in metadata", key) from None
    tk = identity.integrity.find(kid)
    if tk is None:
        raise Unauthenticated(f"object signed with an unknown key (id {kid_hex[:16]})", key)
    signed = {k: v for k, v in md.items() if k.startswith("s3kv-") and k != _META_TAG}
    if not equal(tk.metadata_tag(key, signed), tag):
        raise Unauthenticated("metadata integrity tag mismatch", key)


@dataclass(frozen=True)
class ObjectSpan:
    """Which block ordinals an object holds, as its metadata (or header) says."""

    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count


def check_span(first: int, count: int, end: int | None, key: str | None = None) -> None:
    """An object's span must be ``[first, end)`` with ``first >= 0`` and ``1 <= count <= MAX``.

    ``end``: the block ordinal the reader's key names (the object's last block + 1); None
    when the reader does not know it (operator tools), then only the bounds are checked.
    """
    if first < 0 or not 0 < count <= MAX_PAGES_PER_OBJECT:
        raise SpanMismatch(f"span {first}+{count} outside [0, ..) or over {MAX_PAGES_PER_OBJECT} pages", key)
    if end is not None and first + count != end:
        raise SpanMismatch(
            f"object claims blocks [{first}, {first + count}) but its key names the object ending at block {end}",
            key,
        )


def span_from_metadata(
    identity: ObjectIdentity,
    metadata: Mapping[str, str],
    size: int,
    key: str | None = None,
    *,
    end: int | None = None,
) -> ObjectSpan:
    """Accept a HEAD result only if its mirrored metadata matches what we expect.

    ``end``: the block ordinal the asked-for key names (the span must end there).
    With ``identity.integrity`` the metadata tag must verify. Raises a named
    ``ObjectFormatError`` otherwise (the caller counts it and treats the object as
    missing).
    """
    # Every store hands metadata names over lowercased already (S3 lowercases them on the wire;
    # the store contract does it everywhere), so the copy is only for other callers: it cost a
    # third of a 128k-token lookup's own CPU (344 objects x 9 names). A mixed-case dict that
    # does hold the lowercase version name is taken as it is and fails safe (a foreign object).
    md = metadata if "s3kv-version" in metadata else {k.lower(): v for k, v in metadata.items()}
    try:
        version = int(md["s3kv-version"])
    except (KeyError, ValueError) as e:
        raise ForeignObject("object has no s3kv metadata", key) from e
    if version != VERSION:
        raise UnsupportedVersion(f"object format version {version}, this build reads {VERSION}", key)
    for f, want in identity.metadata_fields:
        if md.get(f) != want:
            raise ForeignObject(f"metadata {f}={md.get(f)!r}, expected {want!r}", key)
    try:
        span = ObjectSpan(int(md["s3kv-first"]), int(md["s3kv-count"]))
    except (KeyError, ValueError) as e:
        raise ForeignObject("object metadata lacks first/count", key) from e
    if identity.integrity is not None:
        _check_metadata_tag(identity, md, key)
    check_span(span.first, span.count, end, key)
    tagged = _META_TAG in md
    if size != object_len(span.count, identity.page_bytes, tagged):
        raise TruncatedObject(f"object size {size} does not match {span.count} pages", key)
    return span


def decode_header(
    data: bytes | memoryview,
    expected: ObjectIdentity,
    key: str | None = None,
    trailer: bytes | memoryview | None = None,
) -> ObjectHeader:
    """Parse and verify a header; ``data`` must start at offset 0 and hold the whole header.

    With ``expected.integrity`` the object must be tagged and ``trailer`` (the bytes at
    ``trailer_range``) must carry a valid object tag for ``key``; the page tags it holds
    are then checked by ``verify_page``.
    """
    buf = bytes(data[:FIXED_LEN]) if len(data) >= FIXED_LEN else b""
    if len(buf) < FIXED_LEN:
        raise TruncatedObject(f"header needs {FIXED_LEN} bytes, got {len(data)}", key)
    (magic, version, flags, hlen, ns, gfp, shard, tp, tpb, first, count, _pad, page_bytes, last) = _FIXED.unpack(
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
    # After the checksum: a flipped bit is corruption; an intact unknown flag is a newer writer's.
    if flags & ~KNOWN_FLAGS:
        raise UnsupportedVersion(f"object header flags {flags:#06x}, this build knows {KNOWN_FLAGS:#06x}", key)
    if count > MAX_PAGES_PER_OBJECT:
        raise SpanMismatch(f"header claims {count} pages, the format allows {MAX_PAGES_PER_OBJECT}", key)
    got = ObjectIdentity(ns, gfp.hex(), shard, tp, tpb, page_bytes, expected.integrity)
    if got != expected:
        diffs = [f for f in ObjectIdentity.__dataclass_fields__ if getattr(got, f) != getattr(expected, f)]
        raise ForeignObject(f"object identity differs in {', '.join(diffs)}", key)
    sums = struct.unpack(f"<{count}Q", body[FIXED_LEN:])
    header = ObjectHeader(got, first, count, last, tuple(sums), flags)
    if expected.integrity is None:
        return header
    return _verify_trailer(header, body + struct.pack("<Q", stored), trailer, key)


def _verify_trailer(
    header: ObjectHeader, header_bytes: bytes, trailer: bytes | memoryview | None, key: str | None
) -> ObjectHeader:
    keys = header.identity.integrity
    assert keys is not None
    if not header.tagged:
        raise Unauthenticated("object carries no integrity tag (integrity is on)", key)
    if key is None:
        raise Unauthenticated("no object key to check the integrity tag against", key)
    n = header.page_count
    if trailer is None or memoryview(trailer).nbytes != trailer_len(n):
        got = "none" if trailer is None else f"{memoryview(trailer).nbytes} bytes"
        raise Unauthenticated(f"integrity trailer missing or cut ({got}, need {trailer_len(n)})", key)
    t = bytes(trailer)
    kid = t[:KEY_ID_BYTES]
    tk = keys.find(kid)
    if tk is None:
        raise Unauthenticated(f"object signed with an unknown key (id {kid.hex()})", key)
    tags = tuple(t[KEY_ID_BYTES + i * PAGE_TAG_BYTES : KEY_ID_BYTES + (i + 1) * PAGE_TAG_BYTES] for i in range(n))
    if not equal(tk.object_tag(key, header_bytes, tags), t[KEY_ID_BYTES + n * PAGE_TAG_BYTES :]):
        raise Unauthenticated("object integrity tag mismatch", key)
    return ObjectHeader(
        header.identity, header.first_ordinal, n, header.last_digest, header.checksums, header.flags, tags, tk
    )


def verify_page(header: ObjectHeader, index: int, page: bytes | memoryview, key: str | None = None) -> None:
    if not 0 <= index < header.page_count:
        raise HeaderCorrupt(f"page index {index} outside object of {header.page_count} pages", key)
    if memoryview(page).nbytes != header.identity.page_bytes:
        raise TruncatedObject(
            f"page {index} has {memoryview(page).nbytes} bytes, expected {header.identity.page_bytes}", key
        )
    if page_checksum(page) != header.checksums[index]:
        raise ChecksumMismatch(f"checksum mismatch on page {index} (ordinal {header.first_ordinal + index})", key)
    if header.identity.integrity is not None:
        # Fail closed: a header whose trailer was never verified has no tags to check against.
        if header.page_tags is None or header.tag_key is None:
            raise Unauthenticated(f"page {index}: object tag not verified", key)
        if not equal(header.tag_key.page_tag(page), header.page_tags[index]):
            raise Unauthenticated(
                f"integrity tag mismatch on page {index} (ordinal {header.first_ordinal + index})", key
            )


def decode_object(
    data: bytes | memoryview, expected: ObjectIdentity, key: str | None = None
) -> tuple[ObjectHeader, list[memoryview]]:
    """Whole-object decode: every page verified before any is returned.

    A tagged object read without integrity keys is checked structurally (xxh3), its
    trailer only measured.
    """
    mv = memoryview(data)
    header = decode_header(mv, _without_integrity(expected), key)
    if mv.nbytes != header.total_len:
        raise TruncatedObject(f"object is {mv.nbytes} bytes, header says {header.total_len}", key)
    if expected.integrity is not None:
        off, n = header.total_len - trailer_len(header.page_count), trailer_len(header.page_count)
        header = decode_header(mv, expected, key, trailer=mv[off : off + n] if header.tagged else None)
    pages = []
    for i in range(header.page_count):
        off = header.page_offset(i)
        page = mv[off : off + expected.page_bytes]
        verify_page(header, i, page, key)
        pages.append(page)
    return header, pages


def _without_integrity(identity: ObjectIdentity) -> ObjectIdentity:
    if identity.integrity is None:
        return identity
    return ObjectIdentity(
        identity.namespace,
        identity.group_fingerprint,
        identity.shard,
        identity.tp_size,
        identity.tokens_per_block,
        identity.page_bytes,
    )
