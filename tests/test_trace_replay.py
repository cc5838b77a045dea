"""``s3kv bench trace`` on a checked-in slice of the Mooncake trace, against an independent count.

The bench replays every request through the simulator and the real adapter classes. This file
counts, with its own arithmetic over token blocks (a chained hash of its own; nothing from
s3kv's keys, policy, lookup or the bench's oracle), what each run must serve and store, from the
rules as documented:

* ideal: every block some earlier request computed (prompt, or the part of its answer whose KV
  exists) is stored; a request is served its longest such prefix, one token short of its prompt;
* full-attention objects: a request that was served ``h`` blocks stores objects ending at every
  multiple of the group's blocks-per-object past ``save_from = h rounded down to an object``, at
  its prompt's last full block and at its history's end; a lookup finds the furthest one its
  own prompt reaches (its "spine"), capped at what the engine lets a hit serve;
* store-everything: every group stores every block, so that spine is the hit;
* window policy: sliding groups store only in-window tails ``[((b-1)*tpb+1-W)//tpb, b)`` (from
  ``save_from`` on) ending at checkpoints, at the prompt's end and at the history's end -- one
  object per tail, named by its end; where tails overlap, the later one starts where the
  earlier ended -- plus, with branch tails, one ending at the spine when the request was served
  less than it; a lookup tries the spine, then the checkpoints below it (three at most), highest
  first, and serves the first whose tail the objects it asks for cover (with one block per
  sliding object: those ending inside the tail, one block past it, and at the prompt's end) on
  its own prefix;
* write once: of two objects with the same name, the first one stays.

The inputs (tokens from the hash ids, answers from the simulator's sampler) are built here too,
and the bench's token fingerprint must match them, so both count the same stream.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from s3kv.cli import main
from s3kv.config import Settings
from s3kv.sim import generate_tokens, request_root
from s3kv.tools.bench.common import GEMMA3_27B, bench_store
from s3kv.tools.bench.fleet import FleetConfig
from s3kv.tools.bench.trace import SIM_VOCAB, TraceConfig, run_trace
from s3kv.tools.bench.tracefile import TokenSynth, find_continuations, read_trace

FIXTURE = Path(__file__).parent / "fixtures" / "mooncake_slice.jsonl"
#: The regime this count models: one engine, no device prefix cache, S3 the only source of reuse.
NO_DEVICE = FleetConfig(device_cache_tokens=0)
TPB = 64
W = GEMMA3_27B.window
VOCAB = SIM_VOCAB
MiB = 1 << 20


#: The replay runs at 64 MiB objects (the default is 512): full-attention objects of 12 blocks, not
#: one per checkpoint stride, so a lookup finds a shared prefix's chain between checkpoints and
#: the slice makes branch points (the rules are the same at any size).
TARGET_MIB = 64


def object_blocks(page_bytes: int, target_mib: int = TARGET_MIB, cap: int = 64) -> int:
    """docs/configuration.md: objects of ~S3KV_TARGET_OBJECT_MIB (at most 64 blocks), at least one block."""
    return max(1, min(cap, target_mib * MiB // page_bytes))


def page_bytes(layers: int) -> int:
    m = GEMMA3_27B
    return layers * 2 * TPB * m.kv_heads * m.head_dim * 2


FULL_BPO = object_blocks(page_bytes(len(GEMMA3_27B.global_layers)))
SLIDING_BPO = object_blocks(page_bytes(len(GEMMA3_27B.local_layers)))
# Checkpoints every S3KV_CHECKPOINT_TOKENS (the default), rounded up to whole objects of the largest count.
CP = -(-(Settings().checkpoint_tokens // TPB) // max(FULL_BPO, SLIDING_BPO)) * max(FULL_BPO, SLIDING_BPO)


def chain(tokens: Sequence[int], n: int) -> list[bytes]:
    raw = array("q", tokens[: n * TPB]).tobytes()
    out, prev = [], b"independent"
    for k in range(n):
        prev = hashlib.sha256(prev + raw[k * TPB * 8 : (k + 1) * TPB * 8]).digest()
        out.append(prev)
    return out


def lo(h: int) -> int:
    """First block a sliding group holds a page for at history h (the engine's rule)."""
    return max(0, (h * TPB + 1 - W) // TPB)


def token_streams(path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) per request, as the bench's documented rules make them."""
    reqs, bt = read_trace(path)
    conts = find_continuations(reqs, bt)
    continued = set(conts.values())
    synth = TokenSynth(bt, VOCAB)
    history: dict[int, list[int]] = {}
    out = []
    for r in reqs:
        a = conts.get(r.index)
        if a is None:
            prompt = synth.prompt(r)
        else:
            prompt = synth.prompt(r, history[a], reqs[a].full_blocks(bt) * bt)
        n = r.output_length if r.index in continued else min(r.output_length, TPB - r.input_length % TPB + 1)
        answer = generate_tokens(request_root(), prompt, n, VOCAB)
        if r.index in continued:
            history[r.index] = prompt[r.full_blocks(bt) * bt :] + answer
        out.append((prompt, answer))
    return out


def independent_count(streams: list[tuple[list[int], list[int]]]) -> dict:
    kv: set[bytes] = set()
    ideal: list[int] = []
    runs = ("window", "window-no-branch", "all")
    spine: dict[str, set[bytes]] = {r: set() for r in runs}
    # Full-attention objects: digest of the prefix they end at -> (first block, end block).
    full_objects: dict[str, dict[bytes, tuple[int, int]]] = {r: {} for r in runs}
    # Sliding objects: digest of the prefix they end at -> their first block.
    objects: dict[str, dict[bytes, int]] = {r: {} for r in runs}
    sliding: dict[str, set[bytes]] = {r: set() for r in runs}  # pages stored (distinct)
    served: dict[str, list[int]] = {r: [] for r in runs}

    def covered(run: str, d: list[bytes], h: int, top: int) -> bool:
        asked = set(range(lo(h) + 1, h + 1)) | {min(h + 1, top), top}
        spans = sorted((objects[run][d[e - 1]], e) for e in asked if 0 < e <= len(d) and d[e - 1] in objects[run])
        pos = lo(h)
        for first, end in spans:
            if first <= pos < end:
                pos = end
        return pos >= h

    spans: dict[str, dict[bytes, int]] = {r: {} for r in runs}  # sliding: end digest -> pages

    def store(run: str, d: list[bytes], first: int, end: int) -> None:
        if first < end:
            objects[run].setdefault(d[end - 1], first)
            spans[run].setdefault(d[end - 1], end - first)
            sliding[run].update(d[first:end])

    # The leader's memo of recent prompts: block digest -> length of the latest prompt holding it.
    reach: dict[bytes, int] = {}
    for prompt, answer in streams:
        plen = len(prompt)
        P, hmax, E = plen // TPB, (plen - 1) // TPB, (plen + len(answer) - 1) // TPB
        d = chain(prompt + answer, E)
        # Where this prompt parts from a recent one that went on past it (0: none).
        common = next((k for k in range(P) if d[k] not in reach), P)
        parts = common if 0 < common < P and reach[d[common - 1]] > common else 0
        reach.update(dict.fromkeys(d[:P], P))
        k = 0
        while k < hmax and d[k] in kv:
            k += 1
        ideal.append(k * TPB)
        for run in runs:
            S = max((e for e in range(1, P + 1) if d[e - 1] in spine[run]), default=0)
            best = min(S, hmax)
            if run == "all":
                h = best
            else:
                cands = [best] + [c for c in range((best - 1) // CP * CP, 0, -CP)][:3]
                h = next((c for c in cands if c > 0 and covered(run, d, c, P)), 0)
            served[run].append(h * TPB)
            save_from = h // FULL_BPO * FULL_BPO
            ends = {e for e in range(save_from + 1, E + 1) if e % FULL_BPO == 0} | {P, E}
            # A branch S3 shows (its chain stored past what was served) takes its tail; else one the
            # engine's own prompts show, past the stored chain, with no tail there yet: its chain
            # object ends there too.
            branch = own = 0
            if run == "window" and S > h and S % CP and S < P:
                branch = S
            elif run == "window" and parts > S and parts % CP and d[parts - 1] not in objects[run]:
                branch = own = parts
                ends.add(own)
            spine[run].update(d[e - 1] for e in ends if e > save_from)
            for e in sorted(ends):
                if e > save_from:  # write once: the first object of a name stays
                    # An object begins at its chunk's start, or later: where the stored chain ends
                    # (S: the lookup saw it whole from its chunk's start), or at the prompt's end,
                    # where the prompt-end snapshot ended the object before it.
                    cs = (e - 1) // FULL_BPO * FULL_BPO
                    first = max(save_from, cs, S if S < e else cs, P if P % FULL_BPO and cs < P < e else cs,
                                own if cs < own < e else cs)
                    full_objects[run].setdefault(d[e - 1], (first, e))
            if run == "all":
                for e in range(save_from + 1, E + 1):
                    store(run, d, e - 1, e)
                continue
            prev = 0
            for b in sorted({c for c in range(CP, E + 1, CP)} | {P} | ({E} if E > P else set())):
                if b > save_from:
                    store(run, d, max(lo(b - 1), save_from, prev), b)
                prev = b
            if branch:
                # The engine gives no sliding page below its window at h: the block below a hit at the
                # branch point is left out where it has none, and a tail missing more is dropped.
                first = lo(branch - 1) if lo(h) <= lo(branch - 1) else lo(branch)
                if lo(h) <= first:
                    store(run, d, first, branch)
        kv.update(d)
    return {
        "ideal": ideal,
        "served": served,
        "full_pages": len(kv),
        "sliding_pages": {r: len(s) for r, s in sliding.items()},
        # Objects created (count, pages) per group: what S3 stores and bills.
        "objects": {
            r: {
                "full": (len(full_objects[r]), [e - f for f, e in full_objects[r].values()]),
                "sliding1024": (len(spans[r]), list(spans[r].values())),
            }
            for r in runs
        },
    }


@pytest.fixture(scope="module")
def replayed() -> dict:
    # Every boundary written (``through``): the count is of the replay's mechanics, not of what the
    # value policy learns (tests/test_value*.py).
    cfg = TraceConfig(path=str(FIXTURE), tokens_per_block=TPB, per_request=True, jobs=1, fleet=NO_DEVICE,
                      settings={"target_object_mib": TARGET_MIB, "write_policy": "through"})
    with bench_store("memory://test-trace-replay", name="trace") as bs:
        return run_trace(bs, cfg)


def test_object_sizes_the_count_assumes():
    # Gemma-3-27B at 64 tokens per block: 5 MiB full-attention pages, 26 MiB sliding ones; 64 MiB
    # objects; checkpoints every 8,192 tokens (128 blocks) rounded up to whole 12-block objects.
    assert (FULL_BPO, SLIDING_BPO, CP) == (12, 2, 132)


def test_replay_matches_the_independent_count(replayed):
    streams = token_streams(FIXTURE)
    fp = hashlib.blake2b(digest_size=16)
    for prompt, answer in streams:
        fp.update(array("i", prompt + answer).tobytes())
    assert replayed["tokens_fingerprint"] == fp.hexdigest()  # the same token stream

    want = independent_count(streams)
    got = replayed["per_request"]
    assert got["ideal"] == want["ideal"]
    for run in ("all", "window", "window-no-branch"):
        assert got[run] == want["served"][run], run
    pol = replayed["policies"]
    assert pol["all"]["distinct_pages_by_group"] == {"full": want["full_pages"], "sliding1024": want["full_pages"]}
    for run in ("window", "window-no-branch"):
        assert pol[run]["distinct_pages_by_group"] == {
            "full": want["full_pages"],
            "sliding1024": want["sliding_pages"][run],
        }, run


def test_the_headline_ratios_are_those_of_the_count(replayed):
    want = independent_count(token_streams(FIXTURE))
    ideal = sum(want["ideal"])
    served = {r: sum(v) for r, v in want["served"].items()}
    ratios = replayed["window_vs_all"]
    assert ideal > 0 and served["window"] > 0
    assert ratios["served"] == round(served["window"] / served["all"], 4)
    assert ratios["served_vs_ideal"] == round(served["window"] / ideal, 4)
    pol = replayed["policies"]
    assert pol["window"]["served_pct_of_ideal"] == round(100 * served["window"] / ideal, 2)
    # Bytes: each page the count says must be stored, once (exact); objects may hold a page twice
    # (a prompt-end snapshot and then the whole chunk, a history-end tail over the prompt-end
    # one), so the bytes S3 bills sit between that and twice that.
    full, slid = page_bytes(10), page_bytes(52)
    must = {
        "all": want["full_pages"] * (full + slid),
        "window": want["full_pages"] * full + want["sliding_pages"]["window"] * slid,
    }
    for run in ("all", "window"):
        assert pol[run]["distinct_page_bytes"] == must[run], run
        assert must[run] <= pol[run]["stored_bytes"] <= 2 * must[run], run
    assert ratios["distinct_page_bytes"] == round(must["window"] / must["all"], 4)
    assert ratios["distinct_page_bytes"] <= ratios["stored_bytes"] <= 2 * ratios["distinct_page_bytes"]


def test_requests_bytes_and_dollars_are_those_of_the_count(replayed):
    """The bill: objects and bytes S3 holds, PUT-class and HEAD requests, dollars -- from the count's
    own arithmetic (list prices written out here; header bytes per the object format doc)."""
    from s3kv.core.objects import header_len

    want = independent_count(token_streams(FIXTURE))
    pages = {"full": page_bytes(10), "sliding1024": page_bytes(52)}
    res = replayed
    pol = res["policies"]
    unreplayed = res["sim"]["answer_blocks_not_replayed"]
    for run in ("all", "window", "window-no-branch"):
        p = pol[run]
        objs = want["objects"][run]
        if run != "all":
            assert p["objects_by_group"] == {g: n for g, (n, _) in objs.items()}, run
            # Full-attention objects: exactly the count's. A sliding object may repeat pages of an
            # earlier one (a history-end tail over the prompt-end tail; the test above bounds
            # that), so its bytes are priced from the pages the store holds: header + pages.
            n_full, counts = objs["full"]
            full = sum(header_len(n) + n * pages["full"] for n in counts)
            hdr = header_len(1) - header_len(0)  # per page; header_len(0) per object
            slid = p["objects_by_group"]["sliding1024"] * header_len(0) + p["pages_by_group"]["sliding1024"] * (
                hdr + pages["sliding1024"]
            )
            assert p["stored_bytes_by_group"] == {"full": full, "sliding1024": slid}, run
            assert want["sliding_pages"][run] <= p["pages_by_group"]["sliding1024"], run
            stored = full + slid
            assert p["stored_bytes"] == stored, run
            extra = unreplayed * pages["full"]  # the answers' full-attention pages, by arithmetic
            assert p["stored_bytes_incl_unreplayed_answers"] == stored + extra, run
        # Every object is below the 1 GiB multipart threshold: one PUT per put call the store saw;
        # one HEAD per key asked.
        assert p["requests"]["put"] == p["store_calls"]["put"] >= sum(p["objects_by_group"].values())
        assert p["requests"]["head"] == p["store_calls"]["head"]
        assert p["requests"]["get"] >= p["store_calls"]["get"]
        # Dollars at S3 list prices: PUT $0.005 / 1k, GET and HEAD $0.0004 / 1k; storage $0.023 per
        # GiB-month for 1 h after the write plus half the fleet index's 10 s period (gc learns the
        # retention, the default: its index publisher deletes in each pass; nothing in this
        # 17-minute slice is read 30 minutes after its write: no refresh).
        assert p["refreshes"] == 0 and p["expired_objects"] == 0
        rq = p["requests"]
        usd_req = rq["put"] * 0.005 / 1000 + (rq["get"] + rq["head"]) * 0.0004 / 1000
        assert p["requests_usd"] == pytest.approx(usd_req, rel=1e-3, abs=2e-6)
        if run != "all":
            # Each object lives until gc's cutoff -- 1 h of retention, plus the index_ttl_s an
            # engine's index may still believe it, plus gc's 60 s margin -- and half the index's 10 s period.
            hours = 1 + (Settings().index_ttl_s + 60 + 5) / 3600
            usd_storage = p["stored_bytes_incl_unreplayed_answers"] / 2**30 * 0.023 * hours / (24 * 365.25 / 12)
            assert p["storage_usd"] == pytest.approx(usd_storage, rel=1e-3, abs=2e-6)
        # GPU dollars saved: 2 x matmul weights x tokens + attention, at 989.4 TFLOP/s x 0.65, $3 / h.
        m = GEMMA3_27B
        weights = m.layers * (m.hidden * m.q_heads * m.head_dim * 2 + 2 * m.hidden * m.kv_heads * m.head_dim
                              + 3 * m.hidden * m.intermediate)
        flops = 0.0
        for n in want["served"][run]:
            local = n * (n + 1) / 2 if n <= W else W * (W + 1) / 2 + (n - W) * W
            flops += 2 * weights * n + 4 * m.q_heads * m.head_dim * (10 * n * (n + 1) / 2 + 52 * local)
        assert p["gpu_usd_saved"] == pytest.approx(flops / (989.4e12 * 0.65) * 3 / 3600, rel=1e-3, abs=2e-6)
        assert p["ratio_gross"] == pytest.approx(p["s3_usd"] / p["gpu_usd_saved"], rel=2e-3)
        # The value line subtracts the GPU time the lookups stalled the batch past one decode forward
        # (Gemma-3-27B's bf16 weights -- decoder matmuls and the embedding -- over an H200's 4.8 TB/s), at $3 / h.
        hidden_ms = (weights + m.vocab * m.hidden) * 2 / 4.8e12 * 1e3
        assert p["lookup_stall"]["hidden_ms"] == pytest.approx(hidden_ms, abs=0.01)
        assert p["stall_gpu_usd"] == pytest.approx(p["lookup_stall"]["lost_s"] * 3 / 3600, rel=1e-3, abs=2e-6)
        assert p["ratio"] == pytest.approx(p["s3_usd"] / (p["gpu_usd_saved"] - p["stall_gpu_usd"]), rel=2e-3)
    v = res["value"]
    assert v["policy"] == "window" and v["ratio"] == pol["window"]["ratio"]
    assert v["retention_h"] == 1.0 and v["prices"]["put_per_1k"] == 0.005


def test_every_page_served_is_right_and_nothing_was_dropped(replayed):
    assert replayed["kv_mismatches"] == 0 and replayed["guard_violations"] == 0
    assert replayed["load_failures"] == 0
    assert all(replayed["targets_met"].values())


def test_the_slice_exercises_what_it_is_for(replayed):
    """Continuations, branch-point tails and hits of every kind happen in this slice."""
    assert replayed["trace"]["continuations"] >= 5
    bt = replayed["branch_tails"]
    assert bt["tails_stored"] > 0 and bt["served_tokens_added"] > 0
    pol = replayed["policies"]
    assert 0 < pol["window-no-branch"]["served_tokens"] < pol["window"]["served_tokens"] <= pol["all"]["served_tokens"]
    up = pol["upstream-example"]
    assert 0 < up["served_tokens"] < pol["window"]["served_tokens"]


def test_cli_json_and_plot(tmp_path):
    png = tmp_path / "trace.png"
    result = CliRunner().invoke(
        main,
        ["bench", "trace", str(FIXTURE), "--json", "--plot", str(png), "--limit", "12", "--policy", "window",
         "--branch-tails", "on", "--jobs", "1"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert res["bench"] == "trace" and res["trace"]["requests"] == 12
    assert set(res["policies"]) == {"window", "upstream-example"}
    assert res["sim"]["tokens_per_block"] == 64 and "sizing_note" in res["sim"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_a_bad_trace_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    result = CliRunner().invoke(main, ["bench", "trace", str(bad), "--json"])
    assert result.exit_code != 0
    assert "bad.jsonl:1" in result.output and "hash_ids" in result.output


def test_retention_runs_on_the_trace_clock(replayed):
    """3 minutes of retention on a 17-minute slice: objects expire (a later lookup misses them),
    hits refresh what they read, fewer tokens are served, every one still right."""
    cfg = TraceConfig(path=str(FIXTURE), tokens_per_block=TPB, jobs=1, runs=("window",),
                      prices=replayed_prices(0.05), fleet=NO_DEVICE)
    with bench_store("memory://test-trace-retention", name="trace") as bs:
        short = run_trace(bs, cfg)
    p, full = short["policies"]["window"], replayed["policies"]["window"]
    assert p["expired_objects"] > 0 and p["refreshes"] > 0
    assert 0 < p["served_tokens"] < full["served_tokens"]
    assert p["storage_usd"] < full["storage_usd"]
    assert short["value"]["retention_h"] == 0.05
    # What gc learnt from the hour-long run's reads (core.retention): within floor and ceiling.
    learnt = replayed["value"]["retention_learnt"]
    assert learnt["ceiling_s"] == 3600 and 300 <= learnt["min_s"] <= learnt["retention_s"] <= 3600
    assert short["kv_mismatches"] == 0 and all(short["targets_met"].values())


def replayed_prices(retention_h: float):
    from s3kv.core.cost import Prices

    return Prices(retention_h=retention_h)


def _trace_json(args, env=None):
    result = CliRunner().invoke(
        main, ["bench", "trace", str(FIXTURE), "--json", "--limit", "8", "--policy", "window",
               "--branch-tails", "on", "--jobs", "1", "--device-cache-tokens", "0", *args],
        catch_exceptions=False, env=env,
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_replays_on_s3_and_through_the_latency_proxy(moto_s3):
    """Issue 30: ``--url s3://`` crashed (bench_store asserted a boto3 store; the factory picks
    obstore); and ``--s3-latency-ms`` replays behind the fault proxy under the default budget,
    printing the scheduler stall per lookup."""
    env = {k: v for k, v in moto_s3.env().items() if k != "S3KV_URL"}
    ref = _trace_json([])
    on_s3 = _trace_json(["--url", moto_s3.store_url("trace-url")], env)
    assert on_s3["store"]["kind"] == "s3"
    for res in (ref, on_s3):
        assert res["policies"]["window"]["kv_mismatches"] == 0
    assert on_s3["policies"]["window"]["served_tokens"] == ref["policies"]["window"]["served_tokens"] > 0
    slow = _trace_json(["--url", moto_s3.store_url("trace-slow"), "--s3-latency-ms", "2"], env)
    assert slow["store"]["s3_latency_ms"] == 2 and "fault proxy" in slow["store"]["where"]
    stall = slow["policies"]["window"]["lookup_stall"]
    assert stall["lookups"] == 8 and stall["p99_ms"] >= stall["p50_ms"] > 0
    assert slow["policies"]["window"]["kv_mismatches"] == 0


def test_the_replay_bills_the_engines_head_belief():
    """``--set index_ttl_s`` reaches the engines and gc's margin alike: a shorter belief keeps every
    object a shorter time past its retention (it once failed with "got multiple values")."""
    def storage(ttl: float | None) -> float:
        cfg = TraceConfig(path=str(FIXTURE), tokens_per_block=TPB, jobs=1, fleet=NO_DEVICE,
                          settings={"target_object_mib": TARGET_MIB, **({} if ttl is None else {"index_ttl_s": ttl})})
        with bench_store(f"memory://test-trace-ttl-{ttl}", name="trace") as bs:
            out = run_trace(bs, cfg)
        assert out["policies"]["window"]["kv_mismatches"] == 0
        return out["value"]["storage_usd"]

    assert 0 < storage(30.0) < storage(None)
