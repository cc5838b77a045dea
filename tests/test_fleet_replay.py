"""``s3kv bench trace --clusters N --router R``: the device-cache accounting against an independent count.

The count below is its own, simple re-implementation of the rules as docs/trace-replay.md and
s3kv/tools/bench/fleet.py state them -- nothing from the bench's fleet, replay or oracle code:

* device cache per engine: whole blocks keyed by their token prefix (a sha256 chain of its own),
  at most ``(prompt_len - 1) // tpb`` blocks, an LRU list of ``capacity // tpb`` blocks; a finished
  request stores (or refreshes) its ``prompt + answer - 1`` tokens' whole blocks, deepest first; with ``sliding="ends"`` a block's sliding page survives only in the
  windows at a request's prompt end and history end, and a match at ``n`` needs every block in
  ``[(n + 1 - W) // tpb, n / tpb)`` to have one;
* affinity router: Dynamo's cost -- blocks past the engine's device match plus blocks still
  prefilling there, plus blocks of every request active there -- the lowest wins (the bench's
  choice must be one of the lowest; ties are its seeded generator's); a request is active from
  its arrival for its prefill (FLOPs past the device match at 989.4 TFLOP/s x 0.65) plus one
  decode forward (bf16 weights over 4.8 TB/s) per answer token;
* tiers: device = the match; S3 = what the connector served (no host tier); computed = the rest;
  the GPU saved is the prefill of the served tokens *on top of* the device match.

The trace is a generated one (``gen-trace --workload chat``, 60 requests): multi-turn sessions, so a
next turn often finds part of its history on its engine and more of it in S3 (a device match *and*
an S3 hit on top of it: the marginal value's case).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from s3kv.sim import generate_tokens, request_root
from s3kv.tools.bench.common import GEMMA3_27B, bench_store
from s3kv.tools.bench.fleet import FleetConfig
from s3kv.tools.bench.gentrace import PRESETS, generate, write_trace
from s3kv.tools.bench.trace import SIM_VOCAB, TraceConfig, run_trace
from s3kv.tools.bench.tracefile import TokenSynth, find_continuations, read_trace

TPB = 64
W = GEMMA3_27B.window
CAPACITY = 20_000  # tokens per engine: small enough that the trace evicts
m = GEMMA3_27B
WEIGHTS = m.layers * (m.hidden * m.q_heads * m.head_dim * 2 + 2 * m.hidden * m.kv_heads * m.head_dim
                      + 3 * m.hidden * m.intermediate)
DECODE_S = (WEIGHTS + m.vocab * m.hidden) * 2 / 4.8e12


def flops(n: int) -> float:
    local = n * (n + 1) / 2 if n <= W else W * (W + 1) / 2 + (n - W) * W
    return 2 * WEIGHTS * n + 4 * m.q_heads * m.head_dim * (10 * n * (n + 1) / 2 + 52 * local)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("fleet") / "chat.jsonl"
    write_trace(generate(PRESETS["chat"], 60, 5), p)
    return p


_results: dict[tuple, dict] = {}


def replayed(path: Path, clusters: int, router: str, sliding: str = "all", capacity: int | None = CAPACITY) -> dict:
    key = (clusters, router, sliding, capacity)
    if key not in _results:
        fleet = FleetConfig(clusters=clusters, router=router, device_cache_tokens=capacity, sliding=sliding)
        # The fleet's mechanics are under test here, not the value policy's choices (which change
        # what S3 holds: tests/test_value*.py) nor the fleet index's publishing period (an object
        # another engine wrote since the last index is a miss: tests/test_fleet_index.py).
        cfg = TraceConfig(path=str(path), tokens_per_block=TPB, per_request=True, jobs=1, runs=("window",),
                          fleet=fleet, settings={"write_policy": "through"}, index_every_s=0)
        with bench_store(f"memory://test-fleet-{clusters}-{router}-{sliding}-{capacity}", name="trace") as bs:
            _results[key] = run_trace(bs, cfg)
    return _results[key]


def streams(path: Path) -> list[tuple[float, list[int], list[int], int]]:
    """(arrival s, prompt, answer as replayed, answer length in the trace) per request."""
    reqs, bt = read_trace(path)
    conts = find_continuations(reqs, bt)
    continued = set(conts.values())
    synth = TokenSynth(bt, SIM_VOCAB)
    history: dict[int, list[int]] = {}
    out = []
    for r in reqs:
        a = conts.get(r.index)
        prompt = synth.prompt(r) if a is None else synth.prompt(r, history[a], reqs[a].full_blocks(bt) * bt)
        n = r.output_length if r.index in continued else min(r.output_length, TPB - r.input_length % TPB + 1)
        answer = generate_tokens(request_root(), prompt, n, SIM_VOCAB)
        if r.index in continued:
            history[r.index] = prompt[r.full_blocks(bt) * bt :] + answer
        out.append(((r.timestamp_ms - reqs[0].timestamp_ms) / 1000, prompt, answer, r.output_length))
    return out


def keys(tokens: list[int], n: int) -> list[bytes]:
    out, prev = [], b"count"
    for k in range(n):
        prev = hashlib.sha256(prev + repr(tokens[k * TPB : (k + 1) * TPB]).encode()).digest()
        out.append(prev)
    return out


class Count:
    """One engine's device cache, the count's way."""

    def __init__(self, sliding: str):
        self.lru: list[bytes] = []  # oldest first
        self.slid: dict[bytes, bool] = {}
        self.sliding = sliding

    def match(self, ks: list[bytes], plen: int) -> int:
        k = 0
        while k < min(len(ks), (plen - 1) // TPB) and ks[k] in self.lru:
            k += 1
        if self.sliding == "ends":
            while k and not all(self.slid[ks[j]] for j in range(max(0, (k * TPB + 1 - W) // TPB), k)):
                k -= 1
        return k

    def finish(self, ks: list[bytes], plen: int, kv_len: int) -> None:
        n = kv_len // TPB
        keep = set()
        for end in (min(n, plen // TPB), n):
            keep |= set(range(max(0, (end * TPB + 1 - W) // TPB), end))
        for j in reversed(range(n)):
            self.slid[ks[j]] = self.slid.get(ks[j], False) or self.sliding == "all" or j in keep
            if ks[j] in self.lru:
                self.lru.remove(ks[j])
            self.lru.append(ks[j])
        while len(self.lru) > CAPACITY // TPB:
            self.lru.pop(0)


def count(path: Path, engine_of: list[int], clusters: int, router: str, sliding: str) -> dict:
    caches = [Count(sliding) for _ in range(clusters)]
    active: list[list[tuple[float, float, int, int]]] = [[] for _ in range(clusters)]  # (prefill end, end, pb, b)
    device, chosen_ok = [], []
    for i, (t, prompt, answer, out_len) in enumerate(streams(path)):
        plen = len(prompt)
        ks = keys(prompt, plen // TPB)
        blocks = -(-plen // TPB)
        e = engine_of[i]
        if router == "affinity":
            cost = []
            for j in range(clusters):
                prefilling = sum(pb for pe, _, pb, _ in active[j] if t < pe)
                act = sum(b for _, end, _, b in active[j] if t < end)
                cost.append(blocks - caches[j].match(ks, plen) + prefilling + act)
            chosen_ok.append(cost[e] == min(cost))
        d = caches[e].match(ks, plen) * TPB
        device.append(d)
        pre = (flops(plen) - flops(d)) / (989.4e12 * 0.65)
        active[e].append((t + pre, t + pre + out_len * DECODE_S, blocks - d // TPB, -(-(plen + out_len) // TPB)))
        have = (plen + len(answer) - 1) // TPB
        kv_len = plen + out_len - 1
        kks = keys(prompt + answer, have) + [b"unique-%d-%d" % (i, k) for k in range(have, kv_len // TPB)]
        caches[e].finish(kks, plen, kv_len)
    return {"device": device, "chosen_ok": chosen_ok}


@pytest.mark.parametrize(
    "clusters, router, sliding",
    [(3, "random", "all"), (3, "affinity", "all"), (2, "affinity", "ends")],
)
def test_device_matches_routes_and_tiers_are_those_of_the_count(trace, clusters, router, sliding):
    res = replayed(trace, clusters, router, sliding)
    got = res["per_request"]
    engines = got["engine"]
    want = count(trace, engines, clusters, router, sliding)
    assert got["device"] == want["device"]
    assert all(want["chosen_ok"])
    assert len(set(engines)) == clusters  # every engine took requests
    assert res["fleet"]["evicted_blocks"] and sum(res["fleet"]["evicted_blocks"]) > 0  # the capacity bit

    # Tiers: device + S3 + computed = every prompt token; S3 (no host tier) is what s3kv served.
    streams_ = streams(trace)
    prompt_tokens = sum(len(p) for _, p, _, _ in streams_)
    served = got["window"]
    assert got["window-s3"] == served
    tiers = res["policies"]["window"]["tiers"]["tokens"]
    assert tiers == {
        "device": sum(want["device"]),
        "host": 0,
        "s3": sum(served),
        "computed": prompt_tokens - sum(want["device"]) - sum(served),
    }
    # Each request: the connector never serves what the device holds, nor past the last prompt token.
    for (_, prompt, _, _), d, s in zip(streams_, want["device"], served, strict=True):
        assert d + s <= (len(prompt) - 1) // TPB * TPB
    assert sum(want["device"]) > 0 and res["kv_mismatches"] == 0 and all(res["targets_met"].values())
    if router == "random":  # the marginal case happens: a device match with an S3 hit on top of it
        assert any(d and s for d, s in zip(want["device"], served, strict=True))

    # GPU saved: the prefill of the served tokens on top of the device match.
    saved = sum(flops(d + s) - flops(d) for d, s in zip(want["device"], served, strict=True))
    assert res["policies"]["window"]["gpu_usd_saved"] == pytest.approx(
        saved / (989.4e12 * 0.65) * 3 / 3600, rel=1e-3, abs=2e-6
    )


def test_affinity_keeps_more_on_the_device_than_random_routing(trace):
    """The point of a KV-aware router: more prompt tokens served by the device, fewer left to S3."""
    shares = {r: replayed(trace, 3, r)["fleet"]["tiers"]["shares"] for r in ("random", "affinity")}
    assert shares["affinity"]["device"] > shares["random"]["device"]
    assert shares["affinity"]["s3"] < shares["random"]["s3"]


def test_one_engine_without_a_device_cache_is_the_old_regime(trace):
    """--device-cache-tokens 0 on one engine: nothing from the device, the same as before fleets."""
    res = replayed(trace, 1, "random", capacity=0)
    assert res["fleet"]["tiers"]["tokens"]["device"] == 0
    assert res["per_request"]["device"] == [0] * res["trace"]["requests"]
    assert res["policies"]["window"]["served_tokens"] > 0


def test_the_default_device_cache_is_what_an_h200_has_left_after_the_weights():
    from s3kv.tools.bench.fleet import default_device_cache_tokens

    weights_bytes = (WEIGHTS + m.vocab * m.hidden) * 2  # bf16 decoder matmuls and embedding: 54.0 GB
    per_token = 10 * 2 * m.kv_heads * m.head_dim * 2  # K and V of the 10 full-attention layers, bf16
    want = int((141e9 - weights_bytes) * 0.9 // per_token) // TPB * TPB
    assert default_device_cache_tokens(m, TPB) == want
    assert 900_000 < want < 1_000_000  # issue 38's "0.9M tokens per cluster"


def test_the_stall_past_one_decode_forward_is_gpu_time_lost_and_latency_added():
    from types import SimpleNamespace

    from s3kv.tools.bench.replay import stall_summary

    recs = [SimpleNamespace(stall_s=s, decision="hit", seq=i) for i, s in enumerate([0.002] * 98 + [0.05, 0.5])]
    st = stall_summary(recs, 1000, hidden_s=0.011)
    assert st["lost_s"] == pytest.approx((0.05 - 0.011) + (0.5 - 0.011))
    assert st["itl_added_p50_ms"] == 0.0 and st["itl_added_p99_ms"] == pytest.approx(489.0)
    assert st["hidden_ms"] == 11.0


def test_the_engines_believe_the_store_on_the_traces_clock(tmp_path):
    """A prompt seen again two hours later: the objects expired (1 h retention) and no engine may promise
    them. On the wall clock the engine's key index still believed its own upload (a 600 s TTL outlives
    a replay of hours of traffic): the load was promised, failed, and the request stayed parked."""
    import json

    p = tmp_path / "late.jsonl"
    row = {"input_length": 2000, "output_length": 4, "hash_ids": [1, 2, 3, 4]}
    p.write_text("".join(json.dumps({"timestamp": t, **row}) + "\n" for t in (0, 7_200_000)))
    cfg = TraceConfig(path=str(p), tokens_per_block=TPB, per_request=True, jobs=1, runs=("window",),
                      fleet=FleetConfig(device_cache_tokens=0))
    with bench_store("memory://test-fleet-late", name="trace") as bs:
        res = run_trace(bs, cfg)
    pol = res["policies"]["window"]
    assert res["per_request"]["window"] == [0, 0]
    assert pol["expired_objects"] > 0 and res["load_failures"] == 0 and all(res["targets_met"].values())
