"""The workload family (s3kv/tools/bench/gentrace.py) and the trace characterisation (tracestats.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from s3kv.cli import main
from s3kv.tools.bench.gentrace import PRESETS, generate, generate_sessions, write_trace
from s3kv.tools.bench.tracefile import TraceRequest, find_continuations, read_trace
from s3kv.tools.bench.tracestats import describe

BT = 512


def test_same_seed_same_trace_other_seed_other_trace(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(generate(PRESETS["chat"], 200, 7), a)
    write_trace(generate(PRESETS["chat"], 200, 7), b)
    assert a.read_bytes() == b.read_bytes()
    assert generate(PRESETS["chat"], 200, 8) != generate(PRESETS["chat"], 200, 7)


@pytest.mark.parametrize("name", ["chat", "fewshot-batch"])
def test_a_higher_load_is_the_same_traffic_on_a_denser_clock(name):
    """``--load``: sessions (or batch jobs) arrive that many times as often; what each one asks is
    drawn the same, so only arrival times change, and the trace spans about that much less."""
    w = PRESETS[name]
    assert w.at_load(1) is w
    base, dense = generate(w, 300, 5), generate(w.at_load(4), 300, 5)
    span = lambda reqs: max(r.timestamp_ms for r in reqs) - min(r.timestamp_ms for r in reqs)  # noqa: E731
    assert 2.5 < span(base) / span(dense) < 6
    # A turn both traces hold asks the same (the denser one ends sooner: it holds fewer late turns).
    a, b = ({sess: (r.input_length, r.hash_ids) for r, sess in gen} for gen in
            (generate_sessions(w, 300, 5), generate_sessions(w.at_load(4), 300, 5)))
    both = a.keys() & b.keys()
    assert len(both) > 100 and all(a[k] == b[k] for k in both)
    r = CliRunner().invoke(main, ["bench", "gen-trace", "--workload", name, "--load", "0", "-o", "/dev/null"])
    assert r.exit_code != 0 and "--load" in r.output


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_writes_a_trace_the_replay_reads(tmp_path, name):
    reqs = generate(PRESETS[name], 150, 3)
    p = tmp_path / "t.jsonl"
    write_trace(reqs, p)
    back, bt = read_trace(p)
    assert bt == BT and len(back) == 150
    assert [r.timestamp_ms for r in back] == sorted(r.timestamp_ms for r in reqs)
    assert all(len(r.hash_ids) == -(-r.input_length // BT) for r in back)


def test_next_turns_are_found_as_the_replay_finds_real_ones():
    """Every generated next turn re-sends its session's history, so find_continuations finds it; it names
    the previous turn itself unless another session's first turn has the same full blocks (a shared system
    prompt with the rest inside the partial block: the heuristic's documented sibling case)."""
    rows = generate_sessions(PRESETS["chat"], 400, 1)
    reqs = [r for r, _ in rows]
    last: dict[int, int] = {}
    want: dict[int, int] = {}
    for r, (sid, turn) in rows:
        if turn and sid in last:
            want[r.index] = last[sid]
        last[sid] = r.index
    assert len(want) > 100
    got = find_continuations(reqs, BT)
    assert set(want) <= set(got)
    wrong = [k for k in want if got[k] != want[k]]
    for k in wrong:
        a, b = reqs[got[k]], reqs[want[k]]
        assert a.hash_ids[: a.full_blocks(BT)] == b.hash_ids[: b.full_blocks(BT)]
    assert len(wrong) <= 0.02 * len(want)


def test_ids_name_prefixes_shared_content_shares_only_its_prefix():
    """rag: two sessions with the same system prompt and first document share exactly those full blocks."""
    rows = generate_sessions(PRESETS["rag"], 300, 2)
    firsts = [r for r, (_, turn) in rows if turn == 0]
    shared = [(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :] if a.hash_ids[0] == b.hash_ids[0]]
    assert shared
    for a, b in shared[:50]:
        k = 0
        while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
            k += 1
        # Past the first difference nothing is equal again (an id names its whole prefix).
        assert not set(a.hash_ids[k:]) & set(b.hash_ids[k:])


def test_the_family_spans_the_reuse_the_issue_asks_for():
    """Re-read fractions of 10-60% and reuse gaps from seconds to an hour, across the tuned presets."""
    ds = {n: describe(generate(w, 1200, 1), BT) for n, w in PRESETS.items() if not w.held_out}
    fr = sorted(d["reread_fraction"] for d in ds.values())
    assert fr[0] <= 0.15 and fr[-1] >= 0.55
    assert min(d["gap_p50_s"] for d in ds.values()) < 10
    assert max(d["gap_p99_s"] for d in ds.values()) > 45 * 60
    assert [n for n, w in PRESETS.items() if w.held_out] == ["fewshot-batch"]


def test_describe_counts_rereads_and_gaps_by_hand():
    reqs = [
        TraceRequest(0, 0.0, 1024, 5, (1, 2)),
        TraceRequest(1, 10_000.0, 1500, 5, (1, 2, 3)),  # re-reads 1, 2 after 10 s
        TraceRequest(2, 70_000.0, 600, 5, (1, 4)),  # re-reads 1 after 60 s
        TraceRequest(3, 80_000.0, 100, 5, (5,)),
    ]
    d = describe(reqs, BT)
    assert d["distinct_blocks"] == 5 and d["reread_blocks"] == 2 and d["reread_fraction"] == 0.4
    assert d["block_reuses"] == 3
    assert (d["gap_p50_s"], d["gap_p99_s"]) == (10.0, 60.0)
    # Reusable: 0, then 2 blocks (1024), then 1 block capped at 599 (one token short), then 0.
    assert d["reusable_tokens"] == 1024 + 512


def test_cli_gen_and_describe(tmp_path):
    out = tmp_path / "g.jsonl"
    r = CliRunner().invoke(main, ["bench", "gen-trace", "--workload", "agentic", "--requests", "120", "--seed", "4",
                                  "-o", str(out), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    gen = json.loads(r.stdout)
    assert gen["requests"] == 120 and gen["workload"] == "agentic" and not gen["held_out"]
    r = CliRunner().invoke(main, ["bench", "describe-trace", str(out), "--json"], catch_exceptions=False)
    again = json.loads(r.stdout)
    assert {k: again[k] for k in ("reread_fraction", "gap_p50_s", "prompt_tokens")} == {
        k: gen[k] for k in ("reread_fraction", "gap_p50_s", "prompt_tokens")
    }
    r = CliRunner().invoke(main, ["bench", "gen-trace", "--workload", "nope", "-o", str(out)])
    assert r.exit_code != 0 and "--workload" in r.output and "chat" in r.output
