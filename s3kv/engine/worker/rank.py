"""What ``register_layout`` fixes for one rank: the geometry, the keys, where each group's pages live.

Pages are addressed only through the layout's regions (``slot_tensor`` / ``as_tensor``); a page
is its group's regions concatenated. Objects this rank writes and reads carry its shard's
identity (namespace, group fingerprint, shard, page size, integrity keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...config import Settings
from ...core.keys import KeyScheme, namespace_digest
from ...core.layout import CacheGeometry
from ...core.objects import ObjectIdentity
from ...core.plan import LoadOp
from ...transfer.download import LoadPlanError


@dataclass(frozen=True)
class RankLayout:
    geometry: CacheGeometry
    namespace: bytes
    keys: KeyScheme
    tp_rank: int
    #: group id -> the group's regions (a page is their slots concatenated).
    regions: Mapping[int, tuple[Any, ...]]
    identity: Mapping[int, ObjectIdentity]
    #: layer id -> group id.
    layer_group: Mapping[int, int]
    #: Where the pages live (the staging pool and the copier follow it).
    device: Any
    #: Each group's key prefix on this rank (by position in ``geometry.groups``), made once: the
    #: group fingerprint is a hash, and every load op and seal names a key.
    key_prefix: tuple[str, ...]

    @classmethod
    def from_layout(
        cls, layout: Any, settings: Settings, *, prefix: str, tp_rank: int, tp_size: int, model_id: str, kv_dtype: str
    ) -> RankLayout:
        geometry = CacheGeometry.from_layout(layout, model_id=model_id, tp_size=tp_size, kv_dtype=kv_dtype)
        namespace = namespace_digest(geometry, tagged=settings.integrity is not None)
        regions: dict[int, tuple[Any, ...]] = {}
        for g in layout.groups:
            regions[int(g.layer_group_id)] = tuple(g.regions)
        device = None
        for regs in regions.values():
            for r in regs:
                if int(r.num_slots) > 0:
                    device = r.slot_tensor(0).device
                    break
            if device is not None:
                break
        if device is None:
            raise ValueError("the KV cache layout has no slots")
        identity = {
            g.group_id: ObjectIdentity(
                namespace=namespace,
                group_fingerprint=g.fingerprint,
                shard=tp_rank,
                tp_size=tp_size,
                tokens_per_block=geometry.tokens_per_block,
                page_bytes=g.page_bytes,
                integrity=settings.integrity,
                window=g.window,
            )
            for g in geometry.groups
        }
        layer_group = {lid: g.group_id for g in geometry.groups for lid in g.layer_ids}
        keys = KeyScheme(prefix, namespace, tp_size)
        key_prefix = tuple(keys.group_prefix(g.fingerprint, tp_rank) for g in geometry.groups)
        return cls(geometry, namespace, keys, tp_rank, regions, identity, layer_group, device, key_prefix)

    def object_key(self, group: int, last_digest: bytes) -> str:
        """This rank's key of the object of ``group`` ending at ``last_digest``."""
        return self.key_prefix[group] + last_digest.hex()

    def resolve(self, op: LoadOp) -> tuple[str, tuple[Any, ...], ObjectIdentity]:
        """A load op's object key, target regions and expected identity on this rank."""
        group = op.obj.group
        if group not in self.identity:
            raise LoadPlanError(f"unknown layer group {group}")
        return self.object_key(group, op.obj.last_digest), self.regions[group], self.identity[group]
