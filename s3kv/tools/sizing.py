"""Sizing and cost: what a model's prompts cost in S3 bytes, requests and dollars. Pure.

Everything is computed with the connector's own rules -- :class:`s3kv.core.policy.StoragePolicy` for
what a prompt stores, :func:`s3kv.core.hitrule.required_range` for what a hit reads, the object
packing of :func:`s3kv.core.policy.object_sizes` -- on a model's real geometry, so the numbers cannot
drift from what s3kv does. ``s3kv size`` prints them (docs/sizing.md explains the columns).

Scope of the estimate (said again in the output): one prompt, saved once, then hit in full by a
repeat (history = prompt minus its last token). Multi-turn conversations add one sliding-window
tail per turn; HEAD counts are a lookup's verify wave plus a strided probe of the
full-attention group (``s3kv bench lookup`` measures real waves).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import Settings
from ..core.cost import HOURS_PER_MONTH, GiB, Gpu, get_requests, stream_share
from ..core.hitrule import object_ends_needed, required_range
from ..core.layout import CacheGeometry, GroupGeometry
from ..core.objects import header_len
from ..core.policy import StoragePolicy, object_sizes
from .models import MODELS, ModelSpec
from .options import fmt_bytes

#: The one registry of model geometries (s3kv.tools.models), under the name ``s3kv size`` used.
PRESETS = MODELS


@dataclass(frozen=True)
class Prices:
    """Dollars. Defaults: S3 Standard list prices in us-east-1 (storage per GB-month, PUT per 1,000
    requests, GET/HEAD per 1,000 requests); data moved to compute in the same region is free."""

    gb_month: float = 0.023
    put_per_1k: float = 0.005
    get_per_1k: float = 0.0004


@dataclass(frozen=True)
class Traffic:
    """A fleet's day: prompt tokens saved for the first time, prompt tokens served from S3."""

    new_tokens_per_day: float = 0.0
    hit_tokens_per_day: float = 0.0
    #: Hours an object lives after its last write or refresh (s3kv gc --expired; 24 x days for a
    #: lifecycle rule).
    retention_h: float = 1.0


def geometry_of(model: ModelSpec, tokens_per_block: int, tp: int) -> CacheGeometry:
    """Layer groups as TensorRT-LLM forms them for this model: full attention, and one window."""
    per_layer = 2 * tokens_per_block * (model.kv_heads // tp) * model.head_dim * model.kv_dtype_bytes
    groups: list[GroupGeometry] = []
    for window, layers in ((None, model.global_layers), (model.window, model.local_layers)):
        if layers:
            groups.append(
                GroupGeometry(len(groups), window, tuple(layers), (per_layer * len(layers),))
            )
    return CacheGeometry(tokens_per_block, tuple(groups), tp, "bf16", model.name)


@dataclass(frozen=True)
class PromptCost:
    policy: str
    prompt_tokens: int
    stored_bytes: int
    objects: int
    hit_tokens: int
    loaded_bytes: int
    gets: int
    heads: int


def prompt_cost(geometry: CacheGeometry, settings: Settings, prompt_tokens: int, mode: str) -> PromptCost:
    """Bytes and objects one prompt stores under ``mode``, and what a full repeat reads."""
    tpb = geometry.tokens_per_block
    pages = [g.page_bytes for g in geometry.groups]
    bpo, cp = object_sizes(pages, tpb, settings)
    policy = StoragePolicy(geometry, max(bpo), cp, mode, settings.window_margin_blocks, bpo)
    blocks = prompt_tokens // tpb
    h = (prompt_tokens - 1) // tpb  # the engine never asks for the last prompt token
    stored = objects = loaded = gets = read_objects = 0
    reads: list[tuple[int, int]] = []  # per group: objects a full hit reads, bytes each
    spine_objects = 0
    for g in geometry.groups:
        gid = g.group_id
        if policy.stores_everything(gid):
            n_blocks = blocks
            n_objects = -(-blocks // bpo[gid])
        else:
            ends = {policy.tail_end(gid, o, blocks) for o in range(blocks)}
            ends.discard(None)
            n_blocks = sum(policy.keeps(gid, o, blocks) for o in range(blocks))
            n_objects = len(ends)
        per_object_header = header_len(bpo[gid])
        stored += geometry.tp_size * (n_blocks * g.page_bytes + n_objects * per_object_header)
        objects += geometry.tp_size * n_objects
        lo, hi = required_range(g, tpb, 0, h, settings.window_margin_blocks)
        loaded += geometry.tp_size * (hi - lo) * g.page_bytes
        # A sliding tail is stored as one object ending at its boundary; others are chunks.
        if not policy.stores_everything(gid) and hi > lo:
            n_read, size = 1, (hi - lo) * g.page_bytes
        else:
            n_read, size = len(object_ends_needed(lo, hi, bpo[gid])), bpo[gid] * g.page_bytes
        reads.append((n_read, size))
        read_objects += geometry.tp_size * n_read  # the lookup's verify wave HEADs each one
        if gid == geometry.spine_group:
            spine_objects = min(settings.lookup_probe_budget, -(-h // bpo[gid]))
    # Each object read is GETs of about S3KV_RANGE_SPLIT_MIB (one billed request each), at most
    # its share of the connections among the load's objects (a rank reads its own shard's).
    sizes = [size for n, size in reads for _ in range(n)]
    gets = geometry.tp_size * sum(
        get_requests(size, settings.range_split_mib << 20,
                     stream_share(settings.max_concurrency, settings.download_threads, len(sizes), i))
        for i, size in enumerate(sizes))
    return PromptCost(mode, prompt_tokens, stored, objects, h * tpb, loaded, gets, spine_objects + read_objects)


@dataclass(frozen=True)
class Sizing:
    model: str
    tp: int
    tokens_per_block: int
    kv_bytes_per_token: dict[str, int]
    prompts: list[dict[str, float]]
    monthly: dict[str, float] | None
    retention_h: float = 1.0


def size(
    model: ModelSpec,
    *,
    tp: int = 1,
    tokens_per_block: int = 32,
    prompt_tokens: tuple[int, ...] = (8192, 32768),
    settings: Settings | None = None,
    gpu: Gpu | None = None,
    traffic: Traffic | None = None,
    prices: Prices = Prices(),
) -> Sizing:
    settings = settings or Settings()
    gpu = gpu or Gpu()
    if model.kv_heads % tp:
        raise ValueError(f"{model.kv_heads} KV heads do not split over TP {tp}")
    geo = geometry_of(model, tokens_per_block, tp)
    per_token = {
        ("full" if g.window is None else f"window {g.window}"): g.page_bytes * tp // tokens_per_block
        for g in geo.groups
    }
    rows = []
    for p in prompt_tokens:
        # TP ranks split the prefill; perfect scaling is the optimistic (recompute-favouring) case.
        flops = model.prefill_flops((p - 1) // tokens_per_block * tokens_per_block)
        prefill_s = gpu.seconds(flops) / tp
        gpu_usd = gpu.usd(flops)  # tp GPUs for 1/tp of the time
        for mode in ("window", "all"):
            c = prompt_cost(geo, settings, p, mode)
            rows.append(
                {
                    **asdict(c),
                    "stored_bytes_per_token": c.stored_bytes / p,
                    "puts_per_1k_tokens": 1000 * c.objects / p,
                    "gets_per_1k_hit_tokens": 1000 * c.gets / max(1, c.hit_tokens),
                    "heads_per_1k_hit_tokens": 1000 * c.heads / max(1, c.hit_tokens),
                    "prefill_s": prefill_s,
                    "break_even_gb_s": c.loaded_bytes / prefill_s / 1e9 if prefill_s else 0.0,
                    # The value line: the prompt stored once and hit once within the retention.
                    **_value_of_one_hit(c, gpu_usd, prices, traffic.retention_h if traffic else 1.0),
                }
            )
    monthly = None
    if traffic is not None and (traffic.new_tokens_per_day or traffic.hit_tokens_per_day):
        ref = next(r for r in rows if r["policy"] == "window" and r["prompt_tokens"] == prompt_tokens[-1])
        # Bytes alive at any moment: each day's new tokens for the retention (S3 bills GB = 2^30 B).
        stored_gb = ref["stored_bytes_per_token"] * traffic.new_tokens_per_day * traffic.retention_h / 24 / GiB
        puts = ref["puts_per_1k_tokens"] / 1000 * traffic.new_tokens_per_day * 30
        reads = (ref["gets_per_1k_hit_tokens"] + ref["heads_per_1k_hit_tokens"]) / 1000 * traffic.hit_tokens_per_day * 30
        monthly = {
            "stored_gb": stored_gb,
            "storage_usd": stored_gb * prices.gb_month,
            "put_requests": puts,
            "put_usd": puts / 1000 * prices.put_per_1k,
            "get_head_requests": reads,
            "get_head_usd": reads / 1000 * prices.get_per_1k,
        }
        monthly["total_usd"] = monthly["storage_usd"] + monthly["put_usd"] + monthly["get_head_usd"]
        gpu_per_token = ref["gpu_usd_saved"] / max(1, ref["hit_tokens"])
        monthly["gpu_usd_saved"] = gpu_per_token * traffic.hit_tokens_per_day * 30
        monthly["ratio"] = monthly["total_usd"] / monthly["gpu_usd_saved"] if monthly["gpu_usd_saved"] else None
    return Sizing(model.name, tp, tokens_per_block, per_token, rows, monthly, traffic.retention_h if traffic else 1.0)


def _value_of_one_hit(c: PromptCost, gpu_usd: float, prices: Prices, retention_h: float) -> dict[str, float | None]:
    s3 = (
        c.objects * prices.put_per_1k / 1000
        + (c.gets + c.heads) * prices.get_per_1k / 1000
        + c.stored_bytes / GiB * prices.gb_month * retention_h / HOURS_PER_MONTH
    )
    return {"s3_usd_one_hit": s3, "gpu_usd_saved": gpu_usd, "ratio": s3 / gpu_usd if gpu_usd else None}


def table(s: Sizing, gpu: str) -> str:
    lines = [
        f"{s.model}, TP {s.tp}, {s.tokens_per_block} tokens per block",
        "KV bytes per token (all shards): "
        + ", ".join(f"{k} layers {fmt_bytes(v)}" for k, v in s.kv_bytes_per_token.items())
        + f"; total {fmt_bytes(sum(s.kv_bytes_per_token.values()))}",
        "",
        f"{'prompt':>7} {'policy':>6} | {'stored':>9} {'per token':>9} {'PUTs':>5} {'PUT/1k':>6} | "
        f"{'hit read':>9} {'GETs':>5} {'HEADs':>5} {'GET+HEAD/1k':>11} | {'prefill':>8} {'break-even':>10} | "
        f"{'S3 $':>8} {'GPU $':>8} {'ratio':>6}",
    ]
    for r in s.prompts:
        lines.append(
            f"{r['prompt_tokens']:>7} {r['policy']:>6} | {fmt_bytes(r['stored_bytes']):>9} {fmt_bytes(r['stored_bytes_per_token']):>9} "
            f"{r['objects']:>5} {r['puts_per_1k_tokens']:>6.1f} | {fmt_bytes(r['loaded_bytes']):>9} {r['gets']:>5} "
            f"{r['heads']:>5} {r['gets_per_1k_hit_tokens'] + r['heads_per_1k_hit_tokens']:>11.1f} | "
            f"{r['prefill_s']:>7.2f}s {r['break_even_gb_s']:>6.1f} GB/s | "
            f"{r['s3_usd_one_hit']:>8.5f} {r['gpu_usd_saved']:>8.5f} {r['ratio']:>6.3f}"
        )
    lines += [
        "",
        "stored: bytes one prompt writes (pages + object headers); PUTs: objects it writes.",
        "hit read: bytes a full repeat of the prompt loads; GETs/HEADs: requests for that hit (GETs of",
        "  ~S3KV_RANGE_SPLIT_MIB each, fewer where the hit's objects share the connections).",
        f"prefill: time to recompute the prompt instead ({gpu}); break-even: S3 read bandwidth at which",
        "  loading the hit takes as long as recomputing it (faster reads: loading wins).",
        "window: sliding layers store only the tails a hit can use; all: every block of every layer.",
        f"S3 $: the prompt stored once (PUTs, bytes kept {s.retention_h:g} h) and hit once (GETs, HEADs); GPU $: the",
        "  prefill that hit saves; ratio = S3 $ / GPU $ (below 1 s3kv pays at one hit; each further hit within",
        "  the retention adds only its GETs and HEADs). docs/sizing.md says which knobs move it.",
    ]
    if s.monthly:
        m = s.monthly
        lines += [
            "",
            f"per month at the largest prompt, window policy: {m['stored_gb']:.0f} GB stored "
            f"(${m['storage_usd']:.2f}), {m['put_requests']:.3g} PUTs (${m['put_usd']:.2f}), "
            f"{m['get_head_requests']:.3g} GETs+HEADs (${m['get_head_usd']:.2f}); total ${m['total_usd']:.2f}",
            f"  for ${m['gpu_usd_saved']:.2f} of prefill GPU time saved: ratio "
            + ("-" if m["ratio"] is None else f"{m['ratio']:.3f}"),
        ]
    return "\n".join(lines)
