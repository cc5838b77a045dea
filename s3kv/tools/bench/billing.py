"""What a trace replay's store traffic would bill at the real model's sizes, with retention on a trace clock.

The replay moves tiny pages (``s3kv.tools.bench.trace``); :class:`BilledStore` sits between the
connector and the replay's store and counts what every request would be at the real page sizes:

* **PUT-class requests**: one per object below the multipart threshold, else create + parts +
  complete (``s3kv.core.cost.put_requests``), plus one per *refresh* (below);
* **GET requests**: each range at its real length (the S3 clients' range split); HEADs one each;
* **storage**: byte-seconds, each object from its write until ``expire_after_s`` after its last
  write or refresh -- gc's cutoff, the retention plus what engines may still believe
  (``s3kv.core.cost.expiry_age_s``) -- (plus half the gc period: ``s3kv gc --watch`` deletes what has expired every
  ``gc_period_s``), priced per GB-month -- not "every byte for the retention period";
* **retention on the trace's clock** (``now``, set by the replay before each request): an object
  whose last write or refresh is more than ``expire_after_s`` old is gone (deleted from the store on
  first sight, as ``s3kv gc`` would have) and a later write of it is new;
* **refresh on hit**, the engine's rule (``s3kv.store.refresh``): a read of an object this engine
  has neither written nor refreshed within ``retention_s / 2`` bumps its age (one PUT-class copy);
* **kinds**: each object is counted as ``full`` (full-attention chain) or, for a sliding group, by
  the boundary its tail ends at: ``checkpoint``, ``prompt-end``, ``history-end`` (past the prompt:
  multi-turn), ``branch`` (a branch point) -- with how many were ever read and the tokens the
  requests that loaded them were served.

Why a module of its own: the replay (trace.py) drives the engine; this prices what it did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ...core.cost import DAYS_PER_MONTH, GiB, get_requests, put_requests
from ...store.base import Buffer, ByteRange, Fetched, HeadBatch, NotFound, ObjectInfo, StoreWrapper

SPLITS_MIB = (8, 16, 32, 64, 1024)
KINDS = ("full", "checkpoint", "prompt-end", "history-end", "branch")


class BilledStore(StoreWrapper):
    def __init__(
        self,
        inner: Any,
        multipart_threshold: int,
        part_size: int,
        *,
        retention_s: float = float("inf"),
        expire_after_s: float | None = None,
        gc_period_s: float = 0.0,
        checkpoint_blocks: int = 0,
        range_split: int = 8 << 20,
    ):
        super().__init__(inner)
        self.multipart_threshold, self.part_size = multipart_threshold, part_size
        self.retention_s, self.gc_period_s = retention_s, gc_period_s
        self.expire_after_s = retention_s if expire_after_s is None else expire_after_s
        #: Where gc learns the retention (``s3kv.core.retention``, set by the replay's publisher):
        #: the one it keeps an object for by its last write or refresh, and the one engines refresh
        #: by; None: the fixed one.
        self.keep: Callable[[float], float | None] | None = None
        #: And (the retention it keeps that object for once the longer ones it kept lately no longer
        #: apply, until when they apply): ``Publisher.keep_s(settled=True)``, ``Publisher.held_until``.
        self.keep_later: Callable[[float], tuple[float | None, float]] | None = None
        self.refresh_retention_s = retention_s
        self.checkpoint_blocks = checkpoint_blocks
        self.range_split = range_split
        self.sim_page: dict[str, int] = {}  # group fingerprint -> sim page bytes
        self.real_page: dict[str, int] = {}
        self.names: dict[str, str] = {}
        self.now = 0.0
        #: The request being replayed: its prompt's full blocks (to tell a tail's kind).
        self.prompt_blocks = 0
        # key -> [written_at, touched_at, real bytes, kind, page count, reads, end block, PUT requests]
        self._objects: dict[str, list[Any]] = {}
        self.reset()

    def reset(self) -> None:
        self.real_put = self.real_get = self.heads = self.refreshes = self.expired = 0
        self.written_put = 0  # PUT-class requests of the objects created (refreshes and repeats apart)
        #: GET requests had loads read with another range split (MiB -> count): the lever's effect.
        self.get_by_split: dict[int, int] = {mib: 0 for mib in SPLITS_MIB}
        self.byte_seconds = 0.0
        #: What the objects some load read cost to write and keep: the bill of a clairvoyant policy
        #: that wrote only those (the same hits, every request and GET the same) -- the floor for
        #: what this run served (``hindsight``).
        self.read_byte_seconds = 0.0
        self.read_put = 0
        self.groups: dict[str, dict[str, int]] = {}
        self.distinct: dict[str, set[bytes]] = {}
        self.kinds: dict[str, dict[str, float]] = {
            k: {"objects": 0, "bytes": 0, "put_requests": 0, "objects_read": 0, "reads": 0, "served_tokens": 0}
            for k in KINDS
        }
        self.read_now: list[tuple[int, str]] = []  # (end, kind) of the sliding objects read for the current request
        #: Full-attention pages the current request read from this store: one a token block, so S3's
        #: share of what it was served when a host tier in front served the rest.
        self.full_pages_now = 0

    def bind(self, geometry: Any, real_page_bytes: Sequence[int]) -> None:
        for g, real in zip(geometry.groups, real_page_bytes, strict=True):
            self.sim_page[g.fingerprint] = g.page_bytes
            self.real_page[g.fingerprint] = real
            self.names[g.fingerprint] = "full" if g.window is None else f"sliding{g.window}"

    # -- retention ------------------------------------------------------------------------
    def _expiry_age(self, o: list[Any]) -> float:
        return self._expiry_for(self.keep(o[1]) if self.keep is not None else None)

    def _expiry_for(self, keep: float | None) -> float:
        if keep is None:
            return self.expire_after_s
        return min(self.expire_after_s, keep + self.expire_after_s - self.retention_s)

    def _life_end(self, o: list[Any], final: bool = False) -> float:
        """When gc deletes ``o``: its cutoff now; where a longer retention gc kept lately held it
        past that (``Publisher.keep_s``), when that stopped -- or, for one alive at the end
        (``final``), will stop."""
        end = o[1] + self._expiry_age(o)
        if self.keep_later is not None:
            keep, held = self.keep_later(o[1])
            if keep is not None:
                later = o[1] + self._expiry_for(keep)
                end = max(later, min(end, held)) if final else max(end, min(self.now, held))
        return end + self.gc_period_s / 2

    def _expire(self, key: str) -> None:
        o = self._objects.get(key)
        if o is None or self.now - o[1] <= self._expiry_age(o):
            return
        self._account(o)
        del self._objects[key]
        self.expired += 1
        self.inner.delete_many([key])

    def finish(self) -> None:
        """Objects still alive at the end of the trace live on until their retention runs out."""
        for o in self._objects.values():
            self._account(o, final=True)
        self._objects.clear()

    def _account(self, o: list[Any], final: bool = False) -> None:
        """An object's storage, from its write until gc deletes it (and, if it was read, the floor's)."""
        bs = o[2] * (self._life_end(o, final) - o[0])
        self.byte_seconds += bs
        if o[5]:
            self.read_byte_seconds += bs
            self.read_put += o[7]

    def hindsight_usd(self, put_per_1k: float, gb_month: float) -> float:
        """What writing only the objects a load read would have saved on PUTs and storage (module doc):
        subtract from the run's S3 $ for the clairvoyant floor."""
        unread_put = self.written_put - self.read_put
        unread_bs = self.byte_seconds - self.read_byte_seconds
        return unread_put * put_per_1k / 1000 + unread_bs / GiB / (DAYS_PER_MONTH * 86400) * gb_month

    def storage_usd(self, gb_month: float) -> float:
        return self.byte_seconds / GiB / (DAYS_PER_MONTH * 86400) * gb_month

    # -- the store ------------------------------------------------------------------------
    def head_many(self, keys: Sequence[str]) -> HeadBatch:
        self.heads += len(keys)
        for k in keys:
            self._expire(k)
        batch = self.inner.head_many(keys)
        # Dated on the trace's clock, as ``list`` dates them: what the engine's lookup judges an
        # answer's age by.
        found = {k: dataclasses.replace(i, last_modified=self._objects[k][1]) if k in self._objects else i
                 for k, i in batch.found.items()}
        return dataclasses.replace(batch, found=found)

    def get_if_changed(self, key: str, etag: str | None = None) -> Fetched | None:
        self.real_get += 1  # the fleet index's poll: one GET, a 304 or the (small) object
        return self.inner.get_if_changed(key, etag)

    def _kind(self, fp: str, md: Mapping[str, str]) -> str:
        if self.names.get(fp) == "full":
            return "full"
        end = int(md.get("s3kv-first", "0") or 0) + int(md.get("s3kv-count", "0") or 0)
        if self.checkpoint_blocks and end % self.checkpoint_blocks == 0:
            return "checkpoint"
        if end == self.prompt_blocks:
            return "prompt-end"
        return "history-end" if end > self.prompt_blocks else "branch"

    def put(self, key: str, data: Buffer | Sequence[Buffer], metadata: Mapping[str, str] | None = None) -> bool:
        from ...core.keys import parse_key
        from ...core.objects import header_len
        from ...store.base import as_buffers, total_size

        if parse_key(key) is None:  # not KV (the fleet index): one PUT, no object to keep
            self.real_put += 1
            return self.inner.put(key, data, metadata)
        self._expire(key)
        md = {k.lower(): v for k, v in (metadata or {}).items()}
        fp, n = md.get("s3kv-group", ""), int(md.get("s3kv-count", "0") or 0)
        real = header_len(n) + n * self.real_page.get(fp, 0)
        reqs = put_requests(real, self.multipart_threshold, self.part_size)
        self.real_put += reqs
        created = self.inner.put(key, data, metadata)
        if created:
            kind = self._kind(fp, md)
            end = int(md.get("s3kv-first", "0") or 0) + n
            self._objects[key] = [self.now, self.now, real, kind, n, 0, end, reqs]
            self.written_put += reqs
            k = self.kinds[kind]
            k["objects"] += 1
            k["bytes"] += real
            k["put_requests"] += reqs
            name = self.names.get(fp, fp)
            e = self.groups.setdefault(name, {"objects": 0, "pages": 0, "bytes": 0, "sim_bytes": 0})
            e["objects"] += 1
            e["pages"] += n
            e["bytes"] += real
            e["sim_bytes"] += total_size(data)
            # A simulated page's bytes are a function of its token prefix (s3kv.sim.model): its first
            # 8 bytes tell pages apart, so objects that repeat a page (a prompt-end snapshot, then
            # the whole chunk) count it once here.
            body = b"".join(bytes(b) for b in as_buffers(data))
            hl, pb = header_len(n), self.sim_page.get(fp, 0)
            seen = self.distinct.setdefault(name, set())
            for i in range(n if pb >= 8 else 0):
                seen.add(body[hl + i * pb : hl + i * pb + 8])
        return created

    def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        from ...core.keys import parse_key
        from ...core.objects import header_len

        pk = parse_key(key)
        if pk is None:  # not KV (a read report): one GET, nothing to keep
            self.real_get += 1
            return self.inner.get_ranges(key, ranges)
        self._expire(key)
        o = self._objects.get(key)
        fp = pk.group_fingerprint
        sim, real = self.sim_page.get(fp, 1), self.real_page.get(fp, 0)
        hl = header_len(o[4] if o else 0)
        n_pages = 0
        for r in ranges:
            head = min(r.length, hl) if r.offset == 0 else 0
            pages = (r.length - head) // sim
            n_pages += pages
            self.real_get += get_requests(head + pages * real, self.range_split, r.parts)
            for mib in SPLITS_MIB:
                self.get_by_split[mib] += get_requests(head + pages * real, mib << 20, r.parts)
        if o is None:
            raise NotFound("expired or never written", key=key)
        out = self.inner.get_ranges(key, ranges)
        if self.names.get(fp) == "full":
            self.full_pages_now += n_pages
        if o[5] == 0:
            self.kinds[o[3]]["objects_read"] += 1
        o[5] += 1
        self.kinds[o[3]]["reads"] += 1
        if o[3] != "full":
            self.read_now.append((o[6], o[3]))
        # Refresh on hit (s3kv.store.refresh): half the retention; learnt, half the whole life
        # (Listings.refresh_s).
        margin = self.expire_after_s - self.retention_s
        if self.now - o[1] > (self.retention_s if self.keep is None else self.refresh_retention_s + margin) / 2:
            o[1] = self.now
            self.refreshes += 1
            self.real_put += 1
        return out

    def credit(self, served_tokens: int) -> None:
        """The current request was served ``served_tokens``: credit the kind of tail it loaded."""
        if served_tokens > 0:
            kind = max(self.read_now)[1] if self.read_now else "full"
            self.kinds[kind]["served_tokens"] += served_tokens
        self.read_now = []
        self.full_pages_now = 0

    def weigh(self, key: str, nbytes: int) -> int:
        """An object's bytes at the real model's page sizes (the host tier's ``host_weigh=``: it holds the
        simulator's tiny pages but must fill up as the real ones would)."""
        from ...core.keys import parse_key
        from ...core.objects import header_len

        pk = parse_key(key)
        fp = pk.group_fingerprint if pk else ""
        sim, real = self.sim_page.get(fp), self.real_page.get(fp)
        if not sim or real is None:
            return nbytes
        per_page = header_len(1) - header_len(0) + sim
        n = max(0, (nbytes - header_len(0)) // per_page)
        return header_len(n) + n * real

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """On the trace's clock: what has expired is gone (deleted, as gc would have), and the rest
        shows its last write or refresh as ``last_modified`` (what the fleet index's publisher lists)."""
        for info in self.inner.list(prefix):
            o = self._objects.get(info.key)
            if o is None:
                yield info
            elif self.now - o[1] > self._expiry_age(o):
                self._expire(info.key)
            else:
                yield dataclasses.replace(info, last_modified=o[1])
