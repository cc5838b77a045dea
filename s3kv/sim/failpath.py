"""The failed-load path of the newest flat-API connector manager, modelled for the simulator.

Read from TensorRT-LLM's ``connectors/kv_cache_connector.py`` on the line that has it (a fork of
the flat API, ``KvCacheConnectorPollResult`` / ``_RequestCoordinationState``; no stored upstream
``main`` has it yet). What ``KvCacheConnectorManager.get_finished`` does, on every rank, once per
executor pass:

1. worker ``get_finished(finished_gen, started_loading)``, then worker
   ``take_failed_load_request_ids()``; ids of requests the manager does not track (not an async
   load or save it knows, nor one it coordinates) are dropped -- so a *sync* load has no failure
   path at all. Each failed id becomes a local abort intent with reason ``transfer_failed``.
2. For every request whose abort reached consensus in an earlier pass and that this rank has not
   released: worker ``try_abort_request(id)``; anything but ``True`` is fatal (the manager raises
   after the collective: the engine dies). Then the rank drops its own bookkeeping of it.
3. One allgather of request ids only (finished saves and loads, abort intents, who released, who
   cleaned, rank 0's scheduler acknowledgements). An abort intent on any rank is an abort on all
   (``transfer_failed`` wins over ``cancelled``); finished saves/loads count only when every rank
   reported them, minus aborted ids.
4. Rank 0 only: ``finalize_successful_load(id)`` for loads every rank finished -- the request
   resumes in the *next* pass, when the acknowledgement has gone through the allgather; and
   ``try_abort_request(id, reason)`` for aborts every worker released (``True`` acknowledges,
   published by the next pass's allgather; otherwise it is asked again next pass).
5. An abort that rank 0 acknowledged and every rank cleaned is finalized; with reason
   ``transfer_failed`` the request is returned in ``failed_load_requests``.

So a failed load ends its request three passes after the first report (intent -> consensus;
release on every rank + scheduler abort; finalize), and its pages are freed only after every
worker said no copy of its can still land. A successful async load resumes one pass later than
on the line without this path. What the executor then does with a failed request was not in the
stored sources at the time (the fork's ``py_executor.py``, cheese-head/TensorRT-LLM, is stored
and was not read again); the line before it
(``handle_load_errors``) rewound a failed request to its device match and recomputed it, and
failed the request ("KV cache load failure") where it could not. The simulator offers both
(``SimEngine(failed_load_outcome=...)``): either way the request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

TRANSFER_FAILED = "transfer_failed"


@dataclass
class _Coordination:
    """One request's abort state on one rank (``_RequestCoordinationState``)."""

    local_reason: str | None = None
    consensus_reason: str | None = None
    released: bool = False  # this rank's worker released the transfer
    all_released: bool = False  # every rank's did (learnt from an allgather)
    cleaned: bool = False  # this rank dropped its bookkeeping
    ack: str | None = None  # rank 0: "success" | "abort"

    def abort(self, reason: str) -> None:
        self.local_reason = _merge(self.local_reason, reason)
        if self.ack == "success":
            self.ack = None

    def observe_consensus(self, reason: str) -> None:
        self.abort(reason)
        self.consensus_reason = _merge(self.consensus_reason, reason)


def _merge(current: str | None, incoming: str) -> str:
    """A transfer failure wins over a cancellation, whatever the rank order."""
    return TRANSFER_FAILED if TRANSFER_FAILED in (current, incoming) else (current or incoming)


@dataclass(frozen=True)
class _Payload:
    saves: frozenset[int]
    loads: frozenset[int]
    intents: tuple[tuple[int, str], ...]
    released: frozenset[int]
    cleaned: frozenset[int]
    success_acks: frozenset[int]
    abort_acks: frozenset[int]


@dataclass
class RankManager:
    """One rank's ``KvCacheConnectorManager`` state that the failed-load path adds to."""

    rank: int
    pending_loads: set[int] = field(default_factory=set)
    pending_saves: set[int] = field(default_factory=set)
    done_loads: set[int] = field(default_factory=set)  # finished here, not yet on every rank
    done_saves: set[int] = field(default_factory=set)
    coord: dict[int, _Coordination] = field(default_factory=dict)

    def tracked(self) -> set[int]:
        return self.pending_loads | self.pending_saves | self.done_loads | self.done_saves | set(self.coord)

    def payload(self) -> _Payload:
        c = self.coord
        return _Payload(
            saves=frozenset(self.done_saves),
            loads=frozenset(self.done_loads),
            intents=tuple(sorted((rid, s.local_reason) for rid, s in c.items() if s.local_reason)),
            released=frozenset(rid for rid, s in c.items() if s.released),
            cleaned=frozenset(rid for rid, s in c.items() if s.cleaned),
            success_acks=frozenset(rid for rid, s in c.items() if self.rank == 0 and s.ack == "success"),
            abort_acks=frozenset(rid for rid, s in c.items() if self.rank == 0 and s.ack == "abort"),
        )


@dataclass(frozen=True)
class PollResult:
    """What one pass of the manager tells the executor (ids every rank agrees on)."""

    finished_saves: frozenset[int]
    resumed_loads: frozenset[int]
    failed_loads: tuple[int, ...]
    #: Requests whose abort every worker released this pass (their copies cannot land any more).
    released: frozenset[int]


class FailedLoadPath:
    """Every rank's manager; :meth:`poll` is one executor pass of ``get_finished`` on all ranks.

    ``call(name, fn, *args)`` makes a connector call the engine's way (an exception is a crash);
    ``crash(message)`` ends the run as the engine's death; ``parse(rank, ret)`` checks a
    ``get_finished`` answer against what the rank was handed.
    """

    def __init__(
        self,
        tp_size: int,
        call: Callable[..., Any],
        crash: Callable[[str], BaseException],
        parse: Callable[[int, Any], tuple[list[int], list[int]]],
    ):
        self.ranks = [RankManager(r) for r in range(tp_size)]
        self._call, self._crash, self._parse = call, crash, parse

    def poll(self, workers: Sequence[Any], scheduler: Any, finished_gen: Iterable[int],
             started_loading: Iterable[int]) -> PollResult:
        finished_gen, started_loading = list(finished_gen), list(started_loading)
        payloads: list[_Payload] = []
        for m, w in zip(self.ranks, workers, strict=True):
            m.pending_saves.update(finished_gen)
            m.pending_loads.update(started_loading)
            ret = self._call("get_finished", w.get_finished, list(finished_gen), list(started_loading))
            saved, loaded = self._parse(m.rank, ret)
            failed: set[int] = set()
            fn = getattr(w, "take_failed_load_request_ids", None)
            if callable(fn):
                # Exact ints only, as the fork's manager keeps them: an id of another type (a
                # numpy integer, a bool) is dropped there without a word, and its request never ends.
                failed = {x for x in (self._call("take_failed_load_request_ids", fn) or ()) if type(x) is int}
            tracked = m.tracked()
            for rid in failed & tracked:
                m.coord.setdefault(rid, _Coordination()).abort(TRANSFER_FAILED)
            m.done_saves |= set(saved) & m.pending_saves
            m.pending_saves -= m.done_saves
            m.done_loads |= set(loaded) & m.pending_loads
            m.pending_loads -= m.done_loads
            for rid, s in list(m.coord.items()):
                if s.consensus_reason is None or s.released:
                    continue
                ok = self._call("try_abort_request", w.try_abort_request, rid)
                if ok is not True:
                    raise self._crash(f"KV connector worker failed to release request {rid} (returned {ok!r})")
                s.released = True
            for rid, s in m.coord.items():
                if s.released and not s.cleaned:
                    for bucket in (m.pending_loads, m.pending_saves, m.done_loads, m.done_saves):
                        bucket.discard(rid)
                    s.cleaned = True
            payloads.append(m.payload())

        # The allgather: every rank folds the same payloads.
        intents = [(rid, why) for p in payloads for rid, why in p.intents]
        released_all = frozenset.intersection(*(p.released for p in payloads))
        cleaned_all = frozenset.intersection(*(p.cleaned for p in payloads))
        success_acks = frozenset().union(*(p.success_acks for p in payloads))
        abort_acks = frozenset().union(*(p.abort_acks for p in payloads))
        saves_all = frozenset.intersection(*(p.saves for p in payloads))
        loads_all = frozenset.intersection(*(p.loads for p in payloads))
        saves_out: frozenset[int] = frozenset()
        resumed: set[int] = set()
        failed_out: list[int] = []
        newly_released: set[int] = set()
        for m in self.ranks:
            for rid, why in intents:
                if rid in m.tracked():
                    m.coord.setdefault(rid, _Coordination()).observe_consensus(why)
            for rid in released_all:
                held = m.coord.get(rid)
                if held is not None and held.consensus_reason is not None and not held.all_released:
                    held.all_released = True
                    newly_released.add(rid)
            aborted = {rid for rid, s in m.coord.items() if s.consensus_reason is not None}
            m_saves, m_loads = saves_all - aborted, loads_all - aborted
            if m.rank == 0:
                for rid in sorted(m_loads):
                    s = m.coord.setdefault(rid, _Coordination())
                    if s.ack != "success":
                        fn = getattr(scheduler, "finalize_successful_load", None)
                        if not callable(fn) or self._call("finalize_successful_load", fn, rid) is True:
                            s.ack = "success"
            resumable = m_loads & success_acks
            m.done_saves -= m_saves
            m.done_loads -= resumable
            for rid in resumable:
                m.coord.pop(rid, None)
            if m.rank == 0:
                for rid, s in list(m.coord.items()):
                    if s.consensus_reason is None or not s.all_released or s.ack == "abort":
                        continue
                    fn = getattr(scheduler, "try_abort_request", None)
                    if not callable(fn) or self._call("try_abort_request", fn, rid, s.consensus_reason) is True:
                        s.ack = "abort"
            for rid in sorted(abort_acks & cleaned_all):
                done = m.coord.get(rid)
                if done is None or done.consensus_reason is None:
                    continue
                del m.coord[rid]
                if m.rank == 0 and done.consensus_reason == TRANSFER_FAILED:
                    failed_out.append(rid)
            if m.rank == 0:
                saves_out, resumed = frozenset(m_saves), set(resumable)
        return PollResult(
            finished_saves=saves_out, resumed_loads=frozenset(resumed), failed_loads=tuple(failed_out),
            released=frozenset(newly_released),
        )

    def forget(self, rid: int) -> None:
        """The request ended another way (finished, cancelled): nothing tracks it as a load any more."""
        for m in self.ranks:
            m.pending_loads.discard(rid)
            m.done_loads.discard(rid)
