"""Paged KV pools: one arena per rank holding every group's regions, and per-group allocators.

Why one arena per rank: a real cache carves all pools out of one device
allocation, so regions sit at non-zero ``base`` offsets next to each other. A
connector that ignores ``base`` or ``stride``, or writes past ``size``, lands
in a neighbour or in a guard gap -- both are detected (pages by the checker,
gaps by :meth:`RankPool.guard_violations`).

Page slot ids are scheduler-side facts, identical on every rank (the
scheduler is rank-identical under TP), so one :class:`GroupAllocator` per
group serves all ranks while each rank has its own memory.
"""

from __future__ import annotations

import torch

from ..trtllm.api import (
    HAVE_TRTLLM_LAYOUT,
    KvCacheBufferRef,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)
from .config import GroupSpec, SimCacheConfig, SimModel

_ALIGN = 64  # region bases are 64-byte aligned, after a guard gap of the same size
_ROLES = (("key", "value"), ("key_scale", "value_scale"))


class SimError(RuntimeError):
    """The simulator itself cannot go on (misconfiguration or an engine-side invariant)."""


class GroupAllocator:
    """Free list of one group's page slots, with reservations.

    The initial order is a seeded permutation (so slot != ordinal and pages of a
    request are not contiguous) and freed slots are reused first (LIFO), so a
    connector that touches a page after it was freed meets junk or someone
    else's KV rather than its old bytes. Admission reserves a request's worst
    case up front; allocation then never fails mid-flight.
    """

    def __init__(self, group_id: int, num_slots: int, seed: int):
        gen = torch.Generator().manual_seed(seed * 7919 + group_id)
        self.group_id = group_id
        self.num_slots = num_slots
        self._free: list[int] = torch.randperm(num_slots, generator=gen).tolist()
        self._in_use: set[int] = set()
        self._reserved = 0

    @property
    def available(self) -> int:
        """Slots neither allocated nor promised to an admitted request."""
        return len(self._free) - self._reserved

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def reserve(self, n: int) -> bool:
        if n > self.available:
            return False
        self._reserved += n
        return True

    def unreserve(self, n: int) -> None:
        if n > self._reserved:
            raise SimError(f"group {self.group_id}: unreserving {n} of {self._reserved}")
        self._reserved -= n

    def alloc(self) -> int:
        """One slot out of an earlier reservation."""
        if self._reserved <= 0 or not self._free:
            raise SimError(f"group {self.group_id}: allocation without reservation")
        self._reserved -= 1
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._in_use:
            raise SimError(f"group {self.group_id}: double free of slot {slot}")
        self._in_use.remove(slot)
        self._free.append(slot)


class RankPool:
    """One rank's KV memory: the arena, its :class:`KvCacheLayout`, and views the engine writes through.

    The engine addresses pages through its own views of the arena (computed from
    its own placement), never through ``KvCacheRegion`` methods, so the model and
    the checker do not depend on the layout types they are testing a connector with.
    """

    def __init__(
        self,
        rank: int,
        groups: tuple[GroupSpec, ...],
        model: SimModel,
        config: SimCacheConfig,
        tp_size: int,
        num_slots: int,
        device: torch.device,
    ):
        self.rank = rank
        self.num_slots = num_slots
        self.junk_byte = config.junk_byte
        tpb = config.tokens_per_block
        per_layer = model.region_bytes_per_layer(tpb, tp_size)
        # (group, region) -> (offset, size, stride); per-layer bytes of each region.
        self.per_layer_bytes = per_layer
        self._place: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._layer_index: dict[int, int] = {}
        cursor = 0
        # Place groups in reverse id order: group 0 is not at offset 0.
        for g in reversed(groups):
            for idx, layer in enumerate(g.layer_ids):
                self._layer_index[layer] = idx
            for k in range(model.regions_per_group):
                size = per_layer[k] * len(g.layer_ids)
                # Pad every other region so stride > size is exercised next to stride == size.
                stride = size + (config.slot_padding if (g.group_id + k) % 2 else 0)
                cursor = _round_up(cursor + _ALIGN, _ALIGN)
                self._place[(g.group_id, k)] = (cursor, size, stride)
                cursor += stride * num_slots
        total = _round_up(cursor + _ALIGN, _ALIGN)
        self.arena = torch.full((total,), config.guard_byte, dtype=torch.uint8, device=device)
        # Guard bytes: the gaps between regions (contiguous) and each padded region's stride padding.
        self._gaps: list[tuple[int, int]] = []
        prev_end = 0
        for off, size, stride in sorted(self._place.values()):
            self._gaps.append((prev_end, off))
            self._rows(self.arena, off, size, stride).fill_(config.junk_byte)
            prev_end = off + stride * num_slots
        self._gaps.append((prev_end, total))
        self.guard_byte = config.guard_byte
        self.layout = KvCacheLayout(
            tokens_per_block=tpb,
            groups=tuple(
                KvCacheLayerGroupLayout(
                    layer_group_id=g.group_id,
                    layer_ids=g.layer_ids,
                    window_size=g.window,
                    regions=tuple(self._region(g, k) for k in range(model.regions_per_group)),
                )
                for g in groups
            ),
            dtype=torch.uint8,
        )

    def _rows(self, t: torch.Tensor, off: int, size: int, stride: int) -> torch.Tensor:
        return t[off : off + stride * self.num_slots].view(self.num_slots, stride)[:, :size]

    def _region(self, g: GroupSpec, k: int) -> KvCacheRegion:
        off, size, stride = self._place[(g.group_id, k)]
        roles = _ROLES[k]
        buffers = tuple(KvCacheBufferRef(layer, role) for layer in g.layer_ids for role in roles)
        if HAVE_TRTLLM_LAYOUT:  # pragma: no cover - the real class addresses raw memory
            return KvCacheRegion(self.arena.data_ptr() + off, size, stride, self.num_slots, buffers)
        return KvCacheRegion(off, size, stride, self.num_slots, buffers, storage=self.arena)

    def region_count(self, group_id: int) -> int:
        return sum(1 for (g, _k) in self._place if g == group_id)

    def slot(self, group_id: int, region: int, slot: int) -> torch.Tensor:
        """The ``size`` bytes of one region's slot (a view)."""
        off, size, stride = self._place[(group_id, region)]
        if not 0 <= slot < self.num_slots:
            raise SimError(f"slot {slot} outside [0, {self.num_slots})")
        start = off + stride * slot
        return self.arena[start : start + size]

    def layer_segment(self, group_id: int, region: int, slot: int, layer: int) -> torch.Tensor:
        """The bytes ``layer`` owns inside one region's slot: layers are packed in ``layer_ids`` order."""
        n = self.per_layer_bytes[region]
        start = self._layer_index[layer] * n
        return self.slot(group_id, region, slot)[start : start + n]

    def junk(self, group_id: int, slot: int) -> None:
        """Overwrite a freed page so a late reader gets a recognisable pattern, never stale KV."""
        for k in range(self.region_count(group_id)):
            self.slot(group_id, k, slot).fill_(self.junk_byte)

    def guard_violations(self) -> int:
        """Bytes outside every slot (gaps, stride padding) that someone overwrote."""
        bad = 0
        for start, end in self._gaps:
            bad += int((self.arena[start:end] != self.guard_byte).sum().item())
        for off, size, stride in self._place.values():
            if stride > size:
                pad = self.arena[off : off + stride * self.num_slots].view(self.num_slots, stride)[:, size:]
                bad += int((pad != self.guard_byte).sum().item())
        return bad


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a
