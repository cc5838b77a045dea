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
* ``FinishPlan`` — per request, what to save if it finishes right after this
  iteration's pass: the same three op kinds, carried as a *standing* plan. Why:
  TensorRT-LLM calls ``request_finished`` and then ``get_finished`` in the same
  iteration, with no metadata in between, frees the pages as soon as every
  rank returns the id, and an idle engine builds no metadata at all. So each
  worker must already hold what a finishing request still needs saving (its
  sliding-window tail, its open objects) when the id reaches ``get_finished``;
  the leader sends a request's plan again only when it changes.

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


#: ``SealOp.to_s3``'s values, nearest the store first: a seal that goes no further than two
#: others goes to the later of them.
TO_S3 = ("now", "evict", "never")


@dataclass(frozen=True)
class SealOp:
    buffer: BufferId
    count: int
    last_digest: bytes
    close: bool = True
    #: Where the object goes: "now" = the store now (and the host tier, if there is one);
    #: "evict" = the host tier now, the store when the tier evicts it, only if a load read it
    #: while cached; "never" = the host tier only. A seal that needs a host tier where there is
    #: none is dropped and counted.
    to_s3: str = "now"


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
    #: The leader found the object in rank 0's host tier: every rank expects it in its own
    #: (a rank that does not hold it reads the store and counts the divergence).
    host: bool = False


@dataclass(frozen=True)
class FinishPlan:
    """What a worker does for ``request_id`` when it arrives in ``finished_gen_req_ids``.

    ``stages`` copy pages still on the device (the live sliding tail), ``seals``
    upload, ``releases`` free. Buffers of the request the plan does not seal are
    dropped at that point. An empty plan: nothing left to save.
    """

    request_id: int
    stages: tuple[StageOp, ...] = ()
    seals: tuple[SealOp, ...] = ()
    releases: tuple[BufferId, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.stages or self.seals or self.releases)


@dataclass(frozen=True)
class ConnectorMetadata:
    iteration: int = 0
    loads: tuple[LoadOp, ...] = ()
    #: Requests whose loads are async (reported from get_finished when on the device).
    async_load_ids: frozenset[int] = frozenset()
    stages: tuple[StageOp, ...] = ()
    seals: tuple[SealOp, ...] = ()
    #: Standing finish plans that changed this iteration (replace the request's previous plan).
    finish_plans: tuple[FinishPlan, ...] = ()
    #: Buffers to free without (another) upload: their last seal already went out.
    releases: tuple[BufferId, ...] = ()
    #: Requests whose open buffers are dropped without upload (replayed or aborted).
    discard_ids: frozenset[int] = frozenset()
    #: Requests promised a load the leader could not plan (e.g. honoured at a point no stored
    #: sliding tail ends at): the workers take the failure rung for them at once.
    failed_load_ids: frozenset[int] = frozenset()
    #: The leader's verdict directory on this host (``engine.verdicts``): where ranks past 0 say
    #: which objects they found bad. Empty with one rank.
    verdicts: str = ""
    #: Parked requests the engine freed without telling the connector (their pages were handed
    #: to another request): each worker stops their loads before this iteration's forward, and
    #: never returns their ids.
    abandoned_ids: frozenset[int] = frozenset()
    #: Seconds between refreshes of an object a worker loads (``Listings.refresh_s``: from the
    #: retention gc deletes by, the fleet index's); 0: as the worker's settings say.
    refresh_s: float = 0.0

    @property
    def empty(self) -> bool:
        return not (
            self.loads or self.stages or self.seals or self.finish_plans or self.discard_ids or self.releases
            or self.abandoned_ids
        )
