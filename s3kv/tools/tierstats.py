"""``s3kv stats --engine URL``: what each tier of running engines served and holds.

The bucket is one tier (``s3kv stats`` walks it); each engine rank's host tier lives in its
process, so it is read from the rank's metrics endpoint (``S3KV_METRICS_PORT``; rank ``r`` serves
port + r): loads by the tier that served them, what the host tier holds against its size, and
its events (saves kept, objects kept from S3 reads, evictions, write-backs, divergence).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..engine.metrics import PREFIX, read_endpoint
from .options import fmt_bytes

_EVENTS = ("inserted", "kept_from_s3", "evicted", "write_back", "write_back_failed", "divergence", "bad",
           "host_only_save")


def scrape(urls: Sequence[str]) -> dict[str, dict[str, float] | str]:
    """Each engine's metrics endpoint read once: its samples, or why it did not answer (one line).
    ``s3kv stats --engine`` builds its tiers, lookup and value lines from this one read."""
    out: dict[str, dict[str, float] | str] = {}
    for url in urls:
        try:
            out[url] = read_endpoint(url)
        except Exception as e:  # noqa: BLE001 - one line per endpoint that does not answer
            out[url] = f"{type(e).__name__}: {e}"
    return out


def engine_tiers(scraped: Mapping[str, dict[str, float] | str]) -> list[dict[str, Any]]:
    """Per endpoint: loads and bytes by tier, the host tier's fill and events (or the error)."""
    out: list[dict[str, Any]] = []
    for url, samples in scraped.items():
        if isinstance(samples, str):
            out.append({"engine": url, "error": samples})
            continue

        def one(name: str, label: str = "", samples: dict[str, float] = samples) -> float:
            key = f"{PREFIX}_{name}" + (f"{{{label}}}" if label else "")
            return samples.get(key, 0.0)

        doc: dict[str, Any] = {
            "engine": url,
            "loads": {t: int(one("tier_loads_total", f'tier="{t}"')) for t in ("host", "s3")},
            "loaded_bytes": {t: int(one("tier_loaded_bytes_total", f'tier="{t}"')) for t in ("host", "s3")},
            "host_tier": {
                "bytes": int(one("host_tier_bytes")), "capacity_bytes": int(one("host_tier_capacity_bytes")),
                "objects": int(one("host_tier_objects")), "register_s": one("host_tier_register_seconds"),
                **{e: int(one("host_tier_events_total", f'event="{e}"')) for e in _EVENTS},
            },
        }
        out.append(doc)
    return out


def lines(tiers: Iterable[dict[str, Any]]) -> Iterator[str]:
    for t in tiers:
        if "error" in t:
            yield f"engine {t['engine']}: no metrics ({t['error']})"
            continue
        h, loads, lb = t["host_tier"], t["loads"], t["loaded_bytes"]
        total = loads["host"] + loads["s3"]
        share = f"{loads['host'] / total:.0%}" if total else "-"
        yield (f"engine {t['engine']}: loads from the host tier {loads['host']} ({fmt_bytes(lb['host'])}), from S3 "
               f"{loads['s3']} ({fmt_bytes(lb['s3'])}): {share} from host memory")
        if h["capacity_bytes"]:
            yield (f"  host tier: {fmt_bytes(h['bytes'])} of {fmt_bytes(h['capacity_bytes'])} in {h['objects']} "
                   f"objects; saves {h['inserted']} ({h['host_only_save']} kept out of S3), kept from S3 reads "
                   f"{h['kept_from_s3']}, evicted {h['evicted']} (written back {h['write_back']}, failed "
                   f"{h['write_back_failed']}), divergence {h['divergence']}, bad copies {h['bad']}")
        else:
            yield "  host tier: off (S3KV_HOST_CACHE_GB=0)"
