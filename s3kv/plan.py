"""Per-iteration connector metadata: what the leader tells every worker to do.

Small, frozen and picklable: under tensor parallelism it is broadcast from rank 0
and bound on every rank. Ops name layer groups, block ordinals and page slots;
the worker turns them into object keys for its own shard, so one plan serves
every rank.

Save path, in three op kinds, so the leader alone decides object composition:

* ``StageOp`` — copy one page (group, slot) into host staging as page
  ``ordinal - buffer.first`` of an object buffer. Emitted in the iteration the
  block completes: a sliding-window page may be freed right after it.
* ``SealOp`` — pack pages ``[buffer.first, buffer.first + count)`` of a buffer into
  an object named by the chain digest of its last block and upload it
  (write-once). ``close`` frees the buffer; a seal with ``close=False`` uploads a
  snapshot (e.g. at the prompt's end) while later blocks still fill the buffer.
* ``releases`` — free a buffer whose last seal already went out.
* ``finishing_ids`` — requests the engine holds for us (``request_finished``
  returned True); report each from ``get_finished`` once its stage copies are done.

Load path: ``LoadOp`` reads the pages ``ordinals`` of one object into ``slots``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BufferId:
    """An object being assembled in staging: one request, group and run of blocks."""

    request_id: int
    group: int
    first: int  # first block ordinal the object will hold
    capacity: int  # most blocks it can hold


@dataclass(frozen=True)
class StageOp:
    buffer: BufferId
    ordinal: int
    slot: int


@dataclass(frozen=True)
class SealOp:
    buffer: BufferId
    count: int
    last_digest: bytes
    close: bool = True


@dataclass(frozen=True)
class ObjectRef:
    """A stored object as the lookup saw it, per shard (writers may differ per shard)."""

    group: int
    last_digest: bytes
    #: (first ordinal, page count) for each shard, indexed by tp rank.
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LoadOp:
    request_id: int
    obj: ObjectRef
    ordinals: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class ConnectorMetadata:
    iteration: int = 0
    loads: tuple[LoadOp, ...] = ()
    #: Requests whose loads are async (reported from get_finished when on the device).
    async_load_ids: frozenset[int] = frozenset()
    stages: tuple[StageOp, ...] = ()
    seals: tuple[SealOp, ...] = ()
    #: Requests held by request_finished -> True, to report once their stages are copied.
    finishing_ids: frozenset[int] = frozenset()
    #: Buffers to free without (another) upload: their last seal already went out.
    releases: tuple[BufferId, ...] = ()
    #: Requests whose open buffers are dropped without upload (replayed or aborted).
    discard_ids: frozenset[int] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.stages or self.seals or self.finishing_ids or self.discard_ids or self.releases)
