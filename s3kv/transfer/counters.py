"""Thread-safe counters shared by the worker and its transfer threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: ``hook(name, delta)`` — e.g. a Prometheus counter's ``labels(name).inc(delta)``.
MetricsHook = Callable[[str, float], None]


class Counters:
    def __init__(self, hook: MetricsHook | None = None):
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._hook = hook

    def add(self, name: str, delta: float = 1) -> None:
        if not delta:
            return
        with self._lock:
            self._values[name] = self._values.get(name, 0) + delta
        if self._hook is not None:
            try:
                self._hook(name, delta)
            except Exception:  # noqa: BLE001 - metrics must never break data movement
                log.exception("s3kv: metrics hook failed for %s", name)

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)
