"""Cold then warm TensorRT-LLM instances of a VSWA model sharing only an S3 bucket.

    S3KV_URL=s3://my-bucket/kv python examples/trtllm_vswa.py --model <path-to-gemma-3> \\
        --max-attention-window 1024 1024 1024 1024 1024 32768

Needs a GPU and TensorRT-LLM (``pip install 's3kv[tensorrt-llm]'``). The second
instance is a fresh process-level engine: whatever it does not recompute came
from the bucket through s3kv.
"""

from __future__ import annotations

import argparse
import os
import time


def build_llm(model: str, windows: list[int], max_seq_len: int | None):
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig

    return LLM(
        model=model,
        backend="pytorch",
        max_seq_len=max_seq_len,
        kv_cache_config=KvCacheConfig(
            free_gpu_memory_fraction=0.5,
            max_attention_window=windows,  # one window per layer, repeated: one layer group per window
            use_kv_cache_manager_v2=True,  # the layout-describing path VSWA needs
            enable_block_reuse=True,  # required with a connector
        ),
        kv_connector_config=KvCacheConnectorConfig(
            connector_module="s3kv.trtllm",
            connector_scheduler_class="S3KvConnectorLeader",
            connector_worker_class="S3KvConnectorWorker",
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-attention-window", type=int, nargs="+", required=True)
    ap.add_argument("--max-seq-len", type=int, default=None)
    args = ap.parse_args()
    if not os.environ.get("S3KV_URL"):
        raise SystemExit("set S3KV_URL=s3://bucket/prefix (credentials from the usual AWS chain)")
    from tensorrt_llm import SamplingParams

    system = "You are a careful assistant. " * 200  # a long shared system prompt: many windows long
    prompts = [system + f"Question {i}: summarise the history of the number {i}." for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for phase in ("cold", "warm"):
        llm = build_llm(args.model, list(args.max_attention_window), args.max_seq_len)
        try:
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            print(f"{phase}: {time.perf_counter() - t:.2f}s", [o.outputs[0].text[:40] for o in outs])
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
