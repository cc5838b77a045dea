"""What both connector sides guard at the engine boundary.

At bring-up (the constructors, ``register_kv_cache_layout``): refuse, with one clear
message, an engine configuration or cache layout s3kv cannot serve correctly
(:class:`UnsupportedEngine`). At run time: contain every exception (:class:`Contain`),
because TensorRT-LLM's executor dies on one. :class:`ConnectorSide` is the part the two
sides share: bring-up in one order, the contained-error counts, throttled metrics.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from ..config import Settings, load_settings
from ..core.errors import S3KvError
from ..engine.runtime import EngineRuntime, acquire_runtime
from ..store.base import ObjectStore
from .api import engine_features as detected_features

log = logging.getLogger("s3kv.trtllm")

#: Cumulative stats are copied into the Prometheus metrics at most this often (scheduler hot path).
_OBSERVE_EVERY_S = 1.0


class UnsupportedEngine(S3KvError, ValueError):
    """Bring-up refused: this engine configuration cannot be served correctly (the message says why)."""


def check_engine(llm_args: Any) -> None:
    """Refuse, at construction, engine settings s3kv cannot serve correctly (both executor loops
    are served; layouts are checked at registration)."""
    if getattr(llm_args, "enable_attention_dp", False):
        # Owners are not independent: under attention DP the executor's _can_queue allgathers the
        # owners' batch sizes after build_connector_meta and start_load_kv have run, and when one
        # owner's batch is empty every owner skips that pass's forward and wait_for_save, and V2
        # reverts the generation pages grown in it -- pages this pass's metadata already named.
        # The simulator does not model that veto, so s3kv's save plans are not proven under it.
        raise UnsupportedEngine(
            "s3kv does not serve attention data parallelism yet (enable_attention_dp=True): a pass the "
            "owners' batch-size allgather skips after its connector metadata is bound is not proven "
            "safe for saves; turn attention DP off for this engine (docs/failures.md)"
        )


def kv_shard(llm_args: Any, mapping: Any) -> tuple[int, int]:
    """(rank, count) of the KV shard this process's pages hold. Tensor parallelism splits the KV
    heads over the TP ranks. Attention data parallelism replicates attention: each owner rank holds
    every KV head of its own requests (its own scheduler, no collectives between owners), so all
    owners read and write one shard -- keys carry no DP rank and owners share each other's saves."""
    if getattr(llm_args, "enable_attention_dp", False):
        return 0, 1
    return int(mapping.tp_rank), int(mapping.tp_size)


def check_layout(layout: Any) -> None:
    """Refuse at registration a layout whose page API s3kv does not rely on."""
    groups = getattr(layout, "groups", None)
    if not groups or getattr(layout, "tokens_per_block", None) is None:
        raise UnsupportedEngine("s3kv: the KV cache layout has no groups or no tokens_per_block")
    for g in groups:
        if getattr(g, "replicated_regions", None):
            raise UnsupportedEngine(
                f"s3kv: layer group {getattr(g, 'layer_group_id', '?')} has replicated regions; this "
                "TensorRT-LLM's layout is one s3kv does not save or load (upgrade TensorRT-LLM or s3kv)"
            )
        for r in getattr(g, "regions", ()) or ():
            missing = [a for a in ("slot_tensor", "as_tensor", "size", "num_slots") if not hasattr(r, a)]
            if missing:
                raise UnsupportedEngine(
                    "s3kv: this TensorRT-LLM's KvCacheRegion has no " + ", ".join(missing)
                    + "; s3kv addresses pages only through them (a TensorRT-LLM whose "
                    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout has them; `s3kv --version` "
                    "says which line is installed)"
                )


class Contain:
    """Catch, log and count what a hook raised; the engine must never see it."""

    def __init__(self, role: str):
        self.role = role
        self.errors: Counter[str] = Counter()
        self._last_log: dict[str, float] = {}

    def __call__(self, hook: str, exc: BaseException) -> None:
        self.errors[hook] += 1
        now = time.monotonic()
        if now - self._last_log.get(hook, 0.0) >= 10.0:  # one traceback per hook per 10 s
            self._last_log[hook] = now
            log.error("s3kv %s: %s() failed (contained; %d so far): %r", self.role, hook,
                      self.errors[hook], exc, exc_info=exc)


class ConnectorSide:
    """What both connector sides share: bring-up in one order, contained errors, throttled metrics.

    First in each side's bases, so its ``__init__`` is the one TensorRT-LLM calls as
    ``cls(llm_args)``; the keyword arguments exist for the simulator and tests (an explicit
    store, settings, engine key or engine features), never needed in production. The side's
    own set-up follows in :meth:`_start`.
    """

    #: Names the side in contained-error logs.
    role = ""
    #: Attention DP is refused at bring-up (``check_engine`` says why); the flag newer lines check
    #: says the same.
    supports_attention_dp = False
    #: Both executor loops are served: the overlap loop (TensorRT-LLM's default) reports
    #: generation one token behind and finishes a pass late (see ``SavePlanner`` / ``FinishPlanner``).
    requires_disable_overlap_scheduler = False

    settings: Settings
    features: frozenset[str]
    _runtime: EngineRuntime
    _contain: Contain
    _llm_args: Any
    _host_weigh: Any
    _observed_at: float

    def __init__(
        self,
        llm_args: Any,
        *,
        settings: Settings | None = None,
        store: ObjectStore | None = None,
        key_prefix: str | None = None,
        engine_key: str | None = None,
        engine_features: Any = None,
        host_weigh: Any = None,
    ):
        """Refuse an engine s3kv cannot serve, read the settings and the engine's features, join
        the engine's runtime (store, index, geometry), then the side's own set-up. ``host_weigh(key,
        nbytes) -> bytes``: what the host tier charges an object (a replay's real model sizes)."""
        super().__init__(llm_args)  # type: ignore[call-arg]  # TensorRT-LLM's connector base class
        check_engine(llm_args)
        self._llm_args = llm_args
        self._host_weigh = host_weigh
        self._observed_at = 0.0
        self._contain = Contain(self.role)
        self.settings = settings if settings is not None else load_settings()
        self.features = frozenset(engine_features) if engine_features is not None else detected_features()
        mapping = llm_args.parallel_config.to_mapping()
        self._runtime = acquire_runtime(
            llm_args, self.settings, store=store, key_prefix=key_prefix, engine_key=engine_key
        )
        self._start(llm_args, mapping)

    def _start(self, llm_args: Any, mapping: Any) -> None:
        """The side's own set-up, once the runtime is joined (``mapping``: the engine's parallel mapping)."""
        raise NotImplementedError

    @property
    def errors(self) -> Counter[str]:
        """Exceptions contained per hook (each one would have killed the engine)."""
        return self._contain.errors

    def _observe_due(self) -> bool:
        """True at most once per ``_OBSERVE_EVERY_S``: time to copy stats into the metrics."""
        now = time.monotonic()
        if now - self._observed_at >= _OBSERVE_EVERY_S:
            self._observed_at = now
            return True
        return False
