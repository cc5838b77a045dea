"""The TensorRT-LLM adapter: a thin translation from engine objects to s3kv's cores.

Wire it with::

    KvCacheConnectorConfig(
        connector_module="s3kv.trtllm",
        connector_scheduler_class="S3KvConnectorLeader",
        connector_worker_class="S3KvConnectorWorker",
    )

and ``S3KV_URL=s3://bucket/prefix`` in the environment. Both classes are built
as ``cls(llm_args)``; the optional keyword arguments exist for the simulator and
tests (an explicit store, settings or engine key), never needed in production.

Failure policy at this boundary: a lookup never raises (a store problem is a
miss); a save never raises (it is dropped and counted); only a promised load
that cannot be completed with verified bytes raises ``LoadFailed``, naming the
object -- the engine has no other way to fail the request safely.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .config import Settings, load_settings
from .errors import LoadFailed, PlanMismatch
from .layout import CacheGeometry, expected_windows
from .leader import LeaderCore
from .runtime import EngineRuntime, acquire_runtime, release_runtime
from .store.base import ObjectStore
from .trtllm_api import (
    HAVE_TRTLLM,
    KvCacheBufferRef,
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)

log = logging.getLogger("s3kv.trtllm")

#: Cumulative stats are copied into the Prometheus metrics at most this often (scheduler hot path).
_OBSERVE_EVERY_S = 1.0

__all__ = ["S3KvConnectorLeader", "S3KvConnectorWorker", "HAVE_TRTLLM", "LoadFailed"]


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


class S3KvConnectorLeader(KvCacheConnectorScheduler):
    """Scheduler side (rank 0): lookups, load plans, save plans."""

    def __init__(
        self,
        llm_args: Any,
        *,
        settings: Settings | None = None,
        store: ObjectStore | None = None,
        key_prefix: str | None = None,
        engine_key: str | None = None,
    ):
        super().__init__(llm_args)
        self._llm_args = llm_args
        self._observed_at = 0.0
        self.settings = _settings(settings)
        mapping = _mapping(llm_args)
        self._runtime: EngineRuntime = acquire_runtime(
            llm_args, self.settings, store=store, key_prefix=key_prefix, engine_key=engine_key
        )
        self.core = LeaderCore(
            self.settings,
            self._runtime.store,
            self._runtime.key_prefix,
            tp_size=int(mapping.tp_size),
            model_id=_model_id(llm_args, self.settings),
            kv_dtype=_kv_dtype(llm_args),
            index=self._runtime.index,
            geometry=self._runtime.get_geometry,
        )

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
        except Exception:  # noqa: BLE001 - a lookup must never fail a request
            log.exception("s3kv: lookup failed for request %s; treating as a miss", getattr(request, "request_id", "?"))
            return 0, False
        return (n, is_async) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.update_state_after_alloc_by_layer_group(request, [list(block_ids)])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        honoured = getattr(request, "py_num_connector_matched_tokens", None)
        self.core.update_state_after_alloc(
            int(request.request_id), block_ids_by_layer_group, None if honoured is None else int(honoured)
        )

    # -- per iteration -----------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        new = list(getattr(scheduler_output, "new_requests", None) or [])
        cached = list(getattr(scheduler_output, "cached_requests", None) or [])
        g = self.core.geometry
        if g is not None:
            for rd in new:
                by_group = getattr(rd, "new_block_ids_by_layer_group", None) or []
                if by_group and len(by_group) != g.num_groups:
                    raise PlanMismatch(
                        f"request {rd.request_id}: the engine reports {len(by_group)} layer groups, "
                        f"the registered KV cache layout has {g.num_groups}"
                    )
        meta = self.core.build_connector_meta(new, cached)
        now = time.monotonic()
        if now - self._observed_at >= _OBSERVE_EVERY_S:
            self._observed_at = now
            self._runtime.observe(leader_stats=self.core.stats)
        return meta

    # -- end of a request --------------------------------------------------
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.request_finished_by_layer_group(request, [list(cache_block_ids)])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        try:
            return self.core.request_finished(int(request.request_id), cache_block_ids_by_layer_group)
        except Exception:  # noqa: BLE001 - a save problem must never fail a finished request
            log.exception("s3kv: planning final saves failed for request %s", request.request_id)
            return False

    def shutdown(self) -> None:
        self._runtime.observe(leader_stats=self.core.stats)
        release_runtime(self._runtime)


class S3KvConnectorWorker(KvCacheConnectorWorker):
    """Worker side (every rank): moves pages between the device and the store."""

    def __init__(
        self,
        llm_args: Any,
        *,
        settings: Settings | None = None,
        store: ObjectStore | None = None,
        key_prefix: str | None = None,
        engine_key: str | None = None,
    ):
        super().__init__(llm_args)
        from .worker import WorkerCore  # imported here: it pulls in the transfer threads

        self._llm_args = llm_args
        self._observed_at = 0.0
        self.settings = _settings(settings)
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
        )

    # -- bring-up ----------------------------------------------------------
    def register_kv_cache_layout(self, layout: Any) -> None:
        self.core.register_layout(layout)
        geometry: CacheGeometry = self.core.geometry
        self._runtime.publish_geometry(geometry)
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
    def start_load_kv(self, stream: Any) -> None:
        self.core.bind(self._metadata)
        self.core.start_load_kv(stream)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        self.core.wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        self.core.save_kv_layer(layer_idx, stream)

    def wait_for_save(self, stream: Any) -> None:
        self.core.wait_for_save(stream)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        try:
            return self.core.get_finished(finished_gen_req_ids, started_loading_req_ids)
        finally:
            now = time.monotonic()
            if now - self._observed_at >= _OBSERVE_EVERY_S:
                self._observed_at = now
                self.observe_metrics()

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
        finally:
            release_runtime(self._runtime)


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


# Keep the name visible for type checkers even when the stand-in is used.
_ = KvCacheRegion
