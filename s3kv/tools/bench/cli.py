"""``s3kv bench <lookup|transfer|jitter|staging|e2e|integrity|trace|gen-trace|describe-trace>``. Heavy imports stay inside the commands.

Every table ends with a legend that says what each ratio divides by what, so a number can be
read without this source. The baseline the benchmarks compare with is what s3kv replaces: one
object per block, written and read synchronously (found by one HEAD per block per layer group,
in order) -- the shape of TensorRT-LLM's own VSWA connector example, moved to S3.

Why this is one module: the ``s3kv bench`` command group, one thin command per benchmark; the heavy
code stays in the benchmark modules.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from ..options import token_counts
from .common import common_options, finish, json_option, plot_option, progress, quick_option

#: What every ratio and column a table prints means, by command (printed under the table).
LEGENDS: dict[str, tuple[str, ...]] = {
    "lookup": (
        "cold RTs / HEADs / cold ms: round trips (waves of parallel HEADs), HEAD requests and time of "
        "one lookup with an empty local index",
        "warm RTs / warm ms: the same lookup again; 0 round trips means the local index answered",
        "seq HEADs / seq ms: a sequential scan, one HEAD per block per layer group in order (one object "
        "per block, synchronous)",
        "speedup = seq ms / cold ms (how many times faster s3kv finds the stored prefix)",
        "hit: prompt tokens the lookup found servable (at most the prompt minus its last token)",
        "per client: wall RTs = wall ms / the injected latency (round trips actually paid); exec = CPU ms "
        "on the calling (executor) thread; proc = the whole process's CPU ms; chain = hashing the "
        "prompt's block chain; client = proc - chain (the lookup's and the S3 client's own CPU)",
        "paths: probe = HEAD waves (no budget); probe_miss = the same for a prompt never stored; "
        "budget_first / budget_next = the default budget, no "
        "summary, as an engine runs out of the box: a cold lookup (a miss if the budget runs out), then "
        "the same prefix again once a lookup that ran out was finished in the background; "
        "summary_hit = namespace summary + one verify wave; "
        "summary_trusted_hit = a fresh listing trusted as the presence check; summary_miss = a cold miss; "
        "the summary paths are medians of --repeats lookups on fresh leaders",
    ),
    "lookup_local": (
        "wall ms: the lookup call's wall time (get_num_new_matched_tokens on the leader), what every "
        "co-running request waits for; cpu ms: the calling thread's CPU in it; hash ms: of which hashing "
        "the prompt's block chain (what no earlier prompt of that prefix already hashed)",
        "cases: index = objects in the key index (own uploads), a fresh leader; index_next = the same after "
        "a lookup of the prompt's first half (a conversation's previous turn); fleet_trusted = a signed, "
        "young fleet index vouches (no request); fleet_verify = the index not trusted: one verify wave to "
        "an in-memory store; fleet_half = the first half stored; fleet_miss = never stored; host = the "
        "host tier holds the first half, the index lists the rest (weighed per tier)",
    ),
    "transfer": (
        "save / load MiB/s: bytes moved per second by s3kv (on its default client), by the fastest "
        "plain client library doing the same puts/gets with the same threads (boto3, obstore, awscrt), "
        "and by one object per block, synchronous (the upstream example's path)",
        "vs fastest = s3kv MiB/s / the fastest raw client's MiB/s (1.00: as fast as the fastest plain "
        "client; the target is >= 0.9)",
        "vs example = s3kv MiB/s / the one-object-per-block synchronous path's MiB/s (how many times faster)",
        "CPU s/GB: process CPU seconds per GB moved, per client (lower leaves more CPU to the engine)",
    ),
    "staging": (
        "GB/s: bytes copied per second between GPU pages and pinned host staging, scattered pages",
        "ratio = s3kv's copy GB/s / one contiguous memcpy of the same bytes (1.00: the hardware's own "
        "speed; the 'all' row shows the worst of the headline page sizes)",
        "GPU-time ratio: the same ratio timed on the GPU alone (without host launch overhead)",
        "per-page copies: the ratio when each page is its own copy call (the fallback without batching)",
        "host tier: a sync load through the worker from the host tier (header checked, pages copied from the "
        "pinned arena), with every page re-hashed (S3KV_HOST_CACHE_VERIFY), and from a store through staging, "
        "each / one contiguous pinned memcpy of the same bytes (target >= 0.9 for the tier)",
    ),
    "e2e": (
        "hit = prompt tokens served from S3 / prompt tokens; ms/req and TTFT: mean per request in the "
        "simulator (no GPU time for skipped prefill)",
        "window / all = bytes stored under the window policy / bytes stored when every block is kept",
        "pages stored per distinct block: 1.0 means no block was written twice",
        "prefill saved: FLOPs the warm cluster did not spend, priced on the named GPU at the stated MFU",
    ),
}
TARGETS_NOTE = "targets: MET / NOT MET against the goals s3kv is built to (a NOT MET is a finding, not an error)"


def explained(name: str, table: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    """``table`` followed by the legend of ``name``'s ratios and columns."""

    def render(res: dict[str, Any]) -> str:
        text = table(res)
        if res.get("skipped"):
            return text
        lines = ["", "what the numbers mean:"] + [f"  {line}" for line in (*LEGENDS[name], TARGETS_NOTE)]
        return text + "\n" + "\n".join(lines)

    return render


def _check_plot(plot_path: str | None, url: str | None = None) -> None:
    """What can be checked before a benchmark starts: --plot's dependency, --url's scheme."""
    if plot_path:
        from .plot import require_matplotlib

        require_matplotlib()
    if url:
        from ..options import url_option

        url_option(url)


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench_group() -> None:
    """Measure s3kv against the baselines it replaces (table, --json, --plot)."""


def _ints(text: str | None) -> tuple[int, ...] | None:
    return token_counts(text, "--prompts") if text else None


def _floats(text: str | None) -> tuple[float, ...] | None:
    return tuple(float(x) for x in text.split(",")) if text else None


def _given(**kw: Any) -> dict[str, Any]:
    """The options given on the command line (not None), as keyword arguments over the defaults."""
    return {k: v for k, v in kw.items() if v is not None}


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
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=None,
    help="Summary-path lookups per prompt and client, each on a fresh leader; medians are shown "
    "(default 5, --quick 1).",
)
@click.option(
    "--s3-latency-ms",
    type=click.FloatRange(min=0),
    default=None,
    help="Add this much to every request on the wire (s3kv's fault proxy in front of the S3 server) "
    "instead of --latency-ms's in-process model.",
)
@click.option(
    "--local",
    is_flag=True,
    help="Instead: what lookups answered without a request (key index, fleet index, host tier) cost the "
    "scheduler's thread, per prompt length (default 8k-128k; --quick: 8k,32k), in-process; no store.",
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
    repeats: int | None,
    s3_latency_ms: float | None,
    local: bool,
) -> None:
    """Lookup round trips and latency, 1k-128k-token prompts, vs a sequential per-block HEAD scan.

    The scan is what one object per block, read synchronously, needs: one HEAD per block per layer
    group, in order, until the first miss. ``--local``: the scheduler's time of lookups that send
    no request, per prompt length and source.
    """
    _check_plot(plot_path, url)
    from . import lookup, plot

    if local:
        from . import lookuplocal

        if plot_path:
            raise click.UsageError("--plot: --local draws no chart")
        chosen = _ints(prompts) or (lookuplocal.QUICK_LOCAL_PROMPTS if quick else lookuplocal.DEFAULT_LOCAL_PROMPTS)
        cfg = lookup.LookupConfig(blocks_per_object=blocks_per_object)
        res = lookuplocal.run_local(cfg, chosen, repeats if repeats is not None else (1 if quick else 5))
        finish(res, as_json=as_json, table=explained("lookup_local", lookuplocal.table))
        return
    chosen = _ints(prompts) or (lookup.QUICK_PROMPTS if quick else lookup.DEFAULT_PROMPTS)
    cap = seq_cap if seq_cap is not None else (64 if quick else 256)
    reps = repeats if repeats is not None else (1 if quick else 5)
    cfg = lookup.LookupConfig(prompts=chosen, blocks_per_object=blocks_per_object, seq_cap=cap, repeats=reps)
    if s3_latency_ms is not None:
        latency_ms = 0.0  # on the wire instead
    res = run_on_store("lookup", url, server, latency_ms, keep, lambda bs: lookup.run_lookup(bs, cfg), s3_latency_ms)
    finish(res, as_json=as_json, table=explained("lookup", lookup.table), plot_path=plot_path, plot=plot.plot_lookup)


# --------------------------------------------------------------------------- transfer


@bench_group.command("transfer")
@common_options(default_latency_ms=0.0)
@click.option(
    "--object-mib",
    default=None,
    help="Object sizes in MiB, e.g. 8,16,32 (the default: around the ~32 MiB objects s3kv makes; --quick: 4).",
)
@click.option(
    "--total-mib",
    type=int,
    default=None,
    help="Bytes moved per object size (default 256 on <= 4 cores, else 1024; --quick 16).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where the stand-in KV cache lives (auto: cuda when a GPU is visible, as in an engine).",
)
@click.option(
    "--page-mib",
    type=float,
    default=1.0,
    show_default=True,
    help="Page (block) size; the one-object-per-block path stores one page per object.",
)
@click.option(
    "--repeats",
    type=int,
    default=None,
    help="Best of this many runs per method (default 2: one with s3kv first, one with the raw clients "
    "first, so neither side always meets the fresher server -- with one, s3kv's 32 MiB saves on a fresh "
    "H200 host read 0.38x the raw client, with two 0.83x; --quick: 1).",
)
@click.option(
    "--upload-threads",
    type=click.IntRange(1, 256),
    default=None,
    help="s3kv's upload threads, and the raw clients' PUT threads (default: S3KV_UPLOAD_THREADS' default).",
)
@click.option(
    "--download-threads",
    type=click.IntRange(1, 256),
    default=None,
    help="s3kv's download threads, and the raw clients' GET threads (default: S3KV_DOWNLOAD_THREADS' default).",
)
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
    repeats: int | None,
    device: str,
    upload_threads: int | None,
    download_threads: int | None,
) -> None:
    """Save/load throughput of s3kv's pipelines vs plain parallel boto3 and one object per block, synchronous."""
    _check_plot(plot_path, url)
    from . import plot, transfer

    sizes = _floats(object_mib) or ((4.0,) if quick else transfer.DEFAULT_OBJECT_MIB)
    total = total_mib or (16 if quick else transfer.default_total_mib(os.cpu_count() or 1))
    visible = transfer.default_device()
    if device == "cuda" and visible != "cuda":
        raise click.BadParameter("no CUDA device is visible", param_hint="--device")
    dev = visible if device == "auto" else device
    cfg = transfer.TransferConfig(
        object_mib=sizes, total_mib=total, page_mib=page_mib,
        repeats=max(1, repeats if repeats is not None else (1 if quick else 2)), device=dev,
        **_given(upload_threads=upload_threads, download_threads=download_threads),
    )
    res = run_on_store("transfer", url, server, latency_ms, keep, lambda bs: transfer.run_transfer(bs, cfg))
    finish(
        res, as_json=as_json, table=explained("transfer", transfer.table), plot_path=plot_path, plot=plot.plot_transfer
    )


# --------------------------------------------------------------------------- jitter


@bench_group.command("jitter")
@common_options(default_latency_ms=0.0, plot=False)
@click.option("--phase-s", type=float, default=None, help="Seconds per phase (default 3, --quick 0.5).")
@click.option("--object-mib", type=float, default=8.0, show_default=True, help="Object size of the transfers.")
def jitter_command(
    as_json: bool,
    url: str | None,
    server: str,
    latency_ms: float,
    quick: bool,
    keep: bool,
    phase_s: float | None,
    object_mib: float,
) -> None:
    """A stand-in executor loop's p50/p99 idle vs during lookups and full-speed transfers, per client."""
    _check_plot(None, url)
    from . import jitter

    cfg = jitter.JitterConfig(
        phase_s=phase_s or (0.5 if quick else 3.0),
        object_mib=1.0 if quick else object_mib,
        objects=4 if quick else 16,
        prompt_tokens=2048 if quick else 16384,
    )
    res = run_on_store("jitter", url, server, latency_ms, keep, lambda bs: jitter.run_jitter(bs, cfg))
    finish(res, as_json=as_json, table=jitter.table)


def run_on_store(
    name: str, url: str | None, server: str, latency_ms: float, keep: bool, run: Callable[[Any], dict[str, Any]],
    s3_latency_ms: float | None = None,
) -> dict[str, Any]:
    """``run(bench store)`` on ``--url`` or an embedded server, announcing which (every store bench)."""
    from .common import bench_store

    with bench_store(url, server=server, latency_ms=latency_ms, name=name, keep=keep,
                     s3_latency_ms=s3_latency_ms) as bs:
        progress(f"{name}: store {bs.where}, {latency_ms:g} ms injected per request")
        return run(bs)


# --------------------------------------------------------------------------- staging


@bench_group.command("staging")
@json_option
@plot_option()
@quick_option
@click.option("--page-mib", default=None, help="Page sizes in MiB (default 0.25,1,4,16; --quick 1).")
@click.option("--pages", type=int, default=None, help="Pages per run (default 64, --quick 8).")
@click.option("--device", default="cuda", show_default=True)
def staging_command(
    as_json: bool, plot_path: str | None, quick: bool, page_mib: str | None, pages: int | None, device: str
) -> None:
    """Device<->pinned-host page copies through s3kv's copy path vs one contiguous memcpy (needs CUDA)."""
    _check_plot(plot_path)
    from . import plot, staging

    sizes = _floats(page_mib) or ((1.0,) if quick else staging.DEFAULT_PAGE_MIB)
    n = pages or (8 if quick else 64)
    res = (staging.run_staging(sizes, n, device, host_objects=2, host_pages=4, host_gib=0.25) if quick
           else staging.run_staging(sizes, n, device))
    if res.get("skipped"):
        progress(f"staging: skipped -- {res['reason']}")
    finish(
        res, as_json=as_json, table=explained("staging", staging.table), plot_path=plot_path, plot=plot.plot_staging
    )


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
    "--mfu", type=float, default=None, help="Prefill model-FLOPs utilisation assumed (default 0.65, measured on an H200: docs/sizing.md)."
)
@click.option(
    "--checkpoint-tokens",
    type=int,
    default=None,
    help="Sliding-group checkpoint spacing (default: the demo's 512; s3kv's own default is 8192).",
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
    _check_plot(plot_path, url)
    from . import e2e, plot

    cfg = (e2e.E2EConfig.quick() if quick else e2e.E2EConfig()).replace(
        **_given(rounds=rounds, gpu_tflops=gpu_tflops, mfu=mfu, checkpoint_tokens=checkpoint_tokens)
    )
    res = run_on_store("e2e", url, server, latency_ms, keep, lambda bs: e2e.run_e2e(bs, cfg))
    finish(res, as_json=as_json, table=explained("e2e", e2e.table), plot_path=plot_path, plot=plot.plot_e2e)


# --------------------------------------------------------------------------- integrity


@bench_group.command("integrity")
@json_option
@quick_option
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
    finish(res, as_json=as_json, table=integrity.table)


# --------------------------------------------------------------------------- trace


def _settings_overrides(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``--set name=value`` pairs, converted and checked as the settings loader does."""
    import dataclasses

    from ...config import ConfigError, Settings, load_settings

    names = {f.name for f in dataclasses.fields(Settings)}
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip().lower()
        if not sep or name not in names:
            raise click.BadParameter(f"{pair!r}: expected NAME=VALUE with NAME a setting", param_hint="--set")
        env[f"S3KV_{name.upper()}"] = text
    try:
        s = load_settings(env=env, require_url=False)
    except (ConfigError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--set") from None
    return {k[5:].lower(): getattr(s, k[5:].lower()) for k in env}


@bench_group.command("trace")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["mooncake"]), default="mooncake", show_default=True)
@click.option(
    "--model",
    default="gemma-3-27b",
    show_default=True,
    help="Geometry for page sizes, objects and prefill FLOPs: a preset (s3kv size's; one with sliding-window "
    "and full-attention layers).",
)
@click.option(
    "--model-config", type=click.Path(dir_okay=False), default=None,
    help="A Hugging Face config.json to take the geometry from (instead of --model).",
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
@click.option("--checkpoint-tokens", type=int, default=None, help="Sliding-group checkpoint spacing (default: S3KV_CHECKPOINT_TOKENS's default).")
@click.option("--put-per-1k", type=float, default=None, help="$ per 1,000 PUT-class requests (default 0.005).")
@click.option("--get-per-1k", type=float, default=None, help="$ per 1,000 GET/HEAD requests (default 0.0004).")
@click.option("--gb-month", type=float, default=None, help="$ per GB-month stored (default 0.023).")
@click.option(
    "--retention-h", type=float, default=None,
    help="Hours an object is kept after its last write or refresh (default 1; 24 x days for a lifecycle rule).",
)
@click.option("--gc-period-s", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="How often gc deletes what has expired (an expired object lives on half of it on average): "
              "its --watch period. Where the fleet index learns the retention (the default) its publisher "
              "deletes in each pass instead, every --index-every.")
@click.option("--gpu-usd-per-hour", type=float, default=None, help="$ per GPU-hour (default 3).")
@click.option(
    "--set", "overrides", multiple=True, metavar="NAME=VALUE",
    help="A connector setting for the replay (e.g. target_object_mib=64, range_split_mib=32): the levers.",
)
@click.option("--gpu-tflops", type=float, default=None, help="GPU peak BF16 TFLOP/s (default H100/H200, 989.4).")
@click.option("--mfu", type=float, default=None,
              help="Prefill model-FLOPs utilisation (default 0.65: measured on an H200, docs/sizing.md).")
@click.option("--audit", is_flag=True, help="Re-verify every page when the engine frees it (slower).")
@click.option(
    "--jobs", type=int, default=None, help="Replays run at once, one process each (default: min(2, cores))."
)
@click.option("--url", default=None, help="Store to replay on (default: in-process memory://, one per replay).")
@click.option(
    "--s3-latency-ms",
    type=click.FloatRange(min=0),
    default=None,
    help="Replay on S3 (the embedded server, or --url s3://) behind s3kv's fault proxy, this much added to "
    "every request, lookups under the engine's default time budget; prints the scheduler stall per lookup.",
)
@click.option(
    "--index-every", type=click.FloatRange(min=0), default=10.0, show_default=True,
    help="Publish the fleet index (s3kv gc --index) every this many seconds of the trace's clock; 0: no publisher.",
)
@click.option("--gc-learnt", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds gc had learnt the retention before the trace's first request (of other traffic: no "
              "reads kept). 0: a fleet that starts with the trace, gc keeping an octave of room beyond 99% of the "
              "reads; 3780 or more (the ceiling and gc's margin at the defaults): a fleet long running, gc cutting at the lag 99% "
              "come within, ghost reads telling of later ones (docs/operations.md).")
@click.option("--clusters", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engines (one per cluster) sharing the store, each with its own device prefix cache.")
@click.option("--router", type=click.Choice(["random", "affinity"]), default="random", show_default=True,
              help="How a request picks its engine: uniform, or longest device match balanced by load (Dynamo's "
              "KV router cost).")
@click.option("--device-cache-tokens", type=click.IntRange(min=0), default=None,
              help="Each engine's device prefix cache, in tokens of full-attention KV (default: what an H200 has "
              "left after the model's weights; 0: off, S3 the only source of reuse -- the regime before fleets).")
@click.option("--device-sliding", type=click.Choice(["all", "ends"]), default="all", show_default=True,
              help="Which sliding-window pages the device keeps: with their block (its best case), or only the "
              "windows at prompt and history ends (its worst).")
@click.option("--router-seed", type=int, default=0, show_default=True, help="Seed of the random router and of ties.")
@click.option("--host-cache-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each engine's host tier, in tokens of full-attention KV (0: none; needs the host tier, issue 39).")
@json_option
@plot_option("Write a PNG chart here (checked before the replay starts).")
def trace_command(
    trace_file: str,
    fmt: str,
    model: str,
    model_config: str | None,
    policy: str,
    branch_tails: str,
    limit: int | None,
    tokens_per_block: int,
    full_outputs: bool,
    checkpoint_tokens: int | None,
    put_per_1k: float | None,
    get_per_1k: float | None,
    gb_month: float | None,
    retention_h: float | None,
    gc_period_s: float,
    gpu_usd_per_hour: float | None,
    overrides: tuple[str, ...],
    gpu_tflops: float | None,
    mfu: float | None,
    audit: bool,
    jobs: int | None,
    url: str | None,
    s3_latency_ms: float | None,
    index_every: float,
    gc_learnt: float,
    clusters: int,
    router: str,
    device_cache_tokens: int | None,
    device_sliding: str,
    router_seed: int,
    host_cache_tokens: int,
    as_json: bool,
    plot_path: str | None,
) -> None:
    """Replay a request trace (Mooncake format) through simulated engines and the real adapter: what
    each tier serves (device prefix cache, host, S3) in a fleet of --clusters behind --router, tokens
    served from S3 per storage policy vs the ideal and the upstream example's rule, bytes stored, S3
    requests and dollars, the prefill saved past the device match, and the value ratio."""
    import os

    _check_plot(plot_path, url)
    from ...core.cost import Gpu, Prices
    from . import trace
    from .common import bench_store
    from .tracefile import TraceError

    if tokens_per_block <= 0 or tokens_per_block % 4:
        raise click.BadParameter("must be a positive multiple of 4", param_hint="--tokens-per-block")
    runs: list[str] = []
    if policy in ("window", "both"):
        runs += {"on": ["window"], "off": ["window-no-branch"], "compare": ["window", "window-no-branch"]}[branch_tails]
    if policy in ("all", "both"):
        runs.append("all")
    try:
        prices = Prices(**_given(put_per_1k=put_per_1k, get_per_1k=get_per_1k, gb_month=gb_month,
                                 retention_h=retention_h))
        gpu = Gpu(**_given(usd_per_hour=gpu_usd_per_hour, peak_tflops=gpu_tflops, mfu=mfu))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if prices.retention_h <= 0:
        raise click.BadParameter("must be > 0", param_hint="--retention-h")
    from ..models import ModelConfigError, resolve

    try:
        spec = resolve(model, model_config)
    except ModelConfigError as e:
        raise click.ClickException(str(e)) from None
    if not (spec.window and spec.global_layers and spec.local_layers):
        raise click.ClickException(
            f"bench trace replays a model with sliding-window and full-attention layers; {spec.name} "
            f"has {'no sliding-window' if not (spec.window and spec.local_layers) else 'no full-attention'} layers"
        )
    cfg = trace.TraceConfig(
        path=trace_file,
        fmt=fmt,
        model=spec,
        runs=tuple(runs),
        limit=limit,
        tokens_per_block=tokens_per_block,
        full_outputs=full_outputs,
        **_given(checkpoint_tokens=checkpoint_tokens),
        prices=prices,
        audit=audit,
        jobs=max(1, jobs if jobs is not None else min(2, os.cpu_count() or 1)),
        url=url,
        s3_latency_ms=s3_latency_ms,
        index_every_s=index_every,
        gc_learnt_s=gc_learnt,
    )
    from .fleet import FleetConfig

    fleet = FleetConfig(clusters, router, device_cache_tokens, device_sliding, router_seed, host_cache_tokens)
    # The replay's made-up model is named (as S3KV_MODEL_ID would), so no weak-identity warning.
    named = {"model_id": f"s3kv-trace/{spec.name}", **_settings_overrides(overrides)}
    cfg = cfg.replace(gpu=gpu, gc_period_s=gc_period_s, settings=named, fleet=fleet)
    with bench_store(url or (None if s3_latency_ms is not None else trace.DEFAULT_URL), name="trace",
                     s3_latency_ms=s3_latency_ms) as bs:
        try:
            res = trace.run_trace(bs, cfg)
        except TraceError as e:
            raise click.ClickException(str(e)) from None
    finish(res, as_json=as_json, table=trace.table, plot_path=plot_path, plot=trace.plot_trace)


@bench_group.command("gen-trace")
@click.option(
    "--workload",
    required=True,
    help="A preset of the family (s3kv.tools.bench.gentrace.PRESETS): chat, agentic, rag, returning, unique; "
    "fewshot-batch is HELD OUT (never tune on it).",
)
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=1200, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--load", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Sessions (or batch jobs) arrive this many times as often as the preset says: the same "
              "traffic, denser against each engine's device cache.")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, writable=True), required=True,
              help="Write the trace here (Mooncake format, one JSON object a line).")
@click.option("--json", "as_json", is_flag=True, help="Print its description as ONE JSON object.")
def gen_trace_command(workload: str, n_requests: int, seed: int, load: float, output: str, as_json: bool) -> None:
    """Write a request trace of a named workload in the Mooncake format, deterministic from --seed, and
    print what its reuse looks like (the figures `describe-trace` prints for any trace)."""
    import json

    from .gentrace import PRESETS, generate, write_trace
    from .tracestats import describe, describe_line

    w = PRESETS.get(workload)
    if w is None:
        raise click.BadParameter(f"unknown workload {workload!r}; known: {', '.join(PRESETS)}", param_hint="--workload")
    reqs = generate(w.at_load(load), n_requests, seed)
    write_trace(reqs, output)
    d = {"workload": w.name, "seed": seed, "load": load, "held_out": w.held_out, "path": output,
         **describe(reqs, 512)}
    if as_json:
        click.echo(json.dumps(d))
    else:
        click.echo(f"{output}: {w.name}{' (HELD OUT)' if w.held_out else ''}, seed {seed}: {describe_line(d)}")


@bench_group.command("describe-trace")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N requests.")
@click.option("--json", "as_json", is_flag=True, help="Print ONE JSON object.")
def describe_trace_command(trace_file: str, limit: int | None, as_json: bool) -> None:
    """What a trace's reuse looks like: distinct prefix blocks ever re-read, the gap between reuses
    (p50/p90/p99), reusable tokens -- the same figures for a real trace and a generated one."""
    import json

    from .tracefile import TraceError, read_trace
    from .tracestats import describe, describe_line

    try:
        reqs, bt = read_trace(trace_file, limit=limit)
    except TraceError as e:
        raise click.ClickException(str(e)) from None
    d = {"path": trace_file, **describe(reqs, bt)}
    click.echo(json.dumps(d) if as_json else f"{trace_file}: {describe_line(d)}")


@bench_group.command("corun")
@click.option("--streams", type=click.IntRange(min=1), default=16, show_default=True, help="Decode streams running.")
@click.option("--arrivals", type=click.IntRange(min=1), default=48, show_default=True,
              help="Requests arriving one after another beside them (each looked up).")
@click.option("--prompt-tokens", type=click.IntRange(min=64), default=2048, show_default=True)
@click.option("--decode-ms", type=click.FloatRange(min=0), default=25.0, show_default=True,
              help="Modelled GPU time of a decode pass.")
@click.option("--hit-share", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Share of arrivals whose prompt a warm engine stored beforehand.")
@click.option("--modes", default="without,probe,index,signed", show_default=True,
              help="without (no s3kv), probe (s3kv, no fleet index), index (fleet index published), "
              "signed (with an integrity key: the index signed).")
@click.option("--url", default=None, help="Store (default: the embedded S3 server).")
@click.option("--s3-latency-ms", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Added to every S3 request by s3kv's fault proxy.")
@json_option
@plot_option("Write a PNG chart here.")
def corun_command(streams: int, arrivals: int, prompt_tokens: int, decode_ms: float, hit_share: float, modes: str,
                  url: str | None, s3_latency_ms: float, as_json: bool, plot_path: str | None) -> None:
    """Decode streams on the simulated engine while requests arrive and are looked up at
    --s3-latency-ms per S3 request: the time between passes (each stream's inter-token latency),
    p50/p99, with s3kv (with and without the fleet index) against without it (issue 41)."""
    from . import corun
    from .common import bench_store

    wanted = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in wanted if m not in corun.MODES]
    if bad or not wanted:
        raise click.BadParameter(f"unknown mode(s) {bad}: use {', '.join(corun.MODES)}", param_hint="--modes")
    cfg = corun.CorunConfig(streams=streams, arrivals=arrivals, prompt_tokens=prompt_tokens, decode_ms=decode_ms,
                            hit_share=hit_share, modes=wanted)
    with bench_store(url, name="corun", s3_latency_ms=s3_latency_ms) as bs:
        res = corun.run_corun(bs, cfg)
    finish(res, as_json=as_json, table=corun.table, plot_path=plot_path, plot=corun.plot_corun)


def _register_faults() -> None:
    """``s3kv bench faults``: the fault matrix's own command (its options in the same style as every
    other benchmark's)."""
    from ..faultmatrix import faults_command

    bench_group.add_command(faults_command, "faults")


_register_faults()
