"""``s3kv bench lookup --local``: what a lookup answered with no request costs the scheduler's thread.

TensorRT-LLM asks ``get_num_new_matched_tokens`` on its executor thread: every co-running request
waits for the whole call. With the fleet index, the key index and the host tier most lookups send
no request at all, so what they cost is pure CPU on that thread -- hashing the prompt's chain,
answering the hit rule's asks, weighing the hit. This bench times exactly that, per prompt length,
on an in-process store (no latency: a wave, where one is sent, costs its CPU only).

Geometry: ``s3kv bench lookup``'s (Gemma-3-27B's block structure, tiny stored pages, the objects
s3kv would write for the real pages). Stored: the objects a cold prefill of each prompt -- and of
its first half (a conversation's previous turn) -- would save. Per prompt length, each case on a
fresh ``LeaderCore`` (set-up untimed), ``--repeats`` times, median and max of:

* ``index``: every object in the key index (this engine's own uploads): a full hit;
* ``index_next``: the same, on a leader that looked up the prompt's first half before (the
  previous turn of a conversation: what the engine saw last);
* ``fleet_trusted``: a signed fleet index young enough to vouch (no request): a full hit;
* ``fleet_verify``: the same index not trusted: a full hit after one verify wave (to memory);
* ``fleet_half``: a prompt whose first half is stored (the next turn of a conversation): a hit
  of half, the rest a miss against the index;
* ``fleet_miss``: a prompt never stored: a miss with no request;
* ``host``: the host tier holds the first half, the fleet index lists the rest: a full hit,
  weighed per tier (``worth.py``), the tier's longest own hit sought too.

Per case: the call's wall time (``ms``), the executor thread's CPU (``cpu_ms``), of which hashing
the prompt's chain (``hash_ms``), and the hit found.

Why a module of its own: ``bench lookup`` measures round trips to a store; this measures the
calls that make none, with set-ups (a published index, a filled host tier) it does not need.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ...config import Settings
from ...core.objects import ObjectIdentity, ObjectSpan, encode_object, object_metadata
from ...engine.fleetindex import Publisher
from ...engine.leader import LeaderCore
from ...store.memory import MemoryStore
from .common import machine_info, progress, rnd
from .lookup import VOCAB, LookupConfig, geometry, planned_objects, real_sizing

DEFAULT_LOCAL_PROMPTS = (8192, 16384, 32768, 65536, 131072)
QUICK_LOCAL_PROMPTS = (8192, 32768)
CASES = ("index", "index_next", "fleet_trusted", "fleet_verify", "fleet_half", "fleet_miss", "host")
#: A fixed key: the fleet index and the objects are signed (a trusted index must be).
_KEY = "s3kv-bench-lookup-local-0123456789abcdef"
PREFIX = "bench-local"


@dataclass
class _Run:
    wall_s: float
    cpu_s: float
    hash_s: float
    hit: int


def _settings(cfg: LookupConfig) -> Settings:
    # A refresher period far beyond the bench: its thread fetches nothing while lookups are timed.
    return Settings(integrity_key=_KEY, fleet_index_s=3600.0, blocks_per_object=cfg.blocks_per_object)


def _leader(settings: Settings, store: Any, cfg: LookupConfig, tiers: Any = None) -> LeaderCore:
    g = geometry(cfg)
    sizing = None if cfg.blocks_per_object else real_sizing(cfg.model, cfg.tokens_per_block)
    return LeaderCore(settings, store, PREFIX, tp_size=1, model_id=g.model_id, kv_dtype=g.kv_dtype, geometry=g,
                      sizing_page_bytes=sizing, tiers=tiers)


def _objects(writer: LeaderCore, cfg: LookupConfig, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """key -> (identity, first, count, last digest) of every object the prompts' prefills save."""
    g = writer.geometry
    assert g is not None
    out: dict[str, Any] = {}
    for i, p in enumerate(prompts):
        for gid, seal in planned_objects(writer, 1_000_000 + i, p):
            grp = g.groups[gid]
            key = writer.scheme.object_key(grp.fingerprint, 0, seal.last_digest)
            ident = ObjectIdentity(writer.namespace, grp.fingerprint, 0, 1, g.tokens_per_block, grp.page_bytes,
                                   writer.settings.integrity, grp.window)
            out.setdefault(key, (ident, seal.buffer.first, seal.count, seal.last_digest))
    return out


def _pages(ident: ObjectIdentity, first: int, count: int) -> list[bytes]:
    return [bytes([(first + k) % 251]) * ident.page_bytes for k in range(count)]


def _host_tier(objects: dict[str, Any]) -> Any:
    """A host tier (plain memory) holding ``objects``, filled as a seal fills it."""
    import torch

    from ...transfer.hosttier import HostTier

    tier = HostTier(MemoryStore(), 1 << 30)
    for key, (ident, first, count, last) in objects.items():
        e = tier.reserve(key, ident, first, count)
        assert e is not None
        pages = _pages(ident, first, count)
        buf = tier.fill_pages(e, torch.frombuffer(bytearray(b"".join(pages)), dtype=torch.uint8))
        if buf is not None:
            buf.release()
        assert tier.commit(e, encode_object(ident, first, last, pages, key)), key
    return tier


def _timed(leader: LeaderCore, rid: int, prompt: list[int]) -> _Run:
    own = list(prompt)  # handed over, as the TensorRT-LLM adapter hands over its own copy
    hashing = leader.stats.lookup_hash_cpu_s
    gc.collect()
    c0, t0 = time.thread_time(), time.perf_counter()
    hit, _ = leader.get_num_new_matched_tokens(rid, own, len(own), 0, owned=True)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return _Run(wall, cpu, leader.stats.lookup_hash_cpu_s - hashing, hit)


def run_local(
    cfg: LookupConfig, prompts: Sequence[int] = DEFAULT_LOCAL_PROMPTS, repeats: int = 5
) -> dict[str, Any]:
    t_start = time.perf_counter()
    rng = random.Random("s3kv-bench/lookup-local")
    longest = max(prompts)
    stream = [rng.randrange(VOCAB) for _ in range(longest)]
    tail = [rng.randrange(VOCAB) for _ in range(longest)]  # what a next turn adds
    warm = [rng.randrange(VOCAB) for _ in range(64)]  # a first lookup's one-time costs, untimed
    store = MemoryStore()
    settings = _settings(cfg)
    writer = _leader(settings.replace(fleet_index_s=0.0), store, cfg)
    halves = {n: stream[: n // 2] for n in prompts}
    objects = _objects(writer, cfg, [stream[:n] for n in prompts] + list(halves.values()))
    half_keys = set(_objects(_leader(settings.replace(fleet_index_s=0.0), MemoryStore(), cfg), cfg,
                             list(halves.values())))
    for key, (ident, first, count, last) in objects.items():
        store.put(key, encode_object(ident, first, last, _pages(ident, first, count), key),
                  object_metadata(ident, first, count, key))
    now = time.time()
    Publisher(store, PREFIX + "/", integrity=settings.integrity, every_s=3600.0).publish(now)
    progress(f"lookup --local: {len(objects)} objects stored and indexed")
    host = _host_tier({k: v for k, v in objects.items() if k in half_keys})

    def fresh(s: Settings, tiers: Any = None) -> LeaderCore:
        leader = _leader(s, store, cfg, tiers)
        fi = leader.fleet_index()
        if fi is not None:
            fi.refresh()
        return leader

    def with_index() -> LeaderCore:
        leader = fresh(settings.replace(fleet_index_s=0.0))
        leader.index.put_many([(key, ObjectSpan(first, count)) for key, (_, first, count, _) in objects.items()], ())
        return leader

    def with_host() -> LeaderCore:
        from ...transfer.tiers import TierSpeed

        return fresh(settings, SimpleNamespace(host_tier=host, speeds={"host": TierSpeed(), "s3": TierSpeed()}))

    def after_half(n: int) -> LeaderCore:
        leader = with_index()
        leader.get_num_new_matched_tokens(8, stream[: n // 2], n // 2, 0)
        return leader

    cases: dict[str, tuple[Callable[[int], LeaderCore], Callable[[int], list[int]]]] = {
        "index": (lambda n: with_index(), lambda n: stream[:n]),
        "index_next": (after_half, lambda n: stream[:n]),
        "fleet_trusted": (lambda n: fresh(settings), lambda n: stream[:n]),
        "fleet_verify": (lambda n: fresh(settings.replace(fleet_index_trust_s=0.0)), lambda n: stream[:n]),
        "fleet_half": (lambda n: fresh(settings), lambda n: stream[: n // 2] + tail[: n - n // 2]),
        "fleet_miss": (lambda n: fresh(settings), lambda n: tail[:n]),
        "host": (lambda n: with_host(), lambda n: stream[:n]),
    }
    rows = []
    for n in prompts:
        row: dict[str, Any] = {"tokens": n}
        for name, (make, prompt_of) in cases.items():
            prompt = prompt_of(n)
            runs = []
            for r in range(repeats):
                leader = make(n)
                leader.get_num_new_matched_tokens(7, warm, len(warm), 0)  # first-call costs, untimed
                runs.append(_timed(leader, 100 + r, prompt))
                leader.close_lookup()
            row[name] = {
                "hit_tokens": min(x.hit for x in runs),
                "ms": rnd(statistics.median(x.wall_s for x in runs) * 1e3, 2),
                "max_ms": rnd(max(x.wall_s for x in runs) * 1e3, 2),
                "cpu_ms": rnd(statistics.median(x.cpu_s for x in runs) * 1e3, 2),
                "hash_ms": rnd(statistics.median(x.hash_s for x in runs) * 1e3, 2),
            }
        progress("lookup --local: " + f"{n:>6} tok: " + ", ".join(
            f"{c} {row[c]['ms']:.1f} ms" for c in cases if c in row))
        rows.append(row)
    host.close()
    return {
        "bench": "lookup_local",
        "machine": machine_info(),
        "geometry": {"model_block_structure": cfg.model.name, "tokens_per_block": cfg.tokens_per_block,
                     "blocks_per_object": list(writer.group_blocks)},
        "repeats": repeats,
        "objects": len(objects),
        "results": rows,
        "seconds": rnd(time.perf_counter() - t_start, 1),
    }


def table(res: dict[str, Any]) -> str:
    lines = [
        f"Local lookups (nothing asked of a store but fleet_verify's wave, to memory): the scheduler's "
        f"time per call, median of {res['repeats']} on fresh leaders",
        f"{'tokens':>7}  {'case':<14}{'wall ms':>9}{'max ms':>9}{'cpu ms':>9}{'hash ms':>9}{'hit tokens':>12}",
    ]
    for r in res["results"]:
        for c in CASES:
            x = r.get(c)
            if x is not None:
                lines.append(f"{r['tokens']:>7}  {c:<14}{x['ms']:>9.2f}{x['max_ms']:>9.2f}{x['cpu_ms']:>9.2f}"
                             f"{x['hash_ms']:>9.2f}{x['hit_tokens']:>12}")
    return "\n".join(lines)
