"""``s3kv demo``: two simulated clusters, in separate processes, sharing only a bucket.

Cluster A (cold) serves multi-turn conversations on a Gemma-3-like VSWA model
(5 sliding : 1 global, the window far shorter than the prompts). Cluster B
(warm), a fresh process with a fresh engine, serves the same conversations again
and continues them one turn further, plus new users on the same system prompt.
Every page either cluster loads is checked byte for byte against what
recomputation would have written (``kv_mismatches``).

By default the bucket is an embedded loopback S3 server (SeaweedFS when
installed, else moto's server); ``--url`` / ``S3KV_URL`` point at a real one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import click

from .keys import parse_key


@dataclass(frozen=True)
class DemoShape:
    window: int = 256
    tokens_per_block: int = 32
    max_seq_len: int = 8192
    num_layers: int = 6
    kv_heads: int = 2
    head_dim: int = 32
    conversations: int = 4
    turns_a: int = 2
    turns_b: int = 3
    system_len: int = 768
    first_len: int = 320
    turn_len: int = 192
    answer_len: int = 48
    new_users: int = 2
    tp_size: int = 1
    chunk_size: int | None = 512
    load_mode: str = "async"
    #: Sliding-group tails every this many tokens: new users on a shared system prompt hit up to here.
    checkpoint_tokens: int = 512


def _workload(shape: DemoShape, role: str) -> list[list[Any]]:
    """Phases of requests: one per conversation turn (users think between turns), new users last."""
    from .sim import multi_turn_workload, random_tokens
    from .sim.request import SimRequestSpec

    turns = shape.turns_a if role == "A" else shape.turns_b
    base = multi_turn_workload(
        n_conversations=shape.conversations,
        turns=shape.turns_b,
        system_len=shape.system_len,
        first_len=shape.first_len,
        turn_len=shape.turn_len,
        max_new_tokens=shape.answer_len,
        seed=7,
        first_id=0,
    )
    first_id = 0 if role == "A" else 10_000
    phases: list[list[Any]] = [[] for _ in range(turns)]
    for s in base:
        turn = s.request_id % shape.turns_b
        if turn < turns:
            phases[turn].append(SimRequestSpec(first_id + s.request_id, s.prompt, s.max_new_tokens))
    if role == "B":
        rng = random.Random("demo/new-users")
        system = list(base[0].prompt[: shape.system_len])
        phases.append(
            [
                SimRequestSpec(first_id + 5_000 + u, tuple(system + random_tokens(rng, shape.first_len, 32000)),
                               shape.answer_len)
                for u in range(shape.new_users)
            ]
        )
    return phases


def run_cluster(role: str, shape: DemoShape) -> dict[str, Any]:
    """One cluster: a simulated engine with the real adapter classes, against S3KV_URL."""
    from .config import load_settings
    from .runtime import open_runtime_store
    from .sim import SimCacheConfig, SimEngine, gemma3_like
    from .store.instrument import InstrumentedStore
    from .trtllm import S3KvConnectorLeader, S3KvConnectorWorker

    settings = load_settings(
        load_mode=shape.load_mode, staging_mib=256, checkpoint_tokens=int(os.environ.get("S3KV_CHECKPOINT_TOKENS", shape.checkpoint_tokens))
    )
    raw, prefix = open_runtime_store(settings)
    raw.check_access()
    store = InstrumentedStore(raw)
    model = gemma3_like(
        shape.window, num_layers=shape.num_layers, kv_heads=shape.kv_heads * shape.tp_size, head_dim=shape.head_dim
    )
    t0 = time.perf_counter()
    engine = SimEngine(
        model,
        SimCacheConfig(tokens_per_block=shape.tokens_per_block, max_seq_len=shape.max_seq_len),
        S3KvConnectorLeader,
        S3KvConnectorWorker,
        tp_size=shape.tp_size,
        chunk_size=shape.chunk_size,
        max_batch=4,
        connector_kwargs=dict(settings=settings, store=store, key_prefix=prefix, engine_key=f"demo-{role}"),
    )
    reports = []
    with engine:
        for phase in _workload(shape, role):
            reports.append(engine.run(phase))
            # Users think between turns; by then the previous turn's uploads are done.
            for w in engine.workers:
                w.flush(120)
        wall = time.perf_counter() - t0
        geometry = engine.workers[0].core.geometry
        wstats = [w.core.stats() for w in engine.workers]
        lstats = engine.leader.core.stats
        ns_prefix = engine.leader.core.scheme.namespace_prefix
    io = store.snapshot()
    windows = {g.fingerprint: (g.group_id, g.window) for g in geometry.groups}
    by_group: dict[str, dict[str, int]] = {}
    for info in raw.list(ns_prefix):
        pk = parse_key(info.key)
        if pk is None or pk.group_fingerprint not in windows:
            continue
        gid, win = windows[pk.group_fingerprint]
        name = f"group{gid}:{'full' if win is None else f'window{win}'}"
        e = by_group.setdefault(name, {"objects": 0, "bytes": 0})
        e["objects"] += 1
        e["bytes"] += info.size
    raw.close()
    requests = [r for rep in reports for r in rep.requests]
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    matched = sum(r.matched_tokens for r in requests)
    return {
        "role": role,
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "matched_tokens": matched,
        "computed_tokens": sum(r.computed_tokens for r in requests),
        "hit_rate": round(matched / prompt_tokens, 4) if prompt_tokens else 0.0,
        "kv_mismatches": sum(rep.kv_mismatches for rep in reports),
        "pages_checked": sum(rep.pages_checked for rep in reports),
        "bytes_saved": sum(s.bytes_uploaded for s in wstats),
        "bytes_loaded": sum(s.bytes_loaded for s in wstats),
        "objects_saved": sum(s.objects_uploaded for s in wstats),
        "saves_dropped": sum(s.saves_dropped_staging_full + s.saves_dropped_store_error for s in wstats),
        "load_failures": sum(s.loads_failed_objects for s in wstats),
        "s3_requests": io.requests,
        "s3": {"head": io.head, "put": io.put, "get": io.get, "bytes_up": io.bytes_up, "bytes_down": io.bytes_down},
        "lookup_waves": lstats.lookup_waves,
        "time_s": round(wall, 3),
        "stored_bytes_by_group": by_group,
        "per_request": [
            {"id": r.request_id, "prompt_tokens": r.prompt_tokens, "matched_tokens": r.matched_tokens,
             "latency_s": round(r.latency_s, 4)}
            for r in requests
        ],
    }


def _spawn(role: str, shape: DemoShape, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    try:
        cmd = [sys.executable, "-m", "s3kv.demo", role, out, json.dumps(asdict(shape))]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise click.ClickException(f"cluster {role} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out) as fh:
            return json.load(fh)
    finally:
        os.unlink(out)


def _table(res: dict[str, Any]) -> str:
    lines = []
    for phase in ("cold", "warm"):
        r = res[phase]
        lines.append(
            f"{phase:>4} (cluster {r['role']}): {r['requests']} requests, prompt {r['prompt_tokens']} tok, "
            f"served from S3 {r['matched_tokens']} tok ({r['hit_rate']:.0%}), recomputed {r['computed_tokens']} tok, "
            f"kv_mismatches: {r['kv_mismatches']} ({r['pages_checked']} pages checked)"
        )
        lines.append(
            f"      S3: {r['s3_requests']} requests (HEAD {r['s3']['head']}, PUT {r['s3']['put']}, "
            f"GET {r['s3']['get']}), saved {r['bytes_saved'] / 2**20:.1f} MiB, "
            f"loaded {r['bytes_loaded'] / 2**20:.1f} MiB, {r['time_s']:.1f}s"
        )
        hits = " ".join(f"{p['matched_tokens']}/{p['prompt_tokens']}" for p in r["per_request"])
        lines.append(f"      hits per request (served/prompt): {hits}")
    lines.append("stored bytes per layer group: " + ", ".join(
        f"{k} {v['bytes'] / 2**20:.1f} MiB in {v['objects']} objects" for k, v in res["warm"]["stored_bytes_by_group"].items()
    ))
    lines.append(f"store: {res['store']}")
    return "\n".join(lines)


@click.command("demo")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--url", default=None, help="Use this bucket (s3://bucket/prefix) instead of an embedded server.")
@click.option("--server", type=click.Choice(["auto", "moto", "seaweedfs"]), default="auto", show_default=True,
              help="Embedded S3 server when no --url / S3KV_URL is given.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel shards per cluster.")
@click.option("--load-mode", type=click.Choice(["async", "sync"]), default="async", show_default=True)
def demo_command(as_json: bool, url: str | None, server: str, tp: int, load_mode: str) -> None:
    """Cold cluster A, then warm cluster B, sharing only the bucket."""
    shape = DemoShape(tp_size=tp, load_mode=load_mode)
    url = url or os.environ.get("S3KV_URL")
    env = dict(os.environ)
    emb = None
    if url:
        env["S3KV_URL"] = url.rstrip("/") + f"/demo-{int(time.time())}"
        where = url
    else:
        from .store.embedded import EmbeddedS3

        emb = EmbeddedS3(kind=server, bucket="s3kv-demo", prefix="demo").start()  # type: ignore[arg-type]
        env.update(emb.env())
        where = f"embedded {emb.kind} at {emb.endpoint_url}"
    try:
        cold = _spawn("A", shape, env)
        warm = _spawn("B", shape, env)
    finally:
        if emb is not None:
            emb.stop()
    res = {"cold": cold, "warm": warm, "store": where, "shape": asdict(shape)}
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(_table(res))


def _main(argv: Sequence[str]) -> None:
    role, out, shape_json = argv
    from .logs import configure_logging

    configure_logging(os.environ.get("S3KV_LOG_LEVEL", "WARNING"))
    result = run_cluster(role, DemoShape(**json.loads(shape_json)))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _main(sys.argv[1:])
