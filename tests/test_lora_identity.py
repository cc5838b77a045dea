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
import threading
import time
from types import SimpleNamespace

import pytest
from test_connector_sim import make_engine, run

from s3kv.sim import SimRequestSpec, gemma3_like, random_tokens
from s3kv.store.memory import MemoryStore
from s3kv.trtllm.lora import CHANGED, ID_CONFLICT, NO_PATH, PENDING, RECENT, UNREADABLE, AdapterIdentities

PROMPT_LEN = 160


def adapter(d, weights: bytes, config: str = '{"r": 8, "lora_alpha": 16}') -> str:
    os.makedirs(d)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write(config)
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return str(d)


def engine(store, **kw):
    """A simulated engine; ``lora_settle_s=0`` unless said: these adapters are written just before."""
    return make_engine(store, gemma3_like(64), **{"lora_settle_s": 0, **kw})


def hashed(eng, path: str | None, task: int = 7):
    """The engine with the adapter's identity computed: it is hashed in the background, and its
    requests are neither served nor saved until then."""
    ids = eng.leader.adapters
    ids.resolve(req(task, path))
    assert ids.wait(30)
    ids.pending = 0
    return eng


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

    cold = run(hashed(engine(store, tp=tp), a), specs(1, a))
    assert cold.kv_mismatches == 0 and cold.matched_tokens == 0
    other = run(hashed(engine(store, tp=tp), b), specs(11, b))
    assert other.kv_mismatches == 0
    assert other.matched_tokens == 0 and other.pages_checked == 0
    same = run(hashed(engine(store, tp=tp), c, task=3), specs(21, c, task=3))
    assert same.kv_mismatches == 0
    assert same.matched_tokens == 2 * (PROMPT_LEN - 16)  # every full block but the last token's


def test_lora_and_base_requests_never_share_kv(tmp_path):
    store = MemoryStore()
    a = adapter(tmp_path / "a", b"weights")
    run(engine(store), specs(1, None, task=None))
    rep = run(hashed(engine(store), a), specs(11, a))
    assert rep.matched_tokens == 0 and rep.kv_mismatches == 0
    rep = run(engine(store), specs(21, None, task=None))
    assert rep.matched_tokens > 0 and rep.kv_mismatches == 0


def test_an_unreadable_adapter_is_neither_served_nor_saved(tmp_path, caplog):
    store = MemoryStore()
    a = adapter(tmp_path / "a", b"weights")
    os.remove(os.path.join(a, "adapter_config.json"))  # the simulated engine still applies the weights
    eng = engine(store)
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


def resolved(ids, task, path):
    """``resolve`` once the adapter's background hash is done."""
    ids.resolve(req(task, path))
    assert ids.wait(30)
    return ids.resolve(req(task, path))


def test_identity_is_the_adapters_content_not_its_path_or_id(tmp_path):
    ids = AdapterIdentities(settle_s=0)
    a = adapter(tmp_path / "a", b"w1")
    a2 = str(tmp_path / "a2")
    shutil.copytree(a, a2)
    b = adapter(tmp_path / "b", b"w2")
    cfg = adapter(tmp_path / "cfg", b"w1", config='{"r": 8, "lora_alpha": 32}')
    got = {name: resolved(ids, task, path) for name, task, path in
           [("a", 1, a), ("a2", 2, a2), ("b", 3, b), ("cfg", 4, cfg)]}
    assert all(why == "" and ident for ident, why in got.values())
    assert got["a"] == got["a2"]
    assert len({got[k][0] for k in ("a", "b", "cfg")}) == 3
    assert ids.resolve(req(None, None)) == (None, "")  # the base model


def test_how_the_engine_applies_adapters_is_part_of_the_identity(tmp_path):
    a = adapter(tmp_path / "a", b"w1")
    qv = SimpleNamespace(lora_config=SimpleNamespace(lora_target_modules=["attn_q", "attn_v"]))
    all_ = SimpleNamespace(lora_config=SimpleNamespace(lora_target_modules=["attn_q", "attn_v", "attn_k"]))
    assert resolved(AdapterIdentities(qv, settle_s=0), 1, a) != resolved(AdapterIdentities(all_, settle_s=0), 1, a)


def test_a_nemo_archive_is_identified_by_its_bytes(tmp_path):
    f1, f2 = tmp_path / "x.nemo", tmp_path / "y.nemo"
    f1.write_bytes(b"archive one")
    f2.write_bytes(b"archive two")
    ids = AdapterIdentities(settle_s=0)
    one, two = resolved(ids, 1, str(f1))[0], resolved(ids, 2, str(f2))[0]
    assert one and two and one != two


@pytest.mark.parametrize("case", ["no_path", "missing", "no_weights", "no_config"])
def test_unidentifiable_adapters_are_refused_and_counted(tmp_path, case, caplog):
    ids = AdapterIdentities(settle_s=0)
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
    ids = AdapterIdentities(settle_s=0)
    d = adapter(tmp_path / "a", b"w1")
    first, _ = resolved(ids, 7, d)
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
    ids = AdapterIdentities(settle_s=0)
    a, b = adapter(tmp_path / "a", b"w1"), adapter(tmp_path / "b", b"w2")
    assert resolved(ids, 7, a)[0] is not None
    assert resolved(ids, 7, b)[0] is None
    assert ids.resolve(req(7, a))[0] is None
    assert ids.resolve(req(8, b))[0] is not None  # its own id is fine
    assert ids.refused == {ID_CONFLICT: 2}


# ------------------------------------------------------------------ first sight is what counts


def test_an_adapter_rewritten_while_hashed_stays_refused(tmp_path, monkeypatch):
    """The engine loaded (and cached by task id) the files as they were when first scheduled; a
    rewrite that lands during s3kv's hash must not let a later request be keyed by the new files
    (the engine still applies the old weights)."""
    d = adapter(tmp_path / "a", b"v1" * 1000)
    w = os.path.join(d, "adapter_model.safetensors")
    ids = AdapterIdentities(settle_s=0)
    real = ids._digest

    def racing(files, sizes):
        out = real(files, sizes)
        with open(w, "wb") as f:  # the operator's rewrite lands while s3kv hashes
            f.write(b"v2" * 1001)
        return out

    monkeypatch.setattr(ids, "_digest", racing)
    assert ids.resolve(req(7, d)) == (None, PENDING)
    assert ids.wait(30)
    monkeypatch.setattr(ids, "_digest", real)
    for _ in range(2):
        assert ids.resolve(req(7, d))[0] is None
        assert ids.wait(30)
    assert ids.refused == {CHANGED: 2}


def test_an_adapter_missing_when_first_seen_stays_refused(tmp_path):
    """Unreadable at first sight, readable later: what the engine loaded then is unknowable."""
    d = str(tmp_path / "a")
    assert ids_resolve_all(ids := AdapterIdentities(settle_s=0), d)[0] is None
    adapter(tmp_path / "a", b"w1")
    assert ids_resolve_all(ids, d)[0] is None
    assert ids.refused == {UNREADABLE: 1, CHANGED: 1}


def ids_resolve_all(ids, path, task=7):
    got = ids.resolve(req(task, path))
    assert ids.wait(30)
    return got


def test_a_same_size_rewrite_with_its_mtime_restored_is_seen(tmp_path):
    """``rsync --inplace -t``: same size, same inode, mtime restored; only the ctime tells."""
    d = adapter(tmp_path / "a", b"A" * 4096)
    w = os.path.join(d, "adapter_model.safetensors")
    ids = AdapterIdentities(settle_s=0)
    assert resolved(ids, 7, d)[0] is not None
    st = os.stat(w)
    time.sleep(0.01)  # a ctime tick apart
    with open(w, "r+b") as f:
        f.write(b"B" * 4096)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ids.resolve(req(7, d)) == (None, ids.resolve(req(7, d))[1])
    assert ids.refused[CHANGED] == 2


def test_a_file_truncated_during_the_hash_refuses_the_adapter_without_a_crash(tmp_path, monkeypatch):
    """A memory-mapped hash of a file truncated under it dies of SIGBUS (the scheduler with it);
    plain reads come back short: the adapter changed, refused."""
    import blake3

    d = adapter(tmp_path / "a", os.urandom(20 << 20))  # more than one read
    w = os.path.join(d, "adapter_model.safetensors")
    big = [0]

    real = blake3.blake3

    class Truncating:
        AUTO = real.AUTO

        def __init__(self, *args, **kwargs):
            self.h = real(*args, **kwargs)

        def update(self, data):
            if len(data) >= 1 << 20 and not big[0]:
                big[0] = 1
                os.truncate(w, 4096)  # what `cp new old` does first (O_TRUNC)
            return self.h.update(data)

        def update_mmap(self, path):
            raise AssertionError("memory-mapped hash: a truncation SIGBUSes the engine")

        def hexdigest(self, length=32):
            return self.h.hexdigest(length=length)

    monkeypatch.setattr(blake3, "blake3", Truncating)
    ids = AdapterIdentities(settle_s=0)
    assert ids.resolve(req(7, d)) == (None, PENDING)
    assert ids.wait(30)
    assert ids.resolve(req(7, d))[0] is None
    assert ids.refused == {CHANGED: 1} and big[0]


def test_the_first_request_never_waits_for_the_hash(tmp_path, monkeypatch):
    """The hash runs off the scheduler thread: the first requests are pending (not served, not
    saved, not counted as unidentified, not warned), then the identity serves."""
    d = adapter(tmp_path / "a", b"w1")
    ids = AdapterIdentities(settle_s=0)
    gate = threading.Event()
    real = ids._digest

    def slow(files, sizes):
        assert gate.wait(30)
        return real(files, sizes)

    monkeypatch.setattr(ids, "_digest", slow)
    assert ids.resolve(req(7, d)) == (None, PENDING)  # returns while the hash is held
    assert ids.resolve(req(7, d)) == (None, PENDING)
    assert ids.pending == 2 and not ids.refused
    gate.set()
    assert ids.wait(30)
    assert ids.resolve(req(7, d))[0] is not None


def test_pending_requests_are_neither_served_nor_saved_nor_counted_unidentified(tmp_path):
    store = MemoryStore()
    a = adapter(tmp_path / "a", b"weights")
    eng = engine(store)
    gate = threading.Event()
    ids = eng.leader.adapters
    real = ids._digest
    ids._digest = lambda files, sizes: (gate.wait(30), real(files, sizes))[1]
    rep = run(eng, specs(1, a, n=2))
    gate.set()
    assert rep.kv_mismatches == 0 and rep.matched_tokens == 0
    assert eng.leader.core.stats.lora_unidentified == 0 and ids.pending == 2
    assert store.keys() == []


# ------------------------------------------------------------------ replaced between enqueue and lookup (#37.1)


@pytest.mark.parametrize("swap", ["none", "symlink", "in_place"])
def test_an_adapter_replaced_between_enqueue_and_lookup_serves_no_wrong_page(tmp_path, swap):
    """The attack (issue #37.1, 52/52 wrong pages): TensorRT-LLM loads an adapter as its first
    request is enqueued; the operator's republish lands before s3kv first sees the request. s3kv
    then hashed the new files and saved KV the engine computed with the old ones under the new
    adapter's identity, which every cluster serving the new adapter loaded. Now the change is
    younger than ``S3KV_LORA_SETTLE_S`` at first sight: refused. ``none``: the same run without a
    swap shares, so the two clusters below do measure what is served across them."""
    settle = 1.0
    v1 = adapter(tmp_path / "v1", b"v1 weights " * 100)
    v2 = adapter(tmp_path / "v2", b"v2 weights " * 100)  # same size: an in-place rewrite keeps it
    path = str(tmp_path / "current")
    if swap == "symlink":
        os.symlink(v1, path)
    else:
        shutil.copytree(v1, path)

    def republish():
        if swap == "symlink":  # ln -sfn v2 current: a new link renamed over the old one
            os.symlink(v2, path + ".new")
            os.replace(path + ".new", path)
        elif swap == "in_place":  # rsync --inplace -t: same inode, same size, mtime restored
            w = os.path.join(path, "adapter_model.safetensors")
            st = os.stat(w)
            with open(w, "r+b") as f:
                f.write(open(os.path.join(v2, "adapter_model.safetensors"), "rb").read())
            os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))

    store = MemoryStore()
    a = engine(store, tp=2, lora_settle_s=settle)
    lookup = a.leader.get_num_new_matched_tokens

    def republish_then_lookup(request, computed):  # the engine loaded the files at enqueue
        republish()
        a.leader.get_num_new_matched_tokens = lookup
        return lookup(request, computed)

    time.sleep(settle + 0.2)  # every file published well before the first request
    a.leader.get_num_new_matched_tokens = republish_then_lookup
    with a:
        a.run(specs(1, path))  # first sight: hashed (or refused), neither served nor saved
        assert a.leader.adapters.wait(30)
        a.run(specs(11, path))  # the engine still applies the weights it loaded first
        for w in a.workers:
            assert w.flush(30)
    saved_by_a = store.keys()
    time.sleep(settle + 0.2)  # cluster B starts after the republish settled: it loads v2
    # B's identity is computed before its first lookup, so its first batch is served only by what
    # A saved (B may then serve its own saves: the hash finishing mid-batch is timing, not the test)
    b = hashed(engine(store, tp=2, lora_settle_s=settle), path)
    with b:
        rep = b.run(specs(21, path))
        again = b.run(specs(31, path))
    assert rep.kv_mismatches == 0 and again.kv_mismatches == 0
    assert again.matched_tokens > 0  # B shares with itself: its v2 identity is a real one
    if swap == "none":
        assert rep.matched_tokens > 0 and not a.leader.adapters.refused
    else:
        assert rep.matched_tokens == 0 and saved_by_a == []
        assert set(a.leader.adapters.refused) == {RECENT}  # both batches of cluster A
        assert not b.leader.adapters.refused


def test_the_settle_time_counts_from_each_task_ids_first_request(tmp_path):
    """A change just before a task id's first request refuses that id for good (the engine keeps
    what it loaded for it); a new id first seen after the settle time starts afresh."""
    d = adapter(tmp_path / "a", b"w1")
    now = [time.time()]
    ids = AdapterIdentities(settle_s=10, clock=lambda: now[0])
    now[0] += 5
    assert ids.resolve(req(7, d))[0] is None
    now[0] += 6  # 11 s after the files were written
    assert resolved(ids, 7, d)[0] is None  # still refused: id 7 was first seen 5 s after
    assert resolved(ids, 8, d)[0] is not None  # id 8 arrived after the settle time
    assert ids.refused == {RECENT: 3}


def test_a_link_on_the_path_is_part_of_the_evidence(tmp_path):
    """The identity is the content the path resolves to; the links it passes are evidence: a link
    flipped after first sight refuses the path, even to a target with the same bytes' age."""
    v1, v2 = adapter(tmp_path / "v1", b"w1"), adapter(tmp_path / "v2", b"w2")
    link = str(tmp_path / "current")
    os.symlink(v1, link)
    ids = AdapterIdentities(settle_s=0)
    assert resolved(ids, 7, link) == resolved(ids, 8, v1)  # content, not the path
    os.symlink(v2, link + ".new")
    os.replace(link + ".new", link)
    assert ids.resolve(req(7, link))[0] is None
    assert ids.refused == {CHANGED: 1}
