"""What the engine's iterations say a lookup's stall costs the requests running beside it.

TensorRT-LLM asks for a lookup on its executor thread, inside scheduling: while it waits, no
request on the engine advances. On the overlap loop (the default) the scheduler of the next pass
runs while the GPU still computes this pass's forward, so a stall up to about one forward is
hidden; beyond it the GPU idles, and every request in the batch gets its next token that much
later. So a lookup's stall costs:

* the request looked up: the stall, against the prefill a hit saves (``core.lookup.stall_budget_s``);
* every co-running request: the stall **beyond what the overlap hides**, added to its
  inter-token latency; the whole engine: that much GPU time.

:class:`Pace` measures what that needs, from calls the leader sees anyway: the batch of the
latest pass (``build_connector_meta``'s requests) and the time between passes without a lookup
in them -- on a GPU-bound engine, the forward time the overlap loop hides a lookup behind (an
overestimate by the host's own scheduling work: a few ms). On the non-overlap loop nothing is
hidden. A pass that comes more than ``IDLE_S`` after the last one ends an idle period: it says
nothing about the forward, and a batch that old runs no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: A gap between passes longer than this is the engine idling, not a forward.
IDLE_S = 1.0
#: Weight of the newest pass in the moving average of the forward time.
_ALPHA = 0.1


class Pace:
    def __init__(self, overlap: bool = False, clock: Callable[[], float] = time.perf_counter):
        self.overlap = overlap
        self._clock = clock
        #: Requests in the latest pass's batch, and the moving average of a pass's time.
        self.batch = 0
        #: Requests the leader tracks besides the one being looked up (set before each lookup).
        self.others = 0
        self.forward_s = 0.0
        self._last: float | None = None
        self._stalled = False

    def iteration(self, batch: int) -> None:
        """A pass built its metadata for ``batch`` requests."""
        now = self._clock()
        if self._last is not None and not self._stalled:
            dt = now - self._last
            if dt <= IDLE_S:
                self.forward_s = dt if self.forward_s == 0.0 else (1 - _ALPHA) * self.forward_s + _ALPHA * dt
        self._last, self._stalled, self.batch = now, False, batch

    def stalled(self) -> None:
        """A lookup ran in the current pass: its time says nothing of the forward."""
        self._stalled = True

    def corunning(self) -> int:
        """Requests that wait for a lookup now: the latest batch, unless the engine went idle, and
        no more than the requests the leader still tracks (the batch may have finished since)."""
        if self._last is None or self._clock() - self._last > IDLE_S:
            return 0
        return max(0, min(self.batch, self.others))

    def hidden_s(self) -> float:
        """How much of a lookup's stall the overlap loop hides behind the forward."""
        return self.forward_s if self.overlap else 0.0
