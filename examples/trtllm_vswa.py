"""Cold then warm TensorRT-LLM instances of a VSWA model sharing only an S3 bucket.

    S3KV_URL=s3://my-bucket/kv python examples/trtllm_vswa.py --model <path-to-gemma-3> \\
        --max-attention-window 1024 1024 1024 1024 1024 32768

Needs a GPU and TensorRT-LLM, with s3kv installed beside it (docs/install.md). The second
instance is a fresh engine: whatever it does not recompute came from the bucket
through s3kv. After each instance the script prints s3kv's own figures, read from
its Prometheus endpoint (``S3KV_METRICS_PORT``; a free port is picked when unset):
prompt tokens served from S3, bytes each way and S3 requests.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

INSTALL_HINT = (
    "this example needs TensorRT-LLM and an NVIDIA GPU: install TensorRT-LLM (its install guide), then "
    "s3kv into the same environment (pip install /path/to/s3kv, docs/install.md). Without a GPU, try `s3kv demo` or "
    "`python examples/simulated_cluster.py`, which run the same connector on a simulated engine."
)


def require_tensorrt_llm() -> None:
    """Stop with one line and an install hint when TensorRT-LLM cannot be imported."""
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError as exc:  # ModuleNotFoundError, or a broken CUDA install underneath it
        raise SystemExit(f"trtllm_vswa.py: {INSTALL_HINT} ({type(exc).__name__}: {exc})") from None


def build_llm(model: str, windows: list[int], max_seq_len: int | None, tp: int) -> Any:
    from tensorrt_llm import LLM

    from s3kv.trtllm import llm_api_options

    return LLM(
        model=model,
        backend="pytorch",
        tensor_parallel_size=tp,
        max_seq_len=max_seq_len,
        # s3kv's connector classes and the kv_cache_config flags it needs (block reuse on, KV cache
        # manager V2 where the installed line has the layout API, partial reuse off), plus ours:
        **llm_api_options(
            free_gpu_memory_fraction=0.5,
            max_attention_window=windows,  # one window per layer, repeated: one layer group per window
        ),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_ranks(port: int, tp: int) -> list[dict[str, float]]:
    """Every rank's metrics (rank r serves on port + r); a rank that does not answer is left out."""
    from s3kv.engine.metrics import read_endpoint

    out = []
    for rank in range(tp):
        try:
            out.append(read_endpoint(f"http://127.0.0.1:{port + rank}/metrics"))
        except OSError:
            pass
    return out


def summarize(phase: str, scrapes: Sequence[dict[str, float]], prompt_tokens: int) -> str:
    """One line of s3kv figures for a phase, summed over the ranks that answered."""
    from s3kv.engine.metrics import figures

    if not scrapes:
        return f"{phase}: no s3kv metrics endpoint answered (is S3KV_METRICS_PORT free?)"
    total: dict[str, float] = {}
    for f in (figures(s) for s in scrapes):
        for k, v in f.items():
            total[k] = total.get(k, 0.0) + v
    served = int(total["hit_tokens"])
    share = served / prompt_tokens if prompt_tokens else 0.0
    mib = 1024 * 1024
    return (
        f"{phase}: {served} of {prompt_tokens} prompt tokens served from S3 ({share:.0%}); "
        f"loaded {total['loaded_bytes'] / mib:.1f} MiB, saved {total['saved_bytes'] / mib:.1f} MiB; "
        f"S3 requests: HEAD {int(total['head_requests'])}, GET {int(total['get_requests'])}, "
        f"PUT {int(total['put_requests'])}; saves dropped {int(total['saves_dropped'])}, "
        f"load failures {int(total['load_failures'])} ({len(scrapes)} rank(s) reporting)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-attention-window", type=int, nargs="+", required=True)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    args = ap.parse_args(argv)
    require_tensorrt_llm()
    if not os.environ.get("S3KV_URL"):
        raise SystemExit("trtllm_vswa.py: set S3KV_URL=s3://bucket/prefix (credentials from the usual AWS chain)")
    port = int(os.environ.get("S3KV_METRICS_PORT") or 0) or free_port()
    os.environ["S3KV_METRICS_PORT"] = str(port)  # the engine's processes inherit it
    from tensorrt_llm import SamplingParams

    system = "You are a careful assistant. " * 200  # a long shared system prompt: many windows long
    prompts = [system + f"Question {i}: summarise the history of the number {i}." for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for phase in ("cold", "warm"):
        llm = build_llm(args.model, list(args.max_attention_window), args.max_seq_len, args.tp)
        try:
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            took = time.perf_counter() - t
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
            print(f"{phase}: {took:.2f}s", [o.outputs[0].text[:40] for o in outs])
            # Scrape before shutdown: the endpoint lives as long as the engine.
            print(summarize(phase, scrape_ranks(port, args.tp), prompt_tokens))
        finally:
            llm.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
