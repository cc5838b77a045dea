"""A family of request traces in the Mooncake format, generated from a seed: many workloads, not one.

``s3kv bench gen-trace --workload NAME --requests N --seed S -o FILE`` writes one; the same
(name, N, seed) gives the same file on every machine (``random.Random(seed)``, no other source).
Each line is what ``tracefile.read_trace`` reads: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one per 512-token block).

**How a prompt becomes hash ids.** A prompt is a list of *segments* -- a system prompt, a
document, a pasted text, a user message, an earlier answer, a tool's output -- each with an
identity and a length. A block's id is interned from (the previous block's id, the segment
pieces the block's 512 tokens cover), so equal ids mean an equal block *and* an equal prefix,
as in the Mooncake release; a prompt that starts with another's segments shares its full blocks
and no more. A next turn re-sends the session's history (every earlier message and answer, in
order) and adds one message, so ``find_continuations`` finds it exactly as it finds a real one:
its ids start with the previous turn's full blocks and it is at least that prompt plus its answer
long.

**Sessions.** Sessions start as a Poisson process; each has a number of turns (1 + geometric),
separated by think times (log-normal, capped); every turn's prompt is the session's prefix
(system prompt, documents, a pasted text) then its history. Requests are written in arrival
order; the first N arrivals are kept (a session that started is never cut before a request
that arrives earlier than the last one kept).

**The presets** (:data:`PRESETS`) span the two figures that decide a cache's worth -- the share
of distinct prefix blocks ever re-read and the gap between reuses (``tracestats.describe``) --
from mostly-unique traffic to agents re-reading long contexts within seconds, and returning
users an hour later. **``fewshot-batch`` is held out**: a different shape (bursts of batch jobs
over shared few-shot templates) that no default, threshold or policy is tuned on; it exists to
check that what was tuned on the others carries. Tune on it and it stops meaning anything.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tracefile import MOONCAKE_BLOCK_TOKENS, TraceRequest

#: A segment: (identity, tokens). Identities are tuples; equal identity, equal tokens.
Segment = tuple[tuple[Any, ...], int]


@dataclass(frozen=True)
class LogNormal:
    """A positive quantity: median and spread (sigma of its log), clamped to [lo, hi]."""

    median: float
    sigma: float = 0.6
    lo: float = 1.0
    hi: float = math.inf

    def draw(self, rng: random.Random) -> float:
        x = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(self.hi, max(self.lo, x))

    def tokens(self, rng: random.Random) -> int:
        return max(1, int(self.draw(rng)))


@dataclass(frozen=True)
class Pool:
    """Shared content: ``size`` items (system prompts, documents, templates) of ``length`` tokens,
    picked with Zipf popularity ``zipf`` (0: uniform). ``size`` 0: none."""

    size: int = 0
    length: LogNormal = LogNormal(1000)
    zipf: float = 1.0

    def weights(self) -> list[float]:
        return [1.0 / (k + 1) ** self.zipf for k in range(self.size)]


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    #: New sessions per minute (Poisson).
    sessions_per_min: float
    #: Mean turns per session (1 + geometric).
    mean_turns: float
    #: Seconds between a turn's arrival and the next one's (think time, tool time, a user's return).
    think_s: LogNormal
    #: Each turn's new message (a user's message, or a tool's output in a loop).
    message: LogNormal
    #: Answer lengths.
    answer: LogNormal
    system: Pool = field(default_factory=Pool)
    documents: Pool = field(default_factory=Pool)
    #: Documents per session, drawn without repeats (0: none).
    docs_per_session: tuple[int, int] = (0, 0)
    #: A text the user pastes into the first message, unique to the session (0: none).
    pasted: LogNormal | None = None
    #: A session stops growing past this many prompt tokens (a context limit).
    max_context: int = 131_072
    #: Bursts: sessions arrive in jobs of this many at once, every ``burst_every_s`` (0: no bursts).
    burst: tuple[int, int] = (0, 0)
    burst_every_s: float = 0.0
    #: Seconds a burst's sessions spread over.
    burst_spread_s: float = 30.0
    held_out: bool = False

    def at_load(self, load: float) -> Workload:
        """The same workload with sessions (or bursts) arriving ``load`` times as often. Why a knob:
        what S3 adds depends on how fast the traffic turns a device cache over (a 600-request
        preset spans 9-51 minutes; the issue's production trace ran 3,000 requests in 16), and the
        seed's draws stay the same (the name seeds them), so only the clock is denser."""
        if load == 1:
            return self
        return dataclasses.replace(self, sessions_per_min=self.sessions_per_min * load,
                                   burst_every_s=self.burst_every_s / load)


PRESETS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "chat",
            "multi-turn conversations over a few shared system prompts, pasted texts, think times of minutes",
            sessions_per_min=18,
            mean_turns=2.6,
            think_s=LogNormal(75, 0.9, 5, 1800),
            message=LogNormal(220, 1.0, 8, 6000),
            answer=LogNormal(350, 0.7, 8, 4000),
            system=Pool(6, LogNormal(1400, 0.4, 200, 4000), 1.2),
            pasted=LogNormal(2500, 1.2, 64, 40000),
        ),
        Workload(
            "agentic",
            "tool-call loops: long shared instructions, many quick turns that append tool output (seconds apart)",
            sessions_per_min=9,
            mean_turns=5,
            think_s=LogNormal(6, 0.8, 1, 120),
            message=LogNormal(900, 1.0, 32, 12000),
            answer=LogNormal(150, 0.6, 16, 1500),
            system=Pool(3, LogNormal(6000, 0.3, 2000, 12000), 1.0),
            documents=Pool(40, LogNormal(3000, 0.6, 300, 16000), 1.1),
            docs_per_session=(0, 1),
            max_context=49_152,
        ),
        Workload(
            "rag",
            "retrieval over a shared corpus: a system prompt, 1-3 popular documents, one question (mostly single turn)",
            sessions_per_min=55,
            mean_turns=1.25,
            think_s=LogNormal(40, 0.8, 3, 900),
            message=LogNormal(60, 0.8, 8, 1000),
            answer=LogNormal(250, 0.6, 16, 2000),
            system=Pool(4, LogNormal(800, 0.3, 100, 2000), 1.0),
            documents=Pool(400, LogNormal(2600, 0.7, 256, 20000), 0.9),
            docs_per_session=(1, 3),
        ),
        Workload(
            "returning",
            "long-gap returning users: few turns, each after 10-60 minutes, over long pasted contexts",
            sessions_per_min=9,
            mean_turns=2.2,
            think_s=LogNormal(1500, 0.5, 300, 3600),
            message=LogNormal(300, 1.0, 8, 4000),
            answer=LogNormal(400, 0.6, 16, 3000),
            system=Pool(2, LogNormal(1000, 0.3, 200, 2000), 1.0),
            pasted=LogNormal(6000, 0.9, 256, 60000),
        ),
        Workload(
            "unique",
            "mostly unique prompts: one-shot requests with long distinct inputs, a short shared preamble at most",
            sessions_per_min=60,
            mean_turns=1.15,
            think_s=LogNormal(60, 0.8, 5, 600),
            message=LogNormal(200, 0.8, 8, 2000),
            answer=LogNormal(200, 0.8, 4, 3000),
            system=Pool(20, LogNormal(700, 0.4, 64, 1500), 1.0),
            pasted=LogNormal(5000, 1.0, 128, 60000),
        ),
        Workload(
            "fewshot-batch",
            "HELD OUT (never tune on it): batch jobs every ~10 min, each a burst of requests over one of a few "
            "long few-shot templates with short distinct inputs and answers",
            sessions_per_min=0,
            mean_turns=1.0,
            think_s=LogNormal(10, 0.5, 1, 60),
            message=LogNormal(500, 0.8, 16, 4000),
            answer=LogNormal(12, 1.0, 1, 256),
            system=Pool(24, LogNormal(7000, 0.5, 1500, 24000), 1.3),
            burst=(40, 120),
            burst_every_s=600,
            burst_spread_s=45,
            held_out=True,
        ),
    )
}


class _Ids:
    """Hash ids interned from (previous id, block content): equal prefix and block, equal id."""

    def __init__(self, block_tokens: int):
        self.bt = block_tokens
        self._ids: dict[tuple[Any, ...], int] = {}

    def of(self, segments: list[Segment], total: int) -> list[int]:
        out: list[int] = []
        prev = -1
        block: list[tuple[Any, ...]] = []
        pos = 0  # tokens placed in the current block
        for ident, n in segments:
            off = 0
            while off < n:
                take = min(n - off, self.bt - pos)
                block.append((ident, off, take))
                off += take
                pos += take
                if pos == self.bt:
                    prev = self._intern(prev, block)
                    out.append(prev)
                    block, pos = [], 0
        if block:
            out.append(self._intern(prev, block))
        assert len(out) == -(-total // self.bt)
        return out

    def _intern(self, prev: int, block: list[tuple[Any, ...]]) -> int:
        key = (prev, tuple(block))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def _pick(rng: random.Random, pool: Pool, weights: list[float], k: int) -> list[int]:
    """``k`` distinct items of ``pool`` by popularity."""
    k = min(k, pool.size)
    out: list[int] = []
    while len(out) < k:
        i = rng.choices(range(pool.size), weights)[0]
        if i not in out:
            out.append(i)
    return out


def _session_starts(w: Workload, rng: random.Random) -> Iterator[float]:
    """Session start times (s), increasing."""
    t = 0.0
    if w.burst_every_s > 0:
        while True:
            n = rng.randint(*w.burst)
            yield from sorted(t + rng.uniform(0, w.burst_spread_s) for _ in range(n))
            t += w.burst_every_s * rng.uniform(0.6, 1.4)
    while True:
        t += rng.expovariate(w.sessions_per_min / 60)
        yield t


def generate(w: Workload, requests: int, seed: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """The first ``requests`` arrivals of workload ``w`` (module doc)."""
    return [r for r, _ in generate_sessions(w, requests, seed, block_tokens)]


def generate_sessions(
    w: Workload, requests: int, seed: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[tuple[TraceRequest, tuple[int, int]]]:
    """:func:`generate`, each request with its (session, turn): what the file does not say."""
    if requests < 1:
        raise ValueError(f"--requests must be >= 1, got {requests}")
    rng = random.Random(f"s3kv-gentrace/{w.name}/{seed}")
    ids = _Ids(block_tokens)
    sys_lens = [w.system.length.tokens(rng) for _ in range(w.system.size)]
    doc_lens = [w.documents.length.tokens(rng) for _ in range(w.documents.size)]
    sys_w, doc_w = w.system.weights(), w.documents.weights()
    rows: list[tuple[float, int, int, list[int], tuple[int, int]]] = []
    times: list[float] = []  # arrivals so far, sorted
    p_more = 1.0 - 1.0 / max(1.0, w.mean_turns)  # geometric: P(another turn)
    for sid, start in enumerate(_session_starts(w, rng)):
        if len(times) >= requests and start > times[requests - 1]:
            break  # every later session starts after the N-th arrival: the first N are final
        prefix: list[Segment] = []
        if w.system.size:
            s = _pick(rng, w.system, sys_w, 1)[0]
            prefix.append((("sys", s), sys_lens[s]))
        if w.documents.size and w.docs_per_session[1]:
            for d in _pick(rng, w.documents, doc_w, rng.randint(*w.docs_per_session)):
                prefix.append((("doc", d), doc_lens[d]))
        if w.pasted is not None:
            prefix.append((("paste", sid), w.pasted.tokens(rng)))
        history: list[Segment] = []
        t = start
        turn = 0
        while True:
            msg: Segment = (("msg", sid, turn), w.message.tokens(rng))
            segs = prefix + history + [msg]
            n_in = sum(n for _, n in segs)
            if n_in > w.max_context and turn:
                break
            n_out = w.answer.tokens(rng)
            rows.append((t, n_in, n_out, ids.of(segs, n_in), (sid, turn)))
            bisect.insort(times, t)
            history += [msg, (("ans", sid, turn), n_out)]
            turn += 1
            if rng.random() >= p_more:
                break
            t += w.think_s.draw(rng)
    rows.sort(key=lambda r: r[0])
    rows = rows[:requests]
    return [
        (TraceRequest(i, round(t * 1000, 3), n_in, n_out, tuple(h)), st)
        for i, (t, n_in, n_out, h, st) in enumerate(rows)
    ]


def write_trace(reqs: list[TraceRequest], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for r in reqs:
            f.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp_ms,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )
