"""What the leader derives once from the cache geometry and the settings.

The geometry arrives after the leader is built (the worker registers the layout); from then on
every plan reads the same namespace, key scheme, object sizes, storage policy and lookup
parameters. Building them in one place keeps lookup, load, save and finish planning consistent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...config import Settings
from ...core.keys import KeyScheme, namespace_digest
from ...core.layout import CacheGeometry
from ...core.lookup import LookupParams
from ...core.objects import ObjectIdentity
from ...core.policy import StoragePolicy, object_sizes


@dataclass(frozen=True)
class LeaderContext:
    geometry: CacheGeometry
    settings: Settings
    namespace: bytes
    scheme: KeyScheme
    #: Blocks per object of each group, and of the full-attention ("spine") group.
    group_blocks: tuple[int, ...]
    bpo: int
    checkpoint_blocks: int
    policy: StoragePolicy
    params: LookupParams
    #: (group, shard) -> what a HEAD must find in an object's metadata.
    identities: Mapping[tuple[int, int], ObjectIdentity]
    #: (group, shard) -> the key prefix its objects share (``scheme.object_key`` less the digest):
    #: a lookup names hundreds of keys on the scheduling path.
    prefixes: Mapping[tuple[int, int], str]

    @classmethod
    def build(
        cls, g: CacheGeometry, settings: Settings, key_prefix: str, sizing_page_bytes: Sequence[int] | None = None
    ) -> LeaderContext:
        """``sizing_page_bytes`` (per group) replaces the real page sizes when choosing blocks per
        object (benchmarks that store tiny pages but model a real model's object structure)."""
        namespace = namespace_digest(g, tagged=settings.integrity is not None)
        scheme = KeyScheme(key_prefix, namespace, g.tp_size)
        sizing = sizing_page_bytes or [x.page_bytes for x in g.groups]
        group_blocks, cp_blocks = object_sizes(sizing, g.tokens_per_block, settings)
        bpo = group_blocks[g.spine_group]
        policy = StoragePolicy(
            g, bpo, cp_blocks, settings.storage_policy, settings.window_margin_blocks,
            group_blocks=group_blocks, branch_tails=settings.branch_tails,
        )
        params = LookupParams(
            blocks_per_object=bpo,
            checkpoint_blocks=cp_blocks,
            margin=settings.window_margin_blocks,
            budget=settings.lookup_probe_budget,
            group_blocks=group_blocks,
        )
        identities = {
            (grp.group_id, s): ObjectIdentity(
                namespace, grp.fingerprint, s, g.tp_size, g.tokens_per_block, grp.page_bytes,
                settings.integrity, grp.window,
            )
            for grp in g.groups
            for s in range(g.tp_size)
        }
        prefixes = {
            (grp.group_id, s): scheme.group_prefix(grp.fingerprint, s) for grp in g.groups for s in range(g.tp_size)
        }
        return cls(g, settings, namespace, scheme, group_blocks, bpo, cp_blocks, policy, params, identities, prefixes)
