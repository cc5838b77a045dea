"""Structured (key=value) logs; request ids travel in the message's ``extra``."""

from __future__ import annotations

import json
import logging
import sys
import time


class KeyValueFormatter(logging.Formatter):
    """One line per event: time, level, logger, message, then any structured extras."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        base = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._skip and not k.startswith("_"):
                base[k] = v
        if record.exc_info:
            base["exc"] = self.formatException(record.exc_info)
        return json.dumps(base, default=str)


def configure_logging(level: str = "WARNING") -> None:
    root = logging.getLogger("s3kv")
    if any(getattr(h, "_s3kv", False) for h in root.handlers):
        root.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    handler._s3kv = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
