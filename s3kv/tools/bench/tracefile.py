"""Request traces: reading them, finding multi-turn continuations, and turning hash ids into tokens.

A trace in the Mooncake format (kvcache-ai/Mooncake, ``FAST25-release/traces``) has one JSON
object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` -- one
id per 512-token block of the prompt (the last block may be partial), remapped so that equal
ids mean equal blocks *and* equal prefixes before them (an id names the whole prefix up to its
block, as a chained hash does). No text, no tokens.

What a replay needs and this module provides, all deterministic (the same on every machine):

* :func:`read_trace` -- the requests, in arrival order, with one-line errors naming the line;
* :func:`find_continuations` -- which request is the next turn of which: B continues A when
  B's ids start with every id of A's *full* blocks and B is at least as long as A's prompt
  plus A's answer (a next turn re-sends the history -- prompt and answer -- then adds a new
  message). A's last, partial block is never among B's ids: in B that block holds A's tail,
  A's answer and B's new text, a different 512 tokens, so it has a new id;
* :class:`TokenSynth` -- the prompt of each request as tokens: a block with id ``i`` is a fixed
  pseudo-random function of ``i`` (equal ids, equal tokens), except where a request continues
  another: there its tokens are the history the engine really produced (the earlier prompt's
  tail and the answer it generated), and the ids of the blocks holding that history are bound
  to those tokens for every later request that names them.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Tokens per hash block in the Mooncake format.
MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("mooncake",)


class TraceError(ValueError):
    """The trace cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    index: int  # position in arrival order (0-based)
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_tokens: int) -> int:
        """How many of the prompt's hash blocks are whole."""
        return self.input_length // block_tokens


def read_trace(
    path: str | Path, fmt: str = "mooncake", limit: int | None = None
) -> tuple[list[TraceRequest], int]:
    """The first ``limit`` requests of the trace (all when None), sorted by arrival (stable), and
    the format's tokens per hash block."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    if limit is not None and limit < 1:
        raise TraceError(f"--limit must be >= 1, got {limit}")
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file not found: {path}")
    bt = MOONCAKE_BLOCK_TOKENS
    out: list[TraceRequest] = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            out.append(_parse_mooncake(line, f"{path}:{lineno}", len(out), bt))
    if not out:
        raise TraceError(f"{path}: no requests")
    order = sorted(range(len(out)), key=lambda i: out[i].timestamp_ms)
    if order != list(range(len(out))):
        out = [TraceRequest(k, out[i].timestamp_ms, out[i].input_length, out[i].output_length, out[i].hash_ids)
               for k, i in enumerate(order)]
    return out, bt


def _parse_mooncake(line: str, where: str, index: int, bt: int) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise TraceError(f"{where}: timestamp must be a number (ms), got {ts!r}")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise TraceError(f"{where}: {name} must be a positive integer, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    if len(ids) != -(-n_in // bt):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{bt}) = {-(-n_in // bt)}"
        )
    return TraceRequest(index, float(ts), n_in, n_out, tuple(ids))


def find_continuations(reqs: Sequence[TraceRequest], block_tokens: int) -> dict[int, int]:
    """request index -> index of the earlier request it continues (see the module doc).

    Of several candidates the one sharing the most full blocks wins (the latest turn of a
    conversation: turn 3 also starts with turn 1's blocks), then the most recent.
    """
    by_last: dict[int, list[int]] = {}  # id of a request's last full block -> those requests
    out: dict[int, int] = {}
    for b in reqs:
        ids = b.hash_ids
        for k in range(len(ids), 0, -1):
            found = None
            for j in reversed(by_last.get(ids[k - 1], ())):
                a = reqs[j]
                if (
                    a.full_blocks(block_tokens) == k
                    and a.hash_ids[:k] == ids[:k]
                    and b.input_length >= a.input_length + a.output_length
                ):
                    found = j
                    break
            if found is not None:
                out[b.index] = found
                break
        nf = b.full_blocks(block_tokens)
        if nf:
            by_last.setdefault(ids[nf - 1], []).append(b.index)
    return out


class TokenSynth:
    """Tokens for a trace's prompts (module doc). ``vocab``: tokens are in ``[0, vocab)``."""

    def __init__(self, block_tokens: int, vocab: int, seed: str = "s3kv-trace"):
        if vocab < 2 or vocab > 1 << 16:
            raise ValueError("vocab must be in [2, 65536]")
        self.block_tokens = block_tokens
        self.vocab = vocab
        self._seed = seed.encode()
        #: Blocks whose tokens are bound to a history (hash id -> its first tokens).
        self._bound: dict[int, tuple[int, ...]] = {}
        self._seen: set[int] = set()

    def synth(self, hash_id: int) -> list[int]:
        """The fixed pseudo-random tokens of a block nobody bound to a history."""
        raw = hashlib.shake_128(self._seed + b"/%d" % hash_id).digest(2 * self.block_tokens)
        v = self.vocab
        if v == 1 << 16:
            return array("H", raw).tolist()
        return [x % v for x in array("H", raw)]

    def block(self, hash_id: int) -> list[int]:
        bound = self._bound.get(hash_id)
        if bound is None:
            return self.synth(hash_id)
        if len(bound) == self.block_tokens:
            return list(bound)
        return list(bound) + self.synth(hash_id)[len(bound) :]

    def prompt(self, req: TraceRequest, history: Sequence[int] = (), history_from: int = 0) -> list[int]:
        """``req``'s prompt. ``history``: the tokens a continued request left at positions
        ``history_from, history_from + 1, ...`` (its prompt's tail and its answer); they fill
        the blocks no earlier request has named, and bind those blocks' ids to them."""
        bt = self.block_tokens
        n = req.input_length
        out: list[int] = []
        hist_end = history_from + len(history)
        for k, hid in enumerate(req.hash_ids):
            start = k * bt
            size = min(bt, n - start)
            if hid not in self._seen and start < hist_end and start + size > history_from:
                # A new block that overlaps the history: the history's tokens, then this request's own.
                own = self.synth(hid)
                toks = [
                    history[p - history_from] if history_from <= p < hist_end else own[p - start]
                    for p in range(start, start + size)
                ]
                self._bound[hid] = tuple(toks)
            else:
                toks = self.block(hid)[:size]
            self._seen.add(hid)
            out.extend(toks)
        return out


def trace_reuse_tokens(reqs: Iterable[TraceRequest], block_tokens: int) -> list[int]:
    """Per request: prompt tokens in hash blocks an earlier request of the trace already had
    (its own reuse figure, independent of any replay), capped one token short of the prompt."""
    seen: set[int] = set()
    out = []
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        out.append(min(k * block_tokens, r.input_length - 1))
        seen.update(r.hash_ids)
    return out


def duration_hours(reqs: Sequence[TraceRequest]) -> float:
    """Wall-clock span of the trace, first to last arrival."""
    ts = [r.timestamp_ms for r in reqs]
    return (max(ts) - min(ts)) / 3.6e6
