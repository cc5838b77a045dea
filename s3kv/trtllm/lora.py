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
recipe have identical safetensors headers. Hashed once per path with BLAKE3 (memory-mapped,
all cores), the same order of work as the engine's own loading of the adapter.

A request whose identity cannot be established is neither served nor saved (counted per
reason, logged once per adapter): no path on the request (an older TensorRT-LLM), files missing
or unreadable, files changed on disk while the engine runs (the engine may still hold the
weights it loaded before), or one task id seen with two identities (the engine caches adapters
by task id, so which weights it applies is unknowable; that id stays refused).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping
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

_Signature = tuple[tuple[str, int, int, int], ...]


class AdapterIdentities:
    """Adapter identities of one engine, cached per path. Thread-safe; never raises."""

    def __init__(self, llm_args: Any = None):
        self._apply = _apply_settings(llm_args)
        self._lock = threading.Lock()
        #: path -> (its files, their signature, the identity): a request for a known adapter
        #: costs a few stats, no listing and no read.
        self._by_path: dict[str, tuple[list[tuple[str, str]], _Signature, str]] = {}
        self._changed: set[str] = set()
        self._by_task: dict[int, str] = {}
        self._conflicted: set[int] = set()
        self._logged: set[tuple[str, str]] = set()
        #: Requests refused, by reason.
        self.refused: Counter[str] = Counter()

    def resolve(self, request: Any) -> tuple[str | None, str]:
        """``(identity, "")`` for a LoRA request, ``(None, "")`` for a base one, or
        ``(None, why)`` when the adapter's identity cannot be established."""
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
            identity, why, reason = self._identity_locked(path)
            if identity is None:
                return self._refuse_locked(reason, path, why)
            seen = self._by_task.setdefault(task, identity)
            if seen != identity:
                self._conflicted.add(task)
                return self._refuse_locked(ID_CONFLICT, f"task {task}", _conflict_message(task))
            return identity, ""

    # -- internals ----------------------------------------------------------------------------

    def _identity_locked(self, path: str) -> tuple[str | None, str, str]:
        if path in self._changed:
            return None, _changed_message(path), CHANGED
        cached = self._by_path.get(path)
        if cached is not None:
            files, signature, identity = cached
            try:
                now = _signature(files, path)
                if now != signature and now[1:] == signature[1:] and _adapter_files(path) == files:
                    # The directory changed, not the adapter's files (e.g. a README added).
                    self._by_path[path] = (files, now, identity)
                    signature = now
                if now == signature:
                    return identity, "", ""
            except (OSError, ValueError):
                pass  # a file gone: changed
            self._changed.add(path)
            return None, _changed_message(path), CHANGED
        try:
            files = _adapter_files(path)
            before = _signature(files, path)
        except (OSError, ValueError) as e:
            return None, f"LoRA adapter {path}: {e}", UNREADABLE
        try:
            identity = self._digest(files)
            after = _signature(files, path)
        except (OSError, ValueError) as e:
            return None, f"LoRA adapter {path}: {e}", UNREADABLE
        if after != before:  # written to while it was read: try again on a later request
            return None, f"LoRA adapter {path} changed while it was read", UNREADABLE
        self._by_path[path] = (files, before, identity)
        return identity, "", ""

    def _digest(self, files: list[tuple[str, str]]) -> str:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update(b"s3kv-lora-v1\0" + self._apply)
        for name, full in files:
            size = os.stat(full).st_size
            h.update(name.encode() + b"\0" + size.to_bytes(8, "little"))
            if size:  # an empty file cannot be mapped
                h.update_mmap(full)
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
    st = os.stat(path)
    out = [("", st.st_size, st.st_mtime_ns, st.st_ino)]
    for name, full in files:
        st = os.stat(full)
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
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
