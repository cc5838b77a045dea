"""The ``s3kv`` command line. Each command lives in the module named for what it does."""

from __future__ import annotations

import os

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default=os.environ.get("S3KV_LOG_LEVEL", "WARNING"), show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """s3kv: share TensorRT-LLM prompt KV across a fleet through S3."""
    from .logs import configure_logging

    configure_logging(log_level.upper())


def _register() -> None:
    from .demo import demo_command

    main.add_command(demo_command, "demo")
    try:
        from .bench.cli import bench_group
    except ImportError:  # pragma: no cover - while the bench package is being built
        pass
    else:
        main.add_command(bench_group, "bench")
    try:
        from .ops import ops_commands
    except ImportError:  # pragma: no cover
        pass
    else:
        for name, cmd in ops_commands().items():
            main.add_command(cmd, name)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
