"""The value policy's estimator (s3kv/core/value.py): it writes what the fleet reads.

Driven with synthetic traffic whose read rate changes: a kind that stops being read stops being
written (but for a deterministic exploration share, which keeps measuring it), and is written
again once reads come back. What a boundary is worth follows its depth, the device match the
reads came on top of, and the bill of the chain below it.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from s3kv.config import Settings
from s3kv.core.cost import Prefill
from s3kv.core.value import (
    AT_PROMPT_END,
    BRANCH,
    CHECKPOINT,
    EXPLORE_SHARE,
    HISTORY_END,
    PROMPT_END,
    Bill,
    Boundary,
    ValueModel,
    explored,
    lag_bin,
)

MiB = 1 << 20
#: Gemma-3-27B-like real sizes at 64 tokens a block: a 1,088-token sliding tail of ~463 MB, a
#: full-attention chain of ~5.2 MB a block in 12-block (64 MiB) objects.
TAIL = 463 * 10**6
CHAIN_BLOCK = 5_242_880


def model(**kw) -> ValueModel:
    return ValueModel(Prefill.from_settings(Settings()), Bill.from_settings(Settings()), **kw)


def digest(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=16).digest()


def boundary(i: int, kind: str = HISTORY_END, tokens: int = 16_384, new_blocks: int = 24) -> Boundary:
    """A request's boundary at ``tokens`` whose chain has ``new_blocks`` blocks not stored yet."""
    objs = -(-new_blocks // 12)
    chain = (new_blocks * CHAIN_BLOCK // objs,) * objs if objs else ()
    return Boundary(kind, tokens, digest(i), (TAIL,), chain, CHAIN_BLOCK / 64)


def serve(m: ValueModel, n: int, read_share: float, start: int, kind: str = HISTORY_END, lag: int = 5,
          device_share: float = 0.0, tokens: int = 4096) -> list[str]:
    """``n`` requests: each plans one ``tokens``-deep boundary of ``kind``, writes it if decided, and a
    share ``read_share`` of the written ones is reused ``lag`` requests later (a next turn): a
    share ``device_share`` of those reuses from the engine's device cache, the rest read from S3.
    Returns each request's decision."""
    out, pending = [], []
    for i in range(start, start + n):
        m.tick()
        b = boundary(i, kind, tokens=tokens)
        d = m.plan([b]).decisions[(kind, b.tokens)]
        out.append(d)
        if d != "refuse":
            m.wrote(kind, [TAIL], b.digest)
            # A deterministic share of them is read (by a hash, so it mixes with exploration).
            if int.from_bytes(digest(i)[:4], "big") < read_share * 2**32:
                pending.append((i + lag, b))
        for due, pb in [p for p in pending if p[0] == i]:
            pending.remove((due, pb))
            if int.from_bytes(digest(due)[4:8], "big") < device_share * 2**32:
                assert m.device_read(pb.digest) == kind
            else:
                m.read(pb.digest, None, pb.tokens, 0, TAIL, 0)
    return out


def written(decisions: list[str]) -> float:
    return sum(d != "refuse" for d in decisions) / len(decisions)


def test_writes_less_when_reads_fall_and_more_when_they_rise():
    m = model(half_life=200)
    busy = serve(m, 400, 0.8, 0)  # conversations go on: most next turns come
    assert written(busy[200:]) == 1.0
    quiet = serve(m, 800, 0.0, 400)  # nobody comes back
    assert m.reads_per_write(HISTORY_END) < 0.2  # (about where a 4k-token boundary stops paying)
    assert written(quiet[-300:]) < 3 * EXPLORE_SHARE  # exploration only
    back = serve(m, 800, 0.8, 1200)  # and then they do again
    assert written(back[-300:]) == 1.0
    assert m.reads_per_write(HISTORY_END) > 0.5


def test_reuses_the_device_serves_stop_the_writes_sooner_than_no_reuse_at_all():
    """Where the engine's own device cache serves a kind's reuses (one engine, or a cache-aware
    router), S3 adds nothing: the policy learns that from the reuses themselves, so it stops
    writing sooner than where nothing is reused (whose evidence is only unread writes against the
    prior), and where S3 serves the same reuses it goes on writing."""
    device, unread, s3 = model(half_life=200), model(half_life=200), model(half_life=200)
    by_device = serve(device, 400, 0.9, 0, device_share=1.0)
    by_nothing = serve(unread, 400, 0.0, 0)
    by_s3 = serve(s3, 400, 0.9, 0)
    assert device.s3_share(HISTORY_END) < 0.5 and s3.s3_share(HISTORY_END) == 1.0
    assert written(by_device) < 0.8 * written(by_nothing)
    assert written(by_device[-200:]) < 3 * EXPLORE_SHARE
    assert written(by_s3[-200:]) == 1.0
    # Half of the reuses from S3: still worth writing (what S3 serves pays for the object).
    half = model(half_life=200)
    assert written(serve(half, 400, 0.9, 0, device_share=0.5)[-200:]) == 1.0
    # A reuse of a boundary this engine never wrote says nothing.
    assert device.device_read(digest(10_000)) is None


def test_an_engine_that_has_watched_an_objects_life_stops_writing_a_kind_nobody_reads_sooner():
    """A fresh engine carries a kind through its first unread writes on the coin-flip prior; once
    it has watched as long as an object lives, zero reads in n writes says the rate is below about
    1/n (the scale-free prior), so a deep boundary whose one read pays ~100x its bill stops at a few
    dozen unread writes, not the ~200 the coin flip needs. A kind read at 1 in 25 -- worth writing
    at that depth -- is written all the same, its rate learnt as what it is."""
    deep = boundary(0, CHECKPOINT, tokens=32_768)
    fresh, watched = model(), model()
    pays = fresh.prefill.usd(0, deep.tokens) / fresh.bill.write_usd(deep.tail)
    assert 50 < pays < 200  # (the premise: one read in ~100 pays)
    watched.advance_to(0)
    watched.advance_to(watched.bill.lifetime_s)
    never_fresh = serve(fresh, 1500, 0.0, 0, CHECKPOINT, tokens=deep.tokens)
    never_watched = serve(watched, 1500, 0.0, 0, CHECKPOINT, tokens=deep.tokens)
    assert "refuse" in never_watched
    assert never_watched.count("write") < 0.6 * never_fresh.count("write")
    assert never_watched.index("refuse") < never_fresh.index("refuse")
    # Half as far watched, half as far moved: the two priors are blended by the watched time.
    half = model()
    half.advance_to(0)
    half.advance_to(half.bill.lifetime_s / 2)
    never_half = serve(half, 1500, 0.0, 0, CHECKPOINT, tokens=deep.tokens)
    assert never_watched.count("write") < never_half.count("write") < never_fresh.count("write")
    for share in (0.04, 0.1):
        m = model()
        m.advance_to(0)
        m.advance_to(m.bill.lifetime_s)
        assert written(serve(m, 1500, share, 0, CHECKPOINT, tokens=deep.tokens)[-500:]) == 1.0
        assert 0.6 * share < m.reads_per_write(CHECKPOINT) < 1.5 * share


def test_exploration_keeps_learning_a_refused_kind():
    """While refused, only the explored boundaries are written -- the same ones on every engine
    (chosen by digest) -- and their reads are what brings the kind back."""
    m = model(half_life=200)
    serve(m, 600, 0.0, 0)
    refused = [boundary(i, tokens=4096) for i in range(600, 1200)]
    plans = [m.plan([b]).decisions[(HISTORY_END, b.tokens)] for b in refused]
    assert set(plans) == {"refuse", "explore"}
    assert [d == "explore" for d in plans] == [explored(b.digest, HISTORY_END) for b in refused]
    share = plans.count("explore") / len(plans)
    assert EXPLORE_SHARE / 2 < share < EXPLORE_SHARE * 2
    # Reads of explored objects alone bring the kind back: until it is written again, only
    # explored boundaries were (and only their reads came).
    back = serve(m, 1500, 1.0, 1200)
    first = back.index("write")
    assert 0 < first < 250 and set(back[:first]) == {"refuse", "explore"}
    assert written(back[-300:]) == 1.0


def test_a_kind_read_only_at_shallow_depth_stops_being_written_deep():
    """Reads per write are learnt per depth bin too: checkpoints read half the time at 4k tokens
    and never at 32k are written shallow and refused deep -- where a kind-wide rate (a quarter)
    times a deep read's larger worth wrote both. Another engine's read is binned by the depth the
    reader sees, as its writer binned it."""
    m = model(half_life=600)
    pending: list[tuple[int, Boundary]] = []
    decisions: dict[int, list[str]] = {4096: [], 32_768: []}
    for i in range(2000):
        m.tick()
        tokens = 4096 if i % 2 else 32_768
        b = boundary(i, CHECKPOINT, tokens=tokens)
        d = m.plan([b]).decisions[(CHECKPOINT, tokens)]
        decisions[tokens].append(d)
        if d != "refuse":
            m.wrote(CHECKPOINT, [TAIL], b.digest, tokens)
            if tokens == 4096 and i % 4 == 1:
                pending.append((i + 5, b))
        for due, pb in [p for p in pending if p[0] == i]:
            pending.remove((due, pb))
            m.read(pb.digest, None, pb.tokens, 0, TAIL, 0)
    assert m.reads_per_write(CHECKPOINT, 32_768) < 0.05 < 0.3 < m.reads_per_write(CHECKPOINT, 4096)
    assert written(decisions[4096][-200:]) == 1.0
    # Deep ones only as often as keeps their bin's evidence from decaying back to the kind's rate
    # (a deep read is worth ~100 writes of its tail): with the kind's rate alone, every one.
    assert written(decisions[32_768][-200:]) < 0.4
    # The kind as a whole still looks worth writing at 32k: only its depth says otherwise.
    deep = boundary(5000, CHECKPOINT, tokens=32_768)
    r = m.reads_per_write(CHECKPOINT)
    assert r > 0.1 and r * m.prefill.usd(0, 32_768) > m.bill.write_usd(deep.tail)
    # Another engine's read (no memo) of a 32k checkpoint counts in the 32k bin, not the 4k one.
    before = (m.reads_per_write(CHECKPOINT, 32_768), m.reads_per_write(CHECKPOINT, 4096))
    for j in range(5):
        m.read(digest(10_000 + j), CHECKPOINT, 32_768, 0, TAIL, 0, end_tokens=32_768)
    deep_rise = m.reads_per_write(CHECKPOINT, 32_768) - before[0]
    shallow_rise = m.reads_per_write(CHECKPOINT, 4096) - before[1]  # only through the kind's rate
    assert deep_rise > 0.01 and deep_rise > 50 * abs(shallow_rise)


def test_engines_fed_the_same_traffic_decide_the_same():
    """Decisions are a function of what was seen and of digests: two engines (or the leader a TP
    group shares) that saw the same make the same plan, exploration included."""
    a, b = model(half_life=200), model(half_life=200)
    da, db = serve(a, 700, 0.1, 0), serve(b, 700, 0.1, 0)
    assert da == db and "explore" in da and "refuse" in da


def test_a_new_kind_is_written_until_its_writes_had_time_to_be_read():
    """Only evidence refuses a kind: a fresh engine writes what s3kv always wrote, until enough of
    a kind's writes are old enough for their reads to have come (the learnt reuse lag)."""
    m = model()
    tiny = Boundary(PROMPT_END, 128, digest(1), (TAIL,), (CHAIN_BLOCK,))  # never worth its bill
    assert m.worth(tiny) < 0
    assert m.plan([tiny]).decisions[(PROMPT_END, 128)] == "write"
    for i in range(20):  # written, never read, but too young to tell (the clock is in seconds)
        m.tick(0.1)
        m.wrote(PROMPT_END, [TAIL], digest(100 + i))
    assert m.plan([tiny]).decisions[(PROMPT_END, 128)] == "write"
    m.tick(3000)  # now they are old enough: no read came
    assert m.judged(PROMPT_END)
    assert m.plan([tiny]).decisions[(PROMPT_END, 128)] in ("refuse", "explore")


def test_reads_of_other_engines_boundaries_are_attributed_by_what_the_reader_sees():
    """Behind a random router most reads are of other engines' objects (not in the memo). A read
    the reader went on past is split between history-end and branch, never prompt-end -- which a
    split over every kind credited with next turns' reads. A hit that reached the reader's own
    prompt end may be an exact repeat (a prompt-end tail) or a next turn whose new tokens stayed in
    the block its history ended in (a history-end tail): split over both (and branch) as this
    engine's own reads are -- crediting prompt-end alone, a 4-engine rag replay counted 17 reads of
    prompt-end tails where 3 were. A hit the host tier served is no S3 read at all."""
    m = model()
    for i in range(8):
        m.wrote(HISTORY_END, [TAIL], digest(i))
        m.wrote(PROMPT_END, [TAIL], digest(100 + i))
    m.read(digest(0), None, 8192, 0, TAIL, 0)  # own reads: attributed exactly, 3 history-end, 1 prompt-end
    m.read(digest(1), None, 8192, 0, TAIL, 0)
    m.read(digest(2), None, 8192, 0, TAIL, 0)
    m.read(digest(100), None, 8192, 0, TAIL, 0)
    assert m.read(digest(999), None, 8192, 0, TAIL, 0) == HISTORY_END  # another engine's, went on
    assert m._reads[PROMPT_END].get(m.clock, m.half_life) == 1
    assert m.read(digest(998), AT_PROMPT_END, 8192, 0, TAIL, 0) == HISTORY_END  # mostly next turns here
    assert m._reads[PROMPT_END].get(m.clock, m.half_life) == pytest.approx(1.25)
    assert m._reads[HISTORY_END].get(m.clock, m.half_life) == pytest.approx(3 + 1 + 0.75)
    # Where this engine's own reads were of prompt-end tails, such a read is credited to them.
    rep = model()
    for i in range(8):
        rep.wrote(PROMPT_END, [TAIL], digest(100 + i))
        rep.wrote(HISTORY_END, [TAIL], digest(i))
    rep.read(digest(100), None, 8192, 0, TAIL, 0)
    assert rep.read(digest(998), AT_PROMPT_END, 8192, 0, TAIL, 0) == PROMPT_END
    assert rep._reads[PROMPT_END].get(rep.clock, rep.half_life) == 2
    assert rep._reads[HISTORY_END].get(rep.clock, rep.half_life) == 0
    before = {k: m.totals[k].reads for k in m.totals}
    m.host_read(PROMPT_END)
    assert {k: m.totals[k].reads for k in m.totals} == before
    assert m.totals[PROMPT_END].host_reads == 1


def test_worth_follows_depth_marginal_tokens_and_the_chain_below():
    m = model()
    m.tick(10_000)  # judged on the prior alone
    for i in range(200):
        m.wrote(CHECKPOINT, [TAIL], digest(i))
    m.tick(3000)
    shallow = Boundary(CHECKPOINT, 4096, digest(1), (TAIL,))
    deep = Boundary(CHECKPOINT, 32_768, digest(2), (TAIL,))
    assert m.worth(deep) > m.worth(shallow)
    # Reads that came on top of a long device match make a read worth less (S3 added little).
    full, marginal = model(), model()
    for x, device in ((full, 0), (marginal, 15_000)):
        for i in range(100):
            x.tick()
            x.wrote(HISTORY_END, [TAIL], digest(i))
            x.read(digest(i), None, 16_384, device, TAIL, 0)
    assert marginal.marginal_share(HISTORY_END) < 0.2 < 0.9 < full.marginal_share(HISTORY_END)
    assert marginal.worth(boundary(7)) < full.worth(boundary(7))
    # A chain already stored costs nothing: the same boundary is written when its chain is, and
    # refused when it would have to write a long unshared chain for a rare read.
    rare = model()
    for i in range(400):
        rare.tick()
        rare.wrote(HISTORY_END, [TAIL], digest(i))
        if i % 8 == 0:
            rare.read(digest(i), None, 16_384, 0, TAIL, 0)
    rare.tick(3000)
    assert rare.plan([boundary(9, new_blocks=0)]).writes(HISTORY_END, 16_384)
    assert rare.plan([boundary(9, new_blocks=256)]).decisions[(HISTORY_END, 16_384)] != "write"


def test_a_plan_keeps_the_chain_to_its_furthest_boundary_and_the_tails_worth_it():
    m = model(min_return=2.0)
    m.tick(10_000)
    for k, kind in enumerate((CHECKPOINT, PROMPT_END)):
        for i in range(100):
            m.wrote(kind, [TAIL], digest(1000 * k + i))
    for i in range(100):  # checkpoints read often, prompt ends never
        m.read(digest(i), CHECKPOINT, 8192, 0, TAIL, 0)
    m.tick(3000)
    cps = [Boundary(CHECKPOINT, 4096 * k, digest(k), (TAIL,), (12 * CHAIN_BLOCK,) * 5) for k in (1, 2)]
    end = Boundary(PROMPT_END, 9000, digest(3), (TAIL,), (CHAIN_BLOCK,))
    plan = m.plan(cps + [end])
    assert plan.writes(CHECKPOINT, 4096) and plan.writes(CHECKPOINT, 8192)
    assert plan.decisions[(PROMPT_END, 9000)] in ("refuse", "explore")
    assert plan.chain_to == (9000 if plan.decisions[(PROMPT_END, 9000)] == "explore" else 8192)
    # A history-end boundary (its end unknown when planned) needs the whole chain: chain_to None.
    assert m.plan([boundary(5, new_blocks=0)]).chain_to is None


def test_a_prompts_chain_is_written_for_the_branch_tails_it_enables():
    """A chain object may serve many later tails: where requests that share prefixes read branch
    tails, a prompt's chain is written even though none of its own tails pays."""
    m = model()
    m.tick(10_000)
    for i in range(200):
        m.wrote(PROMPT_END, [TAIL], digest(i))  # never read
        m.count_write("chain")  # 200 prompts' chains reached their ends ...
    for i in range(100):  # ... and branch tails on them were read 100 times, ~6k tokens each
        m.wrote(BRANCH, [TAIL], digest(1000 + i))
        m.read(digest(1000 + i), None, 6144, 0, TAIL, 0)
    m.tick(3000)
    end = Boundary(PROMPT_END, 8192, digest(7), (TAIL,), (12 * CHAIN_BLOCK,) * 11)
    chain = Boundary("chain", 8192, digest(7), (), ())
    assert m.plan([end]).decisions[(PROMPT_END, 8192)] != "write"
    plan = m.plan([end, chain])
    assert plan.decisions[("chain", 8192)] == "write" and plan.chain_to == 8192
    assert plan.decisions[(PROMPT_END, 8192)] != "write"  # its tail still does not pay
    # Without branch reads the same chain is not worth it.
    quiet = model()
    quiet.tick(10_000)
    for i in range(200):
        quiet.wrote(PROMPT_END, [TAIL], digest(i))
        quiet.count_write("chain")
    quiet.tick(3000)
    assert quiet.plan([end, chain]).decisions[("chain", 8192)] != "write"


def test_the_value_line_adds_up():
    m = model()
    m.wrote("chain", [64 * MiB] * 3)
    m.wrote(HISTORY_END, [TAIL], digest(1))
    m.read(digest(1), None, 10_000, 2_000, TAIL, 8000 * CHAIN_BLOCK // 64)
    snap = m.snapshot()
    h, c = snap[HISTORY_END], snap["chain"]
    bill = Bill.from_settings(Settings())
    assert c["objects"] == 3 and c["put_usd"] == pytest.approx(3 * 0.005 / 1000)
    assert h["reads"] == 1 and h["tokens"] == 8000
    assert h["gpu_usd"] == pytest.approx(Prefill.from_settings(Settings()).usd(2000, 10_000))
    assert h["storage_usd"] == pytest.approx(bill.storage_usd(TAIL))
    assert c["get_usd"] > 0 and h["get_usd"] == pytest.approx(bill.get_usd(TAIL))


def test_the_value_line_reaches_the_metrics_and_s3kv_stats(tmp_path):
    """Issue 38: what the fleet gets, per kind -- from the leader's stats to Prometheus to
    ``s3kv stats --metrics`` (summed over engines), with the lookups' HEADs priced beside."""
    import json

    from click.testing import CliRunner

    from s3kv.engine.leader.stats import LeaderStats
    from s3kv.engine.metrics import Metrics, start_http_server, value_line
    from s3kv.tools.cli import main

    m = model()
    m.wrote("chain", [64 * MiB] * 4)
    m.wrote(HISTORY_END, [TAIL], digest(1))
    m.advance_to(120)
    m.read(digest(1), None, 20_000, 0, TAIL, 20_000 * CHAIN_BLOCK // 64)  # own, dated: 120 s
    m.read(digest(2), None, 20_000, 0, TAIL, 0, lag_s=200)  # another engine's, dated by the index
    m.lag_reads[lag_bin(60)] += 20  # enough dated reads for gc to learn from (core.retention)
    engines = []
    for _ in range(2):
        metrics = Metrics()
        st = LeaderStats(value=m.snapshot(), prefill_tokens_per_s=m.prefill.tokens_per_s,
                         value_lag_reads=list(m.lag_reads))
        metrics.observe_leader(st)
        metrics.observe_leader(st)  # cumulative: observed twice, counted once
        metrics.record_request("head", 0.01, requests=1000)
        engines.append(metrics)
    line = value_line(engines[0].snapshot())
    h = line["kinds"][HISTORY_END]
    assert h["gpu_usd"] == pytest.approx(m.totals[HISTORY_END].gpu_usd)
    assert h["s3_usd"] == pytest.approx(m.totals[HISTORY_END].s3_usd)
    assert line["kinds"]["lookup"]["s3_usd"] == pytest.approx(1000 * 0.0004 / 1000)
    assert line["ratio"] == pytest.approx(line["s3_usd"] / line["gpu_usd"])
    assert engines[0].value("s3kv_value_reads_per_write", kind=HISTORY_END) == pytest.approx(
        m.reads_per_write(HISTORY_END))
    assert engines[0].value("s3kv_prefill_tokens_per_second") == pytest.approx(m.prefill.tokens_per_s)

    servers = [start_http_server(e, 0) for e in engines]
    try:
        urls = [f"http://127.0.0.1:{s.server_port}/metrics" for s in servers]
        args = ["stats", "--url", f"file://{tmp_path}", "--json"]
        for u in urls:
            args += ["--metrics", u]
        r = CliRunner().invoke(main, args, catch_exceptions=False)
        assert r.exit_code == 0, r.output
        v = json.loads(r.stdout)["value"]
        assert v["endpoints"] == 2
        assert v["gpu_usd"] == pytest.approx(2 * line["gpu_usd"]) and v["ratio"] == pytest.approx(line["ratio"])
        # The fleet's dated reads, summed over engines, and the retention gc learns from them.
        assert line["lag_reads"] == [float(x) for x in m.lag_reads]
        rl = v["retention_learnt"]
        # All within 4 minutes: gc's margin alone outlives them, so the floor.
        assert rl["reads_dated"] == 44 and rl["retention_s"] == 300 and rl["ceiling_s"] == 3600
        text = CliRunner().invoke(main, [a for a in args if a != "--json"], catch_exceptions=False)
        assert "value the fleet got" in text.output and HISTORY_END in text.output
        assert "retention: gc learns 300 s from 44 dated reads" in text.output
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_the_engine_reads_its_models_flops_from_its_config(tmp_path, monkeypatch):
    """Contract 3: the prefill figure comes from the model the engine runs -- ``llm_args.model``'s
    config.json, a local directory or a Hugging Face name in the local cache -- else the default
    model's, and the deprecated setting still overrides it."""
    import json

    from s3kv.engine.prefill import config_path, prefill_for
    from s3kv.tools.models import MODELS

    llama = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
    local = tmp_path / "llama"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(llama))
    hub = tmp_path / "hub"
    snap = hub / "models--meta--llama" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(llama))
    (hub / "models--meta--llama" / "refs").mkdir()
    (hub / "models--meta--llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert config_path(local) == local / "config.json"
    assert config_path("meta/llama") == snap / "config.json"
    assert config_path("nobody/nothing") is None and config_path(None) is None

    s = Settings()
    want = MODELS["llama-3.1-8b"].prefill_flops(8192) / 8192
    for ref in (str(local), "meta/llama"):
        p = prefill_for(s, ref, tp=2)
        assert p.model.prefill_flops(8192) / 8192 == pytest.approx(want)
        assert p.tokens_per_s == pytest.approx(2 * 8192 / p.gpu.seconds(p.model.prefill_flops(8192)))
        assert "config" in p.source
    default = prefill_for(s, "s3kv-sim/whatever")
    assert default.model == MODELS["gemma-3-27b"] and "default" in default.source
    (local / "config.json").write_text("{not json")
    assert prefill_for(s, str(local)).model == MODELS["gemma-3-27b"]  # unreadable: the default, no error
    assert prefill_for(Settings(prefill_tokens_per_s=9000.0), "meta/llama").tokens_per_s == 9000.0


def test_reads_are_dated_by_the_memo_or_by_the_fleet_index():
    """Own objects are dated by the memo; another engine's by the age the fleet index gives (the
    caller's ``lag_s``) -- counted for the advice, not learnt into the policy's own lag."""
    m = model()
    m.wrote(HISTORY_END, [TAIL], digest(1))
    m.advance_to(100)
    m.read(digest(1), None, 8192, 0, TAIL, 0)  # own: 100 s after its write
    lag_before = [b.get(m.clock, m.half_life) for b in m._lag]
    m.read(digest(2), None, 8192, 0, TAIL, 0, lag_s=2000)  # another engine's, dated by the index
    m.read(digest(3), None, 8192, 0, TAIL, 0)  # undated: not counted
    assert sum(m.lag_reads) == 2
    assert m.lag_reads[6] == 1 and m.lag_reads[10] == 1  # 100 s in [63, 127); 2000 s in [1023, 2047)
    assert [b.get(m.clock, m.half_life) for b in m._lag] == lag_before



def test_a_boundary_below_the_chains_end_pays_for_the_object_it_splits_off():
    """A prompt-end tail under a history-end one ends a chain object that would otherwise run on
    (``Boundary.splits``): that PUT is its cost. One whose tail alone just pays is refused where it
    splits the chain and written where its end is an object end anyway; the history-end boundary
    above is written either way, its chain no dearer for the split it no longer has."""
    found = None
    for writes in range(100, 2000, 20):  # a read rate at which the tail alone pays, but not with the split
        m = model()
        m.tick(10_000)
        for i in range(writes):
            m.wrote(PROMPT_END, [TAIL], digest(i))
        for i in range(writes // 50):  # 2% of them read
            m.read(digest(i), None, 16_384, 0, TAIL, 0)
        m.tick(3000)
        pe = Boundary(PROMPT_END, 16_384, digest(1), (TAIL,), (12 * CHAIN_BLOCK,), CHAIN_BLOCK / 64, 1)
        if 0 < m.worth(pe) < m.bill.puts_usd(1):
            found = m, pe
            break
    assert found is not None, "no read rate puts the tail between its own bill and the split's"
    m, pe = found
    he = Boundary(HISTORY_END, 16_384 + 640, digest(2), (TAIL,), (CHAIN_BLOCK,) * 2, CHAIN_BLOCK / 64)
    split = m.plan([pe, he])
    assert split.decisions[(PROMPT_END, 16_384)] in ("refuse", "explore")
    assert split.decisions[(HISTORY_END, 16_384 + 640)] == "write" and split.chain_to is None
    aligned = m.plan([dataclasses.replace(pe, splits=0), he])
    assert aligned.decisions[(PROMPT_END, 16_384)] == "write"


def test_a_read_adds_only_what_is_above_the_tail_the_store_holds_below():
    """Where the lookup found a stored tail on this prompt (a conversation's last turn), a later
    reader going past it hits there without a new boundary above it: a read of that boundary adds
    the prefill between the two, not the whole history -- and a boundary below the stored one is
    judged as before (its readers part below the stored tail)."""
    m = model()
    m.tick(10_000)
    for i in range(100):
        m.wrote(PROMPT_END, [TAIL], digest(i))
        if i % 4 == 0:
            m.read(digest(i), None, 32_768, 0, TAIL, 0)
    m.tick(3000)
    pe = Boundary(PROMPT_END, 32_768, digest(1), (TAIL,), (), CHAIN_BLOCK / 64)
    above = dataclasses.replace(pe, stored_below=31_744)  # a read of it adds 1,024 tokens of prefill
    assert m.worth(above) < 0 < m.worth(pe)
    assert m.plan([above]).decisions[(PROMPT_END, 32_768)] != "write"
    assert m.plan([pe]).decisions[(PROMPT_END, 32_768)] == "write"
    assert m.worth(dataclasses.replace(pe, stored_below=32_768)) == m.worth(pe)  # not below it
    worths = [m.worth(dataclasses.replace(pe, stored_below=t)) for t in (0, 2048, 16_384, 31_744)]
    assert worths == sorted(worths, reverse=True) and worths[0] - worths[-1] > 0.9 * worths[0]


def _fleet_serve(engines: list[ValueModel], n: int, read_share: float, pooled: bool) -> list[list[str]]:
    """``serve`` behind a random router: request ``i`` (a second apart) goes to engine ``i % len``,
    and a share ``read_share`` of what is written is read 5 requests later -- by the engine that
    request went to. ``pooled``: before each request, its engine adds what the others counted
    (what the fleet index carries, ``IndexRefresher.others``)."""
    out: list[list[str]] = [[] for _ in engines]
    pending: dict[int, Boundary] = {}
    for i in range(n):
        m = engines[i % len(engines)]
        for e in engines:
            e.tick()
        if pooled:
            others: dict[str, tuple[float, float]] = {}
            for o in engines:
                for k, (r, w) in o.evidence().items() if o is not m else ():
                    r0, w0 = others.get(k, (0.0, 0.0))
                    others[k] = (r0 + r, w0 + w)
            m.pool(others)
        if i in pending:
            pb = pending.pop(i)
            m.read(pb.digest, HISTORY_END, pb.tokens, 0, TAIL, 0, end_tokens=pb.tokens)
        b = boundary(i, tokens=4096)
        d = m.plan([b]).decisions[(HISTORY_END, b.tokens)]
        out[i % len(engines)].append(d)
        if d != "refuse":
            m.wrote(HISTORY_END, [TAIL], b.digest, b.tokens)
            if int.from_bytes(digest(i)[:4], "big") < read_share * 2**32:
                pending[i + 5] = b
    return out


def test_a_fleet_that_pools_its_evidence_learns_as_fast_as_one_engine_that_sees_it_all():
    """Reads per write are a fleet-wide rate (module doc, "pooled over the fleet"): four engines
    that each count only their own writes make four times the unread writes before they refuse a
    kind nobody reads; pooled, the fleet makes about as many as one engine seeing all the traffic."""
    def unread_writes(n_engines: int, pooled: bool) -> int:
        engines = [model(half_life=200) for _ in range(n_engines)]
        out = _fleet_serve(engines, 600, 0.0, pooled)
        return sum(d.count("write") for d in out)  # (exploration aside)

    alone, lone_fleet, pooled_fleet = unread_writes(1, False), unread_writes(4, False), unread_writes(4, True)
    assert lone_fleet > 2.5 * alone  # each engine paid the prior's price on its own
    assert pooled_fleet < 1.2 * alone  # the fleet paid it once
    # Pooling is the same estimator with more evidence: where the fleet reads, it writes.
    busy = _fleet_serve([model(half_life=200) for _ in range(4)], 600, 0.8, pooled=True)
    assert all(written(d[50:]) == 1.0 for d in busy)


def test_an_engine_takes_up_a_kind_the_rest_of_the_fleet_reads():
    """What the other engines counted moves one engine's decision both ways: their reads bring
    back a kind its own unread writes refused, their unread writes refuse one it would write."""
    m = model(half_life=200)
    serve(m, 400, 0.0, 0)
    b = boundary(10_000, tokens=4096)
    assert m.plan([b]).decisions[(HISTORY_END, 4096)] != "write"
    m.pool({HISTORY_END: (300.0, 400.0), f"{HISTORY_END}@2": (300.0, 400.0)})  # the others read theirs
    assert m.plan([b]).decisions[(HISTORY_END, 4096)] == "write"
    m.pool(None)  # a stale index: this engine learns alone again
    assert m.plan([b]).decisions[(HISTORY_END, 4096)] != "write"
    fresh = model(half_life=200)
    assert fresh.plan([b]).decisions[(HISTORY_END, 4096)] == "write"  # unjudged: written
    fresh.pool({HISTORY_END: (0.0, 400.0), f"{HISTORY_END}@2": (0.0, 400.0)})  # the fleet's went unread
    assert fresh.plan([b]).decisions[(HISTORY_END, 4096)] != "write"
    # The others' counts decay as the engine's own do.
    got = fresh._counts(HISTORY_END)[1]
    fresh.tick(200)
    assert fresh._counts(HISTORY_END)[1] == pytest.approx(got / 2)
