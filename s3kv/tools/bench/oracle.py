"""What a trace replay compares with: the ideal (storing every block) and the upstream example's rule.

Its own arithmetic over token blocks (a chained blake2b of each block's tokens,
``fleet.block_chain``), sharing nothing with s3kv's keys, policy or lookup.

* **ideal**: every block some earlier request computed (prompt, or the part of its answer whose
  KV exists) is stored, and a request is served its longest such prefix, one token short of its
  prompt (the engine never takes the last prompt token from a connector);
* **the upstream example's rule** (the VSWA connector example in TensorRT-LLM), counted, not
  replayed: every group stores every full prompt block as its own object, a lookup HEADs block
  by block until the first miss, a save first checks whether the block's object exists, and the
  hit is capped by the smallest window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...core.cost import get_requests, put_requests
from .fleet import block_chain


class Oracle:
    def __init__(self, tpb: int, window: int, page_real: Sequence[int]):
        self.tpb = tpb
        self.window_blocks = window // tpb
        self.page_real = list(page_real)
        self.kv: set[bytes] = set()  # every block any earlier request computed (prompt + answer)
        self.prompt: set[bytes] = set()  # the upstream example stores prompt blocks only
        self.ideal: list[int] = []
        self.upstream: list[int] = []
        self.up = {"head": 0, "put": 0, "get": 0, "real_put": 0, "real_get": 0}
        self.up_bytes = [0] * len(self.page_real)
        self.up_objects = 0

    def __getstate__(self) -> dict[str, Any]:
        # Sent back from a replay process: the counts, not the block sets.
        return {k: v for k, v in self.__dict__.items() if k not in ("kv", "prompt")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.kv, self.prompt = set(), set()

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        tpb, groups = self.tpb, len(self.page_real)
        plen = len(prompt)
        hmax = (plen - 1) // tpb
        full = plen // tpb
        kv_blocks = (plen + len(output) - 1) // tpb
        d = block_chain(list(prompt) + list(output[: max(0, kv_blocks * tpb - plen)]), tpb, kv_blocks)
        k = 0
        while k < hmax and d[k] in self.kv:
            k += 1
        self.ideal.append(k * tpb)
        m = 0  # the upstream lookup: block by block, every group, until the first miss
        while m < full and d[m] in self.prompt:
            m += 1
        served = min(m, hmax, self.window_blocks)
        self.upstream.append(served * tpb)
        self.up["head"] += groups * m + (1 if m < full else 0)
        self.up["get"] += groups * served
        self.up["real_get"] += sum(served * get_requests(p) for p in self.page_real)
        for b in range(served, full):  # saved after the served blocks: exists-check, then PUT if new
            self.up["head"] += groups
            if d[b] not in self.prompt:
                self.up["put"] += groups
                self.up["real_put"] += sum(put_requests(p) for p in self.page_real)
                self.up_objects += groups
                for gi, p in enumerate(self.page_real):
                    self.up_bytes[gi] += p
                self.prompt.add(d[b])
        self.kv.update(d)
