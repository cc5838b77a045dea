"""Operator commands over a bucket others can write to (issue 17, point 6).

* ``verify --delete-bad`` skips, never deletes, objects of a format version it does not read;
* ``verify`` checks sizes before reading, and reads an object in bounded parts;
* a dangling symlink, a FIFO, or a file deleted mid-walk do not stop ``ls`` / ``verify`` / ``gc``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import xxhash
from click.testing import CliRunner

import s3kv.tools.ops as ops
from s3kv.cli import main
from s3kv.core.keys import KeyScheme, parse_key
from s3kv.core.objects import FIXED_LEN, ObjectIdentity, encode_object, header_len, object_metadata
from s3kv.store.base import ObjectStore, StoreWrapper
from s3kv.store.factory import open_store
from s3kv.store.fsspec_store import ENVELOPE_SIZE, encode_envelope

REPO = Path(__file__).resolve().parents[1]
NS = b"\x0a" * 16
GFP = "1f" * 8


def _ident(page_bytes: int = 64) -> ObjectIdentity:
    return ObjectIdentity(NS, GFP, 0, 1, 16, page_bytes)


def _put(store: ObjectStore, first: int, pages: list[bytes], *, version: int | None = None,
         meta_version: int | None = None) -> str:
    ident = _ident(len(pages[0]))
    last = bytes([first + 1]) * 16
    key = KeyScheme("", NS, 1).object_key(GFP, 0, last)
    header, *body = encode_object(ident, first, last, pages)
    if version is not None:  # what another build of s3kv would write: a new version, a valid header
        h = bytearray(header)
        struct.pack_into("<H", h, 4, version)
        struct.pack_into("<Q", h, len(h) - 8, xxhash.xxh3_64_intdigest(bytes(h[:-8])))
        header = bytes(h)
    md = object_metadata(ident, first, len(pages))
    if meta_version is not None:
        md["s3kv-version"] = str(meta_version)
    assert store.put(key, [header, *body], md)
    return key


def _cli(*args: str):
    env = {k: None for k in os.environ if k.startswith("S3KV_")}
    return CliRunner().invoke(main, list(args), env=env)


def test_verify_delete_bad_skips_objects_of_another_format_version(tmp_path):
    url = f"file://{tmp_path}/c"
    store = open_store(url)
    good = _put(store, 0, [b"a" * 64])
    newer_meta = _put(store, 1, [b"b" * 64], version=2, meta_version=2)
    newer_header = _put(store, 2, [b"c" * 64], version=2)  # metadata still says 1
    corrupt = _put(store, 3, [b"d" * 64])
    path = tmp_path / "c" / corrupt
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))

    r = _cli("verify", "--url", url, "--delete-bad", "--json")
    assert r.exit_code == 1  # the corrupt one is bad
    doc = json.loads(r.output)
    assert [b["key"] for b in doc["bad"]] == [corrupt] and doc["deleted"] == 1
    assert {s["key"]: s["reason"] for s in doc["skipped"]} == {
        newer_meta: "unsupported_version",
        newer_header: "unsupported_version",
    }
    left = {i.key for i in store.list("")}
    assert left == {good, newer_meta, newer_header}
    # Table form says why they were left alone; with only skipped objects left, verify passes.
    r = _cli("verify", "--url", url)
    assert r.exit_code == 0, r.output
    assert "2 skipped (another format version; not checked, not deleted)" in r.output
    assert f"skipped {newer_meta}: object format version 2, this build reads 1" in r.output


def _craft_file(root: Path, key: str, md: dict[str, str], head: bytes, size: int) -> Path:
    """An object file as the file:// store lays it out, made sparse up to ``size`` body bytes."""
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode_envelope(md))
        f.write(head)
        f.truncate(ENVELOPE_SIZE + size)
    return path


def test_verify_checks_size_before_reading_a_huge_crafted_object(tmp_path):
    """4 GiB of sparse file behind metadata that claims one 64-byte page: judged from the HEAD,
    no read; the command stays small and quick."""
    root = tmp_path / "c"
    ident = _ident()
    key = KeyScheme("", NS, 1).object_key(GFP, 0, b"\x09" * 16)
    head = encode_object(ident, 0, b"\x09" * 16, [b"z" * 64])[0]
    _craft_file(root, key, object_metadata(ident, 0, 1), bytes(head), 4 << 30)
    # Metadata that agrees with the size but claims a 3 GiB page: skipped, never read.
    big = _ident(3 << 30)
    key2 = KeyScheme("", NS, 1).object_key(GFP, 0, b"\x0b" * 16)
    _craft_file(root, key2, object_metadata(big, 0, 1), b"", header_len(1) + (3 << 30))
    # Peak RSS of this process image: VmHWM (ru_maxrss would carry the forking pytest's over exec).
    code = (
        "import re, sys; from s3kv.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
        "print('MAXRSS', hwm, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code, "verify", "--url", f"file://{root}", "--delete-bad", "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert [(b["key"], b["reason"]) for b in doc["bad"]] == [(key, "truncated")]
    assert [(s["key"], s["reason"]) for s in doc["skipped"]] == [(key2, "page_too_large")]
    assert doc["deleted"] == 1 and (root / key2).exists()
    maxrss_kib = int(proc.stderr.split("MAXRSS")[-1].split()[0])
    assert maxrss_kib < 600 * 1024, maxrss_kib  # nowhere near the 4 GiB a whole download needs
    assert time.monotonic() - t0 < 60


class _Reads(StoreWrapper):
    """Records the bytes of every get_ranges call."""

    def __init__(self, inner: ObjectStore):
        super().__init__(inner)
        self.calls: list[int] = []

    def get_ranges(self, key, ranges):
        out = self.inner.get_ranges(key, ranges)
        self.calls.append(sum(len(b) for b in out))
        return out


def test_verify_reads_an_object_in_bounded_parts(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path}/c")
    pages = [bytes([i]) * 4096 for i in range(40)]
    key = _put(store, 0, pages)
    monkeypatch.setattr(ops, "VERIFY_READ_BYTES", 16 * 1024)  # four pages per read
    reads = _Reads(store)
    entry = ops.Entry(store.head(key), parse_key(key))
    verdict = ops._verify_one(reads, entry)
    assert verdict.status == "ok" and verdict.pages == 40
    assert reads.calls[0] == header_len(40)  # the header alone first
    assert max(reads.calls[1:]) <= 16 * 1024 and sum(reads.calls[1:]) == 40 * 4096
    # A page changed anywhere is still found.
    path = tmp_path / "c" / key
    raw = bytearray(path.read_bytes())
    raw[ENVELOPE_SIZE + header_len(40) + 37 * 4096 + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    verdict = ops._verify_one(_Reads(store), ops.Entry(store.head(key), parse_key(key)))
    assert (verdict.status, verdict.reason) == ("bad", "checksum") and "page 37" in verdict.detail
    assert FIXED_LEN < header_len(40)


def test_dangling_links_fifos_and_vanishing_files_do_not_stop_the_walk(tmp_path):
    url = f"file://{tmp_path}/c"
    store = open_store(url)
    keys = [_put(store, i, [bytes([i]) * 64]) for i in range(3)]
    gdir = tmp_path / "c" / keys[0].rsplit("/", 1)[0]
    os.symlink(tmp_path / "nowhere", gdir / ("ab" * 16))  # dangling, with an object-like name
    os.mkfifo(gdir / ("cd" * 16))  # a FIFO would hang a reader
    for cmd in (["ls"], ["stats"], ["verify"], ["gc", "--older-than", "1"]):
        r = _cli(*cmd, "--url", url, "--json")
        assert r.exit_code == 0, (cmd, r.output)
    assert json.loads(_cli("ls", "--url", url, "--json").output)["total"]["objects"] == 3

    # A file deleted between the listing and its check is "vanished", not an error.
    class DeletesAfterListing(StoreWrapper):
        def list(self, prefix):
            items = list(self.inner.list(prefix))
            os.unlink(tmp_path / "c" / keys[1])
            yield from items

    ctx = ops._Ctx(url, DeletesAfterListing(store), "", True)
    entries = [e for e in ops._walk(ctx) if isinstance(e, ops.Entry)]
    verdicts = [ops._verify_one(store, e) for e in entries]
    assert sorted(v.status for v in verdicts) == ["ok", "ok", "vanished"]


def test_verify_streams_a_page_larger_than_its_read_bound(tmp_path):
    """Issue 29.7: verify read a page whole, up to MAX_PAGE_BYTES (512 MiB): one crafted sparse
    object with a 512 MiB page peaked at 545 MiB, four at ``-j 4`` at 1.7 GiB. Its checksum is
    now streamed over parts of at most VERIFY_READ_BYTES, so the documented bound holds per page."""
    import mmap

    root = tmp_path / "c"
    page = ops.MAX_PAGE_BYTES
    ident = _ident(page)
    zeros = mmap.mmap(-1, page)  # untouched anonymous memory: reading it costs no RSS
    keys = []
    for i in range(4):
        last = bytes([0x20 + i]) * 16
        key = KeyScheme("", NS, 1).object_key(GFP, 0, last)
        head = encode_object(ident, 0, last, [memoryview(zeros)])[0]
        _craft_file(root, key, object_metadata(ident, 0, 1), bytes(head), header_len(1) + page)
        keys.append(key)
    zeros.close()
    code = (
        "import re, sys; from s3kv.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
        "print('MAXRSS', hwm, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "verify", "--url", f"file://{root}", "-j", "4", "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] == 4, doc
    maxrss_mib = int(proc.stderr.split("MAXRSS")[-1].split()[0]) // 1024
    # Four jobs, each holding about one part of at most 64 MiB, not a page: 260 MiB measured
    # (1,543 MiB when pages were read whole; one object: 97 MiB, was 545).
    assert maxrss_mib < page // 2**20, maxrss_mib
