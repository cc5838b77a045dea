"""Ready-made honour / replay hooks for :class:`~s3kv.sim.engine.SimEngine`."""

from __future__ import annotations

from collections.abc import Collection

from .engine import DiscardHook, Honour, PreemptGenerationHook, PreemptHook, honoured_after_failed_grow


def honour_minus_blocks(blocks: int, tokens_per_block: int) -> Honour:
    """V2 honouring ``blocks`` whole blocks fewer than offered (never below 0)."""
    return lambda offer: max(0, offer - blocks * tokens_per_block)


def honour_at_most(tokens: int) -> Honour:
    """V2 honouring at most ``tokens`` (block-aligned) of any offer."""
    return lambda offer: min(offer, tokens)


def honour_when_growth_fails(chunk_tokens: int, tokens_per_block: int, device_match: int = 0) -> Honour:
    """KVCacheManagerV2 with no free page to grow a request's allocation (memory pressure).

    Its ``_reserve_connector_prefix``: an offer ending inside the first chunk is honoured in
    full (the chunk only shrinks); one reaching the chunk's end needs a grow, and when that fails
    the honoured point is the largest whole block inside the pages it has that still leaves a chunk
    to compute -- ``(d + chunk - 1) // tpb * tpb`` -- or nothing when that is not past ``d``.
    ``chunk_tokens`` is the first chunk (the engine's ``chunk_size`` for a request that fits no
    other work); ``device_match`` the request's ``d``.
    """
    d, tpb = device_match, tokens_per_block

    def honour(offer: int) -> int:
        end = d + chunk_tokens
        return offer if d + offer < end else honoured_after_failed_grow(d, end, tpb)

    return honour


def preempt_once(after_chunks: int = 1, request_ids: Collection[int] | None = None) -> PreemptHook:
    """Preempt each (selected) request once, after its ``after_chunks``-th context chunk."""

    def hook(request_id: int, chunks_done: int, attempt: int) -> bool:
        if request_ids is not None and request_id not in request_ids:
            return False
        return attempt == 0 and chunks_done == after_chunks

    return hook


def preempt_generation_once(after_tokens: int = 1, request_ids: Collection[int] | None = None) -> PreemptGenerationHook:
    """Preempt each (selected) request once during generation, after its ``after_tokens``-th token
    (the same rule as :func:`preempt_once`, counting tokens generated instead of chunks)."""
    return preempt_once(after_tokens, request_ids)


def discard_async(
    request_ids: Collection[int] | None = None, attempts: Collection[int] = (0,)
) -> DiscardHook:
    """Discard the async load result of (selected) requests in the given attempts."""

    def hook(request_id: int, attempt: int) -> bool:
        return (request_ids is None or request_id in request_ids) and attempt in attempts

    return hook
