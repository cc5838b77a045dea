"""A LoRA adapter's identity: what a LoRA request's KV is keyed by, never its integer id.

Why not the id: TensorRT-LLM's ``lora_task_id`` is ``LoRARequest.lora_int_id``, a number each
deployment picks for itself (its multi-LoRA examples number adapters 1, 2, 3), so cluster A's
adapter 7 and cluster B's adapter 7 are different weights -- and integrity tags cannot tell
them apart, both clusters being legitimate signers. A LoRA changes the KV of every layer it
adapts, so its pages may only be shared where the *weights* are the same.

What the scheduler-side ``LlmRequest`` carries (TensorRT-LLM's PyTorch executor,
``executor_request_to_llm_request``): ``lora_task_id``, ``py_lora_path`` (the
``LoRARequest.lora_path`` the engine loads the adapter from), and ``lora_config`` /
``lora_weights`` tensors (the module layout; weights only on a TensorRT engine's first request
of an adapter). The adapter's name does not reach it. So the identity is built from the path:

* a directory (Hugging Face PEFT, what ``HfLoraLoader`` reads): ``adapter_config.json`` and
  every ``adapter_model.*`` file, names and whole contents;
* a file (a NeMo ``.nemo`` archive): its whole contents;

plus the engine's ``lora_config`` fields that decide how an adapter is applied (target modules
and their mapping, checkpoint source). Whole contents, not headers: two trainings of one
recipe have identical safetensors headers. Hashed once per path with BLAKE3 (all cores) in a
background thread, the same order of work as the engine's own loading of the adapter; until the
hash is done the adapter's requests are neither served nor saved (counted as pending, not warned).

A request whose identity cannot be established is neither served nor saved (counted per
reason, logged once per adapter): no path on the request (an older TensorRT-LLM), files missing
or unreadable, files changed on disk while the engine runs, or one task id seen with two
identities (that id stays refused). The engine loads an adapter when it first schedules one of
its requests and caches those weights by task id, so the files as first seen (their stats,
recorded on the scheduler thread at first sight, even when unreadable) are the weights it
applies: any later difference -- during the hash included -- refuses that path for good.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import blake3

log = logging.getLogger("s3kv.lora")

#: Files of a PEFT adapter directory that ``HfLoraLoader`` reads (config, then the weights).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS_PREFIX = "adapter_model."
#: ``llm_args.lora_config`` fields that change how an adapter's weights are applied (capacity
#: fields such as ``max_loras`` do not).
_APPLY_FIELDS = ("lora_target_modules", "trtllm_modules_to_hf_modules", "lora_ckpt_source")

#: Refusal reasons (the keys of :attr:`AdapterIdentities.refused`).
NO_PATH, UNREADABLE, CHANGED, ID_CONFLICT = "no_path", "unreadable", "changed_on_disk", "id_conflict"
#: ``resolve``'s answer while the adapter is being hashed (not a refusal: it clears by itself).
PENDING = "LoRA adapter identity being computed"
_PENDING, _READY = "pending", "ready"
#: Read size of the adapter hash.
_CHUNK = 16 << 20

#: (name, size, mtime, ctime, inode, device) of the directory ("") and each file: ctime too,
#: because a same-size rewrite in place can restore the mtime (``rsync --inplace -t``).
_Signature = tuple[tuple[str, int, int, int, int, int], ...]


class AdapterIdentities:
    """Adapter identities of one engine, cached per path. Thread-safe; never raises."""

    def __init__(self, llm_args: Any = None):
        self._apply = _apply_settings(llm_args)
        self._lock = threading.Lock()
        self._paths: dict[str, _Adapter] = {}
        #: task id -> the path it was first seen with: the engine caches the weights it loads
        #: for a task id, so the first path is the one whose weights it applies.
        self._task_path: dict[int, str] = {}
        self._conflicted: set[int] = set()
        self._logged: set[tuple[str, str]] = set()
        self._hasher: ThreadPoolExecutor | None = None
        self._hashing: list[Future[None]] = []
        #: Requests refused, by reason.
        self.refused: Counter[str] = Counter()
        #: Requests neither served nor saved because their adapter was still being hashed.
        self.pending = 0

    def resolve(self, request: Any) -> tuple[str | None, str]:
        """``(identity, "")`` for a LoRA request, ``(None, "")`` for a base one, ``(None, PENDING)``
        while its adapter is hashed, or ``(None, why)`` when its identity cannot be established."""
        task = getattr(request, "lora_task_id", None)
        if task is None:
            return None, ""
        try:
            task = int(task)
        except (TypeError, ValueError):
            return self._refuse(UNREADABLE, f"task {task!r}", f"LoRA task id {task!r} is not an integer")
        path = getattr(request, "py_lora_path", None)
        if not isinstance(path, str) or not path:
            return self._refuse(
                NO_PATH, f"task {task}",
                f"LoRA task {task}: the request names no adapter path (py_lora_path; TensorRT-LLM's "
                "PyTorch executor sets it), so its weights cannot be identified",
            )
        with self._lock:
            if task in self._conflicted:
                return self._refuse_locked(ID_CONFLICT, f"task {task}", _conflict_message(task))
            first = self._task_path.setdefault(task, path)
            a = self._adapter_locked(path)
            if first != path:  # one id, two paths: only the same weights are the same adapter
                b = self._adapter_locked(first)
                if a.state == b.state == _READY and a.identity != b.identity:
                    self._conflicted.add(task)
                    return self._refuse_locked(ID_CONFLICT, f"task {task}", _conflict_message(task))
                if b.state != _READY:
                    a = b  # the weights the engine applies are those of the first path
            if a.state == _PENDING:
                self.pending += 1
                return None, PENDING
            if a.state != _READY:
                return self._refuse_locked(a.state, a.path, a.why)
            return a.identity, ""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the adapter hashes started so far (tests, benchmarks); True once all finished."""
        with self._lock:
            futures = list(self._hashing)
        return not wait_futures(futures, timeout).not_done

    # -- internals ----------------------------------------------------------------------------

    def _adapter_locked(self, path: str) -> _Adapter:
        """The path's state, checked against the files as they are now (a few stats)."""
        a = self._paths.get(path)
        if a is None:
            # First sight: the engine loads the adapter as it schedules this request, so these
            # files (this signature) are the weights it applies for as long as it runs. Recorded
            # now, even when they cannot be read; any later difference refuses the path for good.
            a = self._paths[path] = _Adapter(path)
            try:
                a.files = _adapter_files(path)
                a.signature = _signature(a.files, path)
            except (OSError, ValueError) as e:
                a.state, a.why = UNREADABLE, f"LoRA adapter {path}: {e}"
                return a
            a.state = _PENDING
            # Hashed off the scheduler thread (a large adapter takes a second): until it is done
            # the adapter's requests are neither served nor saved.
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="s3kv-lora-hash")
            self._hashing = [f for f in self._hashing if not f.done()]
            self._hashing.append(self._hasher.submit(self._hash, a))
            return a
        if a.state in (_READY, _PENDING) or (a.state == UNREADABLE and a.signature is None):
            if not self._unchanged(a):
                a.state, a.why = CHANGED, _changed_message(path)
        return a

    def _unchanged(self, a: _Adapter) -> bool:
        if a.signature is None:  # unreadable when first seen: still so?
            try:
                _signature(_adapter_files(a.path), a.path)
            except (OSError, ValueError):
                return True
            return False
        try:
            now = _signature(a.files, a.path)
            if now == a.signature:
                return True
            if now[1:] == a.signature[1:] and _adapter_files(a.path) == a.files:
                # Only the directory changed, not the adapter's files (e.g. a README added).
                a.signature = now
                return True
        except (OSError, ValueError):
            pass  # a file gone: changed
        return False

    def _hash(self, a: _Adapter) -> None:
        first = a.signature
        assert first is not None  # hashed only when it could be read at first sight
        try:
            identity = self._digest(a.files, [s[1] for s in first[1:]])
            same = _signature(a.files, a.path)[1:] == first[1:]
            state, why = (_READY, "") if same else (CHANGED, _changed_message(a.path))
        except _ShortRead:
            identity, state, why = "", CHANGED, _changed_message(a.path)
        except (OSError, ValueError) as e:
            identity, state, why = "", UNREADABLE, f"LoRA adapter {a.path}: {e}"
        except Exception as e:  # noqa: BLE001 - a hashing bug refuses the adapter, never the engine
            log.exception("s3kv: hashing LoRA adapter %s failed", a.path)
            identity, state, why = "", UNREADABLE, f"LoRA adapter {a.path}: {e!r}"
        with self._lock:
            if a.state == _PENDING:  # a change seen meanwhile stands
                a.identity, a.state, a.why = identity, state, why

    def _digest(self, files: list[tuple[str, str]], sizes: list[int]) -> str:
        """BLAKE3 of the files with the sizes first seen. Ordinary reads, not a memory map: a
        file truncated under a map kills the process (SIGBUS); a read just comes back short."""
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update(b"s3kv-lora-v1\0" + self._apply)
        buf = memoryview(bytearray(_CHUNK))
        for (name, full), size in zip(files, sizes, strict=True):
            h.update(name.encode() + b"\0" + size.to_bytes(8, "little"))
            with open(full, "rb", buffering=0) as f:
                left = size
                while left:
                    n = f.readinto(buf[: min(left, _CHUNK)])
                    if not n:
                        raise _ShortRead(name)
                    h.update(buf[:n])
                    left -= n
                if f.read(1):
                    raise _ShortRead(name)
        return h.hexdigest(length=16)

    def _refuse(self, reason: str, subject: str, message: str) -> tuple[None, str]:
        with self._lock:
            return self._refuse_locked(reason, subject, message)

    def _refuse_locked(self, reason: str, subject: str, message: str) -> tuple[None, str]:
        self.refused[reason] += 1
        if (reason, subject) not in self._logged:  # once per adapter and reason: requests repeat
            self._logged.add((reason, subject))
            log.warning("s3kv: %s; its requests are neither served from nor saved to the cache "
                        "(counted as lora_unidentified)", message)
        return None, message


class _ShortRead(Exception):
    """A file's size differs from the one first seen: it changed while it was read."""


@dataclass(eq=False)
class _Adapter:
    path: str
    state: str = _PENDING
    why: str = ""
    identity: str = ""
    files: list[tuple[str, str]] = field(default_factory=list)
    #: Stats when first seen (None: it could not be read then).
    signature: _Signature | None = None


def _adapter_files(path: str) -> list[tuple[str, str]]:
    """(name, full path) of what identifies the adapter at ``path``, in a fixed order."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    if not os.path.isdir(path):
        raise ValueError("no such file or directory")
    names = sorted(n for n in os.listdir(path) if n == ADAPTER_CONFIG or n.startswith(ADAPTER_WEIGHTS_PREFIX))
    if ADAPTER_CONFIG not in names:
        raise ValueError(f"no {ADAPTER_CONFIG}")
    if len(names) < 2:
        raise ValueError(f"no {ADAPTER_WEIGHTS_PREFIX}* weights file")
    files = [(n, os.path.join(path, n)) for n in names]
    for n, full in files:
        if not os.path.isfile(full):
            raise ValueError(f"{n} is not a regular file")
    return files


def _signature(files: list[tuple[str, str]], path: str) -> _Signature:
    """Sizes, times and inodes of the files, and of the directory (a file added or removed)."""
    out = []
    for name, full in [("", path), *files]:
        st = os.stat(full)
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    return tuple(out)


def _apply_settings(llm_args: Any) -> bytes:
    lc = getattr(llm_args, "lora_config", None)
    fields: dict[str, Any] = {}
    for name in _APPLY_FIELDS:
        v = getattr(lc, name, None) if not isinstance(lc, Mapping) else lc.get(name)
        if isinstance(v, (list, tuple, set, frozenset)):
            v = sorted(str(x) for x in v)
        elif isinstance(v, Mapping):
            v = {str(k): str(x) for k, x in v.items()}
        elif v is not None:
            v = str(v)
        fields[name] = v
    return json.dumps(fields, sort_keys=True).encode()


def _changed_message(path: str) -> str:
    return (f"LoRA adapter {path} changed on disk while this engine runs (the engine may still apply "
            "the weights it loaded before); publish changed adapters under a new path")


def _conflict_message(task: int) -> str:
    return (f"LoRA task id {task} was used for two different adapters; the engine caches adapters by "
            "task id, so which weights it applies is unknowable (give each adapter its own id)")
