"""``s3kv demo``: two simulated clusters, in separate processes, sharing only a bucket.

Cluster A (cold) serves multi-turn conversations on a Gemma-3-like VSWA model
(5 sliding : 1 global, the window far shorter than the prompts). Cluster B
(warm), a fresh process with a fresh engine, serves the same conversations again
and continues them one turn further, plus new users on the same system prompt.
Every page either cluster loads is checked byte for byte against what
recomputation would have written (``kv_mismatches``).

By default the bucket is an embedded loopback S3 server (SeaweedFS when
installed, else moto's server); ``--url`` / ``S3KV_URL`` point at a real one.

Why this is one module: the parent (``s3kv demo``) and the child processes it spawns (``python -I``
running :func:`_main`) share the workload shape and the result format.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import click

from ..core.keys import parse_key


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
    #: Host staging per cluster (the demo's model is small).
    staging_mib: int = 256
    #: Host tier per cluster (GiB): cluster B's last turn, sent again, is served from it.
    host_cache_gb: float = 0.25


def _workload(shape: DemoShape, role: str) -> list[list[Any]]:
    """Phases of requests: one per conversation turn (users think between turns), new users last."""
    from ..sim.workload import turn_phases

    return turn_phases(shape, role, first_id=0 if role == "A" else 10_000, seed=7, new_users_seed="demo/new-users")


def _phase_names(shape: DemoShape, role: str) -> list[str]:
    """What each phase of :func:`_workload` is, in words (``turn 1`` ..., ``new users``)."""
    turns = shape.turns_a if role == "A" else shape.turns_b
    return [f"turn {t + 1}" for t in range(turns)] + (["new users"] if role == "B" else [])


#: Settings the demo picks for its small model, applied only where the user chose nothing.
def demo_defaults(shape: DemoShape) -> dict[str, Any]:
    return {
        "load_mode": shape.load_mode,
        "staging_mib": shape.staging_mib,
        "checkpoint_tokens": shape.checkpoint_tokens,
        "host_cache_gb": shape.host_cache_gb,
    }


def demo_overrides(shape: DemoShape, forced: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """The demo's defaults minus what the user set (env or config file), plus ``forced`` (flags)."""
    from ..config import explicit_settings

    chosen = explicit_settings(env)
    out = {k: v for k, v in demo_defaults(shape).items() if k not in chosen}
    out.update(forced or {})
    return out


def run_cluster(role: str, shape: DemoShape, forced: dict[str, Any] | None = None) -> dict[str, Any]:
    """One cluster: a simulated engine with the real adapter classes, against S3KV_URL.

    Settings come from the environment (and ``S3KV_CONFIG_FILE``) like an engine's; the demo's
    own defaults fill only what the user left unset, and ``forced`` (command-line flags) wins.
    """
    from ..config import load_settings
    from ..engine.runtime import open_runtime_store
    from ..store.instrument import InstrumentedStore
    from .faultmatrix import make_engine

    settings = load_settings(**demo_overrides(shape, forced))
    raw, prefix = open_runtime_store(settings)
    raw.check_access()
    store = InstrumentedStore(raw)
    t0 = time.perf_counter()
    engine = make_engine(shape, settings, store, prefix, f"demo-{role}")
    from ..sim import SimEngineCrash, SimHang

    reports: list[Any] = []
    crashes: list[str] = []
    hangs: list[str] = []
    with engine:
        for phase in _workload(shape, role):
            # The simulator dies the way TensorRT-LLM's executor does: on any exception out of a
            # connector call (a crash), or when a request never comes back (a hang). Counted, not hidden.
            try:
                reports.append(engine.run(phase))
            except SimEngineCrash as exc:
                crashes.append(str(exc))
                break
            except SimHang as exc:
                hangs.append(str(exc))
                break
            # Users think between turns; by then the previous turn's uploads are done.
            for w in engine.workers:
                w.flush(120)
        io_phases = store.snapshot()
        repeat = _repeat_inside(engine, store, shape, role) if not (crashes or hangs) else None
        contained = sum(engine.leader.errors.values()) + sum(sum(w.errors.values()) for w in engine.workers)
        wall = time.perf_counter() - t0
        geometry = engine.workers[0].core.geometry
        wstats = [w.core.stats() for w in engine.workers]
        lstats = engine.leader.core.stats
        ns_prefix = engine.leader.core.scheme.namespace_prefix
    io = io_phases
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
    names = _phase_names(shape, role)  # a crash or hang ends the run early: fewer reports than names
    phase_of = {r.request_id: name for rep, name in zip(reports, names, strict=False) for r in rep.requests}
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
        "saves_dropped": sum(s.saves_dropped for s in wstats),
        "load_failures": sum(s.loads_failed_objects for s in wstats),
        # Issue-12 invariants: what the engine would have suffered, and how failed loads ended.
        "engine_crashes": len(crashes),
        "hung_engines": len(hangs),
        "contained_errors": contained,
        "failed_load_rungs": {
            "engine_recompute": sum(r.recomputed_failed_load for r in (x for rep in reports for x in rep.requests)),
            "parked_retry": max((s.rung_parked_retry for s in wstats), default=0),
            "parked_recovered": max((s.parked_loads_recovered for s in wstats), default=0),
        },
        "promises_broken": lstats.promises_broken,
        "s3_requests": io.requests,
        "s3": {"head": io.head, "put": io.put, "get": io.get, "bytes_up": io.bytes_up, "bytes_down": io.bytes_down},
        "lookup_waves": lstats.lookup_waves,
        "host_tier": {
            "capacity_bytes": sum(s.host_capacity for s in wstats), "bytes": sum(s.host_used for s in wstats),
            "objects": sum(s.host_objects for s in wstats), "loads": sum(s.host_hits for s in wstats),
            "bytes_loaded": sum(s.host_hit_bytes for s in wstats),
            "kept_from_s3": sum(s.host_promoted for s in wstats), "evicted": sum(s.host_evicted for s in wstats),
        },
        "repeat": repeat,
        "time_s": round(wall, 3),
        "stored_bytes_by_group": by_group,
        "per_request": [
            {"id": r.request_id, "phase": phase_of[r.request_id], "prompt_tokens": r.prompt_tokens,
             "matched_tokens": r.matched_tokens, "latency_s": round(r.latency_s, 4)}
            for r in requests
        ],
    }


def _spawn(role: str, shape: DemoShape, forced: dict[str, Any], env: dict[str, str],
           said: Sequence[str] = ()) -> dict[str, Any]:
    """Run one cluster in a fresh process; its log lines reach our stderr as they happen, its
    failure comes back as one line (the child prints the traceback itself under --debug).

    ``said``: warnings already printed in this run; the cluster does not repeat them, and its own
    come back in the result's ``warned``. The cluster runs in a session of its own, so a Ctrl-C
    reaches only this process, which stops the cluster (and its helper processes) quietly."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    try:
        cmd = [*_python_here(), role, out, json.dumps(asdict(shape)), json.dumps(forced), json.dumps(list(said))]
        # stdout stays ours (--json prints one object there); the child's stderr is the user's.
        with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=_stderr_target(),
                              start_new_session=True) as proc:
            try:
                proc.wait(timeout=900)
            except BaseException:  # a Ctrl-C (or the timeout): the cluster goes with us, silently
                _stop_group(proc)
                raise
        try:
            with open(out) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            doc = None
        name = "A (cold)" if role == "A" else "B (warm)"
        if isinstance(doc, dict) and "error" in doc:
            raise click.ClickException(f"demo cluster {name} failed: {doc['error']}")
        if proc.returncode != 0 or not isinstance(doc, dict):
            raise click.ClickException(
                f"demo cluster {name} exited with code {proc.returncode} and no result (run `s3kv --debug demo`)"
            )
        return doc
    finally:
        os.unlink(out)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """End a cluster process and everything it started (its session): SIGTERM, then SIGKILL."""
    import signal

    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


#: A cluster process imports exactly the s3kv this process runs: ``-I`` keeps the working
#: directory (a clone's parent, any folder named ``s3kv``) and PYTHONPATH off its path, and the
#: parent's own ``sys.path`` arrives as the first argument (an editable or --user install stays
#: reachable). ``python -m s3kv.tools.demo`` would import ``./s3kv`` first.
_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv.pop(1)); from s3kv.tools.demo import _main; _main(sys.argv[1:])"


def _python_here() -> list[str]:
    """The command line that starts a cluster process (its arguments follow)."""
    return [sys.executable, "-I", "-c", _BOOT, json.dumps(sys.path)]


def _stderr_target() -> Any:
    """Our stderr when it is a real file (a terminal, a log file); else (a test runner's capture)
    None, which lets the child inherit the process's own fd 2."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return sys.stderr


def _hits(r: dict[str, Any]) -> str:
    """Served/prompt tokens per request, grouped by phase: ``turn 1 1056/1088 x4 | new users ...``."""
    phases: dict[str, list[str]] = {}
    for p in r["per_request"]:
        phases.setdefault(p.get("phase", ""), []).append(f"{p['matched_tokens']}/{p['prompt_tokens']}")
    out = []
    for name, hits in phases.items():
        counts = Counter(hits)
        out.append(f"{name} " + ", ".join(h if n == 1 else f"{h} x{n}" for h, n in counts.items()))
    return " | ".join(out)


def _why(phase: str, shape: DemoShape) -> str:
    """In plain words, why each kind of request gets the hit it gets."""
    if phase == "cold":
        return ("cluster A's hits are its own: each conversation's next turn loads the earlier turn, prompt "
                "and answer, that A saved; the simulated engine keeps no KV on the GPU between turns, as "
                "when a busy engine has evicted it")
    reuse = shape.system_len // shape.checkpoint_tokens * shape.checkpoint_tokens
    return (f"not every token, because a hit ends on a {shape.tokens_per_block}-token block before the prompt's "
            f"last token, which the engine always computes; turn {shape.turns_b} loads what turn "
            f"{shape.turns_b - 1} left, prompt and answer, and computes the new message; new users "
            f"share only the {shape.system_len}-token system prompt, and sliding-window layers keep their "
            f"tail only every {shape.checkpoint_tokens} tokens and where a prompt ends, so they load {reuse}")


def _engine_line(r: dict[str, Any]) -> str:
    rungs = r["failed_load_rungs"]
    failed = rungs["engine_recompute"] + rungs["parked_retry"]
    if not (r["engine_crashes"] or r["hung_engines"] or failed or r["contained_errors"]):
        return "engine: no crashes, no hangs, no failed loads, no errors inside s3kv's hooks"
    return (
        f"engine: {r['engine_crashes']} crashes, {r['hung_engines']} hangs; failed loads: "
        f"{rungs['engine_recompute']} recomputed by the engine, {rungs['parked_retry']} held and retried "
        f"({rungs['parked_recovered']} served after); {r['contained_errors']} errors caught inside s3kv's "
        "hooks (each would have stopped a real engine)"
    )


def _layers(name: str) -> str:
    """``group1:window256`` -> ``sliding-window layers (window 256)``; ``group0:full`` -> ``full-attention layers``."""
    kind = name.partition(":")[2]
    if kind.startswith("window"):
        return f"the sliding-window layers (window {kind[len('window'):]} tokens)"
    return "the full-attention layers"


def _store_word(url: str) -> str:
    """What the output calls the store: "S3" only for an S3 (or S3-compatible) bucket."""
    return "S3" if url.lower().startswith("s3://") else "the store"


def _table(res: dict[str, Any]) -> str:
    shape = DemoShape(**res["shape"]) if "shape" in res else DemoShape()
    store = _store_word(res.get("store_url", "s3://"))
    lines = []
    for phase in ("cold", "warm"):
        r = res[phase]
        lines.append(
            f"{phase} cluster {r['role']}: {r['requests']} requests; {r['matched_tokens']} of {r['prompt_tokens']} "
            f"prompt tokens served from {store} or host memory ({r['hit_rate']:.0%}), {r['computed_tokens']} computed; "
            f"kv_mismatches: {r['kv_mismatches']} ({r['pages_checked']} pages checked against recomputation)"
        )
        lines.append(f"  served/prompt tokens per request: {_hits(r)}")
        lines.append(f"  why: {_why(phase, shape)}")
        lines.append(
            f"  {'S3' if store == 'S3' else 'store'}: {r['s3_requests']} requests (HEAD {r['s3']['head']}, PUT {r['s3']['put']}, "
            f"GET {r['s3']['get']}), saved {r['bytes_saved'] / 2**20:.1f} MiB, "
            f"loaded {r['bytes_loaded'] / 2**20:.1f} MiB, {r['time_s']:.1f}s"
        )
        lines.append(f"  {_engine_line(r)}")
        lines.extend(_host_lines(r))
    lines.append("stored: " + ", ".join(
        f"{v['bytes'] / 2**20:.1f} MiB in {v['objects']} objects for {_layers(k)}"
        for k, v in sorted(res["warm"]["stored_bytes_by_group"].items())
    ))
    if res.get("user_settings"):
        lines.append("your settings, kept: " + ", ".join(f"{k} (from {v})" for k, v in res["user_settings"].items()))
    lines.append(f"store: {res['store_url']} ({res['store']})")
    if res.get("cleanup"):
        lines.append(res["cleanup"])
    lines.append("what the words mean (pages, hit rate, kv_mismatches ...): s3kv glossary (docs/glossary.md)")
    return "\n".join(lines)


def _repeat_inside(engine: Any, store: Any, shape: DemoShape, role: str) -> dict[str, Any] | None:
    """Cluster B's last turn, sent again inside B: served from B's host tier (what B saved, what
    it read from S3), with no S3 request for it. Reported on its own; the phases' figures stay."""
    from ..sim import repeat_workload

    if role != "B":
        return None
    specs = repeat_workload(_workload(shape, role)[-2], 20_000)  # the last turn (new users come after it)
    before = store.snapshot()
    rep = engine.run(specs)
    io = store.snapshot()
    return {
        "requests": len(rep.requests), "prompt_tokens": rep.prompt_tokens, "matched_tokens": rep.matched_tokens,
        "kv_mismatches": rep.kv_mismatches,
        "s3": {"head": io.head - before.head, "get": io.get - before.get, "put": io.put - before.put},
    }


def _host_lines(r: dict[str, Any]) -> list[str]:
    """The host tier's line (and, for cluster B, its repeat's) for the table."""
    h = r.get("host_tier")
    if not h or not h["capacity_bytes"]:
        return []
    out = [f"  host tier: {h['loads']} object loads from host memory ({h['bytes_loaded'] / 2**20:.1f} MiB, no S3 "
           f"request), {h['kept_from_s3']} objects kept from S3 reads; holds {h['objects']} objects, "
           f"{h['bytes'] / 2**20:.1f} of {h['capacity_bytes'] / 2**20:.0f} MiB"]
    rp = r.get("repeat")
    if rp:
        out.append(f"  repeat inside this cluster: its last turn sent again, {rp['matched_tokens']} of "
                   f"{rp['prompt_tokens']} prompt tokens served from host memory with S3 GET {rp['s3']['get']}, "
                   f"HEAD {rp['s3']['head']}; kv_mismatches: {rp['kv_mismatches']}")
    return out


def _check_settings(url: str, forced: dict[str, Any], shape: DemoShape) -> Any:
    """The user's settings (env, config file) with the demo's defaults where they chose nothing;
    ConfigError names what is wrong before any cluster starts."""
    from ..config import load_settings

    return load_settings(url=url, **demo_overrides(shape, forced))


def _check_access(url: str) -> None:
    """One clear line (no bucket, no credentials, dead endpoint) before any cluster starts."""
    from ..config import load_settings
    from ..engine.runtime import open_runtime_store
    from ..store.base import StoreError
    from .storeerrors import describe

    store, _ = open_runtime_store(load_settings(url=url))
    try:
        store.check_access()
    except StoreError as exc:
        raise click.ClickException(describe(exc, url, store, role="engine")) from exc
    finally:
        store.close()


def _delete_under(url: str) -> str:
    """Delete what the demo wrote under its own run prefix; one line saying how it went."""
    from ..config import load_settings
    from ..engine.runtime import open_runtime_store
    from ..store.base import StoreError

    store, prefix = open_runtime_store(load_settings(url=url))
    try:
        keys = [i.key for i in store.list(f"{prefix}/" if prefix else "")]
        for i in range(0, len(keys), 1000):
            store.delete_many(keys[i : i + 1000])
    except StoreError as exc:
        from .storeerrors import describe

        return (f"could not delete the demo's objects ({describe(exc, store=store)}); remove them later with: "
                f"s3kv gc --url {url} --older-than 0 --yes")
    finally:
        store.close()
    return f"deleted the demo's {len(keys)} objects under {url} (--keep keeps them)"


@click.command("demo")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--url", default=None,
              help="Use this store (s3://bucket/prefix, file:///dir) instead of an embedded S3 server "
              "(default: the S3KV_URL setting). Each run writes under a sub-prefix of its own, demo-<time>-<random>, "
              "printed at the end, so cluster A starts cold; it is deleted afterwards unless --keep.")
@click.option("--server", type=click.Choice(["auto", "moto", "seaweedfs"]), default="auto", show_default=True,
              help="Embedded S3 server when no --url / S3KV_URL is given.")
@click.option("--tp", type=click.IntRange(min=1, max=8), default=1, show_default=True,
              help="Tensor-parallel shards per cluster.")
@click.option("--keep", is_flag=True,
              help="Keep what the demo wrote: the embedded server keeps running until Ctrl-C (its "
              "environment is printed), or the objects under --url are not deleted.")
@click.option("--s3-latency-ms", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Delay every S3 request by this much (s3kv's fault proxy in front of the embedded "
              "server, or of an http:// AWS_ENDPOINT_URL_S3), as a store in your region would.")
def demo_command(as_json: bool, url: str | None, server: str, tp: int, keep: bool, s3_latency_ms: float) -> None:
    """Cold cluster A, then warm cluster B, sharing only the bucket.

    Terms in its output (pages, kv_mismatches ...): s3kv glossary.
    """
    import signal
    import threading

    run = _Interrupted(keep=keep)
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, run.on_signal) if main else None
    try:
        _demo(run, as_json, url, server, tp, keep, s3_latency_ms)
    except KeyboardInterrupt:
        click.echo(run.line(), err=True)
        raise SystemExit(130) from None
    finally:
        if main:
            signal.signal(signal.SIGINT, old)


@dataclass
class _Interrupted:
    """What a Ctrl-C leaves behind, said in one line: the clusters and servers are stopped by the
    code it unwinds through, and a second Ctrl-C cannot cut that short (it is ignored)."""

    keep: bool
    #: The run's own prefix on the user's store, once objects may be there.
    run_url: str = ""

    def on_signal(self, signum: int, frame: object) -> None:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def line(self) -> str:
        if not self.run_url:
            return "s3kv demo: interrupted"
        if self.keep:
            return f"s3kv demo: interrupted; what it wrote is kept under {self.run_url}"
        return (f"s3kv demo: interrupted; what it wrote stays under {self.run_url}; remove it with: "
                f"s3kv gc --url {self.run_url} --older-than 0 --yes")


def _demo(run: _Interrupted, as_json: bool, url: str | None, server: str, tp: int, keep: bool,
          s3_latency_ms: float) -> None:
    from ..config import (
        ConfigError,
        explicit_settings,
        load_settings,
        redact,
        redact_url,
        unknown_env_names,
        warnings_said,
    )
    from .options import debug_enabled, export_lines, url_option, wait_for_interrupt

    shape = DemoShape(tp_size=tp)
    forced: dict[str, Any] = {}
    url = url_option(url)
    try:
        url = url or load_settings(require_url=False).url or None
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if url and url.strip().lower().startswith("memory://"):
        raise click.UsageError(
            f"{url} is a store inside one process, and the demo's two clusters are separate "
            "processes: they could not share it. Use file:///tmp/s3kv-demo, an s3:// bucket, "
            "or no URL (an embedded S3 server)."
        )
    # The clusters read the same env; variables s3kv does not know were already warned about.
    unknown = set(unknown_env_names())
    env = {k: v for k, v in os.environ.items() if k not in unknown}
    env["S3KV_LOG_LEVEL"] = logging.getLevelName(logging.getLogger("s3kv").getEffectiveLevel())
    if debug_enabled(click.get_current_context(silent=True)):
        env["S3KV_DEBUG"] = "1"
    # The simulated model has no weights to fingerprint: name it, so the engines do not warn that
    # its identity is weak (a real deployment's warning, not the demo's).
    env.setdefault("S3KV_MODEL_ID", "s3kv-demo/gemma3-like")
    if not url and not keep and not any(k in env for k in ("S3KV_INTEGRITY_KEY", "S3KV_INTEGRITY_KEY_FILE")):
        # The embedded server lives and dies with this command: sign its objects with a key of the
        # run's own (what production should do, docs/security.md) instead of warning that none is set.
        env["S3KV_INTEGRITY_KEY"] = secrets.token_hex(32)
    emb = proxy = None
    if url:
        # The second plus a random part: two demos started in the same second on one bucket must
        # not read each other's objects (cluster A would no longer start cold).
        run_url = url.strip().rstrip("/") + f"/demo-{int(time.time())}-{secrets.token_hex(3)}"
        try:
            _check_settings(run_url, forced, shape)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from exc
        env["S3KV_URL"] = run_url
        where = "your store"
        if s3_latency_ms:
            endpoint = env.get("AWS_ENDPOINT_URL_S3", "") if url.strip().lower().startswith("s3://") else ""
            proxy = _latency_proxy(endpoint, s3_latency_ms, f"{url}'s endpoint (AWS_ENDPOINT_URL_S3)")
            env["AWS_ENDPOINT_URL_S3"] = proxy.endpoint_url
        _check_access(run_url)
    else:
        try:  # the user's other settings must be valid before a server starts
            _check_settings("s3://s3kv-demo/demo", forced, shape)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from exc
        from ..store.embedded import EmbeddedS3

        emb = EmbeddedS3(kind=server, bucket="s3kv-demo", prefix="demo").start()  # type: ignore[arg-type]
        env.update(emb.env())
        run_url = emb.url
        where = f"embedded {emb.kind} S3 server at {emb.endpoint_url}"
        if s3_latency_ms:
            proxy = _latency_proxy(emb.endpoint_url, s3_latency_ms, "the embedded server")
            env["AWS_ENDPOINT_URL_S3"] = proxy.endpoint_url
    if proxy is not None:
        where += f", {s3_latency_ms:g} ms added to every request (fault proxy at {proxy.endpoint_url})"
    try:
        _progress(f"demo: cluster A (cold), then cluster B (warm), on {run_url} ({where})")
        if url:
            run.run_url = run_url
        said = warnings_said()
        cold = _spawn("A", shape, forced, env, said)
        said += cold.pop("warned", [])
        _progress("demo: cluster A done; starting cluster B")
        warm = _spawn("B", shape, forced, env, said)
        warm.pop("warned", None)
        cleanup = None
        if url and not keep:
            cleanup = _delete_under(run_url)
        elif url:
            cleanup = f"kept; look with: s3kv ls --url {run_url}"
        elif emb is not None and not keep:
            # Its address is gone once this command returns: do not print it as where to look.
            where = (f"embedded {emb.kind} S3 server, stopped now with the demo's objects; "
                     "s3kv demo --keep keeps it running to look inside with s3kv ls, stats, verify")
            if proxy is not None:
                where += f"; {s3_latency_ms:g} ms added to every request (fault proxy, stopped too)"
        chosen = {k: v for k, v in explicit_settings().items() if k in demo_defaults(shape) and k not in forced}
        res = {"cold": cold, "warm": warm, "store": where, "store_url": redact_url(run_url), "shape": asdict(shape),
               "user_settings": chosen, "cleanup": redact(cleanup) if cleanup else cleanup}
        if as_json:
            click.echo(json.dumps(res, indent=2))
        else:
            click.echo(_table(res))
        if emb is not None and keep:
            out = (lambda m: click.echo(m, err=True)) if as_json else click.echo
            out(f"\nThe {emb.kind} server keeps running with the demo's objects. In another shell:")
            for line in export_lines(emb.env()):
                out(f"  {line}")
            out("  s3kv ls")
            out("Press Ctrl-C to stop it.")
            wait_for_interrupt()
    finally:
        if proxy is not None:
            proxy.stop()
        if emb is not None:
            emb.stop()


def _latency_proxy(endpoint_url: str, latency_ms: float, what: str) -> Any:
    """s3kv's fault proxy in front of ``endpoint_url``, adding ``latency_ms`` to every request."""
    from ..store.faultproxy import FaultProxy, WireFaultPlan

    try:
        return FaultProxy.for_url(endpoint_url, WireFaultPlan(latency_s=latency_ms / 1000.0)).start()
    except ValueError:
        raise click.ClickException(
            f"--s3-latency-ms needs an S3 store on an http://host:port endpoint to put its proxy in front of; "
            f"{what} is {endpoint_url or 'none'!r} (leave out --url to use the embedded server)"
        ) from None


def _progress(message: str) -> None:
    from ..config import redact

    click.echo(redact(message), err=True)


def _main(argv: Sequence[str]) -> None:
    """A demo cluster process: writes its result (or its one-line error) as JSON to ``out``."""
    role, out, shape_json, forced_json, *said_json = argv  # said: warnings the run printed already
    from ..config import mark_said, warnings_said
    from .logs import configure_logging
    from .options import debug_enabled, one_line

    configure_logging(os.environ.get("S3KV_LOG_LEVEL", "WARNING"), fmt="text")
    mark_said(json.loads(said_json[0]) if said_json else [])
    code = 1
    try:
        try:
            result = run_cluster(role, DemoShape(**json.loads(shape_json)), json.loads(forced_json))
            result["warned"] = warnings_said()
        except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
            if debug_enabled():
                traceback.print_exc()
            result = {"error": one_line(exc)}
        with open(out, "w") as f:
            json.dump(result, f)
        code = 1 if "error" in result else 0
    finally:
        # Leave without the interpreter's teardown, as `s3kv`'s store commands do (cli.run says
        # why): native client threads still alive there now and then abort it. A CI run saw
        # cluster B end in SIGABRT ("terminate called without an active exception"; whether before
        # or after its result was written is not known). The parent reads only the file and our code.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _main(sys.argv[1:])
