"""Namespaces, the chained-prefix digest, and object keys. Pure functions.

Why a chain: a page's KV is a function of the *whole* token prefix up to its
block (every layer sees all earlier tokens through the layers below), so the
key must name the whole prefix. ``c_i = H(c_{i-1}, tokens of block i)`` does that
in O(block) per block, and one chain serves every layer group and shard; group
and shard go into the object key beside it. Keys hold digests only, never tokens.

Key layout (decided here, documented in docs/architecture.md)::

    {prefix}/{namespace:32 hex}/{group fingerprint:16 hex}.{shard}of{tp}/{chain digest:32 hex}

* one path per namespace, so ``s3kv ls``/``gc`` can walk or drop a model's cache;
* group and shard next, so per-group stats are a prefix listing;
* the chain digest last: uniformly random, so S3 can split a hot
  ``…/group.shard/`` prefix on its first characters when load grows (each S3
  prefix partition serves ~5,500 GET/HEAD and ~3,500 PUT per second).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .layout import CacheGeometry

FORMAT_VERSION = 1
DIGEST_SIZE = 16


def namespace_digest(geometry: CacheGeometry, *, tagged: bool = False) -> bytes:
    """Everything that makes bytes incompatible goes in: a different geometry never shares a key.

    ``geometry.model_id`` is the model identity (``s3kv.trtllm.identity``: name, revision,
    model dtype, quantization, config digest) and ``kv_dtype`` the resolved KV dtype,
    so fp16 and bf16 loads of one checkpoint never share a key. ``tagged``: engines
    that sign objects (integrity key set) keep their own namespace -- untagged
    objects would be misses for them, and write-once would let an untagged object
    squat the key a signed one needs. The key itself stays out: rotating it must
    not empty the cache.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"s3kv-ns")
    fields: tuple[object, ...] = (
        FORMAT_VERSION,
        geometry.model_id,
        geometry.kv_dtype,
        geometry.tokens_per_block,
        geometry.tp_size,
        tuple(g.fingerprint for g in geometry.groups),
    )
    if tagged:
        # Appended only when on, so untagged namespaces keep their digests.
        fields += ("integrity-tagged",)
    h.update(repr(fields).encode())
    return h.digest()


class NotCacheable(ValueError):
    """A request whose KV depends on something the key cannot name (e.g. images without hashes)."""


def chain_root(
    namespace: bytes,
    *,
    cache_salt: str | int | None = None,
    lora: str | None = None,
    multimodal_hashes: Sequence[object] | None = None,
    has_multimodal: bool = False,
) -> bytes:
    """c_0: the namespace plus everything besides tokens that changes the KV.

    The salt isolates tenants: two salts never share a chain, so never a hit. ``lora`` is the
    adapter's *identity* (``s3kv.trtllm.lora``: a digest of its files), never TensorRT-LLM's
    integer ``lora_task_id``: each deployment numbers its adapters freely, so one id names
    different weights on different clusters. None (the base model) keeps the digests of base
    requests what they were.
    """
    if lora is not None and not isinstance(lora, str):  # an integer task id is no identity
        raise TypeError(f"lora must be an adapter identity string, got {type(lora).__name__}")
    if has_multimodal and not multimodal_hashes:
        raise NotCacheable("request has multimodal inputs but no multimodal hashes; its KV cannot be keyed")
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"s3kv-root")
    h.update(namespace)
    h.update(repr(("salt", cache_salt)).encode())
    h.update(repr(("lora", lora)).encode())
    mm = tuple(_hash_repr(x) for x in (multimodal_hashes or ()))
    h.update(repr(("mm", mm)).encode())
    return h.digest()


def _hash_repr(x: object) -> object:
    # Multimodal hashes arrive as ints, lists of ints or bytes depending on the
    # build; normalise so the same content always hashes the same.
    if isinstance(x, (list, tuple)):
        return tuple(_hash_repr(y) for y in x)
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).hex()
    return x


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    """Each token as a little-endian int64: the chain's input bytes (part of every key).

    ``struct.pack`` converts a list of ints about twice as fast as ``array("q", ...)`` (2.4 vs
    4.5 ms for 128k tokens on a 2-core EPYC), and this runs on the engine's scheduling path for
    every new prompt. The bytes are the ones ``array("q")`` gave on every little-endian host
    (x86, ARM), so keys written by earlier versions still match; ``<`` pins them elsewhere too.
    """
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as e:  # a plain ValueError for callers: a token is not an int64
        raise ValueError(f"token ids must be int64 values: {e}") from None


#: c_i = blake2b(c_{i-1} || tokens of block i), 16 bytes, personalised; copied, never updated.
_BLOCK_HASHER = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"s3kv-blk")


class Chain:
    """Incremental chained digests over full blocks of a growing token list.

    ``raw`` keeps the bytes digested so far (8 per token): what :class:`ChainMemo` compares a
    later prompt with, to reuse digests instead of hashing again. ``branch``: where this prompt
    left the recent prompt it shares most with, inside both (blocks; 0: none, or not known)."""

    __slots__ = ("root", "tokens_per_block", "digests", "raw", "branch")

    def __init__(self, root: bytes, tokens_per_block: int):
        self.root = root
        self.tokens_per_block = tokens_per_block
        self.digests: list[bytes] = []
        self.raw = bytearray()
        self.branch = 0

    def extend_to(self, tokens: Sequence[int]) -> list[bytes]:
        """Digest every full block of ``tokens`` not digested yet; returns the whole list."""
        tpb = self.tokens_per_block
        full = len(tokens) // tpb
        start = len(self.digests)
        if full <= start:
            return self.digests
        # One conversion of every new block's tokens, then a slice per block: the same bytes as
        # converting block by block, at a fraction of the cost (this runs on the engine's
        # scheduling path for every new prompt - 128k tokens are 4096 blocks).
        data = _tokens_bytes(tokens[start * tpb : full * tpb])
        self.raw += data
        self._digest(memoryview(data))
        return self.digests

    def _digest(self, raw: memoryview) -> None:
        """Digest ``raw``: the bytes of whole blocks following those digested so far."""
        step = self.tokens_per_block * 8
        prev = self.digests[-1] if self.digests else self.root
        # Copying a primed hasher skips parsing the parameters for every block: the same
        # digests (blake2b over prev || block, personalised), a third less time.
        fresh, append = _BLOCK_HASHER.copy, self.digests.append
        for off in range(0, len(raw), step):
            h = fresh()
            h.update(prev)
            h.update(raw[off : off + step])
            prev = h.digest()
            append(prev)

    def __len__(self) -> int:
        return len(self.digests)


#: Tokens the chains a :class:`ChainMemo` remembers may hold (8 bytes each: 32 MiB), about thirty
#: 128k-token prompts or thousands of short ones -- a few minutes of an engine's distinct prompts.
MEMO_TOKENS = 4 << 20


class ChainMemo:
    """Recent chains, so a prompt that begins like one of them hashes only what follows.

    Why: hashing the chain is most of what a lookup answered without a request costs the engine's
    scheduler (a 128k-token prompt: 5-7 ms of blake2b while every co-running request waits),
    and the prompts that hit are those repeating a prefix seen lately -- the next turn of a
    conversation re-sends its history, an agent its context, requests their system prompt and
    documents. Exact, never probable: a digest is reused only for blocks whose token bytes equal
    those the remembered chain digested, under the same root, so each digest is the one hashing
    would give.

    Chains are found by their root and first block's bytes (the ``per_key`` latest each) and
    kept, least recently remembered out first, while the tokens they held when remembered fit
    ``max_tokens``. A remembered chain may keep growing (its request's decode blocks): only what
    it has digested is compared. Not thread-safe: the leader calls it under its lock.
    """

    def __init__(self, max_tokens: int = MEMO_TOKENS, per_key: int = 8):
        self.max_tokens = max_tokens
        self.per_key = per_key
        #: Recent prompt blocks: digest -> the length of the latest prompt that held it (``_branch``).
        self._reach: dict[bytes, int] = {}
        self._reach_old: dict[bytes, int] = {}
        self.max_blocks = max(2, max_tokens // 64)
        self._by_first: dict[tuple[bytes, bytes], list[Chain]] = {}
        self._lru: OrderedDict[Chain, tuple[tuple[bytes, bytes], int]] = OrderedDict()
        self._tokens = 0
        #: Blocks whose digest was reused.
        self.reused = 0

    def chain(self, root: bytes, tokens_per_block: int, tokens: Sequence[int]) -> Chain:
        """The chain of ``tokens``' full blocks under ``root``, remembered for later prompts."""
        chain = Chain(root, tokens_per_block)
        full = len(tokens) // tokens_per_block
        if full == 0 or self.max_tokens <= 0:
            chain.extend_to(tokens)
            return chain
        step = tokens_per_block * 8
        data = _tokens_bytes(tokens[: full * tokens_per_block])
        key = (root, data[:step])
        best, src = 0, None
        for c in reversed(self._by_first.get(key, ())):
            n = min(len(c.digests), len(c.raw) // step, full)
            if n > best:
                k = _common_blocks(data, c.raw, n, step)
                if k > best:
                    best, src = k, c
        if src is not None:
            chain.digests = src.digests[:best]
        chain.raw = bytearray(data)
        chain._digest(memoryview(data)[best * step :])
        self.reused += best
        self._remember(key, chain, full * tokens_per_block)
        self._branch(chain, full)
        return chain

    def _branch(self, chain: Chain, full: int) -> None:
        """Set ``chain.branch`` from the recent prompts' blocks, then remember this prompt's.

        Why not from the chains compared above: those are the few latest with the same first block,
        and prompts that share a system prompt are many -- the one that shares a document with this
        prompt is rarely among them. The reach maps each recent prompt block's digest to the length
        (blocks) of the latest prompt that held it. A digest names its whole prefix, so the longest
        common prefix with any recent prompt is the deepest block found (a binary search: the blocks
        found are a prefix, except where one was forgotten, which makes it shorter), and it is a
        branch where that prompt went on past it -- not where it ended (a next turn, a repeat).
        Two generations, the older dropped whole when the younger fills: one bulk update per prompt
        (0.5 ms for 4,096 blocks), where a per-block LRU cost 2.7 ms on the scheduler's thread."""
        young, old, digests = self._reach, self._reach_old, chain.digests

        def held(i: int) -> int:
            d = digests[i]
            return young.get(d) or old.get(d, 0)

        lo, hi = 0, full  # digests[:lo] held; none from hi on (as far as the search can tell)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if held(mid - 1):
                lo = mid
            else:
                hi = mid - 1
        if 0 < lo < full and held(lo - 1) > lo:
            chain.branch = lo
        young.update(dict.fromkeys(digests[:full], full))
        if len(young) > self.max_blocks // 2:
            self._reach_old, self._reach = young, {}

    def _remember(self, key: tuple[bytes, bytes], chain: Chain, tokens: int) -> None:
        same = self._by_first.setdefault(key, [])
        same.append(chain)
        self._lru[chain] = (key, tokens)
        self._tokens += tokens
        if len(same) > self.per_key:
            self._forget(same[0])
        while self._tokens > self.max_tokens and self._lru:
            self._forget(next(iter(self._lru)))

    def _forget(self, chain: Chain) -> None:
        key, tokens = self._lru.pop(chain)
        self._tokens -= tokens
        same = self._by_first[key]
        same.remove(chain)
        if not same:
            del self._by_first[key]


def _common_blocks(a: bytes, b: bytes | bytearray, n: int, step: int) -> int:
    """How many of the first ``n`` blocks (``step`` bytes each) ``a`` and ``b`` have equal. Byte
    comparisons (memcmp) of halving windows: at most about ``n`` blocks' bytes compared."""
    if a[: n * step] == b[: n * step]:
        return n
    lo, hi = 0, n  # blocks [0, lo) equal; a difference within [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * step : mid * step] == b[lo * step : mid * step]:
            lo = mid
        else:
            hi = mid
    return lo


def chain_digests(root: bytes, tokens: Sequence[int], tokens_per_block: int) -> list[bytes]:
    return Chain(root, tokens_per_block).extend_to(tokens)


@dataclass(frozen=True)
class KeyScheme:
    prefix: str
    namespace: bytes
    tp_size: int

    @property
    def namespace_prefix(self) -> str:
        return f"{self.prefix}/{self.namespace.hex()}/" if self.prefix else f"{self.namespace.hex()}/"

    def group_prefix(self, group_fingerprint: str, shard: int) -> str:
        return f"{self.namespace_prefix}{group_fingerprint}.{shard}of{self.tp_size}/"

    def object_key(self, group_fingerprint: str, shard: int, last_digest: bytes) -> str:
        return self.group_prefix(group_fingerprint, shard) + last_digest.hex()


@dataclass(frozen=True)
class ParsedKey:
    namespace: str
    group_fingerprint: str
    shard: int
    tp_size: int
    digest: str


def parse_key(key: str) -> ParsedKey | None:
    """Inverse of ``KeyScheme.object_key`` for operator tools; None for foreign keys."""
    parts = key.rsplit("/", 3)
    if len(parts) < 3:
        return None
    ns, gs, digest = parts[-3], parts[-2], parts[-1]
    try:
        gfp, shard_s = gs.split(".", 1)
        shard, tp = (int(x) for x in shard_s.split("of", 1))
        if len(ns) != 2 * DIGEST_SIZE or len(digest) != 2 * DIGEST_SIZE or len(gfp) != 16:
            return None
        int(ns, 16), int(digest, 16), int(gfp, 16)
    except ValueError:
        return None
    return ParsedKey(ns, gfp, shard, tp, digest)
