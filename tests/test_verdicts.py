"""Verdicts from ranks past 0 to the leader (s3kv/engine/verdicts.py): what a rank's load finds
bad reaches the leader's index, torn or garbled lines never break a lookup, and a rank that cannot
reach the leader's directory says so instead of failing."""

from __future__ import annotations

import logging
import os

import pytest

from s3kv.core.objects import ObjectSpan
from s3kv.engine.index import MISSING, KeyIndex
from s3kv.engine.verdicts import ToLeader, VerdictBoard


def _index() -> KeyIndex:
    return KeyIndex(1000, 600.0, 5.0)


SPAN = ObjectSpan(first=0, count=4)


def _warm(index: KeyIndex, *keys: str) -> None:
    for k in keys:
        index.put_present(k, SPAN)


def test_a_ranks_quarantine_and_release_reach_the_leaders_index(tmp_path: os.PathLike[str]) -> None:
    leader_index = _index()
    _warm(leader_index, "p/a.1of2/x", "p/a.1of2/y", "p/a.0of2/x")
    board = VerdictBoard(leader_index, tp_size=2, base_dir=str(tmp_path))
    rank_index = _index()
    rank = ToLeader(rank_index, 1)
    rank.attach(board.path)
    rank.quarantine(["p/a.1of2/x", "p/a.1of2/y"], 60.0)
    # Before the leader reads, its index still says present: the poll is what moves it.
    assert leader_index.get("p/a.1of2/x") == SPAN
    assert board.poll() == 1
    assert leader_index.get("p/a.1of2/x") is MISSING and leader_index.get("p/a.1of2/y") is MISSING
    assert leader_index.get("p/a.0of2/x") == SPAN  # rank 0's shard is not touched
    assert rank_index.get("p/a.1of2/x") is MISSING  # and the rank's own index has it too
    rank.forget(["p/a.1of2/y"])  # an audit read it whole and found it good
    assert board.poll() == 1 and board.poll() == 0
    assert leader_index.get("p/a.1of2/y") is None and leader_index.get("p/a.1of2/x") is MISSING
    rank.close()
    board.close()
    assert not os.path.exists(board.path)


def test_a_torn_or_garbled_line_never_breaks_a_lookup(tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture) -> None:
    leader_index = _index()
    _warm(leader_index, "k1", "k2")
    board = VerdictBoard(leader_index, tp_size=3, base_dir=str(tmp_path))
    path = os.path.join(board.path, "rank-2")
    with open(path, "wb") as f:
        f.write(b'{"op":"quarantine","keys":["k1"],"ttl":60}\nnot json\n{"op":"quarantine","keys":["k2"],"tt')
    with caplog.at_level(logging.WARNING, logger="s3kv.verdicts"):
        assert board.poll() == 1  # the whole good line; the garbled one skipped; the torn one waits
    assert "unreadable verdict" in caplog.text
    assert leader_index.get("k1") is MISSING and leader_index.get("k2") == SPAN
    with open(path, "ab") as f:
        f.write(b'l":60}\n')
    assert board.poll() == 1
    assert leader_index.get("k2") is MISSING
    board.close()


def test_a_rank_that_cannot_reach_the_leaders_directory_says_so_once(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Another host (TP across nodes): the directory the metadata names is not there."""
    unshared: list[int] = []
    rank = ToLeader(_index(), 1, lambda: unshared.append(1))
    with caplog.at_level(logging.WARNING, logger="s3kv.verdicts"):
        rank.attach(os.path.join(str(tmp_path), "on-another-host"))
        rank.attach(os.path.join(str(tmp_path), "on-another-host"))  # every iteration names it again
        rank.quarantine(["k"], 60.0)
    assert unshared == [1]
    assert caplog.text.count("cannot reach the leader's verdict directory") == 1
    assert rank.index.get("k") is MISSING  # its own index still learns


def test_one_rank_needs_no_directory() -> None:
    from s3kv.config import load_settings
    from s3kv.engine.leader.core import LeaderCore
    from s3kv.store.memory import MemoryStore

    s = load_settings({"S3KV_URL": "s3://b/p"})
    one = LeaderCore(s, MemoryStore(), "p", tp_size=1, model_id="m", kv_dtype="bf16")
    two = LeaderCore(s, MemoryStore(), "p", tp_size=2, model_id="m", kv_dtype="bf16")
    assert one.verdicts is None
    assert two.verdicts is not None and os.path.isdir(two.verdicts.path)
    assert two.build_connector_meta([], []).verdicts == two.verdicts.path
    assert one.build_connector_meta([], []).verdicts == ""


FORK_SCRIPT = """
import os, sys
from s3kv.engine.index import KeyIndex
from s3kv.engine.verdicts import VerdictBoard
board = VerdictBoard(KeyIndex(10, 60.0, 5.0), tp_size=2, base_dir=sys.argv[1])
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the interpreter runs its finalizers
os.waitpid(pid, 0)
print("after child", os.path.isdir(board.path))
"""


def test_a_forked_child_exiting_leaves_the_directory_to_the_leader(tmp_path: os.PathLike[str]) -> None:
    import subprocess
    import sys

    script = os.path.join(str(tmp_path), "fork.py")
    with open(script, "w") as f:
        f.write(FORK_SCRIPT)
    out = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "after child True" in out.stdout
    assert not [p for p in os.listdir(str(tmp_path)) if p.startswith("s3kv-verdicts-")]  # the leader's exit removed it


def test_a_verdict_cut_short_never_swallows_the_next(tmp_path: os.PathLike[str]) -> None:
    """A full /dev/shm cuts a write short; the rank's next verdict still reaches the leader."""
    leader_index = _index()
    _warm(leader_index, "k1", "k2")
    board = VerdictBoard(leader_index, tp_size=2, base_dir=str(tmp_path))
    rank = ToLeader(_index(), 1)
    rank.attach(board.path)
    with open(os.path.join(board.path, "rank-1"), "ab") as f:
        f.write(b'\n{"op":"quarantine","ke')  # what a write cut short leaves
    rank.quarantine(["k2"], 60.0)
    assert board.poll() == 1
    assert leader_index.get("k2") is MISSING and leader_index.get("k1") == SPAN
    board.close()


def test_a_ranks_forget_never_lifts_a_quarantine_the_leader_made(tmp_path: os.PathLike[str]) -> None:
    """The leader quarantines objects for reasons of its own (a finish plan that did not match its
    pages: bytes that verify but may be wrong KV). A rank that saw the same key fail transiently
    and forgets it must not release it; a quarantine the rank itself asked for it may."""
    leader_index = _index()
    board = VerdictBoard(leader_index, tp_size=2, base_dir=str(tmp_path))
    rank = ToLeader(_index(), 1)
    rank.attach(board.path)
    leader_index.quarantine(["mine"], 60.0)
    rank.quarantine(["theirs"], 60.0)
    board.poll()
    rank.forget(["mine", "theirs"])
    assert board.poll() == 1
    assert leader_index.get("mine") is MISSING
    assert leader_index.get("theirs") is None
    board.close()


def test_no_directory_is_a_warning_not_a_failed_start(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="s3kv.verdicts"):
        assert VerdictBoard.make(_index(), 2, base_dir=os.path.join(str(tmp_path), "absent")) is None
    assert "no verdict directory" in caplog.text


def test_a_worker_past_rank_0_counts_a_directory_it_cannot_reach(tmp_path: os.PathLike[str]) -> None:
    """The wiring in WorkerCore: the metadata names the directory, the worker's stats say it
    could not be reached; rank 0 shares the leader's index and attaches nothing."""
    from s3kv.config import load_settings
    from s3kv.core.plan import ConnectorMetadata
    from s3kv.engine.worker.core import WorkerCore
    from s3kv.store.memory import MemoryStore

    s = load_settings({"S3KV_URL": "s3://b/p"})
    gone = ConnectorMetadata(iteration=1, verdicts=os.path.join(str(tmp_path), "on-another-host"))
    for rank, want in ((0, 0), (1, 1)):
        with WorkerCore(s, MemoryStore(), "p", rank=rank, tp_size=2, index=_index()) as w:
            w.bind(gone)
            w.bind(gone)
            assert w.stats().verdicts_unshared == want


KILLED_SCRIPT = """
import os, signal, sys
from s3kv.engine.index import KeyIndex
from s3kv.engine.verdicts import VerdictBoard
board = VerdictBoard(KeyIndex(10, 60.0, 5.0), tp_size=2, base_dir=sys.argv[1])
print(board.path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # no finalizer runs: the directory stays
sys.stdin.read()  # "live": holds its board until the test closes stdin
"""


def test_a_new_board_removes_the_directories_of_leaders_that_were_killed(tmp_path: os.PathLike[str]) -> None:
    """A SIGKILLed (or OOM-killed) leader runs no finalizer: its directory stays in /dev/shm.
    The next board on the host removes it -- never a live leader's, nor one it cannot judge."""
    import subprocess
    import sys

    base = str(tmp_path)
    script = os.path.join(base, "killed.py")
    with open(script, "w") as f:
        f.write(KILLED_SCRIPT)
    killed = subprocess.run([sys.executable, script, base, "kill"], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    dead = killed.stdout.strip()
    assert os.path.isdir(dead)
    live = subprocess.Popen([sys.executable, script, base, "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None
        alive = live.stdout.readline().strip()
        foreign = os.path.join(base, "s3kv-verdicts-older")  # no owner file: an older s3kv's, or being made
        os.mkdir(foreign)
        board = VerdictBoard(_index(), tp_size=2, base_dir=base)
        assert not os.path.exists(dead), "the killed leader's directory stayed"
        assert os.path.isdir(alive), "a live leader's directory was removed"
        assert os.path.isdir(foreign)
        board.close()
        assert not os.path.exists(board.path)
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(60)
    assert not os.path.exists(alive)  # its own exit removed it
