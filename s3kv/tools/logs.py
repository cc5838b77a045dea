"""Logs on stderr: one line per event, credentials in URLs removed.

Two formats: ``json`` (the default inside an engine: one JSON object per line with time, level,
logger, message and any structured ``extra`` such as request ids) and ``text`` (the ``s3kv``
command line: ``s3kv: warning: message``). Both pass every message through
:func:`s3kv.config.redact`, so a URL with ``user:password@`` never reaches a log line.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from ..config import redact


class KeyValueFormatter(logging.Formatter):
    """One line per event: time, level, logger, message, then any structured extras."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        base = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for k, v in record.__dict__.items():
            if k not in self._skip and not k.startswith("_"):
                base[k] = redact(v) if isinstance(v, str) else v
        if record.exc_info:
            base["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(base, default=str)


class TextFormatter(logging.Formatter):
    """``s3kv: warning: message`` -- for people at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        # Messages written for an engine's own log often start with "s3kv: " to say whose they
        # are; here the line already says so.
        message = redact(record.getMessage()).removeprefix("s3kv: ")
        line = f"s3kv: {record.levelname.lower()}: {message}"
        if record.exc_info:
            line += "\n" + redact(self.formatException(record.exc_info))
        return line


FORMATS = {"json": KeyValueFormatter, "text": TextFormatter}


def configure_logging(level: str = "WARNING", fmt: str = "json") -> None:
    """Send the ``s3kv`` loggers to stderr at ``level`` in format ``fmt`` (``json`` or ``text``).

    Calling it again changes level and format of the same handler (never adds a second one).
    """
    root = logging.getLogger("s3kv")
    formatter = FORMATS[fmt]()
    for h in root.handlers:
        if getattr(h, "_s3kv", False):
            h.setFormatter(formatter)
            if isinstance(h, logging.StreamHandler):
                h.setStream(sys.stderr)  # stderr may have been swapped since (test runners)
            root.setLevel(level.upper())
            return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler._s3kv = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
