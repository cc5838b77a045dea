"""The scheduler side of the TensorRT-LLM adapter: engine requests in, ``LeaderCore`` calls out.

Every hook translates the engine's objects into plain values for
:class:`s3kv.engine.leader.LeaderCore` and contains whatever it raises (a lookup
error is a miss, a failed load plan a broken promise): see ``s3kv.trtllm``.
"""

from __future__ import annotations

from typing import Any

from ..config import Settings, redact, warn_once
from ..engine.leader import LeaderCore
from ..engine.runtime import release_runtime
from .api import FAILED_LOAD_HOOK, KvCacheConnectorScheduler
from .boundary import ConnectorSide, kv_shard
from .identity import model_identity, weak_identity_warning
from .lora import PENDING, AdapterIdentities

__all__ = ["S3KvConnectorLeader"]


#: Stores that other hosts' writers may reach (object stores). Not file:// (local disk: its
#: permissions decide), memory:// (one process), nor a store handed in without a URL (the
#: simulator's and the benchmarks' own).
_SHARED_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss")


def warn_if_unsigned(settings: Settings) -> None:
    """Say, once, that a shared store without an integrity key trusts every writer of the bucket."""
    scheme = settings.url.split("://", 1)[0].lower() if "://" in settings.url else ""
    if settings.integrity is not None or scheme not in _SHARED_SCHEMES:
        return
    warn_once(
        f"s3kv: integrity tags are off for the shared store {redact(settings.url)}: this engine serves "
        "any object that anyone allowed to write there (s3:PutObject) plants, with checksums anyone can "
        "recompute -- wrong KV, steered answers. Turn it on: S3KV_INTEGRITY_KEY_FILE=<a file holding one "
        "secret, e.g. `openssl rand -hex 32`, the same on every engine of the fleet> (docs/security.md)"
    )


def first_chunk(request: Any) -> int | None:
    """The request's first context chunk, where the engine sized it before asking the connector
    (KVCacheManagerV2's scheduler sets ``context_chunk_size`` before its connector hooks run);
    None where it carries none, or its getter refuses (the C++ binding checks the request's state)."""
    try:
        n = request.context_chunk_size
    except Exception:  # noqa: BLE001 - no chunk known is no guard, never a lost lookup
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class S3KvConnectorLeader(ConnectorSide, KvCacheConnectorScheduler):
    """Scheduler side (rank 0): lookups, load plans, save plans."""

    role = "leader"

    def _start(self, llm_args: Any, mapping: Any) -> None:
        if self.settings.load_mode == "sync":
            # A sync load that fails has no safe outcome: the forward would run on unverified
            # pages. The manager's failed-load path covers async loads only (it drops failed ids
            # of requests it does not track as async loads), and no line has another.
            warn_once(
                "s3kv: S3KV_LOAD_MODE=sync needs an engine that can fail a request whose sync load "
                "failed; no TensorRT-LLM line can (its failed-load path, where it exists, covers "
                "async loads only), so loads are async (see docs/failures.md)"
            )
        kv = getattr(llm_args, "kv_cache_config", None)
        if getattr(kv, "enable_partial_reuse", False):
            warn_once(
                "s3kv: partial block reuse is on: a device match that ends inside a block gets no S3 "
                "hit (counted as partial_block_misses); set kv_cache_config.enable_partial_reuse=False "
                "for full S3 hits"
            )
        warn_if_unsigned(self.settings)
        identity = model_identity(llm_args, self.settings.model_id, self.settings.identity_cache_dir)
        weak = weak_identity_warning(identity)
        if weak:
            warn_once(weak)
        #: Why no request is served or saved ("" unless the model's identity is weak).
        self.unshared = "model identity is weak (S3KV_MODEL_ID unset)" if weak else ""
        self.adapters = AdapterIdentities(llm_args, self.settings.lora_settle_s)
        # The fleet index's first fetch and the namespace summary's first LIST should not race the
        # first lookups: start their refreshers (background threads) once the worker has
        # registered the layout.
        self._runtime.on_geometry(self._start_summary)
        self.core = LeaderCore(
            self.settings,
            self._runtime.store,
            self._runtime.key_prefix,
            tp_size=kv_shard(llm_args, mapping)[1],
            model_id=identity.model_id,
            kv_dtype=identity.kv_dtype,
            index=self._runtime.index,
            geometry=self._runtime.get_geometry,
            failed_load_hook=False,  # sync loads: see above
            recompute_hook=FAILED_LOAD_HOOK in self.features,  # async loads: host-only objects at TP > 1
            # TensorRT-LLM's default loop is the overlap one; only an explicit True turns it off.
            overlap=getattr(llm_args, "disable_overlap_scheduler", False) is not True,
            tiers=self._runtime,  # rank 0's host tier and load speeds appear there at registration
            model_ref=getattr(llm_args, "model", None),  # its config.json: the prefill FLOPs
        )

    def _start_summary(self) -> None:
        try:
            fleet = self.core.fleet_index()
            if fleet is not None:
                fleet.start()  # its first fetch now, before the first request
            summary = self.core.lookup_summary()
            if summary is not None:
                summary.start()
        except Exception as e:  # noqa: BLE001 - an optional accelerator; lookups probe without it
            self._contain("lookup_summary", e)

    # -- allocation --------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            mm = getattr(request, "multimodal_hashes", None)
            has_mm = bool(mm) or bool(getattr(request, "multimodal_positions", None))
            salt = getattr(request, "cache_salt", None)
            if salt is None:
                salt = getattr(request, "cache_salt_id", None)
            tokens = list(request.get_tokens(0))
            prompt_len = int(getattr(request, "prompt_len", len(tokens)))
            lora, unidentified = (None, "") if self.unshared else self.adapters.resolve(request)
            if unidentified and unidentified != PENDING:  # pending clears by itself: not counted
                self.core.stats.lora_unidentified += 1
            n, is_async = self.core.get_num_new_matched_tokens(
                int(request.request_id),
                tokens,
                prompt_len,
                int(num_computed_tokens),
                cache_salt=salt,
                lora=lora,
                multimodal_hashes=mm,
                has_multimodal=has_mm,
                not_cacheable=self.unshared or unidentified,
                owned=True,  # our own list() above
                first_chunk_tokens=first_chunk(request),
            )
        except Exception as e:  # noqa: BLE001 - a lookup must never fail a request
            self._contain("get_num_new_matched_tokens", e)
            return 0, False
        # (0, True) makes the engine raise: never answer async without tokens.
        return (int(n), bool(is_async)) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.update_state_after_alloc_by_layer_group(request, [list(block_ids)])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: Any) -> None:
        try:
            honoured = getattr(request, "py_num_connector_matched_tokens", None)
            self.core.update_state_after_alloc(
                int(request.request_id), block_ids_by_layer_group, None if honoured is None else int(honoured)
            )
        except Exception as e:  # noqa: BLE001
            self._contain("update_state_after_alloc", e)
            self.core.break_promise(int(request.request_id), f"planning its load failed: {e!r}")

    # -- per iteration -----------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        new = list(getattr(scheduler_output, "new_requests", None) or [])
        cached = list(getattr(scheduler_output, "cached_requests", None) or [])
        try:
            meta = self.core.build_connector_meta(new, cached)
        except Exception as e:  # noqa: BLE001
            self._contain("build_connector_meta", e)
            meta = self.core.fail_safe_meta()
        if self._observe_due():
            try:
                self._runtime.observe(leader_stats=self.core.stats)
            except Exception as e:  # noqa: BLE001
                self._contain("observe", e)
        return meta

    # -- optional engine hooks (some TensorRT-LLM lines call them; feature-detected by the engine) --
    def cancel_load(self, request: Any, start: int, end: int) -> None:
        try:
            self.core.cancel_load(int(request.request_id), int(start), int(end))
        except Exception as e:  # noqa: BLE001
            self._contain("cancel_load", e)

    def request_reset(self, request: Any) -> None:
        try:
            self.core.request_reset(int(request.request_id))
        except Exception as e:  # noqa: BLE001
            self._contain("request_reset", e)

    # -- the failed-load path (lines that have it; docs/failures.md, rung 1) --
    def try_abort_request(self, request_id: int, reason: str) -> bool:
        """Every worker has released the request (its load can no longer land): forget it. The
        manager then ends it (failed, or recomputed and reported anew: not saved, as any request
        reported without a lookup). ``True``: nothing of ours is left to clean."""
        try:
            self.core.request_reset(int(request_id), aborted=str(reason) or "aborted")
        except Exception as e:  # noqa: BLE001 - the state is dropped either way; never retry for ever
            self._contain("try_abort_request", e)
        return True

    def finalize_successful_load(self, request_id: int) -> bool:
        """Every worker finished the request's load. The leader holds nothing per load past the
        metadata that carried it (no lease, no reservation): nothing to clean."""
        return True

    # The same path under its earlier names (``abort_request`` / ``finish_load``).
    abort_request = try_abort_request
    finish_load = finalize_successful_load

    # -- end of a request --------------------------------------------------
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.request_finished_by_layer_group(request, [list(cache_block_ids)])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: Any) -> bool:
        try:
            return self.core.request_finished(int(request.request_id), cache_block_ids_by_layer_group)
        except Exception as e:  # noqa: BLE001
            self._contain("request_finished", e)
            # Hold the pages: the workers return the id at once when they have nothing for it,
            # and holding costs one iteration while freeing under an in-flight copy costs KV.
            return True

    def shutdown(self) -> None:
        try:
            self._runtime.observe(leader_stats=self.core.stats)
            self.core.close_lookup()
        except Exception as e:  # noqa: BLE001
            self._contain("shutdown", e)
        finally:
            release_runtime(self._runtime)
