"""The checker: compares pages with what recomputation would write, and never repairs them.

Two moments are checked:
  * "load": at a request's first forward after allocation (sync) or resume
    (async), after ``wait_for_layer_load(layer)`` and before the model writes
    that layer, every real page of ordinals below the computed position is
    compared -- the connector's pages and the device's own.
  * "audit": when the engine frees a page, it is compared with what was last
    written to it (or verified in it), catching a connector that scribbled over
    a page it does not own after the fact.
A mismatching page keeps its wrong bytes: the run goes on exactly as a real
engine would, silently using them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import GroupSpec
from .model import KvModel
from .pools import RankPool
from .report import KvMismatch


@dataclass(frozen=True)
class PageCheck:
    """One page a request must hold correct KV in before its first forward."""

    request_id: int
    group_id: int
    ordinal: int
    slot: int
    digest: bytes
    source: str  # "connector" | "device"


class KvChecker:
    def __init__(
        self,
        kv: KvModel,
        pools: Sequence[RankPool],
        groups: Sequence[GroupSpec],
        *,
        junk_byte: int,
        audit: bool,
        max_details: int = 200,
    ):
        self._kv = kv
        self._pools = pools
        self._groups = {g.group_id: g for g in groups}
        self._junk = junk_byte
        self._audit_enabled = audit
        self._max_details = max_details
        # (rank, group, slot) -> digest the page must hold, or None (unknown/known bad: not audited)
        self._expect: dict[tuple[int, int, int], bytes | None] = {}
        self.reset()

    def reset(self) -> None:
        self.kv_mismatches = 0
        self.details: list[KvMismatch] = []
        self.pages_checked = 0
        self.pages_audited = 0
        # (request, rank, group, ordinal, region) -> [slot, layers, kind, source] during one pass
        self._pending: dict[tuple[int, int, int, int, int], list] = {}

    # -- expectations ------------------------------------------------------------------------------

    def note_written(self, rank: int, group_id: int, slot: int, digest: bytes) -> None:
        self._expect[(rank, group_id, slot)] = digest

    def forget(self, rank: int, group_id: int, slot: int) -> None:
        self._expect.pop((rank, group_id, slot), None)

    # -- load check --------------------------------------------------------------------------------

    def check_layer(self, rank: int, layer: int, group_id: int, pages: Sequence[PageCheck]) -> None:
        """Verify ``layer``'s bytes of ``pages`` (all in ``group_id``) on ``rank``."""
        pool = self._pools[rank]
        first_layer = self._groups[group_id].layer_ids[0] == layer
        for page in pages:
            if first_layer:
                self.pages_checked += 1
                self._expect[(rank, group_id, page.slot)] = page.digest
            for region in range(pool.region_count(group_id)):
                seg = pool.layer_segment(group_id, region, page.slot, layer)
                want = self._kv.content(page.digest, layer, rank, region)
                if torch.equal(seg, want):
                    continue
                self._expect[(rank, group_id, page.slot)] = None  # known bad: don't audit it again
                key = (page.request_id, rank, group_id, page.ordinal, region)
                entry = self._pending.setdefault(key, [page.slot, [], self._kind(seg), page.source])
                entry[1].append(layer)

    def end_pass(self) -> None:
        """Turn this forward's per-layer findings into one record per page region."""
        for (rid, rank, gid, ordinal, region), (slot, layers, kind, source) in self._pending.items():
            self._record(
                KvMismatch(rid, rank, gid, ordinal, slot, region, tuple(layers), kind, "load", source)
            )
        self._pending.clear()

    # -- audit -------------------------------------------------------------------------------------

    def audit(self, request_id: int, rank: int, group_id: int, ordinal: int, slot: int) -> None:
        """Before the engine junks a freed page: does it still hold what was last written to it?"""
        digest = self._expect.pop((rank, group_id, slot), None)
        if not self._audit_enabled or digest is None:
            return
        pool = self._pools[rank]
        self.pages_audited += 1
        for region in range(pool.region_count(group_id)):
            bad = []
            kind = "wrong"
            for layer in self._groups[group_id].layer_ids:
                seg = pool.layer_segment(group_id, region, slot, layer)
                if not torch.equal(seg, self._kv.content(digest, layer, rank, region)):
                    bad.append(layer)
                    kind = self._kind(seg)
            if bad:
                self._record(
                    KvMismatch(
                        request_id,
                        rank,
                        group_id,
                        ordinal,
                        slot,
                        region,
                        tuple(bad),
                        kind,
                        "audit",
                        "unknown",
                    )
                )

    # -- helpers -----------------------------------------------------------------------------------

    def _kind(self, seg: torch.Tensor) -> str:
        if bool((seg == self._junk).all()):
            return "junk"
        if not bool(seg.any()):
            return "zero"
        return "wrong"

    def _record(self, m: KvMismatch) -> None:
        self.kv_mismatches += 1
        if len(self.details) < self._max_details:
            self.details.append(m)
