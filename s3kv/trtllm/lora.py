"""A LoRA adapter's identity: what a LoRA request's KV is keyed by, never its integer id.

Why not the id: TensorRT-LLM's ``lora_task_id`` is ``LoRARequest.lora_int_id``, a number each
deployment picks for itself (its multi-LoRA examples number adapters 1, 2, 3), so cluster A's
adapter 7 and cluster B's adapter 7 are different weights -- and integrity tags cannot tell
them apart, both clusters being legitimate signers. A LoRA changes the KV of every layer it
adapts, so its pages may only be shared where the *weights* are the same.

What the scheduler-side ``LlmRequest`` carries (TensorRT-LLM's PyTorch executor,
``executor_request_to_llm_request``): ``lora_task_id``, ``py_lora_path`` (the
``LoRARequest.lora_path`` the engine loads the adapter from), and ``lora_config`` (module ids,
layers and ranks: no weights) and ``lora_weights`` (None on the PyTorch backend when the lookup
runs). The adapter's name does not reach it. So the identity is built from the path:

* a directory (Hugging Face PEFT, what ``HfLoraLoader`` reads): ``adapter_config.json`` and
  every ``adapter_model.*`` file, names and whole contents;
* a file (a NeMo ``.nemo`` archive): its whole contents;

plus the engine's ``lora_config`` fields that decide how an adapter is applied (target modules
and their mapping, checkpoint source). Whole contents, not headers: two trainings of one
recipe have identical safetensors headers. Hashed once per path with BLAKE3 (all cores) in a
background thread, the same order of work as the engine's own loading of the adapter; until the
hash is done the adapter's requests are neither served nor saved (counted as pending, not warned).

**When the engine reads those files** (upstream, PyTorch backend): rank 0 loads an adapter when
the first request naming its task id is *enqueued* (``BaseWorker._enqueue_request`` ->
``LoraManager.load_from_ckpt``), before the scheduler -- and s3kv -- see that request; every other
rank at the first ``prepare_resources`` that schedules one of its requests
(``PeftCacheManager.add_request_peft``), after s3kv's lookup of it. Both keep those weights for
the task id while the process lives (``LoraManager`` skips ids it holds). Nothing the lookup sees
says what was read or when the request arrived (the C++ request keeps an arrival time only with
``return_perf_metrics``, on the steady clock, unreadable from Python). So what s3kv hashes is
only bound to what the engine loaded by evidence on disk (``filehash.py``: every way to make a
path give other bytes changes a ctime on the way, symbolic links included, which s3kv resolves
and records):

* files changed after s3kv first saw the path (while it hashed them included): refused for good;
* files, or a link on the path, changed less than ``S3KV_LORA_SETTLE_S`` before s3kv first saw a
  request of this task id: that request may have *arrived* before the change (it waits in the
  engine's queue between arrival and its first scheduling), so the engine may hold the old
  bytes: refused for that task id. The setting is the longest queue wait it covers.

A request whose identity cannot be established is neither served nor saved (counted per
reason, logged once per adapter or task): no path on the request (an older TensorRT-LLM), files
missing or unreadable, changed as above, or one task id seen with two identities (that id stays
refused).
"""

from __future__ import annotations

import json
import logging
import os
import stat as stat_mod
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import blake3

from .filehash import CHUNK, ShortRead, Stat, file_stat, hash_file, resolve

log = logging.getLogger("s3kv.lora")

#: Files of a PEFT adapter directory that ``HfLoraLoader`` reads (config, then the weights).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS_PREFIX = "adapter_model."
#: ``llm_args.lora_config`` fields that change how an adapter's weights are applied (capacity
#: fields such as ``max_loras`` do not).
_APPLY_FIELDS = ("lora_target_modules", "trtllm_modules_to_hf_modules", "lora_ckpt_source")

#: Refusal reasons (the keys of :attr:`AdapterIdentities.refused`).
NO_PATH, UNREADABLE, CHANGED, ID_CONFLICT = "no_path", "unreadable", "changed_on_disk", "id_conflict"
#: The files (or a link on the path) changed within the settle time before a task id was first seen.
RECENT = "changed_before_first_request"
#: ``resolve``'s answer while the adapter is being hashed (not a refusal: it clears by itself).
PENDING = "LoRA adapter identity being computed"
_PENDING, _READY = "pending", "ready"
#: Default of ``S3KV_LORA_SETTLE_S`` (s3kv.config).
DEFAULT_SETTLE_S = 60.0


class AdapterIdentities:
    """Adapter identities of one engine, cached per path. Thread-safe; never raises.

    ``settle_s``: ``S3KV_LORA_SETTLE_S``; ``clock``: wall-clock seconds (file ctimes are wall time)."""

    def __init__(self, llm_args: Any = None, settle_s: float = DEFAULT_SETTLE_S, clock: Any = time.time):
        self._apply = _apply_settings(llm_args)
        self._settle_ns = int(settle_s * 1e9)
        self._clock = clock
        self._lock = threading.Lock()
        self._paths: dict[str, _Adapter] = {}
        #: task id -> the path it was first seen with: the engine caches the weights it loads
        #: for a task id, so the first path is the one whose weights it applies.
        self._task_path: dict[int, str] = {}
        #: task id -> when s3kv first saw a request of it (ns, wall clock).
        self._task_seen: dict[int, int] = {}
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
        now = int(self._clock() * 1e9)
        with self._lock:
            if task in self._conflicted:
                return self._refuse_locked(ID_CONFLICT, f"task {task}", _conflict_message(task))
            first = self._task_path.setdefault(task, path)
            seen = self._task_seen.setdefault(task, now)
            a = self._adapter_locked(path, now)
            if first != path:  # one id, two paths: only the same weights are the same adapter
                b = self._adapter_locked(first, now)
                if a.state == b.state == _READY and a.identity != b.identity:
                    self._conflicted.add(task)
                    return self._refuse_locked(ID_CONFLICT, f"task {task}", _conflict_message(task))
                if b.state != _READY:
                    a = b  # the weights the engine applies are those of the first path
            if a.state in (_READY, _PENDING) and a.newest > seen - self._settle_ns:
                return self._refuse_locked(RECENT, f"task {task}", self._recent_message(a, task, seen))
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

    def _adapter_locked(self, path: str, now: int) -> _Adapter:
        """The path's state, checked against the files as they are now (a few stats)."""
        a = self._paths.get(path)
        if a is None:
            # First sight: what the path resolves to now, recorded even when it cannot be read;
            # any later difference refuses the path for good.
            a = self._paths[path] = _Adapter(path)
            try:
                a.files, a.evidence = _read_evidence(path)
            except (OSError, ValueError) as e:
                a.state, a.why = UNREADABLE, f"LoRA adapter {path}: {e}"
                return a
            a.newest = a.evidence.newest_ctime()
            a.state = _PENDING
            # Hashed off the scheduler thread (a large adapter takes a second): until it is done
            # the adapter's requests are neither served nor saved.
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="s3kv-lora-hash")
            self._hashing = [f for f in self._hashing if not f.done()]
            self._hashing.append(self._hasher.submit(self._hash, a))
            return a
        if a.state in (_READY, _PENDING) or (a.state == UNREADABLE and a.evidence is None):
            if not _unchanged(a):
                a.state, a.why = CHANGED, _changed_message(path)
        return a

    def _hash(self, a: _Adapter) -> None:
        first = a.evidence
        assert first is not None  # hashed only when it could be read at first sight
        try:
            identity = self._digest(a.files, [st[0] for _, st in first.files])
            _, now = _read_evidence(a.path, [n for n, _ in a.files])
            same = now.chain == first.chain and now.files == first.files
            state, why = (_READY, "") if same else (CHANGED, _changed_message(a.path))
        except ShortRead:
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
        """BLAKE3 of the files (by their real paths) with the sizes first seen."""
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update(b"s3kv-lora-v1\0" + self._apply)
        buf = memoryview(bytearray(CHUNK))
        for (name, real), size in zip(files, sizes, strict=True):
            h.update(name.encode() + b"\0" + size.to_bytes(8, "little"))
            hash_file(real, size, h, buf, name)
        return h.hexdigest(length=16)

    def _recent_message(self, a: _Adapter, task: int, seen: int) -> str:
        age = max(0.0, (seen - a.newest) / 1e9)
        return (f"LoRA adapter {a.path} (task id {task}) changed on disk {age:.1f} s before this engine "
                f"first saw a request for it, less than S3KV_LORA_SETTLE_S ({self._settle_ns / 1e9:g} s): "
                "the engine loads an adapter when its first request arrives, which may have been before "
                "the change; publish adapters at least that long before their first request (a new "
                "lora_int_id then starts afresh)")

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


@dataclass(frozen=True)
class _Evidence:
    """How a path resolved and what it held: any difference later means other bytes."""

    #: ("link", path, device, inode, ctime_ns) of every symbolic link passed (to the adapter and
    #: to each file), ("dir", path, device, inode) of every real directory above.
    chain: tuple[tuple[Any, ...], ...]
    #: The adapter directory's stat (None for a one-file adapter): it changes with its listing.
    dir: Stat | None
    #: (name, stat) of every file read.
    files: tuple[tuple[str, Stat], ...]

    def newest_ctime(self) -> int:
        links = [e[4] for e in self.chain if e[0] == "link"]
        dirs = [self.dir[2]] if self.dir is not None else []
        return max([*links, *dirs, *(st[2] for _, st in self.files)], default=0)


@dataclass(eq=False)
class _Adapter:
    path: str
    state: str = _PENDING
    why: str = ""
    identity: str = ""
    #: (name, real path) of the files hashed, in a fixed order.
    files: list[tuple[str, str]] = field(default_factory=list)
    #: At first sight (None: it could not be read then).
    evidence: _Evidence | None = None
    #: Newest ctime of that evidence (ns).
    newest: int = 0


def _read_evidence(path: str, names: list[str] | None = None) -> tuple[list[tuple[str, str]], _Evidence]:
    """The files at ``path`` (``names``: the ones known, else listed) and the evidence of what they
    are. Raises ``OSError`` / ``ValueError`` when they cannot be read."""
    r = resolve(path)
    chain: list[tuple[Any, ...]] = [("link", *x) for x in r.links] + [("dir", *x) for x in r.dirs]
    st = os.stat(r.real)
    if stat_mod.S_ISREG(st.st_mode):
        return [(os.path.basename(path), r.real)], _Evidence(tuple(chain), None, ((os.path.basename(path), file_stat(st)),))
    if not stat_mod.S_ISDIR(st.st_mode):
        raise ValueError("not a file or directory")
    files, stats = [], []
    for name in names if names is not None else _adapter_names(r.real):
        f = resolve(os.path.join(r.real, name))
        chain += [("link", *x) for x in f.links] + [("dir", *x) for x in f.dirs if x[0] != r.real and x not in r.dirs]
        fst = os.stat(f.real)
        if not stat_mod.S_ISREG(fst.st_mode):
            raise ValueError(f"{name} is not a regular file")
        files.append((name, f.real))
        stats.append((name, file_stat(fst)))
    return files, _Evidence(tuple(chain), file_stat(st), tuple(stats))


def _unchanged(a: _Adapter) -> bool:
    if a.evidence is None:  # unreadable when first seen: still so?
        try:
            _read_evidence(a.path)
        except (OSError, ValueError):
            return True
        return False
    try:
        files, now = _read_evidence(a.path, [n for n, _ in a.files])
        if now == a.evidence:
            return True
        # Only the directory changed: unchanged if it still lists the same adapter files (e.g. a
        # README added).
        if (a.evidence.dir is not None and (now.chain, now.files) == (a.evidence.chain, a.evidence.files)
                and _adapter_names(resolve(a.path).real) == [n for n, _ in files]):
            a.evidence = now
            return True
    except (OSError, ValueError):
        pass  # a file gone: changed
    return False


def _adapter_names(directory: str) -> list[str]:
    """Names of the files that identify the adapter in ``directory``, in a fixed order."""
    names = sorted(n for n in os.listdir(directory) if n == ADAPTER_CONFIG or n.startswith(ADAPTER_WEIGHTS_PREFIX))
    if ADAPTER_CONFIG not in names:
        raise ValueError(f"no {ADAPTER_CONFIG}")
    if len(names) < 2:
        raise ValueError(f"no {ADAPTER_WEIGHTS_PREFIX}* weights file")
    return names


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
