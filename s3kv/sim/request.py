"""Requests: the workload's frozen description and the ``LlmRequest`` stand-in connectors see."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequestSpec:
    """One request of a workload.

    ``device_match_tokens`` (block-aligned) is how much of the prompt the
    engine's own cache already holds: the engine fills those pages itself with
    correct KV and passes the count as ``num_computed_tokens``. ``after`` names
    requests that must finish generating before this one is admitted (the next
    turn of a conversation); ``cancel_after_iterations`` cancels it (a client
    timeout). ``multimodal_positions`` without
    ``multimodal_hashes`` makes the request's KV unique to it (must not be cached).
    ``lora_task_id`` with ``lora_path``: TensorRT-LLM's ``LoRARequest(name, lora_int_id,
    lora_path)``; the engine applies the weights at the path it first loaded for that id.
    """

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int = 4
    cache_salt: str | None = None
    lora_task_id: int | None = None
    lora_path: str | None = None
    multimodal_hashes: tuple | None = None
    multimodal_positions: tuple[int, ...] | None = None
    device_match_tokens: int = 0
    after: tuple[int, ...] = ()
    #: Cancel it this many iterations after admission unless finished (the engine then calls
    #: request_finished for it, parked or running).
    cancel_after_iterations: int | None = None
    #: It ends by a stop token after this many tokens (<= max_new_tokens): the sampler's stop
    #: criteria, which the scheduler's length check cannot foresee (the overlap loop then runs
    #: one extra forward for it).
    stop_after: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "after", tuple(self.after))
        if len(self.prompt) < 1:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_new_tokens:
            raise ValueError(f"request {self.request_id}: stop_after must be in [1, max_new_tokens]")

    @property
    def output_limit(self) -> int:
        """How many tokens it generates: up to its stop token, else max_new_tokens."""
        return self.max_new_tokens if self.stop_after is None else self.stop_after


class SimLlmRequest:
    """The scheduler-side ``LlmRequest`` surface the contract names, and nothing else.

    ``get_tokens(0)`` returns a copy (the real binding converts from C++), so a
    connector cannot mutate the engine's tokens.
    """

    def __init__(self, spec: SimRequestSpec):
        self.request_id = spec.request_id
        self.prompt_len = len(spec.prompt)
        self.cache_salt = spec.cache_salt
        self.lora_task_id = spec.lora_task_id
        # The executor worker passes LoRARequest.lora_path on (PyTorch backend), None without LoRA.
        self.py_lora_path = spec.lora_path if spec.lora_task_id is not None else None
        self.multimodal_hashes = None if spec.multimodal_hashes is None else list(spec.multimodal_hashes)
        self.multimodal_positions = (
            None if spec.multimodal_positions is None else list(spec.multimodal_positions)
        )
        self.max_new_tokens = spec.max_new_tokens
        self.py_num_connector_matched_tokens = 0
        #: The scheduler's chunk for the next context pass (set before the connector is asked).
        self.context_chunk_size = self.prompt_len
        self._tokens: list[int] = list(spec.prompt)

    def get_tokens(self, beam: int = 0) -> list[int]:
        if beam != 0:
            raise ValueError("beam width is 1 with a connector")
        return list(self._tokens)

    def __repr__(self) -> str:
        return (
            f"SimLlmRequest(id={self.request_id}, prompt_len={self.prompt_len}, tokens={len(self._tokens)})"
        )
