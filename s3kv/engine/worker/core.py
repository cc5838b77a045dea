"""The worker side of s3kv: executes each iteration's plan on one rank.

``WorkerCore`` is engine-agnostic: the TensorRT-LLM adapter (``s3kv.trtllm``) and
the simulator call it with the connector's per-iteration order::

    bind(metadata) -> start_load_kv(stream) -> [wait_for_layer_load(i) ... save_kv_layer(i)]*
                   -> wait_for_save(stream) -> get_finished(finished_gen, started_loading)

This facade holds the lock and the per-iteration state and runs each hook in that order; the
work lives in the module named for it: ``rank`` (what ``register_layout`` fixes: geometry,
keys, regions), ``saves`` (object buffers in host staging, stage copies, seals, finish plans),
``loads`` (verified downloads, and the failure rungs of a promised load that cannot
complete) and ``stats`` (the counters). Nothing here ever raises into the engine from a save
or a load: a save is dropped and counted, a failed load takes the least harmful outcome the
engine allows (docs/failures.md).

Finishing requests: ``metadata.finish_plans`` keep, per request, what to save if it finishes
after the current pass. When its id reaches ``get_finished`` (same iteration as
``request_finished``, possibly on an engine about to go idle) the plan's pages are copied off the
device, its objects sealed and uploaded in the background, and the id is returned once those
copies completed.

``get_finished`` hand-over state machine (per id, per hand-over): an id is returned only after it
was passed in, exactly once; a saving id as soon as every stage copy of that request issued so far
has completed (at once when nothing is pending; at once on CPU), a loading id once all its pages
are in place.

Why this is one module: it is the facade -- the lock, the per-iteration state and the order of
the hooks, which every part (loads, saves, the host tier, the stats) shares; the work itself
lives in the modules named above.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ...config import Settings, warn_once
from ...core.keys import KeyScheme
from ...core.layout import CacheGeometry
from ...core.objects import ObjectIdentity
from ...core.plan import ConnectorMetadata
from ...core.policy import staging_warnings
from ...store.base import ObjectStore
from ...store.refresh import set_refresh_interval
from ...transfer.copies import Copier
from ...transfer.counters import Counters
from ...transfer.download import Downloader, LoadJob
from ...transfer.hosttier import HostTier, Weigher
from ...transfer.staging import StagingPool
from ...transfer.tiers import TierSpeed, open_host_tier
from ...transfer.upload import Uploader
from ..index import AllShards, KeyIndex
from ..verdicts import ToLeader
from .exit import install_exit_drain
from .loads import Failures, LoadJobs, LoadTimeout, plan_jobs
from .rank import RankLayout
from .saves import SaveJobs
from .stats import WorkerStats, worker_stats

log = logging.getLogger("s3kv.worker")


class WorkerCore:
    """One rank's connector worker. Thread-safe; holds no global state."""

    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        key_prefix: str = "",
        rank: int = 0,
        tp_size: int = 1,
        model_id: str = "",
        kv_dtype: str = "",
        index: KeyIndex | None = None,
        *,
        load_reserve_fraction: float = 0.25,
        failed_load_hook: bool = False,
        host_weigh: Weigher | None = None,
        auto_host_cache: bool = False,
    ):
        """``rank`` is the tensor-parallel rank.
        ``failed_load_hook``: the engine polls ``take_failed_load_request_ids`` and recomputes
        the requests it names (rung 1); without it a failed parked load stays parked and retries.
        ``host_weigh(key, nbytes) -> bytes``: what the host tier charges an object (default: its
        bytes). ``auto_host_cache``: ``host_cache_gb = -1`` sizes the tier from the machine (the
        TensorRT-LLM adapter); otherwise -1 means no tier (tests and tools that build a core)."""
        if not 0 <= rank < tp_size:
            raise ValueError(f"tp rank {rank} outside [0, {tp_size})")
        self.settings = settings
        self.store = store
        self.prefix = key_prefix.rstrip("/")
        self.tp_rank = int(rank)
        self.tp_size = int(tp_size)
        self.model_id = model_id
        self.kv_dtype = str(kv_dtype)
        self.index = index
        self.failed_load_hook = failed_load_hook
        self._load_reserve_fraction = load_reserve_fraction
        self._host_weigh = host_weigh
        self._auto_host_cache = auto_host_cache
        #: The host tier (set by register_layout when one is configured) and each tier's load speed.
        self.host_tier: HostTier | None = None
        self.speeds = {"host": TierSpeed(), "s3": TierSpeed()}
        self._counters = Counters()
        self._lock = threading.RLock()
        self._uploader = Uploader(
            store,
            threads=settings.upload_threads,
            index=AllShards(index) if index is not None and tp_size > 1 else index,
            counters=self._counters,
            wait_event=Copier.synchronize,
            name=f"s3kv-up-r{rank}",
        )
        self._uploader.multipart_threshold = settings.multipart_threshold_mib << 20
        self._uploader.part_size = settings.multipart_part_mib << 20
        # Past rank 0 the index is this process's own: what a load finds bad goes to the leader too.
        self._verdicts = (
            ToLeader(index, self.tp_rank, functools.partial(self._counters.add, "verdicts_unshared"))
            if index is not None and self.tp_rank > 0 else None
        )
        self._loads = LoadJobs(settings, self._verdicts or index, self._counters, failed_load_hook=failed_load_hook)
        self._saves = SaveJobs(settings, self._counters, self._uploader)
        # Load state tests and tools look at (the same objects the load jobs change in place).
        # Set by register_layout.
        self._rank: RankLayout | None = None
        self._copier: Copier | None = None
        self._pool: StagingPool | None = None
        self._downloader: Downloader | None = None
        # Per iteration.
        self._metadata: ConnectorMetadata | None = None
        self._loads_started = False
        self._saves_done = False
        self._failed_now: set[int] = set()  # requests whose sync load failed this iteration
        self._closed = False

    # -- set-up -----------------------------------------------------------
    def register_layout(self, layout: Any) -> CacheGeometry:
        with self._lock:
            if self._rank is not None:
                raise RuntimeError("register_layout called twice")
            rank = RankLayout.from_layout(
                layout, self.settings, prefix=self.prefix, tp_rank=self.tp_rank, tp_size=self.tp_size,
                model_id=self.model_id, kv_dtype=self.kv_dtype,
            )
            geometry, device = rank.geometry, rank.device
            copier = Copier(device, batch=self.settings.batch_copies)
            pool = StagingPool.for_device(
                self.settings.staging_bytes,
                device,
                pinned=self.settings.pinned,
                load_reserve_fraction=self._load_reserve_fraction,
            )
            tier = self._make_tier(device, self.settings.pinned and device.type == "cuda")
            promised = getattr(self.store, "promised_reads", None)  # loads of hits already promised
            downloader = Downloader(
                promised() if promised is not None else self.store,
                pool,
                copier,
                threads=self.settings.download_threads,
                counters=self._counters,
                name=f"s3kv-down-r{self.tp_rank}",
                tier=tier,
                verify_host=self.settings.host_cache_verify,
                speeds=self.speeds,
            )
            self._copier, self._pool, self._downloader = copier, pool, downloader
            self._loads.attach(rank, copier, downloader, tier)
            self._saves.attach(rank, copier, pool, tier)
            self._uploader.tier = tier
            self._rank = rank
            for text in staging_warnings(geometry, self.settings, pool.capacity):
                warn_once(f"s3kv: {text}")  # every rank and engine of a process says the same
            log.info(
                "s3kv worker rank %d/%d: %d layer group(s), namespace %s, staging %d MiB (%s) on %s",
                self.tp_rank,
                self.tp_size,
                geometry.num_groups,
                rank.namespace.hex(),
                pool.capacity >> 20,
                "pinned" if pool.pinned else "pageable",
                device,
            )
            return geometry

    def _make_tier(self, device: Any, pinned: bool) -> HostTier | None:
        """This rank's host tier, as ``S3KV_HOST_CACHE_GB`` asks (none when 0, or auto off here);
        an evicted ``evict`` object the store then holds goes into the key index (every shard)."""
        gb = self.settings.host_cache_gb
        index = AllShards(self.index) if self.index is not None and self.tp_size > 1 else self.index
        self.host_tier = open_host_tier(
            self.store, 0 if gb < 0 and not self._auto_host_cache else gb, device, pinned=pinned,
            weigh=self._host_weigh, counters=self._counters, on_written=index.put_written if index is not None else None,
            speed=self.speeds["host"], name=f"s3kv-host-r{self.tp_rank}",
        )
        return self.host_tier

    def _layout(self) -> RankLayout:
        if self._rank is None:
            raise RuntimeError("no KV cache layout registered yet")
        return self._rank

    @property
    def geometry(self) -> CacheGeometry:
        return self._layout().geometry

    @property
    def keys(self) -> KeyScheme:
        return self._layout().keys

    @property
    def staging(self) -> StagingPool:
        if self._pool is None:
            raise RuntimeError("no KV cache layout registered yet")
        return self._pool

    def identity(self, group: int) -> ObjectIdentity:
        if self._rank is None:
            raise KeyError(group)
        return self._rank.identity[group]

    def object_key(self, group: int, last_digest: bytes) -> str:
        """This rank's key of the object of ``group`` ending at ``last_digest``."""
        return self._layout().object_key(group, last_digest)

    # -- per iteration ----------------------------------------------------
    def bind(self, metadata: ConnectorMetadata | None) -> None:
        with self._lock:
            self._metadata = metadata
            self._loads_started = False
            self._saves_done = False
            self._failed_now = set()
            if metadata is None:
                return
            if self._verdicts is not None:
                self._verdicts.attach(metadata.verdicts)
            if metadata.refresh_s > 0:
                set_refresh_interval(self.store, metadata.refresh_s)
            for rid in metadata.abandoned_ids:  # before start_load_kv and the forward
                try:
                    self._loads.abandon(rid)
                except Exception:  # noqa: BLE001 - the saves below must still be bound
                    log.exception("s3kv: stopping the load of request %s failed", rid)
            self._saves.bind(metadata)

    def start_load_kv(self, stream: Any = None) -> None:
        """Start every load of the bound plan; sync ones are downloaded and verified before return.
        Never raises: a load that cannot be completed with verified bytes takes the failure rung
        this engine allows (see :meth:`_load_failed_now`)."""
        with self._lock:
            md = self._metadata
            if md is None or self._loads_started:
                return
            self._loads_started = True
            self._reap()
            now = time.monotonic()
            sync = self._loads.start(md, stream, now)
        if sync is None:
            return
        sync_jobs, sync_errors = sync
        self._loads.wait_jobs(sync_jobs, now + self._loads.timeout)
        with self._lock:
            failed = self._loads.sync_results(sync_jobs, sync_errors)
            if failed:
                self._load_failed_now(failed, plan_jobs(sync_jobs, failed))

    def _load_failed_now(self, failed: Failures, plan: Sequence[LoadJob] = ()) -> None:
        """Sync loads that failed: no copy may still land, nothing of theirs is saved, and the
        engine's failed-load hook (the only safe outcome for a sync load) is told."""
        # The engine may still run this iteration's forward for the other requests; the
        # failed ones' pages hold no verified KV, so nothing of theirs may be saved from
        # them (it would poison the shared cache).
        self._failed_now |= set(failed)
        self._loads.fail_now(failed, plan)

    def fail_bound_loads(self, reason: str) -> None:
        """The adapter's fallback when ``start_load_kv`` raised: every load of the bound plan
        takes the failure rung (its state is unknown, so none of it may be trusted)."""
        with self._lock:
            md = self._metadata
            if md is None:
                return
            sync = self._loads.fail_bound(md, reason, time.monotonic())
            if sync:
                self._load_failed_now(sync)

    def install_exit_drain(self, timeout_s: float) -> None:
        """Drain queued uploads (at most ``timeout_s``) when the process exits normally
        (``exit.install_exit_drain``: TensorRT-LLM calls no connector ``shutdown()``)."""
        install_exit_drain(self, timeout_s)

    def take_failed_load_request_ids(self) -> set[int]:
        """Rung 1 (engines that offer it): requests whose promised load failed, to be recomputed."""
        with self._lock:
            return self._loads.take_failed()

    def try_abort_request(self, request_id: int) -> bool:
        """The engine's failed-load path: every rank releases the request before any rank frees its
        pages. Returns once no copy of its load can still land (pending downloads dropped, copies
        in flight waited for), no stage copy can still read its pages, and its save state is
        dropped: always ``True`` -- the manager treats anything else as fatal. A step that raises
        leaves only after every copy this rank issued completed (the adapter answers True)."""
        rid = int(request_id)
        with self._lock:
            try:
                self._loads.abort(rid)
                self._saves.abort(rid)
            except Exception:
                self._loads.fence(rid, list(self._saves.copy_events.values()))  # stopped part-way
                raise
            return True

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        """Make the forward stream wait for the copies into the layer's group (no host wait)."""
        with self._lock:
            self._loads.wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        """No-op: a page spans every layer of its group, so it is copied once in wait_for_save."""

    def wait_for_save(self, stream: Any = None) -> None:
        """Copy the iteration's staged pages to host (stream-ordered) and hand seals to the uploader."""
        with self._lock:
            self._saves.last_stream = stream
            self._loads.order_remaining(stream)
            self._reap()
            md = self._metadata
            if md is None or self._saves_done:
                return
            self._saves_done = True
            self._saves.run(md, stream, self._failed_now)

    def get_finished(
        self, finished_gen_req_ids: Iterable[int], started_loading_req_ids: Iterable[int]
    ) -> tuple[list[int], list[int]]:
        """(finished saving, finished loading) ids; see the module doc for the rules. Never raises.
        A finishing id runs its standing finish plan here (pages copied off the device, objects
        sealed) and is returned once those copies completed. A parked request whose load failed
        takes the engine's failed-load hook (rung 1) or stays parked while it is retried (rung 3)."""
        with self._lock:
            self._reap()
            now = time.monotonic()
            for rid in finished_gen_req_ids:
                rid = int(rid)
                self._finish_request(rid)
                self._saves.hand(rid)
            self._loads.hand(started_loading_req_ids, now)
            self._loads.settle(now)
            return self._saves.finished(), self._loads.finished()

    def _finish_request(self, rid: int) -> None:
        """The request ended: stop its load if still parked, run its finish plan, drop the rest."""
        self._loads.cancel_parked(rid)
        self._saves.finish(rid, self._failed_now)

    def _reap(self) -> None:
        """Free the staging of placed loads whose copies completed; forget completed copy events."""
        self._loads.reap()
        self._saves.reap()

    # -- introspection ----------------------------------------------------
    @property
    def _retry_base_s(self) -> float:
        """First delay of a parked load's retries (rung 3); tests shorten it."""
        return self._loads.retry_base_s

    @_retry_base_s.setter
    def _retry_base_s(self, seconds: float) -> None:
        self._loads.retry_base_s = seconds

    # -- lifecycle --------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every upload queued so far has finished (True) or ``timeout`` passed (False)."""
        return self._uploader.flush(timeout)

    def close(self, timeout: float | None = 30.0, cancel: bool = False) -> bool:
        """Drain (or cancel) uploads, stop the threads, free staging. True if drained in time."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        drained = self._uploader.close(timeout, cancel=cancel)
        with self._lock:
            if self._downloader is not None:
                self._downloader.close()
            if self._verdicts is not None:
                self._verdicts.close()
            self._saves.close()
            self._reap()
            if self._copier is not None:
                self._copier.drain()
            if self._pool is not None:
                self._pool.close()
        if self.host_tier is not None:
            self.host_tier.close(timeout)
        return drained

    def __enter__(self) -> WorkerCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> WorkerStats:
        return worker_stats(
            self._counters.snapshot(),
            self._pool.stats() if self._pool is not None else None,
            uploads_pending=self._uploader.pending,
            parked_now=self._loads.parked_now(),
            host=self.host_tier.stats() if self.host_tier is not None else None,
        )


__all__ = ["LoadTimeout", "WorkerCore", "WorkerStats"]
