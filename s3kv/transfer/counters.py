"""Thread-safe counters shared by the worker and its transfer threads."""

from __future__ import annotations

import threading


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, name: str, delta: float = 1) -> None:
        if not delta:
            return
        with self._lock:
            self._values[name] = self._values.get(name, 0) + delta

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)
