"""Overlap loop on the KVCacheManagerV2 line: a request cancelled while in the batch just queued is
freed at once, and the next pass's ``_send_kv_async`` (previous batch) still finds it finished and
calls ``request_finished_by_layer_group`` with one empty list per group (connectors/
kv_cache_connector.py @035ab91, ``KvCacheConnectorManager.request_finished``: "a request whose
cache was already released still reaches the form the connector implements")."""

from __future__ import annotations

import random

from sim_connectors import RecordingLeader, RecordingWorker

from s3kv.sim import FULL_ATTENTION, SimCacheConfig, SimEngine, SimModel, SimRequestSpec, random_tokens

TWO_GROUPS = SimModel(num_layers=4, kv_heads=2, head_dim=8, max_attention_window=(64, FULL_ATTENTION))
CFG32 = SimCacheConfig(tokens_per_block=32, max_seq_len=1024)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(random_tokens(random.Random(seed), n, 32000))


def _run(overlap: bool) -> list:
    log: list = []
    eng = SimEngine(TWO_GROUPS, CFG32, RecordingLeader, RecordingWorker, overlap=overlap,
                    connector_kwargs={"log": log})
    rep = eng.run([
        SimRequestSpec(1, _prompt(64, 1), max_new_tokens=40, cancel_after_iterations=3),
        SimRequestSpec(2, _prompt(64, 2), max_new_tokens=40),
    ])
    assert {r.request_id: r.cancelled for r in rep.requests} == {1: True, 2: False}
    return log


def test_overlap_v2_cancelled_in_batch_gets_request_finished_with_empty_lists():
    finished = [e for e in _run(overlap=True) if e[0] == "finished"]
    assert ("finished", 1, [[], []]) in finished
    assert [e for e in finished if e[1] == 1] == [("finished", 1, [[], []])]


def test_non_overlap_cancel_stays_silent():
    finished = [e for e in _run(overlap=False) if e[0] == "finished"]
    assert [e for e in finished if e[1] == 1] == []
