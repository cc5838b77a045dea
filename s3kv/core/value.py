"""The value policy: which objects are worth writing to S3, learnt from what the fleet reads. Pure.

**What a written object earns.** A hit on top of a device match ``d`` up to a history ``h`` saves
the prefill of tokens ``[d, h)`` (``s3kv.core.cost.Prefill``: the one prefill figure, priced per
GPU-hour). A hit needs a *boundary*: a sliding-window tail ending at ``h`` (or, for a model
without sliding layers, a full-attention object ending there) **and** the full-attention chain
below it. So what is decided is a request's set of boundaries, each of a *kind* -- ``checkpoint``
(every ``checkpoint_tokens``), ``prompt-end``, ``history-end`` (past the prompt: a conversation's
next turn), ``branch`` (a shared prefix) -- and the chain up to the furthest one: a tail is useless
without its chain, and chain objects already stored (or paid for by a lower boundary) cost nothing
more; nor does a read of a boundary add what the store already serves: where the lookup found a
tail on this prompt (a conversation's last turn), a later reader going past it hits there anyway,
and a read of a higher boundary adds only the prefill above it. (Credited with all of ``[d, h)``,
every next turn wrote its tails however few tokens it added: on a 3,000-request conversation
trace, one engine, 2,713 history-end tails; 2,327 with this rule, at 99.5% of the tokens.) A
chain object may also serve many tails of *later* requests: where a prompt shares a prefix with
this one, the next such request finds the chain stored and writes a branch tail that
the ones after it read. That option is a ``chain`` boundary at the prompt's end, with no tail of
its own, read when a branch tail is: a prompt's chain is written when the branch reads it enables
pay for it, even where its own tails do not. Each boundary is expected to earn ``reads per write (kind) x prefill $ of the marginal
tokens a read serves`` less what its reads cost (GETs), against what writing it costs: PUT-class
requests at its real size (multipart included) and storage for its expected life (gc's cutoff).
:meth:`ValueModel.plan` picks the set with the largest expected net value: the top boundary ``T``
maximising ``sum(net of each boundary <= T worth its own tail) + net(T) - chain cost up to T``.

**What is learnt, and how fast.** Per kind, three figures, estimated online from what this engine
sees -- which kind of object ended each of its hits, at what depth, on top of what device match:

* *reads per write*: hits a kind ended over tails of that kind written. In a fleet of symmetric
  engines, one engine's reads over its writes estimate the fleet's: it reads everyone's objects
  (its share of the fleet's reads) and writes its share of the objects. A hit on an object this
  engine wrote is attributed exactly (a bounded memo of its own boundaries). One on another
  engine's object is attributed by what the reader sees of it: a checkpoint by its end; a hit
  that reaches the reader's own prompt end is an exact repeat (a prompt-end tail) or a next turn
  whose new tokens stayed in the block its history ended in (a history-end tail), so it is split
  over prompt-end, history-end and branch; any other (the reader goes on past it: a next turn, a
  shared prefix) is split between history-end and branch -- each split in the proportions of
  this engine's own attributed reads. (Crediting prompt-end alone at the prompt end, a 4-engine
  rag replay counted 17 prompt-end reads where 3 were, and wrote prompt-end tails at 2% reads.)
  Behind a random router most reads are of other engines' objects, so this
  rule, not the memo, decides what the fleet learns: a split over every kind wrongly credited
  prompt-end tails with next turns' reads (on a 4-engine chat replay both kinds looked equally
  read, 0.37 reads per write, while next turns read history-end tails and prompt-end tails
  served ~0.5% of the tokens).
* reads of objects **S3 holds** count, whichever tier served them: the host tier answers first,
  and its hit of an object S3 holds is a read S3 serves without it. Left out, they made an engine
  whose router sends it a prefix's repeats (served by its own tier) judge those boundaries unread
  and stop writing them to S3, and the engine the router later sent the prefix to missed: the
  public trace served fewer tokens with host tiers than without (issue 39). A hit only the host
  tier could serve (an object kept from S3) is no read of S3's: counted apart (``host_reads``).
* *marginal share*: of the history a hit reaches, the share beyond the device match -- the
  tokens S3 adds. Behind a cache-aware router or a host tier the device serves most of a repeat
  and S3's reads fall, or serve little: both lower a kind's worth, so S3 writes less there.
* *S3's share of reuse*: a later request of this engine whose **device** matched past one of its
  own boundaries (and S3 served nothing beyond) reused that boundary without S3 (TensorRT-LLM asks
  a connector only past its device match). Of a kind's reuses, S3 served ``(S3 reads + 4) /
  (S3 reads + device reuses + 4)`` over the fleet, and of a depth bin's likewise: four reads of
  prior, the weight of the reads-per-write prior's. A device reuse is counted as its boundary's
  write is (by the write's age, the lag correction: the device reuses a boundary seconds after its
  write, S3 reads it minutes later). The prior's pseudo-reads count as S3 reads in that share
  only; the reads S3 served stay what they are. Why: the prior is what kept a kind nobody reads
  from S3 written until its unread writes outweighed it -- on one engine with a device cache (the
  default ``bench trace`` fleet) the 600-request agentic and few-shot traces spent $0.010-0.014
  for no token S3 served -- while the device's reuses say within a few requests that S3 would
  not serve them. One read of prior (or a bin's share shrunk towards its kind's) cut the prior of
  deep checkpoints a few device reuses had seen, and the public trace behind 4 affinity engines
  lost 11% of what S3 saved (docs/trace-replay.md, "Reuses the device served").
* *reuse lag*: requests between a write and the hit that reads it (own objects). Reads of a write
  come later, so writes too young to have been read yet are counted as the share of their reads
  that had time to come (the lag's distribution): a fresh engine, or a kind just admitted, is not
  judged before its readers could arrive.

**By depth.** Reads per write are also learnt per *depth bin* of a kind (the boundary's history,
in powers of two of :data:`DEPTH_BASE` tokens), each bin's estimate shrunk towards its kind's by
as many pseudo-reads as the kind's own prior has (two), at the kind's rate: a bin with no evidence
says what its kind says, and falls below it as fast as a kind falls below its prior -- one of a
rarely read kind at once, one of a kind read at 20% only after about ten unread writes. A
weaker pull (one pseudo-write) refused bins of conversations' history-end tails on their first
unlucky writes, before their readers came: 8% of a trace's tokens lost. Why: a
read's worth grows with its depth, so a kind read at 1% whose reads all come at shallow depths
(shared system prompts and documents are short; deep prefixes are one conversation's own) looked
worth writing at every deep boundary: on a 3,000-request conversation trace 1,328 checkpoint tails
at 16k+ tokens were written for 3 reads (~0.6 TB, 12% of the bytes it stored). The depth is what writer
and reader both know exactly (the boundary's end), so another engine's object is binned as
precisely as one's own.

Counts decay with a half-life of :data:`HALF_LIFE_S` seconds, so the estimate follows traffic
that changes. The clock is the caller's (``advance_to``; the leader feeds it the engine's
monotonic time, a trace replay the trace's): seconds, not requests -- an engine of a fleet sees
only its share of the requests, so a lag or a half-life counted in its own requests stretches with
the fleet's size (4 engines replaying 600 requests saw 150 each: too few to judge anything
against a lag prior of up to 511 requests, and the policy wrote nearly everything).

**Priors** (what is assumed before anything is seen; the data outweighs them after a few dozen
writes): reads per write 1/2 (an object's first read is a coin flip: Beta(1, 1)'s mean) worth
:data:`PRIOR_WRITES` writes; the whole history marginal (a fresh engine, no device match) worth
two reads; reuse lag log-uniform over 1 s - 34 min (a retry seconds later to a think time of
minutes; the retention ends every lag at an hour), worth one read -- light on purpose: the lag
is learnt from reads of this engine's own objects, which are few in a fleet (most reads are of
other engines' objects), and a prior lag longer than the real one over-counts young writes'
missing reads and overstates every kind's worth. None is taken from a trace.

What the prior costs, and why it stays (measured 2026-12-05, docs/trace-replay.md "Spending
less where S3 adds little: what was tried"): counts decay, so the evidence against a kind nobody
reads is bounded by its last half-hour or so of writes, while the prior's two pseudo-reads are
not; a long prompt's boundary pays back at one read in ~100, so a never-read kind is written
until ~2 x (value / bill) of its writes matured unread -- the spend on one engine whose device
serves the repeats. Writes mature fast (a dense trace matures dozens within 20 s), so the
binding term is the prior, not the lag. A prior pooled over the kinds (empirical Bayes) cut that
spend 44-74%, but it collapses before any read could come and refuses a kind read at one in 25
on its first unlucky writes, never relearnt at the exploration share: half the public trace's
tokens lost; exploring a refused kind by its chance of paying (its Gamma posterior), or by how
little evidence it has, won back part of them at a higher bill. Dating other engines' reads by
the fleet index's write times (a learnt fleet lag) moved ratios by -8% to +33%, either way.

**Once the engine has watched an object's life, a scale-free prior.** The coin-flip prior is an
exploration bonus while an engine is young: a kind read at 2-4% whose reads come minutes after its
writes is carried through its first unread writes (a scale-free prior from the first request lost
6-45% of the public trace's S3 tokens: docs/trace-replay.md, "A scale-free prior on reads per
write"). Later it is a leak: a never-read kind goes on being written at ~2 x (value / bill)
matured writes a half-life. So as the engine's watched time grows to the longest life an object
may have (the ceiling's, ``Bill.lifetime_s``), a kind's rate moves, in proportion, to the smaller
of the coin flip's and the posterior mean under a prior of density 1/rate on
[:data:`RATE_FLOOR`, inf): the rate unknown within orders of magnitude. Then r reads in n matured
writes say about r/n, and none about 1/(n ln(1000/n)) -- 0.012 after 25, 0.005 after 100, where
the coin flip says 0.069 and 0.019 -- so a kind nobody reads whose read pays ~100x its bill stops
at a few dozen unread writes, not ~200. Depth bins shrink towards the kind's rate as before.

**Pooled over the fleet** (:meth:`ValueModel.evidence`, :meth:`ValueModel.pool`). Reads per write
are one fleet-wide rate, so each engine adds what the others learnt to its own counts: engines
report their evidence (decayed reads and matured writes per kind and depth bin) beside their dated
reads, gc sums the newest report of each engine into the fleet index, and each engine adds that
sum less its own report. Why: the prior's two pseudo-reads are outweighed after a number of unread
writes that every engine had to make on its own -- behind a random router, four engines each wrote
~80 checkpoint tails nobody read before any refused them (a 600-request replay's 335, for 0 reads);
pooled, the fleet makes that number of writes once. One engine alone learns as before (its own
report is all the sum holds), and without a fleet index that learns, nothing is pooled.

**Exploration.** A refused kind is never read, so nothing would tell the policy it became worth
writing. A deterministic :data:`EXPLORE_SHARE` of the boundaries it refuses is written anyway,
chosen by the boundary's chain digest: every rank and every engine picks the same ones (the fleet
writes each explored object once, not once per engine), and their reads keep the estimate alive.

Why this is one module: the estimator, the bill it weighs each object against and the plan that
picks a request's boundaries share one model of what an object earns; split apart, each half
would restate it.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cost import (
    MULTIPART_THRESHOLD,
    PART_SIZE,
    RANGE_SPLIT,
    Prefill,
    Prices,
    expiry_age_s,
    get_requests,
    put_requests,
)
from .retention import lag_bin_edge

CHAIN = "chain"
CHECKPOINT, PROMPT_END, HISTORY_END, BRANCH = "checkpoint", "prompt-end", "history-end", "branch"
#: Every kind, in the order ``bench trace`` and ``s3kv stats`` list them.
KINDS = (CHAIN, CHECKPOINT, PROMPT_END, HISTORY_END, BRANCH)
#: The evidence name of what reads paid against what was stored (:meth:`ValueModel.evidence`): [prefill
#: $ the engine's S3 reads saved, in byte-seconds of storage it buys; bytes it wrote, each counted
#: as the share of its reads that had time to come], both decayed.
#: Summed over the fleet, their ratio is how many seconds keeping everything written is paid for
#: by the reads, which gc weighs the retention against (``core.retention``, what the reads pay for).
KEEP = "keep"
#: Tails a reader that goes on past them cannot tell apart when another engine wrote them.
_AMBIGUOUS = (HISTORY_END, BRANCH)
#: The hint for a hit of another engine's tail that reached the reader's own prompt end (in its last
#: block): an exact repeat reads a prompt-end tail there, but so does a next turn whose new tokens
#: stay inside the block the previous history ended in (a history-end tail), or a prompt that
#: ends just past a shared part (a branch tail). The key does not tell which.
AT_PROMPT_END = "at-prompt-end"
_AT_PROMPT_END_KINDS = (PROMPT_END, HISTORY_END, BRANCH)

#: Half-life of everything learnt, in seconds of the model's clock. Long enough to hold the reuse
#: lag of most reads (think times of minutes), short enough to follow a change of traffic within
#: an hour (the retention: what no read outlives).
HALF_LIFE_S = 1800.0
#: How often an engine renews the evidence it shares with the fleet (:meth:`ValueModel.pool`);
#: its read reports go every minute.
SHARE_EVERY_S = 10.0
#: Share of refused boundaries written anyway (module doc, exploration).
EXPLORE_SHARE = 1 / 32
#: Prior strength (module doc, priors).
PRIOR_READS_PER_WRITE = 0.5
PRIOR_WRITES = 4.0
PRIOR_MARGINAL_TOKENS = 2 * 8192.0
#: S3 reads of prior in S3's share of a kind's reuses (module doc, "S3's share of reuse").
PRIOR_S3_READS = PRIOR_WRITES
#: The evidence name of a kind's reuses the device served (``DEVICE + kind``: [0, matured reuses]).
DEVICE = "device:"
#: Writes are binned by this many seconds for the lag correction (recomputed once per bin).
_EPOCH = 16
#: Reuse-lag histogram: bin b holds lags in [2^b - 1, 2^(b+1) - 1) seconds.
LAG_BINS = 22
_PRIOR_LAG_BINS = range(1, 11)  # 1 s - 34 min
_PRIOR_LAG_WEIGHT = 1.0
#: Own boundaries remembered (digest -> kind, write time, depth bin), for exact attribution of their reads.
MEMO_ENTRIES = 200_000
#: Depth bins of a boundary (module doc, "by depth"): bin d holds boundaries of [2^d, 2^(d+1)) x
#: ``DEPTH_BASE`` tokens of history (bin 0 anything shorter, the last one anything longer).
DEPTH_BASE = 1024
DEPTH_BINS = 8


#: gc's ``--watch`` period the docs run (``s3kv gc --expired --watch 10m``): an expired object
#: outlives its cutoff by half of it on average, unless the fleet index's publisher deletes it
#: sooner (``engine.fleetindex``, expiring in each pass).
GC_WATCH_S = 600.0


@dataclass(frozen=True)
class Bill:
    """What writing and reading an object costs, at its real size (``s3kv.core.cost``'s rules)."""

    prices: Prices = field(default_factory=Prices)
    #: Seconds an object is billed: from its write until gc deletes it (gc's cutoff, plus half a gc
    #: period on average).
    lifetime_s: float = 3600.0
    multipart_threshold: int = MULTIPART_THRESHOLD
    part_size: int = PART_SIZE
    range_split: int = RANGE_SPLIT

    @classmethod
    def from_settings(cls, settings: Any, gc_period_s: float = GC_WATCH_S) -> Bill:
        return cls(
            Prices.from_settings(settings),
            expiry_age_s(settings) + gc_period_s / 2,
            settings.multipart_threshold_mib << 20,
            settings.multipart_part_mib << 20,
            settings.range_split_mib << 20,
        )

    def put_usd(self, nbytes: int) -> float:
        return put_requests(nbytes, self.multipart_threshold, self.part_size) * self.prices.put_per_1k / 1000

    def puts_usd(self, n: int) -> float:
        """``n`` PUT requests (the objects a split adds: their bytes are billed either way)."""
        return n * self.prices.put_per_1k / 1000

    def storage_usd(self, nbytes: int) -> float:
        return nbytes * self.prices.usd_per_byte_s * self.lifetime_s

    def write_usd(self, sizes: Iterable[int]) -> float:
        return sum(self.put_usd(n) + self.storage_usd(n) for n in sizes)

    def get_usd(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return get_requests(int(nbytes), self.range_split) * self.prices.get_per_1k / 1000


@dataclass(frozen=True)
class Boundary:
    """A point a request could make servable: ``tokens`` of history, named by ``digest`` (the chain
    digest of its last block).

    ``tail``: the real sizes of the objects a hit there needs beyond the chain (every sliding
    group and shard; none for a model without sliding layers). ``chain``: the sizes of the chain
    objects this request still has to write *between the boundary below it and this one* (those
    already stored, or paid for by a lower boundary, are not here). ``chain_bytes_per_token``:
    what a hit reads of the chain per token it serves (GETs).
    """

    kind: str
    tokens: int
    digest: bytes
    tail: tuple[int, ...] = ()
    chain: tuple[int, ...] = ()
    chain_bytes_per_token: float = 0.0
    #: Full-attention objects the chain is split into at this end only for this boundary: one per
    #: group and shard where the end is no object end of its own (``chain`` counts them as if
    #: every boundary were written; :meth:`ValueModel.plan` charges each to its boundary).
    splits: int = 0
    #: Tokens of the deepest boundary the store already holds on this prompt below this one (the
    #: lookup found a tail there): a later reader that goes past it hits there without this one.
    stored_below: int = 0


@dataclass(frozen=True)
class Plan:
    """What a request writes: ``decisions[(kind, tokens)]`` is ``"write"``, ``"explore"`` (refused,
    written to learn) or ``"refuse"``; the chain is written up to ``chain_to`` tokens (None: all of
    it, prompt and answer -- a history-end tail needs the whole history)."""

    decisions: dict[tuple[str, int], str]
    chain_to: int | None
    #: The decision for a boundary the plan did not list.
    default: str = "refuse"

    def writes(self, kind: str, tokens: int) -> bool:
        return self.decisions.get((kind, tokens), self.default) != "refuse"


#: Every boundary and the whole chain (what s3kv wrote before the value policy).
WRITE_ALL = Plan({}, None, "write")


def explored(digest: bytes, kind: str, share: float = EXPLORE_SHARE) -> bool:
    """Is this refused boundary written anyway? The same answer on every rank and engine."""
    h = hashlib.blake2b(digest + kind.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < share * 2**64


class _Decayed:
    """A sum that halves every ``half_life`` clock units (read and added lazily)."""

    __slots__ = ("at", "v")

    def __init__(self) -> None:
        self.v = 0.0
        self.at = 0.0

    def get(self, now: float, half_life: float) -> float:
        if now != self.at:
            self.v *= 0.5 ** ((now - self.at) / half_life)
            self.at = now
        return self.v

    def add(self, x: float, now: float, half_life: float) -> None:
        self.v = self.get(now, half_life) + x


@dataclass
class KindTotals:
    """The value line of one kind, cumulative since start: what it cost and what it saved."""

    objects: int = 0
    bytes: int = 0
    put_usd: float = 0.0
    storage_usd: float = 0.0
    reads: int = 0
    tokens: int = 0
    gpu_usd: float = 0.0
    get_usd: float = 0.0
    host_reads: int = 0  # hits only the host tier could serve (objects kept from S3: not reads)
    device_reads: int = 0  # own boundaries a later request reused from the device (``device_read``)
    written: int = 0  # boundaries decided "write"
    explored: int = 0  # boundaries decided "explore"
    refused: int = 0  # boundaries decided "refuse"

    @property
    def s3_usd(self) -> float:
        return self.put_usd + self.storage_usd + self.get_usd


class ValueModel:
    """The estimator (module doc). Fed by the leader: :meth:`advance_to` its clock (seconds),
    :meth:`wrote` per object written, :meth:`read` per hit of an S3 object (:meth:`host_read`
    per one only the host tier could serve); :meth:`plan` decides a request's boundaries. Not
    thread-safe (the leader calls it under its lock)."""

    def __init__(
        self,
        prefill: Prefill,
        bill: Bill,
        *,
        half_life: float = HALF_LIFE_S,
        explore_share: float = EXPLORE_SHARE,
        min_return: float = 1.0,
    ):
        self.prefill, self.bill = prefill, bill
        self.half_life, self.explore_share, self.min_return = half_life, explore_share, min_return
        self.clock = 0.0
        self.totals = {k: KindTotals() for k in KINDS}
        self._reads = {k: _Decayed() for k in KINDS}
        self._depth = {k: _Decayed() for k in KINDS}  # tokens of history the reads reached
        self._marginal = {k: _Decayed() for k in KINDS}  # of those, beyond the device match
        self._own_reads = {k: _Decayed() for k in KINDS}  # reads attributed through the memo
        self._lag = [_Decayed() for _ in range(LAG_BINS)]
        self._paid = _Decayed()  # prefill $ this engine's S3 reads saved (KEEP)
        self._since: float | None = None  # the clock's first reading
        self._watch_s = bill.lifetime_s  # the longest life an object may have: the ceiling's (KEEP)
        #: Reads by lag bin since start (not decayed): own objects' by the memo, others' as the fleet
        #: index dates them, and ghost reads (:meth:`ghost`). What the engine reports for gc to
        #: learn the retention from (``core.retention``).
        self.lag_reads = [0.0] * LAG_BINS
        #: Ghost reads counted (:meth:`ghost`).
        self.ghosts = 0
        #: Per kind: [epoch start, writes] bins, oldest first (for the lag-corrected write count).
        #: Per kind, and per (kind, depth bin) where the write's depth is known.
        self._epochs: dict[str | tuple[str, int], deque[list[float]]] = {k: deque() for k in KINDS}
        self._matured: dict[str | tuple[str, int], float] = {}
        self._matured_at = -1.0
        #: Reads per (kind, depth bin) -- the binned half of ``_reads``.
        self._reads_at: dict[tuple[str, int], _Decayed] = {}
        self._memo: OrderedDict[bytes, tuple[str, float, int | None]] = OrderedDict()
        #: The other engines' evidence (:meth:`pool`): key -> (reads, matured writes), as of ``_others_at``.
        self._others: dict[str, tuple[float, float]] = {}
        self._others_at = 0.0
        #: This engine's evidence as the fleet's read reports take it (:meth:`pool`); None: none yet.
        self.shared: dict[str, list[float]] | None = None
        self._shared_at = 0.0

    # ------------------------------------------------------------------ feeding
    def tick(self, n: float = 1) -> None:
        """The clock moves ``n`` on."""
        self.clock += n

    def advance_to(self, now: float) -> None:
        """The clock reads ``now`` (seconds; it never goes back)."""
        self.clock = max(self.clock, float(now))
        if self._since is None:
            self._since = self.clock

    def host_read(self, kind: str | None = None) -> None:
        """A hit only this engine's host tier could serve: no S3 read (module doc), counted apart."""
        self.totals[kind if kind in self.totals else HISTORY_END].host_reads += 1

    def wrote(self, kind: str, sizes: Sequence[int], digest: bytes | None = None, tokens: int | None = None) -> None:
        """Objects of ``kind`` went to S3 (``sizes``: each one's real bytes). ``digest``: the
        boundary they make servable (remembered, so a hit on it is attributed exactly); a
        boundary's objects are counted as one write of its kind. ``tokens``: its depth (the history
        it serves), learnt by (module doc, "by depth"); None: counted for its kind only."""
        t = self.totals[kind]
        t.objects += len(sizes)
        t.bytes += sum(sizes)
        t.put_usd += sum(self.bill.put_usd(n) for n in sizes)
        t.storage_usd += sum(self.bill.storage_usd(n) for n in sizes)
        self._count(KEEP, sum(sizes))  # bytes, as old as their reads could be (KEEP)
        if digest is None:
            return
        self.count_write(kind, tokens)
        self._memo[digest] = (kind, self.clock, None if tokens is None else depth_bin(tokens))
        self._memo.move_to_end(digest)
        while len(self._memo) > MEMO_ENTRIES:
            self._memo.popitem(last=False)

    def count_write(self, kind: str, tokens: int | None = None) -> None:
        """One boundary of ``kind`` written (what its reads per write are counted against), of
        depth ``tokens`` where known."""
        self._count(kind)
        if tokens is not None:
            self._count((kind, depth_bin(tokens)))

    def _count(self, key: str | tuple[str, int], n: float = 1.0, at: float | None = None) -> None:
        """``n`` more of ``key`` in the epoch of ``at`` (None: now), matured as writes are."""
        ep = self._epochs.setdefault(key, deque())
        t = self.clock if at is None else min(self.clock, at)
        start = t - t % _EPOCH
        if ep and ep[-1][0] == start:
            ep[-1][1] += n
        elif ep and ep[-1][0] > start:  # an earlier epoch (dated by a write): kept in order
            i = bisect.bisect_left(ep, start, key=lambda e: e[0])
            if ep[i][0] == start:
                ep[i][1] += n
            elif self.clock - start <= 8 * self.half_life:
                ep.insert(i, [start, n])
        else:
            ep.append([start, n])
            while ep and self.clock - ep[0][0] > 8 * self.half_life:
                ep.popleft()
        # (No need to recompute the lag-weighted count now: a write this young counts for nothing yet.)

    def read(
        self, digest: bytes | None, kind_hint: str | None, tokens: int, device_tokens: int,
        tail_bytes: int = 0, chain_bytes: int = 0, lag_s: float | None = None, end_tokens: int | None = None,
    ) -> str:
        """A hit served history ``tokens`` on top of ``device_tokens``, ended by the boundary named
        ``digest``. ``kind_hint``: its kind where the reader can tell (a checkpoint by its end; a
        prompt-end tail where the hit reached the reader's own prompt end; a chain object for a
        model without sliding layers), else None -- used where the boundary is not one of this
        engine's own (the memo knows those exactly). ``*_bytes``: what the load reads. ``lag_s``:
        the object's age as the fleet index dates it (None: unknown) -- counted in ``lag_reads``
        for the retention gc learns only (``core.retention``): learnt into the policy's own lag it moved 4-engine ratios
        both ways (docs/trace-replay.md, "what was tried"). ``end_tokens``: the depth of the
        boundary that ended the hit (its tail's end), which bins another engine's object as its
        writer binned it (None: by its kind only); the memo bins one's own.
        Returns the kind it was attributed to (the largest share, for a split)."""
        own = self._memo.get(digest) if digest is not None else None
        now, hl = self.clock, self.half_life
        if own is not None:
            kind = own[0]
            depth = own[2]
            lag = max(0.0, now - own[1])
            b = lag_bin(lag)
            self._lag[b].add(1.0, now, hl)
            self.lag_reads[b] += 1
            self._own_reads[kind].add(1.0, now, hl)
            shares = {kind: 1.0}
        else:
            if lag_s is not None:
                self.lag_reads[lag_bin(lag_s)] += 1
            if kind_hint is None or kind_hint == AT_PROMPT_END:
                shares = self._split(_AMBIGUOUS if kind_hint is None else _AT_PROMPT_END_KINDS)
            else:
                shares = {kind_hint: 1.0}
            depth = None if end_tokens is None else depth_bin(end_tokens)
        marginal = max(0, tokens - device_tokens)
        gpu = self.prefill.usd(device_tokens, tokens)
        self._paid.add(gpu, now, hl)
        for kind, w in shares.items():
            self._reads[kind].add(w, now, hl)
            if depth is not None:
                self._reads_at.setdefault((kind, depth), _Decayed()).add(w, now, hl)
            self._depth[kind].add(w * tokens, now, hl)
            self._marginal[kind].add(w * marginal, now, hl)
            t = self.totals[kind]
            t.gpu_usd += w * gpu
            t.get_usd += w * self.bill.get_usd(tail_bytes)
        if BRANCH in shares:
            # A branch tail serves a prefix whose chain an earlier request wrote: the read is also
            # what writing a prompt's chain buys beyond its own tails (``CHAIN`` boundaries).
            w = shares[BRANCH]
            self._reads[CHAIN].add(w, now, hl)
            self._depth[CHAIN].add(w * tokens, now, hl)
            self._marginal[CHAIN].add(w * marginal, now, hl)
        best = max(shares, key=lambda k: shares[k])
        t = self.totals[best]
        t.reads += 1
        t.tokens += marginal
        self.totals[CHAIN].get_usd += self.bill.get_usd(chain_bytes)
        return best

    def ghost(self, age_s: float) -> None:
        """A *ghost read*: a lookup went past where its hit ended to an object gc had deleted
        (``engine.fleetindex``, ``IndexRefresher.gone``), ``age_s`` after its write -- a read the
        retention cut off. Counted in ``lag_reads`` for gc (``core.retention`` says why)."""
        self.ghosts += 1
        self.lag_reads[lag_bin(age_s)] += 1

    def device_reuse(self, digests: Sequence[bytes], device_blocks: int) -> str | None:
        """A request's device cache matched its first ``device_blocks`` blocks (chain ``digests``)
        and S3 served nothing past them: the deepest of this engine's own boundaries within the
        match is a reuse the device served (:meth:`device_read`). Not with an S3 hit: a reader
        without this device would have hit there, past this boundary, and not needed it."""
        for end in range(min(device_blocks, len(digests)), 0, -1):
            kind = self.device_read(digests[end - 1])
            if kind is not None:
                return kind
        return None

    def device_read(self, digest: bytes) -> str | None:
        """A later request of this engine reused the boundary named ``digest`` from its device cache
        (no S3 read: TensorRT-LLM asks a connector only past its device match). Counted where this
        engine wrote that boundary (the memo) as a reuse S3 did not serve (module doc, "S3's share of
        reuse"). Returns its kind, or None where it is none of this engine's."""
        own = self._memo.get(digest)
        if own is None:
            return None
        kind, written, depth = own
        # Dated by the boundary's write, and counted as its writes are (the lag correction): the
        # device's reuse comes seconds after a write, an S3 read of it may come many minutes later
        # (another engine, or this one once the device evicted it): counted when they happen, they
        # would weigh against a write before its S3 reads had time to come.
        for k in (kind, CHAIN) if kind == BRANCH else (kind,):
            self._count(DEVICE + k, at=written)
        if depth is not None:
            self._count((DEVICE + kind, depth), at=written)
        self.totals[kind].device_reads += 1
        return kind

    def _split(self, kinds: Sequence[str]) -> dict[str, float]:
        """How to attribute a read of another engine's tail that is no checkpoint (module doc) among
        the ``kinds`` it may be: as this engine's own reads of those kinds are attributed (else as
        its writes of them, else evenly)."""
        now, hl = self.clock, self.half_life
        w = {k: self._own_reads[k].get(now, hl) for k in kinds}
        if sum(w.values()) <= 0:
            w = {k: float(self.totals[k].objects) for k in kinds}
        total = sum(w.values())
        if total <= 0:
            return {k: 1 / len(kinds) for k in kinds}
        return {k: v / total for k, v in w.items() if v > 0}

    # ------------------------------------------------------------------ estimates
    def _lag_cdf(self) -> list[float]:
        """Share of reads that come within each lag bin's upper end (prior included)."""
        now, hl = self.clock, self.half_life
        w = [b.get(now, hl) for b in self._lag]
        for b in _PRIOR_LAG_BINS:
            w[b] += _PRIOR_LAG_WEIGHT / len(_PRIOR_LAG_BINS)
        total = sum(w)
        out, acc = [], 0.0
        for x in w:
            acc += x
            out.append(acc / total)
        return out

    def _matured_writes(self, kind: str | tuple[str, int]) -> float:
        """Decayed writes of ``kind`` (or of a (kind, depth bin)), each weighted by the share of its
        reads that had time to come."""
        epoch = self.clock - self.clock % _EPOCH
        if self._matured_at != epoch:
            cdf = self._lag_cdf()
            # Epochs start on the same grid for every kind and depth bin: each one's share of reads
            # come and its decay are computed once, not once per key (45 keys of up to 900 epochs:
            # ~43 ms every epoch on the scheduler's thread when each was computed per key).
            shares: dict[float, tuple[float, float]] = {}
            self._matured = {}
            for k, ep in self._epochs.items():
                s = 0.0
                for start, n in ep:
                    got = shares.get(start)
                    if got is None:
                        got = shares[start] = self._matured_share(epoch - start, cdf)
                    f, decay = got
                    s += n * f * decay  # (0, 0) for an epoch not aged yet: adds nothing
                self._matured[k] = s
            self._matured_at = epoch
        return self._matured.get(kind, 0.0)

    def _matured_share(self, age: float, cdf: list[float]) -> tuple[float, float]:
        """(share of its reads come, decay) of a write ``age`` seconds old; (0, 0) not yet aged."""
        if age <= 0:
            return 0.0, 0.0
        b = lag_bin(age)
        lo, hi = (lag_bin_edge(b - 1) if b else 0.0), lag_bin_edge(b)
        below = cdf[b - 1] if b else 0.0
        return below + (cdf[b] - below) * min(1.0, (age - lo) / (hi - lo)), 0.5 ** (age / self.half_life)

    def judged(self, kind: str) -> bool:
        """Has ``kind`` been written enough, long enough ago to have been read, to be weighed? Until
        then it is written (what s3kv did before the policy): only evidence refuses a kind."""
        return self._counts(kind)[1] >= PRIOR_WRITES

    def reads_per_write(self, kind: str, tokens: int | None = None) -> float:
        """Reads per write of ``kind``; of its boundaries ``tokens`` deep, where given (module doc,
        "by depth": the depth bin's own count, shrunk towards the kind's)."""
        prior_reads = PRIOR_READS_PER_WRITE * PRIOR_WRITES * self.s3_share(kind)
        r, w = self._counts(kind)
        whole = (r + prior_reads) / (w + PRIOR_WRITES)
        if self._since is not None and self.clock > self._since:  # module doc, "once ... watched"
            watched = min(1.0, (self.clock - self._since) / self._watch_s)
            whole -= watched * max(0.0, whole - scale_free_rate(r, w))
        if tokens is None:
            return whole
        prior_reads = PRIOR_READS_PER_WRITE * PRIOR_WRITES * self.s3_share(kind, tokens)
        rb, wb = self._counts((kind, depth_bin(tokens)))
        return (rb + prior_reads) / (wb + prior_reads / whole)

    def s3_share(self, kind: str, tokens: int | None = None) -> float:
        """Of the reuses of ``kind``'s boundaries, the share S3 served (the rest the device did),
        over the fleet, with :data:`PRIOR_S3_READS` S3 reads of prior; of its boundaries ``tokens``
        deep, where given: the depth bin's own (module doc, "S3's share of reuse")."""
        key: str | tuple[str, int] = kind if tokens is None else (kind, depth_bin(tokens))
        s3, device = self._counts(key)[0], self._device_reads(key)
        return (s3 + PRIOR_S3_READS) / (s3 + device + PRIOR_S3_READS)

    def _device_reads(self, key: str | tuple[str, int]) -> float:
        """Reuses of ``key`` the device served, matured by their writes' age (``device_read``): this
        engine's and what the others reported."""
        dkey = DEVICE + key if isinstance(key, str) else (DEVICE + key[0], key[1])
        return self._counts(dkey)[1]

    def _counts(self, key: str | tuple[str, int]) -> tuple[float, float]:
        """(reads, matured writes) of a kind or (kind, depth bin): this engine's, plus what the
        other engines reported (module doc, "pooled over the fleet")."""
        (r, w), (ro, wo) = self._own(key), self._pooled(key)
        return r + ro, w + wo

    def _pooled(self, key: str | tuple[str, int]) -> tuple[float, float]:
        """What the other engines reported of ``key``, decayed to now."""
        other = self._others.get(evidence_key(key))
        if other is None:
            return 0.0, 0.0
        keep = 0.5 ** ((self.clock - self._others_at) / self.half_life)
        return other[0] * keep, other[1] * keep

    def _own(self, key: str | tuple[str, int]) -> tuple[float, float]:
        got = self._reads.get(key) if isinstance(key, str) else self._reads_at.get(key)
        return (got.get(self.clock, self.half_life) if got is not None else 0.0), self._matured_writes(key)

    def evidence(self) -> dict[str, list[float]]:
        """This engine's own evidence now, for the fleet to pool (module doc): per kind and per
        (kind, depth bin) it counted, [decayed reads, matured writes]; and :data:`KEEP`, for gc."""
        keys = {*KINDS, *self._epochs, *self._reads_at} - {KEEP}
        out = {evidence_key(k): list(self._own(k)) for k in keys}
        # Said once this engine has watched the longest life an object may have (the ceiling's, not
        # the shorter one gc may have learnt: reads past that are cut off), and with each byte as
        # its reads had time to come (the lag correction, as writes): before, it weighs its reads
        # so far against bytes whose reads are still to come -- a replay of returning users (back
        # after 10-60 minutes) behind a gc that had learnt for an hour lost 9% of its tokens to a
        # cut its first minutes argued for. A fleet's gc goes on cutting by the reports of the
        # engines before a restart meanwhile (kept, decayed, for eight half-lives). Free storage:
        # nothing to weigh the retention against.
        watched = self._since is not None and self.clock - self._since >= self._watch_s
        if watched and self.bill.prices.usd_per_byte_s > 0:
            paid = self._paid.get(self.clock, self.half_life) / self.bill.prices.usd_per_byte_s
            out[KEEP] = [paid, self._matured_writes(KEEP)]
        return out

    def pool(self, others: dict[str, tuple[float, float]] | None, age_s: float = 0.0) -> None:
        """What the other engines of the fleet counted, as of ``age_s`` ago (``evidence_key`` ->
        (reads, matured writes); kept as given: the caller never changes it); None or empty:
        nothing (this engine learns alone). And what this engine
        shares in turn: :attr:`shared`, its :meth:`evidence` at most every :data:`SHARE_EVERY_S`
        -- a new dict each time, never changed after, so the thread that writes the read reports
        takes it as it is (calling :meth:`evidence` there would race the leader's own use of
        this model's caches)."""
        self._others = others or {}
        self._others_at = self.clock - age_s
        if self.shared is None or self.clock - self._shared_at >= SHARE_EVERY_S:
            self.shared, self._shared_at = self.evidence(), self.clock

    def marginal_share(self, kind: str) -> float:
        m = self._marginal[kind].get(self.clock, self.half_life)
        d = self._depth[kind].get(self.clock, self.half_life)
        return (m + PRIOR_MARGINAL_TOKENS) / (d + PRIOR_MARGINAL_TOKENS)

    def worth(self, b: Boundary) -> float:
        """Expected value of a read-weighted boundary less its tail's cost (the chain apart), in $,
        with its costs scaled by the required return."""
        # A chain boundary's reads are branch reads of a shared part, not of this prompt's depth:
        # its kind's rate (no write of it is binned).
        r = self.reads_per_write(b.kind, None if b.kind == CHAIN else b.tokens)
        if b.kind == CHAIN:  # a branch read serves the shared part: its own length, not this prompt's
            n = self._reads[CHAIN].get(self.clock, self.half_life)
            served = min(b.tokens, (self._marginal[CHAIN].get(self.clock, self.half_life) + PRIOR_MARGINAL_TOKENS)
                         / (n + PRIOR_MARGINAL_TOKENS / 8192))
        else:
            served = b.tokens * self.marginal_share(b.kind)
        # A read adds the prefill above what its reader would hit without this boundary: the stored
        # one below it, at least (a reader that parts below that one never reads this one either).
        below = b.stored_below if b.stored_below < b.tokens else 0
        per_read = self.prefill.usd(max(int(b.tokens - served), below), b.tokens)
        reads_cost = self.bill.get_usd(sum(b.tail)) + self.bill.get_usd(served * b.chain_bytes_per_token)
        return r * (per_read - self.min_return * reads_cost) - self.min_return * self.bill.write_usd(b.tail)

    # ------------------------------------------------------------------ deciding
    def plan(self, boundaries: Sequence[Boundary]) -> Plan:
        """The boundaries a request writes (module doc), and how far its chain goes.

        A boundary below the top one splits the chain's object where the chain goes on past it
        (``Boundary.splits``): that PUT is its own cost, not the chain's -- the chain below a top
        boundary costs its objects with no split where nothing is written. Charged to the chain, a
        prompt-end tail at 1% of reads looked worth its bill by a little (the split's PUT is a third
        of what its tail costs to write and keep, at Gemma-3-27B's sizes): a 3,000-request
        conversation trace wrote 817 of them and their splits, for $0.015, and served $0.004
        through them. (Two boundaries at one end each pay the split alone.)"""
        order = sorted(boundaries, key=lambda b: b.tokens)
        nets = [self.worth(b) for b in order]
        split = [self.min_return * self.bill.puts_usd(b.splits) for b in order]
        unjudged = [not self.judged(b.kind) for b in order]
        best, top = 0.0, -1
        chain = positive = 0.0
        for i, b in enumerate(order):
            chain += self.min_return * self.bill.write_usd(b.chain)
            total = positive + nets[i] - chain
            if total > best or unjudged[i]:
                best, top = max(best, total), i
            chain -= split[i]  # below a higher top, this end splits the chain only if it is written
            positive += max(0.0, nets[i] - split[i])
        decisions: dict[tuple[str, int], str] = {}
        reach = -1
        for i, b in enumerate(order):
            if i == top or (i < top and (nets[i] - split[i] > 0 or unjudged[i])):
                decisions[(b.kind, b.tokens)] = "write"
                reach = i
            elif explored(b.digest, b.kind, self.explore_share):
                decisions[(b.kind, b.tokens)] = "explore"
                reach = max(reach, i)
            else:
                decisions[(b.kind, b.tokens)] = "refuse"
        for b in order:
            t = self.totals[b.kind]
            d = decisions[(b.kind, b.tokens)]
            t.written += d == "write"
            t.explored += d == "explore"
            t.refused += d == "refuse"
        whole = any(b.kind == HISTORY_END and decisions[(b.kind, b.tokens)] != "refuse" for b in order)
        return Plan(decisions, None if whole else (order[reach].tokens if reach >= 0 else 0))

    # ------------------------------------------------------------------ export
    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per kind: the estimates (reads per write, marginal share, the other engines' matured
        writes pooled in) and the value line."""
        fields = ("objects", "bytes", "put_usd", "storage_usd", "get_usd", "reads", "tokens", "gpu_usd",
                  "host_reads", "device_reads", "written", "explored", "refused")
        out = {}
        for k in KINDS:
            t = self.totals[k]
            out[k] = {f: float(getattr(t, f)) for f in fields}
            out[k]["reads_per_write"] = self.reads_per_write(k)
            out[k]["marginal_share"] = self.marginal_share(k)
            out[k]["s3_share"] = self.s3_share(k)
            out[k]["fleet_writes"] = self._pooled(k)[1]
        return out


#: The lowest reads per write the scale-free prior admits (module doc, "once the engine has
#: watched"): below it no boundary pays -- the deepest prompts' boundaries pay back at about one
#: read in a few hundred -- so the prior needs no weight there.
RATE_FLOOR = 1e-3


def scale_free_rate(reads: float, writes: float) -> float:
    """Posterior mean of a reads-per-write rate under the prior 1/rate on [RATE_FLOOR, inf), after
    ``reads`` in ``writes`` (Poisson; at least one write). Counts are rounded to three digits: a
    cache hit for the decayed counts of one kind between two plans."""
    return _scale_free_rate(float(f"{reads:.3g}"), float(f"{max(writes, 1.0):.3g}"))


@functools.lru_cache(maxsize=8192)
def _scale_free_rate(r: float, n: float) -> float:
    # In u = ln(rate) the posterior's density is rate^r e^(-n rate) (the 1/rate prior times d rate
    # = rate du); its mean is the ratio of that times rate to it. The trapezoid rule on 256 points,
    # up to where e^(-n rate) has left nothing (60 past the mode): accurate to well under 1%.
    lo, hi = math.log(RATE_FLOOR), math.log(max(2 * RATE_FLOOR, (r + 60.0) / n))
    us = [lo + (hi - lo) * i / 255 for i in range(256)]
    logs = [r * u - n * math.exp(u) for u in us]
    top = max(logs)
    dens = [math.exp(x - top) * (0.5 if i in (0, 255) else 1.0) for i, x in enumerate(logs)]
    return sum(d * math.exp(u) for d, u in zip(dens, us, strict=True)) / sum(dens)


def evidence_key(key: str | tuple[str, int]) -> str:
    """How a kind (``"checkpoint"``) or a (kind, depth bin) (``"checkpoint@3"``) is named in reports
    and the fleet index."""
    return key if isinstance(key, str) else f"{key[0]}@{key[1]}"


def depth_bin(tokens: int) -> int:
    """The depth bin of a boundary ``tokens`` deep (module doc, "by depth")."""
    return min(DEPTH_BINS - 1, max(0, (int(tokens) // DEPTH_BASE).bit_length() - 1))


def lag_bin(seconds: float) -> int:
    """The reuse-lag bin of ``seconds``: bin b holds [2^b - 1, 2^(b+1) - 1), the last one the rest."""
    return min(LAG_BINS - 1, int(math.log2(seconds + 1)))
