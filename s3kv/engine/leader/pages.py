"""Who holds each page: requests the engine freed without telling the connector.

Why: some TensorRT-LLM lines end a cancelled request (and one ``_handle_errors`` fails) by
finishing and freeing it with no connector call -- ``request_finished`` is called only for
requests that finished in a scheduled batch. For a request whose async load is still parked,
that is a wrong answer waiting to happen: its load keeps running (on the merged line it retries
for as long as its objects fail, rung 3), and a copy landing after the pages went to another
request overwrites that request's KV. For a running request it is a leak: its leader state and
the workers' staging buffers of its open objects stay until ``request_state_ttl_s``, and enough
cancels fill the staging pool (saves dropped, loads off pinned memory).

The one sign the connector gets is a page of such a request among another request's new pages.
So the leader records, per layer group with full attention, which request it last saw given each
page: a request's *fresh* pages only -- the ones it was allocated for itself (past its device
match on its first report, every page of later reports, the pages its parked load writes). A
device-matched page may be shared with live requests (block reuse), and a sliding group frees
pages of live requests as the window moves, so neither says anything. A fresh page of a live
request cannot be given to another while it lives; when the record says it was, the request is
gone.

An owner is recorded with its request state object and that state's ``lists_epoch``: a replayed
request (a new state, or its block lists reported anew) is a new owner, and what was recorded of
its earlier allocation is stale, never evidence. What is found gone is dropped by that state, not
by id: KVCacheManagerV2 pauses generating requests for recompute with no connector call, and one
found gone while scheduling may be looked up again under the same id before the metadata -- that
replay's load must run (stopped, its id was never returned and the engine waited for ever).
Records are never removed, only overwritten: there is at most one per page slot of the pool.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from ...core.layout import CacheGeometry
from ...core.plan import LoadOp
from .requests import RequestState, group_lists
from .stats import LeaderStats

log = logging.getLogger("s3kv.leader")

#: The request state a page was last given to, and that state's lists_epoch then.
_Owner = tuple[RequestState, int]


class PageOwners:
    def __init__(self) -> None:
        #: group id -> page slot -> owner
        self._owner: dict[int, dict[int, _Owner]] = {}
        #: Requests found gone since the last metadata (claims made while scheduling), by id: the
        #: state and epoch found gone -- by the time of the metadata the id may name a replay.
        self.gone: dict[int, _Owner] = {}

    def loading(self, st: RequestState, ops: Iterable[LoadOp], live: Mapping[int, RequestState]) -> None:
        """A parked load was planned: the pages it writes are ``st``'s (every group: a parked
        request's window does not move)."""
        for op in ops:
            self.claim(st, op.obj.group, op.slots, self.gone, live)

    def claim(self, st: RequestState | None, group_id: int, slots: Iterable[int], gone: dict[int, _Owner],
              live: Mapping[int, RequestState], *, record: bool = True) -> None:
        """Add to ``gone`` every other request ``live`` still holds that was recorded holding one
        of ``slots`` of ``group_id``; with ``record`` (and a request state), record ``st`` as
        their holder now."""
        owner = self._owner.setdefault(group_id, {})
        slots = list(slots)
        # In C where it can be: a 128k-token prompt's first report lists 4,096 pages per group, on
        # the engine's scheduling thread. (No page slot is negative in the map: -1 finds nothing.)
        for prev in map(owner.get, slots):
            if prev is not None and prev[0] is not st:
                o, epoch = prev
                if live.get(o.request_id) is o and o.lists_epoch == epoch:
                    gone[o.request_id] = prev
        if st is not None and record:
            owner.update(dict.fromkeys(slots, (st, st.lists_epoch)))
            owner.pop(-1, None)  # BAD_PAGE_INDEX: no page

    def reported(self, geometry: CacheGeometry, live: Mapping[int, RequestState], reports: Sequence[tuple[Any, bool]],
                 gone: dict[int, _Owner]) -> None:
        """Claim the fresh pages of this iteration's reports ``(RequestData, first)`` (after all of
        them were folded, so a replay's new epoch is in place whatever the order)."""
        tpb, n = geometry.tokens_per_block, geometry.num_groups
        sliding = {g.group_id: g.is_sliding for g in geometry.groups}
        for rd, first in reports:
            raw = getattr(rd, "new_block_ids_by_layer_group", None)
            by_group: Sequence[Sequence[int]] = raw if isinstance(raw, list) else group_lists(raw, n)
            if not by_group and n == 1:
                by_group = [getattr(rd, "new_block_ids", None) or ()]
            if not any(by_group):  # most reports: a decode step that needed no new page
                continue
            st = live.get(rd.request_id)  # None: a request we keep nothing of; its pages still tell
            # A first report lists every page from ordinal 0: the device match's may be shared.
            start = math.ceil(int(getattr(rd, "computed_position", 0) or 0) / tpb) if first else 0
            for gid in range(min(n, len(by_group))):
                if len(by_group[gid]) > start and gid in sliding:
                    # A sliding group frees a live request's pages as its window moves: such a
                    # page is checked against the parked loads recorded for it, never recorded.
                    self.claim(st, gid, by_group[gid][start:], gone, live, record=not sliding[gid])

    def settle(self, requests: MutableMapping[int, RequestState], stats: LeaderStats, discards: set[int]) -> frozenset[int]:
        """Forget the requests found gone (their workers drop what they staged for them); the
        ones whose load was parked, which every worker must stop before this iteration's forward."""
        abandoned: set[int] = set()
        for rid, (st, epoch) in sorted(self.gone.items(), key=lambda kv: kv[0]):
            if requests.get(rid) is not st or st.lists_epoch != epoch:
                continue  # ended, or replayed (a new lookup, new lists) since it was found gone
            del requests[rid]
            discards.add(rid)
            if st.load.parked:
                abandoned.add(rid)
                stats.loads_abandoned += 1
            else:
                stats.requests_freed_silently += 1
            log.warning(
                "s3kv: request %s was freed with no connector call (a page of it went to another request)%s",
                rid, "; its parked load is stopped" if st.load.parked else "; its unsaved pages are dropped",
                extra={"request_id": rid},
            )
        self.gone.clear()
        return frozenset(abandoned)
