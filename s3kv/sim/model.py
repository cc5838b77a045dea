"""The deterministic "model": what the forward writes into a page, and which token it samples.

A real layer's KV for a block depends on every token before the block's end
(through the layers below), so the simulated KV of block ``b`` for layer ``L``
on shard ``s`` in region ``r`` is a pure function of the digest of the *full*
token prefix up to the block's end plus ``(L, s, r)``. Any connector bug that
puts another prefix's, layer's, group's, shard's, region's or slot's bytes into
a page therefore produces a byte mismatch. The digest is the simulator's own
(blake2b over int64 token bytes), independent of s3kv's keys.

Bytes are produced cheaply -- a fixed random tensor per (layer, shard, region)
XOR-ed with a 64-bit word from the digest -- because benchmark pages can be
megabytes: that is one vectorised pass, ~50x faster than seeding an RNG per page.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Sequence

import torch

_PERSON_ROOT = b"s3kv-sim-root"
_PERSON_BASE = b"s3kv-sim-base"
_PERSON_LORA = b"s3kv-sim-lora"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian int64 bytes of ``tokens``."""
    a = array("q", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def request_root(
    *,
    cache_salt: str | None = None,
    lora_weights: bytes | None = None,
    multimodal_hashes: Sequence | None = None,
    unhashed_multimodal_nonce: int | None = None,
    salt_changes_kv: bool = True,
) -> bytes:
    """What, besides tokens, determines a request's KV.

    The LoRA weights the engine applies (``adapter_weights``: their content, never the
    request's integer task id) and multimodal content change the KV; the salt does when
    ``salt_changes_kv`` (see SimCacheConfig). A request with multimodal
    positions but no hashes gets a per-request nonce: its KV is unknowable from
    tokens, so any cross-request reuse of it is a mismatch.
    """
    mm = None if multimodal_hashes is None else _freeze(multimodal_hashes)
    salt = cache_salt if salt_changes_kv else None
    ident = repr((lora_weights, mm, salt, unhashed_multimodal_nonce)).encode()
    return hashlib.blake2b(ident, digest_size=16, person=_PERSON_ROOT).digest()


def adapter_weights(path: str) -> bytes:
    """What a LoRA adapter at ``path`` applies, as the engine reads it (TensorRT-LLM's
    ``HfLoraLoader``: a directory's ``adapter_config.json`` and ``adapter_model.*`` files; a NeMo
    archive is one file): a digest of their contents. The simulator's own reading, independent
    of s3kv's adapter identity."""
    if os.path.isfile(path):
        files = [path]
    else:
        names = sorted(os.listdir(path))
        files = [os.path.join(path, n) for n in names if n == "adapter_config.json" or n.startswith("adapter_model.")]
        if not files:
            raise ValueError(f"{path}: no LoRA adapter files")
    h = hashlib.blake2b(digest_size=16, person=_PERSON_LORA)
    for f in files:
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.digest()


def _freeze(x: object) -> object:
    if isinstance(x, list | tuple):
        return tuple(_freeze(v) for v in x)
    return x


class PrefixHasher:
    """Digest of ``root + tokens[:p]`` for any ``p``, incrementally.

    Keeps the hash state at every block boundary, so a digest costs at most one
    block of hashing. The token list handed in must only ever grow (a request's
    tokens do); the states are not re-validated against it.
    """

    def __init__(self, root: bytes, tokens_per_block: int):
        self._tpb = tokens_per_block
        self._states = [hashlib.blake2b(root, digest_size=16)]

    def digest(self, tokens: Sequence[int], p: int) -> bytes:
        if not 0 <= p <= len(tokens):
            raise ValueError(f"prefix length {p} outside [0, {len(tokens)}]")
        tpb = self._tpb
        b = p // tpb
        while len(self._states) <= b:
            i = len(self._states) - 1
            h = self._states[-1].copy()
            h.update(token_bytes(tokens[i * tpb : (i + 1) * tpb]))
            self._states.append(h)
        h = self._states[b].copy()
        if p > b * tpb:
            h.update(token_bytes(tokens[b * tpb : p]))
        return h.digest()


def next_token(digest: bytes, vocab_size: int) -> int:
    """The token sampled after a prefix with this digest (greedy and deterministic)."""
    return int.from_bytes(digest[8:16], "little") % vocab_size


def generate_tokens(root: bytes, prompt: Sequence[int], n: int, vocab_size: int) -> list[int]:
    """The ``n`` tokens the engine will generate after ``prompt`` (for building multi-turn workloads).

    Digests do not depend on the hasher's checkpoint spacing, so any block size gives the same tokens.
    """
    tokens = list(prompt)
    hasher = PrefixHasher(root, 64)
    for _ in range(n):
        tokens.append(next_token(hasher.digest(tokens, len(tokens)), vocab_size))
    return tokens[len(prompt) :]


class KvModel:
    """Generates and verifies the bytes a layer's forward writes into one region of one page."""

    def __init__(
        self,
        *,
        num_layers: int,
        tp_size: int,
        region_bytes: tuple[int, ...],
        device: torch.device,
        seed: int,
    ):
        self._base: dict[tuple[int, int, int], torch.Tensor] = {}
        for layer in range(num_layers):
            for shard in range(tp_size):
                for region, n in enumerate(region_bytes):
                    if n % 8:
                        raise ValueError(f"region {region} segment of {n} bytes is not a multiple of 8")
                    ident = f"{seed}/{layer}/{shard}/{region}".encode()
                    s = int.from_bytes(
                        hashlib.blake2b(ident, digest_size=8, person=_PERSON_BASE).digest(), "little"
                    )
                    gen = torch.Generator().manual_seed(s & ((1 << 63) - 1))
                    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
                    self._base[(layer, shard, region)] = raw.to(device).view(torch.int64)

    def content(self, digest: bytes, layer: int, shard: int, region: int) -> torch.Tensor:
        """uint8 bytes of ``layer``'s segment in ``region`` for the prefix with ``digest``."""
        word = int.from_bytes(digest[:8], "little", signed=True)
        return torch.bitwise_xor(self._base[(layer, shard, region)], word).view(torch.uint8)
