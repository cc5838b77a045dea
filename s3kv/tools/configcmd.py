"""``s3kv config``: every effective setting, and where its value came from.

Precedence, highest first: a command's flag (``--url``), the environment (``S3KV_<NAME>``), the
settings file (``S3KV_CONFIG_FILE``), the default -- written once, in :mod:`s3kv.config`; why this
order: docs/configuration.md.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import click

from .options import url_option

PRECEDENCE = "command-line flag (--url) > environment (S3KV_<NAME>) > settings file (S3KV_CONFIG_FILE) > default"


def _shown(value: Any, secret: bool) -> Any:
    from ..config import redact

    if secret:
        return "***" if value else ""
    return redact(value) if isinstance(value, str) else value


@click.command("config")
@click.option("--url", default=None, help="As the other commands take it: shown as coming from the flag.")
@click.option("--all", "show_all", is_flag=True, help="Also list the settings at their defaults.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def config_command(url: str | None, show_all: bool, as_json: bool) -> None:
    """Every effective setting and where its value came from (flag, environment, file, default).

    The same settings an engine, the demo and the operator commands load; a bad value stops here
    with the one line that would stop them.
    """
    import os

    from ..config import Settings, file_values, setting_sources

    settings, sources = setting_sources(url=url_option(url))
    path = os.environ.get("S3KV_CONFIG_FILE") or None
    in_file = file_values()
    rows = []
    for f in fields(Settings):
        secret = f.repr is False
        value, src = getattr(settings, f.name), sources[f.name]
        where = {"env": f"env S3KV_{f.name.upper()}", "file": "file", "flag": "flag --url", "default": "default"}[src]
        if src in ("env", "flag") and f.name in in_file:
            where += f" (over the file's {_shown(in_file[f.name], secret)!r})"
        rows.append((f.name, _shown(value, secret), src, where))
    if as_json:
        doc = {"file": path, "precedence": PRECEDENCE,
               "settings": {n: {"value": v, "from": s} for n, v, s, _ in rows}}
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"settings file: {path} (S3KV_CONFIG_FILE)" if path else "settings file: none (S3KV_CONFIG_FILE is not set)")
    click.echo(f"precedence: {PRECEDENCE}")
    shown = [r for r in rows if show_all or r[2] != "default"]
    if shown:
        w0 = max(len("SETTING"), *(len(r[0]) for r in shown))
        w1 = max(len("VALUE"), *(len(str(r[1])) for r in shown))
        click.echo("")
        click.echo(f"{'SETTING':<{w0}}  {'VALUE':<{w1}}  FROM")
        for name, value, _, where in shown:
            click.echo(f"{name:<{w0}}  {str(value):<{w1}}  {where}")
    hidden = len(rows) - len(shown)
    if hidden:
        click.echo(f"{'' if shown else chr(10)}{hidden} other settings at their defaults (s3kv config --all lists them)")
