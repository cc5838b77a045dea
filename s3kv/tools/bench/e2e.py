"""``s3kv bench e2e``: the simulator's multi-turn VSWA workload, cold cluster then warm cluster.

In one process, on one store: for each storage policy (``window``: sliding groups keep only the
tails a hit can use; ``all``: every block of every group) a cold cluster A serves the demo's
conversations (``s3kv demo``'s shapes: a Gemma-3-like 5 sliding : 1 global model, the window far
shorter than the prompts), then a fresh warm cluster B -- new engine, new index, sharing only the
store -- serves them again, one turn further, plus new users on the same system prompt. The real
adapter classes (``S3KvConnectorLeader`` / ``S3KvConnectorWorker``) run inside ``SimEngine``,
whose checker compares every page a connector served with what recomputation would have written
(``kv_mismatches``).

Reported per cluster: tokens served from the store, hit rate, time per request (simulated
admission -> last token; the simulator's "forward" is a byte generator, so these times show
connector and store overhead, not GPU time), S3 requests and bytes, and bytes stored per layer
group under each policy.

Prefill saved: the warm cluster's per-request served prefixes, priced on a real model's geometry
(:data:`~s3kv.tools.bench.common.GEMMA3_27B`) with ``2 x params x tokens + attention`` FLOPs
(:meth:`~s3kv.tools.bench.common.ModelSpec.prefill_flops`), converted to seconds at an assumed GPU peak
and MFU (``--gpu-tflops``, ``--mfu``).

Memory soak: a third cluster serves ``rounds`` rounds of new conversations plus repeats of the
previous round's (saves and loads every round); the process RSS and the staging pool are sampled
after each round. ``rss_mib_start`` is the sample after the first round (warm-up done).

Why this is one module: one benchmark -- its set-up, the runs it compares and the table and plot
that report them.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..demo import DemoShape
from .common import (
    GEMMA3_27B,
    GPU_NAME,
    GPU_PEAK_TFLOPS,
    PREFILL_MFU,
    BenchStore,
    ModelSpec,
    SharedStore,
    machine_info,
    progress,
    rnd,
    rss_bytes,
)

POLICIES = ("window", "all")
#: RSS may grow by this much (or 5 %) from the first to the last soak round and still count as flat.
FLAT_RSS_SLACK_MIB = 24.0


@dataclass(frozen=True)
class E2EConfig:
    shape: DemoShape = field(default_factory=DemoShape)
    rounds: int = 12
    soak_conversations: int = 2
    staging_mib: int = 256
    #: None: the demo's (512: sliding tails every 2 windows, so new users on a shared system prompt hit).
    checkpoint_tokens: int | None = None
    model: ModelSpec = GEMMA3_27B
    gpu_tflops: float = GPU_PEAK_TFLOPS
    mfu: float = PREFILL_MFU

    @classmethod
    def quick(cls) -> E2EConfig:
        shape = DemoShape(
            conversations=2,
            turns_a=1,
            turns_b=2,
            system_len=384,
            first_len=160,
            turn_len=96,
            answer_len=16,
            new_users=1,
            max_seq_len=2048,
        )
        return cls(shape=shape, rounds=3, soak_conversations=1, staging_mib=64)

    def replace(self, **kw: Any) -> E2EConfig:
        return dataclasses.replace(self, **kw)


def _engine(cfg: E2EConfig, bs: BenchStore, policy: str, prefix: str, name: str) -> Any:
    from ...config import Settings
    from ..faultmatrix import make_engine

    s = cfg.shape
    settings = Settings(
        load_mode=s.load_mode,
        staging_mib=cfg.staging_mib,
        checkpoint_tokens=cfg.checkpoint_tokens or s.checkpoint_tokens,
        storage_policy=policy,
        check_access=False,
        model_id="s3kv-bench/e2e-gemma3-like",  # the bench's made-up model: named, so no weak-identity warning
    )
    return make_engine(s, settings, SharedStore(bs.store), prefix, f"s3kv-bench-{name}-{uuid.uuid4().hex[:8]}")


def _flush(engine: Any) -> None:
    for w in engine.workers:
        w.flush(120)


def _kv_blocks(tokens: Any, tokens_per_block: int) -> set[bytes]:
    """Chain digests of the full blocks whose KV a request wrote (prompt + answer, less the last token)."""
    from ...core.keys import Chain

    return set(Chain(b"\0" * 16, tokens_per_block).extend_to(list(tokens)[:-1]))


def _cluster(
    cfg: E2EConfig, bs: BenchStore, policy: str, role: str, prefix: str | None = None
) -> tuple[dict[str, Any], set[bytes]]:
    """One cluster's run, and the distinct KV blocks its requests wrote."""
    from ..demo import _workload

    prefix = prefix or bs.key(f"e2e-{policy}")
    before = bs.store.snapshot()
    t0 = time.perf_counter()
    reports = []
    phases = _workload(cfg.shape, role)
    with _engine(cfg, bs, policy, prefix, f"{policy}-{role}") as engine:
        for phase in phases:
            reports.append(engine.run(phase))
            _flush(engine)  # users think between turns; the previous turn's uploads are done by then
        wall = time.perf_counter() - t0
        names = _group_names(engine)
        wstats = [w.core.stats() for w in engine.workers]
        lstats = engine.leader.core.stats
    io = bs.store.snapshot() - before
    reqs = [r for rep in reports for r in rep.requests]
    prompt = sum(r.prompt_tokens for r in reqs)
    matched = sum(r.matched_tokens for r in reqs)
    prompts = {spec.request_id: spec.prompt for phase in phases for spec in phase}
    blocks: set[bytes] = set()
    for r in reqs:
        blocks |= _kv_blocks(
            tuple(prompts[r.request_id]) + tuple(r.output_tokens), cfg.shape.tokens_per_block
        )
    return {
        "role": role,
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "matched_tokens": matched,
        "computed_tokens": sum(r.computed_tokens for r in reqs),
        "hit_rate": rnd(matched / prompt if prompt else 0.0, 4),
        "kv_mismatches": sum(rep.kv_mismatches for rep in reports),
        "pages_checked": sum(rep.pages_checked for rep in reports),
        "mean_request_latency_ms": rnd(1e3 * sum(r.latency_s for r in reqs) / max(1, len(reqs)), 2),
        "mean_ttft_ms": rnd(1e3 * sum(r.ttft_s for r in reqs) / max(1, len(reqs)), 2),
        "wall_s": rnd(wall, 3),
        "s3": {
            "requests": io.requests,
            "head": io.head,
            "put": io.put,
            "get": io.get,
            "bytes_up": io.bytes_up,
            "bytes_down": io.bytes_down,
        },
        "bytes_saved": sum(s.bytes_uploaded for s in wstats),
        "bytes_loaded": sum(s.bytes_loaded for s in wstats),
        "saves_dropped": sum(s.saves_dropped for s in wstats),
        "load_failures": sum(s.loads_failed_objects for s in wstats),
        "lookup_waves": lstats.lookup_waves,
        "groups": names,
        "per_request": [
            {
                "id": r.request_id,
                "prompt_tokens": r.prompt_tokens,
                "matched_tokens": r.matched_tokens,
                "latency_ms": rnd(r.latency_s * 1e3, 2),
            }
            for r in reqs
        ],
    }, blocks


def _group_names(engine: Any) -> dict[str, dict[str, Any]]:
    """Group fingerprint (as in stored keys) -> name and page size, from the geometry the worker registered."""
    geom = engine.workers[0].core.geometry
    return {
        g.fingerprint: {
            "name": f"group{g.group_id}:{'full' if g.window is None else f'window{g.window}'}",
            "page_bytes": g.page_bytes,
        }
        for g in geom.groups
    }


def _stored_by_group(
    bs: BenchStore, policy: str, groups: dict[str, dict[str, Any]]
) -> dict[str, dict[str, int]]:
    """Objects, bytes and pages stored under the policy's prefix, per layer group."""
    from ...core.keys import parse_key
    from ...core.objects import header_len

    out: dict[str, dict[str, int]] = {
        g["name"]: {"objects": 0, "bytes": 0, "pages": 0} for g in groups.values()
    }
    for info in bs.raw.list(bs.key(f"e2e-{policy}") + "/"):
        pk = parse_key(info.key)
        if pk is None:
            continue
        g = groups.get(pk.group_fingerprint, {"name": f"group?:{pk.group_fingerprint}", "page_bytes": 0})
        e = out.setdefault(g["name"], {"objects": 0, "bytes": 0, "pages": 0})
        e["objects"] += 1
        e["bytes"] += info.size
        if g["page_bytes"]:
            # size = header_len(n) + n * page_bytes, header_len(n) = header_len(0) + 8 n
            e["pages"] += (info.size - header_len(0)) // (g["page_bytes"] + 8)
    return dict(sorted(out.items()))


def _soak(cfg: E2EConfig, bs: BenchStore) -> dict[str, Any]:
    from ...sim import multi_turn_workload, repeat_workload

    s = cfg.shape
    samples: list[float] = []
    in_use: list[int] = []
    per_round = 0
    in_process = bs.kind == "memory"
    mismatches = 0
    served = 0
    with _engine(cfg, bs, "window", bs.key("e2e-soak"), "soak") as engine:
        prev: list[Any] = []
        for r in range(cfg.rounds):
            base = 1_000_000 + r * 10_000
            new = multi_turn_workload(
                n_conversations=cfg.soak_conversations,
                turns=2,
                system_len=s.system_len,
                first_len=s.first_len,
                turn_len=s.turn_len,
                max_new_tokens=s.answer_len,
                seed=1000 + r,
                first_id=base,
            )
            specs = new + (repeat_workload(prev, first_id=base + 5_000) if prev else [])
            per_round = max(per_round, len(specs))
            rep = engine.run(specs)
            _flush(engine)
            engine.workers[0].get_finished([], [])  # let the worker free the staging of placed loads
            mismatches += rep.kv_mismatches
            served += rep.matched_tokens
            prev = new
            gc.collect()
            rss = rss_bytes()
            if in_process:
                # A memory:// store holds the objects in this process: count them out.
                rss -= sum(i.size for i in bs.raw.list(bs.prefix + "/"))
            samples.append(rss / 2**20)
            in_use.append(sum(w.core.stats().staging_in_use for w in engine.workers))
        stats = [w.core.stats() for w in engine.workers]
    start, end = samples[0], samples[-1]
    growth = end - start
    return {
        "rounds": cfg.rounds,
        "requests_per_round": per_round,
        "rss_mib_start": rnd(start, 1),
        "rss_mib_end": rnd(end, 1),
        "rss_mib_max": rnd(max(samples), 1),
        "rss_growth_mib": rnd(growth, 1),
        "rss_mib_samples": [rnd(x, 1) for x in samples],
        "rss_excludes_in_process_store_bytes": in_process,
        "rss_growth_kib_per_request": rnd(growth * 1024 / max(1, per_round * (cfg.rounds - 1)), 1),
        "staging_capacity_bytes": sum(st.staging_capacity for st in stats),
        "staging_high_water_bytes": max(st.staging_high_water for st in stats),
        "staging_in_use_samples_bytes": in_use,
        "staging_in_use_end_bytes": in_use[-1],
        "staging_drops": sum(st.staging_drops for st in stats),
        "kv_mismatches": mismatches,
        "matched_tokens": served,
        "flat": growth <= max(FLAT_RSS_SLACK_MIB, 0.05 * start),
    }


def _prefill(cfg: E2EConfig, warm: dict[str, Any]) -> dict[str, Any]:
    m = cfg.model
    flops = sum(m.prefill_flops(r["matched_tokens"]) for r in warm["per_request"])
    eff = cfg.gpu_tflops * 1e12 * cfg.mfu
    ex = m.prefill_flops(32768)
    return {
        "prefill_tflops_saved": rnd(flops / 1e12, 2),
        "prefill_seconds_saved_est": rnd(flops / eff, 3),
        "model": {
            "name": m.name,
            "layers": m.layers,
            "hidden": m.hidden,
            "intermediate": m.intermediate,
            "q_heads": m.q_heads,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "sliding_window": m.window,
            "layer_pattern": f"{m.global_every - 1} local : 1 global ({len(m.global_layers)} global layers)",
            "matmul_params": m.matmul_params,
        },
        "flop_model": "2 x matmul_params x tokens + sum over layers of 4 x q_heads x head_dim x "
        "(keys attended per query: t+1 global, min(t+1, window) local)",
        "gpu": GPU_NAME if cfg.gpu_tflops == GPU_PEAK_TFLOPS else "user-given",
        "gpu_peak_tflops": cfg.gpu_tflops,
        "mfu": cfg.mfu,
        "tokens_priced": sum(r["matched_tokens"] for r in warm["per_request"]),
        "example_32k_prefix": {"tflops": rnd(ex / 1e12, 1), "seconds_est": rnd(ex / eff, 3)},
    }


def run_e2e(bs: BenchStore, cfg: E2EConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    # Untimed: first-use costs (imports, torch, connections, the server allocating its volumes)
    # would otherwise land on whichever cluster runs first.
    _cluster(E2EConfig.quick(), bs, "window", "A", prefix=bs.key("e2e-warmup"))
    amplification: dict[str, float] = {}
    policies: dict[str, dict[str, Any]] = {}
    stored: dict[str, dict[str, dict[str, int]]] = {}
    for policy in POLICIES:
        cold, cold_blocks = _cluster(cfg, bs, policy, "A")
        progress(
            f"e2e: policy {policy}: cold cluster {cold['requests']} requests, hit {cold['hit_rate']:.0%}, "
            f"kv_mismatches {cold['kv_mismatches']}"
        )
        warm, warm_blocks = _cluster(cfg, bs, policy, "B")
        progress(
            f"e2e: policy {policy}: warm cluster {warm['requests']} requests, hit {warm['hit_rate']:.0%}, "
            f"kv_mismatches {warm['kv_mismatches']}"
        )
        policies[policy] = {"cold": cold, "warm": warm}
        stored[policy] = _stored_by_group(bs, policy, warm["groups"])
        # The full-attention group stores every block under both policies: pages stored per distinct
        # block written is pure write amplification (snapshots re-uploading a chunk's earlier pages).
        full = next(g["name"] for g in warm["groups"].values() if g["name"].endswith(":full"))
        distinct = len(cold_blocks | warm_blocks)
        amplification[policy] = rnd(stored[policy][full]["pages"] / distinct if distinct else 0.0, 3)
    total = {p: sum(v["bytes"] for v in stored[p].values()) for p in POLICIES}
    ratio = total["window"] / total["all"] if total["all"] else 0.0
    progress(f"e2e: memory soak, {cfg.rounds} rounds ...")
    soak = _soak(cfg, bs)
    warm = policies["window"]["warm"]
    cold = policies["window"]["cold"]
    prefill = _prefill(cfg, warm)
    runs = [r for p in policies.values() for r in p.values()]
    mismatches = sum(r["kv_mismatches"] for r in runs) + soak["kv_mismatches"]
    res: dict[str, Any] = {
        "bench": "e2e",
        "store": bs.info(),
        "latency_ms_injected": bs.latency_ms,
        "machine": machine_info(),
        "shape": {
            **dataclasses.asdict(cfg.shape),
            "checkpoint_tokens": cfg.checkpoint_tokens or cfg.shape.checkpoint_tokens,
        },
        "policies": policies,
        "cold": cold,
        "warm": warm,
        "tokens_served": warm["matched_tokens"],
        "hit_rate_cold": cold["hit_rate"],
        "hit_rate_warm": warm["hit_rate"],
        "time_per_request_ms_cold": cold["mean_request_latency_ms"],
        "time_per_request_ms_warm": warm["mean_request_latency_ms"],
        "kv_mismatches": mismatches,
        "stored_bytes_by_group": stored,
        "stored_bytes_total": total,
        "stored_ratio_window_vs_all": rnd(ratio, 4),
        "full_group_pages_per_distinct_block": amplification,
        **{k: prefill[k] for k in ("prefill_tflops_saved", "prefill_seconds_saved_est")},
        "prefill_model": prefill,
        "rss_mib_start": soak["rss_mib_start"],
        "rss_mib_end": soak["rss_mib_end"],
        "staging_high_water_bytes": soak["staging_high_water_bytes"],
        "memory": soak,
    }
    res["targets"] = {
        "kv_mismatches_zero": "no page served differs from recomputation (every run, both policies, the soak)",
        "warm_hits_more": "the warm cluster serves a larger share of its prompts than the cold one",
        "window_stores_less": "the window policy stores fewer bytes than storing every block",
        "no_failed_loads": "no promised load failed",
        "memory_flat": f"RSS grows by at most max({FLAT_RSS_SLACK_MIB:g} MiB, 5%) over the soak and staging "
        "stays within its bound",
    }
    res["targets_met"] = {
        "kv_mismatches_zero": mismatches == 0,
        "warm_hits_more": warm["hit_rate"] > cold["hit_rate"],
        "window_stores_less": ratio < 1.0,
        "no_failed_loads": all(r["load_failures"] == 0 for r in runs),
        "memory_flat": bool(soak["flat"])
        and soak["staging_high_water_bytes"] <= soak["staging_capacity_bytes"],
    }
    res["seconds"] = rnd(time.perf_counter() - t0, 1)
    return res


def table(res: dict[str, Any]) -> str:
    from .common import header, targets_line

    s = res["shape"]
    lines = [
        f"s3kv bench e2e -- Gemma-3-like VSWA sim: window {s['window']}, {s['tokens_per_block']} tok/block, "
        f"{s['num_layers']} layers (5 sliding : 1 global), {s['conversations']} conversations, "
        f"checkpoints every {s['checkpoint_tokens']} tok",
        header(res),
        "",
        f"{'policy':>7} {'cluster':>7} | {'reqs':>4} {'prompt tok':>10} {'served':>8} {'hit':>5} | "
        f"{'ms/req':>8} {'TTFT ms':>8} | {'S3 req':>6} {'MiB up':>7} {'MiB down':>8} | {'kv_mismatches':>13}",
    ]
    for policy, runs in res["policies"].items():
        for phase in ("cold", "warm"):
            r = runs[phase]
            lines.append(
                f"{policy:>7} {phase:>7} | {r['requests']:>4} {r['prompt_tokens']:>10} {r['matched_tokens']:>8} "
                f"{r['hit_rate']:>5.0%} | {r['mean_request_latency_ms']:>8.1f} {r['mean_ttft_ms']:>8.1f} | "
                f"{r['s3']['requests']:>6} {r['s3']['bytes_up'] / 2**20:>7.1f} {r['s3']['bytes_down'] / 2**20:>8.1f}"
                f" | {r['kv_mismatches']:>13}"
            )
    lines.append("")
    lines.append("stored bytes per layer group:")
    for policy, groups in res["stored_bytes_by_group"].items():
        parts = ", ".join(
            f"{g} {v['bytes'] / 2**20:.2f} MiB ({v['objects']} objects, {v['pages']} pages)"
            for g, v in groups.items()
        )
        lines.append(f"  {policy:>6}: {parts}")
    lines.append(f"  window / all = {res['stored_ratio_window_vs_all']:.3f}")
    amp = res["full_group_pages_per_distinct_block"]
    lines.append(
        "  full-attention group pages stored per distinct block written (1.0 = no rewrite): "
        + ", ".join(f"{p} {v:.2f}" for p, v in amp.items())
    )
    p = res["prefill_model"]
    lines.append("")
    lines.append(
        f"prefill saved by the warm cluster, priced on {p['model']['name']}: {res['prefill_tflops_saved']:.1f} "
        f"TFLOP = {res['prefill_seconds_saved_est']:.3f} s at {p['gpu_peak_tflops']:g} TFLOP/s x MFU {p['mfu']:g} "
        f"({p['tokens_priced']} tokens; a 32k-token prefix alone: {p['example_32k_prefix']['tflops']:.0f} TFLOP, "
        f"{p['example_32k_prefix']['seconds_est']:.2f} s)"
    )
    m = res["memory"]
    lines.append(
        f"memory soak: {m['rounds']} rounds x {m['requests_per_round']} requests: RSS {m['rss_mib_start']:.0f} -> "
        f"{m['rss_mib_end']:.0f} MiB (max {m['rss_mib_max']:.0f}); staging high water "
        f"{m['staging_high_water_bytes'] / 2**20:.1f} of {m['staging_capacity_bytes'] / 2**20:.0f} MiB, "
        f"in use at the end {m['staging_in_use_end_bytes']} B"
    )
    lines.append(targets_line(res))
    return "\n".join(lines)
