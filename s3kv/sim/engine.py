"""The engine simulator: drives a connector leader and one worker per rank in TensorRT-LLM's call order.

It follows the non-overlap ``PyExecutor._executor_loop`` (trtllm-connector-api.md,
"Per-iteration call order", checked against TensorRT-LLM's source; see
docs/failures.md). One iteration:

  1. scheduling: newly admitted requests are allocated; V2 asks the connector
     (``get_num_new_matched_tokens``), commits what it will consume (``honour``:
     the whole offer, less, or nothing -- the async flag passes through even
     for 0), sets ``py_num_connector_matched_tokens`` and gives pages by the V2
     rule, then ``update_state_after_alloc[_by_layer_group]``;
  2. only if a batch was scheduled (requests parked for an async load count:
     they are taken out afterwards): ``SchedulerOutput`` -> leader
     ``build_connector_meta`` -> pickle round trip (broadcast under TP) ->
     every worker ``bind_connector_meta`` -> ``start_load_kv``;
  3. only if something is left to compute: the forward (per layer, per rank:
     ``wait_for_layer_load`` -> [checker] -> the model writes the layer ->
     ``save_kv_layer``; then the forward-pass callables) and ``wait_for_save``;
  4. tokens are sampled, histories advance, context pages that left the window
     are freed (and junked: V2's update_context_resources);
  5. ``request_finished[_by_layer_group]`` for requests that finished (a cancel, only in
     a pass with a batch, frees its request silently: see ``SimEngine``); True keeps the
     pages, False frees them at once; then
     ``update_resources`` frees the generation pages that left the window --
     also of a request just held for an async save (its lists were passed
     with that page still in them);
  6. every iteration the loop runs: ``get_finished`` on every rank with the ids
     of steps 1 and 5 *of this same iteration*; an id every rank returned
     resumes a parked request or frees a held one.

``overlap=True`` runs ``_executor_loop_overlap`` instead (TensorRT-LLM's default):
the same steps, but the host learns a forward's sampled tokens one pass later,
so generation ``RequestData`` is one token behind the position the forward
writes, and ``request_finished`` / ``update_resources`` for a batch come in the
next pass, after that pass's metadata and forward (see ``_iteration_overlap``).
``cuda_graphs=True``: generation-only passes call no layer hook (a replayed graph).
Errors: the overlap loop dies even on an exception inside the forward (the error budget fails
the batch, then ``assert sample_state is not None``); the non-overlap loop may survive one
there. The simulator ends the run on any connector exception in both loops.

An idle engine (nothing running, parked or waiting) blocks on its request
queue and calls nothing, not even ``get_finished``. Any exception from a
connector call ends the run as :class:`SimEngineCrash` -- the real executor's
event loop dies on one and the other TP ranks hang. ``failed_load_hook`` models
the line whose connector manager has a failed-load path (``take_failed_load_request_ids``,
``try_abort_request``, TP consensus before pages are freed): ``failpath.py``.

Everything runs in one process and one thread; the leader is rank 0's.

Why this is one module: the executor loop is one state machine (scheduling, metadata, forward,
sampling, finishing, hand-over, in TensorRT-LLM's order); split, the call order would no longer read
top to bottom.
"""

from __future__ import annotations

import enum
import itertools
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..trtllm.api import RequestData, SchedulerOutput
from .checker import KvChecker, PageCheck
from .config import GroupSpec, SimCacheConfig, SimModel, layer_groups, sliding_cutoff
from .failpath import FailedLoadPath
from .llm_args import SimLlmArgs, make_llm_args
from .model import KvModel, PrefixHasher, adapter_weights, next_token, request_root
from .pools import GroupAllocator, RankPool, SimError
from .report import RequestReport, SimReport
from .request import SimLlmRequest, SimRequestSpec

Honour = Callable[[int], int]
# (request_id, context chunks done in this attempt, attempt) -> preempt now?
PreemptHook = Callable[[int, int, int], bool]
# (request_id, tokens generated so far, attempt) -> preempt now, during generation?
PreemptGenerationHook = Callable[[int, int, int], bool]
# (request_id, attempt) -> discard this async load's result and recompute?
DiscardHook = Callable[[int, int], bool]


#: The executor loops a connector is proven on, as :class:`SimEngine` keyword arguments: the
#: non-overlap loop, TensorRT-LLM's default overlap loop, and each with CUDA-graph decode
#: (TensorRT-LLM's default too: no layer hook fires in a generation-only pass).
EXECUTOR_LOOPS: dict[str, dict[str, bool]] = {
    "non-overlap": {},
    "overlap": {"overlap": True},
    "graphs": {"cuda_graphs": True},
    "overlap+graphs": {"overlap": True, "cuda_graphs": True},
}


class SimHang(SimError):
    """A run did not finish within its iteration cap; ``stuck`` maps request id -> what it waits for."""

    def __init__(self, message: str, stuck: Mapping[int, str]):
        super().__init__(message)
        self.stuck = dict(stuck)


class SimEngineCrash(SimError):
    """A connector call raised: the real executor dies (every request on the engine fails, TP ranks hang)."""

    def __init__(self, hook: str, cause: BaseException | str):
        super().__init__(f"engine crash: {hook}() raised {cause!r}" if isinstance(cause, BaseException)
                         else f"engine crash: {cause}")
        self.hook = hook
        self.cause = cause


class SimContractError(SimEngineCrash):
    """A connector broke the API contract (the real engine raises -- it dies -- or hangs)."""

    def __init__(self, message: str):
        super().__init__("contract", message)


class _Phase(enum.Enum):
    WAITING = "waiting for admission"
    PARKED = "parked: async load"
    RUNNING = "running"
    SAVING = "finished: pages held for async save"
    DONE = "done"


@dataclass(eq=False)
class _Req:
    """Engine-side state of one request (mutable; never shown to a connector)."""

    spec: SimRequestSpec
    req: SimLlmRequest
    hasher: PrefixHasher
    seq: int  # position in the workload: admission and scheduling order
    phase: _Phase = _Phase.WAITING
    attempt: int = 0
    order: int = -1  # admission counter of the current attempt
    device_match: int = 0
    offered: int = 0
    honoured: int = 0
    is_async: bool = False
    ever_async: bool = False
    discarded: bool = False
    computed: int = 0  # tokens whose KV is in the pages (loaded tokens count once honoured)
    prefill_start: int = 0  # where the model's own prefill began in this attempt
    blocks: list[list[int]] = field(default_factory=list)  # per group: ordinal -> slot or -1
    reserved: list[int] = field(default_factory=list)  # per group: pages promised, not yet allocated
    reported: list[int] = field(default_factory=list)  # per group: entries already sent in RequestData
    reported_tokens: int = 0
    needs_first_report: bool = True
    check_pending: bool = False
    chunks_done: int = 0
    #: The first context pass's length when it differs from ``chunk_size`` (``first_chunk`` hook,
    #: a failed grow); used once.
    first_pass: int | None = None
    generated: int = 0  # tokens sampled (on the device; the host may not know the last one yet)
    #: Overlap loop: the token the last forward sampled, not yet on the host (``_update_requests``
    #: of the next pass appends it); the next forward reads it on the device.
    pending: int | None = None
    #: Overlap loop: ``GENERATION_TO_COMPLETE`` -- its last token is sampled; not scheduled again,
    #: ``request_finished`` comes when the next pass processes this batch.
    to_complete: bool = False
    #: Overlap loop: paused for recompute after this pass (V2 folds the tokens in once the host has them).
    pause_pending: bool = False
    load_ranks: set[int] = field(default_factory=set)  # ranks yet to return the async load
    save_ranks: set[int] = field(default_factory=set)  # ranks yet to return the held (saving) id
    cancelled: bool = False
    #: Overlap loop, V2: cancelled (and freed) while in the batch just queued; the next pass's
    #: ``_send_kv_async`` still finds it finished in ``previous_batch`` and calls
    #: ``request_finished_by_layer_group`` with one empty list per group (its cache is gone).
    finish_after_release: bool = False
    recomputed_failed_load: bool = False  # rewound after the manager reported its load failed
    failed: str = ""  # ended with this error (the executor's _handle_errors), no connector call
    t_admit: float = 0.0
    t_first_token: float = 0.0
    t_done: float = 0.0
    it_admit: int = -1
    it_done: int = -1

    @property
    def rid(self) -> int:
        return self.spec.request_id

    @property
    def tokens(self) -> list[int]:
        """The host's tokens (what connectors see); the engine owns the list, connectors get copies."""
        return self.req._tokens

    @property
    def device_tokens(self) -> list[int]:
        """The tokens the forward reads: the host's, plus (overlap loop) the one only the device has."""
        return self.tokens if self.pending is None else [*self.tokens, self.pending]


def honoured_after_failed_grow(device_match: int, chunk_end: int, tokens_per_block: int) -> int:
    """What KVCacheManagerV2 (``_reserve_connector_prefix``) honours of an offer reaching the first
    chunk's end when growing the allocation fails: the largest whole block inside the pages it
    has that still leaves a chunk to compute, or nothing when that is not past the device match."""
    return max(0, (chunk_end - 1) // tokens_per_block * tokens_per_block - device_match)


class SimEngine:
    """Simulated TensorRT-LLM engine around a connector.

    ``leader_cls`` / ``worker_cls`` are classes or factories called as
    ``cls(llm_args, **connector_kwargs)`` (rank 0's llm_args for the leader).
    ``honour(offer) -> honoured`` models V2 honouring fewer tokens than offered.
    ``preempt_hook`` / ``discard_hook`` inject replays (see the type aliases).
    ``extra_retained_blocks`` keeps sliding pages that many blocks longer before
    freeing them; ``extra_allocated_blocks`` gives that many more blocks below
    the window real pages at allocation (a retained window larger than
    configured, as with speculative decoding). ``flat`` drives the flat
    (single group) leader callbacks and ``RequestData.new_block_ids``.
    ``failed_load_hook`` installs the connector manager's failed-load path (``failpath.py``:
    ``take_failed_load_request_ids`` after every ``get_finished``, abort consensus across the
    ranks, worker and scheduler ``try_abort_request``, ``finalize_successful_load``); a request
    the manager returns as failed ends as ``failed_load_outcome`` says: ``"fail"`` (the executor
    fails it, "KV cache load failure"; pages freed, no connector call) or ``"recompute"``
    (rewound to its device match and recomputed, reported anew). The connectors are told
    through ``connector_kwargs["engine_features"]``, standing in for what they would detect on
    such an install. ``process_per_rank``: each rank past 0 joins an engine runtime of
    its own (its own key index, breaker and metrics), as each TensorRT-LLM rank is its own
    process; by default all ranks share the leader's (one process).
    ``preempt_generation_hook`` preempts a request during generation as KVCacheManagerV2 may
    (``_terminate_recompute_paused_requests`` frees its pages, ``reset_for_recompute`` folds the
    generated tokens into its prompt; no connector call): it is re-admitted with the longer
    prompt, looked up and reported anew under the same id.
    Cancellation (``SimRequestSpec.cancel_after_iterations``) as py_executor @0004396 does it:
    ``_handle_canceled_requests`` runs only inside ``if can_queue:`` of ``_executor_loop`` (after
    ``_send_kv_async``), and in ``_executor_loop_overlap`` only inside ``_process_previous_batch``,
    i.e. in a pass that has a previous batch. A pass with no batch (say only parked requests are
    left) cancels nothing: the cancel waits for the next pass that queues one.
    ``silent_cancel`` (default True, @0004396): a cancelled request is freed with no connector
    call, parked or not -- ``_handle_canceled_requests`` marks it finished after
    ``_send_kv_async`` ran, ``_handle_responses`` -> ``_terminate_request`` frees its pages at once
    (they go to the next allocation, LIFO), and by the next ``_send_kv_async`` it is gone -- except
    on the overlap loop, where it is still in the previous batch there, finished, its pages
    already freed: on the KVCacheManagerV2 line ``get_page_indices_by_layer_group`` has no entry
    for it and the manager calls ``request_finished_by_layer_group`` with one empty list per group
    (connectors/kv_cache_connector.py @035ab91, ``request_finished``; PR 18762's review), which the
    simulator does; on the flat line it drops the request (V1's C++ ``get_cache_block_ids`` for a
    freed sequence not verified). ``False`` calls
    ``request_finished`` for a cancel as for a finish -- no stored upstream source does; kept as a
    stricter check that the connector also survives being told.
    ``overlap`` runs ``_executor_loop_overlap`` (TensorRT-LLM's default) instead of the
    non-overlap loop, and tells the connectors so through ``llm_args.disable_overlap_scheduler``
    (see :meth:`_iteration_overlap`). ``cuda_graphs``: a pass whose batch is generation only
    replays a CUDA graph, inside which no layer hook fires (``wait_for_layer_load`` /
    ``save_kv_layer`` are not called; the forward-pass callables and ``wait_for_save`` are).
    ``first_chunk(request_id) -> tokens | None``: the scheduler's chunk for the request's first
    context pass (smaller under load; a whole number of blocks); default ``chunk_size``. The request
    carries it as ``context_chunk_size`` when the connector is asked (``get_num_new_matched_tokens``),
    as KVCacheManagerV2 does: its scheduler sized the chunk before the connector hooks run.
    ``grow_fails(request_id) -> bool``: memory pressure. An offer reaching the first chunk's end
    ``C = d + chunk`` (capped at the prompt) needs the allocation grown; when that fails, V2's
    ``_reserve_connector_prefix`` honours ``(C - 1) // tpb * tpb`` (nothing when that is not past
    ``d``) and the first pass computes up to ``C`` (``honour_when_growth_fails`` is the same rule for
    one fixed chunk). Applied before ``honour``.
    ``attention_dp=(owner, size)``: this engine is owner rank ``owner`` of an attention-DP engine
    of ``size`` ranks (1.4.0rc4 line): its own scheduler and worker, its own requests, attention not
    sharded (``tp_size`` 1 here) -- run one SimEngine per owner. Not modelled yet: the owners'
    batch-size allgather in ``_can_queue``, which can skip a pass on every owner after its metadata
    was bound (why s3kv refuses attention DP; docs/failures.md).
    Both connector classes must declare ``supports_attention_dp = True`` (the manager's
    ``validate_attention_dp``); the scheduler output carries ``attention_dp_rank``.
    """

    def _own_process(self, kwargs: dict[str, Any], rank: int) -> dict[str, Any]:
        """Connector kwargs for rank ``rank`` as its own process: its own engine runtime (index,
        breaker, metrics), as in TensorRT-LLM, where only rank 0's worker shares the leader's."""
        base = kwargs.get("engine_key") or "derived"
        return {**kwargs, "engine_key": f"{base}#rank{rank}-{id(self):x}"}

    def __init__(
        self,
        model: SimModel,
        config: SimCacheConfig,
        leader_cls: Callable[..., Any],
        worker_cls: Callable[..., Any],
        *,
        tp_size: int | None = None,
        device: str | torch.device = "cpu",
        chunk_size: int | None = None,
        max_batch: int = 4,
        honour: Honour | None = None,
        preempt_hook: PreemptHook | None = None,
        discard_hook: DiscardHook | None = None,
        extra_retained_blocks: int = 0,
        extra_allocated_blocks: int = 0,
        flat: bool = False,
        failed_load_hook: bool = False,
        failed_load_outcome: str = "recompute",
        connector_kwargs: Mapping[str, Any] | None = None,
        max_mismatch_details: int = 200,
        process_per_rank: bool = True,
        silent_cancel: bool = True,
        preempt_generation_hook: PreemptGenerationHook | None = None,
        overlap: bool = False,
        cuda_graphs: bool = False,
        attention_dp: tuple[int, int] | None = None,
        first_chunk: Callable[[int], int | None] | None = None,
        grow_fails: Callable[[int], bool] | None = None,
        forward_fails: Callable[[int], bool] | None = None,
    ):
        if forward_fails is not None and overlap:
            raise ValueError("forward_fails models the non-overlap loop (the overlap loop dies on one)")
        if tp_size is None:
            tp_size = model.tp_size
        elif model.tp_size != 1 and tp_size != model.tp_size:
            raise ValueError(f"tp_size {tp_size} contradicts the model's tp_size {model.tp_size}")
        model.heads_per_shard(tp_size)  # validates tp_size
        if attention_dp is not None and (tp_size != 1 or not 0 <= attention_dp[0] < attention_dp[1]):
            raise ValueError("attention_dp=(owner, size) models one owner rank: tp_size 1, 0 <= owner < size")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError("chunk_size must be positive or None")
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        if extra_retained_blocks < 0 or extra_allocated_blocks < 0:
            raise ValueError("extra blocks must be >= 0")
        self.model = model
        self.config = config
        self.tp_size = tp_size
        self.device = torch.device(device)
        self.chunk_size = chunk_size
        self.max_batch = max_batch
        self.honour = honour or (lambda offer: offer)
        self.first_chunk = first_chunk
        self.grow_fails = grow_fails
        self.forward_fails = forward_fails
        self.preempt_hook = preempt_hook
        self.discard_hook = discard_hook
        self.extra_retained_blocks = extra_retained_blocks
        self.extra_allocated_blocks = extra_allocated_blocks
        self.flat = flat
        self.failed_load_hook = failed_load_hook
        if failed_load_outcome not in ("fail", "recompute"):
            raise ValueError("failed_load_outcome must be 'fail' or 'recompute'")
        self.failed_load_outcome = failed_load_outcome
        self.silent_cancel = silent_cancel
        self.preempt_generation_hook = preempt_generation_hook
        self.overlap = overlap
        self.cuda_graphs = cuda_graphs
        self.attention_dp = attention_dp
        self.tpb = config.tokens_per_block
        self.groups: tuple[GroupSpec, ...] = layer_groups(model, config.max_seq_len)
        self._group_of_layer = {layer: g for g in self.groups for layer in g.layer_ids}
        if flat and (len(self.groups) != 1 or self.groups[0].sliding or model.regions_per_group != 1):
            raise ValueError("flat mode needs one full-attention group with one region")

        max_blocks = -(-config.max_seq_len // self.tpb)
        num_slots = config.pages_per_group or (max_batch + 1) * max_blocks + 8
        self.allocators = tuple(GroupAllocator(g.group_id, num_slots, config.seed) for g in self.groups)
        self.pools = tuple(
            RankPool(r, self.groups, model, config, tp_size, num_slots, self.device) for r in range(tp_size)
        )
        self.kv = KvModel(
            num_layers=model.num_layers,
            tp_size=tp_size,
            region_bytes=model.region_bytes_per_layer(self.tpb, tp_size),
            device=self.device,
            seed=config.seed,
        )
        self.checker = KvChecker(
            self.kv,
            self.pools,
            self.groups,
            junk_byte=config.junk_byte,
            audit=config.audit,
            max_details=max_mismatch_details,
        )

        self._hook_seconds: dict[str, float] = {}
        kwargs = dict(connector_kwargs or {})
        settings = kwargs.get("settings")
        if settings is not None and getattr(settings, "host_cache_gb", 0) < 0:
            # The host tier's automatic size is an engine's (the machine's memory): a simulated
            # engine has one only when asked for (S3KV_HOST_CACHE_GB >= 0).
            kwargs["settings"] = settings.replace(host_cache_gb=0)
        if failed_load_hook:
            kwargs["engine_features"] = frozenset(kwargs.get("engine_features", ())) | {"failed_load_hook"}
        self.llm_args: tuple[SimLlmArgs, ...] = tuple(
            make_llm_args(model, config, tp_size, r, overlap=overlap, attention_dp=attention_dp)
            for r in range(tp_size)
        )
        self.leader = leader_cls(self.llm_args[0], **kwargs)
        self.workers = tuple(
            worker_cls(self.llm_args[r], **(kwargs if r == 0 or not process_per_rank else self._own_process(kwargs, r)))
            for r in range(tp_size)
        )
        self._check_bring_up()
        # [failpath] the manager's failed-load path, when this engine models a line that has it.
        self._failpath = (
            FailedLoadPath(tp_size, self._call, lambda msg: SimEngineCrash("get_finished", msg), self._parse_finished)
            if failed_load_hook else None
        )
        # The cache is created (and registered) before the first request is scheduled.
        for pool, worker in zip(self.pools, self.workers, strict=True):
            self._register(worker, pool)
        self._forward_callables = [
            cb
            for cb in (getattr(w, "register_forward_pass_callable", lambda: None)() for w in self.workers)
            if cb
        ]

        self._ids_seen: set[int] = set()
        #: The engine's LoRA adapter cache (PeftCacheManager): task id -> the weights it applies.
        #: The first path loaded for an id wins; a later request naming the id gets those
        #: weights, whatever path it names (upstream drops a cached task's tensors).
        self._lora_weights: dict[int, bytes] = {}
        self._done_ids: set[int] = set()
        self._admissions = 0
        # Per rank: ids handed to get_finished and not yet returned by that rank.
        self._out_load: list[set[int]] = [set() for _ in range(tp_size)]
        self._out_save: list[set[int]] = [set() for _ in range(tp_size)]
        # Engine-level request queues (they outlive a run: an idle engine keeps held pages).
        self._waiting: list[_Req] = []
        self._live: list[_Req] = []  # running or parked
        self._held: list[_Req] = []  # finished, pages held until every rank returns the saving id
        # Overlap loop: the batch whose forward ran last pass, with each request's KV count after
        # it (``previous_batch``: its tokens, finishes and page updates are processed a pass late).
        self._prev: list[tuple[_Req, int, bool, int]] = []
        self._had_batch = False
        self._seq = 0
        self._wake_id = 1 << 40
        self._iterations = 0

    # ------------------------------------------------------------------ bring-up

    def _check_bring_up(self) -> None:
        if self.attention_dp is not None:
            for side in (self.leader, *self.workers):
                if getattr(type(side), "supports_attention_dp", False) is not True:
                    raise SimContractError(
                        f"bring-up fails: {type(side).__name__} does not declare supports_attention_dp=True"
                    )
        need = (
            ("update_state_after_alloc", "request_finished")
            if self.flat
            else ("update_state_after_alloc_by_layer_group", "request_finished_by_layer_group")
        )
        for name in ("get_num_new_matched_tokens", "build_connector_meta", *need):
            if not callable(getattr(self.leader, name, None)):
                raise SimContractError(f"bring-up fails: the connector scheduler has no {name}()")
        for name in (
            "bind_connector_meta",
            "start_load_kv",
            "wait_for_layer_load",
            "save_kv_layer",
            "wait_for_save",
            "get_finished",
        ):
            if not callable(getattr(self.workers[0], name, None)):
                raise SimContractError(f"bring-up fails: the connector worker has no {name}()")

    def _register(self, worker: Any, pool: RankPool) -> None:
        if callable(getattr(worker, "register_kv_cache_layout", None)):
            self._call("register_kv_cache_layout", worker.register_kv_cache_layout, pool.layout)
            return
        flat_tensor = pool.layout.as_single_pool_tensor()
        if flat_tensor is None or not callable(getattr(worker, "register_kv_caches", None)):
            raise SimContractError(
                "bring-up fails: the worker cannot take this layout (no register_kv_cache_layout)"
            )
        # V1 shape: [num_blocks, num_layers, kv_factor, block_bytes].
        view = flat_tensor.view(flat_tensor.shape[0], self.model.num_layers, 2, -1)
        self._call("register_kv_caches", worker.register_kv_caches, view)

    def shutdown(self) -> None:
        """Call the connectors' optional ``shutdown()`` hooks."""
        for obj in (self.leader, *self.workers):
            fn = getattr(obj, "shutdown", None)
            if callable(fn):
                fn()

    def __enter__(self) -> SimEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ public

    def run(
        self,
        specs: Iterable[SimRequestSpec],
        *,
        max_iterations: int | None = None,
    ) -> SimReport:
        """Submit ``specs`` and run the executor loop until it would block idle; report.

        The real loop runs while any request is active (running, parked for an
        async load) or waiting; with none it blocks on its request queue and
        calls no connector hook at all -- not even ``get_finished``. So a request
        still held for an async save when the engine goes idle keeps its pages
        until the next ``run`` (the next request's first iteration calls
        ``get_finished``). Raises :class:`SimHang` past ``max_iterations``
        (every iteration counts; iterations that only wait on a connector back
        off up to 2 ms each; the default allows twice the work plus 5000 waits,
        ~10 s) and :class:`SimEngineCrash` when a connector call raises. May be
        called repeatedly on one engine; request ids must be unique per engine.
        """
        specs = list(specs)
        states = [self._new_state(s, self._seq + i) for i, s in enumerate(specs)]
        self._seq += len(states)
        if max_iterations is None:
            chunk = self.chunk_size or self.config.max_seq_len
            work = sum(-(-len(s.prompt) // chunk) + s.max_new_tokens + 1 for s in specs)
            max_iterations = 2 * work + 5000
        self.checker.reset()
        self._hook_seconds = {}
        self._waiting.extend(states)
        self._waiting.sort(key=lambda x: x.seq)
        t_start = time.perf_counter()
        idle = 0
        it = 0
        # (Overlap loop: a previous batch left when the loop goes idle is processed by the first
        # pass of the next run, as the real loop's previous_batch waits for the next request.)
        while self._waiting or self._live:
            if it >= max_iterations:
                raise self._hang(states, f"run did not finish within {max_iterations} iterations")
            progressed = self._iteration(self._iterations)
            self._iterations += 1
            it += 1
            if progressed:
                idle = 0
            else:
                if not self._live and self._waiting:
                    raise self._hang(
                        states, "nothing can be admitted (pool too small or a dependency never finishes)"
                    )
                # Only connector-side waits remain: back off a little so background threads can run.
                idle += 1
                time.sleep(min(0.002, 0.0001 * idle))
        # Idle: the executor blocks here. Only requests held for an async save may keep pages.
        guard = sum(p.guard_violations() for p in self.pools)
        held = {g.group_id: 0 for g in self.groups}
        for st in self._held:
            for gi, lst in enumerate(st.blocks):
                held[self.groups[gi].group_id] += sum(1 for s in lst if s >= 0)
        leaked = {a.group_id: a.in_use - held[a.group_id] for a in self.allocators if a.in_use != held[a.group_id]}
        if leaked:
            raise SimError(f"pages still allocated after every request finished: {leaked}")
        return SimReport(
            requests=tuple(self._request_report(st) for st in states),
            iterations=it,
            kv_mismatches=self.checker.kv_mismatches,
            mismatches=tuple(self.checker.details),
            pages_checked=self.checker.pages_checked,
            pages_audited=self.checker.pages_audited,
            guard_violations=guard,
            hook_seconds=dict(self._hook_seconds),
            wall_s=time.perf_counter() - t_start,
            held_while_idle=tuple(st.rid for st in self._held),
        )

    @property
    def held_request_ids(self) -> tuple[int, ...]:
        """Requests whose pages the engine still holds for an async save (e.g. while idle)."""
        return tuple(st.rid for st in self._held)

    def held_pages(self) -> int:
        """Pages (all groups) still held by finished requests."""
        return sum(1 for st in self._held for lst in st.blocks for slot in lst if slot >= 0)

    def drain_held(self, max_requests: int = 100, new_tokens: int = 8, prompt_len: int = 2) -> int:
        """Send short requests, one at a time, until the requests held now are released; return how many.

        The idle executor calls no hook, so only new traffic lets a connector
        return held ids: this is that traffic (fresh ids, tiny prompts, nothing to
        hit). The wake requests may themselves end up held (that is the same
        rule). Raises :class:`SimHang` if the connector never lets go.
        """
        target = {st.rid for st in self._held}
        sent = 0
        while target & {st.rid for st in self._held}:
            if sent >= max_requests:
                raise self._hang(self._held, f"held pages not released after {max_requests} requests")
            rid = self._wake_id
            self._wake_id += 1
            prompt = tuple((rid * 7919 + i) % self.model.vocab_size for i in range(prompt_len))
            self.run([SimRequestSpec(rid, prompt, max_new_tokens=new_tokens)])
            sent += 1
        return sent

    # ------------------------------------------------------------------ one iteration

    def _iteration(self, it: int) -> bool:
        """One pass of the non-overlap ``PyExecutor._executor_loop`` (see the module doc)."""
        if self.overlap:
            return self._iteration_overlap(it)
        progressed, started_loading, scheduled, stream = self._schedule_and_start(it)
        if scheduled and self.forward_fails is not None and self.forward_fails(it):
            return self._forward_failed(it, scheduled, started_loading)

        # 3. The forward, only if something is left to compute; wait_for_save at its end.
        progressed |= self._run_forward(scheduled, stream)

        # 4. Sample and advance; context pages that left the window are freed now (V2's
        #    update_context_resources runs before the responses are handled).
        finished: list[_Req] = []
        for st, n, is_ctx in scheduled:
            self._advance(st, n, is_ctx, it, finished)
        if scheduled:  # _handle_canceled_requests runs inside ``if can_queue:`` only
            self._cancel_due(it, finished)

        # 5. _send_kv_async -> request_finished; True holds the pages ("still saving"), False frees
        #    them now (_handle_responses). Their ids reach get_finished in this same iteration.
        finished_gen: list[int] = []
        for st in finished:
            self._finish(st, it, finished_gen, tell=not (st.cancelled and self.silent_cancel))
            progressed = True
        # 5b. update_resources: generation pages that left the window are freed after
        #     request_finished, a request held for an async save included.
        for st, _, is_ctx in scheduled:
            if not is_ctx and st.phase in (_Phase.RUNNING, _Phase.SAVING):
                self._free_left_window(st, st.computed)

        # 6. Every iteration the loop runs: get_finished on every rank, then the allgather.
        return self._get_finished(finished_gen, started_loading) or progressed

    def _iteration_overlap(self, it: int) -> bool:
        """One pass of ``PyExecutor._executor_loop_overlap`` (py_executor @0004396).

        Scheduling, metadata and the forward of this batch as in the non-overlap loop, but the
        host learns what a forward sampled only in the next pass: a generating request's
        ``RequestData`` is one token behind the position its forward writes (the forward reads
        the last token on the device), and a request whose last token this forward samples is
        marked ``GENERATION_TO_COMPLETE`` (``will_complete_next_iteration``: no extra forward
        for a length-limited request) and gets ``request_finished`` in the next pass -- after
        that pass's metadata and forward for the others, or in a pass with no batch at all.
        After this batch's forward the previous batch is processed: ``_update_requests`` (its
        tokens reach the host), ``_send_kv_async`` (``request_finished``), then, after this
        batch's sampling and context-page update, ``_process_previous_batch`` (cancellations,
        ``update_resources``: its generation pages that left the window are freed, requests
        held for an async save included), and ``get_finished`` last.
        """
        progressed, started_loading, scheduled, stream = self._schedule_and_start(it)
        progressed |= self._run_forward(scheduled, stream)
        prev, self._prev = self._prev, []
        # previous_batch: set by a pass that queued a batch, cleared by one that did not.
        had_batch, self._had_batch = self._had_batch, bool(scheduled)

        # _update_requests(previous batch): the host appends the tokens its forward sampled.
        finished: list[_Req] = []
        for st, _, _, _ in prev:
            progressed = True
            if st.finish_after_release:
                finished.append(st)
                continue
            if st.pending is None:
                continue
            st.tokens.append(st.pending)
            st.pending = None
            if st.phase is _Phase.RUNNING and st.generated >= st.spec.output_limit:
                finished.append(st)
        # _send_kv_async(previous batch): request_finished -- also for a request cancelled after
        # this batch was queued (freed already: V2 reports one empty list per group).
        finished_gen: list[int] = []
        for st in finished:
            if st.finish_after_release:
                self._finish_released(st, finished_gen)
            else:
                self._finish(st, it, finished_gen)
        # V2's pause for recompute, once the host holds the request's tokens.
        for st, _, _, _ in prev:
            if st.pause_pending:
                st.pause_pending = False
                if st.phase is _Phase.RUNNING:
                    self._preempt(st, generating=True)

        # _sample_async + _update_request_states + _update_v2_context_resources (this batch). A
        # request that just finished by a stop token was in this batch too (the host did not know):
        # that extra forward wrote its stop token's KV; what it sampled is dropped.
        current: list[tuple[_Req, int, bool, int]] = []
        for st, n, is_ctx in scheduled:
            if st.phase is not _Phase.RUNNING:
                st.computed += n
                current.append((st, n, is_ctx, st.computed))
            elif self._sample(st, n, is_ctx):
                current.append((st, n, is_ctx, st.computed))

        # _process_previous_batch (only with a previous batch): cancellations, then
        # update_resources(previous batch).
        cancelled: list[_Req] = []
        if had_batch:
            self._cancel_due(it, cancelled)
        in_batch = {id(x[0]) for x in current}
        for st in cancelled:
            self._finish(st, it, finished_gen, tell=not self.silent_cancel)
            # Still in the batch just queued (the next previous_batch), finished: the next pass's
            # _send_kv_async calls request_finished for it (KVCacheManagerV2 line; the flat line's
            # get_cache_indices on a freed request is not modelled).
            st.finish_after_release = self.silent_cancel and not self.flat and id(st) in in_batch
            progressed = True
        for st, _, is_ctx, history in prev:
            if not is_ctx and st.phase in (_Phase.RUNNING, _Phase.SAVING):
                self._free_left_window(st, history)

        # _update_generation_requests_that_will_complete_next_iteration; V2 pausing a request.
        for st, _, is_ctx, _ in current:
            if st.phase is not _Phase.RUNNING:
                continue
            if st.generated >= st.spec.max_new_tokens:
                st.to_complete = True
            elif (
                not is_ctx
                and self.preempt_generation_hook is not None
                and self.preempt_generation_hook(st.rid, st.generated, st.attempt)
            ):
                st.pause_pending = True
        self._prev = [
            x for x in current if x[0].phase in (_Phase.RUNNING, _Phase.SAVING) or x[0].finish_after_release
        ]

        return self._get_finished(finished_gen, started_loading) or progressed

    def _schedule_and_start(self, it: int) -> tuple[bool, list[int], list[tuple[_Req, int, bool]], Any]:
        """Steps 1 and 2 of a pass (both loops): admission and allocation, then -- only with a
        scheduled batch -- the scheduler output, ``build_connector_meta``, bind and ``start_load_kv``."""
        progressed = False
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        live = self._live

        # 1. Scheduling; under V2 the connector is asked while the batch's pages are prepared.
        started_loading: list[int] = []
        for st in list(self._waiting):
            if sum(1 for x in live if x.phase in (_Phase.PARKED, _Phase.RUNNING)) >= self.max_batch:
                break
            if not all(dep in self._done_ids for dep in st.spec.after):
                continue
            if not self._reserve(st):
                continue
            self._waiting.remove(st)
            live.append(st)
            self._allocate(st, it, started_loading)
            progressed = True

        # 2. Only with a scheduled batch (requests parked for an async load count: they were
        #    scheduled, then taken out): scheduler output -> build_connector_meta -> broadcast ->
        #    bind -> start_load_kv. An idle iteration calls none of these. (Overlap loop: a
        #    request marked to complete or to pause is not scheduled.)
        running = sorted(
            (x for x in live if x.phase is _Phase.RUNNING and not x.to_complete and not x.pause_pending),
            key=lambda x: x.order,
        )
        scheduled: list[tuple[_Req, int, bool]] = []
        if running or started_loading:
            dp = {} if self.attention_dp is None else {"attention_dp_rank": self.attention_dp[0]}
            out = SchedulerOutput(new_requests=[], cached_requests=[], **dp)
            for st in running:
                is_ctx = st.computed < st.req.prompt_len
                n = min(st.first_pass or self.chunk_size or st.req.prompt_len, st.req.prompt_len - st.computed) if is_ctx else 1
                st.first_pass = None
                self._ensure_pages(st, -(-(st.computed + n) // self.tpb))
                rd = self._request_data(st, n, is_ctx)
                (out.new_requests if rd[1] else out.cached_requests).append(rd[0])
                scheduled.append((st, n, is_ctx))
            meta = self._call("build_connector_meta", self.leader.build_connector_meta, out)
            try:
                blob = pickle.dumps(meta)
            except Exception as e:
                raise SimContractError(
                    f"connector metadata is not picklable (it is broadcast under TP): {e}"
                ) from e
            for w in self.workers:
                self._call("bind_connector_meta", w.bind_connector_meta, pickle.loads(blob))
            for w in self.workers:
                self._call("start_load_kv", w.start_load_kv, stream)
        return progressed, started_loading, scheduled, stream

    def _run_forward(self, scheduled: list[tuple[_Req, int, bool]], stream: Any) -> bool:
        """The forward, only if something is left to compute; ``wait_for_save`` at its end."""
        if not scheduled:
            return False
        self._forward(scheduled, stream)
        for w in self.workers:
            self._call("wait_for_save", w.wait_for_save, stream)
        return True

    def _forward_failed(self, it: int, scheduled: list[tuple[_Req, int, bool]], started_loading: list[int]) -> bool:
        """The forward raised -- the model's error, not a connector's (py_executor ``_forward_step``
        catches it). It stopped part-way: the pages it was writing hold no request's KV, and no
        ``wait_for_save`` runs. ``_handle_errors`` fails every active request (parked ones are left
        out here: whether they are active then was not verified) and frees its pages with no
        connector call. The same pass goes on: ``_send_kv_async(scheduled_batch.all_requests())``
        finds the batch's requests finished, their cache gone -- on the KVCacheManagerV2 line the
        manager calls ``request_finished_by_layer_group`` with one empty list per group (on the
        flat line V1's ``get_cache_indices`` raises for a freed request and it is skipped: not
        verified) -- and ``get_finished`` runs as in every pass."""
        tpb = self.tpb
        for st, n, _ in scheduled:
            self._spoil(st, range(st.computed // tpb, (st.computed + n - 1) // tpb + 1))
        batch = {st.rid for st, _, _ in scheduled}
        finished_gen: list[int] = []
        for st in [s for s in self._live if s.phase is _Phase.RUNNING]:
            st.failed = "forward failed"
            st.t_done, st.it_done = time.perf_counter(), it
            st.t_first_token = st.t_first_token or st.t_done
            self._done_ids.add(st.rid)
            self._live.remove(st)
            self._release(st)
            st.phase = _Phase.DONE
            if st.rid in batch and not self.flat:
                self._finish_released(st, finished_gen)
        self._get_finished(finished_gen, started_loading)
        return True

    def _spoil(self, st: _Req, ordinals: range) -> None:
        """What a forward stopped part-way leaves in the pages it was writing: no request's KV
        (and nothing the checker expects of them)."""
        for b, (gi, g), (rank, pool) in itertools.product(ordinals, enumerate(self.groups), enumerate(self.pools)):
            slot = st.blocks[gi][b]
            if slot < 0:
                continue
            self.checker.forget(rank, gi, slot)
            for layer, k in itertools.product(g.layer_ids, range(pool.region_count(gi))):
                pool.layer_segment(gi, k, slot, layer).fill_(-7)

    def _cancel_due(self, it: int, finished: list[_Req]) -> None:
        """Requests whose client gave up (``cancel_after_iterations``) join ``finished``."""
        for st in self._live:
            c = st.spec.cancel_after_iterations
            if c is not None and st not in finished and st.phase in (_Phase.PARKED, _Phase.RUNNING):
                if it - st.it_admit >= c:
                    st.cancelled = True
                    st.pending = None  # overlap loop: a token the host never sees
                    if st.phase is _Phase.PARKED:
                        st.discarded = True  # its load was never used
                    finished.append(st)

    def _get_finished(self, finished_gen: list[int], started_loading: list[int]) -> bool:
        """Step 6 (both loops): get_finished on every rank, then the allgather."""
        if self._failpath is not None:  # [failpath] the manager's poll with abort consensus
            return self._failed_load_poll(finished_gen, started_loading)
        progressed = False
        for rank, w in enumerate(self.workers):
            self._out_save[rank].update(finished_gen)
            self._out_load[rank].update(started_loading)
            ret = self._call("get_finished", w.get_finished, list(finished_gen), list(started_loading))
            saved, loaded = self._parse_finished(rank, ret)
            for rid in saved:
                progressed |= self._rank_returned(rid, rank, saving=True)
            for rid in loaded:
                progressed |= self._rank_returned(rid, rank, saving=False)
        return progressed

    def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A connector call. Any exception kills the real executor (``_event_loop_wrapper`` re-raises;
        under TP the other ranks hang in their next collective): here it ends the run."""
        try:
            return self._timed(name, fn, *args)
        except SimError:
            raise
        except Exception as e:  # noqa: BLE001 - that is the point
            raise SimEngineCrash(name, e) from e

    def _failed_load_poll(self, finished_gen: list[int], started_loading: list[int]) -> bool:
        """[failpath] Step 6 on a line with the failed-load path: the manager's poll on every rank
        (``failpath.FailedLoadPath``), then what the executor does with its result."""
        assert self._failpath is not None
        for rank in range(self.tp_size):  # what each rank is handed (the contract checks)
            self._out_save[rank].update(finished_gen)
            self._out_load[rank].update(started_loading)
        res = self._failpath.poll(self.workers, self.leader, finished_gen, started_loading)
        progressed = bool(res.finished_saves or res.resumed_loads or res.failed_loads or res.released)
        for rid in res.finished_saves:
            st = self._find(rid)
            if st is not None and st.phase is _Phase.SAVING:
                self._release(st)
                st.phase = _Phase.DONE
                self._held.remove(st)
        for rid in res.resumed_loads:
            st = self._find(rid)
            if st is not None and st.phase is _Phase.PARKED:
                self._resume(st)
        for rid in res.failed_loads:
            st = self._find(rid)
            if st is None or st.phase is not _Phase.PARKED:
                continue
            if self.failed_load_outcome == "recompute":
                self._rewind(st)
                st.recomputed_failed_load = True
                continue
            # _handle_errors: the request fails; its pages are freed with no connector call.
            st.failed = "KV cache load failure"
            st.t_done, st.it_done = time.perf_counter(), self._iterations
            st.t_first_token = st.t_first_token or st.t_done
            self._done_ids.add(st.rid)
            self._live.remove(st)
            self._release(st)
            st.phase = _Phase.DONE
        return progressed

    # ------------------------------------------------------------------ admission and allocation

    def _new_state(self, spec: SimRequestSpec, seq: int) -> _Req:
        rid = spec.request_id
        if rid in self._ids_seen:
            raise ValueError(f"request id {rid} was already used on this engine")
        self._ids_seen.add(rid)
        plen = len(spec.prompt)
        if plen + spec.max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"request {rid}: prompt + max_new_tokens exceeds max_seq_len {self.config.max_seq_len}"
            )
        d = spec.device_match_tokens
        if d < 0 or d % self.tpb or d > plen - 1:
            raise ValueError(f"request {rid}: device_match_tokens {d} must be block-aligned and < prompt_len")
        nonce = rid if spec.multimodal_positions and not spec.multimodal_hashes else None
        root = request_root(
            cache_salt=spec.cache_salt,
            lora_weights=self._adapter(spec),
            multimodal_hashes=spec.multimodal_hashes,
            unhashed_multimodal_nonce=nonce,
            salt_changes_kv=self.config.salt_changes_kv,
        )
        return _Req(spec=spec, req=SimLlmRequest(spec), hasher=PrefixHasher(root, self.tpb), seq=seq)

    def _adapter(self, spec: SimRequestSpec) -> bytes | None:
        """The LoRA weights the engine applies to ``spec`` (None: the base model)."""
        task = spec.lora_task_id
        if task is None:
            return None
        if task not in self._lora_weights:
            if not spec.lora_path:  # upstream: the task is neither cached nor loadable; the request fails
                raise ValueError(f"request {spec.request_id}: LoRA task {task} is not loaded and has no lora_path")
            self._lora_weights[task] = adapter_weights(spec.lora_path)
        return self._lora_weights[task]

    def _reserve(self, st: _Req) -> bool:
        """Promise the request its worst case of pages in every group, or leave it waiting."""
        need = -(-(len(st.spec.prompt) + st.spec.max_new_tokens) // self.tpb)
        if any(a.available < need for a in self.allocators):
            return False
        for a in self.allocators:
            a.reserve(need)
        st.reserved = [need] * len(self.groups)
        return True

    def _allocate(self, st: _Req, it: int, started_loading: list[int]) -> None:
        req, tpb = st.req, self.tpb
        d = st.spec.device_match_tokens
        req.py_num_connector_matched_tokens = 0
        hooked = self.first_chunk(st.rid) if self.first_chunk is not None else None
        if hooked is not None and (hooked <= 0 or hooked % tpb):
            raise SimError(f"first_chunk({st.rid}) returned {hooked}: must be a positive whole number of blocks")
        chunk = hooked or self.chunk_size
        chunk_end = min(d + chunk, req.prompt_len) if chunk else req.prompt_len
        req.context_chunk_size = chunk_end - d
        ret = self._call("get_num_new_matched_tokens", self.leader.get_num_new_matched_tokens, req, d)
        try:
            offer, is_async = int(ret[0]), bool(ret[1])
        except Exception as e:
            raise SimContractError(f"get_num_new_matched_tokens must return (int, bool), got {ret!r}") from e
        rid = st.rid
        if offer == 0 and is_async:
            raise SimContractError(f"request {rid}: get_num_new_matched_tokens returned (0, True)")
        if offer < 0 or (d + offer) % tpb or d + offer > req.prompt_len - 1:
            raise SimContractError(
                f"request {rid}: offer {offer} on top of device match {d} must be >= 0, end on a block "
                f"boundary and leave the last prompt token (prompt_len {req.prompt_len})"
            )
        grow_failed = self.grow_fails is not None and d + offer >= chunk_end and self.grow_fails(st.rid)
        honoured = honoured_after_failed_grow(d, chunk_end, tpb) if grow_failed else offer
        honoured = min(honoured, int(self.honour(offer)))
        if not 0 <= honoured <= offer or honoured % tpb:
            raise SimError(
                f"honour({offer}) returned {honoured}: must be a whole number of blocks <= the offer"
            )
        req.py_num_connector_matched_tokens = honoured
        h = d + honoured
        st.device_match, st.offered, st.honoured, st.is_async = d, offer, honoured, is_async
        st.ever_async |= is_async
        st.discarded = False
        st.computed = st.prefill_start = h
        st.order = self._admissions
        self._admissions += 1
        if st.attempt == 0:
            st.t_admit, st.it_admit = time.perf_counter(), it
        # V2: pages cover the first chunk; a sliding group gives no page to ordinals left of its window at h.
        # The first pass: up to the chunk's end after a failed grow (V2 keeps the pages it has),
        # else the chunk shifted past what was honoured.
        first = chunk_end - h if grow_failed and h < chunk_end else min(chunk or req.prompt_len, req.prompt_len - h)
        st.first_pass = first if grow_failed or hooked is not None else None
        upto = -(-(h + first) // tpb)
        st.blocks = []
        for g in self.groups:
            cut = min(upto, sliding_cutoff(h, g.window, tpb, self.extra_allocated_blocks))
            lst = [-1] * cut
            st.blocks.append(lst)
        self._ensure_pages(st, upto)
        self._prefill_device_match(st)
        lists = [list(b) for b in st.blocks]
        if self.flat:
            self._call("update_state_after_alloc", self.leader.update_state_after_alloc, req, lists[0])
        else:
            self._call(
                "update_state_after_alloc_by_layer_group",
                self.leader.update_state_after_alloc_by_layer_group,
                req,
                lists,
            )
        st.reported = [0] * len(self.groups)
        st.reported_tokens = 0
        st.needs_first_report = True
        st.chunks_done = 0
        if is_async:
            # Parked even when nothing was honoured (the flag passes through): the engine waits
            # for every rank to return the id, then computes whatever was not loaded.
            st.phase = _Phase.PARKED
            st.load_ranks = set(range(self.tp_size))
            started_loading.append(rid)
        else:
            st.phase = _Phase.RUNNING
            st.check_pending = True

    def _ensure_pages(self, st: _Req, upto: int) -> None:
        for gi, g in enumerate(self.groups):
            lst = st.blocks[gi]
            while len(lst) < upto:
                if st.reserved[gi] <= 0:
                    raise SimError(f"request {st.rid}: group {g.group_id} needs more pages than reserved")
                st.reserved[gi] -= 1
                lst.append(self.allocators[gi].alloc())

    def _prefill_device_match(self, st: _Req) -> None:
        """The device's own prefix cache: correct KV for every real page below the device match."""
        for o in range(st.device_match // self.tpb):
            digest = st.hasher.digest(st.tokens, (o + 1) * self.tpb)
            for gi, g in enumerate(self.groups):
                slot = st.blocks[gi][o]
                if slot < 0:
                    continue
                for rank, pool in enumerate(self.pools):
                    for layer in g.layer_ids:
                        for k in range(pool.region_count(g.group_id)):
                            pool.layer_segment(g.group_id, k, slot, layer).copy_(
                                self.kv.content(digest, layer, rank, k)
                            )
                    self.checker.note_written(rank, g.group_id, slot, digest)

    # ------------------------------------------------------------------ scheduler output

    def _request_data(self, st: _Req, n: int, is_ctx: bool) -> tuple[RequestData, bool]:
        first = st.needs_first_report
        tokens = st.tokens
        if first:
            new_tokens = list(tokens)
            deltas = [list(b) for b in st.blocks]
        else:
            new_tokens = tokens[st.reported_tokens :]
            deltas = [b[st.reported[gi] :] for gi, b in enumerate(st.blocks)]
        st.reported_tokens = len(tokens)
        st.reported = [len(b) for b in st.blocks]
        st.needs_first_report = False
        if is_ctx:
            # The first report of a sync load excludes the connector's tokens: it marks where the load begins.
            position = st.computed - (st.honoured if first and not st.is_async and not st.discarded else 0)
        else:
            position = len(tokens) - 1
        rd = RequestData(
            request_id=st.rid,
            new_tokens=new_tokens,
            new_block_ids=list(deltas[0]) if len(self.groups) == 1 else [],
            computed_position=position,
            num_scheduled_tokens=n,
            block_hashes=[],
            priorities=None,
            cache_salt=st.req.cache_salt,
            new_block_ids_by_layer_group=[] if self.flat else deltas,
        )
        return rd, first

    # ------------------------------------------------------------------ forward

    def _forward(self, scheduled: list[tuple[_Req, int, bool]], stream: Any) -> None:
        tpb = self.tpb
        # Pages to verify before the first write (connector loads and device pages), grouped by group.
        checks: dict[int, list[PageCheck]] = {g.group_id: [] for g in self.groups}
        # Blocks each request writes this pass: (ordinal, digest of the prefix written so far).
        writes: list[tuple[_Req, list[tuple[int, bytes]]]] = []
        for st, n, _ in scheduled:
            if st.check_pending:
                st.check_pending = False
                for o in range(st.computed // tpb):
                    digest = st.hasher.digest(st.tokens, (o + 1) * tpb)
                    source = "device" if o < st.device_match // tpb else "connector"
                    for gi, g in enumerate(self.groups):
                        slot = st.blocks[gi][o]
                        if slot >= 0:
                            checks[g.group_id].append(PageCheck(st.rid, g.group_id, o, slot, digest, source))
            c = st.computed
            tokens = st.device_tokens
            blocks = []
            for b in range(c // tpb, (c + n - 1) // tpb + 1):
                p = min((b + 1) * tpb, c + n)
                blocks.append((b, st.hasher.digest(tokens, p)))
            writes.append((st, blocks))
        # A generation-only batch replays a CUDA graph: no layer hook fires inside it.
        hooks = not (self.cuda_graphs and all(not is_ctx for _, _, is_ctx in scheduled))
        for layer in range(self.model.num_layers):
            g = self._group_of_layer[layer]
            gi = g.group_id
            for rank, (pool, w) in enumerate(zip(self.pools, self.workers, strict=True)):
                if hooks:
                    self._call("wait_for_layer_load", w.wait_for_layer_load, layer, stream)
                if checks[gi]:
                    self.checker.check_layer(rank, layer, gi, checks[gi])
                for st, blocks in writes:
                    for b, digest in blocks:
                        slot = st.blocks[gi][b]
                        if slot < 0:
                            raise SimError(
                                f"request {st.rid}: writing ordinal {b} of group {gi} without a page"
                            )
                        for k in range(pool.region_count(gi)):
                            pool.layer_segment(gi, k, slot, layer).copy_(
                                self.kv.content(digest, layer, rank, k)
                            )
                        if layer == g.layer_ids[-1]:
                            self.checker.note_written(rank, gi, slot, digest)
                if hooks:
                    self._call("save_kv_layer", w.save_kv_layer, layer, stream)
        for cb in self._forward_callables:
            self._call("forward_pass_callable", cb)
        self.checker.end_pass()

    # ------------------------------------------------------------------ get_finished

    def _parse_finished(self, rank: int, ret: Any) -> tuple[list[int], list[int]]:
        try:
            saved, loaded = ret
            saved, loaded = [int(x) for x in (saved or [])], [int(x) for x in (loaded or [])]
        except Exception as e:
            raise SimContractError(f"rank {rank}: get_finished must return (list, list), got {ret!r}") from e
        for rid in saved:
            if rid not in self._out_save[rank]:
                raise SimContractError(
                    f"rank {rank}: get_finished returned saving id {rid} it was not handed"
                )
            self._out_save[rank].remove(rid)
        for rid in loaded:
            if rid not in self._out_load[rank]:
                raise SimContractError(
                    f"rank {rank}: get_finished returned loading id {rid} it was not handed"
                )
            self._out_load[rank].remove(rid)
        return saved, loaded

    def _find(self, rid: int) -> _Req | None:
        return next((x for x in self._live if x.rid == rid), None) or next(
            (x for x in self._held if x.rid == rid), None
        )

    def _rank_returned(self, rid: int, rank: int, *, saving: bool) -> bool:
        """One rank returned ``rid``; act once every rank has (the manager's allgather + intersection)."""
        st = self._find(rid)
        if st is None:
            return False
        if saving:
            st.save_ranks.discard(rank)
            if st.save_ranks or st.phase is not _Phase.SAVING:
                return True
            # Every rank released it: free the pages (the engine's _release_transfer).
            self._release(st)
            st.phase = _Phase.DONE
            self._held.remove(st)
            return True
        st.load_ranks.discard(rank)
        if st.load_ranks or st.phase is not _Phase.PARKED:
            # A cancelled or rewound request no longer waits for its load; the id may still come back.
            return True
        self._resume(st)
        return True

    def _resume(self, st: _Req) -> None:
        """Every rank finished the async load: the request is scheduled from the next iteration."""
        st.phase = _Phase.RUNNING
        st.check_pending = True
        if self.discard_hook is not None and self.discard_hook(st.rid, st.attempt):
            # V2 may throw the loaded tokens away and recompute from the device match.
            self._rewind(st)

    def _rewind(self, st: _Req) -> None:
        """Recompute from the device match (a discarded async load, or ``recompute_failed_load``).

        A sliding group now needs pages for ordinals the load would have skipped;
        they are filled in place before the request's (first) report, which
        carries the full lists.
        """
        st.phase = _Phase.RUNNING
        st.check_pending = True
        st.discarded = True
        st.needs_first_report = True
        st.req.py_num_connector_matched_tokens = 0
        st.computed = st.prefill_start = st.device_match
        st.first_pass = None  # the honoured point's first pass no longer applies
        for gi, g in enumerate(self.groups):
            cut = sliding_cutoff(st.device_match, g.window, self.tpb, self.extra_allocated_blocks)
            lst = st.blocks[gi]
            for o in range(cut, len(lst)):
                if lst[o] < 0:
                    if st.reserved[gi] <= 0:
                        raise SimError(f"request {st.rid}: no reserved page to recompute a discarded load")
                    st.reserved[gi] -= 1
                    lst[o] = self.allocators[gi].alloc()

    # ------------------------------------------------------------------ after the forward

    def _advance(self, st: _Req, n: int, is_ctx: bool, it: int, finished: list[_Req]) -> None:
        """Non-overlap loop: sample (the host has the token at once), then finished or paused."""
        if not self._sample(st, n, is_ctx):
            return
        if st.generated >= st.spec.output_limit:
            finished.append(st)
        elif (
            not is_ctx
            and self.preempt_generation_hook is not None
            and self.preempt_generation_hook(st.rid, st.generated, st.attempt)
        ):
            self._preempt(st, generating=True)

    def _sample(self, st: _Req, n: int, is_ctx: bool) -> bool:
        """After a forward: the request computed ``n`` more tokens; sample the next one when it
        reached the end of its tokens (on the device: the overlap loop's host learns it a pass
        later). A context chunk may be preempted here (False); V2's
        update_context_resources frees its pages that left the window."""
        st.computed += n
        if is_ctx:
            st.chunks_done += 1
        tokens = st.device_tokens
        if st.computed == len(tokens):  # the whole prompt, or a generation step: sample the next token
            token = next_token(st.hasher.digest(tokens, len(tokens)), self.model.vocab_size)
            if self.overlap:
                st.pending = token
            else:
                st.tokens.append(token)
            st.generated += 1
            if st.generated == 1:
                st.t_first_token = time.perf_counter()
        elif (
            is_ctx and self.preempt_hook is not None and self.preempt_hook(st.rid, st.chunks_done, st.attempt)
        ):
            self._preempt(st)
            return False
        if is_ctx:
            self._free_left_window(st, st.computed)
        return True

    def _free_left_window(self, st: _Req, history: int) -> None:
        """Free the sliding pages that left the window at ``history`` computed tokens."""
        for gi, g in enumerate(self.groups):
            if not g.sliding:
                continue
            cut = sliding_cutoff(history, g.window, self.tpb, self.extra_retained_blocks)
            lst = st.blocks[gi]
            for o in range(min(cut, len(lst))):
                if lst[o] >= 0:
                    self._free_page(st, gi, o)

    def _free_page(self, st: _Req, gi: int, ordinal: int) -> None:
        slot = st.blocks[gi][ordinal]
        for rank, pool in enumerate(self.pools):
            self.checker.audit(st.rid, rank, gi, ordinal, slot)
            pool.junk(gi, slot)
        self.allocators[gi].free(slot)
        st.blocks[gi][ordinal] = -1

    def _release(self, st: _Req) -> None:
        """Free every page the request holds and give back what it still had reserved."""
        for gi, lst in enumerate(st.blocks):
            for o, slot in enumerate(lst):
                if slot >= 0:
                    self._free_page(st, gi, o)
            self.allocators[gi].unreserve(st.reserved[gi])
            st.reserved[gi] = 0

    def _preempt(self, st: _Req, *, generating: bool = False) -> None:
        """Drop the request; it is re-admitted from scratch (a V2 replay), with no connector call.
        Mid-prefill it replays its prompt; ``generating`` (V2 pausing it for recompute), the
        tokens so far become its prompt (``reset_for_recompute``)."""
        self._release(st)
        self._live.remove(st)
        st.phase = _Phase.WAITING
        st.attempt += 1
        st.computed = 0
        st.check_pending = False
        st.pending, st.to_complete, st.pause_pending = None, False, False
        if generating:
            st.req.prompt_len = len(st.tokens)
        else:
            del st.tokens[st.req.prompt_len :]
        self._waiting.append(st)
        self._waiting.sort(key=lambda x: x.seq)

    def _finish(self, st: _Req, it: int, finished_gen: list[int], *, tell: bool = True) -> None:
        """``_handle_responses``: ``request_finished``; True keeps the pages until every rank returns
        the id. ``tell=False``: a cancel (``silent_cancel``), freed with no connector call."""
        st.t_done, st.it_done = time.perf_counter(), it
        if not st.t_first_token:
            st.t_first_token = st.t_done
        self._done_ids.add(st.rid)
        self._live.remove(st)
        if not tell:
            self._release(st)
            st.phase = _Phase.DONE
            return
        lists = [list(b) for b in st.blocks]
        if self.flat:
            keep = self._call("request_finished", self.leader.request_finished, st.req, lists[0])
        else:
            keep = self._call(
                "request_finished_by_layer_group", self.leader.request_finished_by_layer_group, st.req, lists
            )
        if keep:
            self._hold(st, finished_gen)
        else:
            self._release(st)
            st.phase = _Phase.DONE

    def _hold(self, st: _Req, finished_gen: list[int]) -> None:
        """``request_finished`` said True: the id waits for every rank's ``get_finished``."""
        st.phase = _Phase.SAVING
        st.save_ranks = set(range(self.tp_size))
        self._held.append(st)
        finished_gen.append(st.rid)

    def _finish_released(self, st: _Req, finished_gen: list[int]) -> None:
        """``_send_kv_async`` for a finished request whose cache was already freed (V2 line:
        ``get_page_indices_by_layer_group`` has no entry; the manager passes one empty list per
        group). True parks its id for ``get_finished`` as for any save; it holds no page."""
        st.finish_after_release = False
        keep = self._call(
            "request_finished_by_layer_group",
            self.leader.request_finished_by_layer_group,
            st.req,
            [[] for _ in self.groups],
        )
        if keep:
            self._hold(st, finished_gen)

    # ------------------------------------------------------------------ reporting

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._hook_seconds[name] = self._hook_seconds.get(name, 0.0) + time.perf_counter() - t0

    def _hang(self, states: Sequence[_Req], why: str) -> SimHang:
        stuck: dict[int, str] = {}
        for st in states:
            if st.phase is _Phase.DONE:
                continue
            what = st.phase.value
            if st.phase is _Phase.PARKED:
                what += f"; ranks {sorted(st.load_ranks)} never returned it as finished loading"
            elif st.phase is _Phase.SAVING:
                what += f"; ranks {sorted(st.save_ranks)} never returned it as finished saving"
            elif st.phase is _Phase.WAITING and st.spec.after:
                pending = [d for d in st.spec.after if d not in self._done_ids]
                if pending:
                    what += f"; depends on unfinished {pending}"
            stuck[st.rid] = what
        detail = "; ".join(f"request {rid}: {w}" for rid, w in stuck.items())
        return SimHang(f"{why}. Stuck: {detail}", stuck)

    def _request_report(self, st: _Req) -> RequestReport:
        plen = st.req.prompt_len  # the last attempt's: a generating request's replay folds its tokens in
        return RequestReport(
            request_id=st.rid,
            prompt_tokens=len(st.spec.prompt),
            device_match_tokens=st.device_match,
            offered_tokens=st.offered,
            matched_tokens=0 if st.discarded else st.honoured,
            computed_tokens=plen - st.prefill_start,
            loaded_async=st.ever_async,
            discarded=st.discarded,
            replays=st.attempt,
            output_tokens=tuple(st.tokens[len(st.spec.prompt) :]),
            ttft_s=st.t_first_token - st.t_admit,
            latency_s=st.t_done - st.t_admit,
            finished_iteration=st.it_done,
            cancelled=st.cancelled,
            recomputed_failed_load=st.recomputed_failed_load,
            failed=st.failed,
        )
