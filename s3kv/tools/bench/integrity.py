"""``s3kv bench integrity``: what keyed integrity tags cost on the save and load paths.

Per page size, over objects of ``object_mib``, best of ``repeats``:

* **sign**: ``encode_object`` with integrity keys (xxh3 checksums + BLAKE3 page tags +
  object tag) vs without (xxh3 only) -- what an upload thread spends per byte;
* **verify**: ``decode_object`` with keys (header, object tag, every page's xxh3 and tag)
  vs without -- what a download thread spends before a byte may reach the GPU;
* the same with ``threads`` threads each on its own object (the upload/download pools run
  in parallel; BLAKE3 releases the GIL);
* keyed BLAKE2b and HMAC-SHA256 over the same pages, single thread: the alternatives.

No store is involved: these are CPU costs per byte, to set against a transfer rate (at
``L`` GB/s of loads, verification takes ``L / verify_gbps`` of a core).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...core.integrity import IntegrityKeys
from ...core.objects import ObjectIdentity, decode_object, encode_object

DEFAULT_PAGE_MIB = (0.25, 1.0, 4.0)
_KEY = "pfx/00000000000000000000000000000000/0123456789abcdef.0of1/" + "ab" * 16


@dataclass(frozen=True)
class IntegrityConfig:
    page_mib: tuple[float, ...] = DEFAULT_PAGE_MIB
    object_mib: float = 32.0
    threads: int = 0  # 0: min(4, cores)
    repeats: int = 3


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _parallel(fns: Sequence[Callable[[], Any]], repeats: int) -> float:
    def once() -> None:
        ts = [threading.Thread(target=f) for f in fns]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return _best(once, repeats)


def _measure(mib: float, cfg: IntegrityConfig, threads: int, keys: IntegrityKeys, mac_key: bytes) -> dict[str, Any]:
    page_bytes = max(64, int(mib * (1 << 20)))
    n = max(1, int(cfg.object_mib * (1 << 20)) // page_bytes)
    plain = ObjectIdentity(bytes(16), "0123456789abcdef", 0, 1, 32, page_bytes)
    signed = replace(plain, integrity=keys)
    digest = bytes(range(16))
    objs = [[os.urandom(page_bytes) for _ in range(n)] for _ in range(threads)]
    pages = objs[0]
    nbytes = n * page_bytes
    plain_blob = b"".join(bytes(b) for b in encode_object(plain, 0, digest, pages))
    signed_blobs = [b"".join(bytes(b) for b in encode_object(signed, 0, digest, p, _KEY)) for p in objs]
    r = cfg.repeats

    def gbps(seconds: float, k: int = 1) -> float:
        return k * nbytes / seconds / 1e9

    row: dict[str, Any] = {"page_mib": mib, "pages_per_object": n, "object_bytes": nbytes}
    row["sign_xxh3_only_gbps"] = gbps(_best(lambda: encode_object(plain, 0, digest, pages), r))
    row["sign_gbps"] = gbps(_best(lambda: encode_object(signed, 0, digest, pages, _KEY), r))
    row["verify_xxh3_only_gbps"] = gbps(_best(lambda: decode_object(plain_blob, plain, _KEY), r))
    row["verify_gbps"] = gbps(_best(lambda: decode_object(signed_blobs[0], signed, _KEY), r))
    signers = [functools.partial(encode_object, signed, 0, digest, p, _KEY) for p in objs]
    verifiers = [functools.partial(decode_object, b, signed, _KEY) for b in signed_blobs]
    row["sign_parallel_gbps"] = gbps(_parallel(signers, r), threads)
    row["verify_parallel_gbps"] = gbps(_parallel(verifiers, r), threads)
    row["blake2b_keyed_gbps"] = gbps(
        _best(lambda: [hashlib.blake2b(p, key=mac_key, digest_size=16).digest() for p in pages], r)
    )
    row["hmac_sha256_gbps"] = gbps(_best(lambda: [hmac.digest(mac_key, p, "sha256") for p in pages], r))
    row["sign_cost_vs_xxh3"] = row["sign_xxh3_only_gbps"] / row["sign_gbps"]
    row["verify_cost_vs_xxh3"] = row["verify_xxh3_only_gbps"] / row["verify_gbps"]
    # Share of one core that tagging / verification takes at 1 GB/s of saves / loads.
    row["core_share_at_1gbps_sign"] = 1.0 / row["sign_gbps"]
    row["core_share_at_1gbps_verify"] = 1.0 / row["verify_gbps"]
    return row


def run_integrity(cfg: IntegrityConfig) -> dict[str, Any]:
    from .common import machine_info

    threads = cfg.threads or min(4, os.cpu_count() or 1)
    keys = IntegrityKeys.from_secrets(os.urandom(32).hex())
    mac_key = os.urandom(32)
    results = [_measure(mib, cfg, threads, keys, mac_key) for mib in cfg.page_mib]
    return {
        "benchmark": "integrity",
        "tag": "keyed BLAKE3 (page tags 16 B, object tag 32 B) + xxh3 checksums",
        "object_mib": cfg.object_mib,
        "threads": threads,
        "repeats": cfg.repeats,
        "machine": machine_info(),
        "results": results,
    }


def table(res: dict[str, Any]) -> str:
    m = res.get("machine", {})
    lines = [
        f"s3kv bench integrity -- {res['tag']}; objects of {res['object_mib']:g} MiB, "
        f"{res['threads']} threads in the parallel columns; machine: {m.get('cores')} cores, {m.get('cpu', '?')}",
        "",
        f"{'page':>9} | {'sign GB/s':>9} {'xxh3 only':>9} {'x cost':>6} {'par.':>6} | "
        f"{'verify GB/s':>11} {'xxh3 only':>9} {'x cost':>6} {'par.':>6} | {'blake2b':>7} {'hmac256':>7}",
    ]
    for r in res["results"]:
        lines.append(
            f"{r['page_mib']:>5g} MiB | {r['sign_gbps']:>9.2f} {r['sign_xxh3_only_gbps']:>9.2f} "
            f"{r['sign_cost_vs_xxh3']:>6.1f} {r['sign_parallel_gbps']:>6.2f} | {r['verify_gbps']:>11.2f} "
            f"{r['verify_xxh3_only_gbps']:>9.2f} {r['verify_cost_vs_xxh3']:>6.1f} {r['verify_parallel_gbps']:>6.2f} | "
            f"{r['blake2b_keyed_gbps']:>7.2f} {r['hmac_sha256_gbps']:>7.2f}"
        )
    lines.append("")
    lines.append(
        "GB/s per thread unless 'par.'; 'x cost' = time with tags / time with xxh3 only; blake2b/hmac256: "
        "keyed BLAKE2b and HMAC-SHA256 over the same pages, one thread (the alternatives to BLAKE3)."
    )
    return "\n".join(lines)
