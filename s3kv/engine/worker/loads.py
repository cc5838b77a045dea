"""Load jobs on one rank, and the failure rungs of a promised load that cannot complete.

``start_load_kv`` groups the plan's ``LoadOp``s by object and reads each on a download thread
(header + wanted pages, verified in staging before any host->device copy); an object this rank's
host tier holds is checked and its copies enqueued right there instead. Sync requests are
waited for inside ``start_load_kv`` (downloads and verification); on CUDA their host->device
copies overlap the first layers and the forward stream waits for a group's copies in
``wait_for_layer_load`` of that group's layers. Async requests (``metadata.async_load_ids``)
are reported from ``get_finished`` once their pages are on the device (every id exactly once,
after it was handed in).

A load that fails after the store's retries is quarantined (the index remembers the object as
missing, so later lookups miss; objects of the same plan it never verified are suspects, read once
in the background) and then: rung 1, on engines with a failed-load hook, the id
goes to ``take_failed_load_request_ids`` and the engine recomputes it; rung 3, otherwise, the
request stays parked and its objects are re-read with backoff until the load succeeds or the
request is cancelled (it arrives in ``finished_gen_req_ids``). Before a request is failed or
released, no copy of its may still land in its pages (``_quiesce``). See docs/failures.md.

Why this is one module: the failure rungs act on the load jobs' own state (parked loads, jobs to
quiesce, retries); split, each half would reach into the other's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ...config import Settings
from ...core.cost import stream_share
from ...core.errors import LoadFailed
from ...core.plan import ConnectorMetadata
from ...transfer.copies import Copier
from ...transfer.counters import Counters
from ...transfer.download import DONE, FAILED, PENDING, PLACING, Downloader, LoadJob, build_jobs
from ...transfer.hosttier import HostTier
from ..verdicts import Verdicts
from .rank import RankLayout

log = logging.getLogger("s3kv.worker")

#: (object key or None, reason) of a failed load, by request id.
Failures = dict[int, tuple[str | None, str]]


class LoadTimeout(Exception):
    """A promised load did not complete within ``settings.load_timeout_s``, or its read stalled
    (``settings.load_stall_s``)."""


#: ``load_stall_s`` is per this many bytes a read fetches (s3kv's objects are ~32 MiB).
_STALL_UNIT = 32 << 20


@dataclass
class AsyncLoad:
    since: float
    declared: bool = False
    handed: bool = False
    jobs: list[LoadJob] = field(default_factory=list)
    #: (key, reason) of a plan error found before any job ran.
    error: tuple[str | None, str] | None = None
    #: Rung 3 (parked, retrying): attempts so far, when to retry next, the jobs to re-read.
    attempts: int = 0
    retry_at: float | None = None
    failed_jobs: list[tuple[LoadJob, list[tuple[int, int]]]] = field(default_factory=list)


#: Audits waiting at most (each reads a whole object, ~30 MiB at s3kv's sizes).
_AUDITS_QUEUED_MAX = 128

#: Failure reasons (exception type names, see ``describe``) by what they say about the object.
_CORRUPT = frozenset({"BadMagic", "HeaderCorrupt", "TruncatedObject", "ChecksumMismatch", "IntegrityError",
                      "ObjectFormatError"})
#: Not ours to judge (another format version, another namespace, another span): never deleted.
_UNUSABLE = frozenset({"UnsupportedVersion", "ForeignObject", "LoadPlanError", "Unauthenticated", "SpanMismatch"})


def plan_jobs(jobs: Sequence[LoadJob], failed: Failures) -> list[LoadJob]:
    """The jobs of the failed requests' plans (taken before quiescing drops their ids)."""
    return [j for j in jobs if j.request_ids & failed.keys()]


def _kind(reason: str) -> str:
    name = reason.split(":", 1)[0]
    if name == "NotFound":
        return "missing"
    if name in _CORRUPT:
        return "corrupt"
    if name in _UNUSABLE:
        return "unusable"
    return "transient"


_BROKEN = "s3kv could not plan the promised load"


def cause(reason: str) -> str:
    """``reason`` (see ``describe``) as one of ``core.errors.PARK_CAUSES``."""
    if reason.startswith(_BROKEN):
        return "broken_promise"  # the engine honoured a point no stored object serves, or a plan mismatch
    if reason.split(":", 1)[0] == "LoadTimeout":
        return "timeout"
    kind = _kind(reason)
    return "store_error" if kind == "transient" else kind


def describe(e: BaseException | None) -> str:
    if e is None:
        return "unknown error"
    return f"{type(e).__name__}: {e}"


class LoadJobs:
    """One rank's loads and their failure rungs. Called under the worker's lock, except
    :meth:`wait_jobs` (a sync load's host wait)."""

    def __init__(self, settings: Settings, index: Verdicts | None, counters: Counters, *, failed_load_hook: bool):
        self.settings, self.index, self.counters = settings, index, counters
        #: The engine polls ``take_failed_load_request_ids`` and recomputes those requests (rung 1).
        self.failed_load_hook = failed_load_hook
        #: load_timeout_s <= 0 means no deadline.
        self.timeout = settings.load_timeout_s if settings.load_timeout_s > 0 else float("inf")
        self.stall_s = settings.load_stall_s
        # Set by attach (register_layout).
        self.rank: RankLayout | None = None
        self.copier: Copier | None = None
        self.downloader: Downloader | None = None
        self.tier: HostTier | None = None
        # The containers below are never replaced, only changed in place (the worker shows them).
        self.jobs: list[LoadJob] = []  # every job whose staging may still be held
        self.group_events: dict[int, list[Any]] = {}  # sync copies the forward has not waited on
        self.parked: dict[int, AsyncLoad] = {}  # async loads by request id
        self.failed_report: set[int] = set()  # for take_failed_load_request_ids
        self.retry_base_s = 0.5
        self.retry_max_s = 30.0
        # Objects quarantined because a failed load never verified them, while their audit runs:
        # key -> False once a load found the object bad meanwhile (its audit must not release it).
        # The audit thread ends audits: under this lock (with the index's), never the worker's.
        self._suspects: dict[str, bool] = {}
        self._audit_lock = threading.Lock()

    def attach(self, rank: RankLayout, copier: Copier, downloader: Downloader, tier: HostTier | None = None) -> None:
        self.rank, self.copier, self.downloader, self.tier = rank, copier, downloader, tier

    # -- start_load_kv ----------------------------------------------------
    def start(self, md: ConnectorMetadata, stream: Any, now: float) -> tuple[list[LoadJob], Failures] | None:
        """Start every load of the plan: the sync jobs to wait for and the sync requests that
        already failed, or None when there is nothing to wait for."""
        for rid in md.async_load_ids:
            st = self.parked.get(rid)
            if st is None:
                st = self.parked[rid] = AsyncLoad(since=now)
            st.declared = True
        broken: Failures = {
            rid: (None, f"{_BROKEN} (see the leader's log)")
            for rid in md.failed_load_ids
        }
        if not md.loads and not broken:
            return None
        if self.rank is None:
            raise RuntimeError("no KV cache layout registered yet")
        assert self.copier is not None and self.downloader is not None
        self.copier.begin_loads(stream)
        jobs, errors = build_jobs(
            md.loads,
            tp_rank=self.rank.tp_rank,
            is_async=lambda rid: rid in md.async_load_ids,
            resolve=self.rank.resolve,
            deadline=now + self.timeout,
        )
        if self.tier is not None:
            self._from_tier(self.tier, jobs)
        from_store = [j for j in jobs if j.host is None]  # in the order they are submitted below
        for i, job in enumerate(from_store):
            job.streams = stream_share(self.settings.max_concurrency, self.settings.download_threads,
                                       len(from_store), i)
        for rid, err in errors.items():
            log.error("s3kv: request %d: load plan does not fit: %s (object %s)", rid, err[1], err[0],
                      extra={"request_id": rid})
            broken.setdefault(rid, err)
        sync_errors: Failures = {}
        for rid, err in broken.items():
            if rid in md.async_load_ids:
                self.parked[rid].error = err
            else:
                sync_errors[rid] = err
        for job in jobs:
            self.jobs.append(job)
            if job.host is None:  # store reads go out first: theirs is the longer wait
                self.downloader.submit(job)
            if job.is_async:
                for rid in job.request_ids:
                    self.parked[rid].jobs.append(job)
        if self.tier is not None:
            # Host tier hits are placed here and now (their copies are asynchronous on the load
            # stream all the same); one whose entry failed its check reads the store after all.
            for job in self.downloader.serve_hits([j for j in jobs if j.host is not None]):
                self.downloader.submit(job)
        sync_jobs = [j for j in jobs if not j.is_async]
        if not sync_jobs and not sync_errors:
            return None
        return sync_jobs, sync_errors

    def _from_tier(self, tier: HostTier, jobs: Sequence[LoadJob]) -> None:
        """Here, in plan order (the tier's state follows the plan on every rank): each job whose
        object this rank's tier holds loads from it; a job that reads at least half of an object
        from the store may read all of it into a tier reservation, so it is held here for the next
        hit (a hit usually ends a block or two before the object it reads from: the prompt's last
        token is computed). Hits first: a reservation must not evict an object this plan loads.

        Reading the whole object costs GETs the load does not need (range splits); it is done
        only where the tier's promoted objects are read here again often enough to save as many:
        behind a device prefix cache that serves the repeats, none is read again, and promoting
        every load cost 11% more GETs (family chat, 4 engines, affinity) for no tier hit."""
        for job in jobs:
            got = tier.acquire(job.key)
            if got is not None:
                job.host, job.host_buf = got
            elif job.plan_host:
                # Rank 0's tier holds it, this rank's does not (a save or read that failed here):
                # the store serves it, or the load fails (docs/failures.md) -- never a wrong byte.
                self.counters.add("host_divergence")
        share = tier.promotion_read_share()
        for job in jobs:
            if job.host is not None or 2 * len({o for o, _ in job.targets}) < job.count:
                continue
            pages, whole = job.read_requests(tier.page_bytes(job.key, job.identity))
            if whole - pages > share * pages:
                self.counters.add("host_promotions_declined")
                continue
            e = tier.reserve(job.key, job.identity, job.first, job.count, promoted=True)
            if e is not None and e.buf is not None:
                job.promote, job.host_buf = e, e.buf.retain()

    def wait_jobs(self, jobs: list[LoadJob], deadline: float) -> None:
        for job in jobs:
            if job.finished:  # a host tier hit placed in ``start``, or done already
                continue
            fut = job.future
            assert fut is not None
            while not job.finished:
                now = time.monotonic()
                if now >= deadline or self._stalled(job, now):
                    break
                try:  # in steps: whether the read stalled is judged as it goes
                    step = min(deadline - now, 0.05 if self.stall_s > 0 else float("inf"))
                    fut.result(timeout=None if step == float("inf") else step)
                except (FutureTimeout, CancelledError):
                    pass
            if not job.finished:
                if not self._cancel(job, stalled=self._stalled(job, time.monotonic())):
                    # Already placing pages: local copies, finish them rather than leave them half done.
                    try:
                        fut.result()
                    except CancelledError:
                        pass

    def sync_results(self, sync_jobs: list[LoadJob], sync_errors: Failures) -> Failures:
        """After the wait: queue the done jobs' copies for the forward; the requests that failed."""
        failed: Failures = dict(sync_errors)
        for job in sync_jobs:
            if job.state == DONE:
                self.group_events.setdefault(job.group, []).append(job.event)
            else:
                for rid in job.request_ids:
                    failed.setdefault(rid, (job.key, describe(job.error)))
        return failed

    def fail_now(self, failed: Failures, plan: Sequence[LoadJob] = ()) -> None:
        """Sync loads that failed: no copy may still land, and the ids are reported where the
        engine polls failed loads. ``plan``: the jobs their plans ran.

        No TensorRT-LLM line can fail a request whose sync load failed (its failed-load path
        covers async loads only), so the TensorRT-LLM leader plans none (``trtllm/leader.py``):
        from an engine, reaching this is a bug -- the forward runs on unverified pages -- and is
        logged critical. Only a ``LeaderCore`` built with ``failed_load_hook=True`` plans sync
        loads (tests and benchmarks that drive ``WorkerCore`` directly)."""
        self._quiesce(set(failed))
        self._note_failed(failed, plan=plan)
        log.critical("s3kv: sync load failed (no TensorRT-LLM engine can fail its request): %s", failed)
        if self.failed_load_hook:
            self.failed_report |= set(failed)
            self.counters.add("rung_engine_recompute", len(failed))

    def fail_bound(self, md: ConnectorMetadata, reason: str, now: float) -> Failures:
        """Every load of the plan takes the failure rung; returns the sync ones (to ``fail_now``)."""
        rids = {op.request_id for op in md.loads} | set(md.failed_load_ids) | set(md.async_load_ids)
        sync: Failures = {}
        for rid in rids:
            if rid in md.async_load_ids:
                st = self.parked.setdefault(rid, AsyncLoad(since=now))
                st.declared = True
                st.error = (None, reason)
            else:
                sync[rid] = (None, reason)
        return sync

    def take_failed(self) -> set[int]:
        out = set(self.failed_report)
        self.failed_report.clear()
        return out

    # -- the forward --------------------------------------------------------
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Make the forward stream wait for the copies into the layer's group (no host wait)."""
        group = self.rank.layer_group.get(int(layer_idx)) if self.rank is not None else None
        events = self.group_events.pop(group, None) if group is not None else None
        if events and self.copier is not None:
            for ev in events:
                self.copier.wait_on(ev, stream)

    def order_remaining(self, stream: Any) -> None:
        """Copies into groups whose layer hook never ran: order them before later work anyway."""
        if self.group_events and self.copier is not None:
            for events in self.group_events.values():
                for ev in events:
                    self.copier.wait_on(ev, stream)
            self.group_events.clear()

    # -- get_finished -------------------------------------------------------
    def hand(self, rids: Iterable[int], now: float) -> None:
        for rid in rids:
            rid = int(rid)
            st = self.parked.get(rid)
            if st is None:
                st = self.parked[rid] = AsyncLoad(since=now)
            st.handed = True

    def finished(self) -> list[int]:
        """Handed, declared async loads whose pages are all in place: returned (once)."""
        loading: list[int] = []
        for rid, st in list(self.parked.items()):
            if (
                st.handed
                and st.declared
                and st.error is None
                and st.retry_at is None  # not parked for a retry
                and not st.failed_jobs
                and all(j.state == DONE and Copier.done(j.event) for j in st.jobs)
            ):
                loading.append(rid)
                if st.attempts:
                    self.counters.add("parked_loads_recovered")
                    if self.index is not None:  # quarantined while it failed; it is good now
                        self.index.forget(j.key for j in st.jobs)
                    log.warning("s3kv: request %d: load succeeded after %d retries", rid, st.attempts,
                                extra={"request_id": rid})
                del self.parked[rid]
        return loading

    def cancel_parked(self, rid: int) -> None:
        """The request ended while parked: make sure no load copy can still land in its pages
        (the engine frees them once every rank returns the id)."""
        st = self.parked.pop(rid, None)
        if st is not None:
            self._quiesce({rid})
            if st.attempts:
                self.counters.add("parked_loads_cancelled")

    def abandon(self, rid: int) -> None:
        """The engine freed the parked request's pages without telling us and handed them to
        another request (the leader saw them among its new pages): no copy of this load may land
        there from now on -- this runs before the iteration's forward writes the new owner's KV.
        Its id is never returned: no engine waits for a request it terminated (the engine hands
        an id once per load, so a replay of the request with a load of its own starts afresh)."""
        self.parked.pop(rid, None)
        self._quiesce({rid})
        self.failed_report.discard(rid)
        self.counters.add("parked_loads_abandoned")

    def abort(self, rid: int) -> None:
        """The engine aborts the request (its failed-load path, every rank): no copy of its load
        may land from now on, and it is neither returned nor reported again."""
        self.parked.pop(rid, None)
        self.counters.add("loads_aborted")
        self._quiesce({rid})
        self.failed_report.discard(rid)

    def fence(self, rid: int, stage_events: Sequence[Any] = ()) -> None:
        """Make sure no load copy of ``rid`` can land from now on, whatever state an abort that
        raised part-way left behind: its pending targets dropped, jobs already placing waited for,
        and every copy this rank issued (``stage_events`` too) completed -- one job failing here
        does not stop the others. Rare path: a host wait is fine."""
        reason = LoadFailed("request aborted", request_ids={rid})
        try:
            for job in list(self.jobs):
                try:
                    mine = rid in job.request_ids or rid in job.owners.values()
                    if mine and job.drop_requests({rid}, reason):
                        continue
                    if mine and job.future is not None:
                        try:
                            job.future.result()
                        except BaseException:  # noqa: BLE001 - cancelled or failed: nothing placed later
                            pass
                    Copier.synchronize(job.event)
                except Exception:  # noqa: BLE001 - the copy stream is drained below anyway
                    log.exception("s3kv: fencing the load of %s for request %d", job.key, rid)
        finally:
            for ev in stage_events:
                Copier.synchronize(ev)
            if self.copier is not None:
                self.copier.drain()

    def parked_now(self) -> int:
        """Requests parked right now while their load is retried (rung 3)."""
        return sum(1 for st in list(self.parked.values()) if st.attempts)

    def settle(self, now: float) -> None:
        """Parked loads that failed: rung 1 (engine hook) or rung 3 (stay parked, retry with backoff)."""
        for rid, st in list(self.parked.items()):
            if st.retry_at is not None:
                if now >= st.retry_at and st.handed:
                    self._retry(rid, st, now)
                continue
            failed = self._async_failure(st, now)
            if failed is None:
                continue
            key, reason = failed
            # The request's own targets in each job, taken before quiescing drops them from
            # jobs still pending (a retry re-reads exactly these).
            wanted = {id(j): [(o, s) for o, s in j.targets if j.owners.get(s) == rid] for j in st.jobs}
            self._quiesce({rid})
            first_failure = st.attempts == 0
            self._note_failed({rid: failed}, quiet=not first_failure, plan=list(st.jobs))
            if self.failed_load_hook:
                del self.parked[rid]
                self.failed_report.add(rid)
                self.counters.add("rung_engine_recompute")
                continue
            # Rung 3: the merged engine has no way to fail a load, and returning the id would
            # serve unverified KV. The request stays parked (visibly) while the load is retried.
            delay = min(self.retry_max_s, self.retry_base_s * (2 ** min(st.attempts, 16)))
            st.retry_at = now + delay
            st.failed_jobs = [(j, wanted.get(id(j), [])) for j in st.jobs if j.state != DONE]
            st.jobs = [j for j in st.jobs if j.state == DONE]
            why = cause(reason)
            if first_failure:
                self.counters.add("rung_parked_retry")
                self.counters.add(f"parked_cause_{why}")
            st.attempts += 1
            (log.warning if first_failure or st.attempts % 10 == 0 else log.info)(
                "s3kv: request %d stays parked (cause %s): its load failed (%s); retry %d in %.1f s",
                rid, why, reason if not key or key in reason else f"{reason} (object {key!r})", st.attempts, delay,
                extra={"request_id": rid, "key": key, "cause": why},
            )

    def _async_failure(self, st: AsyncLoad, now: float) -> tuple[str | None, str] | None:
        if st.error is not None:
            return st.error
        for job in st.jobs:
            if not job.finished and (now > job.deadline or self._stalled(job, now)):
                self._cancel(job, stalled=now <= job.deadline)
            if job.finished and job.state != DONE:
                return job.key, describe(job.error)
        if st.handed and not st.declared and now - st.since > self.timeout:
            return None, "handed over as loading but no load was ever planned for it"
        return None

    def _retry(self, rid: int, st: AsyncLoad, now: float) -> None:
        """Resubmit the failed objects of a parked request (fresh jobs, fresh deadline)."""
        st.retry_at = None
        if st.error is not None or not st.failed_jobs:
            # Nothing to re-read (the plan itself could not be made): it stays parked until the
            # request is cancelled; say so now and then.
            st.retry_at = now + self.retry_max_s
            return
        assert self.downloader is not None
        hits = []
        for old, targets in st.failed_jobs:
            if not targets:
                continue
            job = dataclasses.replace(
                old, targets=targets, request_ids={rid}, owners={s: rid for _, s in targets},
                state=PENDING, error=None, event=None, buffer=None, future=None, lock=threading.Lock(),
                deadline=now + self.timeout, reading_since=float("inf"), host=None, host_buf=None, promote=None,
            )
            self.jobs.append(job)
            st.jobs.append(job)
            # Rank 0's tier held it when the plan ran; this rank's copy may have been filling still
            # (its upload thread behind rank 0's) -- for a host-only object the store never gets,
            # the tier is where the retry finds it. Read outside the plan: nothing accounted.
            got = self.tier.acquire(job.key, plan=False) if self.tier is not None and job.plan_host else None
            if got is not None:
                job.host, job.host_buf = got
                hits.append(job)
            else:
                self.downloader.submit(job)
        for job in self.downloader.serve_hits(hits):  # an entry that fails its check reads the store
            self.downloader.submit(job)
        st.failed_jobs = []
        self.counters.add("load_retries")

    def _note_failed(self, failed: Failures, *, quiet: bool = False, plan: Sequence[LoadJob] = ()) -> None:
        """Count and log failed loads; quarantine the objects that failed so later lookups miss.
        ``quiet``: a retry of a load already reported (counted as a retry, logged at INFO).
        ``plan``: the jobs the failed requests' plans ran (after quiescing: their end states)."""
        if not quiet:
            self.counters.add("requests_failed", len(failed))
        # Every object the plan found failing, not only the first per request: a request fails on
        # whichever failure is seen first, and an object left out here would be offered again.
        verdicts = {j.key: describe(j.error) for j in plan if j.state == FAILED}
        verdicts.update({k: r for k, r in failed.values() if k})
        bad = sorted(k for k, r in verdicts.items() if _kind(r) != "transient")
        if self.index is not None and verdicts:
            # A stale positive would keep promising the same broken load to every request on this
            # prefix. An object that is gone or bad is remembered as missing for a while (later
            # lookups miss at once); after a store outage the entry is only dropped (the next
            # lookup asks the store again).
            with self._audit_lock:  # one step for an audit ending now: it cannot release these
                self.index.forget(verdicts)
                self.index.quarantine(bad, self.settings.quarantine_s)
                for k in bad:
                    if k in self._suspects:
                        self._suspects[k] = False
        if self.index is not None and bad and plan:
            # One object found gone or bad puts the others of the same plan in doubt (as old, from
            # the same writer or the same lifecycle rule), and a failed load stops at its first
            # failure, so which of them it verified is download-thread luck. Those it did not
            # verify would be offered again as a shorter hit -- through the next broken object, a
            # second failed load (on the merged line a request parked until its client gives up).
            # So they are quarantined as suspects and read once in the background (``_audit``):
            # a good one is released, a bad one stays.
            verified = {j.key for j in plan if j.state in (DONE, PLACING)}
            self._audit({j.key: j for j in plan if j.key not in verified and j.key not in bad})
        corrupt = sorted(k for k in bad if _kind(verdicts[k]) == "corrupt")
        if corrupt:
            self._condemn(corrupt)
        reasons = sorted({f"{r} (object {k!r})" if k and k not in r else r for k, r in failed.values()})
        (log.info if quiet else log.error)("s3kv: promised load failed: %s", "; ".join(reasons),
                                           extra={"request_ids": sorted(failed), "keys": sorted(verdicts)})

    def _condemn(self, corrupt: Sequence[str]) -> None:
        """Corrupt objects (already quarantined): counted, and deleted where the settings say so."""
        self.counters.add("objects_quarantined", len(corrupt))
        if self.settings.delete_corrupt:
            assert self.downloader is not None  # a load failed: the layout is registered
            for k in corrupt:
                try:
                    self.downloader.store.delete_many([k])
                except Exception as e:  # noqa: BLE001 - best effort; engines may lack DeleteObject
                    log.warning("s3kv: could not delete corrupt object %s: %s", k, e)

    def _audit(self, suspects: dict[str, LoadJob]) -> None:
        """Quarantine ``suspects`` now and read each (whole, verified, placed nowhere) once, one
        at a time beside the loads (``Downloader.submit`` of an audit)."""
        if not suspects or self.index is None:
            return
        with self._audit_lock:  # with the check below: an audit ending now cannot undo it unread
            self.index.quarantine(suspects, self.settings.quarantine_s)
            if self.downloader is None:
                return
            # Bounded: past it a suspect stays quarantined unread (for quarantine_s), as a failed
            # object does -- a burst of failures must not queue unbounded gigabytes of reads.
            room = max(0, _AUDITS_QUEUED_MAX - self.downloader.audits_queued())
            new = [j for k, j in suspects.items() if k not in self._suspects][:room]
            self._suspects.update((j.key, True) for j in new)
        # Lowest ordinals first: they are what a shorter hit needs, so they are released soonest.
        for old in sorted(new, key=lambda j: (j.first, j.group)):
            job = LoadJob(
                key=old.key, group=old.group, regions=old.regions, identity=old.identity, first=old.first,
                count=old.count, last_digest=old.last_digest,
                targets=[(old.first + i, i) for i in range(old.count)], request_ids=set(), is_async=True,
                deadline=float("inf"), place=False,
            )
            self.downloader.submit(job)
            assert job.future is not None
            job.future.add_done_callback(functools.partial(self._audited, job))

    def _audited(self, job: LoadJob, _future: object = None) -> None:
        """An audit ended (on the audit thread): release a good object, keep a bad one. One not
        run (the downloader closed first) stays quarantined."""
        assert self.index is not None
        reason = describe(job.error) if job.state == FAILED else None
        bad = reason is not None and _kind(reason) != "transient"
        with self._audit_lock:
            clean = self._suspects.pop(job.key, True)
            if job.state not in (DONE, FAILED):
                return
            if not bad and clean:
                # Verified (or the read said nothing about the object): the next lookup may offer it.
                self.index.forget([job.key])
        if bad:
            log.warning("s3kv: object %s, suspect after a failed load, is bad too (%s): it stays quarantined",
                        job.key, reason, extra={"key": job.key})
            if _kind(reason or "") == "corrupt":
                self._condemn([job.key])
        self.counters.add("objects_audited")

    def _quiesce(self, failed: set[int]) -> None:
        """Before failing requests: make sure no load copy can still land in their slots.

        The engine frees a failed request's pages and may hand them to another
        request at once. Pending jobs forget the failed requests' targets (and are
        cancelled when nothing is left); jobs already placing or placed are waited
        for until their copies completed. Rare path, so a short host wait is fine.
        """
        reason = LoadFailed("request failed", request_ids=failed)
        for job in list(self.jobs):
            if not job.request_ids & failed and not any(r in failed for r in job.owners.values()):
                continue
            if job.drop_requests(failed, reason):
                continue
            if job.future is not None:
                try:
                    job.future.result()
                except CancelledError:
                    pass
            Copier.synchronize(job.event)

    def _stalled(self, job: LoadJob, now: float) -> bool:
        """Whether ``job``'s read stalled: sent longer ago than ``load_stall_s`` per 32 MiB it
        fetches, or still waiting for a connection while no read of this rank ended for longer
        than the largest such limit among the reads holding the connections (then they hang).

        Why not only ``load_timeout_s``: a store that stops answering fails no read until the
        client's own timeouts and retries run out, so a load promised just before a hang stayed
        parked for over a minute. A stalled read is a failed load -- it takes its failure rung
        (docs/failures.md) -- not a wait; a read that is merely slower than the rule allows is
        cut too, so slow links raise ``S3KV_LOAD_STALL_S``.

        Sooner, whatever its size: a read sent (or queued) before the circuit breaker found the
        store answering nothing (``ObjectStore.hung_since``, ``S3KV_BREAKER_STALL_S``) -- behind
        a warm index the loads are all a hung store holds, and waiting out each one's own limit
        kept requests parked and the breaker closed for 25 s (issue 37).
        """
        if job.finished:
            return False
        if self._hung(job):
            return True
        if self.stall_s <= 0:
            return False
        limit = self._stall_limit(job)
        if job.reading_since != float("inf"):
            return now - job.reading_since > limit
        # Waiting for a connection: until one of the reads holding them ends, the wait is as long
        # as the longest of them may healthily take -- a small load queued behind full-object
        # reads is not cut by its own small limit while they stream. That limit is never below the
        # job's own, so a wait within it needs no look at the others (this runs every pass).
        last_end = self.downloader.last_read_end if self.downloader is not None else job.submitted_at
        waited = now - max(job.submitted_at, last_end)
        if waited <= limit:
            return False
        return waited > max([limit, *(self._stall_limit(j) for j in list(self.jobs)
                                      if j.place and j.reading_since != float("inf"))])

    def _hung(self, job: LoadJob) -> bool:
        """Whether ``job``'s read was sent (or queued) before the store was found hung."""
        store = self.downloader.store if self.downloader is not None else None
        since = job.reading_since if job.reading_since != float("inf") else job.submitted_at
        return store is not None and since != float("inf") and store.hung_since(since)

    def _stall_limit(self, job: LoadJob) -> float:
        """``load_stall_s`` per 32 MiB the job fetches (at least ``load_stall_s``)."""
        pages = len({o for o, _ in job.targets}) or 1
        return self.stall_s * max(1.0, pages * job.identity.page_bytes / _STALL_UNIT)

    def _cancel(self, job: LoadJob, stalled: bool = False) -> bool:
        """Give up on a job past its deadline or stalled; False if it is already placing pages."""
        if not stalled:
            why = f"not loaded within load_timeout_s={self.settings.load_timeout_s}"
        elif self._hung(job):
            why = (f"the store answered nothing for breaker_stall_s={self.settings.breaker_stall_s:g} "
                   "while its read was out (circuit breaker open)")
        else:
            why = f"its read stalled (load_stall_s={self.stall_s:g} per 32 MiB)"
        stopped, now = job.try_cancel(LoadTimeout(why))
        if now:
            log.error("s3kv: load of %s given up: %s", job.key, why)
            self.counters.add("loads_failed_objects")
            if stalled and job.reading_since != float("inf") and self.downloader is not None:
                # The read still runs; a hung store never fails it: count it where health is judged.
                self.downloader.store.note_timeout("get", job.key)
        return stopped

    def reap(self) -> None:
        """Free the staging of placed loads whose copies completed."""
        if self.jobs:
            self.jobs[:] = [j for j in self.jobs if not j.release_if_complete(Copier.done)]
