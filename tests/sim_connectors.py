"""Test-only connectors that prove the simulator: one correct oracle and deliberately broken variants.

The oracle keeps pages in a process-local dict keyed by the simulator's own
prefix digest + layer group + shard, and honours the whole V2 contract (per
group page lists and deltas, sliding windows, honoured < offered, replays,
chunked prefill, generation blocks, sync and async loads, TP). With it the
checker must report 0 mismatches; each broken variant must be caught.

All are built as ``cls(llm_args, store=OracleStore(), mode="sync"|"async", ...)``
through the engine's ``connector_kwargs``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from s3kv.sim import PrefixHasher, adapter_weights, request_root, sliding_cutoff, token_bytes
from s3kv.trtllm.api import KvCacheConnectorScheduler, KvCacheConnectorWorker, valid_page_slots


def _lora(request: Any) -> bytes | None:
    """The oracle keys a LoRA request by its adapter's weights (the simulator's own digest)."""
    return adapter_weights(request.py_lora_path) if request.lora_task_id is not None else None


class OracleStore:
    """The shared "bucket": page bytes by (prefix digest, group, shard); and rank 0's layout for the leader.

    The API gives the scheduler no layout; leader and rank-0 worker share a
    process in TRT-LLM, so the worker hands the layout over here.
    """

    def __init__(self) -> None:
        self.pages: dict[tuple[bytes, int, int], torch.Tensor] = {}
        self.layout: Any = None
        self.saves = 0
        self.loads = 0


@dataclass
class OracleMeta:
    # (request_id, group, slot, digest)
    loads: list[tuple[int, int, int, bytes]] = field(default_factory=list)
    # (group, slot, digest)
    saves: list[tuple[int, int, bytes]] = field(default_factory=list)
    async_load_ids: list[int] = field(default_factory=list)


@dataclass
class _LeaderReq:
    hasher: PrefixHasher
    cacheable: bool
    device_match: int = 0
    honoured: int = 0
    is_async: bool = False
    first_report_seen: bool = False
    tokens: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)


class OracleLeader(KvCacheConnectorScheduler):
    def __init__(
        self, llm_args: Any, *, store: OracleStore, mode: str = "sync", hold_on_finish: bool = False, **_: Any
    ):
        super().__init__(llm_args)
        self.store = store
        self.mode = mode
        self.hold_on_finish = hold_on_finish
        self.tpb = llm_args.kv_cache_config.tokens_per_block
        self.tp = llm_args.parallel_config.to_mapping().tp_size
        self._reqs: dict[int, _LeaderReq] = {}
        self._pending: OracleMeta = OracleMeta()
        self.offers: list[tuple[int, int]] = []  # (request_id, offer) for tests

    # -- keys (overridden by broken variants) --------------------------------------------------

    def _root(self, request: Any) -> bytes:
        mm_pos = getattr(request, "multimodal_positions", None)
        nonce = request.request_id if mm_pos and not request.multimodal_hashes else None
        return request_root(
            cache_salt=request.cache_salt,
            lora_weights=_lora(request),
            multimodal_hashes=request.multimodal_hashes,
            unhashed_multimodal_nonce=nonce,
        )

    def _digest(self, st: _LeaderReq, tokens: list[int], ordinal: int) -> bytes:
        return st.hasher.digest(tokens, (ordinal + 1) * self.tpb)

    # -- helpers -----------------------------------------------------------------------------------

    def _windows(self) -> dict[int, int | None]:
        if self.store.layout is None:
            raise RuntimeError("no layout registered before the first request")
        return {g.layer_group_id: g.window_size for g in self.store.layout.groups}

    def _have(self, digest: bytes, gid: int) -> bool:
        return all((digest, gid, s) in self.store.pages for s in range(self.tp))

    # -- scheduler API -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        d = num_computed_tokens
        mm_pos = getattr(request, "multimodal_positions", None)
        st = _LeaderReq(
            hasher=PrefixHasher(self._root(request), self.tpb),
            cacheable=not (mm_pos and not request.multimodal_hashes),
            device_match=d,
        )
        self._reqs[request.request_id] = st
        tokens = request.get_tokens(0)
        if not st.cacheable or d % self.tpb:
            return 0, False
        windows = self._windows()
        best = 0
        h = (request.prompt_len - 1) // self.tpb * self.tpb
        while h > d:
            ok = True
            for gid, w in windows.items():
                lo = max(d // self.tpb, sliding_cutoff(h, w, self.tpb))
                for o in range(lo, h // self.tpb):
                    if not self._have(self._digest(st, tokens, o), gid):
                        ok = False
                        break
                if not ok:
                    break
            if ok:
                best = h - d
                break
            h -= self.tpb
        self.offers.append((request.request_id, best))
        st.is_async = best > 0 and self.mode == "async"
        return best, st.is_async

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]]
    ) -> None:
        st = self._reqs[request.request_id]  # a replay starts from the state get_num_new_matched_tokens made
        st.honoured = request.py_num_connector_matched_tokens
        tokens = request.get_tokens(0)
        lo, hi = st.device_match // self.tpb, (st.device_match + st.honoured) // self.tpb
        planned = False
        for gid, lst in enumerate(block_ids_by_layer_group):
            for o, slot in valid_page_slots(lst):
                if lo <= o < hi:
                    digest = self._digest(st, tokens, o)
                    if not self._have(digest, gid):
                        # A real page the plan cannot fill is a bug to fail loudly on, never garbage.
                        raise RuntimeError(
                            f"request {request.request_id}: group {gid} ordinal {o} not stored"
                        )
                    self._pending.loads.append((request.request_id, gid, slot, digest))
                    planned = True
        if st.is_async:  # parked even if V2 honoured less (or nothing): report it loaded
            self._pending.async_load_ids.append(request.request_id)
        elif planned and self.mode == "async":
            raise RuntimeError("sync loads planned for an async connector")

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.update_state_after_alloc_by_layer_group(request, [block_ids])

    def build_connector_meta(self, scheduler_output: Any) -> OracleMeta:
        meta, self._pending = self._pending, OracleMeta()
        for rd, first in [(r, True) for r in scheduler_output.new_requests] + [
            (r, False) for r in scheduler_output.cached_requests
        ]:
            st = self._reqs[rd.request_id]
            deltas = rd.new_block_ids_by_layer_group or [rd.new_block_ids]
            if first:
                st.tokens = list(rd.new_tokens)
                st.blocks = [list(d) for d in deltas]
                # A sync first report excludes the load; an async resume already counts it.
                start = rd.computed_position + (0 if st.is_async else st.honoured)
                st.first_report_seen = True
            else:
                st.tokens.extend(rd.new_tokens)
                for gid, d in enumerate(deltas):
                    st.blocks[gid].extend(d)
                start = rd.computed_position
            if not st.cacheable:
                continue
            for o in range(start // self.tpb, (start + rd.num_scheduled_tokens) // self.tpb):
                digest = self._digest(st, st.tokens, o)
                for gid, lst in enumerate(st.blocks):
                    if o < len(lst) and lst[o] >= 0:
                        meta.saves.append((gid, lst[o], digest))
        return meta

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: list[list[int]]
    ) -> bool:
        self._reqs.pop(request.request_id, None)
        return self.hold_on_finish

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.request_finished_by_layer_group(request, [cache_block_ids])


class OracleWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: Any, *, store: OracleStore, async_delay: int = 0, **_: Any):
        super().__init__(llm_args)
        self.store = store
        self.rank = llm_args.parallel_config.to_mapping().tp_rank
        self.async_delay = async_delay
        self.layout: Any = None
        self._loaded: set[int] = set()  # async ids whose bytes are in place
        self._load_wait: dict[int, int] = {}  # handed-over async id -> get_finished calls to wait
        self._save_wait: dict[int, int] = {}

    # -- page access (the flat variant overrides) -------------------------------------------------

    def register_kv_cache_layout(self, layout: Any) -> None:
        self.layout = layout
        if self.rank == 0:
            self.store.layout = layout

    def _read_page(self, gid: int, slot: int) -> torch.Tensor:
        return torch.cat([r.slot_tensor(slot) for r in self.layout.group(gid).regions]).cpu()

    def _write_page(self, gid: int, slot: int, data: torch.Tensor) -> None:
        off = 0
        for r in self.layout.group(gid).regions:
            r.slot_tensor(slot).copy_(data[off : off + r.size])
            off += r.size

    # -- worker API -------------------------------------------------------------------------------

    def _load_key(self, gid: int, digest: bytes) -> tuple[bytes, int, int]:
        return (digest, gid, self.rank)

    def _load_slot(self, gid: int, slot: int) -> int:
        return slot

    def _do_load(self, rid: int, gid: int, slot: int, digest: bytes) -> None:
        data = self.store.pages[self._load_key(gid, digest)]
        self._write_page(gid, self._load_slot(gid, slot), data)
        self.store.loads += 1

    def start_load_kv(self, stream: Any) -> None:
        meta: OracleMeta = self._metadata
        for rid, gid, slot, digest in meta.loads:
            self._do_load(rid, gid, slot, digest)
        self._loaded.update(meta.async_load_ids)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        pass

    def _do_saves(self, saves: list[tuple[int, int, bytes]]) -> None:
        for gid, slot, digest in saves:
            key = (digest, gid, self.rank)
            if key not in self.store.pages:  # write once
                self.store.pages[key] = self._read_page(gid, slot).clone()
                self.store.saves += 1

    def wait_for_save(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()
        self._do_saves(self._metadata.saves)

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
        for rid in started_loading_req_ids:
            self._load_wait[rid] = self.async_delay
        for rid in finished_gen_req_ids:
            self._save_wait[rid] = self.async_delay
        return self._due(self._save_wait, lambda rid: True), self._due(
            self._load_wait, self._loaded.__contains__
        )

    @staticmethod
    def _due(waits: dict[int, int], ready: Any) -> list[int]:
        out = []
        for rid in list(waits):
            if waits[rid] > 0:
                waits[rid] -= 1
            elif ready(rid):
                out.append(rid)
                del waits[rid]
        return out


class FlatOracleWorker(OracleWorker):
    """Takes the V1 pool tensor ``[num_blocks, num_layers, 2, block_bytes]`` (no layout method)."""

    register_kv_cache_layout = None  # type: ignore[assignment]

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.pool = kv_cache_tensor

    def _read_page(self, gid: int, slot: int) -> torch.Tensor:
        assert gid == 0
        return self.pool[slot].reshape(-1).cpu()

    def _write_page(self, gid: int, slot: int, data: torch.Tensor) -> None:
        self.pool[slot].copy_(data.view(self.pool[slot].shape))


class FlatOracleLeader(OracleLeader):
    """Only the flat callbacks: the engine must call them (and not the grouped ones) in flat mode."""

    def __init__(self, llm_args: Any, **kw: Any):
        super().__init__(llm_args, **kw)
        self.flat_calls = 0

    def _windows(self) -> dict[int, int | None]:
        return {0: None}

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.flat_calls += 1
        OracleLeader.update_state_after_alloc_by_layer_group(self, request, [block_ids])

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        self.flat_calls += 1
        return OracleLeader.request_finished_by_layer_group(self, request, [cache_block_ids])

    def __getattribute__(self, name: str) -> Any:
        if name in ("update_state_after_alloc_by_layer_group", "request_finished_by_layer_group"):
            raise AttributeError(name)
        return super().__getattribute__(name)


# ---------------------------------------------------------------------------------------- broken


class WrongPrefixLeader(OracleLeader):
    """Keys a block by its own tokens only (the upstream example's flaw)."""

    def _digest(self, st: _LeaderReq, tokens: list[int], ordinal: int) -> bytes:
        blk = tokens[ordinal * self.tpb : (ordinal + 1) * self.tpb]
        return hashlib.blake2b(token_bytes(blk), digest_size=16).digest()


class SaltBlindLeader(OracleLeader):
    """Leaves the cache salt out of the chain's root: serves one tenant's pages to another."""

    def _root(self, request: Any) -> bytes:
        return request_root(lora_weights=_lora(request), multimodal_hashes=request.multimodal_hashes)


class WindowExactLeader(OracleLeader):
    """Fills a sliding group only from the configured window's start, ignoring real pages below it.

    Caught when the engine retains more than the window (``extra_allocated_blocks``).
    """

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]]
    ) -> None:
        windows = self._windows()
        h = self._reqs[request.request_id].device_match + request.py_num_connector_matched_tokens
        trimmed = []
        for gid, lst in enumerate(block_ids_by_layer_group):
            cut = sliding_cutoff(h, windows[gid], self.tpb)
            trimmed.append([-1 if o < cut else s for o, s in enumerate(lst)])
        super().update_state_after_alloc_by_layer_group(request, trimmed)


class WrongGroupWorker(OracleWorker):
    """Loads the neighbouring group's bytes (resized) into a group's page."""

    def _do_load(self, rid: int, gid: int, slot: int, digest: bytes) -> None:
        groups = [g.layer_group_id for g in self.layout.groups]
        other = groups[(groups.index(gid) + 1) % len(groups)]
        src = self.store.pages.get((digest, other, self.rank))
        if src is None:
            src = self.store.pages[(digest, gid, self.rank)]
        size = sum(r.size for r in self.layout.group(gid).regions)
        data = torch.zeros(size, dtype=torch.uint8)
        n = min(size, src.numel())
        data[:n] = src[:n]
        self._write_page(gid, slot, data)


class WrongSlotWorker(OracleWorker):
    """Off by one page slot on load."""

    def _load_slot(self, gid: int, slot: int) -> int:
        return (slot + 1) % self.layout.group(gid).regions[0].num_slots


class WrongShardWorker(OracleWorker):
    """Loads shard 0's bytes on every rank."""

    def _load_key(self, gid: int, digest: bytes) -> tuple[bytes, int, int]:
        return (digest, gid, 0)


class LateSaveWorker(OracleWorker):
    """Copies saved pages one iteration late -- after the engine may have freed (and junked) them."""

    def __init__(self, llm_args: Any, **kw: Any):
        super().__init__(llm_args, **kw)
        self._deferred: list[tuple[int, int, bytes]] = []

    def start_load_kv(self, stream: Any) -> None:
        deferred, self._deferred = self._deferred, []
        self._do_saves(deferred)
        super().start_load_kv(stream)

    def wait_for_save(self, stream: Any) -> None:
        self._deferred.extend(self._metadata.saves)


class NeverReturnsWorker(OracleWorker):
    """Loads asynchronously but never reports the load finished: the engine would hang."""

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
        return list(finished_gen_req_ids), []


class RecordingLeader(KvCacheConnectorScheduler):
    """Offers a fixed amount (sync), loads nothing, records every call: for engine tests."""

    def __init__(
        self,
        llm_args: Any,
        *,
        offer: int = 0,
        is_async: bool = False,
        log: list | None = None,
        hold_on_finish: bool = False,
        unpicklable: bool = False,
        **_: Any,
    ):
        super().__init__(llm_args)
        self.offer, self.is_async, self.hold_on_finish = offer, is_async, hold_on_finish
        self.unpicklable = unpicklable
        self.log = log if log is not None else []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.log.append(("match", request.request_id, num_computed_tokens))
        return self.offer, self.is_async and self.offer > 0

    def update_state_after_alloc_by_layer_group(self, request: Any, lists: list[list[int]]) -> None:
        self.log.append(
            ("alloc", request.request_id, request.py_num_connector_matched_tokens, [list(x) for x in lists])
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self.log.append(("meta", scheduler_output))
        if self.unpicklable:
            return {"fn": lambda: None}
        return {"n": len(scheduler_output.new_requests) + len(scheduler_output.cached_requests)}

    def request_finished_by_layer_group(self, request: Any, lists: list[list[int]]) -> bool:
        self.log.append(("finished", request.request_id, [list(x) for x in lists]))
        return self.hold_on_finish


class RecordingWorker(KvCacheConnectorWorker):
    """Records hooks; returns async ids at once; keeps a copy of the layout."""

    def __init__(self, llm_args: Any, *, log: list | None = None, **_: Any):
        super().__init__(llm_args)
        self.rank = llm_args.parallel_config.to_mapping().tp_rank
        self.log = log if log is not None else []
        self.layout: Any = None
        self.bound: list[Any] = []

    def register_kv_cache_layout(self, layout: Any) -> None:
        self.layout = layout

    def bind_connector_meta(self, metadata: Any) -> None:
        super().bind_connector_meta(metadata)
        self.bound.append(metadata)

    def start_load_kv(self, stream: Any) -> None:
        self.log.append(("start_load_kv", self.rank))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        self.log.append(("wait_layer", self.rank, layer_idx))

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        self.log.append(("save_layer", self.rank, layer_idx))

    def wait_for_save(self, stream: Any) -> None:
        self.log.append(("wait_for_save", self.rank))

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
        self.log.append(
            ("get_finished", self.rank, list(finished_gen_req_ids), list(started_loading_req_ids))
        )
        return list(finished_gen_req_ids), list(started_loading_req_ids)
