"""Settings: one URL plus optional knobs, from env vars or a config file.

Every setting has an env var ``S3KV_<NAME>`` and a key ``<name>`` in the optional
config file named by ``S3KV_CONFIG_FILE`` (JSON, or TOML on Python >= 3.11). Env
wins over the file; explicit keyword overrides win over both. Invalid values fail
at start-up with a ``ConfigError`` that names the setting and what it accepts.
AWS credentials, region and endpoints come from boto3's own chain
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, profiles, instance roles …).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .integrity import IntegrityKeys


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it."""


_SCHEMES = ("s3://", "file://", "memory://")


@dataclass(frozen=True)
class Settings:
    #: Where the cache lives: s3://bucket/prefix, file:///dir, memory://name, or any fsspec URL.
    url: str = ""
    #: Blocks per stored object; 0 = choose from page size (objects of ~target_object_mib).
    blocks_per_object: int = 0
    target_object_mib: int = 32
    max_blocks_per_object: int = 64
    #: "async": parked request, reported from get_finished; "sync": finished inside start_load_kv.
    #: A failed sync load has no safe outcome unless the engine offers a failed-load hook, so
    #: "sync" takes effect only there (else async, with a start-up warning). See docs/failures.md.
    load_mode: str = "async"
    #: Save blocks filled by generation (multi-turn reuse of answers).
    save_decode: bool = True
    #: "window": sliding groups store only the tails a future hit can use; "all": every block.
    storage_policy: str = "window"
    #: Sliding-group tails are also stored at multiples of this many tokens (rounded to objects).
    checkpoint_tokens: int = 4096
    #: Extra blocks below the window a sliding group must supply. 0 trusts the engine's exact page
    #: rule (a page outside the plan still fails loudly); raise it where the engine retains more
    #: than the window (speculative decoding). History-end tails then cannot serve (pages gone).
    window_margin_blocks: int = 0
    #: Smallest hit worth a load, in blocks.
    min_hit_blocks: int = 1
    #: Window policy: a request whose lookup found the full-attention chain stored past the last
    #: servable sliding tail (a shared prefix that is not a checkpoint, then a different suffix)
    #: also stores a sliding tail ending at that branch point, so the next request with that
    #: prefix hits it. Costs one sliding tail per such request (docs/trace-replay.md).
    branch_tails: bool = True
    #: Model identity in the namespace; default is llm_args.model.
    model_id: str = ""
    #: Host staging pool for saves and loads.
    staging_mib: int = 1024
    pinned: bool = True
    #: Hand each save's/load's page copies to cudaMemcpyBatchAsync in a few calls (CUDA >= 12.8,
    #: pinned staging, compute capability < 10); off, or where unavailable, one copy per page.
    batch_copies: bool = True
    upload_threads: int = 4
    download_threads: int = 8
    max_concurrency: int = 32
    #: Lookup: strided probe size of the first HEAD wave.
    lookup_probe_budget: int = 128
    #: Budget for one lookup's HEAD waves (it runs in the engine's scheduling path); past it the
    #: lookup is a miss and its HEADs finish in the background, warming the index. 0 = none.
    lookup_timeout_s: float = 5.0
    #: Local key index bound (~300 bytes an entry).
    index_max_entries: int = 200_000
    index_ttl_s: float = 600.0
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
    multipart_threshold_mib: int = 16
    multipart_part_mib: int = 8
    #: "", "AES256" or "aws:kms".
    sse: str = ""
    sse_kms_key_id: str = ""
    breaker_failures: int = 5
    breaker_reset_s: float = 10.0
    #: Serve Prometheus metrics on this port (0 = off).
    metrics_port: int = 0
    #: List prices for the cost estimate (s3kv/cost.py; S3 Standard, us-east-1): PUT-class and
    #: GET-class (GET, HEAD) requests in $ per 1,000, storage in $ per GB-month, and how long an
    #: object is kept (the bucket's lifecycle expiry; infra/terraform's default is 30 days).
    cost_put_per_1k_usd: float = 0.005
    cost_get_per_1k_usd: float = 0.0004
    cost_gb_month_usd: float = 0.023
    cost_retention_days: float = 30.0
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
        from .integrity import keys_from_settings

        return keys_from_settings(self)

    @property
    def staging_bytes(self) -> int:
        return self.staging_mib * 1024 * 1024

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _env_name(field: str) -> str:
    return "S3KV_" + field.upper()


_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def _convert(name: str, raw: Any, target: type | str) -> Any:
    t = target if isinstance(target, str) else target.__name__
    where = f"{_env_name(name)} / {name}"
    if t == "bool":
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in _BOOL_TRUE:
            return True
        if s in _BOOL_FALSE:
            return False
        raise ConfigError(f"{where}: expected a boolean (true/false/1/0), got {raw!r}")
    if t == "int":
        try:
            return int(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {raw!r}") from None
    if t == "float":
        try:
            return float(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {raw!r}") from None
    return str(raw)


def validate(s: Settings) -> None:
    def need(cond: bool, name: str, accepted: str, value: Any) -> None:
        if not cond:
            raise ConfigError(f"{_env_name(name)} / {name}: {accepted}, got {value!r}")

    if s.url:
        need(
            "://" in s.url,
            "url",
            "expected a URL such as s3://bucket/prefix or file:///path",
            s.url,
        )
    need(s.blocks_per_object >= 0, "blocks_per_object", "must be >= 0 (0 = automatic)", s.blocks_per_object)
    need(s.target_object_mib > 0, "target_object_mib", "must be > 0", s.target_object_mib)
    need(s.max_blocks_per_object > 0, "max_blocks_per_object", "must be > 0", s.max_blocks_per_object)
    need(s.load_mode in ("async", "sync"), "load_mode", "accepted values: async, sync", s.load_mode)
    need(s.storage_policy in ("window", "all"), "storage_policy", "accepted values: window, all", s.storage_policy)
    need(s.checkpoint_tokens > 0, "checkpoint_tokens", "must be > 0", s.checkpoint_tokens)
    need(s.window_margin_blocks >= 0, "window_margin_blocks", "must be >= 0", s.window_margin_blocks)
    need(s.min_hit_blocks >= 1, "min_hit_blocks", "must be >= 1", s.min_hit_blocks)
    need(s.staging_mib > 0, "staging_mib", "must be > 0", s.staging_mib)
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
        "breaker_reset_s",
        "lookup_timeout_s",
    ):
        need(getattr(s, name) >= 0, name, "must be >= 0", getattr(s, name))
    need(s.multipart_part_mib >= 5, "multipart_part_mib", "must be >= 5 (S3's minimum part size)", s.multipart_part_mib)
    need(s.multipart_threshold_mib > 0, "multipart_threshold_mib", "must be > 0", s.multipart_threshold_mib)
    need(s.sse in ("", "AES256", "aws:kms"), "sse", "accepted values: '' (none), AES256, aws:kms", s.sse)
    need(s.breaker_failures > 0, "breaker_failures", "must be > 0", s.breaker_failures)
    need(0 <= s.metrics_port < 65536, "metrics_port", "must be a TCP port or 0", s.metrics_port)
    for name in ("cost_put_per_1k_usd", "cost_get_per_1k_usd", "cost_gb_month_usd", "cost_retention_days"):
        v = getattr(s, name)
        need(v >= 0 and v != float("inf"), name, "must be a finite number >= 0", v)
    # Reads key files now, so a bad or missing key fails at start-up (messages never show a secret).
    _ = s.integrity


def _read_file(path: str) -> Mapping[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"S3KV_CONFIG_FILE: no such file {path!r}")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            import tomllib  # Python >= 3.11

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - report any parse error the same way
        raise ConfigError(f"S3KV_CONFIG_FILE: cannot parse {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"S3KV_CONFIG_FILE: {path!r} must hold a table/object of settings")
    data = data.get("s3kv", data)
    return data


def load_settings(
    env: Mapping[str, str] | None = None, *, require_url: bool = True, **overrides: Any
) -> Settings:
    """Settings from (file < env < overrides). Unknown keys in the file are errors."""
    env = os.environ if env is None else env
    known = {f.name: f for f in fields(Settings)}
    values: dict[str, Any] = {}
    cfg_path = env.get("S3KV_CONFIG_FILE")
    if cfg_path:
        for k, v in _read_file(cfg_path).items():
            if k not in known:
                raise ConfigError(f"S3KV_CONFIG_FILE: unknown setting {k!r}; known: {', '.join(sorted(known))}")
            values[k] = v
    for name in known:
        ev = env.get(_env_name(name))
        if ev is not None:
            values[name] = ev
    values.update({k: v for k, v in overrides.items() if v is not None})
    for k in list(values):
        if k not in known:
            raise ConfigError(f"unknown setting {k!r}")
        values[k] = _convert(k, values[k], known[k].type if not isinstance(known[k].type, str) else known[k].type)
    settings = Settings(**values)
    if require_url and not settings.url:
        raise ConfigError(
            "S3KV_URL / url: not set. Point it at the cache, e.g. S3KV_URL=s3://my-bucket/kv "
            "(also file:///path or any fsspec URL)"
        )
    return settings


def auto_blocks_per_object(page_bytes: int, settings: Settings) -> int:
    """Objects of about ``target_object_mib``: fewer requests (PUTs cost 12x GETs) but bounded size."""
    if settings.blocks_per_object:
        return settings.blocks_per_object
    target = settings.target_object_mib * 1024 * 1024
    return max(1, min(settings.max_blocks_per_object, target // max(1, page_bytes)))


Converter = Callable[[str], Any]
