"""HEAD waves in helper processes, so a lookup's requests cost the engine's process almost nothing.

Why: the leader's lookup runs in TensorRT-LLM's process, and every millisecond of Python
there is taken from the executor loop (one GIL). obstore sends a HEAD without the GIL, but
each answer still costs ~0.2 ms of Python on the HEAD loop (the future, the retry wrapper,
the metadata). A 128k-token Gemma-3 verify wave is ~344 HEADs: ~75 ms of the engine's CPU,
and the wave's wall time is that CPU, not the network. Measured against a stub S3 that
answers every HEAD after 20 ms, 344 HEADs on this 2-core box: in-process 65 ms wall / 75 ms
of the engine's CPU; one helper process 64 ms / 0.5 ms; two helpers 55 ms / 0.6 ms. With
more cores, more helpers split the wave's CPU, so the wall time approaches one round trip.

Shape: :class:`HeadHelpers` owns up to N helpers (``python -m s3kv.store.headprocs FD``, not
``multiprocessing``: spawn would re-import the engine's ``__main__``, fork would copy a CUDA
process). Each holds its own :class:`~s3kv.store.obstore_store.ObstoreS3Store` built from a
:class:`HelperRecipe` (same bucket, endpoint, region, addressing, options and identity) and
answers a share of a wave over a socket pair. Only HEAD travels: the index, the breaker, the
metrics and every wrapper stay in the engine's process, so the store's contract is unchanged.

Failure policy (no exception may leave a connector call, nothing may hang):

* helpers start in the background on first use; until one is ready, waves run in-process;
* a helper that exits fails its share of the waves in flight as a transient store error
  (those keys are a miss, never a wrong answer) and is restarted after a back-off;
* a helper whose credentials differ from the engine's is never used (a warning says so):
  two identities would make a hit depend on which process asked;
* a share that does not come back within the wave's limit is a ``DeadlineExceeded``;
* a helper that answers no ping within ``PING_TIMEOUT_S`` is wedged (stopped, deadlocked): it
  is killed, its waves in flight end at once as misses, and it is restarted after the back-off.
  Only a ping tells: a helper late only because the store is slow still answers one;
* a helper exits when the engine's end of its socket closes or the engine is gone, so a killed
  engine leaves none; a child the engine forks never uses (or keeps open) its parent's helpers.

Why this is one module: the helper's main loop and the engine's side of it speak one small
protocol; keeping both here keeps them in step.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import itertools
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from ..core.objects import ObjectFormatError, ObjectSpan, span_from_metadata
from .base import (
    AnswerClock,
    BucketNotFound,
    DeadlineExceeded,
    IntegrityError,
    LocalFailure,
    NotFound,
    ObjectInfo,
    PermissionDenied,
    SpanExpect,
    StoreConfigError,
    StoreError,
    TransientError,
)
from .s3 import S3Options

log = logging.getLogger(__name__)

Outcome = ObjectInfo | StoreError | None

#: How long a helper may take to import and build its store before it counts as failed.
START_TIMEOUT_S = 60.0
#: Back-off before a helper that exited is started again (doubling, capped).
RESTART_BACKOFF_S = (5.0, 300.0)
#: Waves a helper runs at once (each blocks one of its threads; the HEADs share one loop).
HELPER_WAVES = 16
#: The engine-helper protocol's version. Why: the helper imports s3kv from disk when it starts,
#: the engine runs what it imported when it started; after s3kv is upgraded in place under a
#: running engine the two may differ, and a helper that misreads the engine's messages would
#: answer nothing (every wave a wait for its limit). A helper speaking another version refuses
#: to serve instead, and the engine runs its waves itself. Raise it with any change to a message.
PROTOCOL = 3


def _checks_fingerprint() -> str:
    """What the helper's answer checks run (``core.objects``, from disk when it starts), named
    by a digest of its source. Why: the engine trusts a span a helper checked; after an upgrade
    in place that changed the object format or its checks, a helper started later would judge
    objects by other rules than the engine's. It then refuses, as for another protocol."""
    from ..core import objects

    try:
        with open(objects.__file__, "rb") as f:
            return hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    except (OSError, TypeError):  # no source file (a frozen build): the format version at least
        return f"version-{objects.VERSION}"


#: The engine's, fixed when it imported this module (the code it runs from then on).
CHECKS = _checks_fingerprint()
#: Keys per helper a wave is split by: ``ceil(keys / MIN_SHARE)`` helpers (5 keys: shares of 3
#: and 2). Why not more: the lookup blocks the scheduler for its wall time, and a helper answers
#: ~0.3 ms of HEADs per key one after another, so a wave spread thin ends soonest. Why not fewer:
#: each share costs the engine's process a message each way and a reader's wake-up (~0.15 ms of
#: CPU). Measured on a 16-core host, 8 helpers, medians of 9 (16k-token prompt): 16 keys a share
#: saved 0.4-0.6 ms of the engine's CPU but cost 2-4 ms of wall time (the probe path's two waves
#: of ~48 HEADs: 52.4-52.9 ms at 4, 54.9-56.9 ms at 16). Since helpers check answers themselves
#: (``head_many_checked``), the same host's strict-summary 16k lookup (one wave of 44 HEADs),
#: two runs, medians of 10: client CPU 2.56/2.12 ms at 4, 1.93/1.90 at 12, 1.88/1.61 at 24;
#: wall 27.6/26.4, 27.6/27.2 and 30.0/28.8 ms. One ``s3kv bench lookup`` run at 12 had the probe
#: path's 16k wall at 85 ms (56-59 at 4), but three alternating pairs after it (medians of 5 each)
#: showed that as noise: probe wall 59/72/68 ms at 4, 81/61/56 at 12; client CPU probe 3.96 ->
#: 3.62 ms, probe miss 1.79 -> 1.60, strict summary 2.41 -> 2.26 (medians of the three).
MIN_SHARE = 12


def auto_processes(cpus: int | None = None) -> int:
    """Helpers for ``lookup_head_processes = -1``: none on one core (nothing to run them on),
    else half the cores this process may use, 1 to 8. Only the leader's process has them, and
    they sit idle between waves; each takes a share of a wave's CPU. Measured on a 16-core host
    (`s3kv bench lookup`, a 128k-token verify wave of 344 HEADs, 20 ms per request): single runs
    2 helpers 64 ms, 4 helpers 58-63 ms, 8 helpers 51 ms; medians of 5, 8 helpers 50 ms against
    74 ms with the wave in-process."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            cpus = os.cpu_count() or 1
    if cpus < 2:
        return 0
    return max(1, min(8, cpus // 2))


@dataclass(frozen=True)
class HelperRecipe:
    """What a helper needs to build the engine's store again. Sent over the socket, never on a
    command line or in the environment (it may hold keys)."""

    bucket: str
    url: str
    endpoint_url: str
    #: Region and addressing style already resolved; ``head_processes`` 0 (no helpers of helpers).
    options: S3Options
    #: Static credentials (access key, secret, token), or None: boto3's chain in the helper
    #: (roles and SSO refresh there on their own; the helper inherits the engine's environment).
    keys: tuple[str, str, str | None] | None
    profile: str | None
    #: What the helper's credentials must look like: ("static", access key id) or ("chain", method).
    identity: tuple[str, str] | None
    #: The protocol the engine speaks (:data:`PROTOCOL`). 0, the default, is what a recipe from
    #: an engine that predates the number reads as here.
    protocol: int = 0
    #: The engine's :data:`CHECKS`.
    checks: str = ""

    def build(self) -> Any:
        import boto3

        from .obstore_store import ObstoreS3Store

        if self.keys is not None:
            ak, sk, token = self.keys
            session = boto3.session.Session(aws_access_key_id=ak, aws_secret_access_key=sk, aws_session_token=token)
        else:
            session = boto3.session.Session(profile_name=self.profile)
        return ObstoreS3Store(
            self.bucket, endpoint_url=self.endpoint_url, options=self.options, session=session, url=self.url
        )


def identity_of(session: Any, static: bool) -> tuple[str, str] | None:
    """The part of a session's identity two processes must share (see :class:`HelperRecipe`)."""
    creds = session.get_credentials()
    if creds is None:
        return None
    if static:
        return ("static", creds.get_frozen_credentials().access_key)
    # Temporary credentials differ per process (each assumes the role itself); their source
    # must not.
    return ("chain", str(getattr(creds, "method", "") or ""))


def recipe_for(store: Any, processes: int) -> HelperRecipe:
    """The recipe of an :class:`~s3kv.store.obstore_store.ObstoreS3Store` (its boto3 twin holds
    the resolved endpoint, region, addressing style and session)."""
    from botocore.credentials import RefreshableCredentials

    boto = store._boto
    session = boto._session
    style = boto._client.meta.config.s3.get("addressing_style", "auto")
    opts = store.options
    options = replace(
        opts,
        region=store.region,
        addressing_style=style,
        head_processes=0,
        # The wave is split over the helpers: together they keep head_concurrency in flight.
        head_concurrency=max(1, -(-opts.head_concurrency // max(1, processes))),
    )
    creds = session.get_credentials()
    static = creds is not None and not isinstance(creds, RefreshableCredentials)
    keys = None
    if static:
        frozen = creds.get_frozen_credentials()
        keys = (frozen.access_key, frozen.secret_key, frozen.token)
    # "default" is what boto3 names no profile at all; passing it on would make the helper skip
    # the environment's credentials for that profile's.
    profile = None if session.profile_name == "default" else session.profile_name
    return HelperRecipe(
        store.bucket, store.url, store.endpoint_url, options, keys, profile, identity_of(session, static), PROTOCOL,
        CHECKS,
    )


# -- wire format ----------------------------------------------------------------------------
# A helper answers a share with one entry per key, in order: None (missing), (size, metadata,
# last modified) (found), or _Err (failed). Tuples, not ObjectInfo: the key is known to the
# asker, and a tuple pickles in a fraction of the time.


@dataclass(frozen=True)
class _Err:
    kind: str
    message: str
    key: str | None


_ERRORS: dict[str, type[StoreError]] = {
    c.__name__: c
    for c in (
        StoreError, NotFound, TransientError, PermissionDenied, BucketNotFound, DeadlineExceeded,
        IntegrityError, StoreConfigError, LocalFailure,
    )
}


def _encode(outcome: Outcome, same: dict[str, str] | None = None, expect: SpanExpect | None = None) -> Any:
    """``same``: one answer's table of strings seen so far. Objects of one group carry the same
    metadata names and mostly the same values (namespace, group, shard, page size...): sent as
    one string object each, pickle writes them once per answer and the engine unpickles them
    once -- a third less of the engine's CPU for a wave's answer (344 objects x 9 names)."""
    if outcome is None:
        return None
    if isinstance(outcome, ObjectInfo):
        if expect is not None:
            # Checked here, off the engine's GIL: a passing answer is its span (three ints, not
            # nine metadata strings); one that fails goes back whole, for the engine to check
            # again and report why.
            with contextlib.suppress(ObjectFormatError):
                span = span_from_metadata(expect[0], outcome.metadata, outcome.size, outcome.key, end=expect[1])
                return (outcome.size, span.first, span.count, outcome.last_modified)
        if same is None:
            return (outcome.size, dict(outcome.metadata), outcome.last_modified)
        one = same.setdefault
        return (outcome.size, {one(k, k): one(v, v) for k, v in outcome.metadata.items()}, outcome.last_modified)
    kind = next((c.__name__ for c in type(outcome).__mro__ if c.__name__ in _ERRORS), "StoreError")
    return _Err(kind, str(outcome), outcome.key)


def _decode(key: str, wire: Any) -> Outcome:
    if wire is None:
        return None
    if isinstance(wire, _Err):
        cls = _ERRORS.get(wire.kind, StoreError)
        exc = cls.__new__(cls)
        Exception.__init__(exc, wire.message)  # the message already names the object
        exc.key = wire.key
        return exc
    if len(wire) == 4:  # checked in the helper: (size, first, count, last modified)
        size, first, count, last_modified = wire
        return ObjectInfo(key, size, {}, last_modified, span=ObjectSpan(first, count))
    size, metadata, last_modified = wire
    return ObjectInfo(key, size, metadata, last_modified)


# -- the engine's side ----------------------------------------------------------------------


class _HelperGone(Exception):
    """Internal: the helper exited (or its socket broke) before answering."""


#: How the helper starts: the engine's ``sys.path`` arrives first on the socket, so the helper
#: imports this very s3kv (and nothing from its working directory or from PYTHONPATH ahead of the
#: standard library: ``-I``), then serves. ``-c``, not ``-m`` or ``multiprocessing``: spawn would
#: re-import the engine's ``__main__``, fork would copy a CUDA process, and under ``-m`` this
#: module would be ``__main__`` (its classes would unpickle on no other side).
_BOOT = (
    "import sys; from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
    "sys.path[:] = c.recv(); from s3kv.store.headprocs import main; main(c)"
)
#: A send that cannot go out in this long means the helper stopped reading (wedged or stopped);
#: a message that does not arrive whole in this long, that it stopped writing.
_SEND_TIMEOUT_S = 2
#: A helper pinged answers from its main loop, which waits on nothing but the socket (the HEADs
#: run on its pool and loop threads), so a slow store cannot delay the answer; silence this long
#: means the process is stopped or wedged. Generous: a false call costs a restart and a miss.
PING_TIMEOUT_S = 2.0
#: A helper with shares in flight that has sent nothing for this long is pinged.
_SILENT_S = 2.0
#: How often each side wakes when its socket is quiet: the engine's reader to enforce pings and
#: notice a helper that exited, the helper to notice that the engine is gone.
_WATCH_S = 1.0
#: The ping (a pong is an answer whose request id is None).
_PING = "ping"
#: A helper ending again for a reason already logged is logged again after this long: a helper
#: that keeps dying should not go quiet in the log after its first time.
_WARN_EVERY_S = 600.0


def helper_env() -> dict[str, str]:
    """A helper's environment: the engine's, less every ``S3KV_`` variable. The helper's whole
    configuration arrives on the socket (:class:`HelperRecipe`), and some of those variables hold
    secrets a store client has no use for (an inline ``S3KV_INTEGRITY_KEY``, previous keys): a
    process that needs no secret must not hold one (its environment is readable in /proc by the
    same user, and lands in crash reports). The rest stays: boto3's credential chain reads it."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("S3KV_")}


class _Helper:
    """One helper process and the thread that reads its answers.

    Why the reader thread alone closes the socket: closing a descriptor that another thread is
    blocked on does not wake it, and the number may be reused at once (in a CUDA process, by a
    driver handle). Everything else stops a helper by killing its process; the reader then sees
    the end of the stream, closes, and reaps.
    """

    def __init__(self, index: int, recipe: HelperRecipe, answers: AnswerClock | None = None):
        self.index = index
        self.recipe = recipe
        #: Where shares the store answered are noted (the helpers' ``AnswerClock``).
        self.answers = answers if answers is not None else AnswerClock()
        self.ready = False
        self.done = threading.Event()  # set when it has exited or failed to start
        self.failure = ""
        self.pid: int | None = None
        #: The helper's own CPU seconds, as of its last answer (benchmarks add it to the engine's).
        self.cpu_s = 0.0
        #: Shares answered: a helper that answered is healthy (its restart back-off resets).
        self.answered = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._dead = False
        #: Shares sent and not answered: request id -> (their future, when the share was sent).
        self._pending: dict[int, tuple[cf.Future[list[Any]], float]] = {}
        self._ids = itertools.count()
        #: When the ping now unanswered was sent, and when the helper last sent anything.
        self._ping_sent: float | None = None
        self._heard = 0.0
        #: The helper's end of the socket while it is being started (a fork then must close it).
        self._theirs: socket.socket | None = None

    def start(self) -> None:
        """Spawn the process and the reader thread; never raises (a failure marks it done)."""
        try:
            ours, theirs = socket.socketpair()
            # A full socket buffer means a helper that stopped reading: fail it, never block on it.
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_TIMEOUT_S, 0))
            # And a message begun but not finished in as long means a helper stopped mid-send: the
            # reader must not block in recv for ever (it would never enforce a ping again).
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", _SEND_TIMEOUT_S, 0))
            self._theirs = theirs
            with theirs, self._lock:
                if self._dead:  # closed while this thread was on its way
                    ours.close()
                    return
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _BOOT, str(theirs.fileno())],
                    env=helper_env(),
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    close_fds=True,
                )
                self.pid = self._proc.pid
            self._theirs = None
            self._conn = Connection(ours.detach())
            self._conn.send([p for p in sys.path if isinstance(p, str)])
            self._conn.send(self.recipe)
            threading.Thread(target=self._read, name=f"s3kv-headproc-{self.index}", daemon=True).start()
        except Exception as exc:
            self._fail(f"could not start: {type(exc).__name__}: {exc}")
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            self._reap()

    def _read(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            if not conn.poll(START_TIMEOUT_S):
                raise _HelperGone(f"was not ready after {START_TIMEOUT_S:g}s")
            kind, detail, self.cpu_s = conn.recv()
            if kind != "ready":
                raise _HelperGone(str(detail))
            if detail != self.recipe.identity:
                raise _HelperGone(
                    f"resolved other credentials ({detail}) than the engine ({self.recipe.identity}); "
                    f"give both the same credentials, or set S3KV_LOOKUP_HEAD_PROCESSES=0"
                )
            self._heard = time.monotonic()
            with self._lock:  # not after a _fail (stop, close) that came first
                self.ready = not self._dead
            # One poll object, not Connection.poll (which builds a selector per call: ~5 us more
            # of the engine's CPU for each answer). A hang-up or error also wakes it; recv then says so.
            quiet = select.poll()
            quiet.register(conn.fileno(), select.POLLIN)
            while True:
                if not quiet.poll(_WATCH_S * 1000):
                    now = time.monotonic()
                    # Judged only with nothing to read as of now: after a stall of this thread (the
                    # GIL held elsewhere) the pong may be waiting in the socket.
                    if not quiet.poll(0):
                        self._watch(now)
                    continue
                rid, wire, self.cpu_s = conn.recv()
                self._heard = time.monotonic()
                if rid is None:  # a pong
                    with self._lock:
                        self._ping_sent = None
                    continue
                with self._lock:
                    pending = self._pending.pop(rid, None)
                self.answered += 1
                if pending is not None:
                    fut, asked = pending
                    if any(w is None or not isinstance(w, _Err) for w in wire):
                        self.answers.note(asked)  # the store answered (found or missing) this share
                    if not fut.done():
                        fut.set_result(wire)
        except _HelperGone as exc:
            self._fail(str(exc))
        except BlockingIOError:  # SO_RCVTIMEO: part of a message, then nothing
            self._fail(f"stopped in the middle of an answer for {_SEND_TIMEOUT_S}s (stopped or wedged)")
        except (EOFError, OSError) as exc:
            self._fail(f"exited ({type(exc).__name__})")
        except Exception as exc:  # a garbled message: never let the reader die silently
            self._fail(f"sent something unreadable: {type(exc).__name__}: {exc}")
        finally:
            # Under the send lock: a send in progress must not write into a descriptor number
            # that closing frees (and the process may reuse at once). Sends time out, so this waits
            # at most _SEND_TIMEOUT_S.
            with contextlib.suppress(Exception), self._send_lock:
                conn.close()
            self._reap()

    def _watch(self, now: float) -> None:
        """The reader's check while the socket is quiet: the process still runs, a ping sent is
        answered in time, and one that has gone silent with shares in flight is pinged."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:  # exited, though its socket lives on in a fork
            raise _HelperGone(f"exited (code {proc.returncode})")
        with self._lock:
            sent = self._ping_sent
            silent = bool(self._pending) and now - self._heard > _SILENT_S
        if sent is not None and now - sent > PING_TIMEOUT_S:
            raise _HelperGone(f"answered no ping within {PING_TIMEOUT_S:g}s (stopped or wedged)")
        if silent:
            self.ping()

    def ping(self) -> None:
        """Ask for a sign of life (unless one is awaited); the reader fails a helper that gives none."""
        # Never behind another sender (a wave's caller must not wait for it): a send in progress
        # is being answered anyway, and the next quiet second pings again.
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                if self._dead or not self.ready or self._conn is None or self._ping_sent is not None:
                    return
                self._ping_sent = time.monotonic()
                conn = self._conn
            conn.send(_PING)
        except Exception as exc:
            self._fail(f"stopped taking requests ({type(exc).__name__})")
        finally:
            self._send_lock.release()

    def let_go(self) -> None:
        """In a child the engine forked: let go of this helper without touching it. Its
        process and socket are the parent's; the child's copies of the descriptors are closed
        (so the helper still sees the end when the parent dies) and nothing is sent or killed.
        Locks are made anew: another thread of the parent may have held them at the fork."""
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._dead = True
        self.ready = False
        self.failure = "belongs to the parent process"
        self._pending = {}
        self._proc = None
        conn, self._conn = self._conn, None
        theirs, self._theirs = self._theirs, None
        for end in (conn, theirs):
            if end is not None:
                with contextlib.suppress(Exception):
                    end.close()
        self.done = threading.Event()
        self.done.set()

    def _fail(self, why: str) -> None:
        """Mark it dead, answer everything waiting on it, kill the process. Idempotent; never blocks."""
        with self._lock:
            if self._dead:
                return
            self._dead = True
            self.ready = False
            self.failure = why
            pending, self._pending = self._pending, {}
            proc = self._proc
        for fut, _asked in pending.values():
            if not fut.done():
                fut.set_exception(_HelperGone(why))
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception):
                proc.kill()
        self.done.set()

    def _reap(self) -> None:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5.0)

    def ask(
        self, keys: list[str], deadline: float, expect: list[SpanExpect | None] | None = None
    ) -> cf.Future[list[Any]]:
        """Send a share; ``deadline`` (monotonic, which Linux keeps one clock for across
        processes) is when the asker stops waiting: a share the helper takes up later is not sent."""
        fut: cf.Future[list[Any]] = cf.Future()
        rid = next(self._ids)
        with self._lock:  # registered under the lock _fail takes: it is answered either way
            if self._dead or not self.ready or self._conn is None:
                fut.set_exception(_HelperGone(self.failure or "not ready"))
                return fut
            self._pending[rid] = (fut, time.monotonic())
            conn = self._conn
        try:
            with self._send_lock:
                conn.send((rid, keys, deadline, expect))
        except Exception as exc:  # a closed socket, or a send that timed out
            self._fail(f"stopped taking requests ({type(exc).__name__})")
        return fut

    def forget(self, fut: cf.Future[list[Any]]) -> None:
        with self._lock:
            for rid, (f, _asked) in list(self._pending.items()):
                if f is fut:
                    del self._pending[rid]

    def say_goodbye(self) -> None:
        """Ask it to exit (it finishes no more waves); the caller then :meth:`stop`s it."""
        with self._lock:
            if self._dead:
                return
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception), self._send_lock:
                conn.send(None)

    def stop(self, deadline: float) -> None:
        """Wait for it to exit until ``deadline`` (monotonic), then kill it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._fail("was closed")


class HeadHelpers:
    """The helpers of one store: started on first use, restarted after a back-off, closed with it."""

    def __init__(self, recipe: HelperRecipe, processes: int, *, restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S):
        if processes < 1:
            raise ValueError(f"HeadHelpers needs processes >= 1, got {processes}")
        self.recipe = recipe
        self.processes = processes
        self._backoff = restart_backoff_s
        self._lock = threading.Lock()
        self._helpers: list[_Helper | None] = [None] * processes
        self._retry_at = [0.0] * processes
        self._delay = [restart_backoff_s[0]] * processes
        self._closed = False
        #: Shares the store answered, from every helper (``ObjectStore.answered_since``).
        self.answers = AnswerClock()
        #: When each reason a helper ended was last logged (repeated at most every _WARN_EVERY_S).
        self._warned: dict[str, float] = {}
        #: Counters for tests and the bench: waves (shares) sent to helpers, helpers started.
        self.waves_offloaded = 0
        self.starts = 0
        self._retired_cpu_s = 0.0
        #: Where the next wave's shares start, so waves too small for every helper take turns.
        self._turn = itertools.count()
        # A child forked from the engine (multiprocessing's fork start method, a forking worker
        # pool) must not use these helpers: request ids repeat across the fork, so its answers
        # could be read against the parent's keys. It lets go of them and runs its waves itself.
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _let_go_in_child(ref))

    def _let_go(self) -> None:
        self._lock = threading.Lock()  # may have been held by a thread the fork did not copy
        self._closed = True
        helpers, self._helpers = self._helpers, [None] * self.processes
        for h in helpers:
            if h is not None:
                h.let_go()

    def _tend(self) -> list[_Helper]:
        """The ready helpers; (re)starts the missing ones whose back-off has passed."""
        if os.getpid() != self._pid:  # a forked child whose at-fork hook did not run (a C-level fork)
            return []
        now = time.monotonic()
        ready: list[_Helper] = []
        with self._lock:
            if self._closed:
                return []
            for i, h in enumerate(self._helpers):
                if h is not None and h.done.is_set():
                    self._note_failure(h)
                    self._retired_cpu_s += h.cpu_s
                    if h.answered:  # it served: whatever ended it, start again from the shortest wait
                        self._delay[i] = self._backoff[0]
                    self._retry_at[i] = now + self._delay[i]
                    self._delay[i] = min(self._delay[i] * 2, self._backoff[1])
                    self._helpers[i] = h = None
                if h is None and now >= self._retry_at[i]:
                    h = self._helpers[i] = _Helper(i, self.recipe, self.answers)
                    self.starts += 1
                    # Spawning takes milliseconds: not on the caller's (the scheduler's) thread.
                    try:
                        threading.Thread(target=h.start, name=f"s3kv-headproc-start-{i}", daemon=True).start()
                    except RuntimeError as exc:  # no thread to be had: try again after the back-off
                        h._fail(f"could not start: {exc}")
                elif h is not None and h.ready:
                    ready.append(h)
        return ready

    def _note_failure(self, h: _Helper) -> None:
        now = time.monotonic()
        if now - self._warned.get(h.failure, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[h.failure] = now
            log.warning(
                "s3kv: a lookup helper process (pid %s) %s; its share of HEAD waves runs in the "
                "engine's process until it is back (S3KV_LOOKUP_HEAD_PROCESSES)", h.pid, h.failure,
            )

    def ready_count(self) -> int:
        return len(self._tend())

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Start the helpers and wait until all are ready (benchmarks and tests: measure the
        helpers, not the in-process waves of the first seconds). Whether they all came up."""
        deadline = time.monotonic() + timeout
        while self.ready_count() < self.processes:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stats(self) -> dict[str, float]:
        """For metrics, without starting anything: helpers ready now, helper starts so far
        (restarts included), wave shares sent to helpers, the helpers' CPU seconds."""
        with self._lock:
            live = [h for h in self._helpers if h is not None]
            cpu = self._retired_cpu_s + sum(h.cpu_s for h in live)
        return {
            "ready": float(sum(1 for h in live if h.ready)),
            "starts": float(self.starts),
            "shares": float(self.waves_offloaded),
            "cpu_s": cpu,
        }

    def pids(self) -> list[int]:
        with self._lock:
            return [h.pid for h in self._helpers if h is not None and h.pid is not None and not h.done.is_set()]

    def cpu_s(self) -> float:
        """CPU seconds the helpers have spent, as of their last answers (helpers that exited
        included): what a benchmark adds to the engine's own CPU to count a lookup whole."""
        with self._lock:
            return self._retired_cpu_s + sum(h.cpu_s for h in self._helpers if h is not None)

    def head_many(
        self, keys: Sequence[str], limit_s: float, expect: Mapping[str, SpanExpect] | None = None
    ) -> list[Outcome] | None:
        """Outcomes of ``keys`` (in order) from the ready helpers, or None when none is ready
        (the caller then runs the wave itself). Never raises; waits at most ``limit_s``, plus
        ``_SEND_TIMEOUT_S`` for each helper asked that stopped reading (a full socket) and has not
        yet been found out by its ping."""
        ready = self._tend()
        if not ready:
            return None
        deadline = time.monotonic() + limit_s
        n = min(len(ready), max(1, -(-len(keys) // MIN_SHARE)))
        first = next(self._turn) % len(ready)
        ready = (ready[first:] + ready[:first])[:n]
        shares = [list(keys[i::n]) for i in range(n)]
        if expect:
            # Integrity keys never leave the engine's process: such objects come back whole.
            expect = {k: e for k, e in expect.items() if e[0].integrity is None}
        asked = [
            (h, share, h.ask(share, deadline, [expect.get(k) for k in share] if expect else None))
            for h, share in zip(ready, shares, strict=True) if share
        ]
        with self._lock:  # waves come from several lookup threads at once
            self.waves_offloaded += len(asked)
        out: dict[str, Outcome] = {}
        for h, share, fut in asked:
            try:
                wire = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                got: list[Outcome] = [_decode(k, w) for k, w in zip(share, wire, strict=True)]
            except cf.TimeoutError:
                h.forget(fut)
                # Late because the store is slow, or because the helper is wedged: only a ping
                # tells (a late answer, or another helper's early one, says nothing of this one).
                h.ping()
                got = [DeadlineExceeded(f"S3 head: no answer from helper {h.index} within {limit_s:g}s", key=k) for k in share]
            except Exception as exc:  # _HelperGone, or an answer of the wrong shape
                # Ours, not the store's: the breaker must not count a dying helper against S3.
                got = [LocalFailure(f"S3 head: lookup helper {h.index} failed: {exc}", key=k) for k in share]
            out.update(zip(share, got, strict=True))
        return [out[k] for k in keys]

    def close(self) -> None:
        if os.getpid() != self._pid:  # the helpers are the parent's: say nothing to them
            return
        with self._lock:
            self._closed = True
            helpers, self._helpers = self._helpers, [None] * self.processes
        live = [h for h in helpers if h is not None]
        for h in live:  # all asked to stop first, so they wind down together
            h.say_goodbye()
        deadline = time.monotonic() + 2.0
        for h in live:
            h.stop(deadline)


def _let_go_in_child(ref: weakref.ref[HeadHelpers]) -> None:
    helpers = ref()
    if helpers is not None:
        helpers._let_go()


# -- the helper's side ----------------------------------------------------------------------


def main(conn: Connection) -> None:
    """A helper's life (started by :data:`_BOOT`): serve, then leave at once (``os._exit``: the
    HEAD loop's daemon thread may still hold the interpreter at shutdown)."""
    code = 1
    try:
        code = _serve(conn)
    finally:
        os._exit(code)


def _serve(conn: Connection) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the engine decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = os.getppid()  # first: the engine may die while the store is built
    try:
        recipe: HelperRecipe = conn.recv()
    except (EOFError, OSError):
        return 0
    if getattr(recipe, "protocol", 0) != PROTOCOL:
        with contextlib.suppress(Exception):
            conn.send(("error", f"speaks protocol {PROTOCOL}, the engine {getattr(recipe, 'protocol', 0)} (s3kv "
                       f"was upgraded under a running engine: restart it)", time.process_time()))
        return 1
    if getattr(recipe, "checks", "") != CHECKS:
        with contextlib.suppress(Exception):
            conn.send(("error", "checks objects by other code than the engine (s3kv was upgraded under a running "
                       "engine: restart it)", time.process_time()))
        return 1
    try:
        store = recipe.build()
        static = recipe.keys is not None
        conn.send(("ready", identity_of(store._boto._session, static), time.process_time()))
    except Exception as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"could not build its store: {type(exc).__name__}: {exc}", time.process_time()))
        return 1
    send_lock = threading.Lock()

    def answer(rid: int, keys: list[str], deadline: float, expect: list[SpanExpect | None] | None = None) -> None:
        try:
            if time.monotonic() >= deadline:
                # Queued behind other waves (a slow store) until the engine stopped waiting: its
                # HEADs would only hold slots and cost requests for an answer nobody reads.
                raise DeadlineExceeded("the engine stopped waiting before this helper took up its share")
            batch = store.head_many(keys)
            same: dict[str, str] = {}
            checks = expect if expect is not None else [None] * len(keys)
            wire = [  # neither found nor failed: missing
                _encode(batch.found.get(k) or batch.failed.get(k), same, e) for k, e in zip(keys, checks, strict=True)
            ]
        except DeadlineExceeded as exc:
            wire = [_Err("DeadlineExceeded", f"S3 head: {exc}", k) for k in keys]
        except BaseException as exc:  # the engine must get an answer for every key it asked
            wire = [_Err("StoreError", f"S3 head in a lookup helper: {type(exc).__name__}: {exc}", k) for k in keys]
        with contextlib.suppress(OSError, ValueError), send_lock:
            conn.send((rid, wire, time.process_time()))

    pool = cf.ThreadPoolExecutor(max_workers=HELPER_WAVES, thread_name_prefix="s3kv-headproc")
    while True:
        try:
            if not conn.poll(_WATCH_S):
                # The engine is gone though its socket is not closed (a child it forked holds it).
                if os.getppid() != engine:
                    break
                continue
            msg = conn.recv()
        except (EOFError, OSError):  # the engine closed its end, or died
            break
        if msg is None:
            break
        if msg == _PING:  # answered here, never queued behind HEADs: it proves this loop runs
            with contextlib.suppress(OSError, ValueError), send_lock:
                conn.send((None, None, time.process_time()))
            continue
        pool.submit(answer, *msg)
    pool.shutdown(wait=False, cancel_futures=True)
    with contextlib.suppress(Exception):
        store.close()
    return 0
