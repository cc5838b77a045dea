"""``s3kv glossary``: the words s3kv's output uses, each in one line.

The same list is docs/glossary.md (``tests/test_user_path.py`` holds the page equal to
:func:`markdown`), so an installed s3kv, which has no docs folder, can still explain its output.
"""

from __future__ import annotations

import click

#: Term -> what it means, in the order a reader meets them.
TERMS: dict[str, str] = {
    "prompt tokens": "the tokens of a request's prompt (for a conversation, the whole history so far).",
    "served from S3 / from the store": "prompt tokens whose KV was loaded from the bucket instead of "
    "computed (the hit); the rest are computed.",
    "hit rate": "prompt tokens served from the store / prompt tokens.",
    "cold / warm cluster": "the demo's cluster A starts with an empty store (cold); cluster B, a fresh "
    "engine, finds what A stored (warm).",
    "prefill": "computing the KV of a prompt's tokens before the first output token: the work a hit saves.",
    "block, page": "TensorRT-LLM keeps KV in fixed-size blocks of tokens (tokens_per_block, 32 by "
    "default); a page is one block's KV of one layer group on one GPU.",
    "layer group": "the layers that share one attention window (VSWA models such as Gemma-3 have one "
    "group per window size, and one pool of pages per group).",
    "sliding-window / full-attention layers": "a sliding-window layer attends only to the last W tokens "
    "(its window), so only the in-window tail of its KV is needed; a full-attention layer needs all of it.",
    "VSWA": "variable sliding-window attention: a model whose layers have different windows.",
    "tail, checkpoint": "the in-window KV a sliding-window layer needs to continue a prompt; s3kv stores "
    "tails where prompts end and every S3KV_CHECKPOINT_TOKENS tokens (the checkpoints).",
    "branch point, branch tail": "where two prompts that share a prefix (a system prompt, a document) part; "
    "s3kv stores a tail there (a branch tail) once S3's chain or an engine's recent prompts show it, and "
    "later prompts with that prefix are served up to it.",
    "object": "one stored S3 object: a run of consecutive blocks of one layer group and TP shard.",
    "namespace": "the part of every key that names the model, KV dtype, block size and TP size: "
    "different geometries never share a key.",
    "lookup": "finding, for a new request, the longest stored prefix it can be served from (HEAD "
    "requests, or the local index of known keys).",
    "round trip, wave": "one batch of HEAD requests sent together; a lookup sends a probe wave, maybe a "
    "fill-in wave, and a verify wave that checks every object the hit needs.",
    "offer, promise": "the tokens s3kv tells the engine it can load; once the engine takes the offer, s3kv "
    "has promised those pages.",
    "load, save": "copying pages from the store into GPU pages (load), or from GPU pages into the store (save).",
    "staging": "pinned host memory that every save and load passes through (S3KV_STAGING_MIB).",
    "kv_mismatches (mism)": "pages a load filled whose bytes differ from what recomputation writes: "
    "wrong KV. The demo, the fault matrix and the trace replay check every page; it must be 0.",
    "failed load, rung": "what happens when a promised load fails: rung 1, the engine recomputes the "
    "request (where its TensorRT-LLM line can); rung 3, the request waits (is parked) while s3kv retries.",
    "parked": "a request the engine holds back while its load runs (or is retried).",
    "errors caught inside s3kv's hooks": "exceptions s3kv contained: any one of them would have stopped "
    "a real engine, so each is counted.",
    "lookup budget, stall": "how long a lookup may block the engine's scheduler (a share of the prefill "
    "it could save, at most 500 ms); the stall is the time it did.",
    "circuit breaker": "after repeated store failures, lookups miss at once instead of waiting on a dead "
    "store; it tries again after a pause.",
    "integrity key, tags": "a secret that signs every object s3kv writes; an engine with the key serves "
    "only objects with a valid tag (docs/security.md).",
    "TP, shard": "tensor parallelism: each GPU (rank) of an engine holds a shard of every layer's KV.",
    "MFU": "model FLOPs utilisation: the share of the GPU's peak FLOP/s a prefill achieves (0.65 measured "
    "on an H200); with the model's FLOPs per token it prices what a hit saves.",
    "value ratio": "what S3 costs (requests and storage) / what the GPU time a hit saves is worth; below "
    "1 s3kv pays for itself.",
    "pp": "percentage points: 63.9% -> 66.2% is +2.3 pp.",
    "TTFT": "time to first token of a request.",
    "retention, gc": "how long an object is kept after its last write or refresh (S3KV_RETENTION_H); "
    "s3kv gc deletes what is older.",
    "ghost read": "a hit gc's retention cut off: a lookup would have gone on to an object gc had deleted; "
    "engines report it at the object's age, so gc keeps objects longer where reads come later than it keeps.",
}


def markdown() -> str:
    """docs/glossary.md."""
    lines = [
        "# Glossary",
        "",
        "The words s3kv's output uses. The same list is printed by `s3kv glossary` (one term: "
        "`s3kv glossary TERM`).",
        "",
    ]
    lines += [f"- **{term}**: {text}" for term, text in TERMS.items()]
    return "\n".join(lines) + "\n"


@click.command("glossary")
@click.argument("term", required=False)
def glossary_command(term: str | None) -> None:
    """What the words in s3kv's output mean (pages, wave, rung, mism, pp, MFU ...).

    With TERM, only the entries whose name contains it.
    """
    items = list(TERMS.items())
    if term:
        items = [(t, x) for t, x in items if term.lower() in t.lower()]
        if not items:
            raise click.ClickException(f"no glossary entry for {term!r}; s3kv glossary lists them all")
    for t, x in items:
        click.echo(f"{t}: {x}")
