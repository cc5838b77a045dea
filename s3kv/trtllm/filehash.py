"""What a path names on disk, and its bytes into a hash: shared by the model weights digest
(``weights.py``) and LoRA adapter identities (``lora.py``).

A path names whatever it resolves to *now*; the engine read what it resolved to when it loaded.
So an identity records how the path resolved (:func:`resolve`): every symbolic link passed and
every real directory above, then the stats of the files it reads (:func:`file_stat`).

Why ctime is the evidence of a change: every way to make a name resolve to other bytes changes
the ctime of an inode the name then resolves through -- writing a file (in place too, with its
mtime restored afterwards: ``rsync --inplace -t``), creating or renaming one into place (``rsync``
without ``--inplace``, ``mv``), linking one (``ln``), flipping a symbolic link (``ln -sfn``
makes a new link) -- and no unprivileged call sets a ctime back. So "every symlink passed and
every file read has a ctime older than t" proves the path gave these bytes at t. A directory's
own ctime also changes when any entry is added to it, so for the directories above what is read
only the inode is kept (a directory renamed over another is a new inode).
"""

from __future__ import annotations

import os
import stat as stat_mod
from dataclasses import dataclass
from typing import Any

#: (size, mtime_ns, ctime_ns, inode, device) of a file: what says it still holds the bytes hashed.
Stat = tuple[int, int, int, int, int]

#: Symbolic links followed in one resolution before it is refused (Linux's own limit, ELOOP).
_MAX_LINKS = 40
#: Read size when hashing.
CHUNK = 16 << 20


def file_stat(st: os.stat_result) -> Stat:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True)
class Resolved:
    """Where a path led: the real path, and every inode passed on the way."""

    real: str
    #: (link path, device, inode, ctime_ns) of every symbolic link followed.
    links: tuple[tuple[str, int, int, int], ...]
    #: (path, device, inode) of every real directory passed above ``real``.
    dirs: tuple[tuple[str, int, int], ...]

    @property
    def newest_link_ctime(self) -> int:
        return max((ctime for *_, ctime in self.links), default=0)


def resolve(path: str) -> Resolved:
    """Resolve ``path`` one component at a time, as the kernel does (``..`` after a link is
    physical), recording each link and directory passed. Raises ``OSError`` or ``ValueError``."""
    todo = os.path.abspath(path).split(os.sep)
    current = os.sep
    links: list[tuple[str, int, int, int]] = []
    dirs: list[tuple[str, int, int]] = []
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        nxt = os.path.join(current, name)
        st = os.lstat(nxt)
        if stat_mod.S_ISLNK(st.st_mode):
            if len(links) >= _MAX_LINKS:
                raise ValueError(f"more than {_MAX_LINKS} symbolic links in {path}")
            links.append((nxt, st.st_dev, st.st_ino, st.st_ctime_ns))
            target = os.readlink(nxt)
            if os.path.isabs(target):
                current = os.sep
            todo = target.split(os.sep) + todo
            continue
        if todo and any(t not in ("", ".") for t in todo):
            if not stat_mod.S_ISDIR(st.st_mode):
                raise ValueError(f"{nxt} is not a directory")
            dirs.append((nxt, st.st_dev, st.st_ino))
        current = nxt
    return Resolved(current, tuple(links), tuple(dirs))


class ShortRead(Exception):
    """A file is shorter or longer than the size it was hashed for: it changed while it was read."""


def hash_span(f: Any, h: Any, buf: memoryview, offset: int, count: int, name: str) -> None:
    """Feed ``count`` bytes of ``f`` from ``offset`` to ``h``. Ordinary reads, never a memory map:
    a file truncated under a map kills the process (SIGBUS); a read just comes back short."""
    f.seek(offset)
    while count:
        got = f.readinto(buf[: min(count, len(buf))])
        if not got:
            raise ShortRead(f"{name}: shorter than expected")
        h.update(buf[:got])
        count -= got


def hash_file(path: str, size: int, h: Any, buf: memoryview, name: str = "") -> None:
    """Feed the whole file to ``h``, which must hold exactly ``size`` bytes (else ``ShortRead``)."""
    with open(path, "rb", buffering=0) as f:
        hash_span(f, h, buf, 0, size, name or path)
        if f.read(1):
            raise ShortRead(f"{name or path}: longer than expected")
