"""Helpers the ``s3kv`` commands share: how errors look, ``--url``'s check, waiting for Ctrl-C.

The commands (:mod:`.cli`, :mod:`.demo`, :mod:`.ops`, :mod:`.bench.cli`) import these from here,
so no command module imports another to reach them.
"""

from __future__ import annotations

import os
import signal
import threading

import click

_TRUE = {"1", "true", "yes", "on"}


def debug_enabled(ctx: click.Context | None = None) -> bool:
    """``--debug`` on the command line (``ctx.meta``), else ``S3KV_DEBUG`` in the environment."""
    if ctx is not None:
        root = ctx.find_root()
        if "s3kv.debug" in root.meta:
            return bool(root.meta["s3kv.debug"])
    return os.environ.get("S3KV_DEBUG", "").strip().lower() in _TRUE


def one_line(exc: BaseException) -> str:
    """What a user sees for ``exc``: its message, first line only, credentials removed.

    s3kv's own errors (bad settings, store errors) carry messages written for users; anything
    else is shown with its type, which is what makes it searchable.
    """
    from ..config import ConfigError, redact
    from ..core.errors import S3KvError
    from ..store.base import StoreError

    if isinstance(exc, StoreError):
        from .storeerrors import describe

        return redact(describe(exc))
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, (ConfigError, S3KvError)):
        return redact(first or type(exc).__name__)
    return redact(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


def url_option(url: str | None) -> str | None:
    """A command's ``--url`` value, checked here so that its errors name ``--url`` (the settings'
    own check would name S3KV_URL, which the user did not set)."""
    if url is None:
        return None
    from ..config import ConfigError, check_url

    try:
        return check_url(url, "--url")
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("--url: "), param_hint="--url") from None


def export_lines(env: dict[str, str]) -> list[str]:
    import shlex

    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def wait_for_interrupt() -> None:
    """Block until SIGINT (Ctrl-C) or SIGTERM."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
