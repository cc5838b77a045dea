"""Page copies on CUDA: one cudaMemcpyBatchAsync per call vs one copy per page.

Skipped cleanly without CUDA; the batch tests skip where the runtime predates 12.8.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("needs a CUDA device", allow_module_level=True)

from s3kv.config import Settings  # noqa: E402
from s3kv.sim.layouts import GroupSpec, make_layout, page_bytes  # noqa: E402
from s3kv.store.memory import MemoryStore  # noqa: E402
from s3kv.transfer.copies import Copier, PageCopy  # noqa: E402
from s3kv.transfer.memcpy_batch import MemcpyBatch, MemcpyBatchError  # noqa: E402

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
SPECS = {
    "packed": GroupSpec((0,), None, (64 * 1024,)),
    "padded": GroupSpec((0,), None, (64 * 1024,), pad=512),
    "multi-region": GroupSpec((0, 1), 128, (32 * 1024, 4096, 512)),
}


def needs_batch() -> MemcpyBatch:
    b = MemcpyBatch.load()
    if b is None:
        pytest.skip("no trusted cudaMemcpyBatchAsync here (needs CUDA 12.8+, compute capability < 10)")
    return b


def test_batch_is_bound_on_hopper_with_a_recent_runtime():
    major, _ = torch.cuda.get_device_capability()
    b = MemcpyBatch.load()
    if major >= 10:
        assert b is None  # not trusted on Blackwell and newer
    elif major == 9 and int(torch.version.cuda.split(".")[0]) >= 13:
        assert b is not None and b.version >= 13000  # what this project measured


def staged(copier, layout, slots, fwd, pinned=True):
    regions = tuple(layout.group(0).regions)
    pb = layout.group(0).bytes_per_page
    host = torch.zeros(len(slots) * pb, dtype=torch.uint8, pin_memory=pinned)
    copies = [PageCopy(regions, s, host, i * pb) for i, s in enumerate(slots)]
    Copier.synchronize(copier.save(copies, fwd))
    return host, copies


class SpyBatch:
    """Wraps the real batch, counting calls; ``fail`` makes it refuse like the driver would."""

    def __init__(self, inner, fail=False):
        self.inner, self.fail, self.calls = inner, fail, 0

    def copy(self, dsts, srcs, sizes, stream):
        self.calls += 1
        if self.fail:
            raise MemcpyBatchError("cudaMemcpyBatchAsync failed with cudaError 1 (injected)")
        self.inner.copy(dsts, srcs, sizes, stream)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_batched_and_per_page_copies_move_the_same_bytes(name):
    needs_batch()
    layout = make_layout([SPECS[name]], num_slots=32, device=DEV, fill_seed=5)
    fwd = torch.cuda.Stream()
    slots = [3, 4, 5, 17, 0, 31, 9, 10]
    batch, per_page = Copier(DEV), Copier(DEV, batch=False)
    assert batch.path == "memcpy_batch" and per_page.path == "per_page"
    hb, _ = staged(batch, layout, slots, fwd)
    hp, _ = staged(per_page, layout, slots, fwd)
    assert torch.equal(hb, hp)
    pb = layout.group(0).bytes_per_page
    for i, s in enumerate(slots):
        assert bytes(hb[i * pb : (i + 1) * pb].numpy()) == page_bytes(layout, 0, s)
    # Load the staged pages into other slots with the batch; the rest of the pool is untouched.
    before = {s: page_bytes(layout, 0, s) for s in range(32)}
    dst = [1, 2, 6, 7, 8, 20, 21, 22]
    regions = tuple(layout.group(0).regions)
    batch.begin_loads(fwd)
    Copier.synchronize(batch.load([PageCopy(regions, s, hb, i * pb) for i, s in enumerate(dst)]))
    for i, s in enumerate(dst):
        assert page_bytes(layout, 0, s) == before[slots[i]]
    for s in set(range(32)) - set(dst):
        assert page_bytes(layout, 0, s) == before[s]


def test_batch_is_used_for_pinned_staging_only():
    spy = SpyBatch(needs_batch())
    layout = make_layout([SPECS["packed"]], num_slots=8, device=DEV, fill_seed=1)
    c = Copier(DEV)
    c._batch = spy
    fwd = torch.cuda.Stream()
    staged(c, layout, [1, 5], fwd, pinned=True)
    assert spy.calls == 1
    host, _ = staged(c, layout, [1, 5], fwd, pinned=False)  # pageable: per-page copies
    assert spy.calls == 1
    assert bytes(host[: 64 * 1024].numpy()) == page_bytes(layout, 0, 1)


def test_a_refused_batch_falls_back_to_per_page_copies(caplog):
    spy = SpyBatch(needs_batch(), fail=True)
    layout = make_layout([SPECS["multi-region"]], num_slots=8, device=DEV, fill_seed=2)
    c = Copier(DEV)
    c._batch = spy
    fwd = torch.cuda.Stream()
    pb = layout.group(0).bytes_per_page
    for k in range(3):
        with caplog.at_level(logging.WARNING, logger="s3kv.transfer.copies"):
            host, _ = staged(c, layout, [6, 2], fwd)
        assert spy.calls == k + 1 and c.path == ("per_page" if k == 2 else "memcpy_batch")
        assert bytes(host[:pb].numpy()) == page_bytes(layout, 0, 6)
        assert bytes(host[pb:].numpy()) == page_bytes(layout, 0, 2)
    assert "per-page copies from now on" in caplog.text
    # A later torch launch check is not tripped by a leftover runtime error.
    torch.ones(4, device=DEV).add_(1)
    torch.cuda.synchronize()


def test_a_refusal_after_queued_batches_still_moves_every_page():
    """The third batch of a call is refused: the first two are queued, the rest go per page."""
    real = needs_batch()

    class FailThird(SpyBatch):
        def copy(self, dsts, srcs, sizes, stream):
            self.calls += 1
            if self.calls == 3:
                raise MemcpyBatchError("cudaMemcpyBatchAsync failed with cudaError 1 (injected)")
            real.copy(dsts, srcs, sizes, stream)

    layout = make_layout([SPECS["padded"]], num_slots=64, device=DEV, fill_seed=8)
    c = Copier(DEV)
    c._batch = FailThird(real)
    slots = list(range(63, 3, -2))  # 30 pages: batches of 4, 8, then the refused 16
    host, _ = staged(c, layout, slots, torch.cuda.Stream())
    pb = layout.group(0).bytes_per_page
    for i, s in enumerate(slots):
        assert bytes(host[i * pb : (i + 1) * pb].numpy()) == page_bytes(layout, 0, s)


def test_batched_load_waits_for_earlier_forward_work():
    needs_batch()
    layout = make_layout([SPECS["packed"]], num_slots=8, device=DEV, fill_seed=None)
    rows = layout.group(0).regions[0].as_tensor()
    c = Copier(DEV)
    fwd = torch.cuda.Stream()
    host = torch.full((64 * 1024,), 9, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(int(50e-3 * 2.0e9))  # earlier forward work ...
        rows[4].fill_(1)  # ... that still writes the slot handed to the load
    c.begin_loads(fwd)
    c.wait_on(c.load([PageCopy(tuple(layout.group(0).regions), 4, host, 0)]), fwd)
    fwd.synchronize()
    assert int(rows[4].min()) == 9 == int(rows[4].max())


def test_batch_refuses_the_legacy_default_stream():
    b = needs_batch()
    x = torch.ones(16, dtype=torch.uint8, device=DEV)
    y = torch.zeros(16, dtype=torch.uint8, device=DEV)
    with pytest.raises(MemcpyBatchError, match="default stream"):
        b.copy([y.data_ptr()], [x.data_ptr()], [16], 0)


def test_save_through_the_batch_waits_for_the_forward():
    """The batched save is ordered after forward work still running on the forward stream."""
    needs_batch()
    layout = make_layout([SPECS["packed"]], num_slots=8, device=DEV, fill_seed=None)
    c = Copier(DEV)
    fwd = torch.cuda.Stream()
    rows = layout.group(0).regions[0].as_tensor()
    host = torch.zeros(64 * 1024, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(int(50e-3 * 2.0e9))  # a long "forward" ...
        rows[3].fill_(77)  # ... that writes the page last
    ev = c.save([PageCopy(tuple(layout.group(0).regions), 3, host, 0)], fwd)
    Copier.synchronize(ev)
    assert int(host.min()) == 77 == int(host.max())


@pytest.mark.parametrize("batch_copies", [True, False], ids=["batch", "per-page"])
def test_worker_setting_picks_the_copy_path(batch_copies):
    from s3kv.engine.worker import WorkerCore

    layout = make_layout([SPECS["multi-region"]], num_slots=16, device=DEV, fill_seed=4)
    core = WorkerCore(Settings(staging_mib=16, batch_copies=batch_copies), MemoryStore(), "kv", 0, 1, "m", "bf16")
    core.register_layout(layout)
    want = "memcpy_batch" if batch_copies and MemcpyBatch.load() is not None else "per_page"
    assert core._copier.path == want
    core.close()
