"""The TensorRT-LLM adapter: a thin translation from engine objects to s3kv's cores.

Wire it with::

    KvCacheConnectorConfig(
        connector_module="s3kv.trtllm",
        connector_scheduler_class="S3KvConnectorLeader",
        connector_worker_class="S3KvConnectorWorker",
    )

and ``S3KV_URL=s3://bucket/prefix`` in the environment. Both classes are built
as ``cls(llm_args)``; the optional keyword arguments exist for the simulator and
tests (an explicit store, settings, engine key or engine features), never needed
in production.

Failure policy at this boundary: **no exception ever escapes a connector call**
once the engine is up. TensorRT-LLM's executor dies on one (every request on the
engine fails; under TP the other ranks hang in their next collective). So every
hook below catches, logs, counts and degrades to the least harmful answer: a
lookup error is a miss, a save error a dropped save, a load that cannot be
completed with verified bytes takes the failure rung the installed engine
allows (docs/failures.md). Only bring-up -- the constructors and
``register_kv_cache_layout`` -- refuses what s3kv cannot serve correctly, with
one clear message, before the first request.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from .config import Settings, load_settings
from .core.errors import LoadFailed, S3KvError
from .core.layout import CacheGeometry, expected_windows
from .core.plan import ConnectorMetadata
from .engine.leader import LeaderCore
from .engine.runtime import EngineRuntime, acquire_runtime, release_runtime
from .store.base import ObjectStore
from .trtllm_api import (
    FAILED_LOAD_HOOK,
    HAVE_TRTLLM,
    KvCacheBufferRef,
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
    engine_features,
)

log = logging.getLogger("s3kv.trtllm")

#: Cumulative stats are copied into the Prometheus metrics at most this often (scheduler hot path).
_OBSERVE_EVERY_S = 1.0

__all__ = ["S3KvConnectorLeader", "S3KvConnectorWorker", "HAVE_TRTLLM", "LoadFailed", "UnsupportedEngine"]


class UnsupportedEngine(S3KvError, ValueError):
    """Bring-up refused: this engine configuration cannot be served correctly (the message says why)."""


def _mapping(llm_args: Any) -> Any:
    return llm_args.parallel_config.to_mapping()


def _kv_dtype(llm_args: Any) -> str:
    from .identity import model_identity

    return model_identity(llm_args).kv_dtype  # resolved: "auto" -> the dtype the pages really hold


def _model_id(llm_args: Any, settings: Settings) -> str:
    from .identity import model_identity

    # Name, revision, model dtype, quantization, config digest (see s3kv/identity.py).
    return model_identity(llm_args, settings.model_id).model_id


def _settings(settings: Settings | None) -> Settings:
    return settings if settings is not None else load_settings()


def _check_engine(llm_args: Any) -> None:
    """Refuse, at construction, engine settings s3kv cannot serve correctly."""
    if getattr(llm_args, "enable_attention_dp", False):
        raise UnsupportedEngine(
            "s3kv does not support attention data parallelism (enable_attention_dp=True): "
            "each DP rank would need its own scheduler-side state; turn it off for this engine"
        )
    if getattr(llm_args, "disable_overlap_scheduler", True) is False:
        # The overlap loop reports generation one token behind and handles a request's end
        # one iteration late; s3kv's finish plans are proven on the non-overlap loop only.
        raise UnsupportedEngine(
            "s3kv needs TensorRT-LLM's non-overlap executor loop: pass disable_overlap_scheduler=True "
            "to LLM(...) (the overlap scheduler is on by default; upstream's connector examples turn it off)"
        )


def _features(explicit: Any) -> frozenset[str]:
    return frozenset(explicit) if explicit is not None else engine_features()


class _Contain:
    """Catch, log and count what a hook raised; the engine must never see it."""

    def __init__(self, role: str):
        self.role = role
        self.errors: Counter[str] = Counter()
        self._last_log: dict[str, float] = {}

    def __call__(self, hook: str, exc: BaseException) -> None:
        self.errors[hook] += 1
        now = time.monotonic()
        if now - self._last_log.get(hook, 0.0) >= 10.0:  # one traceback per hook per 10 s
            self._last_log[hook] = now
            log.error("s3kv %s: %s() failed (contained; %d so far): %r", self.role, hook,
                      self.errors[hook], exc, exc_info=exc)


class S3KvConnectorLeader(KvCacheConnectorScheduler):
    """Scheduler side (rank 0): lookups, load plans, save plans."""

    supports_attention_dp = False
    #: Honoured by TensorRT-LLM lines that know the flag; older ones are checked in __init__.
    requires_disable_overlap_scheduler = True

    def __init__(
        self,
        llm_args: Any,
        *,
        settings: Settings | None = None,
        store: ObjectStore | None = None,
        key_prefix: str | None = None,
        engine_key: str | None = None,
        engine_features: Any = None,
    ):
        super().__init__(llm_args)
        _check_engine(llm_args)
        self._llm_args = llm_args
        self._observed_at = 0.0
        self._contain = _Contain("leader")
        self.settings = _settings(settings)
        self.features = _features(engine_features)
        mapping = _mapping(llm_args)
        self._runtime: EngineRuntime = acquire_runtime(
            llm_args, self.settings, store=store, key_prefix=key_prefix, engine_key=engine_key
        )
        hook = FAILED_LOAD_HOOK in self.features
        if self.settings.load_mode == "sync" and not hook:
            log.warning(
                "s3kv: S3KV_LOAD_MODE=sync needs an engine that can recompute a request whose load "
                "failed (a failed-load hook); this TensorRT-LLM has none, so loads are async "
                "(see docs/failures.md)"
            )
        kv = getattr(llm_args, "kv_cache_config", None)
        if getattr(kv, "enable_partial_reuse", False):
            log.warning(
                "s3kv: partial block reuse is on: a device match that ends inside a block gets no S3 "
                "hit (counted as partial_block_misses); set kv_cache_config.enable_partial_reuse=False "
                "for full S3 hits"
            )
        # The namespace summary's first LIST should not race the first lookups: start its
        # refresher (background thread) once the worker has registered the layout.
        self._runtime.on_geometry(self._start_summary)
        self.core = LeaderCore(
            self.settings,
            self._runtime.store,
            self._runtime.key_prefix,
            tp_size=int(mapping.tp_size),
            model_id=_model_id(llm_args, self.settings),
            kv_dtype=_kv_dtype(llm_args),
            index=self._runtime.index,
            geometry=self._runtime.get_geometry,
            failed_load_hook=hook,
        )

    @property
    def errors(self) -> Counter[str]:
        """Exceptions contained per hook (each one would have killed the engine)."""
        return self._contain.errors

    def _start_summary(self) -> None:
        try:
            summary = self.core.lookup_summary()
            if summary is not None:
                summary.start()
        except Exception as e:  # noqa: BLE001 - an optional accelerator; lookups probe without it
            self._contain("lookup_summary", e)

    # -- allocation --------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            mm = getattr(request, "multimodal_hashes", None)
            has_mm = bool(mm) or bool(getattr(request, "multimodal_positions", None))
            salt = getattr(request, "cache_salt", None)
            if salt is None:
                salt = getattr(request, "cache_salt_id", None)
            tokens = list(request.get_tokens(0))
            prompt_len = int(getattr(request, "prompt_len", len(tokens)))
            n, is_async = self.core.get_num_new_matched_tokens(
                int(request.request_id),
                tokens,
                prompt_len,
                int(num_computed_tokens),
                cache_salt=salt,
                lora_id=getattr(request, "lora_task_id", None),
                multimodal_hashes=mm,
                has_multimodal=has_mm,
            )
        except Exception as e:  # noqa: BLE001 - a lookup must never fail a request
            self._contain("get_num_new_matched_tokens", e)
            return 0, False
        # (0, True) makes the engine raise: never answer async without tokens.
        return (int(n), bool(is_async)) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.update_state_after_alloc_by_layer_group(request, [list(block_ids)])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: Any) -> None:
        try:
            honoured = getattr(request, "py_num_connector_matched_tokens", None)
            self.core.update_state_after_alloc(
                int(request.request_id), block_ids_by_layer_group, None if honoured is None else int(honoured)
            )
        except Exception as e:  # noqa: BLE001
            self._contain("update_state_after_alloc", e)
            self.core.break_promise(int(request.request_id), f"planning its load failed: {e!r}")

    # -- per iteration -----------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        new = list(getattr(scheduler_output, "new_requests", None) or [])
        cached = list(getattr(scheduler_output, "cached_requests", None) or [])
        try:
            meta = self.core.build_connector_meta(new, cached)
        except Exception as e:  # noqa: BLE001
            self._contain("build_connector_meta", e)
            meta = self.core.fail_safe_meta()
        now = time.monotonic()
        if now - self._observed_at >= _OBSERVE_EVERY_S:
            self._observed_at = now
            try:
                self._runtime.observe(leader_stats=self.core.stats)
            except Exception as e:  # noqa: BLE001
                self._contain("observe", e)
        return meta

    # -- optional engine hooks (some TensorRT-LLM lines call them; feature-detected by the engine) --
    def cancel_load(self, request: Any, start: int, end: int) -> None:
        try:
            self.core.cancel_load(int(request.request_id), int(start), int(end))
        except Exception as e:  # noqa: BLE001
            self._contain("cancel_load", e)

    def request_reset(self, request: Any) -> None:
        try:
            self.core.request_reset(int(request.request_id))
        except Exception as e:  # noqa: BLE001
            self._contain("request_reset", e)

    # -- end of a request --------------------------------------------------
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.request_finished_by_layer_group(request, [list(cache_block_ids)])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: Any) -> bool:
        try:
            return self.core.request_finished(int(request.request_id), cache_block_ids_by_layer_group)
        except Exception as e:  # noqa: BLE001
            self._contain("request_finished", e)
            # Hold the pages: the workers return the id at once when they have nothing for it,
            # and holding costs one iteration while freeing under an in-flight copy costs KV.
            return True

    def shutdown(self) -> None:
        try:
            self._runtime.observe(leader_stats=self.core.stats)
            self.core.close_lookup()
        except Exception as e:  # noqa: BLE001
            self._contain("shutdown", e)
        finally:
            release_runtime(self._runtime)


class S3KvConnectorWorker(KvCacheConnectorWorker):
    """Worker side (every rank): moves pages between the device and the store."""

    supports_attention_dp = False
    requires_disable_overlap_scheduler = True

    def __init__(
        self,
        llm_args: Any,
        *,
        settings: Settings | None = None,
        store: ObjectStore | None = None,
        key_prefix: str | None = None,
        engine_key: str | None = None,
        engine_features: Any = None,
    ):
        super().__init__(llm_args)
        _check_engine(llm_args)
        from .engine.worker import WorkerCore  # imported here: it pulls in the transfer threads

        self._llm_args = llm_args
        self._observed_at = 0.0
        self._contain = _Contain("worker")
        self.settings = _settings(settings)
        self.features = _features(engine_features)
        mapping = _mapping(llm_args)
        self.tp_rank = int(mapping.tp_rank)
        self.tp_size = int(mapping.tp_size)
        self._runtime = acquire_runtime(
            llm_args, self.settings, store=store, key_prefix=key_prefix, engine_key=engine_key
        )
        self.core = WorkerCore(
            settings=self.settings,
            store=self._runtime.store,
            key_prefix=self._runtime.key_prefix,
            rank=self.tp_rank,
            tp_size=self.tp_size,
            model_id=_model_id(llm_args, self.settings),
            kv_dtype=_kv_dtype(llm_args),
            index=self._runtime.index,
            failed_load_hook=FAILED_LOAD_HOOK in self.features,
        )
        # TensorRT-LLM never calls a connector shutdown(): drain uploads at process exit.
        self.core.install_exit_drain(self.settings.exit_drain_s)

    @property
    def errors(self) -> Counter[str]:
        return self._contain.errors

    # -- bring-up ----------------------------------------------------------
    def register_kv_cache_layout(self, layout: Any) -> None:
        _check_layout(layout)
        self.core.register_layout(layout)
        geometry: CacheGeometry = self.core.geometry
        self._runtime.publish_geometry(geometry)
        if self.tp_rank == 0:
            self._runtime.geometry_ready()
        kv = getattr(self._llm_args, "kv_cache_config", None)
        max_seq_len = getattr(self._llm_args, "max_seq_len", None)
        expected = expected_windows(getattr(kv, "max_attention_window", None), max_seq_len)
        if max_seq_len is not None and len(expected) != geometry.num_groups:
            # The layout is authoritative; a mismatch means the configured windows are
            # not what the cache grouped on (worth knowing when reading hit rates).
            log.warning(
                "s3kv: configured windows give %d layer groups, the KV cache layout has %d",
                len(expected), geometry.num_groups,
            )
        log.info(
            "s3kv worker rank %d/%d: %s",
            self.tp_rank,
            self.tp_size,
            ", ".join(f"group {g.group_id} window={g.window or 'full'} {g.page_bytes} B/page" for g in geometry.groups),
        )

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Flat (V1) form: one pool ``[num_blocks, num_layers, kv_factor, block_size]``, one group."""
        import torch

        t = kv_cache_tensor
        num_blocks = int(t.shape[0])
        flat = t.reshape(num_blocks, -1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(num_blocks, -1)
        page = int(flat.shape[1])
        num_layers = int(t.shape[1]) if t.dim() > 1 else 1
        tpb = int(self._llm_args.kv_cache_config.tokens_per_block)
        region = _FlatRegion(flat, page)
        layout = KvCacheLayout(
            tokens_per_block=tpb,
            groups=(
                KvCacheLayerGroupLayout(
                    layer_group_id=0,
                    layer_ids=tuple(range(num_layers)),
                    window_size=None,
                    regions=(region,),
                ),
            ),
        )
        self.register_kv_cache_layout(layout)

    # -- forward -----------------------------------------------------------
    def bind_connector_meta(self, metadata: Any) -> None:
        super().bind_connector_meta(metadata)
        try:
            # Bound at once: its finish plans must be in place even if no start_load_kv follows.
            self.core.bind(metadata)
        except Exception as e:  # noqa: BLE001
            self._contain("bind_connector_meta", e)

    def start_load_kv(self, stream: Any) -> None:
        try:
            self.core.start_load_kv(stream)
        except Exception as e:  # noqa: BLE001
            self._contain("start_load_kv", e)
            self.core.fail_bound_loads(f"start_load_kv failed: {e!r}")

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        try:
            self.core.wait_for_layer_load(layer_idx, stream)
        except Exception as e:  # noqa: BLE001
            self._contain("wait_for_layer_load", e)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        try:
            self.core.save_kv_layer(layer_idx, stream)
        except Exception as e:  # noqa: BLE001
            self._contain("save_kv_layer", e)

    def wait_for_save(self, stream: Any) -> None:
        try:
            self.core.wait_for_save(stream)
        except Exception as e:  # noqa: BLE001
            self._contain("wait_for_save", e)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        try:
            return self.core.get_finished(finished_gen_req_ids, started_loading_req_ids)
        except Exception as e:  # noqa: BLE001
            self._contain("get_finished", e)
            # The ids were recorded before anything could fail; a later call returns them.
            return [], []
        finally:
            now = time.monotonic()
            if now - self._observed_at >= _OBSERVE_EVERY_S:
                self._observed_at = now
                try:
                    self.observe_metrics()
                except Exception as e:  # noqa: BLE001
                    self._contain("observe", e)

    def take_failed_load_request_ids(self) -> set[int]:
        """Branch API (rung 1): requests whose promised load failed; the engine recomputes them."""
        try:
            return self.core.take_failed_load_request_ids()
        except Exception as e:  # noqa: BLE001
            self._contain("take_failed_load_request_ids", e)
            return set()

    def observe_metrics(self) -> None:
        """Copy this rank's cumulative stats into the engine's Prometheus metrics."""
        self._runtime.observe(worker_stats=self.core.stats(), source=f"rank{self.tp_rank}")

    @property
    def metrics(self) -> Any:
        return self._runtime.metrics

    # -- lifecycle ---------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (tests, demo, graceful shutdown)."""
        return self.core.flush(timeout)

    def shutdown(self) -> None:
        try:
            self.core.close()
            self.observe_metrics()
        except Exception as e:  # noqa: BLE001
            self._contain("shutdown", e)
        finally:
            release_runtime(self._runtime)


def _check_layout(layout: Any) -> None:
    """Refuse at registration a layout whose page API s3kv does not rely on."""
    groups = getattr(layout, "groups", None)
    if not groups or getattr(layout, "tokens_per_block", None) is None:
        raise UnsupportedEngine("s3kv: the KV cache layout has no groups or no tokens_per_block")
    for g in groups:
        if getattr(g, "replicated_regions", None):
            raise UnsupportedEngine(
                f"s3kv: layer group {getattr(g, 'layer_group_id', '?')} has replicated regions; this "
                "TensorRT-LLM's layout is one s3kv does not save or load (upgrade TensorRT-LLM or s3kv)"
            )
        for r in getattr(g, "regions", ()) or ():
            missing = [a for a in ("slot_tensor", "as_tensor", "size", "num_slots") if not hasattr(r, a)]
            if missing:
                raise UnsupportedEngine(
                    "s3kv: this TensorRT-LLM's KvCacheRegion has no " + ", ".join(missing)
                    + "; s3kv addresses pages only through them (a TensorRT-LLM with the V2 layout "
                    "API, merged around 2026-09, has them)"
                )


class _FlatRegion:
    """A region over a V1 pool tensor: slot ``i`` is row ``i`` (no raw addresses needed)."""

    def __init__(self, rows: Any, size: int):
        self._rows = rows
        self.size = size
        self.stride = size
        self.base = 0
        self.num_slots = int(rows.shape[0])
        self.buffers: tuple[Any, ...] = (KvCacheBufferRef(0, "kv"),)

    def slot_tensor(self, slot_id: int, dtype: Any = None) -> Any:
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot {slot_id} outside [0, {self.num_slots})")
        t = self._rows[slot_id]
        return t if dtype is None else t.view(dtype)

    def as_tensor(self, dtype: Any = None) -> Any:
        return self._rows if dtype is None else self._rows.view(dtype)


# Keep the names visible for type checkers even when the stand-ins are used.
_ = (KvCacheRegion, ConnectorMetadata)
