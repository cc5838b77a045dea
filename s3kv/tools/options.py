"""Helpers the ``s3kv`` commands share: how errors look, ``--url``'s check, waiting for Ctrl-C.

The commands (:mod:`.cli`, :mod:`.demo`, :mod:`.ops`, :mod:`.bench.cli`) import these from here,
so no command module imports another to reach them.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

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

    Never the exception's class name: s3kv's own errors (bad settings, store errors) carry messages
    written for users; a file the system refused reads ``<file>: <reason>``; anything else is its
    message (``s3kv --debug`` shows the traceback, with the type).
    """
    from ..config import redact
    from ..store.base import StoreError

    if isinstance(exc, StoreError):
        from .storeerrors import describe

        return redact(describe(exc))
    if isinstance(exc, OSError) and exc.strerror:
        return redact(f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror)
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return redact(first or "an unexpected error that says nothing more")


def url_option(url: str | None) -> str | None:
    """A command's ``--url`` value, checked here so that its errors name ``--url`` (the settings'
    own check, and the store factory's, would name S3KV_URL, which the user did not set)."""
    if url is None:
        return None
    from ..config import ConfigError, check_url, redact_url
    from ..store.base import StoreConfigError
    from ..store.factory import SETTING, parse_store_url

    try:
        url = check_url(url, "--url")
        parse_store_url(url)  # what the store would refuse when opened: a bucket name, a query ...
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("--url: "), param_hint="--url") from None
    except StoreConfigError as exc:
        why = str(exc).removeprefix(f"{SETTING}={redact_url(url)!r}: ").partition(". Accepted: ")[0]
        raise click.BadParameter(f"{why}, got {redact_url(url)!r}", param_hint="--url") from None
    return url


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


def writable_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for an option naming a file the command writes (``--plot``, ``--env-file``):
    checked when the command line is read, before any work, by opening it for append (which
    creates nothing that was not there: a file this check created is removed again)."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value)
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write {value}: {exc.strerror or exc}", ctx=ctx, param=param) from None
    if not existed:
        path.unlink(missing_ok=True)
    return value


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"`` (a figure not known)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def token_counts(text: str, param_hint: str) -> tuple[int, ...]:
    """``"1k,4k,16384"`` -> ``(1024, 4096, 16384)``: token counts as every command takes them (``k`` is
    1024, as in block-aligned prompt sizes); anything else is a BadParameter naming the option."""
    out = []
    for part in text.split(","):
        word = part.strip().lower()
        mult = 1024 if word.endswith("k") else 1
        try:
            n = float(word[:-1] if mult > 1 else word) * mult
        except ValueError:
            n = -1
        if n <= 0 or n != int(n):
            raise click.BadParameter(
                f"{part.strip()!r} is not a token count; expected positive whole numbers, comma-separated, "
                "with k for 1024 (e.g. 1k,4k,16384)", param_hint=param_hint)
        out.append(int(n))
    return tuple(out)


def retention_line(rl: dict[str, Any]) -> str:
    """The retention gc learns from the dated reads (``s3kv.core.retention``) in a line: ``bench
    trace``'s (what it learnt over the replay) and ``s3kv stats --engine``'s (what it learns from
    the engines' reads summed)."""
    if rl.get("retention_s") is None:
        return (f"retention: the {rl['ceiling_s']:.0f} s ceiling (S3KV_RETENTION_H): {rl.get('reads_dated', 0):.0f} "
                "dated reads, too few to learn from")
    moved = (f"; {rl['min_s']:.0f}-{rl['max_s']:.0f} s over the trace, {rl['changes']} change(s), "
             f"{rl.get('ghost_reads', 0)} ghost read(s)"
             if "changes" in rl else f" from {rl['reads_dated']:.0f} dated reads")
    return (f"retention: gc learns {rl['retention_s']:.0f} s{moved} (ceiling {rl['ceiling_s']:.0f} s; "
            "S3KV_RETENTION_AUTO, docs/operations.md)")
