"""Object store on a filesystem: ``file://`` and any other fsspec URL.

On-disk format. Every object is one file: a fixed 4 KiB *envelope* followed by the body::

    b"S3KVENV1" | u32 little-endian JSON length | JSON {"metadata": {...}} | zero padding to 4096

Why an envelope in the file rather than a sidecar: publishing one file is one atomic step, so
data and metadata can never be seen apart or from two different writers (a sidecar needs two
publishes and a crash or a race between them pairs the wrong metadata with the body). Why fixed
size: the body's offset and size are known without reading anything (``size = file size -
4096``), so ``list`` costs no extra reads and a ranged read is one seek. 4 KiB holds S3's own
2 KiB limit on user metadata with room to spare. The envelope is independent of s3kv's object
format (layout.py's header is part of the body). Files are therefore not raw bodies: use this
store (or skip 4096 bytes) to read them.

Write-once. The body goes to a temp file next to its final name; it is published with
``os.link(temp, final)``, which fails with EEXIST if the name exists - unlike ``rename``, which
silently replaces. Two writers racing on one key: exactly one link succeeds (True), the other
gets False, and a reader only ever sees a complete file. Non-local fsspec file systems have no
such primitive: they use exists-check then move, which can let two racing writers both win
(the last whole body stays; never a torn object) - the same trade as S3Store's fallback.

Why this is one module: the envelope format, write-once publishing and the store calls over them are
one contract that must change together.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import os
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..config import query_start, redact, redact_url
from .base import (
    TOUCH_GONE,
    TOUCH_REFRESHED,
    TOUCH_UNSUPPORTED,
    TOUCH_YOUNG,
    AnswerClock,
    Buffer,
    ByteRange,
    Fetched,
    HeadBatch,
    IntegrityError,
    NotFound,
    ObjectInfo,
    ObjectStore,
    PermissionDenied,
    StoreConfigError,
    StoreError,
    TransientError,
    as_buffers,
)

T = TypeVar("T")

ENVELOPE_SIZE = 4096
MAGIC = b"S3KVENV1"
_LEN = struct.Struct("<I")
#: Temp files carry this in their name; ``list`` skips them and keys may not contain it.
TMP_MARK = ".s3kv-tmp-"
# Errors from os.link on file systems without hard links (FAT, some FUSE / network mounts).
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def encode_envelope(metadata: Mapping[str, str]) -> bytes:
    meta = json.dumps({"metadata": dict(metadata)}, separators=(",", ":"), sort_keys=True).encode()
    if len(MAGIC) + _LEN.size + len(meta) > ENVELOPE_SIZE:
        raise ValueError(
            f"object metadata too large for the {ENVELOPE_SIZE}-byte envelope ({len(meta)} bytes of JSON)"
        )
    return (MAGIC + _LEN.pack(len(meta)) + meta).ljust(ENVELOPE_SIZE, b"\0")


def decode_envelope(raw: bytes, key: str) -> dict[str, str]:
    if len(raw) < ENVELOPE_SIZE or raw[: len(MAGIC)] != MAGIC:
        raise IntegrityError("not an s3kv object file (bad or short envelope)", key=key)
    (n,) = _LEN.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        doc = json.loads(raw[start : start + n])
        return {str(k): str(v) for k, v in doc["metadata"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"corrupt object envelope: {exc}", key=key) from exc


class FsspecStore(ObjectStore):
    """Objects as files under ``url`` (the URL is the root; keys are paths below it)."""

    def __init__(
        self,
        url: str,
        *,
        fs: fsspec.AbstractFileSystem | None = None,
        storage_options: Mapping[str, Any] | None = None,
        max_concurrency: int = 16,
        fsync: bool = True,
    ):
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        # Shown in every message: without a query string or fragment, which may hold a secret
        # (``?token=…``) that fsspec keeps as part of the root path (issue 37).
        self.url = redact_url(url)
        self._root = str(root).rstrip("/") or "/"
        cut = query_start(self._root)
        self._hidden = self._root[cut:] if cut >= 0 else ""
        self._local = isinstance(fs, LocalFileSystem)
        # fsync before publishing: after a crash a visible file must be a whole file.
        self._fsync = fsync
        self._max_concurrency = max_concurrency
        self._pool: cf.ThreadPoolExecutor | None = None
        self._answers = AnswerClock()  # files opened and read (``answered_since``)

    # -- helpers -----------------------------------------------------------------------
    def _path(self, key: str) -> str:
        if (
            not key
            or key.startswith("/")
            or TMP_MARK in key
            or any(p in ("", ".", "..") for p in key.split("/"))
        ):
            raise ValueError(self._shown(f"invalid object key {key!r} for {self.url}"))
        return f"{self._root.rstrip('/')}/{key}"

    def _key_of(self, path: str) -> str:
        return path[len(self._root.rstrip("/")) + 1 :]

    def _shown(self, text: str) -> str:
        """``text`` as it may be shown: no part of the URL's query or fragment, whether it comes
        as a URL or inside a path (an OSError names the file)."""
        if self._hidden:
            text = text.replace(self._hidden, self._hidden[0] + "***")
        return redact(text)

    def _scrub(self, exc: BaseException) -> BaseException:
        """``exc`` with the secret part of the root removed from what it prints (chained as the
        cause of the store's error, it reaches tracebacks in the engine's own log handlers)."""
        if self._hidden:
            if isinstance(exc, OSError):
                for attr in ("filename", "filename2"):
                    if isinstance(getattr(exc, attr, None), str):
                        setattr(exc, attr, self._shown(getattr(exc, attr)))
            exc.args = tuple(self._shown(a) if isinstance(a, str) else a for a in exc.args)
        return exc

    def _translate(self, exc: OSError, op: str, key: str | None) -> StoreError:
        self._scrub(exc)
        text = self._shown(f"{op} on {self.url}: {type(exc).__name__}: {exc}")
        if isinstance(exc, FileNotFoundError):
            return NotFound(text, key=key)
        if isinstance(exc, PermissionError):
            return PermissionDenied(text, key=key)
        # On a remote file system most OSErrors are network trouble; on a local disk they are
        # not (ENOSPC, EIO) and retrying will not fix them.
        return StoreError(text, key=key) if self._local else TransientError(text, key=key)

    def _guard(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StoreError:
            raise
        except (OSError, TimeoutError) as exc:
            raise self._translate(exc, op, key) from exc

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        # Local files answer in microseconds: threads would cost more than they save.
        if self._local or len(items) <= 1:
            return [fn(i) for i in items]
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(
                max_workers=self._max_concurrency, thread_name_prefix="s3kv-fs"
            )
        return list(self._pool.map(fn, items))

    # -- HEAD --------------------------------------------------------------------------
    def _head_one(self, key: str) -> ObjectInfo | None | StoreError:
        path = self._path(key)
        try:
            mtime: float | None
            if self._local:
                fd = _open_regular(path, key)
                if fd is None:
                    return None  # not a regular file: nothing this store wrote (see _open_regular)
                try:
                    raw = os.pread(fd, ENVELOPE_SIZE, 0)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                size, mtime = st.st_size, st.st_mtime
            else:
                with self.fs.open(path, "rb") as f:
                    raw = f.read(ENVELOPE_SIZE)
                info = self.fs.info(path)
                size, mtime = int(info["size"]), _mtime(info)
            meta = decode_envelope(raw, key)
            return ObjectInfo(key, size - ENVELOPE_SIZE, meta, mtime)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            return None  # a key prefix of other keys is a directory, not an object
        except StoreError as exc:
            return exc
        except OSError as exc:
            return self._translate(exc, "head", key)

    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        unique = list(dict.fromkeys(keys))
        asked = time.monotonic()
        batch = HeadBatch.from_outcomes(unique, self._map(self._head_one, unique))
        if batch.found or batch.missing:
            self._answers.note(asked)
        return batch

    def answered_since(self, t: float) -> bool:
        return self._answers.since(t)

    # -- PUT ---------------------------------------------------------------------------
    def put(
        self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None
    ) -> bool:
        path = self._path(key)
        views = as_buffers(data)
        envelope = encode_envelope({str(k).lower(): str(v) for k, v in (metadata or {}).items()})
        if self._local:
            return self._guard("put", key, lambda: self._put_local(path, envelope, views))
        return self._guard("put", key, lambda: self._put_remote(path, envelope, views))

    def _tmp_path(self, path: str) -> str:
        head, _, name = path.rpartition("/")
        return f"{head}/.{name}{TMP_MARK}{uuid.uuid4().hex}"

    def _put_local(self, path: str, envelope: bytes, views: list[memoryview]) -> bool:
        if os.path.exists(path):  # cheap early exit; the link below is what decides
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._tmp_path(path)
        try:
            with open(tmp, "xb") as f:
                f.write(envelope)
                for v in views:  # buffer by buffer: no joined copy of the body
                    f.write(v)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, fails if the name exists: exactly one writer wins
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise
                # No hard links here. RACE: check-then-rename can let two writers both
                # "win"; the later whole file replaces the earlier one, never a torn file.
                if os.path.exists(path):
                    return False
                os.replace(tmp, path)
                return True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _put_remote(self, path: str, envelope: bytes, views: list[memoryview]) -> bool:
        # RACE (documented in the module docstring): exists-then-move is not atomic.
        if self.fs.exists(path):
            return False
        tmp = self._tmp_path(path)
        parent = path.rpartition("/")[0]
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(envelope)
                for v in views:
                    f.write(v)
            if self.fs.exists(path):
                return False
            self.fs.mv(tmp, path)
            return True
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)

    # -- GET ---------------------------------------------------------------------------
    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        path = self._path(key)

        def read_all() -> list[bytes]:
            asked = time.monotonic()
            out: list[bytes] = []
            if self._local:
                fd = _open_regular(path, key)
                if fd is None:
                    raise NotFound("not a regular file", key=key)
                try:
                    self._answers.note(asked)
                    # pread: no shared file position, so concurrent readers never interfere.
                    out = [
                        os.pread(fd, r.length, ENVELOPE_SIZE + r.offset) if r.length else b"" for r in ranges
                    ]
                finally:
                    os.close(fd)
            else:
                with self.fs.open(path, "rb") as f:
                    self._answers.note(asked)
                    for r in ranges:
                        f.seek(ENVELOPE_SIZE + r.offset)
                        out.append(f.read(r.length) if r.length else b"")
            for r, b in zip(ranges, out, strict=True):
                if len(b) != r.length:
                    raise IntegrityError(
                        f"range {r.offset}+{r.length} returned {len(b)} bytes: object shorter than expected",
                        key=key,
                    )
            return out

        return self._guard("get", key, read_all)

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        """Files have no ETag: this one is made of what changes when a key is written anew (a new
        inode by ``put``'s link, its mtime and size; remote: the file system's ETag if it has one)."""
        path = self._path(key)

        def read() -> Fetched | None:
            if self._local:
                fd = _open_regular(path, key)
                if fd is None:
                    raise NotFound("no such object", key=key)
                try:
                    st = os.fstat(fd)
                    tag = f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'
                    if etag is not None and etag == tag:
                        return None
                    raw = os.pread(fd, st.st_size, 0)
                finally:
                    os.close(fd)
            else:
                info = self.fs.info(path)
                tag = str(info.get("ETag") or info.get("etag") or f'"{_mtime(info)}-{info.get("size")}"')
                if etag is not None and etag == tag:
                    return None
                with self.fs.open(path, "rb") as f:
                    raw = f.read()
            decode_envelope(raw[:ENVELOPE_SIZE], key)
            return Fetched(raw[ENVELOPE_SIZE:], tag)

        return self._guard("get", key, read)

    # -- DELETE / LIST -----------------------------------------------------------------
    def touch(self, key: str, min_age_s: float = 0.0) -> str:
        if not self._local:  # fsspec has no portable "set mtime"
            return TOUCH_UNSUPPORTED
        path = self._path(key)

        def utime() -> str:
            try:
                if time.time() - os.stat(path).st_mtime < min_age_s:
                    return TOUCH_YOUNG
                os.utime(path)
            except FileNotFoundError:
                return TOUCH_GONE
            return TOUCH_REFRESHED

        return self._guard("touch", key, utime)

    def store_time(self) -> float:
        """The file system's clock: the modification time it gives a file written now (a temp
        file under the root, removed at once; ``list`` never shows it). On a local disk that is
        this host's clock, on a network file system the server's."""
        path = f"{self._root.rstrip('/')}/.s3kv-clock{TMP_MARK}{uuid.uuid4().hex}"

        def stamp() -> float | None:
            if self._local:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                try:
                    return os.fstat(fd).st_mtime
                finally:
                    os.close(fd)
                    os.unlink(path)
            self.fs.pipe_file(path, b"")
            try:
                return _mtime(self.fs.info(path))
            finally:
                self.fs.rm(path)

        t = self._guard("clock", None, stamp)
        if t is None:
            raise StoreError(self._shown(f"{self.url}: the file system gives no modification times"))
        return t

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in dict.fromkeys(keys):
            path = self._path(key)

            def rm(path: str = path) -> None:
                try:
                    if self._local:
                        os.unlink(path)
                    else:
                        self.fs.rm(path)
                except FileNotFoundError:
                    pass

            self._guard("delete", key, rm)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # Walk only the directory that holds the prefix; the prefix may end mid-name.
        sub = prefix.rpartition("/")[0]
        base = f"{self._root.rstrip('/')}/{sub}" if sub else self._root

        def collect() -> list[ObjectInfo]:
            items: list[ObjectInfo] = []
            if self._local:
                if not os.path.isdir(base):
                    return []
                for dirpath, _dirs, files in os.walk(base):
                    for name in files:
                        full = os.path.join(dirpath, name)
                        key = self._key_of(full)
                        if TMP_MARK in name or not key.startswith(prefix):
                            continue
                        try:
                            st = os.lstat(full)  # a link is not an object, nor is a FIFO
                        except OSError:
                            continue  # deleted while we walked, or unreadable
                        if stat.S_ISREG(st.st_mode) and st.st_size >= ENVELOPE_SIZE:
                            items.append(ObjectInfo(key, st.st_size - ENVELOPE_SIZE, {}, st.st_mtime))
            else:
                if not self.fs.exists(base):
                    return []
                for path, info in self.fs.find(base, detail=True).items():
                    key = self._key_of(self.fs._strip_protocol(path))
                    if TMP_MARK in path.rpartition("/")[2] or not key.startswith(prefix):
                        continue
                    if int(info["size"]) >= ENVELOPE_SIZE:
                        items.append(ObjectInfo(key, int(info["size"]) - ENVELOPE_SIZE, {}, _mtime(info)))
            return sorted(items, key=lambda i: i.key)

        yield from self._guard("list", prefix, collect)

    # -- start-up ----------------------------------------------------------------------
    def check_access(self) -> None:
        if self._local:
            try:
                os.makedirs(self._root, exist_ok=True)  # a cache directory may be created on first use
            except FileExistsError as exc:
                raise StoreConfigError(
                    self._shown(f"S3KV_URL={self.url}: {self._root} exists and is not a directory")
                ) from self._scrub(exc)
            except PermissionError as exc:
                raise PermissionDenied(
                    self._shown(f"S3KV_URL={self.url}: cannot create the directory {self._root}: {exc}")
                ) from self._scrub(exc)
            if not os.access(self._root, os.W_OK | os.X_OK):
                raise PermissionDenied(
                    self._shown(f"S3KV_URL={self.url}: directory {self._root} is not writable by this process")
                )
        outcome = self._head_one(self._probe_key())
        if isinstance(outcome, StoreError):
            raise type(outcome)(self._shown(f"S3KV_URL={self.url}: store check failed: {outcome}")) from outcome

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"


def _open_regular(path: str, key: str) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file, else None (missing too).

    Only regular files are objects. Opening a FIFO for reading blocks until a writer comes
    (forever, on a lookup's thread), and a symlink can point anywhere: both are refused -
    ``O_NONBLOCK`` makes the open of a FIFO return at once, ``O_NOFOLLOW`` refuses a link, and
    ``fstat`` on the open descriptor (no race with a swap) checks the type.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):  # a link; a FIFO/socket; a path through a file
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mtime(info: Mapping[str, Any]) -> float | None:
    for name in ("mtime", "LastModified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, (int, float)):
            return float(value)
        if value is not None and hasattr(value, "timestamp"):
            return float(value.timestamp())
    return None
