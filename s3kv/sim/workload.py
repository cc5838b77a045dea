"""Deterministic workloads and model geometries for the simulator.

Every generator takes a seed and produces the same specs on every machine.
Multi-turn conversations precompute each answer with the simulator's own
sampler (:func:`~s3kv.sim.model.generate_tokens`), so turn k+1's prompt is
exactly turn k's prompt + the answer the engine will generate + new text,
and turn k+1 is admitted only after turn k finished (``after``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from .config import SimModel
from .model import generate_tokens, request_root
from .request import SimRequestSpec

FULL_ATTENTION = 1 << 20  # a configured window at/above max_seq_len: the engine clamps it to full attention


def gemma3_like(
    window: int = 64,
    *,
    num_layers: int = 6,
    kv_heads: int = 2,
    head_dim: int = 8,
    regions_per_group: int = 1,
    dtype: str = "bfloat16",
    vocab_size: int = 32000,
    name: str = "s3kv-sim/gemma3-like",
    tp_size: int = 1,
) -> SimModel:
    """Gemma-3's pattern, 5 sliding : 1 global, at toy size: windows ``[W]*5 + [full]`` repeated.

    Configured sliding-first, as Gemma-3 does; the engine numbers the full group 0.
    """
    return SimModel(
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_attention_window=(window,) * 5 + (FULL_ATTENTION,),
        dtype=dtype,
        regions_per_group=regions_per_group,
        vocab_size=vocab_size,
        name=name,
        tp_size=tp_size,
    )


def flat_model(
    *,
    num_layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 8,
    dtype: str = "bfloat16",
    vocab_size: int = 32000,
    name: str = "s3kv-sim/flat",
) -> SimModel:
    """One window (full attention): one group, one region -- the flat/V1-compatible geometry."""
    return SimModel(
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        vocab_size=vocab_size,
        name=name,
    )


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def shared_prefix_workload(
    *,
    n_users: int = 4,
    system_len: int = 128,
    user_len: int = 64,
    max_new_tokens: int = 4,
    vocab_size: int = 32000,
    seed: int = 0,
    first_id: int = 0,
    cache_salt: str | None = None,
) -> list[SimRequestSpec]:
    """One system prompt, then ``n_users`` different user texts after it."""
    rng = random.Random(f"shared/{seed}")
    system = random_tokens(rng, system_len, vocab_size)
    return [
        SimRequestSpec(
            request_id=first_id + i,
            prompt=tuple(system + random_tokens(rng, user_len, vocab_size)),
            max_new_tokens=max_new_tokens,
            cache_salt=cache_salt,
        )
        for i in range(n_users)
    ]


def multi_turn_workload(
    *,
    n_conversations: int = 2,
    turns: int = 3,
    system_len: int = 64,
    first_len: int = 48,
    turn_len: int = 40,
    max_new_tokens: int = 8,
    vocab_size: int = 32000,
    seed: int = 0,
    first_id: int = 0,
) -> list[SimRequestSpec]:
    """Conversations sharing a system prompt; turn k+1 = turn k's prompt + its answer + new text.

    Ids: conversation ``c`` turn ``t`` is ``first_id + c * turns + t``. Specs are
    ordered turn-major (all first turns, then all second turns, ...).
    """
    rng = random.Random(f"multi/{seed}")
    system = random_tokens(rng, system_len, vocab_size)
    root = request_root()
    by_turn: list[list[SimRequestSpec]] = [[] for _ in range(turns)]
    for c in range(n_conversations):
        prompt = system + random_tokens(rng, first_len, vocab_size)
        for t in range(turns):
            rid = first_id + c * turns + t
            by_turn[t].append(
                SimRequestSpec(
                    request_id=rid,
                    prompt=tuple(prompt),
                    max_new_tokens=max_new_tokens,
                    after=(rid - 1,) if t else (),
                )
            )
            answer = generate_tokens(root, prompt, max_new_tokens, vocab_size)
            prompt = prompt + answer + random_tokens(rng, turn_len, vocab_size)
    return [s for turn in by_turn for s in turn]


def repeat_workload(specs: Sequence[SimRequestSpec], first_id: int) -> list[SimRequestSpec]:
    """The same requests under new ids (``after`` remapped): a warm pass over a cold one's prompts."""
    base = min(s.request_id for s in specs)
    remap = {s.request_id: first_id + s.request_id - base for s in specs}
    return [
        dataclasses.replace(s, request_id=remap[s.request_id], after=tuple(remap.get(a, a) for a in s.after))
        for s in specs
    ]


def turn_phases(shape: Any, role: str, *, first_id: int, seed: int, new_users_seed: str) -> list[list[SimRequestSpec]]:
    """Two clusters' phases of :func:`multi_turn_workload`: one phase per conversation turn (users
    think between turns; cluster ``"A"`` runs ``shape.turns_a`` turns, ``"B"`` ``shape.turns_b``)
    and, on B, a last phase of ``shape.new_users`` new users on the shared system prompt. ``shape``
    names conversations, turns_a, turns_b, system_len, first_len, turn_len, answer_len, new_users."""
    base = multi_turn_workload(
        n_conversations=shape.conversations,
        turns=shape.turns_b,
        system_len=shape.system_len,
        first_len=shape.first_len,
        turn_len=shape.turn_len,
        max_new_tokens=shape.answer_len,
        seed=seed,
    )
    turns = shape.turns_a if role == "A" else shape.turns_b
    phases: list[list[SimRequestSpec]] = [[] for _ in range(turns)]
    for s in base:
        t = s.request_id % shape.turns_b
        if t < turns:
            phases[t].append(SimRequestSpec(first_id + s.request_id, s.prompt, s.max_new_tokens))
    if role == "B" and shape.new_users:
        rng = random.Random(new_users_seed)
        system = list(base[0].prompt[: shape.system_len])
        phases.append([
            SimRequestSpec(first_id + 5_000 + u, tuple(system + random_tokens(rng, shape.first_len, 32000)),
                           shape.answer_len)
            for u in range(shape.new_users)
        ])
    return phases
