"""``s3kv bench <lookup|transfer|staging|e2e|integrity|trace>``. Heavy imports stay inside the commands."""

from __future__ import annotations

import click

from .common import common_options, finish, progress


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench_group() -> None:
    """Measure s3kv against the baselines it replaces (table, --json, --plot)."""


def _ints(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(float(part) * mult))
    return tuple(out)


def _floats(text: str | None) -> tuple[float, ...] | None:
    return tuple(float(x) for x in text.split(",")) if text else None


# --------------------------------------------------------------------------- lookup


@bench_group.command("lookup")
@common_options(default_latency_ms=20.0)
@click.option(
    "--prompts",
    default=None,
    help="Prompt lengths in tokens, e.g. 1k,4k,16k,64k,128k (the default; --quick: 1k,4k).",
)
@click.option(
    "--blocks-per-object",
    type=int,
    default=0,
    show_default=True,
    help="0: what s3kv picks for Gemma-3-27B's real pages at TP 1.",
)
@click.option(
    "--seq-cap",
    type=int,
    default=None,
    help="HEADs of the sequential scan actually run per prompt before extrapolating "
    "(default 256, --quick 64; 0 = run it all).",
)
def lookup_command(
    as_json: bool,
    plot_path: str | None,
    url: str | None,
    server: str,
    latency_ms: float,
    quick: bool,
    keep: bool,
    prompts: str | None,
    blocks_per_object: int,
    seq_cap: int | None,
) -> None:
    """Lookup round trips and latency, 1k-128k-token prompts, vs the seed's per-block HEAD scan."""
    from . import lookup, plot
    from .common import bench_store

    chosen = _ints(prompts) or (lookup.QUICK_PROMPTS if quick else lookup.DEFAULT_PROMPTS)
    cap = seq_cap if seq_cap is not None else (64 if quick else 256)
    cfg = lookup.LookupConfig(prompts=chosen, blocks_per_object=blocks_per_object, seq_cap=cap)
    with bench_store(url, server=server, latency_ms=latency_ms, name="lookup", keep=keep) as bs:
        progress(f"lookup: store {bs.where}, {latency_ms:g} ms injected per request")
        res = lookup.run_lookup(bs, cfg)
    finish(res, as_json=as_json, table=lookup.table, plot_path=plot_path, plot=plot.plot_lookup)


# --------------------------------------------------------------------------- transfer


@bench_group.command("transfer")
@common_options(default_latency_ms=0.0)
@click.option(
    "--object-mib", default=None, help="Object sizes in MiB, e.g. 4,8,16 (the default; --quick: 4)."
)
@click.option(
    "--total-mib", type=int, default=None, help="Bytes moved per object size (default 256, --quick 16)."
)
@click.option(
    "--page-mib",
    type=float,
    default=1.0,
    show_default=True,
    help="Page (block) size; the seed-style path stores one page per object.",
)
@click.option("--repeats", type=int, default=1, show_default=True, help="Best of this many runs per method.")
def transfer_command(
    as_json: bool,
    plot_path: str | None,
    url: str | None,
    server: str,
    latency_ms: float,
    quick: bool,
    keep: bool,
    object_mib: str | None,
    total_mib: int | None,
    page_mib: float,
    repeats: int,
) -> None:
    """Save/load throughput of s3kv's pipelines vs raw parallel boto3 and a seed-style sequential path."""
    from . import plot, transfer
    from .common import bench_store

    sizes = _floats(object_mib) or ((4.0,) if quick else transfer.DEFAULT_OBJECT_MIB)
    total = total_mib or (16 if quick else 256)
    cfg = transfer.TransferConfig(
        object_mib=sizes, total_mib=total, page_mib=page_mib, repeats=max(1, repeats)
    )
    with bench_store(url, server=server, latency_ms=latency_ms, name="transfer", keep=keep) as bs:
        progress(f"transfer: store {bs.where}, {latency_ms:g} ms injected per request")
        res = transfer.run_transfer(bs, cfg)
    finish(res, as_json=as_json, table=transfer.table, plot_path=plot_path, plot=plot.plot_transfer)


# --------------------------------------------------------------------------- staging


@bench_group.command("staging")
@click.option("--json", "as_json", is_flag=True, help="Print ONE JSON object on stdout.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write a PNG chart here.",
)
@click.option("--quick", is_flag=True, help="Tiny sizes (tests, smoke runs).")
@click.option("--page-mib", default=None, help="Page sizes in MiB (default 0.25,1,4,16; --quick 1).")
@click.option("--pages", type=int, default=None, help="Pages per run (default 64, --quick 8).")
@click.option("--device", default="cuda", show_default=True)
def staging_command(
    as_json: bool, plot_path: str | None, quick: bool, page_mib: str | None, pages: int | None, device: str
) -> None:
    """Device<->pinned-host page copies through s3kv's copy path vs one contiguous memcpy (needs CUDA)."""
    from . import plot, staging

    sizes = _floats(page_mib) or ((1.0,) if quick else staging.DEFAULT_PAGE_MIB)
    n = pages or (8 if quick else 64)
    res = staging.run_staging(sizes, n, device)
    if res.get("skipped"):
        progress(f"staging: skipped -- {res['reason']}")
    finish(res, as_json=as_json, table=staging.table, plot_path=plot_path, plot=plot.plot_staging)


# --------------------------------------------------------------------------- e2e


@bench_group.command("e2e")
@common_options(default_latency_ms=0.0)
@click.option("--rounds", type=int, default=None, help="Rounds of the memory soak (default 12, --quick 3).")
@click.option(
    "--gpu-tflops",
    type=float,
    default=None,
    help="GPU peak BF16 TFLOP/s for the prefill estimate (default: H100/H200 SXM dense, 989.4).",
)
@click.option(
    "--mfu", type=float, default=None, help="Prefill model-FLOPs utilisation assumed (default 0.40)."
)
@click.option(
    "--checkpoint-tokens",
    type=int,
    default=None,
    help="Sliding-group checkpoint spacing (default: the demo's 512; s3kv's own default is 4096).",
)
def e2e_command(
    as_json: bool,
    plot_path: str | None,
    url: str | None,
    server: str,
    latency_ms: float,
    quick: bool,
    keep: bool,
    rounds: int | None,
    gpu_tflops: float | None,
    mfu: float | None,
    checkpoint_tokens: int | None,
) -> None:
    """Multi-turn VSWA workload: cold then warm cluster, both storage policies, prefill saved, memory soak."""
    from . import e2e, plot
    from .common import bench_store

    cfg = e2e.E2EConfig.quick() if quick else e2e.E2EConfig()
    if rounds is not None:
        cfg = cfg.replace(rounds=rounds)
    if gpu_tflops is not None:
        cfg = cfg.replace(gpu_tflops=gpu_tflops)
    if mfu is not None:
        cfg = cfg.replace(mfu=mfu)
    if checkpoint_tokens is not None:
        cfg = cfg.replace(checkpoint_tokens=checkpoint_tokens)
    with bench_store(url, server=server, latency_ms=latency_ms, name="e2e", keep=keep) as bs:
        progress(f"e2e: store {bs.where}, {latency_ms:g} ms injected per request")
        res = e2e.run_e2e(bs, cfg)
    finish(res, as_json=as_json, table=e2e.table, plot_path=plot_path, plot=plot.plot_e2e)


# --------------------------------------------------------------------------- integrity


@bench_group.command("integrity")
@click.option("--json", "as_json", is_flag=True, help="Print ONE JSON object on stdout.")
@click.option("--quick", is_flag=True, help="Tiny sizes (tests, smoke runs).")
@click.option("--page-mib", default=None, help="Page sizes in MiB (default 0.25,1,4; --quick 0.25).")
@click.option("--object-mib", type=float, default=None, help="Object size in MiB (default 32, --quick 2).")
@click.option("--threads", type=int, default=0, show_default=True, help="Parallel columns' threads; 0 = min(4, cores).")
def integrity_command(as_json: bool, quick: bool, page_mib: str | None, object_mib: float | None, threads: int) -> None:
    """CPU cost of keyed integrity tags: signing and verifying GB/s vs xxh3 checksums alone."""
    from . import integrity

    cfg = integrity.IntegrityConfig(
        page_mib=_floats(page_mib) or ((0.25,) if quick else integrity.DEFAULT_PAGE_MIB),
        object_mib=object_mib or (2.0 if quick else 32.0),
        threads=max(0, threads),
        repeats=1 if quick else 3,
    )
    res = integrity.run_integrity(cfg)
    finish(res, as_json=as_json, table=integrity.table, plot_path=None, plot=lambda r, p: None)


# --------------------------------------------------------------------------- trace


@bench_group.command("trace")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["mooncake"]), default="mooncake", show_default=True)
@click.option(
    "--model",
    type=click.Choice(["gemma-3-27b", "gemma-3-12b", "gemma-3-4b"]),
    default="gemma-3-27b",
    show_default=True,
    help="Geometry for page sizes, objects and prefill FLOPs.",
)
@click.option(
    "--policy",
    type=click.Choice(["window", "all", "both"]),
    default="both",
    show_default=True,
    help="Storage policies replayed (the upstream example's rule is always counted).",
)
@click.option(
    "--branch-tails",
    type=click.Choice(["on", "off", "compare"]),
    default="compare",
    show_default=True,
    help="Window policy with branch-point tails, without, or both (what they add).",
)
@click.option("--limit", type=int, default=None, help="Only the first N requests.")
@click.option("--tokens-per-block", type=int, default=64, show_default=True, help="Simulator block size.")
@click.option("--full-outputs", is_flag=True, help="Generate every answer in full (slow; default: the ones re-read).")
@click.option("--checkpoint-tokens", type=int, default=4096, show_default=True)
@click.option("--put-per-1k", type=float, default=None, help="$ per 1,000 PUT-class requests (default 0.005).")
@click.option("--get-per-1k", type=float, default=None, help="$ per 1,000 GET/HEAD requests (default 0.0004).")
@click.option("--gb-month", type=float, default=None, help="$ per GB-month stored (default 0.023).")
@click.option("--retention-days", type=float, default=None, help="Days an object is kept (default 30).")
@click.option("--gpu-tflops", type=float, default=None, help="GPU peak BF16 TFLOP/s (default H100/H200, 989.4).")
@click.option("--mfu", type=float, default=None, help="Prefill model-FLOPs utilisation (default 0.40).")
@click.option("--audit", is_flag=True, help="Re-verify every page when the engine frees it (slower).")
@click.option(
    "--jobs", type=int, default=None, help="Replays run at once, one process each (default: min(2, cores))."
)
@click.option("--url", default=None, help="Store to replay on (default: in-process memory://, one per replay).")
@click.option("--json", "as_json", is_flag=True, help="Print ONE JSON object on stdout (progress on stderr).")
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None, help="Write a PNG chart here."
)
def trace_command(
    trace_file: str,
    fmt: str,
    model: str,
    policy: str,
    branch_tails: str,
    limit: int | None,
    tokens_per_block: int,
    full_outputs: bool,
    checkpoint_tokens: int,
    put_per_1k: float | None,
    get_per_1k: float | None,
    gb_month: float | None,
    retention_days: float | None,
    gpu_tflops: float | None,
    mfu: float | None,
    audit: bool,
    jobs: int | None,
    url: str | None,
    as_json: bool,
    plot_path: str | None,
) -> None:
    """Replay a request trace (Mooncake format) through the simulator and the real adapter: tokens
    served from S3 per storage policy vs the ideal and the upstream example's rule, bytes stored,
    S3 requests and dollars, prefill saved."""
    import os

    from ..cost import Prices
    from ..trace import TraceError
    from . import trace
    from .common import bench_store

    if tokens_per_block <= 0 or tokens_per_block % 4:
        raise click.BadParameter("must be a positive multiple of 4", param_hint="--tokens-per-block")
    runs: list[str] = []
    if policy in ("window", "both"):
        runs += {"on": ["window"], "off": ["window-no-branch"], "compare": ["window", "window-no-branch"]}[branch_tails]
    if policy in ("all", "both"):
        runs.append("all")
    d = Prices()
    try:
        prices = Prices(
            d.put_per_1k if put_per_1k is None else put_per_1k,
            d.get_per_1k if get_per_1k is None else get_per_1k,
            d.gb_month if gb_month is None else gb_month,
            d.retention_days if retention_days is None else retention_days,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    cfg = trace.TraceConfig(
        path=trace_file,
        fmt=fmt,
        model=trace.MODELS[model],
        runs=tuple(runs),
        limit=limit,
        tokens_per_block=tokens_per_block,
        full_outputs=full_outputs,
        checkpoint_tokens=checkpoint_tokens,
        prices=prices,
        audit=audit,
        jobs=max(1, jobs if jobs is not None else min(2, os.cpu_count() or 1)),
        url=url,
    )
    if gpu_tflops is not None:
        cfg = cfg.replace(gpu_tflops=gpu_tflops)
    if mfu is not None:
        cfg = cfg.replace(mfu=mfu)
    with bench_store(url or trace.DEFAULT_URL, name="trace") as bs:
        try:
            res = trace.run_trace(bs, cfg)
        except TraceError as e:
            raise click.ClickException(str(e)) from None
    finish(res, as_json=as_json, table=trace.table, plot_path=plot_path, plot=trace.plot_trace)
