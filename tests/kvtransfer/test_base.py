"""The shared pieces: inbox semantics, the sync driver, staging, and the local transport."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvtransfer import LayoutMismatch, LocalTransport, LoopThread, TransferError
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
