"""The retention learnt from what the fleet reads (issue 38): engines report, gc decides.

A fixed ``S3KV_RETENTION_H`` is a constant fitted to one traffic: an hour kept a conversation
trace's p99 reuse gap (26 min) and billed every object nobody read for the hour as well, while
the public trace's reads all came within 17 minutes. So gc learns the retention from when objects
are read, and ``S3KV_RETENTION_H`` becomes its ceiling:

* **engines report** (``s3kv.engine.fleetindex``): each leader dates every S3 read it makes
  (``ValueModel.lag_reads``: its own objects by its memo, others' by the fleet index's write
  times) and, while the fleet index says gc learns, writes the running counts every
  :data:`REPORT_EVERY_S` to ``{namespace}/fleet-reads/{engine}.{seq}`` -- write-once keys (the
  bucket policy that makes KV write-once needs no exception), a few KB each, with the engine's
  write-policy evidence beside them, which gc sums into the index (``s3kv.core.value``, pooled
  over the fleet);
* **gc decides** (:func:`learn_retention`, in the index publisher of ``s3kv gc --index``): it
  folds the reports into one histogram that forgets with a half-life of :data:`HALF_LIFE_S`
  (traffic changes), takes the retention whose cutoff keeps 99% of the reads, ghost reads
  included -- or less where the reads do not pay for keeping everything that long (below) --
  with an octave of room while it has learnt for less than the ceiling, and publishes it in the
  fleet index (``retention_s``);
* **and past it, by what engines say**: each report also says how long its engine promises loads
  on a HEAD's answer (``belief_s``); gc's margin past the retention covers the longest reported
  (:meth:`FleetReads.longest_belief`), not only its own settings' -- engines in a rolling upgrade
  still believe the old default, and a report that does not say is taken for it;
* **who deletes by it**: gc, each object by :func:`retention_for` its last write or refresh:
  the learnt retention, or the longest an engine may have believed for it. An engine believes its
  own upload for what the fresh index it holds says (``believe_s``: the learnt retention, the
  floor while gc has too few reads; a stale index: the floor's life), so a user back after 20
  minutes costs no verify wave, and gc may move the retention either way at any time without
  deleting what an engine still promises without asking; the engines' refresh-on-hit follows it
  (the leader hands it to the workers).

Why ghost reads (``ValueModel.ghost``): reads later than the cutoff are never seen, so a rule
that only keeps what it saw would ratchet down -- each shorter retention hides the reads that would
argue against the next. Engines remember what the fleet index stopped listing (``IndexRefresher.gone``,
with write times); a lookup that would have gone on past its hit to such an object, gone at an
age gc deletes at, counts the read it would have made at that age, and reports it beside the
dated reads: more than 1% of the reads past the cutoff, and it grows back. Why from the index and
not from the engine's own uploads: behind a router that spreads requests, the object a late
reader misses is most often another engine's, and one's own repeats the device serves (a batch
re-run after 20 minutes showed no own ghost at all).

Why the cut differs with how long gc has learnt (:func:`settled`): ghosts cannot tell of reads
later than gc has watched. Both cut at the lag 99% of the reads (ghosts included) come within,
read inside its octave-wide lag bin. A gc that has learnt for less than the ceiling (a fleet just
started, or a replay's window) keeps an octave of room beyond it -- reads crowding the room are
seen and grow it, before objects go; one that has learnt longer keeps none. (The room was once
the whole lag bin above the one holding that lag: one to two octaves, depending on where in its
bin the lag fell: a 3,000-request conversation's objects were kept 2,047 s where 99% of its reads
came within ~970 s, and the room is now to 1,940 s.)

**And no longer than the reads pay for** (:func:`paid_cutoff`). 99% of the reads is a share, not
a price: where a few reads come late, it keeps everything written as long as they need -- a
2,400-request trace of unique prompts behind 4 engines kept every object ~57 minutes for its
tail of late reads, storage 64% of its bill (docs/trace-replay.md has what this cut does).
Engines also report what their S3 reads saved (prefill $, in byte-seconds of storage at the
bucket's price) and the bytes they wrote (``core.value.KEEP``, beside the write-policy
evidence, decayed alike; each byte counted as its reads had time to come, and only once the
engine watched the longest life an object may have: its first hour cannot say what later reads
pay).
Summed over the fleet, the ratio is how many seconds of keeping everything written the reads
pay for. gc cuts where a second more of keeping everything costs more than the reads that
second brings save -- never later than the 99% rule, with the same octave of room while young.
A cut too early is seen as before: the reads it cuts off come back as ghost reads at their lag,
and the cut grows back once they pay.

Why no prior: with fewer than :data:`MIN_DATED_READS` dated reads the ceiling stands.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .fleetindex import FRESH_PERIODS, add_evidence, check_evidence
from .integrity import IntegrityKeys, TagKey, equal

#: The shortest retention gc chooses; engines believe their own uploads this long once gc learns.
RETENTION_FLOOR_S = 300.0
#: The fleet's read histogram forgets at this half-life (a day's traffic changes within hours).
HALF_LIFE_S = 3600.0
#: Fewer dated reads than this (after forgetting): the ceiling stands.
MIN_DATED_READS = 20.0
#: Share of the dated reads allowed past the lag the cut is taken at.
TAIL_SHARE = 0.01
#: How often an engine writes its read report while gc learns.
REPORT_EVERY_S = 60.0
#: Where reports live under a namespace's prefix.
REPORTS_DIR = "fleet-reads/"
#: A report older than this is forgotten (its engine is gone) and deleted with the superseded ones.
REPORT_STALE_S = 86400.0

#: What an engine whose report names no belief promised loads on (a HEAD's answer, a listing):
#: ``index_ttl_s`` before its default went from 600 s to 120 s (2026-12-07), when reports did not
#: say. gc's margin covers it while such an engine reports (:meth:`FleetReads.longest_belief`).
LEGACY_BELIEF_S = 600.0
#: An engine silent this long is gone: its beliefs no longer widen gc's margin.
BELIEF_FORGET_S = 4 * 3600.0

_REPORT_NAME = re.compile(r"^([0-9a-f]{16})\.([0-9]{1,12})$")


def lag_bin_edge(b: int) -> float:
    """Upper edge, in seconds, of reuse-lag bin ``b`` (bin b holds [2^b - 1, 2^(b+1) - 1) s)."""
    return float(2 ** (b + 1) - 1)


def learn_retention(lag_reads: Sequence[float], *, margin_s: float, cap_s: float,
                    watched_s: float = math.inf, paid_s: float | None = None) -> float | None:
    """The retention (seconds, in [``RETENTION_FLOOR_S``, ``cap_s``]) the reads argue for, or None
    with too few of them (module doc). ``lag_reads``: reads by lag bin since the object's write or
    refresh, ghost reads included; ``margin_s``: what gc keeps beyond the retention
    (``core.cost.expiry_age_s``), so a retention R deletes at age R + margin; ``watched_s``: how
    long gc has learnt (:func:`settled`); ``paid_s``: how many seconds of keeping all that is
    written the reads pay for (:func:`paid_cutoff`; None: unknown, the 99% rule alone)."""
    n = float(sum(lag_reads))
    if n < MIN_DATED_READS:
        return None
    q = _lag_within(lag_reads, TAIL_SHARE * n)
    if paid_s is not None:  # no later than the reads pay for (module doc)
        q = min(q, paid_cutoff(lag_reads, paid_s))
    if not settled(watched_s, margin_s=margin_s, cap_s=cap_s):
        q = 2 * q + 1  # an octave of room: (1 + lag) doubled -- for either cut, both blind past what gc watched
    return min(cap_s, max(RETENTION_FLOOR_S, q - margin_s))


def paid_cutoff(lag_reads: Sequence[float], paid_s: float) -> float:
    """The age to delete at that the reads pay for (module doc, what the reads pay for): the ``t``
    maximising ``paid_s x F(t) - t``, ``F(t)`` the share of reads within lag ``t`` (each bin's
    spread evenly over log(1 + lag), as :func:`_lag_within` reads it). Keeping every object
    written a second longer costs one second of all the bytes written; the reads that second
    brings save ``paid_s x`` their share of it. Within a bin the gain falls as the lag grows
    (concave), so each bin's best is where its reads' density stops paying, clamped to the bin."""
    n = float(sum(lag_reads))
    if n <= 0 or paid_s <= 0:
        return 0.0
    best_t, best, below = 0.0, 0.0, 0.0
    for b, x in enumerate(lag_reads):
        lo, hi = (lag_bin_edge(b - 1) if b else 0.0), lag_bin_edge(b)
        if x > 0:
            span = math.log((hi + 1) / (lo + 1))
            f = x / n
            t = min(hi, max(lo, paid_s * f / span - 1))  # d/dt [paid_s x F(t)] = 1 there
            gain = paid_s * (below + f * math.log((t + 1) / (lo + 1)) / span) - t
            if gain > best:
                best_t, best = t, gain
        below += x / n
    return best_t


def _lag_within(lag_reads: Sequence[float], allowed: float) -> float:
    """The lag all but ``allowed`` of the reads come within, read inside its lag bin as if the bin's
    reads were spread evenly over log(1 + lag): the bins are an octave wide, and their edges would
    keep objects up to twice as long as the reads asked."""
    beyond = float(sum(lag_reads))  # reads in bin b and later
    for b, x in enumerate(lag_reads):
        if x > 0 and beyond - x <= allowed:
            lo = lag_bin_edge(b - 1) if b else 0.0
            return (lo + 1) * ((lag_bin_edge(b) + 1) / (lo + 1)) ** ((beyond - allowed) / x) - 1
        beyond -= x
    return 0.0


def settled(watched_s: float, *, margin_s: float, cap_s: float) -> bool:
    """Has gc learnt long enough (``watched_s``) to cut at the lag 99% of the reads come within,
    ghost reads telling it of those past the cutoff (module doc)? Not before it watched the
    ceiling and its margin: reads later than gc has watched cannot have been seen, nor their
    ghosts, and a rule with no room deletes what a fleet's first late reads want (a batch re-run
    20 minutes on served 71% of its tokens). Until then an octave of room stands in for them."""
    return watched_s >= cap_s + margin_s


def engine_lag_s(index_every_s: float, fleet_index_s: float, skew_s: float) -> float:
    """How long after gc publishes a retention an engine may still act on the one before: its
    index is fresh for ``FRESH_PERIODS`` periods (past that it believes only the floor), plus
    clock skew."""
    return FRESH_PERIODS * max(index_every_s, fleet_index_s) + skew_s


def believe_s(learnt: float | None) -> float:
    """How long gc tells engines to believe their own uploads: the learnt retention, or the floor
    while it has too few reads to learn from (it keeps the ceiling then, but an engine's belief in
    that would hold every object written meanwhile to the ceiling once it learns a shorter one)."""
    return RETENTION_FLOOR_S if learnt is None else learnt


def believe_unknown_s(cap_s: float, index_ttl_s: float) -> float:
    """How long an engine believes its own uploads while it holds no fresh fleet index, so does
    not know what gc keeps: the floor (or a shorter setting, ``cap_s``), which gc keeps by every
    rule, plus the index TTL, which gc's margin covers (``core.cost.expiry_age_s``)."""
    return min(cap_s, RETENTION_FLOOR_S) + index_ttl_s


def retention_for(
    beliefs: Sequence[tuple[float, float]], touched_at: float, *, retention_s: float, since: float,
    cap_s: float, lag_s: float,
) -> float:
    """The retention gc keeps an object for, last written or refreshed at ``touched_at``: the one
    it learnt (``retention_s``), or longer where an engine may have believed longer for a write the
    object could have been (module doc). ``beliefs``: (time published, belief) from ``since`` on,
    oldest first; a write an engine still believes at ``touched_at`` came within its belief of
    it, so every belief in force within its own span (plus the ``lag_s`` engines may act on an
    older index) before ``touched_at`` counts. Before ``since`` plus the lag, engines believed the
    ceiling (``cap_s``) -- and when they first see gc learn they cut that to the floor's life, so
    a refresh after that needs no more."""
    if touched_at < since + lag_s:
        return cap_s
    best = retention_s
    for i, (t, b) in enumerate(beliefs):
        end = beliefs[i + 1][0] if i + 1 < len(beliefs) else math.inf
        if t <= touched_at and end >= touched_at - b - lag_s:
            best = max(best, b)
    return min(best, cap_s)


# ------------------------------------------------------------------------------ reports
def report_key(namespace_prefix: str, engine: str, seq: int) -> str:
    """An engine's ``seq``-th read report (``namespace_prefix`` ends with ``/``)."""
    return f"{namespace_prefix}{REPORTS_DIR}{engine}.{seq}"


def parse_report_key(rel: str) -> tuple[str, int] | None:
    """(engine, seq) of a report's key relative to its namespace prefix, else None."""
    if not rel.startswith(REPORTS_DIR):
        return None
    m = _REPORT_NAME.match(rel[len(REPORTS_DIR):])
    return (m.group(1), int(m.group(2))) if m else None


def encode_report(lag_reads: Sequence[float], at: float, key: str, tag_key: TagKey | None = None,
                  evidence: Mapping[str, Sequence[float]] | None = None, belief_s: float | None = None) -> bytes:
    """A report at ``key``: JSON, then with an integrity key a line with its tag (over the key and
    the JSON, as the fleet index's): a report only a key holder wrote moves the retention.
    ``evidence``: the engine's write-policy evidence (``ValueModel.evidence``), which gc pools.
    ``belief_s``: how long the engine promises loads on an answer it got (``index_ttl_s`` plus
    ``lookup_summary_trust_s``), which gc's margin covers."""
    doc: dict[str, Any] = {"lag_reads": [float(x) for x in lag_reads], "at": float(at),
                           "key_id": tag_key.key_id.hex() if tag_key is not None else None}
    if belief_s is not None:
        doc["belief_s"] = float(belief_s)
    if evidence is not None:
        doc["evidence"] = {k: [float(x) for x in v] for k, v in evidence.items()}
    body = json.dumps(doc, sort_keys=True).encode()
    return body if tag_key is None else body + b"\n" + tag_key.index_tag(key, body).hex().encode()


def decode_report(data: bytes, bins: int, key: str, keys: IntegrityKeys | None = None) -> Report:
    """The report at ``key``. Raises ValueError on anything else: a foreign object, or -- where
    ``keys`` -- one no key of ours signed (a planted report could only move the retention between
    floor and ceiling, or the write policy's reads per write, but that is storage or misses it was
    never owed)."""
    body, _, tag = bytes(data).partition(b"\n")
    doc = json.loads(body)
    if keys is not None:
        k = keys.find(bytes.fromhex(doc.get("key_id") or ""))
        if k is None or not equal(k.index_tag(key, body).hex().encode(), tag):
            raise ValueError("a read report no integrity key of ours signed")
    lags = [float(x) for x in doc["lag_reads"]]
    if len(lags) != bins or any(not math.isfinite(x) or x < 0 for x in lags):
        raise ValueError(f"a read report has {len(lags)} lag bins, expected {bins} non-negative counts")
    raw = doc.get("belief_s", LEGACY_BELIEF_S)
    # bool is an int to Python: ``true`` would pass as 1 s and shrink gc's margin to a second.
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"a read report's belief_s {raw!r} is not a number")
    belief = float(raw)
    if not math.isfinite(belief) or belief < 0:
        raise ValueError(f"a read report's belief_s {belief!r} is not a finite number >= 0")
    return Report(lags, float(doc["at"]), check_evidence(doc.get("evidence") or {}), belief)


@dataclass(frozen=True)
class Report:
    """One engine's read report: its dated reads, when, and its write-policy evidence."""

    lag_reads: list[float]
    at: float
    evidence: dict[str, tuple[float, float]]
    #: How long it promises loads on an answer it got (:data:`LEGACY_BELIEF_S` where it did not say).
    belief_s: float = LEGACY_BELIEF_S


@dataclass
class FleetReads:
    """The fleet's read histogram: engines' running counts folded in as they grow, forgotten
    at :data:`HALF_LIFE_S` (module doc)."""

    bins: int
    lag_reads: list[float] = field(default_factory=list)
    at: float | None = None
    #: engine -> its last counts taken.
    seen: dict[str, list[float]] = field(default_factory=dict)
    #: engine -> (report time, report number, its write-policy evidence), the newest taken.
    evidence: dict[str, tuple[float, int, dict[str, tuple[float, float]]]] = field(default_factory=dict)

    #: engine -> (report time, how long it promises loads on an answer it got), the newest taken.
    beliefs: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.lag_reads:
            self.lag_reads = [0.0] * self.bins

    def take_belief(self, engine: str, at: float, belief_s: float) -> None:
        cur = self.beliefs.get(engine)
        if cur is None or at >= cur[0]:
            self.beliefs[engine] = (at, belief_s)

    def longest_belief(self, now: float) -> float:
        """The longest any engine heard from within :data:`BELIEF_FORGET_S` promises loads on an
        answer it got (0: none). Why gc asks: it must keep every object that long past its
        retention, and engines need not run its settings -- in a rolling upgrade they still
        believe the old default (:data:`LEGACY_BELIEF_S`)."""
        for engine, (at, _) in list(self.beliefs.items()):
            if now - at > BELIEF_FORGET_S:
                del self.beliefs[engine]
        return max((b for _, b in self.beliefs.values()), default=0.0)

    def take(self, engine: str, counts: Sequence[float], now: float) -> None:
        """One engine's running counts: what grew since its last report is new (counts that shrank:
        the engine restarted, all of them are)."""
        if self.at is not None and now > self.at:
            keep = 0.5 ** ((now - self.at) / HALF_LIFE_S)
            self.lag_reads = [x * keep for x in self.lag_reads]
        self.at = now if self.at is None else max(self.at, now)
        last = self.seen.get(engine)
        restarted = last is None or any(c < p for c, p in zip(counts, last, strict=True))
        for b, c in enumerate(counts):
            self.lag_reads[b] += c if restarted or last is None else c - last[b]
        self.seen[engine] = list(counts)

    def take_evidence(self, engine: str, seq: int, at: float, evidence: dict[str, tuple[float, float]]) -> None:
        cur = self.evidence.get(engine)
        if evidence and (cur is None or seq >= cur[1]):
            self.evidence[engine] = (at, seq, evidence)

    def pooled(self, now: float, half_life: float) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
        """The fleet's write-policy evidence at ``now``: the newest report of each engine, decayed
        at ``half_life`` from its time, summed; and which report of each engine the sum holds (an
        engine takes its own back out). An engine silent for eight half-lives is dropped: what it
        counted has decayed to under 0.4%, and a fleet whose engines come and go would otherwise
        carry a day of them in every index."""
        total: dict[str, tuple[float, float]] = {}
        held: dict[str, int] = {}
        for engine, (at, seq, ev) in list(self.evidence.items()):
            if now - at > min(REPORT_STALE_S, 8 * half_life):
                del self.evidence[engine]
                continue
            held[engine] = seq
            add_evidence(total, ev, 0.5 ** (max(0.0, now - at) / half_life))
        return total, held
