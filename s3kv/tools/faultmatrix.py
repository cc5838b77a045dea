"""Fault matrix: the real connector, a simulated TP=2 VSWA engine, a real loopback S3 server, and
wire-level faults in between.

    s3kv bench faults [--json] [--rates 0.05,0.3] [--server moto|seaweedfs] [--faults a,b]

For every fault type and rate, a fresh key prefix, and two clusters (separate engines sharing
only the bucket): cluster A runs the first turns of some multi-turn conversations (cold: saves),
cluster B repeats them and continues one turn further (warm: lookups and loads). Every request
goes through :class:`~s3kv.store.faultproxy.FaultProxy` in front of the server, so the S3 store
sees real 503s, resets, held answers and short bodies. Every page a cluster loads is checked
byte for byte against recomputation (``kv_mismatches``, the "wrong bytes" column).

No exception may leave a connector call: the simulator, like TensorRT-LLM's executor, dies on
one (``crashes``). A promised load that cannot be completed takes the failure rung the engine
allows (docs/failures.md): on the merged TensorRT-LLM line the request stays parked while the
load is retried (rung 3, ``parked``), on a line with a failed-load hook the engine recomputes it
(rung 1, ``recomputed``; ``--failed-load-hook``). A run that does not finish within its bound is a
``hang``.

Why this is one module: one experiment -- its workload, fault plans, clusters and table are parts of
one run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from ..config import Settings
from ..store.base import ObjectStore
from ..store.faultproxy import FaultProxy, WireFaultPlan

log = logging.getLogger("s3kv.faultmatrix")

# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Shape:
    """A small Gemma-3-like VSWA model (5 sliding : 1 full) at TP=2, and a multi-turn workload."""

    window: int = 64
    tokens_per_block: int = 16
    max_seq_len: int = 2048
    num_layers: int = 6
    kv_heads: int = 2
    head_dim: int = 16
    tp_size: int = 2
    chunk_size: int | None = 64
    max_batch: int = 4
    conversations: int = 3
    turns_a: int = 2
    turns_b: int = 3
    system_len: int = 128
    first_len: int = 80
    turn_len: int = 48
    answer_len: int = 8
    new_users: int = 2
    blocks_per_object: int = 4
    checkpoint_tokens: int = 128
    load_mode: str = "async"
    #: Model a TensorRT-LLM line with the failed-load hook (rung 1) instead of the merged line.
    failed_load_hook: bool = False
    seed: int = 11


SMALL = Shape(conversations=2, turns_a=1, turns_b=2, new_users=1, system_len=96, first_len=64, turn_len=32)


def workload(shape: Shape, role: str, first_id: int) -> list[list[Any]]:
    """Phases of requests (one per turn, users think between turns; new users last in B)."""
    from ..sim.workload import turn_phases

    return turn_phases(shape, role, first_id=first_id, seed=shape.seed,
                       new_users_seed=f"faultmatrix/new-users/{shape.seed}")


def fault_settings(url: str, **overrides: Any) -> Settings:
    """Connector settings for fault runs: short timeouts so a stall resolves in about a second."""
    values: dict[str, Any] = dict(
        url=url,
        staging_mib=64,
        pinned=False,
        upload_threads=2,
        download_threads=4,
        max_concurrency=16,
        connect_timeout_s=1.0,
        read_timeout_s=1.0,
        retry_deadline_s=4.0,
        max_attempts=6,
        load_timeout_s=20.0,
        # Fault runs measure what faults cost, not the scheduling-path budget (tens of ms by
        # default): a slow loopback server through the proxy must not turn hits into misses.
        lookup_timeout_s=5.0,
        check_access=False,
    )
    values.update(overrides)
    return Settings(**values)


def store_from_settings(
    settings: Settings, *, endpoint_url: str, access_key: str, secret_key: str, region: str = "us-east-1"
) -> tuple[ObjectStore, str]:
    """The S3 store ``open_runtime_store`` would build from ``settings``, at an explicit endpoint.

    Same options mapping as :func:`s3kv.engine.runtime.open_runtime_store` (timeouts, retry policy,
    multipart, SSE) so a fault run exercises the production store; only the endpoint and the
    keys are passed in rather than read from the process environment.
    """
    from ..engine.runtime import s3_options
    from ..store.factory import make_s3_store, parse_store_url

    scheme, bucket, prefix = parse_store_url(settings.url)
    if scheme != "s3":
        raise ValueError(f"fault runs need an s3:// URL, got {settings.url!r}")
    options = dataclasses.replace(s3_options(settings), region=region)
    # The client production uses (S3KV_S3_CLIENT: obstore by default, boto3 when asked).
    store = make_s3_store(
        bucket,
        endpoint_url=endpoint_url,
        options=options,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        url=settings.url,
    )
    return store, prefix


# --------------------------------------------------------------------------- one cluster


@dataclass
class ClusterResult:
    role: str
    requests: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    hit_requests: int = 0
    #: Requests whose promised load failed (each took one of the rungs below).
    failed_loads: int = 0
    #: Rung 1: rewound and recomputed by the engine's failed-load hook.
    recomputed: int = 0
    #: Rung 3: stayed parked while the load was retried (then served, or cancelled).
    parked: int = 0
    parked_recovered: int = 0
    cancelled: int = 0
    kv_mismatches: int = 0
    pages_checked: int = 0
    #: Engine crashes (an exception out of a connector call) and other escapes.
    escaped: list[str] = field(default_factory=list)
    hangs: int = 0
    saves_dropped: int = 0
    objects_saved: int = 0
    #: Seconds spent in get_num_new_matched_tokens (the lookup, on the scheduling path).
    lookup_s: float = 0.0
    wall_s: float = 0.0
    per_request: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def make_engine(
    shape: Any,
    settings: Settings | None,
    store: ObjectStore | None,
    key_prefix: str | None,
    engine_key: str,
    **engine_kwargs: Any,
) -> Any:
    """A simulated engine driving the real adapter classes against ``store``.

    ``store`` None: the connectors open it themselves from ``settings`` (None: from the
    environment), exactly as in production (start-up access check included). ``shape``: a
    :class:`Shape` (its max_batch and failed_load_hook are the defaults of ``engine_kwargs``), or
    another with its model and chunking fields (the demo's)."""
    from ..sim import SimCacheConfig, SimEngine, gemma3_like
    from ..trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    model = gemma3_like(
        shape.window,
        num_layers=shape.num_layers,
        kv_heads=shape.kv_heads * shape.tp_size,
        head_dim=shape.head_dim,
    )
    if isinstance(shape, Shape):
        engine_kwargs.setdefault("failed_load_hook", shape.failed_load_hook)
        engine_kwargs.setdefault("max_batch", shape.max_batch)
    return SimEngine(
        model,
        SimCacheConfig(tokens_per_block=shape.tokens_per_block, max_seq_len=shape.max_seq_len),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        tp_size=shape.tp_size,
        chunk_size=shape.chunk_size,
        connector_kwargs=dict(settings=settings, store=store, key_prefix=key_prefix, engine_key=engine_key),
        **engine_kwargs,
    )


def run_phases(
    engine: Any,
    phases: Iterable[Sequence[Any]],
    result: ClusterResult,
    *,
    flush_s: float = 60.0,
    idle_iterations: int = 60_000,
) -> ClusterResult:
    """Run each phase to completion (bounded), flushing uploads between phases; fill ``result``."""
    from ..sim import SimEngineCrash, SimHang

    t0 = time.perf_counter()
    # Worker counters are cumulative over the engine's life: count this call's share only.
    before = [w.core._counters.snapshot() for w in engine.workers]
    for phase in phases:
        phase = list(phase)
        chunk = engine.chunk_size or engine.config.max_seq_len
        work = sum(-(-len(s.prompt) // chunk) + s.max_new_tokens + 1 for s in phase)
        try:
            rep = engine.run(phase, max_iterations=2 * work + idle_iterations)
        except SimHang as exc:
            result.hangs += 1
            result.escaped.append(f"SimHang: {exc}")
            break
        except SimEngineCrash as exc:
            result.escaped.append(f"engine crash: {exc}")
            log.error("engine crash: %s", exc)
            break
        except Exception as exc:  # noqa: BLE001 - any other escape is what the matrix counts
            result.escaped.append(f"{type(exc).__name__}: {exc}")
            log.exception("exception escaped a connector call")
            break
        result.kv_mismatches += rep.kv_mismatches
        result.lookup_s += rep.hook_seconds.get("get_num_new_matched_tokens", 0.0)
        result.pages_checked += rep.pages_checked
        for r in rep.requests:
            result.requests += 1
            result.prompt_tokens += r.prompt_tokens
            result.matched_tokens += r.matched_tokens
            result.hit_requests += r.matched_tokens > 0
            result.recomputed += r.recomputed_failed_load
            result.cancelled += r.cancelled
            result.per_request.append(
                {
                    "id": r.request_id,
                    "prompt": r.prompt_tokens,
                    "matched": r.matched_tokens,
                    "recomputed": r.recomputed_failed_load,
                    "cancelled": r.cancelled,
                }
            )
        for w in engine.workers:
            w.flush(flush_s)
    counters = [w.core._counters.snapshot() for w in engine.workers]

    def delta(name: str) -> int:
        # Per request, not per rank: under TP every rank parks (and recovers) the same request.
        return max((int(c.get(name, 0)) - int(b.get(name, 0)) for c, b in zip(counters, before, strict=True)),
                   default=0)

    result.parked = delta("rung_parked_retry")
    result.parked_recovered = delta("parked_loads_recovered")
    result.failed_loads = result.recomputed + result.parked
    stats = [w.core.stats() for w in engine.workers]
    result.saves_dropped = sum(s.saves_dropped for s in stats)
    result.objects_saved = sum(s.objects_uploaded for s in stats)
    result.wall_s = time.perf_counter() - t0
    return result


def run_cluster(
    role: str,
    shape: Shape,
    settings: Settings,
    store: ObjectStore,
    key_prefix: str,
    *,
    first_id: int = 0,
    engine_key: str | None = None,
) -> ClusterResult:
    engine_key = engine_key or f"faultmatrix-{role}-{uuid.uuid4().hex[:8]}"
    result = ClusterResult(role)
    engine = make_engine(shape, settings, store, key_prefix, engine_key)
    try:
        with engine:
            run_phases(engine, workload(shape, role, first_id), result)
    except Exception as exc:  # noqa: BLE001 - shutdown must not raise either
        result.escaped.append(f"{type(exc).__name__} at shutdown: {exc}")
    return result


# --------------------------------------------------------------------------- the matrix


#: name -> (description, plan for a rate). "latency" holds the answer ``LATENCY_S`` (shorter than
#: the read timeout: slow but successful); "read timeout" holds it longer than the read timeout.
LATENCY_S = 0.3
STALL_S = 2.5


def _plan(name: str, rate: float) -> WireFaultPlan:
    if name == "none":
        return WireFaultPlan()
    if name == "latency":
        return WireFaultPlan(stall=rate, stall_s=LATENCY_S)
    if name == "stall":
        return WireFaultPlan(stall=rate, stall_s=STALL_S)
    field_name = {
        "503": "slowdown_503",
        "500": "error_500",
        "reset": "reset",
        "truncate": "truncate",
        "truncate_head": "truncate_head",
    }[name]
    values: dict[str, Any] = {field_name: rate}
    return WireFaultPlan(**values)


FAULT_LABELS = {
    "none": "none (baseline)",
    "503": "503 SlowDown",
    "500": "500 InternalError",
    "reset": "connection reset (before / after / mid answer)",
    "stall": f"read timeout (answer held {STALL_S:g} s > 1 s read timeout)",
    "truncate": "truncated body (full Content-Length, short body)",
    "latency": f"latency (answer held {LATENCY_S:g} s)",
    "truncate_head": "truncated response head",
}
#: The issue's list; acceptance is judged on these.
REQUIRED_FAULTS = ("503", "500", "reset", "stall", "truncate", "latency")
DEFAULT_FAULTS = REQUIRED_FAULTS


@dataclass
class Cell:
    fault: str
    rate: float
    requests: int
    hit_tokens: int
    hit_requests: int
    hit_rate: float
    #: Requests whose promised load failed, and the rung each took (docs/failures.md).
    failed_loads: int
    recomputed: int
    parked: int
    kv_mismatches: int
    escaped: list[str]
    hangs: int
    saves_dropped: int
    wire_requests: int
    wire_faults: int
    time_s: float
    lookup_s: float = 0.0
    vs_baseline: float | None = None

    @property
    def ok(self) -> bool:
        return self.kv_mismatches == 0 and not self.escaped and self.hangs == 0


def run_cell(
    server: Any,
    fault: str,
    rate: float,
    shape: Shape = Shape(),
    *,
    seed: int = 1,
    **overrides: Any,
) -> Cell:
    """One cell: a fresh prefix, a proxy with ``fault`` at ``rate`` in front of ``server``, cluster
    A (cold) then cluster B (warm), both through the proxy. ``overrides``: settings over
    those of :func:`fault_settings`."""
    prefix = f"fm/{fault}-{int(rate * 1000)}-{uuid.uuid4().hex[:8]}"
    settings = fault_settings(
        f"s3://{server.bucket}/{prefix}",
        blocks_per_object=shape.blocks_per_object,
        checkpoint_tokens=shape.checkpoint_tokens,
        load_mode=shape.load_mode,
        **overrides,
    )
    t0 = time.perf_counter()
    with FaultProxy.for_url(server.endpoint_url, _plan(fault, rate), seed=seed) as px:
        results = []
        for role, first_id in (("A", 0), ("B", 100_000)):
            # One store client per cluster, as two clusters would have. The engine's runtime
            # wraps it (circuit breaker, metrics) but leaves closing it to us.
            store, key_prefix = store_from_settings(
                settings,
                endpoint_url=px.endpoint_url,
                access_key=server.access_key,
                secret_key=server.secret_key,
                region=server.region,
            )
            try:
                results.append(run_cluster(role, shape, settings, store, key_prefix, first_id=first_id))
            finally:
                store.close()
        a, b = results
        stats = px.stats()
    wall = time.perf_counter() - t0
    return Cell(
        fault=fault,
        rate=rate,
        requests=a.requests + b.requests,
        hit_tokens=b.matched_tokens,
        hit_requests=b.hit_requests,
        hit_rate=round(b.hit_rate, 4),
        failed_loads=a.failed_loads + b.failed_loads,
        recomputed=a.recomputed + b.recomputed,
        parked=a.parked + b.parked,
        kv_mismatches=a.kv_mismatches + b.kv_mismatches,
        escaped=a.escaped + b.escaped,
        hangs=a.hangs + b.hangs,
        saves_dropped=a.saves_dropped + b.saves_dropped,
        wire_requests=int(stats["requests"]),  # type: ignore[arg-type]
        wire_faults=int(stats["faults_total"]),  # type: ignore[arg-type]
        time_s=round(wall, 2),
        lookup_s=round(a.lookup_s + b.lookup_s, 2),
    )


def run_matrix(
    server: Any,
    faults: Sequence[str] = DEFAULT_FAULTS,
    rates: Sequence[float] = (0.05, 0.3),
    shape: Shape = Shape(),
    *,
    seed: int = 1,
    progress: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    baseline = run_cell(server, "none", 0.0, shape, seed=seed)
    cells = [baseline]
    if progress:
        progress(baseline)
    for fault in faults:
        for rate in rates:
            cell = run_cell(server, fault, rate, shape, seed=seed)
            cells.append(cell)
            if progress:
                progress(cell)
    for c in cells:
        if baseline.hit_rate:
            c.vs_baseline = round(c.hit_rate / baseline.hit_rate, 4)
    return cells


def markdown_table(cells: Sequence[Cell]) -> str:
    head = (
        "| fault | rate | requests | hits (tokens served / hit requests) | hit rate (vs fault-free) "
        "| failed loads: recomputed (rung 1) / parked + retried (rung 3) | wrong bytes (kv mismatches) "
        "| engine crashes / hangs | wire requests (faults injected) | time (of which lookups) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for c in cells:
        vs = f" ({c.vs_baseline:.0%})" if c.vs_baseline is not None else ""
        rows.append(
            f"| {FAULT_LABELS.get(c.fault, c.fault)} | {c.rate:.0%} | {c.requests} | "
            f"{c.hit_tokens} / {c.hit_requests} | {c.hit_rate:.1%}{vs} | {c.recomputed} / {c.parked} | "
            f"{c.kv_mismatches} | {len(c.escaped)} / {c.hangs} | {c.wire_requests} ({c.wire_faults}) | "
            f"{c.time_s:.1f} s ({c.lookup_s:.1f} s) |"
        )
    return "\n".join(rows)


def acceptance(cells: Sequence[Cell], *, low_rate: float = 0.05, tolerance: float = 0.10) -> list[str]:
    """What the issue's acceptance rules find wrong with ``cells`` (empty: all pass)."""
    problems = []
    for c in cells:
        if c.fault not in REQUIRED_FAULTS and c.fault != "none":
            continue
        if c.kv_mismatches:
            problems.append(f"{c.fault}@{c.rate:.0%}: {c.kv_mismatches} wrong pages loaded")
        if c.escaped:
            problems.append(f"{c.fault}@{c.rate:.0%}: engine crashes: {c.escaped[:2]}")
        if c.hangs:
            problems.append(f"{c.fault}@{c.rate:.0%}: {c.hangs} runs did not finish")
        if abs(c.rate - low_rate) < 1e-9 and c.vs_baseline is not None and c.vs_baseline < 1 - tolerance:
            problems.append(
                f"{c.fault}@{c.rate:.0%}: hit rate {c.hit_rate:.1%} is {c.vs_baseline:.0%} of fault-free"
            )
    return problems


@click.command("faults", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print ONE JSON object on stdout instead of the table.")
@click.option("--rates", default="0.05,0.3", show_default=True, help="Fault rates, comma-separated.")
@click.option("--server", type=click.Choice(["moto", "seaweedfs"]), default="moto", show_default=True,
              help="The embedded S3 server the faults are injected in front of.")
@click.option("--faults", "fault_list", default=",".join(DEFAULT_FAULTS), show_default=True,
              help=f"Faults, comma-separated, from {','.join(k for k in FAULT_LABELS if k != 'none')}.")
@click.option("--small", is_flag=True, help="The reduced workload the tests use.")
@click.option("--failed-load-hook", is_flag=True,
              help="Model a TensorRT-LLM line with the connector manager's failed-load path (rung 1: the "
              "request is aborted on every rank and recomputed) instead of the merged line (rung 3).")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the fault schedule.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
              default="CRITICAL", show_default=True, help="s3kv log lines on stderr at this level and above.")
@click.pass_context
def faults_command(ctx: click.Context, as_json: bool, rates: str, server: str, fault_list: str, small: bool,
                   failed_load_hook: bool, seed: int, log_level: str) -> None:
    """The fault matrix of docs/reliability.md: S3 faults at 5% and 30% under TensorRT-LLM's call
    order, on a simulated TP=2 VSWA engine and a real loopback S3 server (about 2.5 min)."""
    try:
        rate_list = [float(x) for x in rates.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{rates!r}: expected numbers, comma-separated (e.g. 0.05,0.3)",
                                 param_hint="--rates") from None
    faults = [f.strip() for f in fault_list.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULT_LABELS]
    if unknown:
        raise click.BadParameter(f"unknown: {', '.join(unknown)}; known: {', '.join(sorted(FAULT_LABELS))}",
                                 param_hint="--faults")
    ctx.exit(_run(as_json, rate_list, server, faults, small, failed_load_hook, seed, log_level))


def _run(as_json: bool, rates: list[float], server_kind: str, faults: list[str], small: bool,
         failed_load_hook: bool, seed: int, log_level: str) -> int:
    from ..store.embedded import EmbeddedS3
    from .logs import configure_logging

    configure_logging(log_level.upper())
    shape = SMALL if small else Shape()
    if failed_load_hook:
        shape = dataclasses.replace(shape, failed_load_hook=True)

    def progress(c: Cell) -> None:
        print(
            f"  {c.fault}@{c.rate:.0%}: {c.time_s:.1f}s, hit rate {c.hit_rate:.1%}, "
            f"{c.failed_loads} failed loads ({c.recomputed} recomputed, {c.parked} parked), "
            f"{c.kv_mismatches} wrong",
            file=sys.stderr,
            flush=True,
        )

    t0 = time.perf_counter()
    with EmbeddedS3(server_kind, bucket=f"s3kv-fm-{uuid.uuid4().hex[:8]}") as server:  # type: ignore[arg-type]
        cells = run_matrix(server, faults, rates, shape, seed=seed, progress=progress)
    total = time.perf_counter() - t0
    problems = acceptance(cells)
    extra = [c for c in cells if c.fault not in REQUIRED_FAULTS and c.fault != "none"]
    notes = [
        f"{c.fault}@{c.rate:.0%} (beyond the issue's list): {c.failed_loads} failed loads, "
        f"hit rate {c.hit_rate:.1%}, {c.kv_mismatches} wrong pages, {len(c.escaped)} crashes"
        for c in extra
    ]
    if as_json:
        print(
            json.dumps(
                {
                    "server": server_kind,
                    "shape": dataclasses.asdict(shape),
                    "total_s": round(total, 1),
                    "cells": [dataclasses.asdict(c) for c in cells],
                    "problems": problems,
                    "notes": notes,
                },
                indent=2,
            )
        )
    else:
        print(markdown_table(cells))
        print(
            f"\nserver: {server_kind}; TP={shape.tp_size}; engine: "
            f"{'failed-load hook (rung 1)' if shape.failed_load_hook else 'merged line (rung 3)'}; total {total:.0f} s; "
            f"acceptance: {'PASS' if not problems else 'FAIL'}"
        )
        for p in problems:
            print(f"- {p}")
        for n in notes:
            print(f"- note: {n}")
    return 0 if not problems else 1
