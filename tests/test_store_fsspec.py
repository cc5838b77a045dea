"""FsspecStore specifics: the on-disk envelope, temp files, and the non-local (remote) code path."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pytest

from s3kv.store.base import ByteRange, IntegrityError, NotFound, StoreConfigError
from s3kv.store.fsspec_store import ENVELOPE_SIZE, TMP_MARK, FsspecStore, decode_envelope, encode_envelope


def test_envelope_layout_on_disk(tmp_path: Path) -> None:
    store = FsspecStore(f"file://{tmp_path}")
    assert store.put("ns/g0/obj", [b"hello ", b"world"], {"Fingerprint": "abc"}) is True
    raw = (tmp_path / "ns/g0/obj").read_bytes()
    assert len(raw) == ENVELOPE_SIZE + 11 and raw[ENVELOPE_SIZE:] == b"hello world"
    assert decode_envelope(raw[:ENVELOPE_SIZE], "k") == {"fingerprint": "abc"}
    assert store.get_ranges("ns/g0/obj", [ByteRange(6, 5)]) == [b"world"]
    # Nothing but the object is left in the directory (the temp file is gone).
    assert sorted(os.listdir(tmp_path / "ns/g0")) == ["obj"]


def test_foreign_and_temp_files(tmp_path: Path) -> None:
    store = FsspecStore(f"file://{tmp_path}")
    (tmp_path / "foreign").write_bytes(b"x" * (ENVELOPE_SIZE + 10))
    (tmp_path / f".obj{TMP_MARK}123").write_bytes(b"y" * (ENVELOPE_SIZE + 10))
    (tmp_path / "dir").mkdir()
    batch = store.head_many(["foreign", "dir", "absent"])
    assert isinstance(batch.failed["foreign"], IntegrityError)
    assert batch.missing == {"dir", "absent"}
    assert [o.key for o in store.list("")] == ["foreign"]  # temp files never listed
    with pytest.raises(NotFound):
        store.get_ranges("absent", [ByteRange(0, 1)])


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", f"x{TMP_MARK}y", "./a"])
def test_bad_keys(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError):
        FsspecStore(f"file://{tmp_path}").put(key, b"")


def test_metadata_limit() -> None:
    with pytest.raises(ValueError, match="envelope"):
        encode_envelope({"k": "v" * ENVELOPE_SIZE})


def test_check_access_local(tmp_path: Path) -> None:
    FsspecStore(f"file://{tmp_path}/new/dir").check_access()
    assert (tmp_path / "new/dir").is_dir()
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(StoreConfigError, match="S3KV_URL.*not a directory"):
        FsspecStore(f"file://{tmp_path}/afile").check_access()


def test_remote_code_path_on_fsspec_memory() -> None:
    """fsspec's in-memory file system is not local: it takes the generic (exists + move) path."""
    root = f"memory://s3kv-{uuid.uuid4().hex[:8]}"
    store = FsspecStore(root, max_concurrency=4)
    assert not store._local
    try:
        store.check_access()
        assert store.put("a/1", [b"ab", b"cd"], {"X": "1"}) is True
        assert store.put("a/1", b"zz") is False
        assert store.put("a/2", b"efg") is True
        batch = store.head_many(["a/1", "a/2", "a/3"])
        assert batch.found["a/1"].size == 4 and batch.found["a/1"].metadata == {"x": "1"}
        assert batch.missing == {"a/3"}
        assert store.get_ranges("a/1", [ByteRange(1, 2), ByteRange(0, 4)]) == [b"bc", b"abcd"]
        with pytest.raises(IntegrityError):
            store.get_ranges("a/2", [ByteRange(1, 10)])
        assert [(o.key, o.size) for o in store.list("a/")] == [("a/1", 4), ("a/2", 3)]
        assert not [p for p in fsspec.filesystem("memory").find(store._root) if TMP_MARK in p]
        store.delete_many(["a/1", "a/9"])
        assert [o.key for o in store.list("")] == ["a/2"]
    finally:
        store.close()
        fsspec.filesystem("memory").rm(store._root, recursive=True)
