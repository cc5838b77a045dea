"""TensorRT-LLM's connector types: the real ones when importable, faithful stand-ins otherwise.

s3kv must import (and its simulator must run) on machines without TensorRT-LLM.
The stand-ins follow TensorRT-LLM's connector API (``tensorrt_llm._torch.pyexecutor.
kv_cache_connector``) field for field, so the adapter code is the same either way. ``HAVE_TRTLLM`` says which ones are in use.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

HAVE_TRTLLM = False

try:  # The V2 layout API (merged ~2026-09) lives under connectors/.
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        RequestData,
        SchedulerOutput,
    )

    HAVE_TRTLLM = True
except Exception:  # pragma: no cover - depends on the environment
    try:  # Older releases: flat API only.
        from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # type: ignore
            KvCacheConnectorScheduler,
            KvCacheConnectorWorker,
            RequestData,
            SchedulerOutput,
        )

        HAVE_TRTLLM = True
    except Exception:
        pass

try:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import (  # type: ignore
        KvCacheBufferRef,
        KvCacheLayerGroupLayout,
        KvCacheLayout,
        KvCacheRegion,
        valid_page_slots,
    )

    HAVE_TRTLLM_LAYOUT = True
except Exception:
    HAVE_TRTLLM_LAYOUT = False


if not HAVE_TRTLLM:

    @dataclass
    class RequestData:  # type: ignore[no-redef]
        request_id: int
        new_tokens: list[int]
        new_block_ids: list[int]
        computed_position: int
        num_scheduled_tokens: int = 0
        block_hashes: list[int] = field(default_factory=list)
        priorities: Any = None
        cache_salt: str | None = None
        new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)

    @dataclass
    class SchedulerOutput:  # type: ignore[no-redef]
        new_requests: list[RequestData] = field(default_factory=list)
        cached_requests: list[RequestData] = field(default_factory=list)
        attention_dp_rank: int | None = None

    class KvCacheConnectorScheduler:  # type: ignore[no-redef]
        supports_attention_dp = False

        def __init__(self, llm_args: Any):
            self._llm_args = llm_args

    class KvCacheConnectorWorker:  # type: ignore[no-redef]
        def __init__(self, llm_args: Any):
            self._llm_args = llm_args
            self._metadata: Any = None

        def bind_connector_meta(self, metadata: Any) -> None:
            self._metadata = metadata

        def get_connector_meta(self) -> Any:
            return self._metadata

        def _clear_connector_meta(self) -> None:
            self._metadata = None

        def register_forward_pass_callable(self) -> Any:
            return None


if not HAVE_TRTLLM_LAYOUT:

    def valid_page_slots(page_indices: Iterable[int]) -> Iterator[tuple[int, int]]:  # type: ignore[no-redef]
        for ordinal, slot in enumerate(page_indices):
            if slot >= 0:
                yield ordinal, slot

    @dataclass(frozen=True)
    class KvCacheBufferRef:  # type: ignore[no-redef]
        layer_id: int
        role: str
        expansion: int = 1


@dataclass(frozen=True)
class TensorKvCacheRegion:
    """``KvCacheRegion``'s interface over a tensor: slot ``i`` is ``storage[base + stride*i :][:size]``.

    The real class addresses raw device memory; this one keeps the tensor that
    backs it (``storage``, uint8, 1-D), so views are made safely and tests and
    benchmarks can build layouts whether or not TensorRT-LLM is installed.
    It is the stand-in ``KvCacheRegion`` when TensorRT-LLM is absent.
    """

    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[Any, ...] = ()
    storage: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def address_of(self, slot_id: int) -> int:
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot {slot_id} outside [0, {self.num_slots})")
        return self.base + self.stride * slot_id

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        assert self.storage is not None
        itemsize = torch.empty((), dtype=dtype).element_size()
        view = self.storage[self.base : self.base + self.stride * self.num_slots]
        rows = view.view(self.num_slots, self.stride)[:, : self.size]
        return rows.view(dtype) if dtype != torch.uint8 else rows.reshape(self.num_slots, self.size // itemsize)

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        start = self.address_of(slot_id)
        assert self.storage is not None
        t = self.storage[start : start + self.size]
        return t if dtype == torch.uint8 else t.view(dtype)

@dataclass(frozen=True)
class TensorKvCacheLayerGroupLayout:
    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    regions: tuple[Any, ...]

    @property
    def bytes_per_page(self) -> int:
        return sum(r.size for r in self.regions)

@dataclass(frozen=True)
class TensorKvCacheLayout:
    tokens_per_block: int
    groups: tuple[Any, ...]
    dtype: torch.dtype = torch.uint8

    def group(self, layer_group_id: int) -> Any:
        for g in self.groups:
            if g.layer_group_id == layer_group_id:
                return g
        raise KeyError(layer_group_id)

    def group_of_layer(self, layer_id: int) -> Any:
        for g in self.groups:
            if layer_id in g.layer_ids:
                return g
        raise KeyError(layer_id)

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        if len(self.groups) == 1 and len(self.groups[0].regions) == 1:
            return self.groups[0].regions[0].as_tensor()
        return None


#: Engine features a connector can use only where the installed TensorRT-LLM has them.
#: The connector manager's failed-load path (docs/failures.md, rung 1).
FAILED_LOAD_HOOK = "failed_load_hook"


def engine_features(
    worker_base: type | None = None, scheduler_base: type | None = None
) -> frozenset[str]:
    """What the installed engine offers beyond the merged connector API, by feature detection.

    ``failed_load_hook``: the connector base classes of the newest flat-API line
    (``connectors/kv_cache_connector.py`` with ``KvCacheConnectorPollResult``): worker
    ``take_failed_load_request_ids()`` and ``try_abort_request(id)``, scheduler
    ``try_abort_request(id, reason)`` (and ``finalize_successful_load(id)``); or the same path
    under its earlier names, worker ``abort_request(id)`` with ``take_failed_load_request_ids``,
    scheduler ``abort_request(id, reason)`` / ``finish_load(id)``. The manager polls the worker's
    failed ids after every ``get_finished``, reaches consensus across the tensor-parallel ranks,
    has every worker release the request before any page is freed, and returns it to the
    executor as failed. It covers async loads only: the manager drops failed ids of requests it
    does not track as async loads. The earlier ``get_block_ids_with_load_errors`` API (block ids,
    ``handle_load_errors``) is not this path and is not used.
    """
    worker_base = KvCacheConnectorWorker if worker_base is None else worker_base
    scheduler_base = KvCacheConnectorScheduler if scheduler_base is None else scheduler_base

    def has(cls: type, *names: str) -> bool:
        return any(callable(getattr(cls, n, None)) for n in names)

    out = set()
    if (
        has(worker_base, "take_failed_load_request_ids")
        and has(worker_base, "try_abort_request", "abort_request")
        and has(scheduler_base, "try_abort_request", "abort_request")
    ):
        out.add(FAILED_LOAD_HOOK)
    return frozenset(out)


if not HAVE_TRTLLM_LAYOUT:
    KvCacheRegion = TensorKvCacheRegion  # type: ignore[misc,assignment]
    KvCacheLayerGroupLayout = TensorKvCacheLayerGroupLayout  # type: ignore[misc,assignment]
    KvCacheLayout = TensorKvCacheLayout  # type: ignore[misc,assignment]


__all__ = [
    "FAILED_LOAD_HOOK",
    "HAVE_TRTLLM",
    "engine_features",
    "HAVE_TRTLLM_LAYOUT",
    "KvCacheBufferRef",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "KvCacheLayerGroupLayout",
    "KvCacheLayout",
    "KvCacheRegion",
    "RequestData",
    "TensorKvCacheLayerGroupLayout",
    "TensorKvCacheLayout",
    "TensorKvCacheRegion",
    "SchedulerOutput",
    "valid_page_slots",
]
