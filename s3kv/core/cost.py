"""What S3 costs per token: list prices, request counts at real object sizes, $ per 1M tokens. Pure.

Prices are S3 Standard list prices in us-east-1 (the defaults of the ``cost_*`` settings):

* PUT, COPY, POST, LIST: $0.005 per 1,000 requests -- every PUT, and for a multipart upload
  its CreateMultipartUpload, each UploadPart and the CompleteMultipartUpload;
* GET and all other requests (HEAD included): $0.0004 per 1,000 -- each ranged GET;
* storage: $0.023 per GB-month (first 50 TB; S3 bills GB = 2^30 bytes), kept for
  ``retention_h`` hours after the last write or refresh (default 1: what ``s3kv gc --watch``
  enforces, docs/operations.md; 99% of the traces' reuses come within 26 minutes);
* data transfer to compute in the same region: free (not counted).

What it buys, in the same dollars (:class:`Gpu`): the prefill GPU time a served token no longer
costs, at ``gpu_usd_per_hour`` for a GPU of ``gpu_peak_tflops`` running prefill at ``prefill_mfu``.
:class:`Prefill` is the package's ONE prefill-speed figure built from it: the model's FLOPs
(``s3kv.core.model.ModelSpec.prefill_flops``) over peak x MFU. The lookup's time budget, the value
policy (``s3kv.core.value``), the bill and ``s3kv size`` all read it, so a hit's worth and what a
lookup may stall for it can never disagree.
The default MFU is a measurement, not a guess: on an H200, a Gemma-3-27B-shaped model (random bf16
weights, plain PyTorch SDPA) prefilled 4k-32k-token prompts at 81-90 us per token, which is MFU
0.59-0.68 under ``ModelSpec.prefill_flops`` (matmul-only 0.57-0.64); 0.65 sits at the fast end, so
the GPU time saved is not overstated. :func:`value` puts the two side by side: ``ratio`` = S3
dollars / GPU dollars saved (below 1: s3kv pays; docs/sizing.md).

Other storage classes, regions or negotiated prices: set the ``cost_*`` settings (or the bench's
options). How s3kv's requests map to S3's: an object at least ``multipart_threshold`` bytes long
goes up as a multipart upload of ``part_size`` parts; a GET range much longer than
``range_split`` is fetched as parallel sub-ranges of about that size (``S3Store``); a lookup
sends one HEAD per key it cannot answer from its index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .model import ModelSpec

MiB = 1 << 20
GiB = 1 << 30
#: The defaults of S3KV_MULTIPART_THRESHOLD_MIB / S3KV_MULTIPART_PART_MIB and of the S3 clients'
#: range split (``S3Options.range_split_bytes``).
MULTIPART_THRESHOLD = 1024 * MiB
PART_SIZE = 128 * MiB
RANGE_SPLIT = 16 * MiB
DAYS_PER_MONTH = 365.25 / 12
HOURS_PER_MONTH = 24 * DAYS_PER_MONTH
#: The defaults of S3KV_GPU_USD_PER_HOUR / S3KV_GPU_PEAK_TFLOPS / S3KV_PREFILL_MFU (module doc).
GPU_USD_PER_HOUR = 3.0
GPU_PEAK_TFLOPS = 989.4
PREFILL_MFU = 0.65


@dataclass(frozen=True)
class Prices:
    put_per_1k: float = 0.005
    get_per_1k: float = 0.0004
    gb_month: float = 0.023
    retention_h: float = 1.0

    def __post_init__(self) -> None:
        for name in ("put_per_1k", "get_per_1k", "gb_month", "retention_h"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"price {name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_settings(cls, settings: Any) -> Prices:
        return cls(
            settings.cost_put_per_1k_usd,
            settings.cost_get_per_1k_usd,
            settings.cost_gb_month_usd,
            settings.retention_h,
        )

    @property
    def usd_per_byte_s(self) -> float:
        """What a byte stored costs a second."""
        return self.gb_month / GiB / (DAYS_PER_MONTH * 86400)


@dataclass(frozen=True)
class Gpu:
    """What prefill GPU time costs (module doc): $ per GPU-hour, peak TFLOP/s, prefill MFU."""

    usd_per_hour: float = GPU_USD_PER_HOUR
    peak_tflops: float = GPU_PEAK_TFLOPS
    mfu: float = PREFILL_MFU

    def __post_init__(self) -> None:
        for name in ("usd_per_hour", "peak_tflops", "mfu"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.mfu > 1:
            raise ValueError(f"mfu must be at most 1, got {self.mfu!r}")

    @classmethod
    def from_settings(cls, settings: Any) -> Gpu:
        return cls(settings.gpu_usd_per_hour, settings.gpu_peak_tflops, settings.prefill_mfu)

    def seconds(self, flops: float) -> float:
        return flops / (self.peak_tflops * 1e12 * self.mfu)

    def usd(self, flops: float) -> float:
        return self.seconds(flops) * self.usd_per_hour / 3600


#: The prompt length :attr:`Prefill.tokens_per_s` is quoted at. Attention makes a token of a long
#: prompt dearer than one of a short prompt (Gemma-3-27B: 51.5 GFLOP a token at 1k tokens, 52.7 at
#: 8k, 56.6 at 32k), so one tokens-per-second figure needs a length: 8k, a long chat turn or a
#: short document. Costs and values use :meth:`Prefill.seconds` of the real span instead.
REFERENCE_PROMPT_TOKENS = 8192


@dataclass(frozen=True)
class Prefill:
    """What prefill costs on one engine: the one prefill-speed figure (module doc).

    ``model``: the model's geometry (its FLOPs per token); ``gpu``: peak x MFU and $ per GPU-hour;
    ``tp``: the engine's GPUs (they prefill a prompt together); ``tokens_per_s_override`` (> 0): the
    engine's measured throughput, which replaces the FLOP model for time and money alike
    (``S3KV_PREFILL_TOKENS_PER_S``, kept for engines that measured theirs). ``source`` says where
    the figure came from (logged).
    """

    gpu: Gpu = field(default_factory=Gpu)
    model: ModelSpec = field(default_factory=ModelSpec)
    tp: int = 1
    tokens_per_s_override: float = 0.0
    source: str = "default model"

    def gpu_seconds(self, start: int, end: int) -> float:
        """GPU-seconds to prefill tokens ``[start, end)`` of a prompt whose first ``start`` tokens are
        already computed (attention reads them): what a hit of that span saves, over all TP ranks."""
        if end <= start:
            return 0.0
        if self.tokens_per_s_override > 0:
            return (end - start) / self.tokens_per_s_override * self.tp
        return self.gpu.seconds(self.model.prefill_flops(end) - self.model.prefill_flops(start))

    def usd(self, start: int, end: int) -> float:
        """What that prefill costs at the GPU's price."""
        return self.gpu_seconds(start, end) * self.gpu.usd_per_hour / 3600

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens the engine (its ``tp`` GPUs together) prefills per second, for a prompt of
        :data:`REFERENCE_PROMPT_TOKENS`: what a lookup's time budget weighs a hit with."""
        return REFERENCE_PROMPT_TOKENS * self.tp / self.gpu_seconds(0, REFERENCE_PROMPT_TOKENS)

    @classmethod
    def from_settings(cls, settings: Any, model: ModelSpec | None = None, tp: int = 1, source: str = "") -> Prefill:
        """The figure for ``settings`` (GPU price, peak, MFU, and the throughput override),
        ``model`` (None: the model s3kv's defaults describe, Gemma-3-27B) and ``tp`` GPUs."""
        override = float(getattr(settings, "prefill_tokens_per_s", 0.0) or 0.0)
        if override > 0:
            source = "S3KV_PREFILL_TOKENS_PER_S"
        return cls(Gpu.from_settings(settings), model or ModelSpec(), max(1, int(tp)), override,
                   source or "default model")


def value(s3_usd: float, gpu_usd_saved: float) -> dict[str, float | None]:
    """S3 dollars next to the GPU dollars they saved; ``ratio`` below 1: s3kv pays for itself."""
    return {
        "s3_usd": s3_usd,
        "gpu_usd_saved": gpu_usd_saved,
        "ratio": None if gpu_usd_saved <= 0 else s3_usd / gpu_usd_saved,
    }


def put_requests(size: int, threshold: int = MULTIPART_THRESHOLD, part_size: int = PART_SIZE) -> int:
    """PUT-class requests to store one object of ``size`` bytes."""
    if size < threshold:
        return 1
    return 2 + -(-size // part_size)  # create + parts + complete


def get_requests(length: int, split: int = RANGE_SPLIT, cap: int = 0) -> int:
    """GET requests to read one range of ``length`` bytes: the S3 stores' split rule, written
    here only. Parts of about ``split`` bytes, at most ``cap`` of them (``ByteRange.parts``; 0:
    no cap)."""
    n = max(1, round(length / split))
    return min(n, cap) if cap > 0 else n


def stream_share(connections: int, objects_at_once: int, objects: int, index: int = 0) -> int:
    """GETs the ``index``-th object of a load of ``objects`` may split into: the store's
    ``connections`` shared by the objects read beside it -- the load's objects go in waves of
    ``objects_at_once`` (the downloader's threads), and this one's wave is what shares them (a
    load of 9 reads 8, then 1 with every connection: with one share for all, the ninth read alone
    on 4 streams, 1.5x the load's time in a model at 30 ms and 100 MB/s a stream). Why a share at
    all: a long prompt's load of many ~300 MiB objects split at 16 MiB sent five times more GETs
    than there are connections -- the same bytes over the same streams, one billed request each
    (a third of the public trace's S3 bill). A load of one object keeps every connection."""
    per_wave = max(1, objects_at_once)
    wave_start = (max(0, index) // per_wave) * per_wave
    return max(1, connections // max(1, min(per_wave, objects - wave_start)))


@dataclass(frozen=True)
class Usage:
    """S3 traffic and what it bought. Requests as S3 bills them (see the module doc)."""

    put_requests: int = 0
    get_requests: int = 0
    head_requests: int = 0
    #: Bytes written (kept for the retention period).
    bytes_stored: int = 0
    #: Prompt tokens served from the store (prefill skipped).
    tokens_served: int = 0
    #: Tokens whose KV was saved.
    tokens_saved: int = 0


@dataclass(frozen=True)
class Cost:
    put_usd: float
    get_usd: float
    head_usd: float
    storage_usd: float

    @property
    def requests_usd(self) -> float:
        return self.put_usd + self.get_usd + self.head_usd

    @property
    def total_usd(self) -> float:
        return self.requests_usd + self.storage_usd


def cost(usage: Usage, prices: Prices = Prices()) -> Cost:
    """Dollars for ``usage``: its requests, and its bytes kept for the retention period."""
    months = prices.retention_h / HOURS_PER_MONTH
    return Cost(
        put_usd=usage.put_requests * prices.put_per_1k / 1000,
        get_usd=usage.get_requests * prices.get_per_1k / 1000,
        head_usd=usage.head_requests * prices.get_per_1k / 1000,
        storage_usd=usage.bytes_stored / GiB * prices.gb_month * months,
    )


def per_1k_tokens(n: float, tokens: int) -> float | None:
    return None if tokens <= 0 else 1000.0 * n / tokens


def usd_per_million_tokens_served(usage: Usage, prices: Prices = Prices()) -> float | None:
    """Everything S3 cost (requests, and storage over the retention period) per 1M tokens served."""
    if usage.tokens_served <= 0:
        return None
    return cost(usage, prices).total_usd * 1e6 / usage.tokens_served


def usage_from_stats(leader: Any, workers: Any, head_requests: int) -> Usage:
    """A :class:`Usage` from a leader's ``LeaderStats`` (tokens served and saved), its workers'
    ``WorkerStats`` (one or several ranks: PUT/GET requests, bytes uploaded) and the HEADs its
    lookups sent (the store's request counter, e.g. ``s3kv_store_requests_total{op="head"}``)."""
    ws = list(workers) if isinstance(workers, list | tuple) else [workers]
    return Usage(
        put_requests=sum(int(getattr(w, "put_requests", 0)) for w in ws),
        get_requests=sum(int(getattr(w, "get_requests", 0)) for w in ws),
        head_requests=int(head_requests),
        bytes_stored=sum(int(getattr(w, "bytes_uploaded", 0)) for w in ws),
        tokens_served=int(getattr(leader, "hit_tokens", 0)),
        tokens_saved=int(getattr(leader, "tokens_saved", 0)),
    )


def summary(usage: Usage, prices: Prices = Prices()) -> dict[str, float | None]:
    """The figures ``s3kv stats`` and the metrics show: requests per 1k tokens saved / served,
    bytes per token saved, and $ per 1M tokens served."""
    c = cost(usage, prices)
    return {
        "put_per_1k_tokens_saved": per_1k_tokens(usage.put_requests, usage.tokens_saved),
        "get_per_1k_tokens_served": per_1k_tokens(usage.get_requests, usage.tokens_served),
        "head_per_1k_tokens_served": per_1k_tokens(usage.head_requests, usage.tokens_served),
        "bytes_per_token_saved": None if usage.tokens_saved <= 0 else usage.bytes_stored / usage.tokens_saved,
        "usd_requests": c.requests_usd,
        "usd_storage": c.storage_usd,
        "usd_per_1m_tokens_served": usd_per_million_tokens_served(usage, prices),
    }


#: Clock skew between engines, S3 and the host running gc.
EXPIRY_MARGIN_S = 60.0


def expiry_age_s(settings: Any) -> float:
    """The age past which ``gc --expired`` deletes: the retention plus what an engine may still
    believe. An engine that wrote the object believes it there for the retention
    (``KeyIndex.from_settings``); one that saw it (a HEAD within ``index_ttl_s``, a listing within
    ``lookup_summary_trust_s``) promises loads of it without asking again; an object young then
    must outlive that belief, or the promised load finds nothing (a failed load, where refresh
    could not keep it young: a bucket refusing the copy, an engine that only looked it up).
    Settings are the ones gc runs with: engines with longer ones need them here too."""
    return settings.retention_h * 3600.0 + promise_s(settings) + EXPIRY_MARGIN_S


def promise_s(settings: Any) -> float:
    """How long an engine promises loads on an answer it got without asking again: a HEAD's
    (``index_ttl_s``) or a listing's (``lookup_summary_trust_s``). gc's margin covers it
    (:func:`expiry_age_s`), and engines report it for gc (``core.retention``, ``belief_s``)."""
    return settings.index_ttl_s + settings.lookup_summary_trust_s
