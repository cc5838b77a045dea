"""The cache geometry as s3kv sees it: pure data, no tensors, no I/O.

Built by the worker from TensorRT-LLM's ``KvCacheLayout`` (the only source that
knows which group id holds which window, how many bytes a page has, and which
layers a group holds) and shared with the leader (see ``s3kv.engine.runtime``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupGeometry:
    group_id: int
    #: Effective attention window in tokens; None = full attention.
    window: int | None
    layer_ids: tuple[int, ...]
    #: Byte size of this group's page in each region (a page is their concatenation).
    region_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.window is not None and self.window <= 0:
            raise ValueError(f"layer group {self.group_id}: window must be positive or None, got {self.window}")
        if not self.region_sizes or any(s <= 0 for s in self.region_sizes):
            raise ValueError(f"layer group {self.group_id}: region sizes must be positive, got {self.region_sizes}")

    @property
    def page_bytes(self) -> int:
        return sum(self.region_sizes)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def fingerprint(self) -> str:
        """16 hex chars naming what a page of this group *is*: window, layers, byte layout.

        Deliberately not the group id: ids are the cache's business and may be
        numbered differently by another engine build for the very same model.
        """
        h = hashlib.blake2b(digest_size=8, person=b"s3kv-group")
        h.update(repr((self.window, self.layer_ids, self.region_sizes)).encode())
        return h.hexdigest()


@dataclass(frozen=True)
class CacheGeometry:
    tokens_per_block: int
    #: Indexed by group id (ids are dense from 0).
    groups: tuple[GroupGeometry, ...]
    tp_size: int
    #: The dtype pages really hold, resolved ("auto" -> model dtype or KV quantization; s3kv/trtllm/identity.py).
    kv_dtype: str
    #: Model identity: name, revision, model dtype, quantization, config digest (``ModelIdentity.model_id``).
    model_id: str

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {self.tokens_per_block}")
        if self.tp_size <= 0:
            raise ValueError(f"tp_size must be positive, got {self.tp_size}")
        for i, g in enumerate(self.groups):
            if g.group_id != i:
                raise ValueError(f"layer group ids must be dense from 0; position {i} holds id {g.group_id}")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def spine_group(self) -> int:
        """The group a lookup probes first: full attention if any, else the widest window.

        A full-attention group stores every block, so its objects alone tell how
        long the stored prefix is; sliding groups only confirm their tails.
        """
        return max(self.groups, key=lambda g: (g.window is None, g.window or 0, -g.group_id)).group_id

    @classmethod
    def from_layout(cls, layout: Any, *, model_id: str, tp_size: int, kv_dtype: str) -> CacheGeometry:
        groups = []
        for g in sorted(layout.groups, key=lambda g: g.layer_group_id):
            groups.append(
                GroupGeometry(
                    group_id=int(g.layer_group_id),
                    window=None if g.window_size is None else int(g.window_size),
                    layer_ids=tuple(int(x) for x in g.layer_ids),
                    region_sizes=tuple(int(r.size) for r in g.regions),
                )
            )
        return cls(
            tokens_per_block=int(layout.tokens_per_block),
            groups=tuple(groups),
            tp_size=tp_size,
            kv_dtype=kv_dtype,
            model_id=model_id,
        )


def effective_window(window: int | None, max_seq_len: int | None) -> int | None:
    """The window a layer group is formed on (the engine's rule, see the API doc)."""
    if window is None or window <= 0:
        return None
    if max_seq_len is None:
        return int(window)
    return None if int(window) >= int(max_seq_len) else int(window)


def expected_windows(max_attention_window: list[int] | None, max_seq_len: int | None) -> set[int | None]:
    """Distinct effective windows the configured list yields (one layer group each)."""
    if not max_attention_window:
        return {None}
    return {effective_window(w, max_seq_len) for w in max_attention_window}
