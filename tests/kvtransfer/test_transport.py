"""The Transport contract, pinned for every implementation (local, UCX worker, UCX listener)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer import MAX_REQUEST_ID_BYTES, LayoutMismatch, RequestTooLarge
from tests.kvtransfer.conftest import random_kv, sample_extras, tiny_layout

SRC = [3, 0, 17, 63, 5, 40]
DST = [10, 11, 40, 2, 63, 0]


def assert_landed(dst_before, dst, src, src_ids, dst_ids):
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    others = [b for b in range(dst.shape[2]) if b not in dst_ids]
    assert torch.equal(dst[:, :, others], dst_before[:, :, others])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_and_extras_land_exactly(transport_kind, dtype):
    make, run = transport_kind
    layout = tiny_layout(dtype)
    src, dst = random_kv(layout, seed=1), random_kv(layout, seed=2)
    before, extras = dst.clone(), sample_extras()

    async def go():
        async with make(layout, dst) as rx:
            tx = make(layout)
            conn = await tx.connect(rx.address)
            stats = await conn.send_blocks("req-1", src, SRC, DST, extras)
            got = await rx.recv_blocks("req-1", timeout=10)
            await tx.close()
            return stats, got

    stats, got = run(go())
    assert_landed(before, dst, src, SRC, DST)
    assert set(got) == set(extras)
    for k, v in extras.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert stats.num_blocks == len(SRC)
    assert stats.bytes == len(SRC) * layout.block_bytes == len(SRC) * 3 * 2 * 16 * 2 * 8 * (
        4 if dtype == "float32" else 2)
    assert stats.extras_bytes == sum(t.numel() * t.element_size() for t in extras.values())
    assert stats.seconds > 0


@pytest.mark.parametrize("field,value", [("dtype", "bfloat16"), ("block_size", 32),
                                         ("num_draft_layers", 0), ("model", "other")])
def test_mismatched_peer_is_refused_before_any_bytes(transport_kind, field, value):
    make, run = transport_kind
    rx_layout, tx_layout = tiny_layout(), tiny_layout(**{field: value})
    dst = random_kv(rx_layout)
    before = dst.clone()

    async def go():
        async with make(rx_layout, dst) as rx:
            tx = make(tx_layout)
            try:
                with pytest.raises(LayoutMismatch) as err:
                    await tx.connect(rx.address)
            finally:
                await tx.close()
            return err.value

    err = run(go())
    assert field in err.fields and field in str(err)
    assert torch.equal(dst, before)


def test_concurrent_and_repeated_transfers(transport_kind):
    make, run = transport_kind
    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)
    before = dst.clone()

    async def go():
        async with make(layout, dst) as rx:
            tx = make(layout)
            conn = await tx.connect(rx.address)
            sends = [conn.send_blocks(f"c{i}", src, [i, i + 20], [2 * i, 2 * i + 1],
                                      {"i": torch.tensor([i])}) for i in range(16)]
            stats = await asyncio.gather(*sends)
            got = [await rx.recv_blocks(f"c{i}", timeout=10) for i in range(16)]
            for i in range(5):  # the same blocks again: a fresh request each time
                await conn.send_blocks(f"again{i}", src, [63], [40])
                await rx.recv_blocks(f"again{i}", timeout=10)
            await tx.close()
            return stats, got

    stats, got = run(go())
    src_ids = [b for i in range(16) for b in (i, i + 20)] + [63]
    dst_ids = list(range(32)) + [40]
    assert_landed(before, dst, src, src_ids, dst_ids)
    assert [int(g["i"]) for g in got] == list(range(16))
    assert all(s.bytes == 2 * layout.block_bytes for s in stats)


def test_bad_block_ids_are_refused_by_the_sender(transport_kind):
    make, run = transport_kind
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, num_blocks=8)
    before = dst.clone()

    async def go():
        async with make(layout, dst) as rx:
            tx = make(layout)
            conn = await tx.connect(rx.address)
            assert conn.peer_num_blocks == 8
            with pytest.raises(ValueError, match="out of range"):
                await conn.send_blocks("r", src, [1], [8])
            with pytest.raises(ValueError, match="duplicate"):
                await conn.send_blocks("r", src, [1, 2], [3, 3])
            with pytest.raises(ValueError, match="src block ids"):
                await conn.send_blocks("r", src, [1], [2, 3])
            await tx.close()

    run(go())
    assert torch.equal(dst, before)


def test_overlong_request_id_is_refused_by_the_sender(transport_kind):
    """Request ids of up to `MAX_REQUEST_ID_BYTES` (UTF-8) go; a longer one is refused before
    a byte moves, and the receiver stays healthy with nothing dropped."""
    make, run = transport_kind
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, seed=1)
    before = dst.clone()
    longest = "ü" * (MAX_REQUEST_ID_BYTES // 2)

    async def go():
        async with make(layout, dst) as rx:
            tx = make(layout)
            conn = await tx.connect(rx.address)
            with pytest.raises(RequestTooLarge, match=f"longer than the {MAX_REQUEST_ID_BYTES}"):
                await conn.send_blocks(longest + "x", src, [1], [2])
            assert torch.equal(dst, before)
            await conn.send_blocks(longest, src, [1], [2])
            await rx.recv_blocks(longest, timeout=10)
            assert rx.healthy and rx.dropped_messages == 0
            await tx.close()

    run(go())
    assert torch.equal(dst[:, :, 2], src[:, :, 1])


def test_extras_only_transfer(transport_kind):
    make, run = transport_kind
    layout = tiny_layout()
    dst = random_kv(layout)
    before = dst.clone()

    async def go():
        async with make(layout, dst) as rx:
            tx = make(layout)
            conn = await tx.connect(rx.address)
            stats = await conn.send_blocks("x", random_kv(layout), [], [], {"t": torch.ones(2)})
            got = await rx.recv_blocks("x", timeout=10)
            await tx.close()
            return stats, got

    stats, got = run(go())
    assert stats.bytes == 0 and torch.equal(got["t"], torch.ones(2))
    assert torch.equal(dst, before)
