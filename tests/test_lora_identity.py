"""A LoRA request's KV is keyed by its adapter's identity, never by TensorRT-LLM's integer id.

The attack (issue #29.1): two clusters number their adapters freely, so cluster A's adapter 7
and cluster B's adapter 7 are different weights under one ``lora_task_id``. Keyed by the id,
B was served A's pages (52/52 wrong). The simulator's KV depends on the adapter's weights (the
files at ``py_lora_path``), so its checker sees every such page.
"""

from __future__ import annotations

import logging
import os
import shutil
from types import SimpleNamespace

import pytest
from test_connector_sim import make_engine, run

from s3kv.sim import SimRequestSpec, gemma3_like, random_tokens
from s3kv.store.memory import MemoryStore
from s3kv.trtllm.lora import CHANGED, ID_CONFLICT, NO_PATH, UNREADABLE, AdapterIdentities

PROMPT_LEN = 160


def adapter(d, weights: bytes, config: str = '{"r": 8, "lora_alpha": 16}') -> str:
    os.makedirs(d)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write(config)
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return str(d)


def prompts(n: int, seed: int = 5) -> list[tuple[int, ...]]:
    import random

    rng = random.Random(seed)
    return [tuple(random_tokens(rng, PROMPT_LEN, 32000)) for _ in range(n)]


def specs(first_id: int, path: str | None, task: int | None = 7, n: int = 2) -> list[SimRequestSpec]:
    return [
        SimRequestSpec(first_id + i, p, lora_task_id=task, lora_path=path) for i, p in enumerate(prompts(n))
    ]


@pytest.mark.parametrize("tp", [1, 2])
def test_one_lora_id_on_two_clusters_never_shares_kv(tmp_path, tp):
    """Cluster A's adapter 7 and cluster B's adapter 7 are different weights: 0 pages served across
    them, 0 wrong pages. The same adapter under another path and id on cluster C: hits."""
    store = MemoryStore()
    a = adapter(tmp_path / "a" / "support-bot", b"cluster A's weights")
    b = adapter(tmp_path / "b" / "support-bot", b"cluster B's weights")
    c = str(tmp_path / "c" / "another-name")
    shutil.copytree(a, c)  # A's adapter, copied to cluster C under another path

    cold = run(make_engine(store, gemma3_like(64), tp=tp), specs(1, a))
    assert cold.kv_mismatches == 0 and cold.matched_tokens == 0
    other = run(make_engine(store, gemma3_like(64), tp=tp), specs(11, b))
    assert other.kv_mismatches == 0
    assert other.matched_tokens == 0 and other.pages_checked == 0
    same = run(make_engine(store, gemma3_like(64), tp=tp), specs(21, c, task=3))
    assert same.kv_mismatches == 0
    assert same.matched_tokens == 2 * (PROMPT_LEN - 16)  # every full block but the last token's


def test_lora_and_base_requests_never_share_kv(tmp_path):
    store = MemoryStore()
    a = adapter(tmp_path / "a", b"weights")
    run(make_engine(store, gemma3_like(64)), specs(1, None, task=None))
    rep = run(make_engine(store, gemma3_like(64)), specs(11, a))
    assert rep.matched_tokens == 0 and rep.kv_mismatches == 0
    rep = run(make_engine(store, gemma3_like(64)), specs(21, None, task=None))
    assert rep.matched_tokens > 0 and rep.kv_mismatches == 0


def test_an_unreadable_adapter_is_neither_served_nor_saved(tmp_path, caplog):
    store = MemoryStore()
    a = adapter(tmp_path / "a", b"weights")
    os.remove(os.path.join(a, "adapter_config.json"))  # the simulated engine still applies the weights
    eng = make_engine(store, gemma3_like(64))
    with caplog.at_level(logging.WARNING, logger="s3kv.lora"):
        rep = run(eng, specs(1, a, n=3))
    assert rep.kv_mismatches == 0
    assert eng.leader.core.stats.lora_unidentified == 3
    assert eng.leader.adapters.refused == {UNREADABLE: 3}
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # logged once
    assert "no adapter_config.json" in caplog.records[0].message
    assert store.keys() == []  # nothing saved


# ------------------------------------------------------------------ identity rules


def req(task, path):
    return SimpleNamespace(lora_task_id=task, py_lora_path=path)


def test_identity_is_the_adapters_content_not_its_path_or_id(tmp_path):
    ids = AdapterIdentities()
    a = adapter(tmp_path / "a", b"w1")
    a2 = str(tmp_path / "a2")
    shutil.copytree(a, a2)
    b = adapter(tmp_path / "b", b"w2")
    cfg = adapter(tmp_path / "cfg", b"w1", config='{"r": 8, "lora_alpha": 32}')
    got = {name: ids.resolve(req(task, path)) for name, task, path in
           [("a", 1, a), ("a2", 2, a2), ("b", 3, b), ("cfg", 4, cfg)]}
    assert all(why == "" and ident for ident, why in got.values())
    assert got["a"] == got["a2"]
    assert len({got[k][0] for k in ("a", "b", "cfg")}) == 3
    assert ids.resolve(req(None, None)) == (None, "")  # the base model


def test_how_the_engine_applies_adapters_is_part_of_the_identity(tmp_path):
    a = adapter(tmp_path / "a", b"w1")
    qv = SimpleNamespace(lora_config=SimpleNamespace(lora_target_modules=["attn_q", "attn_v"]))
    all_ = SimpleNamespace(lora_config=SimpleNamespace(lora_target_modules=["attn_q", "attn_v", "attn_k"]))
    assert AdapterIdentities(qv).resolve(req(1, a)) != AdapterIdentities(all_).resolve(req(1, a))


def test_a_nemo_archive_is_identified_by_its_bytes(tmp_path):
    f1, f2 = tmp_path / "x.nemo", tmp_path / "y.nemo"
    f1.write_bytes(b"archive one")
    f2.write_bytes(b"archive two")
    ids = AdapterIdentities()
    assert ids.resolve(req(1, str(f1)))[0] != ids.resolve(req(2, str(f2)))[0]


@pytest.mark.parametrize("case", ["no_path", "missing", "no_weights", "no_config"])
def test_unidentifiable_adapters_are_refused_and_counted(tmp_path, case, caplog):
    ids = AdapterIdentities()
    d = adapter(tmp_path / "a", b"w")
    if case == "no_weights":
        os.remove(os.path.join(d, "adapter_model.safetensors"))
    if case == "no_config":
        os.remove(os.path.join(d, "adapter_config.json"))
    path = {"no_path": None, "missing": str(tmp_path / "gone")}.get(case, d)
    with caplog.at_level(logging.WARNING, logger="s3kv.lora"):
        for _ in range(3):
            ident, why = ids.resolve(req(7, path))
            assert ident is None and why
    assert ids.refused == {NO_PATH if case == "no_path" else UNREADABLE: 3}
    assert len(caplog.records) == 1


def test_an_adapter_changed_on_disk_is_refused_from_then_on(tmp_path):
    ids = AdapterIdentities()
    d = adapter(tmp_path / "a", b"w1")
    first, _ = ids.resolve(req(7, d))
    assert first is not None
    with open(os.path.join(d, "README.md"), "w") as f:  # not the adapter: still the same identity
        f.write("notes")
    assert ids.resolve(req(7, d)) == (first, "")
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(b"retrained in place")
    assert ids.resolve(req(7, d))[0] is None
    assert ids.resolve(req(7, d))[0] is None
    assert ids.refused == {CHANGED: 2}


def test_one_task_id_for_two_adapters_refuses_that_id(tmp_path):
    """The engine caches adapters by task id: after a second adapter under one id, which weights it
    applies is unknowable, so neither adapter is served or saved under that id again."""
    ids = AdapterIdentities()
    a, b = adapter(tmp_path / "a", b"w1"), adapter(tmp_path / "b", b"w2")
    assert ids.resolve(req(7, a))[0] is not None
    assert ids.resolve(req(7, b))[0] is None
    assert ids.resolve(req(7, a))[0] is None
    assert ids.resolve(req(8, b))[0] is not None  # its own id is fine
    assert ids.refused == {ID_CONFLICT: 2}
