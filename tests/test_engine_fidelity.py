"""Issue 12: s3kv driven in TensorRT-LLM's real executor order (s3kv.sim.SimEngine) -- the cases
that broke on the real engine, and connectors deliberately broken the same way to show each test
can fail.

The real loop calls ``request_finished`` and then ``get_finished`` in the same iteration and frees
a finished request's pages as soon as every rank returns its id; an idle engine calls nothing at
all; any exception out of a connector call kills it. See docs/failures.md.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest

from s3kv.config import Settings
from s3kv.sim import (
    EXECUTOR_LOOPS,
    SimCacheConfig,
    SimEngine,
    SimEngineCrash,
    SimRequestSpec,
    gemma3_like,
    random_tokens,
)
from s3kv.store.memory import MemoryStore
from s3kv.trtllm import S3KvConnectorLeader, S3KvConnectorWorker

TPB = 16
WINDOW = 64
_keys = itertools.count()


class CopiesAfterFreeWorker(S3KvConnectorWorker):
    """The bug the issue found: a finishing request's last pages are copied one iteration late --
    after its id was returned and the engine freed (and reused) its pages."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._late: list[int] = []

    def bind_connector_meta(self, metadata):
        super().bind_connector_meta(metadata)
        late, self._late = self._late, []
        with self.core._lock:
            for rid in late:
                self.core._finish_request(rid)

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        self._late += list(finished_gen_req_ids)
        saved, loaded = super().get_finished([], started_loading_req_ids)
        return saved + list(finished_gen_req_ids), loaded


class RaisingWorker(S3KvConnectorWorker):
    """An exception out of get_finished: the real executor dies on it."""

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        if finished_gen_req_ids:
            raise RuntimeError("boom")
        return super().get_finished(finished_gen_req_ids, started_loading_req_ids)


def engine(store, *, worker=S3KvConnectorWorker, tp=1, honour=None, hook=False, max_batch=4, loop="non-overlap",
           **settings):
    s = Settings(url="memory://unused", staging_mib=64, check_access=False, blocks_per_object=4, lookup_timeout_s=5.0,
                 checkpoint_tokens=8 * TPB, **settings)
    return SimEngine(
        gemma3_like(WINDOW, num_layers=6, kv_heads=2 * tp, head_dim=8),
        SimCacheConfig(tokens_per_block=TPB, max_seq_len=4096),
        S3KvConnectorLeader,
        worker,
        tp_size=tp,
        chunk_size=48,
        max_batch=max_batch,
        honour=honour,
        failed_load_hook=hook,
        connector_kwargs=dict(settings=s, store=store, engine_key=f"fidelity-{next(_keys)}"),
        **EXECUTOR_LOOPS[loop],
    )


def flushed(eng):
    for w in eng.workers:
        assert w.flush(30)


def prompt(n, seed):
    import random

    return tuple(random_tokens(random.Random(seed), n, 32000))


def history_blocks(spec, rep):
    """Whole blocks of a finished request's history that have KV (the last token has none)."""
    return (len(spec.prompt) + len(rep.by_id(spec.request_id).output_tokens) - 1) // TPB


# ----------------------------------------------------------------------------- finishing requests


def finish_while_another_decodes(store, worker, tp=1, loop="non-overlap", new_tokens=70, stop_after=None):
    """A finishes (history many windows long) while B keeps decoding; then A's next turn."""
    a = SimRequestSpec(1, prompt(215, 1), max_new_tokens=new_tokens, stop_after=stop_after)
    b = SimRequestSpec(2, prompt(150, 2), max_new_tokens=260)
    with engine(store, worker=worker, tp=tp, loop=loop) as eng:
        rep = eng.run([a, b])
        flushed(eng)
    assert rep.by_id(1).finished_iteration < rep.by_id(2).finished_iteration  # A ended first
    turn2 = SimRequestSpec(3, a.prompt + rep.by_id(1).output_tokens + prompt(40, 3), max_new_tokens=4)
    with engine(store, tp=tp) as eng2:
        rep2 = eng2.run([turn2])
    return rep, rep2, history_blocks(a, rep)


# 215 + 121 = 336 tokens: h = 335, (h + 1) % TPB == 0 -- the engine frees the block that just left
# the window after request_finished, and no checkpoint tail holds it (the overlap loop's case).
@pytest.mark.parametrize("new_tokens", [70, 121])
@pytest.mark.parametrize("loop", ["non-overlap", "overlap", "overlap+graphs"])
@pytest.mark.parametrize("tp", [1, 2])
def test_request_finishing_while_another_decodes_then_next_turn_past_the_window(tp, loop, new_tokens):
    rep, rep2, hist = finish_while_another_decodes(MemoryStore(), S3KvConnectorWorker, tp, loop, new_tokens)
    assert rep.kv_mismatches == 0 and rep2.kv_mismatches == 0
    assert hist * TPB >= 4 * WINDOW  # the history is several windows long
    assert rep2.requests[0].matched_tokens == hist * TPB  # the whole history is served


@pytest.mark.parametrize("loop", ["non-overlap", "overlap"])
def test_a_history_ending_on_a_block_boundary(loop):
    """215 + 106 = 321 tokens: the last KV position (319) completes a block. The non-overlap loop
    reports its token before the forward that writes it; the overlap loop's host learns it only at
    request_finished, after the last metadata -- that block is not stored (one block less served,
    never a wrong byte)."""
    rep, rep2, hist = finish_while_another_decodes(MemoryStore(), S3KvConnectorWorker, 1, loop, 106)
    assert rep.kv_mismatches == 0 and rep2.kv_mismatches == 0
    lost = 1 if loop == "overlap" else 0
    assert rep2.requests[0].matched_tokens == (hist - lost) * TPB


@pytest.mark.parametrize("loop", ["non-overlap", "overlap"])
def test_a_request_ending_on_a_stop_token(loop):
    """The same history ended by a stop token: the overlap loop cannot foresee it and runs one extra
    forward (its token dropped), whose report brings the last block's token -- the whole history."""
    rep, rep2, hist = finish_while_another_decodes(MemoryStore(), S3KvConnectorWorker, 1, loop, 200, 106)
    assert rep.kv_mismatches == 0 and rep2.kv_mismatches == 0
    assert len(rep.by_id(1).output_tokens) == 106
    assert rep2.requests[0].matched_tokens == hist * TPB


def test_copies_after_free_is_caught():
    _, rep2, hist = finish_while_another_decodes(MemoryStore(), CopiesAfterFreeWorker)
    assert rep2.kv_mismatches > 0  # the next turn loaded the junk (or another request's KV)


@pytest.mark.parametrize("loop", ["non-overlap", "overlap"])
@pytest.mark.parametrize("worker", [S3KvConnectorWorker, CopiesAfterFreeWorker], ids=["s3kv", "late-copy"])
def test_engine_idle_right_after_a_finish(worker, loop):
    """The last request finishes and the engine goes idle (no metadata, no hook at all): the final
    sliding tail is still saved, staging is released, and the next turn hits the whole history."""
    store = MemoryStore()
    a = SimRequestSpec(1, prompt(215, 4), max_new_tokens=70)  # history ends off a checkpoint
    with engine(store, worker=worker, loop=loop) as eng:
        rep = eng.run([a])
        assert rep.held_while_idle == ()  # CPU copies are done in get_finished: nothing held
        flushed(eng)
        staging = [w.core.stats().staging_in_use for w in eng.workers]
    turn2 = SimRequestSpec(2, a.prompt + rep.by_id(1).output_tokens + prompt(30, 5), max_new_tokens=4)
    with engine(store) as eng2:
        rep2 = eng2.run([turn2])
    assert rep2.kv_mismatches == 0
    full = history_blocks(a, rep) * TPB
    if worker is S3KvConnectorWorker:
        assert staging == [0] * len(staging)
        assert rep2.requests[0].matched_tokens == full
    else:  # the tail waits for a metadata an idle engine never builds
        assert rep2.requests[0].matched_tokens < full


def test_an_exception_from_get_finished_is_an_engine_crash():
    with engine(MemoryStore(), worker=RaisingWorker) as eng, pytest.raises(SimEngineCrash, match="get_finished"):
        eng.run([SimRequestSpec(1, prompt(100, 6), max_new_tokens=20)])


def test_the_adapter_contains_core_errors():
    """A fault inside s3kv's cores reaches no engine: the hook degrades (here, a miss and a dropped
    save) and counts it."""
    store = MemoryStore()
    with engine(store) as eng:
        def boom(*a, **k):
            raise RuntimeError("injected")

        eng.leader.core.get_num_new_matched_tokens = boom
        eng.leader.core.build_connector_meta = boom
        for w in eng.workers:
            w.core.get_finished = boom
            w.core.wait_for_save = boom
        rep = eng.run([SimRequestSpec(1, prompt(100, 7), max_new_tokens=5)])
        assert rep.kv_mismatches == 0
        assert eng.leader.errors["build_connector_meta"] > 0 and eng.workers[0].errors["get_finished"] > 0


# ----------------------------------------------------------------------------- smaller honours


def _boundaries(policy, hook):
    """Store a 20-block prompt; then, per block boundary k of the offer, an engine that honours only k
    blocks (async). Returns (served by a correct smaller load, needed a failure rung)."""
    store = MemoryStore()
    p = prompt(20 * TPB + 5, 8)
    with engine(store, storage_policy=policy) as cold:
        cold.run([SimRequestSpec(1, p, max_new_tokens=2)])
        flushed(cold)
    served, rung = [], []
    for k in range(0, 21):
        with engine(store, storage_policy=policy, honour=lambda offer, k=k: min(offer, k * TPB), hook=hook) as eng:
            # On the merged line a broken promise parks the request until its client gives up; the
            # cancel lands in a pass that queues a batch (py_executor @0004396), so another request
            # keeps batches coming meanwhile.
            spec = SimRequestSpec(100 + k, p, max_new_tokens=2, cancel_after_iterations=None if hook else 40)
            busy = [] if hook else [SimRequestSpec(200 + k, prompt(2 * TPB, 9), max_new_tokens=50)]
            rep = eng.run([spec, *busy])
        r = rep.by_id(100 + k)
        assert rep.kv_mismatches == 0, (policy, k)
        if r.recomputed_failed_load or r.cancelled:
            rung.append(k)
        else:
            assert r.matched_tokens == min(r.offered_tokens, k * TPB)
            served.append(k)
    return served, rung


@pytest.mark.parametrize("hook", [False, True], ids=["merged-line", "failed-load-hook"])
def test_honour_less_at_every_block_boundary(hook, capsys):
    """Every honour (0 included, async) is either a correct smaller load or the failure rung -- never an
    error, never a wrong byte. Store-everything serves every boundary; the window policy serves the
    boundaries a sliding tail ends at (checkpoints, the prompt end) and 0."""
    served_all, rung_all = _boundaries("all", hook)
    assert rung_all == [] and served_all == list(range(21))
    served, rung = _boundaries("window", hook)
    assert {0, 8, 16, 20} <= set(served) and sorted(served + rung) == list(range(21))
    with capsys.disabled():
        print(f"\n[honour boundaries, {'hook' if hook else 'merged line'}] window policy: "
              f"{len(served)}/21 served by a smaller load, {len(rung)} took the rung {rung}; "
              f"store-everything: 21/21 served")


# ----------------------------------------------------------------------------- process exit


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from s3kv.config import Settings
    from s3kv.core.plan import BufferId, ConnectorMetadata, SealOp, StageOp
    from s3kv.store.base import StoreWrapper
    from s3kv.store.fsspec_store import FsspecStore
    from s3kv.sim.layouts import GroupSpec, make_layout
    from s3kv.engine.worker import WorkerCore

    class Slow(StoreWrapper):
        def put(self, key, data, metadata=None):
            time.sleep(0.3)
            return super().put(key, data, metadata)

    root, drain_s = sys.argv[1], float(sys.argv[2])
    store = Slow(FsspecStore("file://" + root))
    core = WorkerCore(Settings(staging_mib=8, upload_threads=1, exit_drain_s=drain_s), store, "kv", 0, 1,
                      model_id="m", kv_dtype="bf16")
    core.register_layout(make_layout([GroupSpec((0,), None, (256,))], num_slots=16, tokens_per_block=16))
    core.install_exit_drain(drain_s)
    stages, seals = [], []
    for i in range(6):
        bid = BufferId(1, 0, i, 1)
        stages.append(StageOp(bid, i, i))
        seals.append(SealOp(bid, 1, bytes([i]) * 16))
    core.bind(ConnectorMetadata(stages=tuple(stages), seals=tuple(seals)))
    core.wait_for_save(None)
    print("queued", core.stats().uploads_pending, flush=True)
    if len(sys.argv) > 3:  # a child forked now exits normally (its atexit handlers run)
        import os
        t = time.monotonic()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        print("child exited in", round(time.monotonic() - t, 2), flush=True)
    # No close(), no shutdown(): TensorRT-LLM calls neither.
    """
)


@pytest.mark.parametrize("drain_s,expect_all", [(10.0, True), (0.2, False)])
def test_uploads_in_flight_at_process_exit_are_drained_within_a_bound(tmp_path, drain_s, expect_all):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    root = tmp_path / "bucket"
    root.mkdir()
    out = subprocess.run([sys.executable, str(script), str(root), str(drain_s)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "queued" in out.stdout
    written = [p for p in root.rglob("*") if p.is_file()]
    if expect_all:
        assert len(written) == 6
    else:
        assert len(written) < 6 and "dropped" in out.stderr


def test_a_forked_child_exiting_does_not_drain_the_engines_uploads(tmp_path):
    """The drain is the engine's: a child it forks holds copies of the queued uploads but none of
    the threads that send them, so draining there would only wait out the whole bound."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    root = tmp_path / "bucket"
    root.mkdir()
    out = subprocess.run([sys.executable, str(script), str(root), "20", "fork"], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    took = float(out.stdout.split("child exited in")[1])
    assert took < 5.0, f"the forked child waited {took}s at exit"
    assert len([p for p in root.rglob("*") if p.is_file()]) == 6  # the engine still drained them all
    assert "dropped" not in out.stderr


# ----------------------------------------------------------------------------- bring-up


def _args(**kw):
    import dataclasses as dc

    from s3kv.sim import SimCacheConfig, make_llm_args

    a = make_llm_args(gemma3_like(WINDOW, num_layers=6, kv_heads=2, head_dim=8),
                      SimCacheConfig(tokens_per_block=TPB, max_seq_len=4096), 1, 0)
    return dc.replace(a, **kw)


@pytest.mark.parametrize("cls", [S3KvConnectorLeader, S3KvConnectorWorker])
def test_the_overlap_scheduler_is_served(cls):
    """TensorRT-LLM's default loop: accepted at bring-up, and the class flag newer lines check says so."""
    s = Settings(url="memory://unused", check_access=False)
    side = cls(_args(disable_overlap_scheduler=False), settings=s, store=MemoryStore(),
               engine_key=f"bringup-{next(_keys)}")
    assert cls.requires_disable_overlap_scheduler is False
    side.shutdown()


@pytest.mark.parametrize("cls", [S3KvConnectorLeader, S3KvConnectorWorker])
def test_attention_dp_is_refused_at_bring_up(cls):
    """The owners' batch-size allgather can skip a pass after its metadata is bound (not modelled):
    refused with one message, and the class flag says so."""
    from s3kv.trtllm import UnsupportedEngine

    s = Settings(url="memory://unused", check_access=False)
    with pytest.raises(UnsupportedEngine, match="attention data parallelism"):
        cls(_args(enable_attention_dp=True), settings=s, store=MemoryStore(), engine_key=f"bringup-{next(_keys)}")
    assert cls.supports_attention_dp is False


def test_bring_up_refuses_a_layout_without_the_page_api():
    from types import SimpleNamespace

    from s3kv.trtllm import UnsupportedEngine

    s = Settings(url="memory://unused", check_access=False)
    w = S3KvConnectorWorker(_args(), settings=s, store=MemoryStore(), engine_key=f"bringup-{next(_keys)}")
    region = SimpleNamespace(base=0, size=64, stride=64, num_slots=4, buffers=())  # no slot_tensor/as_tensor
    group = SimpleNamespace(layer_group_id=0, layer_ids=(0,), window_size=None, regions=(region,))
    with pytest.raises(UnsupportedEngine, match="slot_tensor"):
        w.register_kv_cache_layout(SimpleNamespace(tokens_per_block=TPB, groups=(group,)))
    group2 = SimpleNamespace(layer_group_id=0, layer_ids=(0,), window_size=None, regions=(),
                             replicated_regions=(region,))
    with pytest.raises(UnsupportedEngine, match="replicated"):
        w.register_kv_cache_layout(SimpleNamespace(tokens_per_block=TPB, groups=(group2,)))


def test_per_group_page_lists_as_a_dict_are_accepted():
    """One V2 branch passes per-group page lists as a dict keyed by group id."""
    from s3kv.engine.leader.requests import group_lists as _group_lists

    assert _group_lists({1: [5, 6], 0: [-1, 3]}, 2) == [[-1, 3], [5, 6]]
    assert _group_lists([[1], [2]], 2) == [[1], [2]]
    assert _group_lists(None, 2) == []
