"""Ready-made honour / replay hooks for :class:`~s3kv.sim.engine.SimEngine`."""

from __future__ import annotations

from collections.abc import Collection

from .engine import DiscardHook, Honour, PreemptGenerationHook, PreemptHook


def honour_minus_blocks(blocks: int, tokens_per_block: int) -> Honour:
    """V2 honouring ``blocks`` whole blocks fewer than offered (never below 0)."""
    return lambda offer: max(0, offer - blocks * tokens_per_block)


def honour_at_most(tokens: int) -> Honour:
    """V2 honouring at most ``tokens`` (block-aligned) of any offer."""
    return lambda offer: min(offer, tokens)


def preempt_once(after_chunks: int = 1, request_ids: Collection[int] | None = None) -> PreemptHook:
    """Preempt each (selected) request once, after its ``after_chunks``-th context chunk."""

    def hook(request_id: int, chunks_done: int, attempt: int) -> bool:
        if request_ids is not None and request_id not in request_ids:
            return False
        return attempt == 0 and chunks_done == after_chunks

    return hook


def preempt_generation_once(after_tokens: int = 1, request_ids: Collection[int] | None = None) -> PreemptGenerationHook:
    """Preempt each (selected) request once during generation, after its ``after_tokens``-th token."""

    def hook(request_id: int, generated: int, attempt: int) -> bool:
        if request_ids is not None and request_id not in request_ids:
            return False
        return attempt == 0 and generated == after_tokens

    return hook


def discard_async(
    request_ids: Collection[int] | None = None, attempts: Collection[int] = (0,)
) -> DiscardHook:
    """Discard the async load result of (selected) requests in the given attempts."""

    def hook(request_id: int, attempt: int) -> bool:
        return (request_ids is None or request_id in request_ids) and attempt in attempts

    return hook
