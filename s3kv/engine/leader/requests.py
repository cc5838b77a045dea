"""The leader's per-request state, grouped by what changes it.

* :class:`RequestState` -- what the request is (chain, tokens) and the engine's view of it (page
  lists, how far its KV exists, when it was last mentioned), plus the parts below;
* :class:`LoadState` -- the lookup's offer and the load promise (``lookup.py``, ``loads.py``);
* :class:`SaveState` -- the save cursor, the open object buffers and this pass's stage, seal and
  release ops (``saves.py``; ``finish.py`` dry-runs a copy of it);
* :class:`BranchTail` -- the branch-point tail being staged (``saves.py``);
* ``finish_sent`` / ``finish_memo`` -- the standing finish plan the workers hold (``finish.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.hitrule import Span
from ...core.keys import Chain
from ...core.plan import BufferId, FinishPlan, LoadOp, SealOp, StageOp
from ...core.value import Plan


def group_lists(by_group: Any, num_groups: int) -> list[list[int]]:
    """Per-group page lists as a list indexed by group id.

    The merged API passes a list; one V2 branch passes a dict keyed by group id.
    Both name the group explicitly, so both are accepted; anything else is empty.
    """
    if not by_group:
        return []
    if isinstance(by_group, dict):
        return [list(by_group.get(g, ())) for g in range(num_groups)]
    return [list(x) for x in by_group]


@dataclass
class Buffer:
    bid: BufferId
    count: int = 0  # pages staged
    sealed: int = 0  # pages covered by the last seal
    #: Where its seals send the object (``SealOp.to_s3``; ``writes.py`` decides).
    to_s3: str = "now"


@dataclass
class LoadState:
    """What the lookup offered and what the engine honoured; the loads not yet sent."""

    d_blocks: int = 0
    #: The device match the lookup was asked about, in tokens (may end inside a block).
    device_tokens: int = 0
    h_blocks: int = 0  # served history after honour (device match + connector)
    offered_blocks: int = 0
    load_async: bool = False
    coverage: dict[tuple[int, int], dict[int, Span]] = field(default_factory=dict)
    #: How far the lookup saw the full-attention chain stored (``LookupResult.spine_blocks``), and
    #: how far of it the store holds (less what only the host tier does: ``Lookups._stored_spine``).
    spine_blocks: int = 0
    stored_spine_blocks: int = 0
    #: How far the store holds that chain without a gap from the start of the chunk it ends in, on
    #: every shard, not capped at what may be served (0: not seen whole from a chunk's start): where
    #: this request's chain objects may begin, inside a chunk (``core.lookup``).
    chain_stored_to: int = 0
    #: The offer reaches the first chunk's end: the engine must grow the allocation to honour it
    #: (``pressure.py``). Known only where the engine says how it chunks the prompt.
    needs_grow: bool = False
    #: The servable history the lookup found (blocks), before the guard cut it; and the offer as
    #: made (blocks), before the engine cancelled any of it (``cancel_load``).
    found_blocks: int = 0
    made_blocks: int = 0
    #: Looked up again (the engine took its pages back to run it anew).
    replayed: bool = False
    #: An async load was promised and the request has not been reported since (still parked).
    parked: bool = False
    #: The next metadata must declare this request's async load (even with nothing to load).
    declare_async: bool = False
    pending: list[LoadOp] = field(default_factory=list)


@dataclass
class SaveState:
    """Where saving stands: blocks planned so far, the open object buffers, and this pass's ops.

    The buffer operations below are the only way objects open, fill and close, for the live
    plan and for the finish plan's dry run alike.
    """

    request_id: int
    chain: Chain | None
    completed: int = 0  # blocks whose completion has been planned
    save_from: int = 0
    open: dict[int, Buffer] = field(default_factory=dict)
    #: Sliding groups: the block that most recently left the window during decode.
    evicted: dict[int, Buffer] = field(default_factory=dict)
    stages: list[StageOp] = field(default_factory=list)
    seals: list[SealOp] = field(default_factory=list)
    releases: list[BufferId] = field(default_factory=list)
    #: What the value policy decided this request writes (``writes.py``; None: not decided).
    plan: Plan | None = None

    def stage(self, gid: int, o: int, slot: int, capacity: int, to_s3: str = "now") -> None:
        """Stage ``o`` into the group's open buffer, opening one of ``capacity`` blocks when the
        run breaks, the buffer is full or its objects go elsewhere (``to_s3``)."""
        buf = self.open.get(gid)
        if buf is not None and (
            o != buf.bid.first + buf.count or buf.count >= buf.bid.capacity or buf.to_s3 != to_s3
        ):
            self.close(gid)
            buf = None
        if buf is None:
            buf = Buffer(BufferId(self.request_id, gid, o, capacity), to_s3=to_s3)
            self.open[gid] = buf
        self.stages.append(StageOp(buf.bid, o, slot))
        buf.count += 1

    def seal(self, gid: int, *, close: bool, to_s3: str | None = None) -> None:
        """Seal the group's open buffer (``to_s3``: where this seal's object goes, if not where the
        buffer's go -- a prompt-end snapshot of a tail that runs on to a checkpoint)."""
        buf = self.open[gid]
        assert self.chain is not None
        if buf.count > buf.sealed:
            last = buf.bid.first + buf.count - 1
            self.seals.append(SealOp(buf.bid, buf.count, self.chain.digests[last], close, to_s3 or buf.to_s3))
            buf.sealed = buf.count
        elif close:
            self.releases.append(buf.bid)
        if close:
            del self.open[gid]

    def close(self, gid: int) -> None:
        if gid in self.open:
            self.seal(gid, close=True)

    def release_evicted(self, gid: int) -> None:
        """Drop the group's evicted copy (its staging is freed)."""
        ev = self.evicted.pop(gid, None)
        if ev is not None:
            self.releases.append(ev.bid)


@dataclass
class BranchTail:
    """Branch-point tail: its end ordinal (0: none) and, per sliding group, its buffer while open
    and the next ordinal to stage. ``chain``: the request writes the full-attention chain up to
    the branch point too, its object ending there (a branch its own recent prompts show, where S3
    holds no chain ending at it: ``saves.py``)."""

    end: int = 0
    chain: bool = False
    open: dict[int, Buffer] = field(default_factory=dict)
    next: dict[int, int] = field(default_factory=dict)


@dataclass
class RequestState:
    request_id: int
    root: bytes | None  # None: not cacheable
    chain: Chain | None
    tokens: list[int]
    prompt_len: int
    slots: list[list[int]] = field(default_factory=list)
    reported: bool = False
    kv_tokens: int = 0  # tokens whose KV exists on the device
    #: Bumped when the engine re-sends the whole page lists (a first report).
    lists_epoch: int = 0
    #: time.monotonic() of the last call about it (state of requests the engine forgot expires).
    seen: float = 0.0
    load: LoadState = field(default_factory=LoadState)
    saves: SaveState = field(init=False)
    branch: BranchTail = field(default_factory=BranchTail)
    #: The finish plan the workers hold for this request (the last one sent).
    finish_sent: FinishPlan | None = None
    #: The last finish plan computed and what it was computed from (see ``finish.py``).
    finish_memo: tuple[Any, FinishPlan] | None = None

    def __post_init__(self) -> None:
        self.saves = SaveState(self.request_id, self.chain)
