"""The ``s3kv`` console script's entry point (``[project.scripts]`` in pyproject.toml).

The commands live in :mod:`s3kv.tools.cli`; this module keeps the path that installed scripts
import (``from s3kv.cli import main``) and runs as ``python -m s3kv.cli``.
"""

from __future__ import annotations

import os
import sys

from .tools.cli import main

__all__ = ["main", "run"]

#: Commands whose work, output included, is done when they return, and that register no exit
#: work: the store commands, and the demo (its clusters run in processes of their own, which
#: leave the same way: ``demo._main``; its embedded server stops in the command's ``finally``).
_DONE_ON_RETURN = frozenset({"ls", "stats", "verify", "gc", "demo"})


def _command(args: list[str]) -> str | None:
    """The command's name in ``args`` (after the group's own options)."""
    it = iter(args)
    for a in it:
        if a == "--log-level":
            next(it, None)
        elif not a.startswith("-"):
            return a
    return None


def run() -> None:
    """The console script: ``main``, and for the commands done on return an exit that skips the
    interpreter's teardown. Why: with native client threads still alive (obstore's runtime, the
    HEAD loop) that teardown now and then aborts -- on this 2-core box under load, 8 of 60
    ``s3kv ls`` runs that had printed their listing ended in SIGABRT, exit 134 for a command that
    succeeded (seen once in CI too). Their output is flushed first; they register no exit work."""
    try:
        main()
    except SystemExit as exc:
        if _command(sys.argv[1:]) not in _DONE_ON_RETURN:
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
