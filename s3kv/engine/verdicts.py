"""Verdicts on objects, from every rank to the leader: which objects a rank found gone or bad
(quarantined), and which it cleared again (an audit that read them whole, a retry that loaded them).

Why: each TensorRT-LLM rank is its own process with its own key index, and only rank 0's worker
shares the leader's. The leader plans every shard's loads from its own index, so an object of
shard 1 that rank 1 found corrupt stayed "present" there: every later request on that prefix was
promised the same failing load -- recomputed after a wasted load with a failed-load hook, and on
the merged line (no hook) parked until its client gave up -- until the leader's index forgot the
entry (``S3KV_INDEX_TTL_S``), and then again, since a HEAD cannot see corrupt bytes.

How: the leader makes a directory of its own on the host (shared memory where there is some;
random name, mode 0700) and names it in every connector metadata, which TensorRT-LLM broadcasts
to every rank. Rank ``r`` appends one JSON line per verdict to ``rank-<r>`` in it; the leader
reads what is new before each lookup (one ``stat`` per rank when nothing is). Verdicts are rare
(a failed load), so the files stay small; the leader removes the directory when it goes, and a
new board removes those of leaders that died without (SIGKILL, OOM): each leader holds an ``flock``
on its directory's ``owner`` file while it lives, which the kernel releases when it dies.

A rank on another host (tensor parallelism across nodes) cannot reach the directory: it says so
once (a WARNING and the ``verdicts_unshared`` counter), and its verdicts reach the leader only
as its index entries expire. Delete corrupt objects there (``S3KV_DELETE_CORRUPT``), so a HEAD
after that sees them gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from .index import KeyIndex

log = logging.getLogger("s3kv.verdicts")

#: Where the directory goes: shared memory (never a disk write), else the temporary directory.
_SHM = "/dev/shm"
#: Keys remembered as quarantined for a rank (oldest forgotten first; their quarantines expire anyway).
_THEIRS_MAX = 65536


#: Every board's directory name starts so.
_PREFIX = "s3kv-verdicts-"
#: The file a live leader holds an exclusive ``flock`` on.
_OWNER = "owner"


def _file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}")


def _remove(path: str, owner: int, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # a child's copy closed does not release the lock: the parent's still holds it
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _hold(directory: str) -> int:
    """Lock ``directory`` (new, empty) as this leader's for as long as the descriptor returned
    stays open. The file is locked under another name and then renamed: a board starting at the
    same moment must never find an ``owner`` file not locked yet and take the directory for dead."""
    making = os.path.join(directory, f".{_OWNER}")
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(making, os.path.join(directory, _OWNER))
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep(base_dir: str) -> int:
    """Remove the boards in ``base_dir`` whose leaders are gone; how many. Never raises.

    Why a lock and not a pid in the name: the kernel drops an ``flock`` when the last descriptor
    of its holder closes, however the process ended, and knows nothing of pid namespaces -- two
    containers sharing /dev/shm see different pids, and a pid test would delete a live board of
    the other. A directory without an ``owner`` file (being made right now, or by an older s3kv)
    is left alone.
    """
    gone = 0
    try:
        names = [n for n in os.listdir(base_dir) if n.startswith(_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(base_dir, name)
        try:
            fd = os.open(os.path.join(path, _OWNER), os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # not ours to judge (no owner file, another user's, gone meanwhile)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its leader lives
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            gone += 1
        finally:
            os.close(fd)
    if gone:
        log.info("s3kv: removed %d verdict directories of leaders that ended without removing them", gone)
    return gone


class VerdictBoard:
    """The leader's end: the directory, and what each rank wrote there applied to its index."""

    def __init__(self, index: KeyIndex, tp_size: int, base_dir: str | None = None):
        if base_dir is None:
            base_dir = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK) else None
        self.index = index
        sweep(base_dir if base_dir is not None else tempfile.gettempdir())
        self.path = tempfile.mkdtemp(prefix=_PREFIX, dir=base_dir)
        try:
            fd = _hold(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._ranks = range(1, tp_size)
        self._read = {r: 0 for r in self._ranks}  # bytes of each rank's file applied so far
        self._lock = threading.Lock()
        # Keys quarantined here for a rank's verdict, by rank: only such a quarantine may that
        # rank's later "forget" lift. The leader quarantines objects for reasons of its own (a
        # finish plan that did not match the pages copied: the bytes verify but may be wrong KV),
        # and a rank that merely saw a transient failure of the same key must not release those.
        self._theirs: OrderedDict[str, int] = OrderedDict()
        # Removed when the leader goes (or at exit): TensorRT-LLM calls no shutdown. Only by this
        # process: a child the engine forks runs the same finalizer when it exits normally, and
        # must not take the directory away from the leader and the ranks still writing to it.
        self._cleanup = weakref.finalize(self, _remove, self.path, os.getpid(), fd)

    @classmethod
    def make(cls, index: KeyIndex, tp_size: int, base_dir: str | None = None) -> VerdictBoard | None:
        """A board, or None (with a WARNING) where no directory can be made: the engine still
        starts; its ranks' verdicts then reach the leader only as its index entries expire."""
        try:
            return cls(index, tp_size, base_dir)
        except Exception as e:  # noqa: BLE001 - an optional channel must not stop the engine
            log.warning("s3kv: no verdict directory for the ranks (%s: %s); objects a rank past 0 finds bad "
                        "are promised again until the leader's index forgets them", type(e).__name__, e)
            return None

    def poll(self) -> int:
        """Apply what the ranks wrote since the last poll; the number of verdicts applied. Never
        raises: a file it cannot read is read again at the next poll."""
        n = 0
        with self._lock:
            for r in self._ranks:
                try:
                    n += self._poll_rank(r)
                except Exception as e:  # noqa: BLE001 - a lookup must never fail for this
                    log.debug("s3kv: reading rank %d's verdicts failed: %s", r, e)
        return n

    def _poll_rank(self, rank: int) -> int:
        path, done = _file(self.path, rank), self._read[rank]
        try:
            if os.stat(path).st_size <= done:
                return 0
        except FileNotFoundError:
            return 0
        with open(path, "rb") as f:
            f.seek(done)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read at the next poll
        self._read[rank] = done + end  # first: a line that fails below is never read again
        n = 0
        for line in data[:end].splitlines():
            if not line:  # each verdict starts with a newline too (``ToLeader._send``)
                continue
            try:
                verdict = json.loads(line)
                keys = [str(k) for k in verdict["keys"]]
                if verdict["op"] == "quarantine":
                    self.index.quarantine(keys, float(verdict["ttl"]))
                    for k in keys:  # newest last: the oldest are forgotten first
                        self._theirs[k] = rank
                        self._theirs.move_to_end(k)
                    while len(self._theirs) > _THEIRS_MAX:
                        self._theirs.popitem(last=False)
                elif verdict["op"] == "forget":
                    lift = [k for k in keys if self._theirs.get(k) == rank]
                    for k in lift:
                        del self._theirs[k]
                    self.index.forget(lift)
                    self.index.forget([k for k in keys if k not in lift], keep_quarantine=True)
                else:
                    continue
                n += 1
            except Exception as e:  # noqa: BLE001 - any line, however garbled: skipped, never fatal
                log.warning("s3kv: rank %d wrote an unreadable verdict (%s): skipped", rank, e)
        return n

    def close(self) -> None:
        self._cleanup()


class Verdicts(Protocol):
    """What the load jobs tell an index: a ``KeyIndex`` on rank 0, a ``ToLeader`` past it."""

    def quarantine(self, keys: Iterable[str], ttl: float) -> None: ...

    def forget(self, keys: Iterable[str]) -> None: ...


class ToLeader:
    """A rank's key index (ranks past 0) that also sends its verdicts to the leader's board.

    Only what a failed load or an audit decides goes there -- ``quarantine`` and ``forget`` --
    not every confirmed upload: rank 0's confirmation stands for every shard (``AllShards``)."""

    def __init__(self, index: KeyIndex, rank: int, on_unshared: Callable[[], None] | None = None):
        self.index = index
        self.rank = rank
        self._on_unshared = on_unshared
        self._lock = threading.Lock()
        self._path: str | None = None  # the board's directory, from the connector metadata
        self._fd: int | None = None
        self._warned = False

    def attach(self, directory: str) -> None:
        """The board named in the latest metadata (cheap when unchanged: once per iteration)."""
        if directory == self._path or not directory:
            return
        with self._lock:
            self._path = directory
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd = None
            try:
                self._fd = os.open(_file(directory, self.rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            except Exception as e:  # noqa: BLE001 - bound every iteration: never into the engine
                self._unshared(f"{type(e).__name__}: {e}", elsewhere=isinstance(e, FileNotFoundError))

    def _unshared(self, why: str, *, elsewhere: bool = False) -> None:
        if self._on_unshared is not None:
            self._on_unshared()
        if not self._warned:
            self._warned = True
            log.warning(
                "s3kv rank %d cannot %s the leader's verdict directory %s (%s)%s. Objects this rank "
                "finds bad are then promised again until the leader's index entries expire "
                "(S3KV_INDEX_TTL_S); S3KV_DELETE_CORRUPT=1 deletes corrupt ones so a HEAD sees them gone",
                self.rank, "reach" if elsewhere else "write to", self._path, why,
                " -- is the leader on another host?" if elsewhere else "",
            )

    def _send(self, op: str, keys: list[str], ttl: float = 0.0) -> None:
        if not keys:
            return
        # A newline before as well as after: a verdict cut short (a full /dev/shm) is then a
        # garbled line of its own, skipped, instead of swallowing the next one.
        line = b"\n" + json.dumps({"op": op, "keys": keys, "ttl": ttl}, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self._fd is None:
                return
            try:
                # One write with O_APPEND: the leader reads whole lines only.
                view = memoryview(line)
                while view:
                    view = view[os.write(self._fd, view):]
            except Exception as e:  # noqa: BLE001 - a full /dev/shm must not fail a load's bookkeeping
                self._unshared(f"{type(e).__name__}: {e}")

    # The index's interface, as the load jobs use it.
    def quarantine(self, keys: Iterable[str], ttl: float) -> None:
        keys = list(keys)
        self.index.quarantine(keys, ttl)
        self._send("quarantine", keys, ttl)

    def forget(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.index.forget(keys)
        self._send("forget", keys)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
