"""The model weights' digest: every byte of every weights file the engine loads, kept between
runs per file, keyed by the file's identity.

**Which files** (of a local model directory, top level, symbolic links followed): the
``*.safetensors`` files when there are any (the loaders then read nothing else), else the
``*.bin`` files (PyTorch pickles: hashed as bytes, never unpickled -- loading one runs code), else
``*.pt`` / ``*.pth``. None of them: no digest (the identity is weak, see ``identity.py``).

**What is hashed.** A safetensors file per tensor: its name, dtype, shape and the BLAKE3 of its
bytes, located by the header's offsets, plus the file's ``__metadata__``; the checkpoint digest
covers the sorted tensors of every file, so the same weights sharded into other files keep it.
Any other file: its name, size and the BLAKE3 of all its bytes. Every byte counts: a fine-tune
that touches one expert of a fused MoE tensor or a band of rows of one projection changes it
(a sample of each tensor did not). Reads are ordinary reads, never a memory map (a file
truncated under a map kills the process).

**Cost, and the cache.** Reading a checkpoint is bound by the disk or the page cache, and BLAKE3
hashes on every core (tens of seconds for 54 GB from NVMe: docs/security.md, 37.4). So each file's
result is kept under ``S3KV_IDENTITY_CACHE_DIR`` (default ``~/.cache/s3kv``), keyed by its real
path, size, mtime, ctime, inode and device: a restart on the same node reads no weights, and
any write to a file (an in-place rewrite with its mtime restored changes the ctime) makes it
read again. Tensor-parallel ranks are processes of their own: one hashes a file while the
others wait on its lock (``fcntl.flock``), then read the entry. It runs while the connector is
built, before the engine's first request, so no request is ever keyed by a provisional identity.

**The bytes the engine loaded.** The engine read its weights after its process started, so a
weights file -- or a link on its path -- with a ctime after the process start may hold other
bytes than the engine's: then there is no digest (weak), never one of the new bytes. (TensorRT-LLM's
model loader downloads a hub id and sets ``llm_args.model`` to the local snapshot directory: a
worker process started after the download is not affected; one that downloaded it itself is weak
on that start only.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from .filehash import CHUNK, ShortRead, Stat, file_stat, hash_file, hash_span, resolve

log = logging.getLogger("s3kv.identity")

#: Weights file suffixes, in the order the loaders prefer them: the first that has files wins.
WEIGHT_SUFFIXES: tuple[tuple[str, ...], ...] = ((".safetensors",), (".bin",), (".pt", ".pth"))
#: Said in the weak identity of a directory without any.
NO_WEIGHTS = "holds no weights file s3kv can read (*.safetensors, *.bin, *.pt, *.pth)"
#: Largest safetensors header read (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100 << 20
#: Files hashed at once (each on all cores): enough to keep a fast disk busy between hashes.
_PARALLEL_FILES = 4
_FORMAT = "s3kv-weights-v3"
_CACHE_VERSION = 1
_IMPORTED = time.time()

#: In-process results, keyed as the cache: the leader and rank 0's worker share a process.
_memo: dict[tuple[str, Stat], dict[str, Any]] = {}
_memo_lock = threading.Lock()


@dataclass(frozen=True)
class WeightsDigest:
    #: Hex digest over every weights file ("" when there is none to trust).
    digest: str
    #: Why there is no digest ("" when there is one).
    weak: str = ""
    files: int = 0
    #: Bytes of weights covered, and of those read now (the rest came from the cache).
    nbytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0


def weights_digest(directory: Path, cache_dir: str = "") -> WeightsDigest:
    """The digest of the weights in ``directory``. Never raises: what cannot be read or trusted
    gives ``digest=""`` and the reason in ``weak``. ``cache_dir``: ``S3KV_IDENTITY_CACHE_DIR``.
    A file changed after this process started (before it, the engine cannot have read its
    weights) is not trusted."""
    t0 = time.perf_counter()
    try:
        files = weight_files(directory)
    except OSError as e:
        return WeightsDigest("", f"cannot list it ({e})")
    if not files:
        return WeightsDigest("", NO_WEIGHTS)
    bound = int(process_start() * 1e9)
    todo: list[tuple[str, str, Stat]] = []
    for name, path in files:
        try:
            r = resolve(path)
            now = os.stat(r.real)
        except (OSError, ValueError) as e:
            return WeightsDigest("", f"cannot read {name} ({e})")
        if max(r.newest_link_ctime, now.st_ctime_ns) > bound:
            return WeightsDigest("", f"{name} changed on disk after this engine started (rewritten, or "
                                     "downloaded by this process), so the weights it loaded may not be the "
                                     "file's bytes now; a later start is not affected by a download")
        todo.append((name, r.real, file_stat(now)))
    cache = _cache_root(cache_dir)
    results: dict[int, dict[str, Any]] = {}
    missing = []
    for i, (_, real, st) in enumerate(todo):
        with _memo_lock:
            hit = _memo.get((real, st))
        entry = hit or _cache_get(cache, real, st)
        if entry is None:
            missing.append(i)
        else:
            results[i] = entry
    read = sum(todo[i][2][0] for i in missing)
    try:
        with ThreadPoolExecutor(min(_PARALLEL_FILES, max(1, len(missing))), thread_name_prefix="s3kv-weights") as ex:
            for i, entry in zip(missing, ex.map(lambda i: _hash_cached(cache, *todo[i]), missing), strict=True):
                results[i] = entry
    except ShortRead as e:
        return WeightsDigest("", f"it changed while s3kv read it ({e})")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return WeightsDigest("", f"cannot read its weights ({e})")
    except Exception as e:  # noqa: BLE001 - an odd checkpoint leaves a weak identity, never a failed start
        log.exception("s3kv: digesting the weights in %s failed", directory)
        return WeightsDigest("", f"cannot read its weights ({e!r})")
    for i, (_, real, st) in enumerate(todo):
        with _memo_lock:
            _memo[(real, st)] = results[i]
    nbytes = sum(st[0] for _, _, st in todo)
    return WeightsDigest(_combine([results[i] for i in range(len(todo))]), "", len(todo), nbytes, read,
                         time.perf_counter() - t0)


def weight_files(directory: Path) -> list[tuple[str, str]]:
    """(name, path) of the weights files the engine loads from ``directory``, sorted."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    for suffixes in WEIGHT_SUFFIXES:
        chosen = [n for n in names if n.endswith(suffixes)]
        if chosen:
            return [(n, str(directory / n)) for n in chosen]
    return []


def process_start() -> float:
    """Wall-clock time this process started (Linux ``/proc``), else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


# ------------------------------------------------------------------ hashing


def _hash_cached(cache: Path | None, name: str, real: str, st: Stat) -> dict[str, Any]:
    """One file's entry: hashed here, or by the process holding its lock meanwhile."""
    with _locked(cache, real, st):
        entry = _cache_get(cache, real, st)
        if entry is not None:  # another rank hashed it while this one waited
            return entry
        entry = _hash(name, real, st)
        now = file_stat(os.stat(real))
        if now != st:
            raise ShortRead(f"{name}: its stat changed while it was read")
        _cache_put(cache, real, st, entry)
        return entry


def _hash(name: str, real: str, st: Stat) -> dict[str, Any]:
    buf = memoryview(bytearray(CHUNK))
    size = st[0]
    if not name.endswith(".safetensors"):
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        hash_file(real, size, h, buf, name)
        return {"file": [name, size, h.hexdigest()]}
    with open(real, "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), 8, 0)
        if len(raw) != 8:
            raise ValueError(f"{name}: not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{name}: safetensors header of {n} bytes")
        header = json.loads(os.pread(f.fileno(), n, 8))
        if not isinstance(header, dict):
            raise ValueError(f"{name}: safetensors header is not an object")
        meta = header.pop("__metadata__", None)
        spans = []
        for key, t in header.items():
            begin, end = (int(x) for x in t["data_offsets"])
            if not 0 <= begin <= end <= size - 8 - n:
                raise ValueError(f"{name}: tensor {key} lies outside the file")
            spans.append((begin, end, key, str(t["dtype"]), [int(x) for x in t["shape"]]))
        tensors = []
        for begin, end, key, dtype, shape in sorted(spans):  # in file order: one pass over the disk
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            hash_span(f, h, buf, 8 + n + begin, end - begin, name)
            tensors.append([key, dtype, shape, h.hexdigest()])
    return {"tensors": tensors, "metadata": meta if isinstance(meta, dict) else {}}


def _combine(entries: list[dict[str, Any]]) -> str:
    tensors = sorted(t for e in entries for t in e.get("tensors", []))
    metadata = sorted({json.dumps(e["metadata"], sort_keys=True) for e in entries if "metadata" in e})
    files = sorted(e["file"] for e in entries if "file" in e)
    body = json.dumps({"tensors": tensors, "metadata": metadata, "files": files}, separators=(",", ":"))
    h = blake3.blake3(_FORMAT.encode() + b"\0")
    h.update(body.encode())
    return h.hexdigest(length=16)


# ------------------------------------------------------------------ the cache


def _cache_root(setting: str) -> Path | None:
    if setting == "off":
        return None
    if setting:
        root = Path(setting).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = Path(base) / "s3kv"
    root = root / f"weights-v{_CACHE_VERSION}"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        log.warning("s3kv: cannot use %s for weights digests (%s; S3KV_IDENTITY_CACHE_DIR): every start "
                    "reads the whole checkpoint", root, e)
        return None
    return root


def _entry_name(real: str, st: Stat) -> str:
    return hashlib.blake2b(repr((real, st)).encode(), digest_size=16).hexdigest()


def _cache_get(cache: Path | None, real: str, st: Stat) -> dict[str, Any] | None:
    if cache is None:
        return None
    try:
        doc = json.loads((cache / (_entry_name(real, st) + ".json")).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and doc.get("path") == real and doc.get("stat") == list(st)
    entry = doc.get("entry") if ok else None
    return entry if isinstance(entry, dict) and ("tensors" in entry or "file" in entry) else None


def _cache_put(cache: Path | None, real: str, st: Stat, entry: dict[str, Any]) -> None:
    if cache is None:
        return
    path = cache / (_entry_name(real, st) + ".json")
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps({"path": real, "stat": list(st), "entry": entry}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("s3kv: cannot write %s (%s); the next start reads %s again", path, e, real)
        with contextlib.suppress(OSError):
            tmp.unlink()


@contextlib.contextmanager
def _locked(cache: Path | None, real: str, st: Stat) -> Iterator[None]:
    """Hold the file's lock: one process hashes it, the others wait and read its entry."""
    if cache is None:
        yield
        return
    try:
        fd = os.open(cache / (_entry_name(real, st) + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock

