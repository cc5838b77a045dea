"""The fleet index in a trace replay: its publisher on the trace's clock.

A replay runs hours of traffic in minutes, so the publisher (``s3kv gc --index``) cannot run on
wall time beside it: :class:`ReplayIndex` is a hook the replay calls before each request with
the trace's time and its fleet -- the billed store every engine shares (``fleet.store``) and the
simulated engines (``fleet.engines``). Every ``every_s`` of the trace's clock it publishes the
engines' namespace from what that store holds (the publisher's HEADs billed as a deployment's
would be, objects expired on the trace's clock gone, as gc would have deleted them) and has every
engine pick the new index up at once; the engines judge its age on the same clock. Its first
call publishes an index even before anything is stored (an empty namespace's misses are free).

Where gc learns the retention, its publisher is taken to have been running before the trace's
first request -- a window of a fleet's ongoing traffic, which a trace is, not a namespace's
first minute: engines see an index saying gc learns before they write anything (they believe
their uploads for the floor's life until gc has reads to learn from), so gc keeps nothing for
the ceiling because an engine might not have known. What gc learns is not carried in: it starts
with no reads. Started with the trace instead, gc kept the first ~90 s of writes (the time
engines may take to see it learn) for the ceiling: on the public trace's first 1,200 requests
half the storage, a once-per-namespace cost a short replay magnifies.
"""

from __future__ import annotations

from typing import Any


class ReplayIndex:
    """``hook(now, fleet)`` (module docstring). Picklable: a replay may run in a process of its own."""

    def __init__(self, every_s: float = 10.0, learn: tuple[float, float] | None = None, learnt_s: float = 0.0):
        """``learn``: (ceiling s, gc's margin s) -- the publisher learns the retention from the
        engines' read reports (``s3kv.core.retention``) and the billed store deletes by it;
        ``learnt_s``: how long it had learnt before the trace (of other traffic: no reads kept)."""
        self.learn = learn
        self.learnt_s = learnt_s
        if every_s <= 0:
            raise ValueError(f"the fleet index's period must be > 0, got {every_s}")
        self.every_s = every_s
        self.now = 0.0
        self._last = float("-inf")
        self._publisher: Any = None
        self.passes = 0
        #: (trace s, learnt retention s) after each pass while learning.
        self.retention_s: list[tuple[float, float]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_publisher": None}

    def _clock(self) -> float:
        return self.now

    def flush(self, fleet: Any) -> None:
        """At the trace's end: every engine reports what it read, and gc learns from it once more
        (what the fleet would do in the next minutes decides how long the last objects live)."""
        if self._publisher is None or self.learn is None:
            return
        for e in fleet.engines:
            fi = e.leader.core.fleet_index()
            if fi is not None:
                fi.report(force=True)
        self._last = float("-inf")
        self(self.now, fleet)

    def __call__(self, now: float, fleet: Any) -> None:
        from ...engine.fleetindex import Publisher

        self.now = now
        cores = [e.leader.core for e in fleet.engines]
        if self._publisher is None:
            core = cores[0]
            self._publisher = Publisher(
                fleet.store, core.key_prefix.rstrip("/") + "/", integrity=core.settings.integrity,
                every_s=self.every_s, namespaces=[core.scheme.namespace_prefix], clock=self._clock,
                learn=self.learn, engine_poll_s=core.settings.fleet_index_s,
            )
            for c in cores:
                fi = c.fleet_index()
                if fi is not None:
                    fi.clock = self._clock
            if self.learn is not None:  # running since before the trace (module doc)
                from ...core.cost import EXPIRY_MARGIN_S
                from ...core.retention import engine_lag_s

                self._publisher.publish(now - engine_lag_s(self.every_s, core.settings.fleet_index_s,
                                                           EXPIRY_MARGIN_S) - self.every_s - self.learnt_s)
        if now - self._last < self.every_s:
            return
        self._last = now
        self._publisher.publish(now)
        self.passes += 1
        nsp = cores[0].scheme.namespace_prefix
        learnt = self._publisher.retention.get(nsp)
        if learnt is not None and self.learn is not None:
            pub = self._publisher
            fleet.store.keep = lambda touched_at: pub.keep_s(nsp, touched_at)
            fleet.store.keep_later = lambda touched_at: (pub.keep_s(nsp, touched_at, settled=True), pub.held_until(nsp))
            fleet.store.refresh_retention_s = learnt[0]
            self.retention_s.append((now, learnt[0]))
        for c in cores:
            fi = c.fleet_index()
            if fi is not None:
                fi.refresh()
