"""The fleet a trace replay runs in: clusters, the router that picks one, and each engine's device prefix cache.

TensorRT-LLM asks a connector only for tokens beyond its own device match, so what s3kv is worth
depends on what the engines already hold: ``s3kv bench trace --clusters N --router R`` replays the
trace on N engines (one per cluster) sharing one billed store, each with its own device prefix
cache, and credits S3 only with tokens past the device match. Everything here is arithmetic on
the trace's clock; nothing touches the store.

**The device prefix cache** (:class:`DeviceCache`; TensorRT-LLM's block reuse, read in the KV
cache manager V2 -- ``kv_cache_manager_v2/_block_radix_tree.py``, ``_core/_kv_cache.py``,
``_life_cycle_registry.py`` -- which VSWA with a connector requires):

* blocks of ``tokens_per_block`` tokens keyed by their chained prefix (a radix tree of block
  keys): a block matches only behind every block before it;
* **full blocks only**: V2 can match and reuse a partial last block (``enable_partial_reuse``),
  but then the device match ends mid-block and no connector load can start there; s3kv's docs
  tell users to turn it off (docs/failures.md), and the model assumes they did;
* **the last prompt token is never reused**: at most ``(prompt_len - 1) // tpb`` blocks match
  (the engine computes at least one token; the connector contract says the same of its offer);
* **what a finished request leaves for reuse**: every block whose KV exists, prompt and answer:
  the full blocks of ``prompt_len + answer_len - 1`` tokens (the last sampled token's KV is
  never written). V2 commits blocks as they fill and keeps them, unreferenced, until evicted;
* **under VSWA** a match at ``n`` tokens needs every full-attention block below ``n`` and, of each
  sliding group with window ``W``, only the blocks still in the window at ``n``:
  ``[(n + 1 - W) // tpb, ceil(n / tpb))`` (``AttnLifeCycle.get_stale_range``; V2's
  ``_prune_match`` shortens a match whose in-window sliding page is gone). Which sliding pages
  survive is the model's choice, ``sliding=``: ``"all"`` (default) -- a block's sliding page lives
  as long as the block (V2 keeps a committed sliding page after it leaves the window, droppable,
  until evicted): the device's best case, so S3's marginal share is not overstated; ``"ends"``
  -- only the windows at each request's prompt end and history end survive (V2 sizes its
  sliding pool for live windows -- ``_try_update_target_ratios`` weighs each pool by the live
  requests' non-stale blocks -- so stale sliding pages go first under pressure; with SWA scratch
  reuse they are never kept): the device's worst case;
* **LRU, charged at full-attention KV**: capacity is in tokens of the model's full-attention KV
  (:func:`default_device_cache_tokens`); the sliding pages a match needs are a window per match,
  not per token, and are not charged. A finished request refreshes its whole history (what it
  matched included), deepest block first, so a block is never older than a block behind it:
  eviction takes leaves and the cache stays prefix-closed (a match is a plain walk).

Requests run one at a time on the trace's clock, as the S3 replay does: a request's blocks enter
its engine's cache before the next request is routed.

**The default capacity** (:func:`default_device_cache_tokens`): an H200's 141 GB, minus the
model's weights in bf16 (decoder matmuls plus the embedding), times TensorRT-LLM's
``free_gpu_memory_fraction`` default 0.9, in tokens of full-attention KV. Gemma-3-27B: (141 GB -
54.0 GB) x 0.9 / 80 KiB a token = 0.95M tokens. Activation memory is not subtracted (the device's
favour).

**Routers** (:class:`Router`): ``random`` -- uniform, seeded; ``affinity`` -- Dynamo's KV router
cost (docs.nvidia.com/dynamo, "KV Router", cost function): ``overlap_weight x prefill_blocks +
decode_blocks`` per engine, the lowest wins (router temperature 0; ties by the seeded generator),
where ``prefill_blocks`` is the request's blocks past that engine's device match plus the prompt
blocks still prefilling there, and ``decode_blocks`` the blocks of every request active there;
``overlap_weight`` 1 (Dynamo's default ``kv-overlap-score-weight``). The router sees each
engine's cache exactly (KV events). Load on the trace's clock: a request is active on its engine
from its arrival for its prefill time (prompt tokens past the device match at the package's
prefill speed, ``core.cost.Gpu``) plus one decode forward per answer token
(:func:`decode_forward_s`); no queueing is modelled.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.cost import Gpu
from ..models import ModelSpec

#: NVIDIA H200 SXM: 141 GB of HBM3e at 4.8 TB/s (product specification).
GPU_MEMORY_BYTES = 141e9
GPU_HBM_BYTES_PER_S = 4.8e12
#: TensorRT-LLM's ``KvCacheConfig.free_gpu_memory_fraction`` default.
FREE_GPU_MEMORY_FRACTION = 0.9
#: Weights and KV in bf16.
WEIGHT_BYTES_PER_PARAM = 2
#: Dynamo's default ``kv-overlap-score-weight``.
OVERLAP_WEIGHT = 1.0
ROUTERS = ("random", "affinity")
SLIDING_RULES = ("all", "ends")


def weight_bytes(model: ModelSpec) -> float:
    """The model's weights in bf16: decoder matmuls and the (tied) embedding."""
    return (model.matmul_params + model.vocab * model.hidden) * WEIGHT_BYTES_PER_PARAM


def full_kv_bytes_per_token(model: ModelSpec) -> int:
    return 2 * model.kv_heads * model.head_dim * model.kv_dtype_bytes * len(model.global_layers)


def default_device_cache_tokens(model: ModelSpec, tokens_per_block: int) -> int:
    """What an H200 has left after the weights, in tokens of full-attention KV (module doc), whole blocks."""
    free = max(0.0, GPU_MEMORY_BYTES - weight_bytes(model)) * FREE_GPU_MEMORY_FRACTION
    tokens = int(free // full_kv_bytes_per_token(model))
    return tokens // tokens_per_block * tokens_per_block


def decode_forward_s(model: ModelSpec) -> float:
    """One decode forward: it reads every weight once and is memory-bound, so at least the weights over
    the H200's HBM bandwidth (11 ms for Gemma-3-27B). The overlap loop schedules the next pass while
    this one runs on the GPU, so a lookup stall up to this long is hidden; a lower bound, so hidden
    stall is not overstated."""
    return weight_bytes(model) / GPU_HBM_BYTES_PER_S


def block_chain(tokens: Sequence[int], tpb: int, n: int, prev: bytes = b"", start: int = 0) -> list[bytes]:
    """Chained digests of blocks ``start..n-1`` of ``tokens``: each names its block and every block before
    it (a prefix key). ``prev``: the digest of block ``start - 1`` (to extend a chain)."""
    raw = array("i", tokens[start * tpb : n * tpb]).tobytes()
    step = 4 * tpb
    out = []
    for k in range(n - start):
        prev = hashlib.blake2b(prev + raw[k * step : (k + 1) * step], digest_size=12).digest()
        out.append(prev)
    return out


class DeviceCache:
    """One engine's device prefix cache under TensorRT-LLM's block-reuse rules (module doc)."""

    def __init__(self, capacity_tokens: int, tokens_per_block: int, window: int, sliding: str = "all"):
        if sliding not in SLIDING_RULES:
            raise ValueError(f"sliding must be one of {SLIDING_RULES}, got {sliding!r}")
        self.tpb = tokens_per_block
        self.window = window
        self.sliding = sliding
        self.capacity = max(0, capacity_tokens // tokens_per_block)
        #: block key -> whether its sliding page survives (always True under "all"); oldest first.
        self._lru: OrderedDict[bytes, bool] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _window_lo(self, n_blocks: int) -> int:
        """First block a sliding group still holds at a history of ``n_blocks`` whole blocks."""
        return max(0, (n_blocks * self.tpb + 1 - self.window) // self.tpb)

    def match(self, chain: Sequence[bytes], prompt_len: int) -> int:
        """Tokens of ``chain`` (the prompt's block keys) the engine serves itself. Nothing moves: the
        request's :meth:`finish` refreshes its whole history, the blocks it matched included."""
        if not self.capacity:
            return 0
        top = min(len(chain), (prompt_len - 1) // self.tpb)
        k = 0
        lru = self._lru
        while k < top and chain[k] in lru:
            k += 1
        if self.sliding == "ends" and self.window:
            # Longest n <= k whose in-window sliding pages all survive: run[j] = surviving run ending at j.
            run = 0
            runs = []
            for j in range(k):
                run = run + 1 if lru[chain[j]] else 0
                runs.append(run)
            while k > 0 and runs[k - 1] < k - self._window_lo(k):
                k -= 1
        return k * self.tpb

    def finish(self, chain: Sequence[bytes], prompt_len: int, kv_len: int) -> None:
        """A request on this engine ended: its blocks of ``kv_len`` tokens (prompt and answer whose KV
        exists) are kept for reuse. ``chain`` holds at least ``kv_len // tpb`` keys."""
        if not self.capacity:
            return
        n = kv_len // self.tpb
        keep: set[int] = set()
        if self.sliding == "ends" and self.window:
            for end in (min(n, prompt_len // self.tpb), n):  # windows at the prompt end and the history end
                keep.update(range(self._window_lo(end), end))
        lru = self._lru
        for j in range(n - 1, -1, -1):  # deepest first: a block is never older than the ones before it
            key = chain[j]
            lru[key] = lru.get(key, False) or self.sliding == "all" or j in keep
            lru.move_to_end(key)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
            self.evicted += 1


@dataclass
class _Load:
    """What is active on one engine at the trace's clock (module doc)."""

    ends: list[tuple[float, int]] = field(default_factory=list)  # (end s, blocks) heap
    prefill_ends: list[tuple[float, int]] = field(default_factory=list)  # (prefill end s, blocks) heap
    blocks: int = 0
    prefill_blocks: int = 0

    def advance(self, now: float) -> None:
        while self.ends and self.ends[0][0] <= now:
            self.blocks -= heapq.heappop(self.ends)[1]
        while self.prefill_ends and self.prefill_ends[0][0] <= now:
            self.prefill_blocks -= heapq.heappop(self.prefill_ends)[1]

    def add(self, now: float, prefill_s: float, total_s: float, prefill_blocks: int, blocks: int) -> None:
        heapq.heappush(self.ends, (now + total_s, blocks))
        heapq.heappush(self.prefill_ends, (now + prefill_s, prefill_blocks))
        self.blocks += blocks
        self.prefill_blocks += prefill_blocks


@dataclass(frozen=True)
class FleetConfig:
    clusters: int = 1
    router: str = "random"
    #: Per engine; None: :func:`default_device_cache_tokens`; 0: off (S3 the only source of reuse).
    device_cache_tokens: int | None = None
    sliding: str = "all"
    seed: int = 0
    #: Per engine; 0: no host tier (the host-tier store wrapper, once merged: docs/trace-replay.md).
    host_cache_tokens: int = 0

    def __post_init__(self) -> None:
        if self.clusters < 1:
            raise ValueError(f"--clusters must be >= 1, got {self.clusters}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.sliding not in SLIDING_RULES:
            raise ValueError(f"--device-sliding must be one of {', '.join(SLIDING_RULES)}, got {self.sliding!r}")
        if self.device_cache_tokens is not None and self.device_cache_tokens < 0:
            raise ValueError(f"--device-cache-tokens must be >= 0, got {self.device_cache_tokens}")
        if self.host_cache_tokens < 0:
            raise ValueError(f"--host-cache-tokens must be >= 0, got {self.host_cache_tokens}")


class Fleet:
    """N engines' device caches and loads, and the router between them (module doc)."""

    def __init__(self, cfg: FleetConfig, model: ModelSpec, tokens_per_block: int, gpu: Gpu):
        self.cfg = cfg
        self.model = model
        self.tpb = tokens_per_block
        self.gpu = gpu
        self.device_tokens = (
            default_device_cache_tokens(model, tokens_per_block)
            if cfg.device_cache_tokens is None
            else cfg.device_cache_tokens
        )
        self.caches = [
            DeviceCache(self.device_tokens, tokens_per_block, model.window, cfg.sliding) for _ in range(cfg.clusters)
        ]
        self.loads = [_Load() for _ in range(cfg.clusters)]
        self.decode_s = decode_forward_s(model)
        self._rng = random.Random(f"s3kv-fleet/{cfg.seed}")
        self.routed = [0] * cfg.clusters
        #: Called with (now s, this fleet) before each request (e.g. a fleet-index publisher on the trace's clock).
        self.on_clock: list[Callable[[float, Fleet], None]] = []
        #: Set by the replay: the billed store every engine shares, and the engines (a hook's view of the fleet).
        self.store: Any = None
        self.engines: list[Any] = []

    def route(self, now: float, chain: Sequence[bytes], prompt_len: int, answer_len: int) -> tuple[int, int]:
        """(engine, device-matched tokens) for the request arriving ``now``; books its load there."""
        for hook in self.on_clock:
            hook(now, self)
        n = self.cfg.clusters
        for ld in self.loads:
            ld.advance(now)
        blocks = -(-prompt_len // self.tpb)
        if n == 1:
            e = 0
        elif self.cfg.router == "random":
            e = self._rng.randrange(n)
        else:
            costs = []
            for i in range(n):
                new = blocks - self.caches[i].match(chain, prompt_len) // self.tpb
                costs.append(OVERLAP_WEIGHT * (new + self.loads[i].prefill_blocks) + self.loads[i].blocks)
            best = min(costs)
            e = self._rng.choice([i for i, c in enumerate(costs) if c == best])
        d = self.caches[e].match(chain, prompt_len)
        prefill_s = self.gpu.seconds(self.model.prefill_flops(prompt_len) - self.model.prefill_flops(d))
        total_blocks = -(-(prompt_len + answer_len) // self.tpb)
        self.loads[e].add(now, prefill_s, prefill_s + answer_len * self.decode_s, blocks - d // self.tpb, total_blocks)
        self.routed[e] += 1
        return e, d

    def finish(self, e: int, chain: Sequence[bytes], prompt_len: int, kv_len: int) -> None:
        self.caches[e].finish(chain, prompt_len, kv_len)

    def describe(self) -> dict[str, Any]:
        return {
            "clusters": self.cfg.clusters,
            "router": self.cfg.router,
            "device_cache_tokens": self.device_tokens,
            "device_cache_default": self.cfg.device_cache_tokens is None,
            "device_cache_rule": (
                "LRU per engine, whole blocks by chained prefix, never the last prompt token; a finished "
                "request's prompt and answer blocks kept; sliding pages "
                + ("kept with their block" if self.cfg.sliding == "all" else "kept only in the windows at prompt "
                   "and history ends")
            ),
            "device_sliding": self.cfg.sliding,
            "device_cache_derivation": (
                f"{GPU_MEMORY_BYTES / 1e9:.0f} GB (H200) - {weight_bytes(self.model) / 1e9:.1f} GB weights (bf16), "
                f"x {FREE_GPU_MEMORY_FRACTION} (free_gpu_memory_fraction), / "
                f"{full_kv_bytes_per_token(self.model)} B of full-attention KV per token"
            ),
            "decode_forward_ms": round(self.decode_s * 1e3, 2),
            "router_rule": "uniform, seeded" if self.cfg.router == "random" else (
                f"Dynamo KV router cost {OVERLAP_WEIGHT:g} x prefill blocks (past the device match, plus "
                "prefilling there) + active blocks; lowest wins, ties seeded"
            ),
            "routed": list(self.routed),
            "evicted_blocks": [c.evicted for c in self.caches],
            "host_cache_tokens": self.cfg.host_cache_tokens,
        }
