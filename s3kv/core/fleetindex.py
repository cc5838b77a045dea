"""The fleet index: what one namespace holds, published once for every engine. Format only (pure).

One publisher (``s3kv gc --watch``, ``s3kv.engine.fleetindex.Publisher``) lists the namespace and
writes this object under a fixed key, ``{namespace prefix}fleet-index``; every engine fetches it
with a conditional GET every few seconds (a 304 while nothing changed) and answers lookups from
it: a miss costs no request, a hit one HEAD wave, or none where the index is signed with the
integrity key and young enough (``s3kv.engine.leader.lookup``).

Layout (little-endian)::

    b"S3KVFIX" | u8 format version | u32 header length | header (JSON, utf-8)
    | body: zlib of, per section in header order, n digest keys (u64), n end blocks (u32),
            n page counts (u16), n ages at listing (u32 seconds)
    | [signed only] 32-byte index tag (``TagKey.index_tag``) over everything before it

The header names the namespace, when the listing began (``listed_at``, POSIX seconds: every
object written before it is in the index, if it still existed), when it was published, how often
its publisher publishes (``every_s``: a reader past a few periods knows the publisher stopped),
the key that signed it (``key_id``) and one ``[group fingerprint, shard, tp, n]`` per section.

Why these columns: a lookup asks "is the object ending at block ``e`` of chain digest ``c`` in
group ``g``, shard ``s`` stored, and from which block?" -- the end and the page count answer it
exactly (they come from the object's own metadata, checked by the publisher's HEAD), and the age
says whether gc may have deleted it since (an engine trusts no entry near gc's cutoff).

Why 8 bytes of each digest, not 16: the index holds every object of the namespace, and a million
objects are 18 MB this way (~11 MB compressed: digests do not compress, the rest mostly does)
against 26 MB. A lookup checks the prefix and the end block; two digests of one section sharing 64
bits (2^-64 a pair, ~3e-8 for a million entries, once per lookup of such a prefix) make a
candidate whose object the key does not name -- its HEAD or its load finds nothing, a miss or a
failed load (never a wrong byte: the load reads the full key and checks the header).

Bounded: a reader refuses an index with more than ``max_objects`` entries or a body that does
not inflate to exactly its declared size, before holding more than that in memory. Parse cost
is a decompress (zlib releases the GIL) and a copy of each column into an ``array``; a lookup is
a binary search per ask (``bisect`` over the sorted u64 keys, ~2 µs at a million entries).
"""

from __future__ import annotations

import bisect
import json
import math
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .integrity import OBJECT_TAG_BYTES, IntegrityKeys, TagKey, equal

FORMAT = 1
MAGIC = b"S3KVFIX"
#: The index's name under its namespace's prefix.
INDEX_NAME = "fleet-index"
#: An index is fresh for this many of its publish periods (a reader past that knows the publisher
#: stopped, and what it said of the retention may be old: ``s3kv.core.retention``).
FRESH_PERIODS = 3
DIGEST_BYTES = 8
#: Bytes per entry in the inflated body: digest key, end block, page count, age.
ENTRY_BYTES = 8 + 4 + 2 + 4
MAX_HEADER_BYTES = 1 << 20
#: The most write-policy evidence names a report or the index carries (kinds x depth bins is 45).
MAX_EVIDENCE_KEYS = 256
MAX_SECTIONS = 4096
_U32 = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"


class IndexFormatError(ValueError):
    """The bytes are no fleet index this reader accepts; ``reason`` names why (a metric label)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def digest_key(digest: bytes) -> int:
    """The sort key of a chain digest in the index: its first 8 bytes as a little-endian u64."""
    return int.from_bytes(digest[:DIGEST_BYTES], "little")


@dataclass(frozen=True)
class IndexEntry:
    """One object as the publisher found it."""

    digest: bytes
    end: int
    count: int
    written_at: float


#: (group fingerprint, shard, tp size): one section per layer group and shard.
SectionId = tuple[str, int, int]


class Section:
    """One group's and shard's objects: parallel columns sorted by digest key."""

    __slots__ = ("keys", "ends", "counts", "ages")

    def __init__(self, keys: array, ends: array, counts: array, ages: array):
        self.keys, self.ends, self.counts, self.ages = keys, ends, counts, ages

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, digest: bytes, end: int) -> tuple[int, int] | None:
        """(page count, age at listing in seconds) of the object the key ``digest`` names and that
        ends at block ``end``; None if the index holds no such object."""
        k = digest_key(digest)
        keys = self.keys
        i = bisect.bisect_left(keys, k)
        n = len(keys)
        while i < n and keys[i] == k:  # 64-bit prefixes may repeat (module docstring)
            if self.ends[i] == end:
                return self.counts[i], self.ages[i]
            i += 1
        return None


@dataclass
class FleetIndex:
    namespace: bytes
    listed_at: float
    published_at: float
    every_s: float
    #: The key that signed it (None: unsigned), and whether this reader checked that signature.
    key_id: bytes | None
    verified: bool
    sections: dict[SectionId, Section] = field(default_factory=dict)
    objects: int = 0
    nbytes: int = 0
    #: The retention gc learns and deletes by (``s3kv.core.retention``), and since when it has
    #: learnt (POSIX s, publisher's clock); None where gc keeps ``S3KV_RETENTION_H``.
    retention_s: float | None = None
    auto_since: float | None = None
    #: (time published, how long engines believe their own uploads) since gc learns, oldest
    #: first: what gc keeps each object for (``core.retention.retention_for``).
    retention_history: tuple[tuple[float, float], ...] = ()
    #: The fleet's write-policy evidence (``s3kv.core.value``, "pooled over the fleet"), as of
    #: ``listed_at``: the sum of each reporting engine's newest report, and which report of each
    #: engine it holds; None where gc pools none.
    evidence: dict[str, tuple[float, float]] | None = None
    evidence_of: dict[str, int] = field(default_factory=dict)

    @property
    def believe_s(self) -> float | None:
        """How long engines believe their own uploads now (``core.retention.believe_s``)."""
        return self.retention_history[-1][1] if self.retention_history else None

    def written_at(self, age_s: int) -> float:
        return self.listed_at - age_s


def check_evidence(ev: Any) -> dict[str, tuple[float, float]]:
    """Write-policy evidence as a report or the fleet index carries it: at most
    :data:`MAX_EVIDENCE_KEYS` names, each [reads, writes] finite and non-negative. Raises ValueError."""
    if not isinstance(ev, dict) or len(ev) > MAX_EVIDENCE_KEYS:
        raise ValueError(f"write-policy evidence is not a mapping of at most {MAX_EVIDENCE_KEYS} names")
    out = {}
    for k, v in ev.items():
        r, w = (float(x) for x in v)
        if not (isinstance(k, str) and len(k) <= 32 and all(math.isfinite(x) and x >= 0 for x in (r, w))):
            raise ValueError(f"write-policy evidence {k!r}: {v!r} is not two non-negative counts")
        out[k] = (r, w)
    return out


def add_evidence(into: dict[str, tuple[float, float]], ev: Mapping[str, Sequence[float]], weight: float) -> None:
    """Add ``weight`` times each (reads, writes) of ``ev`` to ``into`` (a negative weight takes
    a report back out of a sum)."""
    for k, (r, w) in ev.items():
        r0, w0 = into.get(k, (0.0, 0.0))
        into[k] = (r0 + r * weight, w0 + w * weight)


def max_index_bytes(max_objects: int) -> int:
    """The largest index a reader bounded at ``max_objects`` may fetch (zlib never grows the body
    by more than a few bytes per 16 KiB)."""
    body = max_objects * ENTRY_BYTES
    return len(MAGIC) + 1 + _U32.size + MAX_HEADER_BYTES + body + body // 1000 + 1024 + OBJECT_TAG_BYTES


def encode(
    namespace: bytes,
    sections: Mapping[SectionId, Iterable[IndexEntry]],
    *,
    object_key: str,
    listed_at: float,
    published_at: float,
    every_s: float,
    tag_key: TagKey | None = None,
    level: int = 6,
    retention: tuple[float, float] | None = None,
    retention_history: Sequence[tuple[float, float]] = (),
    evidence: tuple[Mapping[str, tuple[float, float]], Mapping[str, int]] | None = None,
) -> bytes:
    """The index object for ``sections`` (entries in any order), signed when ``tag_key``."""
    heads: list[list[Any]] = []
    cols: list[bytes] = []
    for (gfp, shard, tp), entries in sorted(sections.items()):
        rows = sorted((digest_key(e.digest), e.end, e.count, e.written_at) for e in entries)
        if not rows:
            continue
        keys, ends, counts, ages = array("Q"), array("I"), array("H"), array("I")
        for k, end, count, written in rows:
            keys.append(k)
            ends.append(end)
            counts.append(count)
            ages.append(min(0xFFFFFFFF, max(0, int(listed_at - written))))
        for col in (keys, ends, counts, ages):
            if not _LITTLE:
                col.byteswap()
            cols.append(col.tobytes())
        heads.append([gfp, int(shard), int(tp), len(rows)])
    raw = b"".join(cols)
    header = {
        "namespace": namespace.hex(),
        "listed_at": float(listed_at),
        "published_at": float(published_at),
        "every_s": float(every_s),
        "key_id": tag_key.key_id.hex() if tag_key is not None else None,
        "body_bytes": len(raw),
        "sections": heads,
    }
    if retention is not None:  # (retention s, learning since): s3kv.core.retention
        header["retention"] = [float(retention[0]), float(retention[1])]
        header["retention_history"] = [[float(t), float(r)] for t, r in retention_history]
    if evidence is not None:  # (fleet sum, engine -> report number): s3kv.core.value, pooled
        header["evidence"] = {k: [float(r), float(w)] for k, (r, w) in evidence[0].items()}
        header["evidence_of"] = {e: int(n) for e, n in evidence[1].items()}
    hb = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    out = MAGIC + bytes([FORMAT]) + _U32.pack(len(hb)) + hb + zlib.compress(raw, level)
    if tag_key is not None:
        out += tag_key.index_tag(object_key, out)
    return out


def _header(data: memoryview) -> tuple[dict[str, Any], int]:
    fixed = len(MAGIC) + 1 + _U32.size
    if len(data) < fixed or bytes(data[: len(MAGIC)]) != MAGIC:
        raise IndexFormatError("foreign", "not a fleet index (bad magic)")
    if data[len(MAGIC)] != FORMAT:
        raise IndexFormatError("version", f"fleet index format {data[len(MAGIC)]}, this build reads {FORMAT}")
    (hlen,) = _U32.unpack_from(data, len(MAGIC) + 1)
    if hlen > MAX_HEADER_BYTES or fixed + hlen > len(data):
        raise IndexFormatError("truncated", f"fleet index header of {hlen} bytes does not fit")
    try:
        header = json.loads(bytes(data[fixed : fixed + hlen]))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise IndexFormatError("foreign", f"fleet index header is not JSON: {e}") from None
    return header, fixed + hlen


def decode(
    data: bytes | memoryview,
    *,
    object_key: str,
    namespace: bytes,
    keys: IntegrityKeys | None,
    max_objects: int,
) -> FleetIndex:
    """The index in ``data``, fetched from ``object_key``, for a reader of ``namespace`` holding
    integrity ``keys`` (or none). Raises :class:`IndexFormatError`.

    A signature is checked whenever the reader holds the key that made it (a bad one is refused);
    ``verified`` says whether it was. What an unverified index may be used for is the reader's
    policy (``s3kv.engine.fleetindex``), not the format's."""
    view = memoryview(data).cast("B")
    header, start = _header(view)
    try:
        key_hex = header["key_id"]
        key_id = bytes.fromhex(key_hex) if key_hex is not None else None
        ns = bytes.fromhex(header["namespace"])
        listed_at, published_at = float(header["listed_at"]), float(header["published_at"])
        every_s = float(header["every_s"])
        body_bytes = int(header["body_bytes"])
        heads = [(str(g), int(s), int(t), int(n)) for g, s, t, n in header["sections"]]
        learnt = header.get("retention")
        retention = (float(learnt[0]), float(learnt[1])) if learnt is not None else None
        history = tuple((float(t), float(r)) for t, r in header.get("retention_history", ()))
        pooled = check_evidence(header["evidence"]) if "evidence" in header else None
        pooled_of = {str(e): int(n) for e, n in dict(header.get("evidence_of", {})).items()}
    except (KeyError, TypeError, ValueError) as e:
        raise IndexFormatError("foreign", f"fleet index header lacks a field or has a bad one: {e}") from None
    if ns != namespace:
        raise IndexFormatError("namespace", f"fleet index of namespace {ns.hex()}, expected {namespace.hex()}")
    end = len(view)
    verified = False
    if key_id is not None:
        end -= OBJECT_TAG_BYTES
        if end < start:
            raise IndexFormatError("truncated", "signed fleet index without its tag")
        if keys is not None:
            k = keys.find(key_id)
            if k is None:
                raise IndexFormatError("unknown_key", f"fleet index signed by key {key_id.hex()}, not one of ours")
            if not equal(k.index_tag(object_key, view[:end]), bytes(view[end:])):
                raise IndexFormatError("bad_signature", "fleet index tag does not verify")
            verified = True
    n_total = sum(n for *_, n in heads)
    if len(heads) > MAX_SECTIONS or any(n < 0 for *_, n in heads) or n_total > max_objects:
        raise IndexFormatError("too_large", f"fleet index of {n_total} objects (bound {max_objects})")
    if body_bytes != n_total * ENTRY_BYTES:
        raise IndexFormatError("foreign", f"fleet index body of {body_bytes} bytes for {n_total} objects")
    z = zlib.decompressobj()
    try:
        raw = z.decompress(view[start:end], body_bytes + 1)
    except zlib.error as e:
        raise IndexFormatError("foreign", f"fleet index body does not inflate: {e}") from None
    if len(raw) != body_bytes or z.unconsumed_tail or not z.eof:
        raise IndexFormatError("truncated", f"fleet index body inflates to {len(raw)} bytes, expected {body_bytes}")
    out = FleetIndex(ns, listed_at, published_at, every_s, key_id, verified, objects=n_total, nbytes=len(view),
                     retention_s=retention[0] if retention else None, auto_since=retention[1] if retention else None,
                     retention_history=history, evidence=pooled, evidence_of=pooled_of)
    off = 0
    for gfp, shard, tp, n in heads:
        cols = []
        for code, width in (("Q", 8), ("I", 4), ("H", 2), ("I", 4)):
            col = array(code)
            col.frombytes(raw[off : off + n * width])
            if not _LITTLE:
                col.byteswap()
            cols.append(col)
            off += n * width
        out.sections[(gfp, shard, tp)] = Section(*cols)
    return out

