"""What the leader and the workers of one engine share inside one process.

TensorRT-LLM builds the scheduler-side connector and the rank-0 worker in the
same process from the same ``llm_args``. Only the worker is told the cache
layout (``register_kv_cache_layout``), and only it learns which uploads
succeeded -- yet the leader needs the layout to name keys and the confirmed
uploads to answer warm lookups without a HEAD. ``EngineRuntime`` is that shared
piece: one store client (one connection pool), one key index, the geometry.

The registry below is the one process-global in s3kv. It is keyed by the
engine's identity (URL, model, block size, windows, TP size -- or an explicit
``engine_key``), so several ranks or several simulated engines in one process
never mix, and a leader built before its worker still finds the layout later.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..core.layout import CacheGeometry
from ..store.base import ObjectStore
from ..store.breaker import BreakerPolicy, CircuitBreakerStore
from ..store.refresh import RefreshOnHit
from .index import KeyIndex
from .metrics import Metrics, MetricsStore, serve_for_rank

log = logging.getLogger("s3kv.runtime")


@dataclass
class EngineRuntime:
    key: str
    settings: Settings
    store: ObjectStore
    key_prefix: str
    index: KeyIndex
    metrics: Metrics = field(default_factory=Metrics)
    geometry: CacheGeometry | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    refs: int = 0
    http_server: Any = None
    #: Close the store with the runtime only if the runtime opened it (a caller's store is theirs).
    owns_store: bool = True
    _geometry_ready: bool = False
    _geometry_callbacks: list[Any] = field(default_factory=list)
    #: Seconds the warm-up at layout registration took (None: not run).
    warm_up_s: float | None = None
    #: Rank 0's host tier (``s3kv.transfer.hosttier``) and its workers' measured load speeds per
    #: tier, published when its worker registers the layout: what the leader's lookups answer
    #: from first and weigh a hit by.
    host_tier: Any = None
    speeds: Any = None

    def observe(self, leader_stats: Any = None, worker_stats: Any = None, source: str = "worker") -> None:
        """Copy cumulative connector stats into the Prometheus metrics."""
        if leader_stats is not None:
            self.metrics.observe_leader(leader_stats)
            helpers = head_helpers_of(self.store)
            if helpers is not None:
                self.metrics.observe_head_helpers(helpers.stats())
        if worker_stats is not None:
            self.metrics.observe_worker(worker_stats, source=source)

    def publish_geometry(self, geometry: CacheGeometry) -> None:
        with self.lock:
            if self.geometry is not None and self.geometry != geometry:
                # Ranks of one engine agree on the geometry by construction; a
                # difference means two engines collided on one key.
                raise RuntimeError(
                    f"s3kv engine {self.key!r}: a worker registered a different cache geometry "
                    f"({geometry}) than another ({self.geometry}); give each engine its own engine_key"
                )
            self.geometry = geometry

    def get_geometry(self) -> CacheGeometry | None:
        return self.geometry

    def on_geometry(self, callback: Any) -> None:
        """Call ``callback()`` once the rank-0 worker registered the layout (at once if it has)."""
        with self.lock:
            if not self._geometry_ready:
                self._geometry_callbacks.append(callback)
                return
        callback()

    def geometry_ready(self) -> None:
        self.warm_up()
        with self.lock:
            self._geometry_ready = True
            callbacks, self._geometry_callbacks = self._geometry_callbacks, []
        for cb in callbacks:
            cb()

    def warm_up(self) -> float | None:
        """Pay now, at layout registration (before the first request), what the first lookup
        would pay once: the HEAD helper processes started and ready, the client's event loop,
        credentials, DNS and connections (HEAD waves, of every size the client treats apart, of
        keys that do not exist). Takes at most about ``warm_up_s``; never raises; measured.

        Why: a fresh engine's first lookups took 140-240 ms on a 2-core host with no latency at
        all (helpers starting, waves in-process meanwhile, connections opening) -- past any
        sensible budget, so an autoscaled engine's first requests missed, however warm the bucket.
        """
        limit = self.settings.warm_up_s
        if limit <= 0 or self.warm_up_s is not None:
            return self.warm_up_s
        t0 = time.perf_counter()
        base = f"{self.key_prefix.rstrip('/')}/.s3kv-warm-up/" if self.key_prefix else ".s3kv-warm-up/"
        try:
            helpers = head_helpers_of(self.store)
            self.store.head_many([base + "0"])  # one key: the plain request path
            self.store.head_many([base + "0", base + "1"])  # a small wave: the client's event loop
            if helpers is not None:
                ready = helpers.wait_ready(timeout=limit)
                from ..store.headprocs import MIN_SHARE

                # A share for every helper, MIN_SHARE HEADs in flight each: their connections.
                n = MIN_SHARE * max(1, helpers.ready_count())
                self.store.head_many([base + str(i) for i in range(n)])
                if not ready:
                    log.warning("s3kv: lookup helper processes not all ready after %.1f s (S3KV_WARM_UP_S); "
                                "their share of the first lookups runs in the engine's process", limit)
        except Exception as e:  # noqa: BLE001 - warming is best effort; a dead store shows in lookups
            log.warning("s3kv: warming the store client up failed: %s", e)
        self.warm_up_s = time.perf_counter() - t0
        self.metrics.warm_up_seconds.set(self.warm_up_s)
        log.info("s3kv: store client warmed up in %.3f s (before the first request)", self.warm_up_s)
        return self.warm_up_s


_REGISTRY: dict[str, EngineRuntime] = {}
_REGISTRY_LOCK = threading.Lock()


def engine_key_for(llm_args: Any, settings: Settings) -> str:
    kv = getattr(llm_args, "kv_cache_config", None)
    windows = tuple(getattr(kv, "max_attention_window", None) or ())
    tpb = getattr(kv, "tokens_per_block", None)
    mapping = llm_args.parallel_config.to_mapping()
    return repr(
        (settings.url, settings.model_id or str(getattr(llm_args, "model", "")), tpb, windows,
         getattr(llm_args, "max_seq_len", None), mapping.tp_size)
    )


def head_helpers_of(store: Any) -> Any:
    """The HEAD helper processes behind ``store``'s wrappers (breaker, metrics ...), or None."""
    for _ in range(16):  # wrappers nest a few deep; never loop on a cycle
        helpers = getattr(store, "head_helpers", None)
        if helpers is not None:
            return helpers
        store = getattr(store, "inner", None)
        if store is None:
            return None
    return None


def s3_options(settings: Settings) -> Any:
    """The ``S3Options`` the settings describe (timeouts, retries, multipart, SSE)."""
    from ..store.headprocs import auto_processes
    from ..store.retrying import RetryPolicy
    from ..store.s3 import S3Options

    mib = 1024 * 1024
    return S3Options(
        max_concurrency=settings.max_concurrency,
        connect_timeout_s=settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        retry=RetryPolicy(max_attempts=settings.max_attempts, deadline_s=settings.retry_deadline_s),
        multipart_threshold=settings.multipart_threshold_mib * mib,
        part_size=settings.multipart_part_mib * mib,
        range_split_bytes=settings.range_split_mib * mib,
        sse=settings.sse or None,  # type: ignore[arg-type]  # validated by Settings
        sse_kms_key_id=settings.sse_kms_key_id or None,
        client=settings.s3_client,  # type: ignore[arg-type]  # validated by Settings
        head_concurrency=settings.lookup_head_concurrency,
        head_processes=auto_processes() if settings.lookup_head_processes < 0 else settings.lookup_head_processes,
    )


def open_runtime_store(settings: Settings) -> tuple[ObjectStore, str]:
    """The store behind ``settings.url`` and the key prefix to build keys under."""
    from ..store.factory import open_store, parse_store_url

    scheme, _bucket, prefix = parse_store_url(settings.url)
    store = open_store(settings.url, options=s3_options(settings) if scheme == "s3" else None)
    return store, prefix


def acquire_runtime(
    llm_args: Any,
    settings: Settings,
    *,
    store: ObjectStore | None = None,
    key_prefix: str | None = None,
    engine_key: str | None = None,
) -> EngineRuntime:
    key = engine_key or engine_key_for(llm_args, settings)
    with _REGISTRY_LOCK:
        rt = _REGISTRY.get(key)
        if rt is None:
            owns_store = store is None
            prefix = ""
            if store is None:
                store, prefix = open_runtime_store(settings)
                if settings.check_access:
                    # One clear error at start-up rather than per-request noise.
                    store.check_access()
            if key_prefix is not None:
                prefix = key_prefix
            metrics = Metrics()
            # Metrics count every request that reaches the store; the breaker sits
            # outside them so an open breaker answers at once without touching it.
            if settings.refresh_on_hit:  # keeps loaded objects young under s3kv gc's retention
                store = RefreshOnHit(store, settings.retention_h * 3600 / 2, on_outcome=metrics.on_refresh)
            wrapped: ObjectStore = CircuitBreakerStore(
                MetricsStore(store, metrics),
                BreakerPolicy.from_settings(settings),
                on_transition=metrics.on_breaker_transition,
                name=key,
            )
            rt = EngineRuntime(
                key=key,
                settings=settings,
                store=wrapped,
                key_prefix=prefix,
                index=KeyIndex.from_settings(settings),
                metrics=metrics,
                owns_store=owns_store,
            )
            if settings.metrics_port:
                # Every tensor-parallel rank is its own process with its own registry: rank r
                # serves port + r (only rank 0's would be seen otherwise).
                mapping = llm_args.parallel_config.to_mapping()
                port = settings.metrics_port + int(mapping.tp_rank)
                try:
                    rt.http_server = serve_for_rank(
                        metrics, settings.metrics_port, int(mapping.tp_rank), int(mapping.tp_size),
                        settings.metrics_addr,
                    )
                    log.info("s3kv metrics on %s:%d", settings.metrics_addr, port)
                except (OSError, ValueError) as e:  # port taken (another engine here) or past 65535
                    log.warning("s3kv: cannot serve metrics on port %d: %s", port, e)
            _REGISTRY[key] = rt
        rt.refs += 1
        return rt


def release_runtime(rt: EngineRuntime) -> None:
    with _REGISTRY_LOCK:
        rt.refs -= 1
        if rt.refs <= 0 and _REGISTRY.get(rt.key) is rt:
            del _REGISTRY[rt.key]
            if rt.http_server is not None:
                try:
                    rt.http_server.shutdown()
                except Exception:  # noqa: BLE001
                    log.debug("stopping the metrics server failed", exc_info=True)
            if not rt.owns_store:
                return
            try:
                rt.store.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("closing store failed", exc_info=True)
