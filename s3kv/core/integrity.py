"""Keyed integrity tags: only holders of the engines' secret can write KV that readers accept.

The per-page xxh3 checksums in an object's header catch corruption, not forgery:
anyone with ``s3:PutObject`` on the prefix can write pages of their choosing and
recompute the checksums. With a secret configured (``S3KV_INTEGRITY_KEY`` or
``S3KV_INTEGRITY_KEY_FILE``) every object carries tags only a key holder can make,
and a reader holding the key treats an object without a valid tag as a miss.

Four tags, all keyed BLAKE3 (a MAC when keyed; ~5 GB/s a core here, 4-8x keyed
BLAKE2b or HMAC-SHA256 -- see ``s3kv bench integrity``), each under its own key
derived from the secret (``derive_key`` contexts), so one tag can never stand in
for another:

* a **page tag** (16 bytes) per page, so a ranged load of a few pages verifies
  exactly the bytes it fetched;
* an **object tag** (32 bytes) over the object key, the whole header and the
  ordered page tags: binds every page to its position, object and key;
* a **metadata tag** (16 bytes, in ``x-amz-meta-s3kv-tag``) over the object key
  and the mirrored metadata, so the lookup's HEAD rejects a planted object before
  anything is promised -- a forged object is a miss, not a failed load;
* an **index tag** (32 bytes) over a published fleet index and its key
  (``s3kv.core.fleetindex``): only a key holder can publish an index that makes a
  hit free.

Every tag names the key that made it by an 8-byte key id (a one-way digest of
the secret). Writers sign with the current key; readers accept the current key
and the configured previous keys, which is how a key is rotated without a cold
cache (docs/security.md).

Secrets are strings of >= 32 characters without whitespace or commas (e.g.
``openssl rand -hex 32``); they never appear in a message, a log line or a repr.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

if TYPE_CHECKING:
    from ..config import Settings

MIN_SECRET_CHARS = 32
KEY_ID_BYTES = 8
PAGE_TAG_BYTES = 16
OBJECT_TAG_BYTES = 32
META_TAG_BYTES = 16

_CTX = "s3kv object integrity v1: "


def _derive(secret: bytes, purpose: str, size: int = 32) -> bytes:
    return blake3.blake3(secret, derive_key_context=_CTX + purpose).digest(size)


@dataclass(frozen=True)
class TagKey:
    """One secret's derived keys. Built with :meth:`from_secret`; holds no secret itself."""

    key_id: bytes
    _page: bytes = field(repr=False)
    _object: bytes = field(repr=False)
    _meta: bytes = field(repr=False)
    _index: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: str | bytes) -> TagKey:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        return cls(
            _derive(raw, "key id", KEY_ID_BYTES),
            _derive(raw, "page tag"),
            _derive(raw, "object tag"),
            _derive(raw, "metadata tag"),
            _derive(raw, "fleet index tag"),
        )

    def __repr__(self) -> str:
        return f"TagKey(id={self.key_id.hex()})"

    def page_tag(self, page: Any) -> bytes:
        # blake3 releases the GIL on large inputs: upload/download threads tag in parallel.
        return blake3.blake3(page, key=self._page).digest(PAGE_TAG_BYTES)

    def object_tag(self, object_key: str, header: bytes, page_tags: Sequence[bytes]) -> bytes:
        h = blake3.blake3(key=self._object)
        k = object_key.encode()
        # Length-prefixed: no (key, header) pair can be re-split into another.
        h.update(len(k).to_bytes(8, "little"))
        h.update(k)
        h.update(self.key_id)
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        for t in page_tags:
            h.update(t)
        return h.digest(OBJECT_TAG_BYTES)

    def metadata_tag(self, object_key: str, fields: Mapping[str, str]) -> bytes:
        h = blake3.blake3(key=self._meta)
        # Canonical: sorted "name=value" lines; names and values never hold a newline.
        text = object_key + "\n" + "".join(f"{k}={fields[k]}\n" for k in sorted(fields))
        h.update(text.encode())
        return h.digest(META_TAG_BYTES)

    def index_tag(self, object_key: str, body: Any) -> bytes:
        """The tag of a published fleet index (``s3kv.core.fleetindex``): over its key, so a
        signed index copied to another namespace's key does not verify there, and its bytes."""
        h = blake3.blake3(key=self._index)
        k = object_key.encode()
        h.update(len(k).to_bytes(8, "little"))
        h.update(k)
        h.update(self.key_id)
        h.update(body)
        return h.digest(OBJECT_TAG_BYTES)


@dataclass(frozen=True)
class IntegrityKeys:
    """The key writers sign with, and every key readers accept (current first)."""

    current: TagKey
    previous: tuple[TagKey, ...] = ()

    def __post_init__(self) -> None:
        ids = [k.key_id for k in self.accepted]
        if len(set(ids)) != len(ids):
            raise ValueError("integrity keys: the same key is configured twice")

    @property
    def accepted(self) -> tuple[TagKey, ...]:
        return (self.current, *self.previous)

    def find(self, key_id: bytes) -> TagKey | None:
        for k in self.accepted:
            if hmac.compare_digest(k.key_id, key_id):
                return k
        return None

    @classmethod
    def from_secrets(cls, current: str | bytes, previous: Sequence[str | bytes] = ()) -> IntegrityKeys:
        return cls(TagKey.from_secret(current), tuple(TagKey.from_secret(p) for p in previous))


def equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two tags."""
    return hmac.compare_digest(a, b)


# ------------------------------------------------------------------ settings -> keys


def _secret_problem(secret: str) -> str | None:
    if len(secret) < MIN_SECRET_CHARS:
        return f"a secret must have at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 32`)"
    if any(c.isspace() or c == "," for c in secret):
        return "a secret must not contain whitespace or commas"
    return None


def _read_secrets(path: str, setting: str) -> list[str]:
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _config_error(f"{setting}: cannot read {path!r}: {type(e).__name__}") from None
    # One secret per line; blank lines and '#' comments ignored.
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _config_error(message: str) -> Exception:
    from ..config import ConfigError

    return ConfigError(message)


def keys_from_settings(settings: Settings) -> IntegrityKeys | None:
    """The integrity keys the settings name, or None (integrity off).

    Raises ``ConfigError`` naming the setting (never echoing a secret) when a key is
    malformed, a file is unreadable, or previous keys are set without a current one.
    """
    key, key_file = settings.integrity_key.strip(), settings.integrity_key_file.strip()
    prev_inline, prev_file = settings.integrity_previous_keys.strip(), settings.integrity_previous_keys_file.strip()
    if key and key_file:
        raise _config_error(
            "S3KV_INTEGRITY_KEY / integrity_key and S3KV_INTEGRITY_KEY_FILE / integrity_key_file: set only one"
        )
    current: str | None = None
    if key:
        problem = _secret_problem(key)
        if problem:
            raise _config_error(f"S3KV_INTEGRITY_KEY / integrity_key: {problem}")
        current = key
    elif key_file:
        found = _read_secrets(key_file, "S3KV_INTEGRITY_KEY_FILE / integrity_key_file")
        if len(found) != 1:
            raise _config_error(
                f"S3KV_INTEGRITY_KEY_FILE / integrity_key_file: {key_file!r} must hold exactly one secret, "
                f"found {len(found)}"
            )
        problem = _secret_problem(found[0])
        if problem:
            raise _config_error(f"S3KV_INTEGRITY_KEY_FILE / integrity_key_file: {key_file!r}: {problem}")
        current = found[0]
    previous: list[str] = []
    if prev_inline:
        for i, s in enumerate(x.strip() for x in prev_inline.split(",")):
            problem = _secret_problem(s)
            if problem:
                raise _config_error(f"S3KV_INTEGRITY_PREVIOUS_KEYS / integrity_previous_keys: entry {i}: {problem}")
            previous.append(s)
    if prev_file:
        for i, s in enumerate(_read_secrets(prev_file, "S3KV_INTEGRITY_PREVIOUS_KEYS_FILE")):
            problem = _secret_problem(s)
            if problem:
                raise _config_error(
                    f"S3KV_INTEGRITY_PREVIOUS_KEYS_FILE / integrity_previous_keys_file: {prev_file!r} "
                    f"line {i + 1}: {problem}"
                )
            previous.append(s)
    if current is None:
        if previous:
            raise _config_error(
                "S3KV_INTEGRITY_PREVIOUS_KEYS: previous keys need a current key "
                "(S3KV_INTEGRITY_KEY or S3KV_INTEGRITY_KEY_FILE)"
            )
        return None
    # The current key listed again among the previous ones is harmless (a rotation step); drop it.
    previous = [p for p in dict.fromkeys(previous) if p != current]
    return IntegrityKeys.from_secrets(current, previous)
