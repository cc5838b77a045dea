"""Operator commands: ``s3kv ls``, ``stats``, ``verify``, ``gc``.

They walk the key layout of :mod:`s3kv.keys` (``{prefix}/{namespace}/{group}.{shard}of{tp}/{digest}``)
through the store interface only (``list``, ``head_many``, ``get_ranges``, ``delete_many``), so they
work the same on ``s3://``, ``file://`` and ``memory://``. Keys under the prefix that do not fit the
layout are counted as *unrecognised* and never touched.

Every command takes ``--url`` (default: the ``S3KV_URL`` env var) and ``--json`` (one JSON object
on stdout instead of a table). ``verify`` exits 1 when it finds a bad object or cannot read one;
``gc`` needs at least one filter (``--older-than`` / ``--namespace``).
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

from .keys import DIGEST_SIZE, ParsedKey, parse_key
from .objects import (
    ForeignObject,
    ObjectFormatError,
    ObjectIdentity,
    decode_object,
    span_from_metadata,
)
from .store.base import ByteRange, NotFound, ObjectInfo, ObjectStore, StoreError
from .store.factory import SETTING, open_store, parse_store_url

DELETE_BATCH = 1000
HEAD_BATCH = 256
_NS_HEX = 2 * DIGEST_SIZE


# -- plumbing ----------------------------------------------------------------------------
@dataclass
class _Ctx:
    url: str
    store: ObjectStore
    root: str  # "" or "prefix/"
    json: bool
    now: float = field(default_factory=time.time)


def _open(url: str | None, as_json: bool) -> _Ctx:
    url = url or os.environ.get(SETTING, "")
    if not url.strip():
        raise click.UsageError(f"no store URL: pass --url or set {SETTING} (e.g. s3://bucket/prefix)")
    try:
        parsed = parse_store_url(url)
        store = open_store(url)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    root = f"{parsed.prefix}/" if parsed.prefix else ""
    return _Ctx(url, store, root, as_json)


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--url`` and ``--json``; opens the store, closes it after, turns store errors into exit 1."""

    @click.option(
        "--url",
        default=None,
        metavar="URL",
        help=f"Cache location (s3://bucket/prefix, file:///dir, memory://name). Default: ${SETTING}.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
    @functools.wraps(fn)
    def wrapper(url: str | None, as_json: bool, **kwargs: Any) -> Any:
        ctx = _open(url, as_json)
        try:
            return fn(ctx, **kwargs)
        except StoreError as exc:
            raise click.ClickException(f"store error on {ctx.url}: {type(exc).__name__}: {exc}") from exc
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


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


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

    @property
    def group(self) -> str:
        p = self.parsed
        return f"{p.group_fingerprint}.{p.shard}of{p.tp_size}"


def _walk(ctx: _Ctx, namespace: str | None = None) -> Iterator[Entry | ObjectInfo]:
    """Layout entries under the prefix (or one namespace); non-layout keys come back as ObjectInfo."""
    base = ctx.root + (f"{namespace}/" if namespace else "")
    for info in ctx.store.list(base):
        rel = info.key[len(ctx.root) :]
        parsed = parse_key(rel) if rel.count("/") == 2 else None
        if parsed is None or parsed.tp_size < 1 or not 0 <= parsed.shard < parsed.tp_size:
            yield info
        else:
            yield Entry(info, parsed)


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
@click.command("ls")
@_common
@click.option("--namespace", "-n", default=None, help="List this namespace's groups (full or unique prefix).")
def ls_command(ctx: _Ctx, namespace: str | None) -> None:
    """Namespaces under the prefix (or one namespace's groups) with object counts, bytes and ages."""
    ns = _resolve_ns(ctx, namespace)
    buckets: dict[str, _Agg] = {}
    other = _Agg()
    for e in _walk(ctx, ns):
        if isinstance(e, Entry):
            name = e.group if ns else e.parsed.namespace
            buckets.setdefault(name, _Agg()).add(ctx, e.info)
        else:
            other.add(ctx, e)
    total = _Agg(sum(a.objects for a in buckets.values()), sum(a.bytes for a in buckets.values()))
    if ns:
        rows_doc = [{**_group_doc(g), **a.ls_doc()} for g, a in sorted(buckets.items())]
        doc: dict[str, Any] = {"url": ctx.url, "namespace": ns, "groups": rows_doc}
        title = "GROUP"
    else:
        rows_doc = [{"namespace": n, **a.ls_doc()} for n, a in sorted(buckets.items())]
        doc = {"url": ctx.url, "namespaces": rows_doc}
        title = "NAMESPACE"
    doc["total"] = {"objects": total.objects, "bytes": total.bytes}
    doc["unrecognised"] = {"objects": other.objects, "bytes": other.bytes}

    def text() -> Iterator[str]:
        rows = [
            (name, a.objects, fmt_bytes(a.bytes), fmt_age(a.oldest), fmt_age(a.newest))
            for name, a in sorted(buckets.items())
        ]
        if not rows:
            yield f"no s3kv objects under {ctx.url}" + (f" in namespace {ns}" if ns else "")
        else:
            yield from _table((title, "OBJECTS", "BYTES", "OLDEST", "NEWEST"), rows)
            yield f"total: {total.objects} objects, {fmt_bytes(total.bytes)}"
        if other.objects:
            yield f"unrecognised keys (not s3kv layout, ignored): {other.objects}, {fmt_bytes(other.bytes)}"

    _emit(ctx, doc, text)


# -- stats -------------------------------------------------------------------------------------
def _meta_int(md: Mapping[str, str], name: str) -> int | None:
    try:
        return int({k.lower(): v for k, v in md.items()}[name])
    except (KeyError, ValueError):
        return None


def _pages_from_size(size: int, page_bytes: int) -> int | None:
    """Pages of an object of ``size`` bytes (header_len(n) + n * page_bytes = 88 + n * (8 + page_bytes))."""
    from .objects import header_len

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
def stats_command(ctx: _Ctx, namespace: str | None, deep: bool) -> None:
    """Objects, bytes, pages and ages per namespace and per group/shard.

    Pages come from object sizes and each group's page size (one HEAD per group), or with
    --deep from every object's metadata (s3kv-count).
    """
    ns = _resolve_ns(ctx, namespace)
    groups: dict[tuple[str, str], list[Entry]] = {}
    other = _Agg()
    for e in _walk(ctx, ns):
        if isinstance(e, Entry):
            groups.setdefault((e.parsed.namespace, e.group), []).append(e)
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
        for k in asked:  # the group's page size, from the first object whose metadata has it
            info = heads.get(k)
            page_bytes = _meta_int(info.metadata, "s3kv-page-bytes") if info else None
            if page_bytes is not None:
                tpb = _meta_int(info.metadata, "s3kv-tpb") if info else None
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
            "objects": agg.objects,
            "bytes": agg.bytes,
            "pages": pages,
            "page_bytes": page_bytes,
            "tokens_per_block": tpb,
            "age_s": agg.age_doc(),
        }
        nd = ns_docs.setdefault(n, {"namespace": n, "groups": []})
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
                "namespace": n,
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
    if deep:
        doc["inconsistent"] = inconsistent

    def text() -> Iterator[str]:
        if not namespaces:
            yield f"no s3kv objects under {ctx.url}"
        rows: list[tuple[Any, ...]] = []
        for d in namespaces:
            ages = d["age_s"]
            rows.append(
                (
                    d["namespace"],
                    d["objects"],
                    fmt_bytes(d["bytes"]),
                    _dash(d["pages"]),
                    fmt_age(ages["min"]),
                    fmt_age(ages["median"]),
                    fmt_age(ages["max"]),
                )
            )
            for gd in d["groups"]:
                ages = gd["age_s"]
                rows.append(
                    (
                        f"  {gd['group']}",
                        gd["objects"],
                        fmt_bytes(gd["bytes"]),
                        _dash(gd["pages"]),
                        fmt_age(ages["min"]),
                        fmt_age(ages["median"]),
                        fmt_age(ages["max"]),
                    )
                )
        if rows:
            yield from _table(
                ("NAMESPACE / GROUP", "OBJECTS", "BYTES", "PAGES", "MIN AGE", "MEDIAN", "MAX AGE"), rows
            )
            t = doc["total"]
            yield f"total: {t['objects']} objects, {fmt_bytes(t['bytes'])}, {_dash(t['pages'])} pages"
        if deep and inconsistent:
            yield f"objects whose metadata and size disagree (run verify): {inconsistent}"
        if other.objects:
            yield f"unrecognised keys (not s3kv layout, ignored): {other.objects}, {fmt_bytes(other.bytes)}"

    _emit(ctx, doc, text)


def _dash(x: Any) -> str:
    return "-" if x is None else str(x)


# -- verify ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    key: str
    status: str  # ok | bad | error | vanished
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


def check_object(parsed: ParsedKey, info: ObjectInfo, data: bytes) -> int:
    """Every check a loader would make, with the expected identity rebuilt from key + metadata.

    Returns the page count; raises a named :class:`ObjectFormatError` for a bad object.
    """
    key = info.key
    identity = identity_from(parsed, info.metadata, key)
    span = span_from_metadata(identity, info.metadata, info.size, key)
    header, pages = decode_object(data, identity, key)
    if (header.first_ordinal, header.page_count) != (span.first, span.count):
        raise ForeignObject(
            f"header holds ordinals {header.first_ordinal}+{header.page_count}, metadata says "
            f"{span.first}+{span.count}",
            key,
        )
    if header.last_digest.hex() != parsed.digest:
        raise ForeignObject(
            "header chain digest differs from the key's (object stored under the wrong key)", key
        )
    return len(pages)


def _verify_one(store: ObjectStore, e: Entry) -> Verdict:
    key = e.info.key
    try:
        info = store.head(key)
        if info is None:
            return Verdict(key, "vanished")
        data = store.get_ranges(key, [ByteRange(0, info.size)])[0] if info.size else b""
        pages = check_object(e.parsed, info, data)
    except NotFound:
        return Verdict(key, "vanished")
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
    "--delete-bad", is_flag=True, help="Delete objects found bad (never ones that could not be read)."
)
def verify_command(
    ctx: _Ctx, namespace: str | None, limit: int | None, sample: float | None, jobs: int, delete_bad: bool
) -> None:
    """Download objects and check header, identity (against key and metadata) and every page checksum.

    Exit code 1 if any object is bad or could not be read.
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
        summary = f"checked {len(verdicts)} objects: {len(ok)} ok, {len(bad)} bad"
        if by_reason:
            summary += " (" + ", ".join(f"{r}: {n}" for r, n in sorted(by_reason.items())) + ")"
        if errors:
            summary += f", {len(errors)} unreadable"
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
@click.command("gc")
@_common
@click.option(
    "--older-than",
    "older_than",
    type=click.FloatRange(min=0.0),
    default=None,
    metavar="DAYS",
    help="Delete objects last modified more than DAYS ago (0: any age).",
)
@click.option("--namespace", "-n", default=None, help="Delete only this namespace (the full 32 hex digits).")
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--verbose", "-v", is_flag=True, help="Also list every key (table) / add 'keys' (JSON).")
def gc_command(
    ctx: _Ctx, older_than: float | None, namespace: str | None, dry_run: bool, verbose: bool
) -> None:
    """Delete s3kv objects by age and/or namespace (at least one filter is required).

    Only keys in the s3kv layout are considered; anything else under the prefix is left alone.
    """
    if older_than is None and namespace is None:
        raise click.UsageError("gc needs a filter: --older-than DAYS and/or --namespace NS")
    ns = _resolve_ns(ctx, namespace, exact=True)
    cutoff = older_than * 86400.0 if older_than else None  # --older-than 0: everything

    victims: list[Entry] = []
    for e in _walk(ctx, ns):
        if not isinstance(e, Entry):
            continue
        if cutoff is not None:
            age = _age(ctx, e.info)
            if age is None or age < cutoff:
                continue
        victims.append(e)
    by_ns: dict[str, _Agg] = {}
    for e in victims:
        a = by_ns.setdefault(e.parsed.namespace, _Agg())
        a.objects += 1
        a.bytes += e.info.size
    matched = _Agg(len(victims), sum(e.info.size for e in victims))

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
        "older_than_days": older_than,
        "matched": {"objects": matched.objects, "bytes": matched.bytes},
        "deleted": {"objects": deleted.objects, "bytes": deleted.bytes},
        "by_namespace": {n: {"objects": a.objects, "bytes": a.bytes} for n, a in sorted(by_ns.items())},
    }
    if failure is not None:
        doc["error"] = f"{type(failure).__name__}: {failure}"
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
        if failure is not None:
            yield f"stopped after an error: {type(failure).__name__}: {failure}"

    _emit(ctx, doc, text)
    if failure is not None:
        raise SystemExit(1)


def ops_commands() -> dict[str, click.Command]:
    return {"ls": ls_command, "stats": stats_command, "verify": verify_command, "gc": gc_command}
