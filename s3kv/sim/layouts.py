"""Tensor-backed KV cache layouts for tests and benchmarks (CPU or CUDA).

Uses the tensor-backed layout classes of :mod:`s3kv.trtllm.api` (the stand-ins when
TensorRT-LLM is absent; the real ``KvCacheRegion`` addresses raw device memory), so
each region is backed by a uint8 tensor the test can inspect and overwrite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..transfer.staging import host_memoryview
from ..trtllm import api as trtllm_api


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
    region_cls: Any = trtllm_api.TensorKvCacheRegion
    group_cls: Any = trtllm_api.TensorKvCacheLayerGroupLayout
    layout_cls: Any = trtllm_api.TensorKvCacheLayout
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
