"""The ``s3kv`` console script's entry point (``[project.scripts]`` in pyproject.toml).

The commands live in :mod:`s3kv.tools.cli`; this module keeps the path that installed scripts
import (``from s3kv.cli import main``) and runs as ``python -m s3kv.cli``.
"""

from __future__ import annotations

from .tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    main()
