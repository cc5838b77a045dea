"""Uploads still queued when the engine's process exits: drained for a bounded time, the rest counted.

TensorRT-LLM calls no connector ``shutdown()``; without this, saves still in the upload queue at
exit would be lost silently. What could not finish is counted (``uploads_dropped_at_exit``) and logged.
Then the host tier writes what its ``evict`` policy still owes the store (objects a load read),
in what is left of the time.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from typing import Any

from ...transfer.counters import Counters
from ...transfer.upload import Uploader

log = logging.getLogger("s3kv.worker")


def install_exit_drain(core: Any, timeout_s: float) -> None:
    """At a normal exit, wait up to ``timeout_s`` for the worker ``core``'s upload queue, unless
    it was closed or collected first (only a weak reference is kept: many workers come and go
    in one process in tests and the simulator)."""
    ref = weakref.ref(core)
    pid = os.getpid()

    def drain() -> None:
        owner = ref()
        if owner is None or owner._closed or os.getpid() != pid:
            # Not in a child the engine forked that exits normally: the uploads and their
            # threads are the parent's, and a flush there would only wait out its timeout.
            return
        t0 = time.monotonic()
        try:
            _drain_uploads(owner, timeout_s, t0)
        finally:
            if owner.host_tier is not None:
                owner.host_tier.close(max(0.0, timeout_s - (time.monotonic() - t0)))

    atexit.register(drain)


def _drain_uploads(owner: Any, timeout_s: float, t0: float) -> None:
    uploader: Uploader = owner._uploader
    counters: Counters = owner._counters
    pending = uploader.pending
    if not pending:
        return
    drained = owner.flush(timeout_s)
    left = uploader.pending
    if drained:
        log.info("s3kv: drained %d upload(s) at exit in %.1f s", pending, time.monotonic() - t0)
    else:
        counters.add("uploads_dropped_at_exit", left)
        log.warning("s3kv: %d upload(s) still queued after %.1f s at exit; dropped", left, timeout_s)
