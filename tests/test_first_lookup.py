"""No cold start (issue 30): what a fresh engine's first lookup used to pay once is paid at layout
registration, so that lookup hits within its budget.

* a fresh engine process (moto, this host's cores, default settings) hits a stored 3k-token
  prefix on its very first lookup;
* the warm-up itself: every HEAD path the client has (one key, a small wave, a wave for each
  helper), the helpers started and waited for, never an exception, before the first lookup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from s3kv.config import Settings
from s3kv.engine.index import KeyIndex
from s3kv.engine.runtime import EngineRuntime
from s3kv.store.base import HeadBatch, StoreError, StoreWrapper
from s3kv.store.headprocs import MIN_SHARE
from s3kv.store.memory import MemoryStore

ENGINE = r"""
import json, random, sys
from s3kv.config import load_settings
from s3kv.sim import SimCacheConfig, SimEngine, gemma3_like, random_tokens
from s3kv.sim.request import SimRequestSpec
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

prompt = tuple(random_tokens(random.Random(5), 3000, 32000))
engine = SimEngine(gemma3_like(256, num_layers=6, kv_heads=2, head_dim=32),
                   SimCacheConfig(tokens_per_block=32, max_seq_len=8192),
                   S3KvConnectorLeader, S3KvConnectorWorker, chunk_size=512, max_batch=4,
                   connector_kwargs=dict(settings=load_settings(), engine_key="first-lookup"))
with engine:
    rep = engine.run([SimRequestSpec(1, prompt, 8)])
    for w in engine.workers:
        w.flush(60)
    first = engine.leader.core.stats.recent_lookups[0]
    print(json.dumps({"matched": rep.requests[0].matched_tokens, "decision": first.decision,
                      "stall_ms": first.stall_s * 1e3, "budget_ms": first.budget_s * 1e3,
                      "kv_mismatches": rep.kv_mismatches}))
"""


def _fresh_engine(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", ENGINE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_fresh_engine_process_hits_a_stored_3k_prefix_on_its_first_lookup(moto_s3):
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}
    env.update(moto_s3.env(f"first-lookup-{uuid.uuid4().hex[:8]}"))
    cold = _fresh_engine(env)  # stores the prompt (nothing to hit yet)
    assert cold["matched"] == 0
    warm = _fresh_engine(env)  # a new process, a new engine: its first lookup
    assert warm["decision"] == "hit", warm
    assert warm["matched"] == 2976 and warm["kv_mismatches"] == 0
    assert warm["stall_ms"] < warm["budget_ms"]


class Recorder(StoreWrapper):
    """Counts HEAD waves by size; ``helpers`` stands in for the HEAD helper processes."""

    def __init__(self, inner, helpers=None, fail=False):
        super().__init__(inner)
        self.waves: list[int] = []
        self.head_helpers = helpers
        self.fail = fail

    def head_many(self, keys) -> HeadBatch:
        self.waves.append(len(keys))
        if self.fail:
            raise StoreError("down")
        return super().head_many(keys)


class FakeHelpers:
    def __init__(self, ready: int):
        self.ready, self.waited = ready, []

    def wait_ready(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return True

    def ready_count(self) -> int:
        return self.ready


def _runtime(store, **settings) -> EngineRuntime:
    return EngineRuntime("k", Settings(**settings), store, "pfx", KeyIndex(10, 60.0, 2.0))


def test_registration_warms_every_head_path_before_the_first_lookup():
    helpers = FakeHelpers(ready=3)
    store = Recorder(MemoryStore(), helpers)
    rt = _runtime(store)
    seen: list[list[int]] = []
    rt.on_geometry(lambda: seen.append(list(store.waves)))  # what the leader starts from
    rt.geometry_ready()
    # One key (the plain path), a small wave (the event loop), a share for each helper.
    assert store.waves == [1, 2, 3 * MIN_SHARE]
    assert seen == [store.waves]  # done before anything waiting for the layout runs
    assert helpers.waited == [10.0]
    assert rt.warm_up_s is not None and rt.metrics.value("s3kv_warm_up_seconds") == rt.warm_up_s
    rt.geometry_ready()  # once per engine
    assert len(store.waves) == 3


def test_warm_up_never_raises_and_can_be_turned_off():
    down = Recorder(MemoryStore(), fail=True)
    rt = _runtime(down)
    rt.geometry_ready()
    assert down.waves == [1] and rt.warm_up_s is not None
    off = Recorder(MemoryStore())
    rt = _runtime(off, warm_up_s=0)
    rt.geometry_ready()
    assert off.waves == [] and rt.warm_up_s is None
