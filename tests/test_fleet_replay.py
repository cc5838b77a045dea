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


def replayed(path: Path, clusters: int, router: str, sliding: str = "all", capacity: int | None = CAPACITY,
             host: int = 0, write_policy: str = "through") -> dict:
    key = (clusters, router, sliding, capacity, host, write_policy)
    if key not in _results:
        fleet = FleetConfig(clusters=clusters, router=router, device_cache_tokens=capacity, sliding=sliding,
                            host_cache_tokens=host)
        # The fleet's mechanics are under test here, not the value policy's choices (which change
        # what S3 holds: tests/test_value*.py) nor the fleet index's publishing period (an object
        # another engine wrote since the last index is a miss: tests/test_fleet_index.py).
        cfg = TraceConfig(path=str(path), tokens_per_block=TPB, per_request=True, jobs=1, runs=("window",),
                          fleet=fleet, settings={"write_policy": write_policy}, index_every_s=0)
        with bench_store(f"memory://test-fleet-{'-'.join(map(str, key))}", name="trace") as bs:
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


#: A host tier no trace here fills: what it held is never evicted (the count below relies on it).
HOST = 50_000_000


def test_a_host_tier_serves_what_s3_would_and_its_share_is_counted(trace):
    """One engine, no device cache, a host tier with write_policy=local (nothing goes to S3): every
    request is served exactly what the tierless write-through run served from S3, all of it from
    host memory -- the host share is s3kv's, S3's is 0, and no KV object was read from S3."""
    s3 = replayed(trace, 1, "random", capacity=0)
    local = replayed(trace, 1, "random", capacity=0, host=HOST, write_policy="local")
    got = local["per_request"]
    assert got["window"] == s3["per_request"]["window"] and sum(got["window"]) > 0
    assert got["window-host"] == got["window"] and got["window-s3"] == [0] * len(got["window"])
    pol = local["policies"]["window"]
    assert pol["tiers"]["tokens"]["host"] == sum(got["window"]) and pol["tiers"]["tokens"]["s3"] == 0
    assert sum(k["reads"] for k in pol["by_kind"].values()) == 0  # no KV object was read from S3...
    assert sum(k["objects"] for k in pol["by_kind"].values()) == 0  # ... nor written there
    # S3 saved nothing: its ratio has no denominator; every tier's saving is the host tier's.
    assert pol["gpu_usd_saved_s3"] == 0 and pol["gpu_usd_saved"] == s3["policies"]["window"]["gpu_usd_saved"]
    t = pol["host_tier"]
    assert t["hits"] > 0 and t["evicted"] == 0 and not t["over_capacity"]
    assert t["gib_per_engine"] == pytest.approx(HOST * 10 * 2 * m.kv_heads * m.head_dim * 2 / 2**30, abs=0.01)
    assert local["kv_mismatches"] == 0 and all(local["targets_met"].values())


def test_host_and_s3_shares_in_a_fleet_match_what_each_engine_saw(trace):
    """Three engines behind a random router, device caches, host tiers that never evict, everything
    written through: each request is served what it is served without the tier (S3 holds it all),
    split between host and S3 as the count says -- a block can come from the host tier only if an
    earlier request on the *same engine* had it (prompt or answer: the engine saved or loaded it),
    and a served block no earlier request there had must come from S3."""
    plain = replayed(trace, 3, "random")
    tiered = replayed(trace, 3, "random", host=HOST)
    got, want = tiered["per_request"], plain["per_request"]
    assert got["engine"] == want["engine"] and got["device"] == want["device"]
    assert got["window"] == want["window"]
    seen: list[set[bytes]] = [set() for _ in range(3)]
    own = 0
    for i, (_, prompt, answer, _) in enumerate(streams(trace)):
        e, d, s = got["engine"][i], got["device"][i], got["window"][i]
        ks = keys(prompt, len(prompt) // TPB)
        served = ks[d // TPB : (d + s) // TPB]
        on_engine = sum(TPB for k in served if k in seen[e])
        assert got["window-host"][i] + got["window-s3"][i] == s
        assert got["window-host"][i] <= on_engine  # the host tier holds only what this engine had
        assert got["window-s3"][i] >= s - on_engine  # the rest came from S3
        own += on_engine
        seen[e].update(keys(prompt + answer, (len(prompt) + len(answer) - 1) // TPB))
    tokens = tiered["policies"]["window"]["tiers"]["tokens"]
    assert tokens["host"] == sum(got["window-host"]) > 0 and tokens["s3"] == sum(got["window-s3"]) > 0
    assert sum(tokens.values()) == sum(len(p) for _, p, _, _ in streams(trace))
    assert tokens["host"] <= own
    # S3 is credited only with what it served: its value is the part of the saving S3's tokens made.
    pol = tiered["policies"]["window"]
    assert pol["gpu_usd_saved"] == pytest.approx(plain["policies"]["window"]["gpu_usd_saved"], rel=1e-6)
    assert 0 < pol["gpu_usd_saved_s3"] < pol["gpu_usd_saved"]
    assert tiered["kv_mismatches"] == 0 and all(tiered["targets_met"].values())
