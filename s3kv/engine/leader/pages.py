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
So the leader records which request it last saw given each page, for pages no live request can
lose while it lives: a parked load's pages (every group: a parked request's window does not move)
and, of full-attention groups, a request's own prompt pages past its device match. Never:

* device-matched pages -- block reuse shares them with live requests (the device match is the
  one the lookup was asked about, whatever a first report's ``computed_position`` says);
* sliding pages of a running request -- the window frees them while it lives;
* pages past the prompt -- speculative decoding hands out pages for draft tokens and gives them
  back when the drafts are rejected (``releaseLastBlock``), while the request lives.

Every new page of every report is *checked* against the records; a live holder's page among
another request's new pages means the engine freed the holder.

An owner is a weak reference to its request state with that state's ``lists_epoch`` (a record
never keeps a dead request's tokens alive): a replayed request (a new state, or its block lists
reported anew) is a new owner, and what was recorded of its earlier allocation is stale, never
evidence. What is found gone is dropped by that state, not by id: KVCacheManagerV2 pauses
generating requests for recompute with no connector call, and one found gone while scheduling
may be looked up again under the same id before the metadata -- that replay's load must run
(stopped, its id was never returned and the engine waited for ever). Records are never removed,
only overwritten: there is at most one per page slot of the pool.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from ...core.layout import CacheGeometry
from ...core.plan import LoadOp
from .requests import RequestState, group_lists
from .stats import LeaderStats

log = logging.getLogger("s3kv.leader")

#: The request state a page was last given to (weakly), and that state's lists_epoch then.
_Owner = tuple["weakref.ref[RequestState]", int]


def _holder(owner: _Owner, live: Mapping[int, RequestState]) -> RequestState | None:
    """The state ``owner`` names if it is still the live one, with the same lists; else None."""
    st = owner[0]()
    if st is None or live.get(st.request_id) is not st or st.lists_epoch != owner[1]:
        return None
    return st


class PageOwners:
    def __init__(self) -> None:
        #: group id -> page slot -> owner
        self._owner: dict[int, dict[int, _Owner]] = {}
        #: Requests found gone since the last metadata (claims made while scheduling), by id: the
        #: state and epoch found gone -- by the time of the metadata the id may name a replay.
        self.gone: dict[int, _Owner] = {}
        #: Parked requests found gone whose loads no metadata has told the workers to stop yet:
        #: their state is dropped, so nothing would find them again if a metadata failed to build.
        self.abandoned: set[int] = set()

    def loading(self, st: RequestState, ops: Iterable[LoadOp], live: Mapping[int, RequestState]) -> None:
        """A parked load was planned: the pages it writes are ``st``'s."""
        for op in ops:
            self.claim(st, op.obj.group, op.slots, op.slots, self.gone, live)

    def claim(self, st: RequestState | None, group_id: int, check: Sequence[int], record: Sequence[int],
              gone: dict[int, _Owner], live: Mapping[int, RequestState]) -> None:
        """Add to ``gone`` every other request ``live`` still holds that was recorded holding one
        of the pages ``check`` of ``group_id``; record ``st`` as the holder of ``record``."""
        owner = self._owner.setdefault(group_id, {})
        # In C where it can be: a 128k-token prompt's first report lists 4,096 pages per group, on
        # the engine's scheduling thread. (No page slot is negative in the map: -1 finds nothing.)
        for prev in map(owner.get, check):
            if prev is None:
                continue
            holder = _holder(prev, live)
            if holder is not None and holder is not st:
                gone[holder.request_id] = prev
        if st is not None and record:
            owner.update(dict.fromkeys(record, (weakref.ref(st), st.lists_epoch)))
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
            if first and st is not None:
                start = max(start, math.ceil(st.load.device_tokens / tpb))
            prompt_blocks = math.ceil(st.prompt_len / tpb) if st is not None else 0
            for gid in range(min(n, len(by_group))):
                delta = by_group[gid]
                if len(delta) <= start or gid not in sliding:
                    continue
                check = delta[start:]
                record: Sequence[int] = ()
                if st is not None and st.root is not None and not sliding[gid] and gid < len(st.slots):
                    # Ordinal of check[0]: a later report's pages come last in the lists folded so far.
                    first_ordinal = start if first else len(st.slots[gid]) - len(delta)
                    record = check[: max(0, prompt_blocks - first_ordinal)]
                self.claim(st, gid, check, record, gone, live)

    def take_abandoned(self) -> frozenset[int]:
        """The parked loads every worker must stop before this iteration's forward (once)."""
        out, self.abandoned = frozenset(self.abandoned), set()
        return out

    def settle(self, requests: MutableMapping[int, RequestState], stats: LeaderStats, discards: set[int]) -> None:
        """Forget the requests found gone (their workers drop what they staged for them); the
        parked ones go to ``abandoned``."""
        abandoned = self.abandoned
        for rid, owner in sorted(self.gone.items(), key=lambda kv: kv[0]):
            st = _holder(owner, requests)
            if st is None:
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
