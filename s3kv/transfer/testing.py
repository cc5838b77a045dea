"""Tensor-backed KV cache layouts for tests and benchmarks (CPU or CUDA).

Uses the stand-in layout classes of :mod:`s3kv.trtllm_api` when TensorRT-LLM's own
are not importable; otherwise (the real ``KvCacheRegion`` addresses raw device
memory) a duck-typed region with the same interface. Either way each region is
backed by a uint8 tensor the test can inspect and overwrite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import trtllm_api
from .staging import host_memoryview


@dataclass(frozen=True)
class TensorRegion:
    """Same interface as ``KvCacheRegion``; slot ``i`` is ``storage[base + stride*i : +size]``."""

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
        view = self.storage[self.base : self.base + self.stride * self.num_slots]
        rows = view.view(self.num_slots, self.stride)[:, : self.size]
        return rows if dtype == torch.uint8 else rows.view(dtype)

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        start = self.address_of(slot_id)
        assert self.storage is not None
        t = self.storage[start : start + self.size]
        return t if dtype == torch.uint8 else t.view(dtype)


@dataclass(frozen=True)
class TensorGroup:
    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    regions: tuple[Any, ...]

    @property
    def bytes_per_page(self) -> int:
        return sum(r.size for r in self.regions)


@dataclass(frozen=True)
class TensorLayout:
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


@dataclass(frozen=True)
class GroupSpec:
    layer_ids: tuple[int, ...]
    window: int | None
    region_sizes: tuple[int, ...]
    #: Extra bytes between slots of each region (stride = size + pad).
    pad: int = 0


def make_layout(
    groups: Sequence[GroupSpec],
    *,
    num_slots: int = 16,
    tokens_per_block: int = 32,
    device: str | torch.device = "cpu",
    fill_seed: int | None = 0,
) -> Any:
    """A layout whose regions each own a tensor of ``num_slots * stride`` bytes on ``device``.

    ``fill_seed`` fills every byte with deterministic noise (None: zeros).
    """
    use_stand_ins = not trtllm_api.HAVE_TRTLLM_LAYOUT
    region_cls: Any = trtllm_api.KvCacheRegion if use_stand_ins else TensorRegion
    group_cls: Any = trtllm_api.KvCacheLayerGroupLayout if use_stand_ins else TensorGroup
    layout_cls: Any = trtllm_api.KvCacheLayout if use_stand_ins else TensorLayout
    gen = torch.Generator().manual_seed(fill_seed) if fill_seed is not None else None
    out = []
    for gid, spec in enumerate(groups):
        regions = []
        for size in spec.region_sizes:
            stride = size + spec.pad
            if gen is not None:
                host = torch.randint(0, 256, (num_slots * stride,), dtype=torch.uint8, generator=gen)
            else:
                host = torch.zeros(num_slots * stride, dtype=torch.uint8)
            storage = host.to(device)
            regions.append(region_cls(0, size, stride, num_slots, (), storage=storage))
        out.append(group_cls(gid, tuple(spec.layer_ids), spec.window, tuple(regions)))
    return layout_cls(tokens_per_block, tuple(out))


def page_bytes(layout: Any, group: int, slot: int) -> bytes:
    """The page's bytes (its regions concatenated), read back to host."""
    g = layout.group(group)
    out = []
    for r in g.regions:
        t = r.slot_tensor(slot).cpu().contiguous()
        out.append(bytes(host_memoryview(t)))
    return b"".join(out)


def write_page(layout: Any, group: int, slot: int, data: bytes | int) -> None:
    """Overwrite a page with ``data`` (bytes of the page's size, or one byte value)."""
    g = layout.group(group)
    off = 0
    for r in g.regions:
        t = r.slot_tensor(slot)
        if isinstance(data, int):
            t.fill_(data)
        else:
            t.copy_(torch.frombuffer(bytearray(data[off : off + r.size]), dtype=torch.uint8).to(t.device))
        off += r.size
