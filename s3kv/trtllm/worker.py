"""The worker side of the TensorRT-LLM adapter (every rank): engine calls in, ``WorkerCore`` calls out.

It registers the engine's KV cache layout (the V2 layout API, or the flat V1 pool
tensor through :class:`_FlatRegion`) and forwards each per-iteration hook to
:class:`s3kv.engine.worker.WorkerCore`, containing whatever it raises (a failed
``start_load_kv`` fails the bound loads, never the engine): see ``s3kv.trtllm``.
"""

from __future__ import annotations

from typing import Any

from ..core.layout import CacheGeometry, expected_windows
from ..engine.runtime import release_runtime
from .api import (
    FAILED_LOAD_HOOK,
    KvCacheBufferRef,
    KvCacheConnectorWorker,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
)
from .boundary import ConnectorSide, check_layout, kv_shard, log
from .identity import model_identity

__all__ = ["S3KvConnectorWorker"]


class S3KvConnectorWorker(ConnectorSide, KvCacheConnectorWorker):
    """Worker side (every rank): moves pages between the device and the store."""

    role = "worker"

    def _start(self, llm_args: Any, mapping: Any) -> None:
        from ..engine.worker import WorkerCore  # imported here: it pulls in the transfer threads

        self.tp_rank, self.tp_size = kv_shard(llm_args, mapping)
        identity = model_identity(llm_args, self.settings.model_id)  # as the leader's (same process cache)
        self.core = WorkerCore(
            settings=self.settings,
            store=self._runtime.store,
            key_prefix=self._runtime.key_prefix,
            rank=self.tp_rank,
            tp_size=self.tp_size,
            model_id=identity.model_id,
            kv_dtype=identity.kv_dtype,
            index=self._runtime.index,
            failed_load_hook=FAILED_LOAD_HOOK in self.features,
            host_weigh=self._host_weigh,
            auto_host_cache=True,  # an engine: S3KV_HOST_CACHE_GB=-1 sizes the tier from the machine
        )
        # TensorRT-LLM never calls a connector shutdown(): drain uploads at process exit.
        self.core.install_exit_drain(self.settings.exit_drain_s)

    # -- bring-up ----------------------------------------------------------
    def register_kv_cache_layout(self, layout: Any) -> None:
        check_layout(layout)
        self.core.register_layout(layout)
        geometry: CacheGeometry = self.core.geometry
        self._runtime.publish_geometry(geometry)
        if self.tp_rank == 0:
            # The leader sees this rank's host tier (every rank's holds its own shard of the same
            # objects: the plan keeps them in step) and the load speeds measured here.
            self._runtime.host_tier = self.core.host_tier
            self._runtime.speeds = self.core.speeds
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
            if self._observe_due():
                try:
                    self.observe_metrics()
                except Exception as e:  # noqa: BLE001
                    self._contain("observe", e)

    # -- the failed-load path (lines that have it; docs/failures.md, rung 1) --
    def take_failed_load_request_ids(self) -> set[int]:
        """Parked requests whose promised load failed (after the store's retries), once each; the
        manager aborts them on every rank and ends them."""
        try:
            # Plain ints: the manager keeps only ids whose type is exactly int (sim/failpath.py).
            return {int(r) for r in self.core.take_failed_load_request_ids()}
        except Exception as e:  # noqa: BLE001
            self._contain("take_failed_load_request_ids", e)
            return set()

    def try_abort_request(self, request_id: int) -> bool:
        """Release the request: ``True`` once no copy of its load can land in its pages. Never
        ``False`` and never an exception: the manager turns either into the engine's death."""
        try:
            return self.core.try_abort_request(int(request_id))
        except Exception as e:  # noqa: BLE001
            # The core waited for every copy this rank issued before raising: the pages are safe to free.
            self._contain("try_abort_request", e)
            return True

    #: The same path under its earlier name.
    abort_request = try_abort_request

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
