"""The shared pieces: inbox semantics, the sync driver, staging, and the local transport."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvtransfer import LayoutMismatch, LocalTransport, LoopThread, TransferError, staging
from kvtransfer.base import Inbox
from kvtransfer.staging import StagingPool, block_ids, gather, scatter
from tests.kvtransfer.conftest import random_kv, tiny_layout


def test_inbox_delivers_in_either_order():
    inbox = Inbox()

    async def go():
        inbox.put("early", {"x": torch.ones(1)})
        early = await inbox.wait("early")
        waiting = asyncio.ensure_future(inbox.wait("late", timeout=5))
        await asyncio.sleep(0)
        # from another thread, as a colocated sender on its own loop would
        threading.Thread(target=inbox.put, args=("late", {"y": torch.zeros(1)})).start()
        return early, await waiting

    early, late = asyncio.run(go())
    assert set(early) == {"x"} and set(late) == {"y"}


def test_inbox_raises_failures_and_times_out():
    inbox = Inbox()

    async def go():
        inbox.put("bad", TransferError("checksum mismatch"))
        with pytest.raises(TransferError, match="checksum"):
            await inbox.wait("bad")
        with pytest.raises(asyncio.TimeoutError):
            await inbox.wait("never", timeout=0.01)
        inbox.put("dropped", {})
        inbox.discard("dropped")
        with pytest.raises(asyncio.TimeoutError):
            await inbox.wait("dropped", timeout=0.01)

    asyncio.run(go())


def test_on_receive_callback_gets_each_landed_request():
    layout = tiny_layout()
    seen = []
    rx = LocalTransport(layout, random_kv(layout), on_receive=lambda r, x: seen.append((r, x)))

    async def go():
        await rx.start()
        conn = await LocalTransport(layout).connect(rx.address)
        await conn.send_blocks("r", random_kv(layout), [1], [2], {"t": torch.ones(3)})
        await rx.close()

    asyncio.run(go())
    assert [r for r, _ in seen] == ["r"] and torch.equal(seen[0][1]["t"], torch.ones(3))


def test_loop_thread_drives_a_transport_from_sync_code_and_stops():
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, seed=1)
    loop = LoopThread()
    rx = LocalTransport(layout, dst)
    loop.run(rx.start())
    conn = loop.run(LocalTransport(layout).connect(rx.address))
    loop.run(conn.send_blocks("r", src, [4], [5]))
    loop.submit(asyncio.sleep(3600))  # left running: close() must still return
    loop.close()
    assert torch.equal(dst[:, :, 5], src[:, :, 4])
    assert not any(t.name == "kvtransfer-loop" for t in threading.enumerate())


def test_local_refuses_unknown_peers_and_foreign_tensors():
    layout = tiny_layout()

    async def go():
        tx = LocalTransport(layout)
        with pytest.raises(ConnectionError):
            await tx.connect({"kind": "local", "id": "nobody"})
        with pytest.raises(ValueError):
            await tx.connect({"kind": "ucx", "mode": "worker"})
        async with LocalTransport(layout, random_kv(layout)) as rx:
            conn = await tx.connect(rx.address)
            with pytest.raises(LayoutMismatch):
                await conn.send_blocks("r", random_kv(tiny_layout("bfloat16")), [1], [1])
            with pytest.raises(TypeError):
                await conn.send_blocks("r", random_kv(layout), [1], [1], {"x": [1, 2]})
        with pytest.raises(ConnectionError):  # a closed receiver is gone from the registry
            await tx.connect(rx.address)
        with pytest.raises(TransferError, match="closed"):
            await conn.send_blocks("r", random_kv(layout), [1], [1])

    asyncio.run(go())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_scatter_match_plain_indexing(dtype):
    layout = tiny_layout(dtype)
    src, dst = random_kv(layout, seed=1), random_kv(layout, seed=2)
    ids, to = [7, 3, 3, 60], [0, 63, 5, 9]
    pool = StagingPool()
    buf = pool.take(len(ids) * layout.block_bytes // layout.num_layers * 2, "cpu")
    part = gather(src, (1, 3), block_ids(ids, src.device), buf)
    assert torch.equal(part, src[1:3, :, ids])
    scatter(dst, (1, 3), to, part)
    assert torch.equal(dst[1:3, :, to], src[1:3, :, ids])


def test_scatter_takes_ids_built_once():
    """The receiver builds the id tensor once per request and passes it to every chunk's
    scatter: the same result as the list."""
    layout = tiny_layout()
    src = random_kv(layout, seed=1)
    a, b = random_kv(layout, seed=2), random_kv(layout, seed=2)
    to = [9, 0, 33]
    part = src[0:2, :, [1, 2, 3]].contiguous()
    scatter(a, (0, 2), to, part)
    scatter(b, (0, 2), block_ids(to, b.device), part)
    assert torch.equal(a, b) and torch.equal(a[0:2, :, to], part)
    assert block_ids(torch.tensor([4, 5], dtype=torch.int32), "cpu").dtype == torch.long


def test_host_copies_need_no_stream():
    assert staging.copy_stream("cpu") is None
    assert staging.mark(None) is None
    staging.after_current(None)  # a no-op, not an error
    with torch.cuda.stream(staging.copy_stream("cpu")):  # the senders' idiom, on the host
        assert torch.equal(torch.ones(2) * 2, torch.full((2,), 2.0))


@pytest.mark.gpu
def test_copy_stream_orders_after_current_work_and_marks_its_own():
    dev = torch.device("cuda", 0)
    s = staging.copy_stream(dev)
    assert s is staging.copy_stream("cuda:0") and s != torch.cuda.current_stream(dev)
    layout = tiny_layout("bfloat16")
    kv = torch.zeros(layout.kv_shape(64), dtype=torch.bfloat16, device=dev)
    torch.cuda._sleep(10_000_000)  # queued ahead on the current stream: the "engine"
    kv.fill_(3)
    staging.after_current(s)
    buf = StagingPool().take(4 * layout.block_bytes, dev)
    with torch.cuda.stream(s):
        part = gather(kv, (0, layout.num_layers), block_ids([1, 2, 3, 4], dev), buf)
    done = staging.mark(s)
    done.synchronize()
    assert bool((part == 3).all())


def test_staging_pool_reuses_host_buffers():
    pool = StagingPool(max_bytes=1 << 20)
    a = pool.take(1000, "cpu")
    assert a.numel() == 1000
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take(700, "cpu")  # same power-of-two class: the same memory
    assert b.data_ptr() == ptr and b.numel() == 700
    pool.give(pool.take(2 << 20, "cpu"))  # over the idle cap: dropped, not kept
    assert pool._idle == 0


@pytest.mark.gpu
@pytest.mark.parametrize("src_dev,dst_dev", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_local_transfer_moves_between_devices(src_dev, dst_dev):
    layout = tiny_layout("bfloat16")
    src = random_kv(layout, seed=1).to(src_dev)
    dst = random_kv(layout, seed=2).to(dst_dev)
    before = dst.cpu()

    async def go():
        async with LocalTransport(layout, dst) as rx:
            conn = await LocalTransport(layout).connect(rx.address)
            await conn.send_blocks("r", src, [1, 9, 4], [0, 5, 63], {"h": torch.ones(2)})
            return await rx.recv_blocks("r")

    got = asyncio.run(go())
    assert got["h"].device.type == dst.device.type
    after, src = dst.cpu(), src.cpu()
    assert torch.equal(after[:, :, [0, 5, 63]], src[:, :, [1, 9, 4]])
    others = [b for b in range(64) if b not in (0, 5, 63)]
    assert torch.equal(after[:, :, others], before[:, :, others])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_copy_kernel_equals_index_select_and_index_copy(dtype):
    """The Triton block copy that gathers and scatters on GPUs (run by the interpreter here):
    bit for bit what index_select / index_copy_ produce, for any dtype (it moves bits), with
    rows longer than one tile and blocks in any order."""
    from engine.attention import triton_available
    from kvtransfer import staging

    if not triton_available():
        pytest.skip("needs triton")
    old = staging.COPY_TILE
    staging.COPY_TILE = 64  # several tiles per block row, the last one partial
    try:
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(3, 2, 9, 4, 2, 13, generator=g).to(dtype)  # 104 elements per block row
        ids = torch.tensor([7, 0, 4, 5])
        src = staging.rows(kv, (1, 3))
        ref = torch.index_select(src, 1, ids)
        got = torch.zeros_like(ref)
        staging.copy_blocks(src, got, ids, gather=True)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        dst, want = kv.clone(), kv.clone()
        data = torch.randn(ref.shape, generator=g).to(dtype)
        staging.rows(want, (1, 3)).index_copy_(1, ids, data)
        staging.copy_blocks(staging.rows(dst, (1, 3)), data, ids, gather=False)
        assert torch.equal(dst, want) and not torch.equal(dst, kv)
    finally:
        staging.COPY_TILE = old


class _SlowEvent:
    """Duck-typed CUDA event: completes `after` seconds into its synchronize()."""

    def __init__(self, after: float = 0.0, fail: bool = False):
        self.after, self.fail, self.done, self.thread = after, fail, after == 0, None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        import time

        self.thread = threading.current_thread()
        time.sleep(self.after)
        if self.fail:
            raise RuntimeError("device lost")
        self.done = True


def test_wait_event_waits_off_the_loop_on_a_daemon_thread():
    async def go():
        slow, ticks = _SlowEvent(0.05), []

        async def tick():  # the loop keeps running while the event is waited for
            while not slow.done:
                ticks.append(1)
                await asyncio.sleep(0.005)

        await asyncio.gather(staging.wait_event(slow), tick())
        return slow, len(ticks)

    slow, ticks = asyncio.run(go())
    assert slow.done and ticks >= 3
    assert slow.thread.daemon and slow.thread.name.startswith("kvtransfer-wait")
    done = _SlowEvent()
    asyncio.run(staging.wait_event(done))
    assert done.thread is None  # already complete: no thread asked
    asyncio.run(staging.wait_event(None))
    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(staging.wait_event(_SlowEvent(0.01, fail=True)))
