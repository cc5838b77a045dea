"""Operator commands: ``s3kv ls``, ``stats``, ``verify``, ``gc``.

They walk the key layout of :mod:`s3kv.core.keys` (``{prefix}/{namespace}/{group}.{shard}of{tp}/{digest}``)
through the store interface only (``list``, ``head_many``, ``get_ranges``, ``delete_many``), so they
work the same on ``s3://``, ``file://`` and ``memory://``. A namespace may sit deeper than the prefix
(``s3://b/kv`` also finds ``kv/demo-1-ab12cd/{namespace}/...``, what ``s3kv demo --url s3://b/kv`` writes);
such rows are shown with their sub-prefix (``demo-1/``). Keys under the prefix that do not fit the
layout are counted as *unrecognised* and never touched.

Every command takes ``--url`` (default: the ``S3KV_URL`` setting, from the env or the file named by
``S3KV_CONFIG_FILE``, whose timeouts and retry settings apply too) and ``--json`` (one JSON object
on stdout instead of a table). ``verify`` exits 1 when it finds a bad object or cannot read one;
objects of a format version this build does not read are *skipped* (never deleted). ``gc`` needs
at least one filter (``--older-than`` / ``--namespace``) and asks before deleting more than
``--confirm-above`` objects unless ``--yes``.

Why this is one module: ``ls``, ``stats``, ``verify`` and ``gc`` share the bucket walk, the
namespace resolution and the output helpers.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import click
import xxhash

from ..config import ConfigError, Settings, load_settings, redact_url
from ..core.cost import EXPIRY_MARGIN_S, expiry_age_s, promise_s
from ..core.keys import DIGEST_SIZE, ParsedKey, parse_key
from ..core.objects import (
    ChecksumMismatch,
    ForeignObject,
    ObjectFormatError,
    ObjectHeader,
    ObjectIdentity,
    TruncatedObject,
    UnsupportedVersion,
    decode_header,
    header_len,
    span_from_metadata,
    verify_page,
)
from ..store.base import ByteRange, NotFound, ObjectInfo, ObjectStore, StoreError
from .options import fmt_bytes
from .storeerrors import describe

SETTING = "S3KV_URL"
DELETE_BATCH = 1000
HEAD_BATCH = 256
#: verify reads an object in parts of about this many bytes (at least one page), so a huge
#: (or crafted) object never sits in memory whole.
VERIFY_READ_BYTES = 64 * 1024 * 1024
#: verify does not read pages larger than this (no real model has pages near it); such objects
#: are reported as skipped, never judged or deleted.
MAX_PAGE_BYTES = 512 * 1024 * 1024
#: gc asks before deleting more objects than this (unless --yes).
CONFIRM_ABOVE = 1000
_NS_HEX = 2 * DIGEST_SIZE


# -- plumbing ----------------------------------------------------------------------------
def _said(exc: BaseException) -> str:
    from .options import one_line

    return one_line(exc)


@dataclass
class _Ctx:
    url: str
    store: ObjectStore
    root: str  # "" or "prefix/"
    json: bool
    now: float = field(default_factory=time.time)
    #: The user's settings (list prices for the cost figures of ``stats``).
    settings: Any = None


def _open(url: str | None, as_json: bool) -> _Ctx:
    """The store behind ``--url`` (else the S3KV_URL setting), opened with the user's settings:
    ``S3KV_CONFIG_FILE`` and the env's timeouts, retries and SSE apply as in an engine."""
    from ..engine.runtime import open_runtime_store
    from ..store.factory import parse_store_url
    from .options import url_option

    url = url_option(url)
    try:
        settings = load_settings(require_url=False, url=url)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if not settings.url:
        raise click.UsageError(f"no store URL: pass --url or set {SETTING} (e.g. s3://bucket/prefix)")
    scheme, where, _ = parse_store_url(settings.url)
    if scheme == "file" and not os.path.isdir(where):
        # A typo'd path would list as an empty cache (and gc would "delete 0 objects").
        raise click.ClickException(
            f"{'--url' if url else SETTING} {settings.url}: no such directory {where}; check the path "
            "(engines create it when they first save)"
        )
    if settings.url.startswith("memory://"):
        click.echo(
            f"s3kv: warning: {redact_url(settings.url)} lives inside one process; this command starts with it empty "
            "(use file:///dir or s3:// to share a cache between processes)",
            err=True,
        )
    try:
        store, prefix = open_runtime_store(settings)
    except StoreError as exc:
        raise click.ClickException(describe(exc, settings.url)) from exc
    root = f"{prefix}/" if prefix else ""
    return _Ctx(redact_url(settings.url), store, root, as_json, settings=settings)  # ctx.url: as shown


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--url`` and ``--json``; opens the store, closes it after, turns store errors into exit 1."""

    @click.option(
        "--url",
        default=None,
        metavar="URL",
        help=f"Cache location (s3://bucket/prefix, file:///dir). Default: the {SETTING} setting.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
    @functools.wraps(fn)
    def wrapper(url: str | None, as_json: bool, **kwargs: Any) -> Any:
        ctx = _open(url, as_json)
        try:
            return fn(ctx, **kwargs)
        except StoreError as exc:
            raise click.ClickException(describe(exc, ctx.url, ctx.store)) from exc
        finally:
            ctx.store.close()

    return wrapper


def _emit(ctx: _Ctx, doc: Mapping[str, Any], text: Callable[[], Iterable[str]]) -> None:
    if ctx.json:
        click.echo(json.dumps(doc, sort_keys=False, default=str))
    else:
        for line in text():
            click.echo(line)


def _progress(ctx: _Ctx, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, unit="obj", file=sys.stderr, disable=ctx.json or not sys.stderr.isatty()
    )


def _age(ctx: _Ctx, info: ObjectInfo) -> float | None:
    if info.last_modified is None:
        return None
    return max(0.0, ctx.now - info.last_modified)


def fmt_age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


# -- walking the layout ----------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    info: ObjectInfo
    parsed: ParsedKey
    #: Where the namespace sits below the URL's prefix: "" or e.g. "demo-1712345678/".
    sub: str = ""

    @property
    def group(self) -> str:
        p = self.parsed
        return f"{p.group_fingerprint}.{p.shard}of{p.tp_size}"

    @property
    def where(self) -> str:
        """The namespace as shown: with its sub-prefix when it has one."""
        return self.sub + self.parsed.namespace


def _walk(ctx: _Ctx, namespace: str | None = None) -> Iterator[Entry | ObjectInfo]:
    """Layout entries at any depth under the prefix (or of one namespace); other keys come back
    as ObjectInfo."""
    for info in ctx.store.list(ctx.root):
        rel = info.key[len(ctx.root) :]
        parsed = parse_key(rel)
        if parsed is None or parsed.tp_size < 1 or not 0 <= parsed.shard < parsed.tp_size:
            yield info
            continue
        if namespace and parsed.namespace != namespace:
            continue
        tail = f"{parsed.namespace}/{rel.rsplit('/', 2)[1]}/{parsed.digest}"
        sub = rel[: len(rel) - len(tail)]
        yield Entry(info, parsed, sub)


def _is_ns(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return len(text) == _NS_HEX


def _resolve_ns(ctx: _Ctx, ns: str | None, *, exact: bool = False) -> str | None:
    """A full namespace from a full one or (unless ``exact``) a unique hex prefix of one."""
    if ns is None:
        return None
    ns = ns.strip().strip("/").lower()
    if _is_ns(ns):
        return ns
    if exact or not ns:
        raise click.BadParameter(
            f"{ns!r} is not a namespace ({_NS_HEX} hex digits)", param_hint="--namespace"
        )
    try:
        int(ns, 16)
    except ValueError as exc:
        raise click.BadParameter(f"{ns!r} is not hex", param_hint="--namespace") from exc
    found = sorted({e.parsed.namespace for e in _walk(ctx) if isinstance(e, Entry)})
    hits = [n for n in found if n.startswith(ns)]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise click.ClickException(f"no namespace starting with {ns!r} under {ctx.url}")
    raise click.ClickException(f"namespace prefix {ns!r} is ambiguous: {', '.join(hits)}")


@dataclass
class _Agg:
    objects: int = 0
    bytes: int = 0
    ages: list[float] = field(default_factory=list)

    def add(self, ctx: _Ctx, info: ObjectInfo) -> None:
        self.objects += 1
        self.bytes += info.size
        age = _age(ctx, info)
        if age is not None:
            self.ages.append(age)

    @property
    def oldest(self) -> float | None:
        return max(self.ages) if self.ages else None

    @property
    def newest(self) -> float | None:
        return min(self.ages) if self.ages else None

    def ls_doc(self) -> dict[str, Any]:
        return {
            "objects": self.objects,
            "bytes": self.bytes,
            "oldest_age_s": _round(self.oldest),
            "newest_age_s": _round(self.newest),
        }

    def age_doc(self) -> dict[str, float | None]:
        if not self.ages:
            return {"min": None, "median": None, "max": None}
        return {
            "min": _round(min(self.ages)),
            "median": _round(statistics.median(self.ages)),
            "max": _round(max(self.ages)),
        }


def _group_doc(group: str) -> dict[str, Any]:
    fp, shard = group.split(".", 1)
    s, tp = shard.split("of", 1)
    return {"group": group, "group_fingerprint": fp, "shard": int(s), "tp_size": int(tp)}


# -- ls --------------------------------------------------------------------------------------
def _window_of(md: Mapping[str, str] | None) -> str:
    """``w=256`` / ``full`` from an object's ``s3kv-window`` metadata; ``w=?`` when it has none."""
    raw = {k.lower(): v for k, v in (md or {}).items()}.get("s3kv-window")
    if raw is None:
        return "w=?"
    return "full" if raw.strip().lower() in ("full", "none", "") else f"w={raw.strip()}"


def _group_windows(ctx: _Ctx, first_keys: Mapping[str, str]) -> dict[str, str]:
    """Window label per group, from one HEAD of one object of each group."""
    heads = ctx.store.head_many(list(first_keys.values()))
    return {g: _window_of(heads.found[k].metadata if k in heads.found else None) for g, k in first_keys.items()}


def _windows_text(labels: Iterable[str]) -> str:
    """``full + w=256`` for a namespace: each group's window once, full attention first."""
    uniq = sorted(set(labels), key=lambda x: (x != "full", len(x), x))
    return " + ".join(uniq) if uniq else "-"


@click.command("ls")
@_common
@click.option("--namespace", "-n", default=None, help="List this namespace's groups (full or unique prefix).")
def ls_command(ctx: _Ctx, namespace: str | None) -> None:
    """Namespaces under the prefix (or one namespace's groups) with windows, objects, bytes and ages."""
    ns = _resolve_ns(ctx, namespace)
    buckets: dict[str, _Agg] = {}
    first_key: dict[str, str] = {}  # group row -> one of its keys (for its window)
    group_of_row: dict[str, set[str]] = {}  # namespace row -> its groups' rows
    other = _Agg()
    for e in _walk(ctx, ns):
        if isinstance(e, Entry):
            grow = e.sub + e.group
            name = grow if ns else e.where
            buckets.setdefault(name, _Agg()).add(ctx, e.info)
            first_key.setdefault(e.where + "/" + e.group, e.info.key)
            group_of_row.setdefault(name, set()).add(e.where + "/" + e.group)
        else:
            other.add(ctx, e)
    windows = _group_windows(ctx, first_key) if first_key else {}
    win = {row: _windows_text(windows[g] for g in groups) for row, groups in group_of_row.items()}
    total = _Agg(sum(a.objects for a in buckets.values()), sum(a.bytes for a in buckets.values()))
    if ns:
        rows_doc = [
            {**_group_doc(g.rsplit("/", 1)[-1]), "path": _sub_of(g), "window": win[g], **a.ls_doc()}
            for g, a in sorted(buckets.items())
        ]
        doc: dict[str, Any] = {"url": ctx.url, "namespace": ns, "groups": rows_doc}
        title = "GROUP"
    else:
        rows_doc = [
            {"namespace": n.rsplit("/", 1)[-1], "path": _sub_of(n), "windows": win[n], **a.ls_doc()}
            for n, a in sorted(buckets.items())
        ]
        doc = {"url": ctx.url, "namespaces": rows_doc}
        title = "NAMESPACE"
    doc["total"] = {"objects": total.objects, "bytes": total.bytes}
    doc["unrecognised"] = {"objects": other.objects, "bytes": other.bytes}

    def text() -> Iterator[str]:
        rows = [
            (name, win[name], a.objects, fmt_bytes(a.bytes), fmt_age(a.oldest), fmt_age(a.newest))
            for name, a in sorted(buckets.items())
        ]
        if not rows:
            yield f"no s3kv objects under {ctx.url}" + (f" in namespace {ns}" if ns else "")
        else:
            yield from _table((title, "WINDOW" if ns else "WINDOWS", "OBJECTS", "BYTES", "OLDEST", "NEWEST"), rows)
            yield f"total: {total.objects} objects, {fmt_bytes(total.bytes)}"
            if any(_sub_of(n) for n in buckets):
                yield f"(a name with a '/' sits below {ctx.url}: pass --url {ctx.url.rstrip('/')}/<that path> to see it alone)"
        if other.objects:
            yield f"unrecognised keys (not s3kv layout, ignored): {other.objects}, {fmt_bytes(other.bytes)}"

    _emit(ctx, doc, text)


def _lookup_costs(scraped: Mapping[str, dict[str, float] | str], gpu: Any) -> dict[str, Any]:
    """What the engines' lookups cost, summed over their metrics endpoints (``--engine``)."""
    from ..engine.metrics import figures

    keys = ("lookups", "lookup_stall_s", "lookup_unhidden_stall_s", "lookup_added_latency_s", "lookups_from_index")
    sums = dict.fromkeys(keys, 0.0)
    unreachable = {url: s for url, s in scraped.items() if isinstance(s, str)}
    for samples in scraped.values():
        if not isinstance(samples, str):
            f = figures(samples)
            for k in keys:
                sums[k] += f.get(k, 0.0)
    n = sums["lookups"]
    return {
        "engines": len(scraped) - len(unreachable),
        "lookups": n,
        "from_index_pct": 100.0 * sums["lookups_from_index"] / n if n else 0.0,
        "stall_s": sums["lookup_stall_s"],
        "unhidden_stall_s": sums["lookup_unhidden_stall_s"],
        "gpu_usd_lost": sums["lookup_unhidden_stall_s"] / 3600.0 * gpu.usd_per_hour,
        "added_latency_s": sums["lookup_added_latency_s"],
        "unreachable": unreachable,
    }


def _sub_of(row: str) -> str:
    """The sub-prefix part of a row name ("demo-1/abcd..." -> "demo-1/"; "abcd..." -> "")."""
    head, sep, _ = row.rpartition("/")
    return head + sep


# -- stats -------------------------------------------------------------------------------------
def _meta_int(md: Mapping[str, str], name: str) -> int | None:
    try:
        return int({k.lower(): v for k, v in md.items()}[name])
    except (KeyError, ValueError):
        return None


def _pages_from_size(size: int, page_bytes: int) -> int | None:
    """Pages of an object of ``size`` bytes (header_len(n) + n * page_bytes = 88 + n * (8 + page_bytes))."""
    from ..core.objects import header_len

    fixed = header_len(0)
    per = 8 + page_bytes
    if page_bytes <= 0 or size < fixed or (size - fixed) % per:
        return None
    return (size - fixed) // per


def _head_all(store: ObjectStore, keys: Sequence[str]) -> dict[str, ObjectInfo]:
    out: dict[str, ObjectInfo] = {}
    for i in range(0, len(keys), HEAD_BATCH):
        batch = store.head_many(keys[i : i + HEAD_BATCH])
        if batch.failed:
            key, err = next(iter(batch.failed.items()))
            raise err if err.key else StoreError(str(err), key=key)
        out.update(batch.found)
    return out


@click.command("stats")
@_common
@click.option("--namespace", "-n", default=None, help="Only this namespace (full or unique prefix).")
@click.option("--deep", is_flag=True, help="HEAD every object and count pages from its metadata.")
@click.option("--engine", "--metrics", "engines", multiple=True, metavar="URL",
              help="Also an engine rank's metrics endpoint (http://host:port/metrics; repeat for each engine "
              "and rank): what its host tier and S3 served, what the host tier holds, what its lookups cost "
              "(scheduler stall beyond the overlap loop, latency added to co-running requests), and the value "
              "line -- the prefill GPU $ the fleet's hits saved against the S3 $ billed, per kind of object.")
def stats_command(ctx: _Ctx, namespace: str | None, deep: bool, engines: tuple[str, ...] = ()) -> None:
    """Objects, bytes, pages and ages per namespace and per group/shard; with --engine, what the
    engines got from them.

    Pages come from object sizes and each group's page size (one HEAD per group), or with
    --deep from every object's metadata (s3kv-count). With --engine, per tier: the host tier of
    each engine rank named (from its metrics), beside the bucket.
    """
    ns = _resolve_ns(ctx, namespace)
    groups: dict[tuple[str, str], list[Entry]] = {}
    other = _Agg()
    for e in _walk(ctx, ns):
        if isinstance(e, Entry):
            groups.setdefault((e.where, e.group), []).append(e)
        else:
            other.add(ctx, e)

    ns_docs: dict[str, dict[str, Any]] = {}
    ns_aggs: dict[str, _Agg] = {}
    ns_pages: dict[str, int | None] = {}
    inconsistent = 0
    for (n, g), entries in sorted(groups.items()):
        agg = _Agg()
        for e in entries:
            agg.add(ctx, e.info)
        keys = [e.info.key for e in entries]
        asked = keys if deep else keys[:3]
        heads = _head_all(ctx.store, asked)
        page_bytes = tpb = None
        window = "w=?"
        for k in asked:  # the group's page size, from the first object whose metadata has it
            info = heads.get(k)
            page_bytes = _meta_int(info.metadata, "s3kv-page-bytes") if info else None
            if page_bytes is not None:
                tpb = _meta_int(info.metadata, "s3kv-tpb") if info else None
                window = _window_of(info.metadata if info else None)
                break
        counts: list[int | None] = []
        for e in entries:
            by_size = _pages_from_size(e.info.size, page_bytes) if page_bytes else None
            if deep:
                info = heads.get(e.info.key)
                count = _meta_int(info.metadata, "s3kv-count") if info else None
                if count is None or count != by_size:
                    inconsistent += 1
                counts.append(count if count is not None else by_size)
            else:
                counts.append(by_size)
        pages = None if any(c is None for c in counts) else sum(c for c in counts if c is not None)
        gdoc = {
            **_group_doc(g),
            "window": window,
            "objects": agg.objects,
            "bytes": agg.bytes,
            "pages": pages,
            "page_bytes": page_bytes,
            "tokens_per_block": tpb,
            "age_s": agg.age_doc(),
        }
        nd = ns_docs.setdefault(n, {"namespace": n.rsplit("/", 1)[-1], "path": _sub_of(n), "groups": []})
        nd["groups"].append(gdoc)
        na = ns_aggs.setdefault(n, _Agg())
        na.objects += agg.objects
        na.bytes += agg.bytes
        na.ages.extend(agg.ages)
        prev = ns_pages.get(n, 0)
        ns_pages[n] = None if prev is None or pages is None else prev + pages

    namespaces = []
    for n, nd in ns_docs.items():
        a = ns_aggs[n]
        namespaces.append(
            {
                "namespace": nd["namespace"],
                "path": nd["path"],
                "windows": _windows_text(gd["window"] for gd in nd["groups"]),
                "objects": a.objects,
                "bytes": a.bytes,
                "pages": ns_pages[n],
                "age_s": a.age_doc(),
                "groups": nd["groups"],
            }
        )
    total_pages: int | None = 0
    for d in namespaces:
        total_pages = None if total_pages is None or d["pages"] is None else total_pages + d["pages"]
    doc: dict[str, Any] = {
        "url": ctx.url,
        "deep": deep,
        "namespaces": namespaces,
        "total": {
            "objects": sum(d["objects"] for d in namespaces),
            "bytes": sum(d["bytes"] for d in namespaces),
            "pages": total_pages,
        },
        "unrecognised": {"objects": other.objects, "bytes": other.bytes},
    }
    # What keeping this costs at list prices (S3KV_COST_* settings), and what a stored token weighs.
    from ..core.cost import GiB, Gpu, Prices

    prices = Prices.from_settings(ctx.settings) if ctx.settings is not None else Prices()
    gpu = Gpu.from_settings(ctx.settings) if ctx.settings is not None else Gpu()
    stored_tokens = 0
    for d in namespaces:
        for gd in d["groups"]:
            if gd["pages"] is not None and gd["tokens_per_block"]:
                stored_tokens = max(stored_tokens, gd["pages"] * gd["tokens_per_block"])
    doc["cost"] = {
        "storage_usd_per_month": round(doc["total"]["bytes"] / GiB * prices.gb_month, 4),
        "gb_month_usd": prices.gb_month,
        # Bytes per token across every group, over the tokens of the group with the most pages.
        "bytes_per_token": round(doc["total"]["bytes"] / stored_tokens, 1) if stored_tokens else None,
        # The value line: keeping this much stored pays for itself when hits save at least this
        # much prefill GPU time a month (S3KV_GPU_USD_PER_HOUR). Requests come on top (s3kv bench
        # trace, docs/sizing.md).
        "gpu_usd_per_hour": gpu.usd_per_hour,
        "break_even_gpu_hours_per_month": round(doc["total"]["bytes"] / GiB * prices.gb_month / gpu.usd_per_hour, 4),
        "retention_h": prices.retention_h,
    }
    if deep:
        doc["inconsistent"] = inconsistent
    if engines:
        from .tierstats import engine_tiers, scrape

        scraped = scrape(engines)  # each endpoint read once: the three lines agree on what it said
        doc["tiers"] = engine_tiers(scraped)
        doc["lookups"] = _lookup_costs(scraped, gpu)
        margin = promise_s(ctx.settings or Settings()) + EXPIRY_MARGIN_S  # gc's margin past the retention
        doc["value"] = _value_line(scraped, prices, margin)

    def text() -> Iterator[str]:
        if not namespaces:
            yield f"no s3kv objects under {ctx.url}"
        rows: list[tuple[Any, ...]] = []
        def row(label: str, windows: Any, d: dict[str, Any]) -> tuple[Any, ...]:
            ages = d["age_s"]
            return (label, windows, d["objects"], fmt_bytes(d["bytes"]), _dash(d["pages"]),
                    fmt_age(ages["min"]), fmt_age(ages["median"]), fmt_age(ages["max"]))

        for d in namespaces:
            rows.append(row(d["path"] + d["namespace"], d["windows"], d))
            rows += [row(f"  {gd['group']}", gd["window"], gd) for gd in d["groups"]]
        if rows:
            yield from _table(
                ("NAMESPACE / GROUP", "WINDOW", "OBJECTS", "BYTES", "PAGES", "MIN AGE", "MEDIAN", "MAX AGE"),
                rows,
            )
            t = doc["total"]
            yield f"total: {t['objects']} objects, {fmt_bytes(t['bytes'])}, {_dash(t['pages'])} pages"
            c = doc["cost"]
            per_token = "" if c["bytes_per_token"] is None else f", {fmt_bytes(int(c['bytes_per_token']))} per token"
            yield (f"storage at ${c['gb_month_usd']:g}/GB-month: ${c['storage_usd_per_month']:.2f} a month"
                   f"{per_token}")
            yield (f"value: pays for itself when hits save more than {c['break_even_gpu_hours_per_month']:.2f} "
                   f"GPU-hours of prefill a month (at ${c['gpu_usd_per_hour']:g}/GPU-h; requests on top); "
                   f"retention {c['retention_h']:g} h: s3kv gc --expired")
        if "value" in doc:
            yield from _value_text(doc["value"])
        if deep and inconsistent:
            yield f"objects whose metadata and size disagree (run verify): {inconsistent}"
        if other.objects:
            yield f"unrecognised keys (not s3kv layout, ignored): {other.objects}, {fmt_bytes(other.bytes)}"
        if "tiers" in doc:
            from .tierstats import lines

            yield from lines(doc["tiers"])
        lk = doc.get("lookups")
        if lk:
            yield (f"lookups ({lk['engines']} engines): {lk['lookups']:.0f}, {lk['from_index_pct']:.0f}% from the fleet "
                   f"index; scheduler stall {lk['stall_s']:.1f} s, of it {lk['unhidden_stall_s']:.1f} s beyond the "
                   f"overlap loop (GPU time lost, ${lk['gpu_usd_lost']:.4f}); inter-token latency added to "
                   f"co-running requests {lk['added_latency_s']:.1f} request-s")
            for url, why in lk["unreachable"].items():
                yield f"  not read: {url}: {why}"

    _emit(ctx, doc, text)


def _dash(x: Any) -> str:
    return "-" if x is None else str(x)


def _value_line(scraped: Mapping[str, dict[str, float] | str], prices: Any, margin_s: float) -> dict[str, Any]:
    """The value line summed over the engines' metrics endpoints (``s3kv.engine.metrics.value_line``),
    with the retention gc learns from their dated reads (``s3kv.core.retention``; ``margin_s``: what
    gc keeps beyond it); an endpoint that does not answer is named, not fatal."""
    from ..core.retention import learn_retention
    from ..engine.metrics import value_line

    samples: dict[str, float] = {}
    unreachable = [f"{url}: {s}" for url, s in scraped.items() if isinstance(s, str)]
    for one in scraped.values():
        if not isinstance(one, str):
            for k, v in one.items():
                samples[k] = samples.get(k, 0.0) + v
    out = value_line(samples, prices.get_per_1k)
    lag = out.pop("lag_reads")
    cap = prices.retention_h * 3600
    out["retention_learnt"] = {"retention_s": learn_retention(lag, margin_s=margin_s, cap_s=cap),
                               "ceiling_s": cap, "reads_dated": sum(lag)}
    out["endpoints"] = len(scraped) - len(unreachable)
    out["unreachable"] = unreachable
    return out


def _value_text(v: Mapping[str, Any]) -> Iterator[str]:
    from ..core.value import KINDS

    yield ""
    yield f"value the fleet got (metrics of {v['endpoints']} endpoint(s); S3 $ as billed, GPU $ of the tokens hits served):"
    order = [k for k in (*KINDS, "lookup") if k in v["kinds"]] + sorted(set(v["kinds"]) - {*KINDS, "lookup"})
    rows = []
    for k in order:
        r = v["kinds"][k]
        ratio = f"{r['s3_usd'] / r['gpu_usd']:.3f}" if r["gpu_usd"] > 0 else "-"
        rows.append((k, int(r["objects"]), int(r["reads"]), f"{r['tokens'] / 1e6:.2f}M", f"${r['s3_usd']:.4f}",
                     f"${r['gpu_usd']:.4f}", ratio))
    yield from _table(("KIND", "OBJECTS", "HITS", "TOKENS", "S3 $", "GPU $ SAVED", "RATIO"), rows)
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
    yield (f"total: S3 ${v['s3_usd']:.4f} for ${v['gpu_usd']:.4f} of prefill saved: ratio {ratio} (below 1: s3kv "
           "pays; a chain object's value is in the hits of the tails it serves)")
    from .options import retention_line

    yield retention_line(v["retention_learnt"])
    for u in v["unreachable"]:
        yield f"unreachable: {u}"


# -- verify ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    key: str
    status: str  # ok | bad | skipped | error | vanished
    reason: str = ""
    detail: str = ""
    pages: int = 0


def identity_from(parsed: ParsedKey, metadata: Mapping[str, str], key: str) -> ObjectIdentity:
    """The identity an object must have: namespace/group/shard from its key, sizes from its metadata."""
    tpb = _meta_int(metadata, "s3kv-tpb")
    page_bytes = _meta_int(metadata, "s3kv-page-bytes")
    if tpb is None or page_bytes is None:
        raise ForeignObject("object has no s3kv metadata (s3kv-tpb / s3kv-page-bytes)", key)
    return ObjectIdentity(
        bytes.fromhex(parsed.namespace),
        parsed.group_fingerprint,
        parsed.shard,
        parsed.tp_size,
        tpb,
        page_bytes,
    )


class _TooLarge(ObjectFormatError):
    reason = "page_too_large"


def _verify_streamed(store: ObjectStore, parsed: ParsedKey, info: ObjectInfo) -> int:
    """Every check a loader would make, with the expected identity rebuilt from key + metadata,
    without holding the object: sizes from the HEAD first, then the header, then the pages in
    parts of about VERIFY_READ_BYTES. Returns the page count; raises a named
    :class:`ObjectFormatError` for a bad object."""
    key = info.key
    identity = identity_from(parsed, info.metadata, key)
    # The HEAD's size must be what the metadata's page count implies before a byte is read.
    span = span_from_metadata(identity, info.metadata, info.size, key)
    if identity.page_bytes > MAX_PAGE_BYTES:
        raise _TooLarge(f"pages of {identity.page_bytes} bytes are past verify's limit of {MAX_PAGE_BYTES}", key)
    hlen = header_len(span.count)
    head = store.get_ranges(key, [ByteRange(0, hlen)])[0]
    header = decode_header(head, identity, key)
    if (header.first_ordinal, header.page_count) != (span.first, span.count):
        raise ForeignObject(
            f"header holds ordinals {header.first_ordinal}+{header.page_count}, metadata says "
            f"{span.first}+{span.count}",
            key,
        )
    if header.last_digest.hex() != parsed.digest:
        raise ForeignObject("header chain digest differs from the key's (object stored under the wrong key)", key)
    if header.total_len != info.size:
        raise TruncatedObject(f"object is {info.size} bytes, header says {header.total_len}", key)
    pb = identity.page_bytes
    if pb > VERIFY_READ_BYTES:
        for i in range(header.page_count):
            _verify_large_page(store, header, i, key)
        return header.page_count
    per_read = VERIFY_READ_BYTES // max(1, pb)
    for first in range(0, header.page_count, per_read):
        idx = range(first, min(header.page_count, first + per_read))
        pages = store.get_ranges(key, [ByteRange(header.page_offset(i), pb) for i in idx])
        for i, page in zip(idx, pages, strict=True):
            verify_page(header, i, page, key)
    return header.page_count


def _verify_large_page(store: ObjectStore, header: ObjectHeader, i: int, key: str) -> None:
    """``verify_page`` of a page larger than VERIFY_READ_BYTES, its checksum streamed over parts
    of at most that size. Why: read whole, one crafted object with a 512 MiB page (the most
    MAX_PAGE_BYTES lets through) held 545 MiB, and four at ``-j 4`` 1.7 GiB."""
    pb = header.identity.page_bytes
    digest = xxhash.xxh3_64()  # streamed, the same value as page_checksum over the whole page
    start = header.page_offset(i)
    for off in range(0, pb, VERIFY_READ_BYTES):
        n = min(VERIFY_READ_BYTES, pb - off)
        part = store.get_ranges(key, [ByteRange(start + off, n)])[0]
        if len(part) != n:
            raise TruncatedObject(f"page {i}: read {len(part)} of {n} bytes at offset {off}", key)
        digest.update(part)
        del part  # before the next part is read: one part per job in memory
    if digest.intdigest() != header.checksums[i]:
        raise ChecksumMismatch(f"checksum mismatch on page {i} (ordinal {header.first_ordinal + i})", key)


def _verify_one(store: ObjectStore, e: Entry) -> Verdict:
    key = e.info.key
    try:
        info = store.head(key)
        if info is None:
            return Verdict(key, "vanished")
        pages = _verify_streamed(store, e.parsed, info)
    except NotFound:
        return Verdict(key, "vanished")
    except (UnsupportedVersion, _TooLarge) as exc:
        # Written by another s3kv version (or not plausibly by any): not ours to judge, and never
        # ours to delete.
        return Verdict(key, "skipped", exc.reason, _without_key(str(exc), key))
    except ObjectFormatError as exc:
        return Verdict(key, "bad", exc.reason, _without_key(str(exc), key))
    except StoreError as exc:
        return Verdict(key, "error", type(exc).__name__, _without_key(str(exc), key))
    return Verdict(key, "ok", pages=pages)


def _without_key(message: str, key: str) -> str:
    suffix = f" (object {key!r})"
    return message[: -len(suffix)] if message.endswith(suffix) else message


def _sampled(digest: str, fraction: float) -> bool:
    return int(digest[:8], 16) < fraction * 0x1_0000_0000


@click.command("verify")
@_common
@click.option("--namespace", "-n", default=None, help="Only this namespace (full or unique prefix).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Check at most this many objects.")
@click.option(
    "--sample",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True),
    default=None,
    help="Check this fraction of objects (chosen by key digest, so repeatable).",
)
@click.option(
    "--jobs", "-j", type=click.IntRange(min=1), default=8, show_default=True, help="Parallel downloads."
)
@click.option(
    "--delete-bad",
    is_flag=True,
    help="Delete objects found bad (never ones that could not be read, nor ones of another format version).",
)
def verify_command(
    ctx: _Ctx, namespace: str | None, limit: int | None, sample: float | None, jobs: int, delete_bad: bool
) -> None:
    """Read objects and check header, identity (against key and metadata) and every page checksum.

    Sizes are checked against the metadata before any read, and objects are read in parts, so a
    huge object never sits in memory whole. Objects of a format version this build does not read
    are reported as skipped and never deleted. Exit code 1 if any object is bad or unreadable.
    """
    ns = _resolve_ns(ctx, namespace)
    entries: list[Entry] = []
    unrecognised = 0
    for e in _walk(ctx, ns):
        if not isinstance(e, Entry):
            unrecognised += 1
        elif sample is None or _sampled(e.parsed.digest, sample):
            entries.append(e)
    entries.sort(key=lambda e: e.info.key)
    if limit is not None:
        entries = entries[:limit]

    verdicts: list[Verdict] = []
    with _progress(ctx, len(entries), "verify") as bar, ThreadPoolExecutor(max_workers=jobs) as pool:
        for v in pool.map(lambda e: _verify_one(ctx.store, e), entries):
            verdicts.append(v)
            bar.update(1)
    bad = [v for v in verdicts if v.status == "bad"]
    errors = [v for v in verdicts if v.status == "error"]
    skipped = [v for v in verdicts if v.status == "skipped"]
    by_reason: dict[str, int] = {}
    for v in bad:
        by_reason[v.reason] = by_reason.get(v.reason, 0) + 1
    deleted = 0
    if delete_bad and bad:
        keys = [v.key for v in bad]
        for i in range(0, len(keys), DELETE_BATCH):
            ctx.store.delete_many(keys[i : i + DELETE_BATCH])
            deleted += len(keys[i : i + DELETE_BATCH])
    ok = [v for v in verdicts if v.status == "ok"]
    doc = {
        "url": ctx.url,
        "namespace": ns,
        "checked": len(verdicts),
        "ok": len(ok),
        "pages_ok": sum(v.pages for v in ok),
        "bad_count": len(bad),
        "bad": [{"key": v.key, "reason": v.reason, "detail": v.detail} for v in bad],
        "bad_by_reason": by_reason,
        "errors": [{"key": v.key, "error": v.reason, "detail": v.detail} for v in errors],
        "skipped": [{"key": v.key, "reason": v.reason, "detail": v.detail} for v in skipped],
        "vanished": sum(v.status == "vanished" for v in verdicts),
        "unrecognised": unrecognised,
        "deleted": deleted,
    }

    def text() -> Iterator[str]:
        if bad:
            yield f"{len(bad)} bad objects:"
            for v in bad:
                yield f"  {v.key}"
                yield f"    {v.reason}: {v.detail}"
        for v in errors:
            yield f"could not read {v.key}: {v.reason}: {v.detail}"
        for v in skipped:
            yield f"skipped {v.key}: {v.detail}"
        summary = f"checked {len(verdicts)} objects: {len(ok)} ok, {len(bad)} bad"
        if by_reason:
            summary += " (" + ", ".join(f"{r}: {n}" for r, n in sorted(by_reason.items())) + ")"
        if errors:
            summary += f", {len(errors)} unreadable"
        if skipped:
            summary += f", {len(skipped)} skipped (another format version; not checked, not deleted)"
        if doc["vanished"]:
            summary += f", {doc['vanished']} vanished while checking"
        yield summary
        if delete_bad:
            yield f"deleted {deleted} bad objects"
        if unrecognised:
            yield f"unrecognised keys (not s3kv layout, not checked): {unrecognised}"

    _emit(ctx, doc, text)
    if bad or errors:
        raise SystemExit(1)


# -- gc ----------------------------------------------------------------------------------------
class Duration(click.ParamType):
    """An age: ``90s``, ``30m``, ``1h``, ``2d``, or a bare number of days; in seconds."""

    name = "duration"
    UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, float):
            return value
        text = str(value).strip().lower()
        scale = self.UNITS.get(text[-1:]) if text else None
        try:
            n = float(text[:-1] if scale else text)
        except ValueError:
            n = float("nan")
        if not n >= 0 or n == float("inf"):
            self.fail(f"{value!r} is not an age: use e.g. 90s, 30m, 1h, 2d (a bare number is days)", param, ctx)
        return n * (scale or 86400.0)


@click.command("gc")
@_common
@click.option(
    "--older-than",
    "older_than",
    type=Duration(),
    default=None,
    metavar="AGE",
    help="Delete objects last modified more than AGE ago: 90s, 30m, 1h, 2d, or a bare number of days (0: any age).",
)
@click.option(
    "--expired",
    is_flag=True,
    help="Delete objects older than the retention_h setting (S3KV_RETENTION_H, default 1 h) plus how long "
    "an engine may still trust an earlier answer (index_ttl_s + lookup_summary_trust_s + 60 s). Engines "
    "refresh the objects they load (refresh_on_hit).",
)
@click.option(
    "--watch",
    type=Duration(),
    default=None,
    metavar="EVERY",
    help="Run again every EVERY (e.g. 10m) until stopped, deleting without asking: s3kv's own expiry, "
    "finer than S3 lifecycle rules (whole days). One JSON line / summary per pass.",
)
@click.option(
    "--index",
    "index_every",
    type=Duration(),
    default=None,
    metavar="EVERY",
    help="Also publish each namespace's fleet index, the one object engines poll instead of listing "
    "(docs/operations.md#the-fleet-index): every EVERY (e.g. 10s) with --watch, once after the pass without.",
)
@click.option("--now", "now", type=float, default=None, hidden=True,
              help="The store's clock for tests (POSIX seconds): replaces reading it, no skew check.")
@click.option("--namespace", "-n", default=None, help="Delete only this namespace (the full 32 hex digits).")
@click.option(
    "--include-sub-prefixes",
    "sub_prefixes",
    is_flag=True,
    help="Also delete under sub-prefixes of the URL that hold namespaces of their own (another "
    "deployment's URL such as s3://b/kv/teamB below s3://b/kv, the demo's runs). Without it gc stays in "
    "this URL's own namespaces and says what it left.",
)
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking, however many objects match.")
@click.option(
    "--confirm-above",
    type=click.IntRange(min=0),
    default=CONFIRM_ABOVE,
    show_default=True,
    help="Ask before deleting more objects than this (unless --yes).",
)
@click.option("--verbose", "-v", is_flag=True, help="Also list every key (table) / add 'keys' (JSON).")
def gc_command(
    ctx: _Ctx,
    older_than: float | None,
    expired: bool,
    watch: float | None,
    index_every: float | None,
    now: float | None,
    namespace: str | None,
    sub_prefixes: bool,
    dry_run: bool,
    yes: bool,
    confirm_above: int,
    verbose: bool,
) -> None:
    """Delete s3kv objects by age and/or namespace (at least one filter is required).

    Only keys in the s3kv layout are considered; anything else under the prefix is left alone,
    and so are namespaces under a sub-prefix (another deployment's URL) unless
    ``--include-sub-prefixes``. Ages are seconds since LastModified by the store's own clock (the
    Date of a request gc makes), which a loading engine bumps (refresh on hit), so ``--expired``
    keeps hot prefixes and drops what nobody read within the retention. gc refuses to run by age
    when this host's clock is off the store's by more than its safety margin (60 s).
    """
    if expired:
        if older_than is not None:
            raise click.UsageError("--expired and --older-than both set an age: pass one")
        older_than = expiry_age_s(ctx.settings)
    if older_than is None and namespace is None:
        raise click.UsageError("gc needs a filter: --expired, --older-than AGE and/or --namespace NS")
    learn = None
    if expired and index_every is not None and ctx.settings is not None and ctx.settings.retention_auto:
        cap = ctx.settings.retention_h * 3600.0
        learn = (cap, older_than - cap)  # older_than: expiry_age_s, the ceiling plus gc's margin
    publish, pub = _index_hook(ctx, index_every, namespace, now, sub_prefixes, learn)
    if publish is not None and learn is not None:
        publish()  # learn before the first pass, so it deletes by what the reports say
    if watch is not None:
        if watch <= 0:
            raise click.BadParameter("must be > 0", param_hint="--watch")
        while True:
            try:
                _gc_clock(ctx, now, older_than, None if dry_run else pub)
                _gc_pass(ctx, older_than, namespace, sub_prefixes, dry_run, True, confirm_above, verbose, pub)
            except (StoreError, SystemExit, click.ClickException) as exc:  # the next pass tries again
                click.echo(f"s3kv gc: pass failed: {exc}", err=True)
            _wait_publishing(watch, index_every, publish)
    _gc_clock(ctx, now, older_than, None if dry_run else pub)
    _gc_pass(ctx, older_than, namespace, sub_prefixes, dry_run, yes, confirm_above, verbose, pub)
    if publish is not None:
        publish()


def _gc_clock(ctx: _Ctx, now: float | None, older_than: float | None, pub: Any = None) -> None:
    """``ctx.now`` for gc's ages: the store's own clock, read from a request's answer.

    Why not this host's: LastModified is the store's stamp, so an age against the host's clock is
    off by their skew -- at +4,400 s a fresh object read as over an hour old and ``--older-than 1h``
    deleted it (issue 37). The margin gc keeps for skew (``EXPIRY_MARGIN_S``, in ``--expired``) is
    also what it tolerates here: past it, the host's clock is wrong enough to be fixed first (the
    engines on it judge their own ages by it too), so gc refuses by age, in one line.

    ``pub``: the fleet index's publisher, told the skew once it is checked (it deletes what its
    own passes find expired by the store's clock, ``s3kv.engine.fleetindex``) and nothing until
    then; None (no publisher, a dry run): nothing to tell."""
    if pub is not None:
        pub.vouch(None)
    if now is not None or not older_than:  # a test's clock; or no ages (by namespace alone, any age)
        ctx.now = time.time() if now is None else now
        if pub is not None and now is not None:  # the test's clock is the store's
            pub.vouch(0.0)
        return
    before = time.time()
    store_now = ctx.store.store_time()  # a store error: the one line every command words alike
    skew = (before + time.time()) / 2 - store_now
    if abs(skew) > EXPIRY_MARGIN_S:
        raise click.ClickException(
            f"not collecting by age: this host's clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} "
            f"the store's ({ctx.url}), more than gc's {EXPIRY_MARGIN_S:g} s safety margin; set this host's time "
            "(NTP) and run again"
        )
    ctx.now = store_now
    if pub is not None:
        pub.vouch(-skew)


def _gc_pass(
    ctx: _Ctx,
    older_than: float | None,
    namespace: str | None,
    sub_prefixes: bool,
    dry_run: bool,
    yes: bool,
    confirm_above: int,
    verbose: bool,
    pub: Any = None,
) -> None:
    ns = _resolve_ns(ctx, namespace, exact=True)
    cutoff = older_than if older_than else None  # --older-than 0: everything
    learnt = _learnt_cutoffs(ctx, pub, older_than)

    victims: list[Entry] = []
    # Matching objects under a sub-prefix: another deployment's (``s3://b/kv/teamB`` seen from
    # ``s3://b/kv`` -- its own gc, its own retention), never this one's to delete unless told.
    left: dict[str, _Agg] = {}
    for e in _walk(ctx, ns):
        if not isinstance(e, Entry):
            continue
        if cutoff is not None:
            age = _age(ctx, e.info)
            if age is None or age < learnt(e, cutoff):
                continue
        if e.sub and not sub_prefixes:
            a = left.setdefault(e.sub, _Agg())
            a.objects += 1
            a.bytes += e.info.size
            continue
        victims.append(e)
    by_ns: dict[str, _Agg] = {}
    for e in victims:
        a = by_ns.setdefault(e.parsed.namespace, _Agg())
        a.objects += 1
        a.bytes += e.info.size
    matched = _Agg(len(victims), sum(e.info.size for e in victims))

    if not dry_run and not yes and len(victims) > confirm_above:
        _confirm_delete(ctx, matched)
    deleted = _Agg()
    failure: StoreError | None = None
    if not dry_run and victims:
        with _progress(ctx, len(victims), "gc") as bar:
            for i in range(0, len(victims), DELETE_BATCH):
                batch = victims[i : i + DELETE_BATCH]
                try:
                    ctx.store.delete_many([e.info.key for e in batch])
                except StoreError as exc:
                    failure = exc
                    break
                deleted.objects += len(batch)
                deleted.bytes += sum(e.info.size for e in batch)
                bar.update(len(batch))

    doc: dict[str, Any] = {
        "url": ctx.url,
        "dry_run": dry_run,
        "namespace": ns,
        "older_than_s": older_than,
        "matched": {"objects": matched.objects, "bytes": matched.bytes},
        "deleted": {"objects": deleted.objects, "bytes": deleted.bytes},
        "by_namespace": {n: {"objects": a.objects, "bytes": a.bytes} for n, a in sorted(by_ns.items())},
    }
    if pub is not None and pub.expire_skew_s is not None:
        doc["deleted_in_index_passes"] = {"objects": pub.expired_total[0], "bytes": pub.expired_total[1]}
    if left:
        doc["left_in_sub_prefixes"] = {s: {"objects": a.objects, "bytes": a.bytes} for s, a in sorted(left.items())}
    if failure is not None:
        doc["error"] = _said(failure)
    if verbose:
        doc["keys"] = [e.info.key for e in victims]

    def text() -> Iterator[str]:
        if verbose:
            for e in victims:
                yield e.info.key
        if by_ns:
            yield from _table(
                ("NAMESPACE", "OBJECTS", "BYTES"),
                [(n, a.objects, fmt_bytes(a.bytes)) for n, a in sorted(by_ns.items())],
            )
        verb = "would delete" if dry_run else "deleted"
        shown = matched if dry_run else deleted
        yield f"{verb} {shown.objects} objects, {fmt_bytes(shown.bytes)}" + (" (dry run)" if dry_run else "")
        if "deleted_in_index_passes" in doc:
            n, b = pub.expired_total
            yield f"the fleet index's passes deleted {n} expired objects, {fmt_bytes(b)}, since gc started"
        if left:
            n = sum(a.objects for a in left.values())
            yield (f"left {n} matching objects under {len(left)} sub-prefix(es) holding namespaces of their own "
                   f"({', '.join(sorted(left))}): another deployment's; gc its own URL, or pass --include-sub-prefixes")
        if failure is not None:
            yield f"stopped after an error: {_said(failure)}"

    _emit(ctx, doc, text)
    if failure is not None:
        raise SystemExit(1)


def _learnt_cutoffs(ctx: _Ctx, pub: Any, older_than: float | None) -> Callable[[Entry, float], float]:
    """The age past which gc deletes an object: where its namespace's publisher learns the
    retention (``s3kv.core.retention``), the one it keeps that object for (by its last write or
    refresh: the longest an engine may have believed) plus gc's margin there -- which may exceed
    ``cutoff``, gc's own settings' (an engine reporting a longer belief: ``Publisher.margin_s``);
    else ``cutoff``."""
    if pub is None or not pub.retention or not older_than:
        return lambda e, cutoff: cutoff

    def age(e: Entry, cutoff: float) -> float:
        nsp = e.info.key[: e.info.key.index(e.parsed.namespace) + len(e.parsed.namespace) + 1]
        learnt = pub.cutoff_s(nsp, e.info.last_modified)
        return cutoff if learnt is None else learnt

    return age


def _index_hook(
    ctx: _Ctx, every: float | None, namespace: str | None, now: float | None, sub_prefixes: bool,
    learn: tuple[float, float] | None = None,
) -> tuple[Callable[[], None] | None, Any]:
    """What ``--index`` runs: one fleet index publishing pass (``s3kv.engine.fleetindex``), signed
    with the integrity key of gc's settings, over the namespaces gc keeps to (its URL's own unless
    ``--include-sub-prefixes``); a failure is one line on stderr, retried next time. With
    ``learn`` (ceiling s, margin s) the publisher learns the retention too. Also the publisher."""
    if every is None:
        return None, None
    if every <= 0:
        raise click.BadParameter("must be > 0", param_hint="--index")
    from ..engine.fleetindex import Publisher

    ns = _resolve_ns(ctx, namespace, exact=True)
    pub = Publisher(ctx.store, ctx.root, integrity=ctx.settings.integrity if ctx.settings else None, every_s=every,
                    namespaces=[f"{ctx.root}{ns}/"] if ns else (),  # named: an index even while it is empty
                    sub_prefixes=sub_prefixes, learn=learn,
                    engine_poll_s=ctx.settings.fleet_index_s if ctx.settings else 5.0)

    def publish() -> None:
        try:
            rep = pub.publish(now, ns)
        except StoreError as exc:
            click.echo(f"s3kv gc: fleet index not published: {exc}", err=True)
            return
        for where, why in rep.errors.items():
            click.echo(f"s3kv gc: fleet index of {where} not published: {why}", err=True)

    return publish, pub


def _wait_publishing(seconds: float, every: float | None, publish: Callable[[], None] | None) -> None:
    """Sleep ``seconds``, publishing the fleet index every ``every`` meanwhile."""
    if publish is None or every is None:
        time.sleep(seconds)
        return
    until = time.monotonic() + seconds
    while True:
        t0 = time.monotonic()
        publish()
        left = until - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, max(0.0, every - (time.monotonic() - t0))))


def _confirm_delete(ctx: _Ctx, matched: _Agg) -> None:
    what = f"{matched.objects} objects ({fmt_bytes(matched.bytes)}) under {ctx.url}"
    refuse = click.ClickException(
        f"not deleting {what} without confirmation: pass --yes, or look first with --dry-run"
    )
    if ctx.json:
        raise refuse  # a script reading JSON cannot answer a prompt
    try:
        ok = click.confirm(f"Delete {what}?", default=False, err=True)
    except click.Abort:  # no terminal / end of input
        raise refuse from None
    if not ok:
        raise refuse


def ops_commands() -> dict[str, click.Command]:
    return {"ls": ls_command, "stats": stats_command, "verify": verify_command, "gc": gc_command}
