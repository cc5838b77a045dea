"""Settings: one URL plus optional knobs, from env vars or a config file.

Every setting has an env var ``S3KV_<NAME>`` and a key ``<name>`` in the optional
config file named by ``S3KV_CONFIG_FILE`` (JSON, TOML on Python >= 3.11, or YAML).
Precedence, highest first: explicit keyword overrides (a command's flags), the
environment, the file, the default (:func:`setting_sources` says which one each value
came from; docs/configuration.md says why this order). Invalid values fail at start-up
with a ``ConfigError`` that names where the value came from -- the variable, or the file
and its key -- and what it accepts.
AWS credentials, region and endpoints come from boto3's own chain
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, profiles, instance roles …).

Why this is one module: each setting's name, default, conversion and validation sit together, so the
env var, the file key and the error message cannot disagree.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from .core.integrity import IntegrityKeys

log = logging.getLogger("s3kv.config")


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it.

    ``setting`` and ``detail`` (what is wrong, without the name) let :func:`load_settings` name
    the place a bad value came from: the variable, or the settings file and its key.
    """

    def __init__(self, message: str, setting: str = "", detail: str = ""):
        super().__init__(message)
        self.setting = setting
        self.detail = detail


#: URL schemes S3KV_URL may use. An allow-list, not "anything fsspec knows": fsspec also speaks
#: http(s), ftp, ssh, zip, git, "reference" ... -- a settings file or env var that can name those
#: can make every engine read KV from (or send it to) wherever the URL points.
URL_SCHEMES = ("s3", "file", "memory", "gs", "gcs", "az", "abfs", "abfss")

#: S3KV_* environment variables that are not settings but are still read somewhere
#: (so they draw no "unknown setting" warning).
OTHER_ENV_VARS = frozenset(
    {
        "S3KV_CONFIG_FILE",  # the settings file
        "S3KV_LOG_LEVEL",  # s3kv --log-level's default; demo clusters inherit it
        "S3KV_DEBUG",  # s3kv --debug: full tracebacks instead of one-line errors
        "S3KV_WEED",  # path of the SeaweedFS binary for embedded servers
        "S3KV_TF_PLUGIN_MIRROR",  # tests: terraform provider mirror
        "S3KV_SIM_FUZZ",  # tests: simulator fuzz rounds
        "S3KV_FUZZ_SEEDS",  # tests: fuzz seeds
    }
)

# What may be a URL in free text: a scheme-like word and ":", then everything up to whitespace or
# a quote -- any number of slashes after the ":" (a mistyped ``s3:/AKIA…:secret@bucket`` carries
# credentials as well as ``s3://`` does). Without an "@" it is shown unchanged.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s'\"<>]*")
# A URL's scheme and the slashes after it: kept when the rest is redacted.
_SCHEME_HEAD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(/+)")


def _userinfo_end(url: str) -> int:
    """Index of the last ``@`` that may close a ``user[:password]`` part in ``url``, else -1.

    Why not ``urlsplit(url).netloc``: the authority ends at the first ``/``, and about half of AWS
    secret keys hold one, so in ``s3://AKIA…:wJal…/K7MD…@bucket/p`` the parser sees host
    ``AKIA…:wJal…`` and a path holding the rest of the secret. No parser can tell that from a path
    holding an ``@``, so every ``@`` after the scheme counts -- except in a ``file:///path``, whose
    authority is empty (it cannot carry credentials). A scheme with one slash (``s3:/…``) or none
    is a typo that may still hold a key pair: the same rule.
    """
    head = _SCHEME_HEAD.match(url)
    if head is None:
        return url.rfind("@")
    if head.group(1).lower() == "file" and len(head.group(2)) >= 3:
        return -1
    return url.rfind("@", head.end())


def redact_url(url: str) -> str:
    """``url`` (or a value meant to be one) as it may be shown: no ``user[:password]`` part (see
    :func:`_userinfo_end`), and no query string or fragment (see :func:`query_start`)."""
    at = _userinfo_end(url)
    if at >= 0:
        head = _SCHEME_HEAD.match(url)
        url = f"{head.group(0) if head else ''}***{url[at:]}"
    cut = query_start(url)
    return url if cut < 0 else f"{url[: cut + 1]}***"


def query_start(url: str) -> int:
    """Index of the ``?`` or ``#`` that starts ``url``'s query string or fragment, else -1.

    Why hidden whole: signed and tokenised URLs carry their secret there (``gs://b/p?token=…``,
    an Azure SAS ``?sv=…&sig=…``, ``#access_token=…``), and an fsspec store takes such a query
    as part of its path, so it came back in every error that names a file (issue 37). s3kv's
    own URLs never need either (an s3:// URL with one is refused), so nothing useful is lost.
    """
    marks = [i for i in (url.find("?"), url.find("#")) if i >= 0]
    return min(marks) if marks else -1


def redact(text: str) -> str:
    """``text`` with every URL in it shown by :func:`redact_url`: whatever may be a
    ``user[:password]`` part (all from the scheme's slashes to the URL's last ``@``) and its
    query string and fragment replaced by ``***``."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def has_userinfo(url: str) -> bool:
    """Whether ``url`` may carry credentials (see :func:`_userinfo_end`)."""
    return _userinfo_end(url.strip()) >= 0


def _scheme_hint(parts: Any) -> str:
    """What a user who wrote this URL most likely meant (built from the host and path only, never
    the userinfo part)."""
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6 keeps its brackets
    if parts.port:
        host = f"{host}:{parts.port}"
    bucket, _, prefix = parts.path.strip("/").partition("/")
    target = f"s3://{bucket}/{prefix}".rstrip("/") if bucket else "s3://bucket/prefix"
    return (f". An S3-compatible server (MinIO, SeaweedFS ...) is named by AWS_ENDPOINT_URL_S3: "
            f"AWS_ENDPOINT_URL_S3={parts.scheme.lower()}://{host} with the URL {target}")


def check_url(url: str, name: str = "S3KV_URL / url") -> str:
    """``url`` stripped, if its scheme is allowed and it holds no credentials; else ConfigError.

    Messages never show what may be a credential (see :func:`redact_url`).
    """
    url = url.strip()
    shown = redact_url(url)
    if "://" not in url:
        raise ConfigError(f"{name}: expected a URL such as s3://bucket/prefix or file:///path, got {shown!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in URL_SCHEMES:
        raise ConfigError(
            f"{name}: scheme {parts.scheme + '://'!r} is not allowed, got {shown!r}; "
            f"allowed: {', '.join(s + '://' for s in URL_SCHEMES)}{_scheme_hint(parts)}"
        )
    if has_userinfo(url):
        raise ConfigError(
            f"{name}: credentials in the URL are not accepted (it holds an '@'), got {shown!r}; "
            "use the store's own credential chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, instance roles, ...)"
        )
    if scheme == "s3" and ("?" in url or "#" in url):
        raise ConfigError(
            f"{name}: '?' and '#' are not allowed in an s3:// URL (S3 would read them as part of "
            f"the key, IAM policies would not), got {shown!r}"
        )
    return url


@dataclass(frozen=True)
class Settings:
    #: Where the cache lives: s3://bucket/prefix, file:///dir, memory://name (one process only),
    #: or gs:// / az:// through fsspec (see URL_SCHEMES).
    url: str = ""
    #: Blocks per stored object; 0 = choose from page size (objects of ~target_object_mib).
    blocks_per_object: int = 0
    #: Every object is one PUT-class request (up to the multipart threshold) and the lookup HEADs
    #: one key per object, while storage is billed per byte: a PUT costs what keeping 64 MiB costs
    #: for 2.5 hours, and gc keeps most objects minutes. So full-attention objects are as large as the
    #: checkpoint stride lets them (an object never spans a checkpoint; on Gemma-3-27B one object
    #: per stride, 640 MiB). Against 64 MiB: S3 $ -15% to -45% over the public trace and the
    #: generated family in 1- and 4-engine fleets, tokens served 83-139% (docs/sizing.md); 640 MiB
    #: with 8,192-token checkpoints against 512 with 4,096: docs/trace-replay.md (2026-12-06).
    target_object_mib: int = 640
    #: A bound on pages per object, not the size: the size is ``target_object_mib``'s. Why so high:
    #: at 64 it was the size wherever pages are small -- TensorRT-LLM's 32 tokens a block gave
    #: Gemma-3-27B full-attention objects of 160 MiB, half a stride, and twice the PUTs the trace
    #: replay (64 tokens a block) billed (docs/trace-replay.md, "Objects sized in bytes").
    max_blocks_per_object: int = 1024
    #: "async": parked request, reported from get_finished; "sync": finished inside start_load_kv.
    #: A failed sync load has no safe outcome, and no TensorRT-LLM line can fail one (the failed-load
    #: path covers async loads only), so the adapter loads async (with a start-up warning); "sync"
    #: remains for LeaderCore users whose engine can. See docs/failures.md.
    load_mode: str = "async"
    #: Save blocks filled by generation (multi-turn reuse of answers).
    save_decode: bool = True
    #: "window": sliding groups store only the tails a future hit can use; "all": every block.
    storage_policy: str = "window"
    #: Sliding-group tails are also stored at multiples of this many tokens (rounded to objects).
    #: Why not denser: a checkpoint ends an object, so each is a PUT and a tail per prompt that
    #: passes it, and they serve only prefixes shared that far; shared prefixes that end between
    #: two are found where prompts part (branch tails, from S3's chain or the engine's own prompts).
    checkpoint_tokens: int = 8192
    #: Extra blocks below the window a sliding group must supply. 0 trusts the engine's exact page
    #: rule (a page outside the plan still fails loudly); raise it where the engine retains more
    #: than the window (speculative decoding). History-end tails then cannot serve (pages gone).
    window_margin_blocks: int = 0
    #: An offer that a failed allocation grow would cut to an unservable point (V2, chunked
    #: prefill: ``engine/leader/pressure.py``) is cut to a point inside the request's first chunk:
    #: "pressure" while the engine shows memory pressure (it honoured less recently), "always",
    #: or "off".
    offer_guard: str = "pressure"
    #: Smallest hit worth a load, in blocks.
    min_hit_blocks: int = 1
    #: Window policy: a request whose lookup found the full-attention chain stored past the last
    #: servable sliding tail (a shared prefix that is not a checkpoint, then a different suffix)
    #: also stores a sliding tail ending at that branch point, so the next request with that
    #: prefix hits it. Costs one sliding tail per such request (docs/trace-replay.md).
    branch_tails: bool = True
    #: What goes to S3 (docs/sizing.md, "The value policy"): "auto" writes the objects expected to
    #: earn more prefill time than their bill, learnt from what this engine's hits read; "through"
    #: writes everything now; "back" writes to the host tier, to S3 only what was read there before
    #: it is evicted; "local" the host tier only (back/local need S3KV_HOST_CACHE_GB).
    write_policy: str = "auto"
    #: The value policy writes an object when its expected prefill savings are at least this many
    #: times its S3 bill. 1 (default) maximises the expected net saving; more leaves a margin for
    #: what the estimate cannot see (GPU time saved is worth its price only while GPUs are busy),
    #: at the price of hits: on the public trace 2 cut the ratio 0.198 -> 0.159 but served 83%.
    write_min_return: float = 1.0
    #: Model identity in the namespace; default is llm_args.model.
    model_id: str = ""
    #: Where the model weights' digests are kept between runs, per file and keyed by the file's
    #: identity (path, size, mtime, ctime, inode), so a restart does not read the checkpoint again:
    #: "" = $XDG_CACHE_HOME/s3kv (~/.cache/s3kv); "off" = none (every start hashes every file).
    identity_cache_dir: str = ""
    #: A LoRA adapter whose files (or a link on its path) changed less than this many seconds
    #: before this engine first saw a request for its task id is neither served nor saved under
    #: that id: the request may have arrived, and the engine loaded the adapter, before the change.
    #: It is the longest queue wait (arrival to first scheduling) this covers; 0 = off (only
    #: changes after s3kv first saw the adapter refuse it).
    lora_settle_s: float = 60.0
    #: Host staging pool for saves and loads (per engine process, pinned): a save holds a buffer
    #: per open object and layer group until it is uploaded, so it holds a few of the largest
    #: objects (a Gemma-3-27B sliding tail ~416-442 MiB, a full-attention object 640 MiB).
    staging_mib: int = 4096
    pinned: bool = True
    #: Host tier (DRAM, per TP rank): GiB of s3kv objects kept in host memory in front of the store,
    #: so repeats on this engine load at PCIe speed with no S3 request. -1 = auto: on a GPU engine
    #: 20% of the host's memory (total, or the container's limit) shared by its GPUs, at most
    #: 64 GB a rank (pinned once, at start-up); 0 in the simulator and wherever the KV cache is not
    #: on a GPU. 0 = off (docs/sizing.md: how big).
    host_cache_gb: float = -1.0
    #: Re-check every page's checksum on every host-tier hit. Off: pages are checked when they
    #: enter the tier (hashed where they land, or verified from the store) and each hit checks the
    #: header only -- hashing every hit costs more host time than the copy (s3kv bench staging).
    host_cache_verify: bool = False
    #: Hand each save's/load's page copies to cudaMemcpyBatchAsync in a few calls (CUDA >= 12.8,
    #: pinned staging, compute capability < 10); off, or where unavailable, one copy per page.
    batch_copies: bool = True
    #: PUTs in flight. s3kv writes each object with one conditional PUT (object_store has no
    #: conditional multipart), so its save concurrency is across objects: 8, measured on a
    #: 16-core GPU host against loopback SeaweedFS, saved 1.3-1.7x faster than 4 (0.5-0.64 ->
    #: 0.78-1.07 GB/s), 0.8-0.97x of awscrt's split-part PUTs; staging bounds the bytes held
    #: either way, and a real bucket gives each stream only ~100 MB/s.
    upload_threads: int = 8
    download_threads: int = 8
    max_concurrency: int = 32
    #: Lookup: strided probe size of the first HEAD wave.
    lookup_probe_budget: int = 128
    #: Budget for one lookup's HEAD waves (it runs in the engine's scheduling path, where every
    #: millisecond stalls the whole batch); past it the lookup is a miss and its HEADs finish in
    #: the background, warming the index. -1 = follow the value: the stall-fraction rule below,
    #: and a hit is loaded only where that beats recomputing it at the tiers' measured speeds;
    #: 0 = none; > 0 = this many seconds for every lookup (and every hit is loaded).
    lookup_timeout_s: float = -1.0
    #: A lookup may stall the scheduler for at most this fraction of the prefill time its best
    #: possible hit would save (prompt tokens past the device match / prefill_tokens_per_s) ...
    lookup_stall_fraction: float = 0.5
    #: ... and never longer than this (what a hung store may cost one lookup).
    lookup_max_stall_ms: float = 500.0
    #: Deprecated override of the one prefill-speed figure (s3kv/core/cost.py ``Prefill``): prompt
    #: tokens per second, the engine's TP ranks together. 0 (default): derived from the model's FLOPs
    #: per token (its config.json, read from llm_args.model or the Hugging Face cache) at
    #: gpu_peak_tflops x prefill_mfu per GPU. > 0: this measured throughput, for the lookup budget,
    #: the value policy and the bill alike.
    prefill_tokens_per_s: float = 0.0
    #: HEAD waves of timed-out lookups still running in the background; a lookup that finds this
    #: many is a miss at once (a hung store must not queue waves without bound).
    lookup_max_pending: int = 4
    #: HEADs in flight at once, over all of a leader's waves (obstore client: on one event loop,
    #: no thread each; boto3 uses max_concurrency threads). A wave larger than this costs more
    #: than one round trip: a 128k-token Gemma-3 prompt's verify wave is ~344 HEADs. Each HEAD in
    #: flight holds a connection (a file descriptor), kept idle afterwards for reuse.
    lookup_head_concurrency: int = 512
    #: Helper processes that send and parse the lookup's HEAD waves (obstore client), so a wave
    #: costs the engine's process ~1 ms of CPU instead of ~0.2 ms per HEAD (75 ms for a
    #: 128k-token verify wave), and with several cores its wall time drops too. -1 = half the
    #: usable cores, 1 to 8 (none on one core); 0 = waves run in the engine's process.
    lookup_head_processes: int = -1
    #: Refresh a summary of the namespace's stored objects (one LIST pass by this engine) this
    #: often, so a cold miss costs no request and a cold hit one verify wave, where no fresh fleet
    #: index exists (fleet_index_s); 0 = off (lookups probe with HEADs). Off by default: every
    #: engine listing on its own is what the fleet index replaces.
    lookup_summary_s: float = 0.0
    #: The summary is dropped (lookups probe) when the namespace holds more objects than this.
    lookup_summary_max_objects: int = 500_000
    #: 0: every object a summary hit would load is HEADed (one wave) before it is promised. > 0:
    #: a listing younger than this many seconds counts as a presence observation, as the index's
    #: HEAD answers do (for index_ttl_s): a cold hit then costs no request either. Spans come
    #: from the key and the size; the load still verifies header and checksums before placing.
    lookup_summary_trust_s: float = 0.0
    # -- the fleet index; the lookup's stall priced as latency (docs/operations.md#the-fleet-index)
    #: Fetch the namespace's fleet index (one conditional GET, a 304 while it is unchanged) this
    #: often, seconds; 0 = off. One publisher writes it (`s3kv gc --watch ... --index 10s`); with
    #: a fresh one a cold miss costs no request and a cold hit one verify wave (or none, below).
    #: Without one lookups fall back to the LIST summary (lookup_summary_s) or HEAD waves.
    fleet_index_s: float = 5.0
    #: A fleet index signed with the integrity key and younger than this (at most index_ttl_s)
    #: vouches for the young objects it lists as a HEAD answer does: their hit costs no request.
    #: 0 = every index hit is verified by one HEAD wave. Unsigned indexes are never trusted.
    fleet_index_trust_s: float = 60.0
    #: An index listing more objects than this is refused (lookups fall back); ~18 bytes each.
    fleet_index_max_objects: int = 4_000_000
    #: The inter-token latency one lookup may add to the requests running beside it -- its stall
    #: beyond what the overlap loop hides behind the previous forward -- in ms: set it from your
    #: per-token latency SLO (a lookup with no request beside it is bound by the value rule only).
    lookup_max_added_latency_ms: float = 50.0
    #: At layout registration (before the first request), spend at most about this long paying
    #: what the first lookup would pay once: HEAD helper processes, event loop, connections. 0 = off.
    warm_up_s: float = 10.0
    #: S3 client for s3:// URLs: auto (obstore when installed, else boto3), obstore, boto3.
    s3_client: str = "auto"
    #: Local key index bound (~300 bytes an entry).
    index_max_entries: int = 200_000
    #: How long a HEAD's "present" is believed, seconds (0: never). This engine's own uploads are
    #: believed for what gc keeps (``Listings._follow_retention``): their later hits send no request.
    #: Why 2 minutes: gc keeps *every* object this long past its retention (an engine may promise
    #: a load on a HEAD this old), so each second is storage on everything written, while asking
    #: again costs one HEAD of an object read again. Replayed (27 traces x fleets), 600 s billed
    #: 3-46% more storage where gc keeps the floor or the ceiling, and saved no HEADs to speak of:
    #: the fleet index and this engine's own uploads answer most lookups (docs/trace-replay.md).
    #: Set it alike on gc and engines (gc's margin: ``core.cost.expiry_age_s``).
    index_ttl_s: float = 120.0
    negative_ttl_s: float = 2.0
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    retry_deadline_s: float = 20.0
    max_attempts: int = 6
    #: Deadline of one attempt at a promised load; past it the attempt failed (see docs/failures.md).
    load_timeout_s: float = 60.0
    #: How long an object that failed a load or verification stays "missing" in the local index.
    quarantine_s: float = 600.0
    #: Delete an object whose bytes fail verification (needs s3:DeleteObject; engines usually lack it),
    #: so the next engine that computes that prefix writes it anew.
    delete_corrupt: bool = False
    #: At process exit, wait at most this long for queued uploads (TensorRT-LLM calls no shutdown()).
    exit_drain_s: float = 10.0
    #: Forget a request the engine has not mentioned for this long (0 = never).
    request_state_ttl_s: float = 3600.0
    #: Bodies at least this large go up as (conditional) multipart. 1024: every object s3kv writes
    #: for the models it knows (~32 MiB chunks, sliding-window tails of ~430 MB for Gemma-3-27B) is
    #: ONE conditional PUT -- one billed request, where 8 MiB parts made a tail ~55 (S3 allows
    #: single PUTs up to 5 GiB); parallelism comes from the objects in flight (upload_threads).
    multipart_threshold_mib: int = 1024
    #: Part size above the threshold: 128 MiB keeps a multi-GiB object at a handful of requests.
    multipart_part_mib: int = 128
    #: A load reads an object's range as parallel GETs of about this many MiB (each a billed
    #: request; smaller: more parallel streams per object, more requests). 16: a ~430 MB
    #: sliding-window tail is 27 GETs, still within max_concurrency in one wave, half of 8's.
    range_split_mib: int = 16
    #: "", "AES256" or "aws:kms".
    sse: str = ""
    sse_kms_key_id: str = ""
    breaker_failures: int = 5
    breaker_reset_s: float = 10.0
    #: A HEAD wave unanswered this long, with no call of the store answered since it was sent,
    #: opens the breaker (a hung store fails no call, and lookups past their backlog send none,
    #: so counting failures alone took 40 s); 0 = off.
    breaker_stall_s: float = 2.0
    #: A promised load's read that has not ended this many seconds after it was sent (per
    #: 32 MiB it fetches), or that waits this long for a connection while no read ends, is a
    #: failed load (its failure rung), not a wait; 0 = only load_timeout_s bounds it.
    load_stall_s: float = 5.0
    #: Serve Prometheus metrics on this port (0 = off). With TP > 1 rank r serves port + r.
    metrics_port: int = 0
    #: Address the metrics server binds; loopback unless you mean to expose it (e.g. "0.0.0.0"
    #: for a Prometheus scraping the pod IP).
    metrics_addr: str = "127.0.0.1"
    #: List prices for the cost estimate (s3kv/core/cost.py; S3 Standard, us-east-1): PUT-class and
    #: GET-class (GET, HEAD) requests in $ per 1,000, storage in $ per GB-month.
    cost_put_per_1k_usd: float = 0.005
    cost_get_per_1k_usd: float = 0.0004
    cost_gb_month_usd: float = 0.023
    #: Hours an object is kept after its last write or refresh: what `s3kv gc --watch` enforces
    #: (docs/operations.md) and the cost estimate assumes. 1: 99% of reuses in the conversation
    #: traces came within 26 minutes (docs/sizing.md). An engine refreshes an object it loads at
    #: most once per half of this (refresh_on_hit).
    retention_h: float = 1.0
    #: ``s3kv gc --expired --index`` learns the retention from when the fleet's objects are read
    #: (``s3kv.core.retention``), retention_h its ceiling, and publishes it in the fleet index;
    #: engines then report their reads and refresh by it. false: gc keeps retention_h.
    retention_auto: bool = True
    #: Bump the age of an object this engine loads (a server-side copy onto itself; one PUT-class
    #: request, at most once per retention_h / 2 per object and engine), so a hot prefix outlives
    #: the retention. Needs s3:PutObject and s3:GetObject only, and a bucket that allows CopyObject
    #: (the Terraform module's enforce_write_once refuses it: docs/operations.md).
    refresh_on_hit: bool = True
    #: What the prefill GPU time a hit saves is worth (s3kv/core/cost.py): $ per GPU-hour, the
    #: GPU's peak dense BF16 TFLOP/s (H100/H200 SXM), and the prefill MFU (0.65: measured on an
    #: H200 for Gemma-3-27B, 81-90 us per token).
    gpu_usd_per_hour: float = 3.0
    gpu_peak_tflops: float = 989.4
    prefill_mfu: float = 0.65
    #: Check at start-up that the bucket/prefix is reachable and readable.
    check_access: bool = True
    #: Secret for keyed integrity tags (>= 32 chars, e.g. `openssl rand -hex 32`): objects are
    #: signed with it and objects without a valid tag are misses. Or name a file holding it.
    integrity_key: str = field(default="", repr=False)
    integrity_key_file: str = ""
    #: Secrets also accepted when reading (comma-separated, or one per line in the file): key rotation.
    integrity_previous_keys: str = field(default="", repr=False)
    integrity_previous_keys_file: str = ""

    def __post_init__(self) -> None:
        validate(self)

    @cached_property
    def integrity(self) -> IntegrityKeys | None:
        """The integrity keys (None: integrity tags off). Files are read once, at construction."""
        from .core.integrity import keys_from_settings

        return keys_from_settings(self)

    @property
    def staging_bytes(self) -> int:
        return self.staging_mib * 1024 * 1024

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _env_name(field: str) -> str:
    return "S3KV_" + field.upper()


#: Settings that take one of a few words: the accepted spellings, matched in any case
#: (``S3KV_LOAD_MODE=Sync`` is ``sync``) and stored as written here.
CHOICES: dict[str, tuple[str, ...]] = {
    "load_mode": ("async", "sync"),
    "storage_policy": ("window", "all"),
    "write_policy": ("auto", "through", "back", "local"),
    "offer_guard": ("pressure", "always", "off"),
    "s3_client": ("auto", "obstore", "boto3"),
    "sse": ("", "AES256", "aws:kms"),
}

_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def _bad(name: str, detail: str) -> ConfigError:
    return ConfigError(f"{_env_name(name)} / {name}: {detail}", setting=name, detail=detail)


def _convert(name: str, raw: Any, target: type | str) -> Any:
    t = target if isinstance(target, str) else target.__name__
    if t == "bool":
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in _BOOL_TRUE:
            return True
        if s in _BOOL_FALSE:
            return False
        raise _bad(name, f"expected a boolean (true/false/1/0), got {raw!r}")
    if t == "int":
        try:
            return int(str(raw).strip())
        except ValueError:
            raise _bad(name, f"expected an integer, got {raw!r}") from None
    if t == "float":
        try:
            return float(str(raw).strip())
        except ValueError:
            raise _bad(name, f"expected a number, got {raw!r}") from None
    if isinstance(raw, bool) and name in CHOICES and "off" in CHOICES[name]:
        raw = "off" if raw is False else "on"  # YAML reads a bare `off` as false
    if name in CHOICES:
        word = str(raw).strip()
        return next((c for c in CHOICES[name] if c.lower() == word.lower()), word)
    return str(raw)


def validate(s: Settings) -> None:
    def need(cond: bool, name: str, accepted: str, value: Any) -> None:
        if not cond:
            raise _bad(name, f"{accepted}, got {value!r}")

    if s.url:
        try:
            check_url(s.url)
        except ConfigError as e:
            raise ConfigError(str(e), setting="url", detail=str(e).partition(": ")[2]) from None
    need(s.blocks_per_object >= 0, "blocks_per_object", "must be >= 0 (0 = automatic)", s.blocks_per_object)
    need(s.target_object_mib > 0, "target_object_mib", "must be > 0", s.target_object_mib)
    need(s.max_blocks_per_object > 0, "max_blocks_per_object", "must be > 0", s.max_blocks_per_object)
    for name, accepted in CHOICES.items():
        words = ", ".join(c or "'' (none)" for c in accepted)
        need(getattr(s, name) in accepted, name, f"accepted values: {words} (any case)", getattr(s, name))
    need(s.checkpoint_tokens > 0, "checkpoint_tokens", "must be > 0", s.checkpoint_tokens)
    need(s.window_margin_blocks >= 0, "window_margin_blocks", "must be >= 0", s.window_margin_blocks)
    need(s.min_hit_blocks >= 1, "min_hit_blocks", "must be >= 1", s.min_hit_blocks)
    need(s.staging_mib > 0, "staging_mib", "must be > 0", s.staging_mib)
    need(0 <= s.host_cache_gb < float("inf") or s.host_cache_gb == -1, "host_cache_gb",
         "must be >= 0 (0 = off), or -1 (auto)", s.host_cache_gb)
    need(s.lookup_max_pending >= 0, "lookup_max_pending", "must be >= 0", s.lookup_max_pending)
    need(s.lookup_summary_s >= 0, "lookup_summary_s", "must be >= 0 (0 = off)", s.lookup_summary_s)
    need(s.lookup_summary_trust_s >= 0, "lookup_summary_trust_s", "must be >= 0 (0 = verify)", s.lookup_summary_trust_s)
    need(s.fleet_index_s >= 0, "fleet_index_s", "must be >= 0 (0 = off)", s.fleet_index_s)
    need(s.fleet_index_trust_s >= 0, "fleet_index_trust_s", "must be >= 0 (0 = verify)", s.fleet_index_trust_s)
    need(s.fleet_index_max_objects > 0, "fleet_index_max_objects", "must be > 0", s.fleet_index_max_objects)
    need(s.lookup_max_added_latency_ms >= 0, "lookup_max_added_latency_ms", "must be >= 0",
         s.lookup_max_added_latency_ms)
    need(s.identity_cache_dir in ("", "off") or os.path.isabs(os.path.expanduser(s.identity_cache_dir)),
         "identity_cache_dir", "must be an absolute path, '' (the user cache directory) or 'off'",
         s.identity_cache_dir)
    need(s.lookup_head_processes >= -1, "lookup_head_processes", "must be >= 0, or -1 (auto)", s.lookup_head_processes)
    for name in ("lookup_head_concurrency", "lookup_summary_max_objects"):
        need(getattr(s, name) > 0, name, "must be > 0", getattr(s, name))
    for name in ("upload_threads", "download_threads", "max_concurrency", "lookup_probe_budget", "max_attempts"):
        need(getattr(s, name) > 0, name, "must be > 0", getattr(s, name))
    need(s.index_max_entries >= 0, "index_max_entries", "must be >= 0", s.index_max_entries)
    for name in (
        "index_ttl_s",
        "negative_ttl_s",
        "connect_timeout_s",
        "read_timeout_s",
        "retry_deadline_s",
        "load_timeout_s",
        "quarantine_s",
        "exit_drain_s",
        "request_state_ttl_s",
        "breaker_reset_s",
        "breaker_stall_s",
        "load_stall_s",
        "lookup_max_stall_ms",
        "warm_up_s",
        "lora_settle_s",
    ):
        need(getattr(s, name) >= 0, name, "must be >= 0", getattr(s, name))
    need(s.lookup_timeout_s >= 0 or s.lookup_timeout_s == -1, "lookup_timeout_s",
         "must be >= 0, or -1 (follow the value)", s.lookup_timeout_s)
    need(0 < s.lookup_stall_fraction <= 10, "lookup_stall_fraction", "must be in (0, 10]", s.lookup_stall_fraction)
    need(s.write_min_return > 0 and s.write_min_return != float("inf"), "write_min_return",
         "must be a finite number > 0", s.write_min_return)
    need(s.prefill_tokens_per_s >= 0, "prefill_tokens_per_s", "must be >= 0 (0 = from the model's FLOPs)",
         s.prefill_tokens_per_s)
    need(s.multipart_part_mib >= 5, "multipart_part_mib", "must be >= 5 (S3's minimum part size)", s.multipart_part_mib)
    need(s.multipart_threshold_mib > 0, "multipart_threshold_mib", "must be > 0", s.multipart_threshold_mib)
    need(s.range_split_mib > 0, "range_split_mib", "must be > 0", s.range_split_mib)
    need(s.breaker_failures > 0, "breaker_failures", "must be > 0", s.breaker_failures)
    need(0 <= s.metrics_port < 65536, "metrics_port", "must be a TCP port or 0", s.metrics_port)
    need(_is_bind_address(s.metrics_addr), "metrics_addr", "expected an IP address or 'localhost'", s.metrics_addr)
    for name in ("cost_put_per_1k_usd", "cost_get_per_1k_usd", "cost_gb_month_usd", "retention_h"):
        v = getattr(s, name)
        need(v >= 0 and v != float("inf"), name, "must be a finite number >= 0", v)
    need(s.retention_h > 0, "retention_h", "must be > 0 (hours)", s.retention_h)
    for name in ("gpu_usd_per_hour", "gpu_peak_tflops"):
        v = getattr(s, name)
        need(0 < v < float("inf"), name, "must be a finite number > 0", v)
    need(0 < s.prefill_mfu <= 1, "prefill_mfu", "must be in (0, 1]", s.prefill_mfu)
    # Reads key files now, so a bad or missing key fails at start-up (messages never show a secret).
    _ = s.integrity


def _is_bind_address(text: str) -> bool:
    if text == "localhost":
        return True
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


#: What S3KV_CONFIG_FILE may hold, for the messages that reject a file.
FILE_FORMATS = ("JSON (any name), TOML (a name ending in .toml, Python >= 3.11) or YAML (a name ending in "
                ".yaml or .yml, read with PyYAML)")


def _read_file(path: str) -> Mapping[str, Any]:
    """The settings in the file ``S3KV_CONFIG_FILE`` names; every failure is one ConfigError
    naming the variable and the file."""
    where = f"S3KV_CONFIG_FILE={path!r}"
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{where}: is a directory; name the settings file itself ({FILE_FORMATS})")
    if not stat.S_ISREG(mode):
        # A FIFO or a device: reading one could block the engine's start for ever.
        raise ConfigError(f"{where}: is not a regular file; name a settings file ({FILE_FORMATS})")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a text file (not UTF-8); expected {FILE_FORMATS}") from None
    suffix = p.suffix.lower()
    fmt = "TOML" if suffix == ".toml" else "YAML" if suffix in (".yaml", ".yml") else "JSON"
    try:
        if fmt == "TOML":
            import tomllib  # Python >= 3.11
            data = tomllib.loads(text)
        elif fmt == "YAML":
            import yaml  # PyYAML: TensorRT-LLM depends on it; s3kv only where a .yaml file is named
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError:
        need = "Python >= 3.11" if fmt == "TOML" else "PyYAML (pip install pyyaml)"
        raise ConfigError(f"{where}: reading {fmt} needs {need}; or write the settings as JSON") from None
    except Exception as e:  # noqa: BLE001 - json's, tomllib's and yaml's parse errors
        if not isinstance(e, ValueError) and type(e).__module__.split(".")[0] != "yaml":
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else "not valid"
        mark = getattr(e, "problem_mark", None)
        if getattr(e, "problem", None) and mark is not None:  # yaml's: where, without its dump of the text
            first = f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"  # type: ignore[attr-defined]
        raise ConfigError(f"{where}: cannot parse it as {fmt}: {first}; expected {FILE_FORMATS}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a table/object of settings ({FILE_FORMATS})")
    data = data.get("s3kv", data)
    return data


def _did_you_mean(word: str, candidates: list[str]) -> str:
    # Compare without the shared "S3KV_" so that it does not make every name look close.
    def bare(name: str) -> str:
        return name[5:] if name.upper().startswith("S3KV_") else name

    by_bare = {bare(c): c for c in candidates}
    close = difflib.get_close_matches(bare(word), list(by_bare), n=1, cutoff=0.6)
    return f"; did you mean {by_bare[close[0]]}?" if close else ""


def unknown_env_names(env: Mapping[str, str] | None = None) -> list[str]:
    """``S3KV_*`` variables in ``env`` that s3kv does not read (typos, old names)."""
    env = os.environ if env is None else env
    known = {_env_name(f.name) for f in fields(Settings)} | OTHER_ENV_VARS
    return sorted(n for n in env if n.upper().startswith("S3KV_") and n not in known)


def unknown_env_vars(env: Mapping[str, str] | None = None) -> list[str]:
    """One message per ``S3KV_*`` variable in ``env`` that s3kv does not read, naming the closest
    variable it does read."""
    names = [_env_name(f.name) for f in fields(Settings)] + sorted(OTHER_ENV_VARS)
    return [
        f"{n} is not an s3kv setting and is ignored{_did_you_mean(n.upper(), names)}"
        for n in unknown_env_names(env)
    ]


#: Every message :func:`warn_once` has said (or been told was said) in this process, in order.
_SAID: list[str] = []


@functools.lru_cache(maxsize=256)
def warn_once(message: str) -> None:
    # Leader and workers of one process load settings separately; say it once.
    _SAID.append(message)
    log.warning("%s", message)


def warnings_said() -> list[str]:
    """What :func:`warn_once` said in this process: a tool that runs one job in several processes
    (the demo's clusters) hands it to the next, so the user reads each warning once."""
    return list(_SAID)


def mark_said(messages: list[str]) -> None:
    """Count ``messages`` as said here already: :func:`warn_once` stays quiet about them."""
    was, log.disabled = log.disabled, True
    try:
        for m in messages:
            warn_once(m)
    finally:
        log.disabled = was


def explicit_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Settings the user chose, by name, with where: ``"S3KV_X"`` (env) or ``"S3KV_CONFIG_FILE"``.

    For tools that have their own defaults (the demo): they may apply them only where the user
    chose nothing, never over the user's choice.
    """
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    cfg_path = env.get("S3KV_CONFIG_FILE")
    if cfg_path:
        out.update({k: "S3KV_CONFIG_FILE" for k in _read_file(cfg_path)})
    for f in fields(Settings):
        if env.get(_env_name(f.name)) is not None:
            out[f.name] = _env_name(f.name)
    return out


def _gather(env: Mapping[str, str], overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(raw values, where each came from) for the settings set anywhere: file < env < overrides.
    Unknown keys in the file and unknown overrides are errors."""
    known = {f.name for f in fields(Settings)}
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    cfg_path = env.get("S3KV_CONFIG_FILE")
    if cfg_path:
        for k, v in _read_file(cfg_path).items():
            if k not in known:
                raise ConfigError(
                    f"S3KV_CONFIG_FILE: unknown setting {k!r} in {cfg_path!r}{_did_you_mean(k, sorted(known))}"
                )
            values[k], source[k] = v, "file"
    for name in known:
        ev = env.get(_env_name(name))
        if ev is not None:
            values[name], source[name] = ev, "env"
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in known:
            raise ConfigError(f"unknown setting {k!r}")
        values[k], source[k] = v, "flag"
    return values, source


def _from_file(e: ConfigError, source: Mapping[str, str], env: Mapping[str, str]) -> ConfigError:
    """``e`` naming the settings file and its key when the bad value came from the file (its
    message names the variable, which the user did not set)."""
    if e.setting and source.get(e.setting) == "file":
        path = env.get("S3KV_CONFIG_FILE", "")
        return ConfigError(f"S3KV_CONFIG_FILE={path!r}, key {e.setting!r}: {e.detail}", e.setting, e.detail)
    return e


def load_settings(
    env: Mapping[str, str] | None = None, *, require_url: bool = True, **overrides: Any
) -> Settings:
    """Settings from (file < env < overrides). Unknown keys in the file are errors; unknown
    ``S3KV_*`` env vars are logged once as warnings (with the closest setting's name)."""
    env = os.environ if env is None else env
    known = {f.name: f for f in fields(Settings)}
    values, source = _gather(env, overrides)
    for message in unknown_env_vars(env):
        warn_once(message)
    try:
        for k in list(values):
            values[k] = _convert(k, values[k], known[k].type)
        settings = Settings(**values)
    except ConfigError as e:
        raise _from_file(e, source, env) from None
    if require_url and not settings.url:
        raise ConfigError(
            "S3KV_URL / url: not set. Point it at the cache, e.g. S3KV_URL=s3://my-bucket/kv "
            f"(allowed schemes: {', '.join(s + '://' for s in URL_SCHEMES)})"
        )
    return settings


def file_values(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The raw key/values of the file ``S3KV_CONFIG_FILE`` names ({} when none is named)."""
    env = os.environ if env is None else env
    path = env.get("S3KV_CONFIG_FILE")
    return dict(_read_file(path)) if path else {}


def setting_sources(env: Mapping[str, str] | None = None, **overrides: Any) -> tuple[Settings, dict[str, str]]:
    """The settings :func:`load_settings` would build (no URL required), and where each value came
    from: ``"default"``, ``"file"`` (``S3KV_CONFIG_FILE``), ``"env"`` (``S3KV_<NAME>``) or ``"flag"``
    (an override, i.e. a command-line option). For ``s3kv config``."""
    env = os.environ if env is None else env
    settings = load_settings(env, require_url=False, **overrides)
    _, source = _gather(env, overrides)
    return settings, {f.name: source.get(f.name, "default") for f in fields(Settings)}


def auto_blocks_per_object(page_bytes: int, settings: Settings) -> int:
    """Objects of about ``target_object_mib``: fewer requests (PUTs cost 12x GETs) but bounded size."""
    if settings.blocks_per_object:
        return settings.blocks_per_object
    target = settings.target_object_mib * 1024 * 1024
    return max(1, min(settings.max_blocks_per_object, target // max(1, page_bytes)))

