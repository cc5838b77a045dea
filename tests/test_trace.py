"""s3kv/tools/bench/tracefile.py: reading Mooncake traces, finding next turns, tokens from hash ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from s3kv.tools.bench.tracefile import (
    TokenSynth,
    TraceError,
    TraceRequest,
    find_continuations,
    read_trace,
    trace_reuse_tokens,
)

BT = 512


def write(tmp_path: Path, rows: list[dict], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def row(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def req(i: int, n_in: int, n_out: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(i, float(i), n_in, n_out, tuple(ids))


def test_read_sorts_by_arrival_and_limits(tmp_path):
    p = write(tmp_path, [row(5, 10, 1, [1]), row(0, 600, 2, [2, 3]), row(7, 1, 1, [4])])
    reqs, bt = read_trace(p)
    assert bt == BT
    assert [r.timestamp_ms for r in reqs] == [0, 5, 7] and [r.index for r in reqs] == [0, 1, 2]
    assert reqs[0].hash_ids == (2, 3) and reqs[0].full_blocks(BT) == 1
    assert len(read_trace(p, limit=2)[0]) == 2


@pytest.mark.parametrize(
    "line, words",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing hash_ids"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}', "ceil(5/512)"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "integers"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, words):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(row(0, 10, 1, [9])) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2") as ei:
        read_trace(p)
    assert words in str(ei.value)


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(tmp_path / "x", fmt="vllm")
    with pytest.raises(TraceError, match="not found"):
        read_trace(tmp_path / "x")


def test_continuations_need_the_whole_history_and_pick_the_latest_turn():
    reqs = [
        req(0, 1100, 50, [1, 2, 3]),  # 2 full blocks (1, 2) + a partial one
        req(1, 1120, 200, [1, 2, 7]),  # shares the full blocks but 1120 < 1100 + 50: a sibling
        req(2, 1300, 40, [1, 2, 8]),  # 1300 >= 1150 (and < 1120 + 200): the next turn of 0 only
        req(3, 1600, 5, [1, 2, 8, 9]),  # starts with the full blocks of 0, 1 and 2: the latest, 2
        req(4, 2000, 5, [5, 6, 7, 8]),  # unrelated
        req(5, 1024, 4, [1, 2]),  # starts with 0's full blocks but 1024 < 1150
    ]
    got = find_continuations(reqs, BT)
    assert got[2] == 0
    assert 1 not in got and 4 not in got and 5 not in got
    assert got[3] == 2  # 2 and 0 both qualify (2 full blocks each): the most recent wins
    # A request whose prompt is block-aligned: the next turn starts with all of its ids.
    aligned = [req(0, 1024, 30, [1, 2]), req(1, 1100, 5, [1, 2, 3])]
    assert find_continuations(aligned, BT) == {1: 0}


def test_equal_ids_give_equal_tokens_and_differ_otherwise():
    s = TokenSynth(BT, 1 << 16)
    a = s.prompt(req(0, 1100, 1, [1, 2, 3]))
    b = s.prompt(req(1, 1100, 1, [1, 2, 4]))
    assert len(a) == 1100 and a[:1024] == b[:1024] and a[1024:] != b[1024:]
    assert a == TokenSynth(BT, 1 << 16).prompt(req(0, 1100, 1, [1, 2, 3]))  # deterministic
    small = TokenSynth(BT, 100).synth(1)
    assert len(small) == BT and max(small) < 100


def test_a_continuation_carries_the_history_and_binds_its_blocks():
    s = TokenSynth(BT, 1 << 16)
    first = s.prompt(req(0, 700, 3, [1, 2]))
    answer = [7, 7, 7]
    history = first[512:] + answer  # the partial block and the answer
    nxt = s.prompt(req(1, 1100, 1, [1, 20, 21]), history, 512)
    assert nxt[:703] == first + answer  # the whole history, then the new message
    assert nxt[703:] != first[:397]
    # A later request naming block 20 gets the same tokens (equal ids, equal tokens) ...
    again = s.prompt(req(2, 1100, 1, [1, 20, 22]))
    assert again[:1024] == nxt[:1024]
    # ... and a known block keeps its tokens even where another history would overlap it.
    other = s.prompt(req(3, 1100, 1, [1, 20, 23]), [9] * 600, 512)
    assert other[:1024] == nxt[:1024]


def test_reuse_by_hash_ids():
    reqs = [req(0, 1100, 1, [1, 2, 3]), req(1, 1100, 1, [1, 2, 4]), req(2, 1024, 1, [1, 2])]
    assert trace_reuse_tokens(reqs, BT) == [0, 1024, 1023]
