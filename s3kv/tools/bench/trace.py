"""``s3kv bench trace FILE``: replay a request trace through simulated engines and the real adapter, and price it.

Every request of the trace, in arrival order, goes through ``SimEngine`` driving the real
``S3KvConnectorLeader`` / ``S3KvConnectorWorker`` (``replay``), once per storage policy, from an
empty bucket each time. Its prompt is synthesised from the trace's hash ids
(``tracefile``: equal ids give equal tokens; a request that continues an earlier one re-sends
that request's prompt tail and the answer the engine really generated). The simulator's checker
compares every page the connector served with what recomputation writes (``kv_mismatches``).

**The fleet** (``fleet``): ``--clusters N`` engines behind ``--router random|affinity``, each with
a device prefix cache (``--device-cache-tokens``, default what an H200 holds after the weights);
a request's device match is served by its engine, and s3kv is credited only with tokens past it.
Printed per run: what each tier served (device / host / S3 / computed, shares of prompt tokens).
``--clusters 1 --device-cache-tokens 0`` is the regime this bench always ran: S3 the only source
of reuse, the regime the "ideal" (``oracle``) describes exactly.

**The value** (``value`` object, each policy row too): S3 dollars (``billing``: requests and bytes
at the real sizes, storage as byte-hours under ``--retention-h`` on the trace's clock) against the
prefill GPU dollars the served tokens saved *on top of the device match* -- ``prefill_flops(d +
s) - prefill_flops(d)`` for ``s`` tokens served past a device match of ``d`` (``core.cost.Gpu``:
the package's one prefill speed) -- minus the GPU time the lookups' scheduler stall cost beyond
what the overlap loop hides (``replay.stall_summary``: one decode forward, ``fleet.decode_forward_s``;
the whole batch waits, so it is GPU time lost). ``ratio`` = S3 $ / that net; ``ratio_gross``
leaves the stall out.

Output: ``tracereport`` (the table and the plot).

Why this is one module: the bench as a whole -- running the policies (in processes of their own),
checking they saw the same stream and fleet, and turning their counts into the one result and its
value line.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ...core.cost import Usage, cost, value
from .common import BenchStore, machine_info, progress, rnd
from .oracle import Oracle
from .replay import (  # noqa: F401 - the bench's names, where callers have always found them
    MODELS,
    RUNS,
    SIM_HEAD_DIM,
    SIM_VOCAB,
    TraceConfig,
    answer_tokens,
    real_page_bytes,
    replay,
    stall_summary,
)
from .tracefile import TraceRequest, duration_hours, find_continuations, read_trace, trace_reuse_tokens
from .tracereport import plot_trace, table  # noqa: F401

_Oracle = Oracle


def _unreplayed_blocks(cfg: TraceConfig, reqs: Sequence[TraceRequest], continued: set[int]) -> int:
    """Answer blocks the replay did not generate (their KV would have been stored)."""
    tpb = cfg.tokens_per_block
    n = 0
    for r in reqs:
        g = answer_tokens(cfg, r, r.index in continued)
        n += (r.input_length + r.output_length - 1) // tpb - (r.input_length + g - 1) // tpb
    return n


DEFAULT_URL = "memory://s3kv-bench-trace"


def _replay_job(
    cfg: TraceConfig, reqs: Sequence[TraceRequest], bt: int, conts: Mapping[int, int], run: str, oracle: _Oracle | None
) -> tuple[dict[str, Any], _Oracle | None]:
    """One replay in a process of its own, on a store of its own."""
    import torch

    from .common import bench_store

    torch.set_num_threads(1)  # tiny tensors; the other replay process needs the other core
    url = cfg.url or (None if cfg.s3_latency_ms is not None else DEFAULT_URL)
    with bench_store(url, name=f"trace-{run}", s3_latency_ms=cfg.s3_latency_ms) as bs:
        return replay(cfg, bs, reqs, bt, conts, run, oracle), oracle


def _replay_all(
    cfg: TraceConfig, bs: BenchStore, reqs: Sequence[TraceRequest], bt: int, conts: Mapping[int, int], oracle: _Oracle
) -> tuple[dict[str, dict[str, Any]], _Oracle]:
    """Every run of ``cfg.runs``; the first also feeds the oracle (the token streams are the same)."""
    if cfg.jobs <= 1 or len(cfg.runs) == 1:
        runs = {name: replay(cfg, bs, reqs, bt, conts, name, oracle if i == 0 else None) for i, name in enumerate(cfg.runs)}
        return runs, oracle
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: this process has torch (OpenMP) and thread pools.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(cfg.jobs, len(cfg.runs)), mp_context=ctx) as pool:
        # Store-everything writes the most objects and takes longest: start it first.
        order = sorted(cfg.runs, key=lambda n: RUNS[n][0] != "all")
        futs = {
            name: pool.submit(_replay_job, cfg, reqs, bt, conts, name, oracle if name == cfg.runs[0] else None)
            for name in order
        }
        results = {name: futs[name].result() for name in cfg.runs}
    fed = results[cfg.runs[0]][1]
    assert fed is not None
    return {name: r for name, (r, _) in results.items()}, fed


def run_trace(bs: BenchStore, cfg: TraceConfig) -> dict[str, Any]:
    t_start = time.perf_counter()
    reqs, bt = read_trace(cfg.path, cfg.fmt, cfg.limit)
    conts = find_continuations(reqs, bt)
    continued = set(conts.values())
    tpb = cfg.tokens_per_block
    m = cfg.model
    pages = real_page_bytes(m, tpb)
    hours = duration_hours(reqs)
    prompt_tokens = sum(r.input_length for r in reqs)
    progress(
        f"trace: {len(reqs)} requests, {prompt_tokens / 1e6:.1f}M prompt tokens, {len(conts)} continuations, "
        f"{hours * 60:.1f} min of traffic; runs {', '.join(cfg.runs)}"
    )
    runs, oracle = _replay_all(cfg, bs, reqs, bt, conts, _Oracle(tpb, m.window, pages))
    fps = {r["tokens_fingerprint"] for r in runs.values()}
    if len(fps) != 1:
        raise RuntimeError("the replays saw different token streams: the replay is not deterministic")
    if len({r["fleet_fingerprint"] for r in runs.values()}) != 1:
        raise RuntimeError("the replays routed differently: the fleet model is not deterministic")
    first_run = runs[cfg.runs[0]]
    device = first_run["device_per_request"]  # the same in every run (routing never depends on S3)
    device_tokens = sum(device)
    ideal = sum(oracle.ideal)
    # What S3 could serve past the device match: every block an earlier request computed, less the device's.
    ideal_marginal = sum(max(0, i - d) for i, d in zip(oracle.ideal, device, strict=True))
    unreplayed = _unreplayed_blocks(cfg, reqs, continued)

    def prefill(per_request: Sequence[int], s3_per_request: Sequence[int] | None = None) -> dict[str, float]:
        """The prefill the served tokens saved on top of each request's device match (module doc), and
        S3's part of it: a request's saving shared between the host tier and S3 by the tokens each
        served (``s3_per_request``; None: S3 served all of it)."""
        flops = s3_flops = 0.0
        s3s = per_request if s3_per_request is None else s3_per_request
        for t, d, x in zip(per_request, device, s3s, strict=True):
            f = m.prefill_flops(d + t) - m.prefill_flops(d)
            flops += f
            s3_flops += f * x / t if t else 0.0
        return {
            "prefill_pflops_saved": rnd(flops / 1e15, 3),
            "gpu_seconds_saved": rnd(cfg.gpu.seconds(flops), 1),
            "gpu_usd_saved": rnd(cfg.gpu.usd(flops), 6),
            "gpu_usd_saved_s3": rnd(cfg.gpu.usd(s3_flops), 6),
        }

    def tiers(r: Mapping[str, Any]) -> dict[str, Any]:
        """Prompt tokens by the tier that served them (the host tier: what s3kv served that S3 did not)."""
        s3 = sum(r["s3_per_request"])
        host = r["served_tokens"] - s3
        computed = prompt_tokens - device_tokens - r["served_tokens"]
        toks = {"device": device_tokens, "host": host, "s3": s3, "computed": computed}
        return {
            "tokens": toks,
            "shares": {k: rnd(v / prompt_tokens, 4) for k, v in toks.items()},
        }

    def money(
        put: int, get: int, head: int, stored: int, served: int, storage_usd: float | None = None
    ) -> dict[str, Any]:
        """Requests at list prices; storage as replayed (``storage_usd``: byte-seconds under
        retention) or, for the counted upstream rule, every byte kept for the retention."""
        usage = Usage(put, get, head, stored, served)
        c = cost(usage, cfg.prices)
        if storage_usd is not None:
            c = dataclasses.replace(c, storage_usd=storage_usd)
        per_h = (lambda x: rnd(x / hours, 4)) if hours > 0 else (lambda x: None)
        return {
            "requests_usd": rnd(c.requests_usd, 6),
            "storage_usd": rnd(c.storage_usd, 6),
            "s3_usd": rnd(c.total_usd, 6),
            "usd_per_trace_hour": per_h(c.total_usd),
            "requests_usd_per_trace_hour": per_h(c.requests_usd),
            "storage_usd_per_trace_hour": per_h(c.storage_usd),
            "usd_per_1m_tokens_served": None if served <= 0 else rnd(c.total_usd * 1e6 / served, 4),
        }

    def priced(row: dict[str, Any]) -> dict[str, Any]:
        """ratio: S3 $ / (marginal GPU $ S3 saved - the stall's GPU $); ratio_gross without the stall;
        ratio_s3kv: S3 $ / (what every s3kv tier saved - the stall): with a host tier in front, what
        it served (free of S3 requests) is credited too. Without one the three share a numerator."""
        lost = (row.get("lookup_stall") or {}).get("lost_s", 0.0)
        row["stall_gpu_usd"] = rnd(lost * cfg.gpu.usd_per_hour / 3600, 6)
        row["gpu_usd_net"] = rnd(row["gpu_usd_saved_s3"] - row["stall_gpu_usd"], 6)
        v, g = value(row["s3_usd"], row["gpu_usd_net"]), value(row["s3_usd"], row["gpu_usd_saved_s3"])
        a = value(row["s3_usd"], row["gpu_usd_saved"] - row["stall_gpu_usd"])
        row["ratio"] = None if v["ratio"] is None else rnd(v["ratio"], 4)
        row["ratio_gross"] = None if g["ratio"] is None else rnd(g["ratio"], 4)
        row["ratio_s3kv"] = None if a["ratio"] is None else rnd(a["ratio"], 4)
        if "unread_write_usd" in row:
            # The clairvoyant floor: this run's hits, had only the objects they read been written.
            floor = max(0.0, row["s3_usd"] - row.pop("unread_write_usd"))
            h = value(floor, row["gpu_usd_net"])
            row["hindsight"] = {"s3_usd": rnd(floor, 6), "ratio": None if h["ratio"] is None else rnd(h["ratio"], 4)}
        return row

    page_of = {"full": pages[0], f"sliding{m.window}": pages[1]}
    rows: dict[str, dict[str, Any]] = {}
    for name, r in runs.items():
        stored_real = sum(g["bytes"] for g in r["stored_by_group"].values())
        # Answer blocks not replayed: their full-attention pages (every group's under "all").
        extra = unreplayed * (pages[0] + (pages[1] if r["storage_policy"] == "all" else 0))
        rq = r["requests_real"]
        rows[name] = {
            "served_tokens": r["served_tokens"],
            "served_pct_of_prompt": rnd(100 * r["served_tokens"] / prompt_tokens, 2),
            "served_pct_of_ideal": rnd(100 * r["served_tokens"] / ideal_marginal, 2) if ideal_marginal else None,
            "tiers": tiers(r),
            "stored_bytes": stored_real,
            "stored_bytes_incl_unreplayed_answers": stored_real + extra,
            # Each page once: objects repeat some (a prompt-end snapshot and then the whole chunk;
            # a history-end tail over the prompt-end one), which S3 bills but a hit never needs.
            "distinct_page_bytes": sum(
                v["distinct_pages"] * page_of[g] for g, v in r["stored_by_group"].items()
            ),
            "stored_bytes_by_group": {g: v["bytes"] for g, v in r["stored_by_group"].items()},
            "pages_by_group": {g: v["pages"] for g, v in r["stored_by_group"].items()},
            "distinct_pages_by_group": {g: v["distinct_pages"] for g, v in r["stored_by_group"].items()},
            "objects_by_group": {g: v["objects"] for g, v in r["stored_by_group"].items()},
            "per_1k_prompt_tokens": {k: rnd(1000 * v / prompt_tokens, 4) for k, v in rq.items()},
            "per_1k_served_tokens": {k: rnd(1000 * v / r["served_tokens"], 4) for k, v in rq.items()}
            if r["served_tokens"]
            else None,
            # HEAD waves that went to the store, per lookup: each is a round trip on the scheduler's path.
            "round_trips_per_lookup": rnd(r["lookup_waves"] / r["lookups"], 3) if r["lookups"] else 0.0,
            # The unreplayed answers' pages live as long as their request's other objects.
            **money(
                rq["put"], rq["get"], rq["head"], stored_real + extra, r["served_tokens"],
                r["storage_usd"] * (stored_real + extra) / stored_real if stored_real else 0.0,
            ),
            **prefill(r["served_per_request"], r["s3_per_request"]),
            "host_tier": r["host_tier"],
            "unread_write_usd": r["unread_write_usd"],
            "value_model": r["value_model"],
            "retention_learnt": r["retention_learnt"],
            "refreshes": r["refreshes"],
            "expired_objects": r["expired_objects"],
            "get_requests_by_split_mib": r["get_requests_by_split_mib"],
            # What the store itself counted (calls, not billed requests): the accounting's cross-check.
            "store_calls": r["requests_sim"],
            "requests": dict(rq),
            "by_kind": r["by_kind"],
            "kv_mismatches": r["kv_mismatches"],
            "branch_tails_stored": r["branch_tails_stored"],
            "offer_guard": {k: r[k] for k in ("offers_exposed", "offers_cut", "tokens_cut")},
            "lookup_stall": r["lookup_stall"],
            "wall_s": r["wall_s"],
        }
    up_stored = sum(oracle.up_bytes)
    upstream = [max(0, u - d) for u, d in zip(oracle.upstream, device, strict=True)]  # past the device match
    rows["upstream-example"] = {
        "served_tokens": sum(upstream),
        "served_pct_of_prompt": rnd(100 * sum(upstream) / prompt_tokens, 2),
        "served_pct_of_ideal": rnd(100 * sum(upstream) / ideal_marginal, 2) if ideal_marginal else None,
        "stored_bytes": up_stored,
        "stored_bytes_by_group": {"full": oracle.up_bytes[0], f"sliding{m.window}": oracle.up_bytes[1]},
        "objects_by_group": {"full": oracle.up_objects // 2, f"sliding{m.window}": oracle.up_objects // 2},
        "per_1k_prompt_tokens": {
            "head": rnd(1000 * oracle.up["head"] / prompt_tokens, 4),
            "put": rnd(1000 * oracle.up["real_put"] / prompt_tokens, 4),
            "get": rnd(1000 * oracle.up["real_get"] / prompt_tokens, 4),
        },
        **money(oracle.up["real_put"], oracle.up["real_get"], oracle.up["head"], up_stored, sum(upstream),
                cost(Usage(bytes_stored=up_stored), cfg.prices).storage_usd),
        **prefill(upstream),
        "modelled": "counted from its rule, not replayed",
    }
    for row in rows.values():
        priced(row)
    from ...config import Settings
    from .common import GPU_NAME, GPU_PEAK_TFLOPS

    first = rows[cfg.runs[0]]
    res_value = {
        "policy": cfg.runs[0],
        "s3_usd": first["s3_usd"],
        "requests_usd": first["requests_usd"],
        "storage_usd": first["storage_usd"],
        "gpu_usd_saved": first["gpu_usd_saved"],
        "gpu_usd_saved_s3": first["gpu_usd_saved_s3"],
        "stall_gpu_usd": first["stall_gpu_usd"],
        "gpu_usd_net": first["gpu_usd_net"],
        "ratio": first["ratio"],
        "ratio_gross": first["ratio_gross"],
        "ratio_s3kv": first["ratio_s3kv"],
        # The same hits, had only the objects they read been written: no write policy does better.
        "hindsight": first.get("hindsight"),
        # The retention gc learnt from the engines' read reports and deleted by (s3kv.core.retention).
        "retention_learnt": first.get("retention_learnt"),
        "tiers": first["tiers"]["shares"],
        "fleet": {k: first_run["fleet"][k] for k in ("clusters", "router", "device_cache_tokens", "device_sliding",
                                                      "host_cache_tokens")},
        "stall": {k: first["lookup_stall"][k] for k in ("hidden_ms", "lost_s", "itl_added_p50_ms", "itl_added_p99_ms")},
        "prices": dataclasses.asdict(cfg.prices),
        "retention_h": cfg.prices.retention_h,
        # How often gc deleted: its --watch period, or the index's where its publisher learns.
        "gc_period_s": first.get("gc_period_s", cfg.gc_period_s),
        "gpu": dataclasses.asdict(cfg.gpu),
        "settings": {
            k: getattr(Settings(**cfg.settings), k)
            for k in ("multipart_threshold_mib", "multipart_part_mib", "range_split_mib", "target_object_mib")
        },
        "note": "ratio = S3 $ (requests + storage from write until gc deletes: the retention plus what engines "
        "may still believe, after the last write or refresh) / (prefill GPU $ the tokens S3 served saved past each "
        "request's device match - GPU $ the lookups' stall beyond one decode forward cost); ratio_gross leaves "
        "the stall out; ratio_s3kv credits what the host tier served too (the same without one); below 1 s3kv "
        "pays for itself. Where gc learns the retention (the default), its index publisher ran before the "
        "first request (a window of ongoing traffic), with no reads learnt yet",
    }
    res: dict[str, Any] = {
        "value": res_value,
        "bench": "trace",
        "store": bs.info(),
        "latency_ms_injected": bs.latency_ms,
        "machine": machine_info(),
        "trace": {
            "path": cfg.path,
            "format": cfg.fmt,
            "requests": len(reqs),
            "prompt_tokens": prompt_tokens,
            "output_tokens": sum(r.output_length for r in reqs),
            "continuations": len(conts),
            "duration_hours": rnd(hours, 4),
            "hash_block_tokens": bt,
            "reuse_by_hash_ids_tokens": sum(trace_reuse_tokens(reqs, bt)),
        },
        "sim": {
            "tokens_per_block": tpb,
            "layers": "1 sliding + 1 full-attention (2 layer groups)",
            "window": m.window,
            "sim_page_bytes": {g: 4 * tpb * SIM_HEAD_DIM for g in ("full", "sliding")},
            "real_page_bytes": {"full": pages[0], "sliding": pages[1]},
            "checkpoint_tokens": cfg.checkpoint_tokens,
            "engine": f"one request at a time (uploads land before the next lookup), chunked prefill of "
            f"{cfg.chunk_tokens} tokens, "
            + (f"{cfg.fleet.clusters} engine(s), device prefix cache {first_run['fleet']['device_cache_tokens']:,} "
               "tokens each" if first_run["fleet"]["device_cache_tokens"] else "no device prefix cache"),
            "answers": "full answers generated" if cfg.full_outputs else (
                "continued requests generate their whole answer; others up to the first block it completes"
            ),
            "generated_tokens": next(iter(runs.values()))["generated_tokens"],
            "answer_tokens_not_replayed": next(iter(runs.values()))["answer_tokens_not_replayed"],
            "answer_blocks_not_replayed": unreplayed,
            "audit": cfg.audit,
            "replay_processes": min(max(1, cfg.jobs), len(cfg.runs)),
            "sizing_note": "objects sized from the real model's page bytes; tiny pages moved; bytes and "
            "requests reported at real sizes",
        },
        "model": {
            "name": m.name,
            "layers": m.layers,
            "sliding_window": m.window,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "gpu": GPU_NAME if cfg.gpu.peak_tflops == GPU_PEAK_TFLOPS else "user-given",
            "gpu_peak_tflops": cfg.gpu.peak_tflops,
            "mfu": cfg.gpu.mfu,
        },
        "prices": dataclasses.asdict(cfg.prices),
        "ideal_tokens": ideal,
        "ideal_pct_of_prompt": rnd(100 * ideal / prompt_tokens, 2),
        # The ideal past each request's device match: what served_pct_of_ideal divides by.
        "ideal_marginal_tokens": ideal_marginal,
        "fleet": {**first_run["fleet"], "tiers": first["tiers"]},
        "policies": rows,
        "kv_mismatches": sum(r["kv_mismatches"] for r in runs.values()),
        "guard_violations": sum(r["guard_violations"] for r in runs.values()),
        "load_failures": sum(r["load_failures"] for r in runs.values()),
        "curves": _curves(reqs, runs, oracle, device),
    }
    if cfg.per_request:
        res["per_request"] = {
            **{name: r["served_per_request"] for name, r in runs.items()},
            "ideal": list(oracle.ideal),
            "upstream-example": list(upstream),
            "device": list(device),
            "engine": list(first_run["engine_per_request"]),
            **{f"{name}-s3": r["s3_per_request"] for name, r in runs.items()},
            **{f"{name}-host": [a - b for a, b in zip(r["served_per_request"], r["s3_per_request"], strict=True)]
               for name, r in runs.items()},
        }
        res["tokens_fingerprint"] = next(iter(fps))
    if "window" in runs and "all" in runs:
        w, a = rows["window"], rows["all"]
        res["window_vs_all"] = {
            "served": rnd(w["served_tokens"] / a["served_tokens"], 4) if a["served_tokens"] else None,
            "served_vs_ideal": rnd(w["served_tokens"] / ideal, 4) if ideal else None,
            "stored_bytes": rnd(w["stored_bytes_incl_unreplayed_answers"] / a["stored_bytes_incl_unreplayed_answers"], 4)
            if a["stored_bytes"]
            else None,
            "distinct_page_bytes": rnd(w["distinct_page_bytes"] / a["distinct_page_bytes"], 4)
            if a["distinct_page_bytes"]
            else None,
        }
    if "window" in runs and "window-no-branch" in runs:
        w, nb = rows["window"], rows["window-no-branch"]
        res["branch_tails"] = {
            "served_tokens_added": w["served_tokens"] - nb["served_tokens"],
            "served_pct_points_added": rnd(w["served_pct_of_prompt"] - nb["served_pct_of_prompt"], 2),
            "stored_bytes_added": w["stored_bytes"] - nb["stored_bytes"],
            "stored_bytes_added_pct": rnd(100 * (w["stored_bytes"] / nb["stored_bytes"] - 1), 2)
            if nb["stored_bytes"]
            else None,
            "tails_stored": w["branch_tails_stored"],
        }
    res["targets"] = {
        "kv_mismatches_zero": "no page served differs from recomputation, in every run",
        "no_failed_loads": "no promised load failed",
        "no_saves_dropped": "every planned save reached the store (else the policy comparison is off)",
    }
    res["targets_met"] = {
        "kv_mismatches_zero": res["kv_mismatches"] == 0 and res["guard_violations"] == 0,
        "no_failed_loads": res["load_failures"] == 0,
        "no_saves_dropped": all(r["saves_dropped"] == 0 for r in runs.values()),
    }
    res["seconds"] = rnd(time.perf_counter() - t_start, 1)
    return res


def _curves(
    reqs: Sequence[TraceRequest], runs: Mapping[str, Mapping[str, Any]], oracle: _Oracle, device: Sequence[int]
) -> dict[str, Any]:
    """Cumulative served tokens against cumulative prompt tokens, ~200 points (for the plot)."""
    n = len(reqs)
    idx = sorted({min(n - 1, int(i * n / 200)) for i in range(200)} | {n - 1})

    def cum(xs: Sequence[int]) -> list[int]:
        out, s, j = [], 0, 0
        for i, x in enumerate(xs):
            s += x
            if j < len(idx) and i == idx[j]:
                out.append(s)
                j += 1
        return out

    series = {name: cum(r["served_per_request"]) for name, r in runs.items()}
    series["ideal"] = cum(oracle.ideal)
    series["upstream-example"] = cum([max(0, u - d) for u, d in zip(oracle.upstream, device, strict=True)])
    return {"prompt_tokens": cum([r.input_length for r in reqs]), "served": series}


