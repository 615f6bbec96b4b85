"""UCX specifics: checksums, receiver-side refusals, timeouts, and real two-process transfers."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvtransfer import BlockLayout, LayoutMismatch, TransferError
from tests.kvtransfer.conftest import random_kv, run_then_stop, sample_extras, tiny_layout

pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed: UCX transport untested")

from kvtransfer import wire  # noqa: E402
from kvtransfer.bench import measure_raw, spawn_receiver, stop_receiver  # noqa: E402
from kvtransfer.ucx import UcxTransport  # noqa: E402


@pytest.mark.parametrize("mode", ["worker", "listener"])
def test_layer_chunks_with_checksum(ucx_loop, mode):
    layout = tiny_layout("bfloat16")
    src, dst = random_kv(layout, seed=5), random_kv(layout, seed=6)

    async def go():
        async with UcxTransport(layout, dst, mode=mode) as rx:
            tx = UcxTransport(layout, num_chunks=3, checksum=True)
            conn = await tx.connect(rx.address)
            await conn.send_blocks("r", src, [1, 2, 3], [4, 5, 6], sample_extras())
            await tx.close()

    ucx_loop.run(go(), timeout=60)
    assert torch.equal(dst[:, :, [4, 5, 6]], src[:, :, [1, 2, 3]])


def test_trace_has_both_sides_in_order(ucx_loop):
    """With `trace` on, a transfer leaves its timeline: the sender's stamps and the
    receiver's (returned in the ack), on one clock, in causal order."""
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, seed=1)

    async def go():
        async with UcxTransport(layout, dst) as rx:
            tx = UcxTransport(layout, num_chunks=3)
            conn = await tx.connect(rx.address)
            await conn.send_blocks("quiet", src, [1, 2], [3, 4])
            quiet = conn.last_trace
            conn.trace = True
            stats = await conn.send_blocks("traced", src, [5, 6], [7, 8], sample_extras())
            await tx.close()
            return quiet, conn.last_trace, stats

    quiet, t, stats = ucx_loop.run(go(), timeout=60)
    assert quiet is None
    rx = t["rx"]
    assert t["chunks"] == 3 and len(t["ready"]) == 3 and len(rx["landed"]) == 3
    assert 0 <= t["ready"][0] <= t["ready"][-1] <= rx["landed"][-1]
    assert 0 < rx["header"] <= rx["landed"][0] <= rx["landed"][-1] <= rx["scattered"]
    assert rx["scattered"] <= rx["synced"] <= rx["ack"] <= t["acked"]
    assert t["sent"] <= t["acked"] == pytest.approx(stats.seconds)
    assert torch.equal(dst[:, :, [7, 8]], src[:, :, [5, 6]])


def test_corrupted_payload_is_reported(ucx_loop):
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, seed=1)

    async def go():
        async with UcxTransport(layout, dst) as rx:
            tx = UcxTransport(layout, checksum=True)
            conn = await tx.connect(rx.address)
            send_payload = conn._send_payload

            async def corrupt(*args):  # what a flipped bit in flight looks like to the receiver
                sends, sums = await send_payload(*args)
                return sends, [s ^ 1 for s in sums]

            conn._send_payload = corrupt
            with pytest.raises(TransferError, match="checksum"):
                await conn.send_blocks("bad", src, [1], [2])
            with pytest.raises(TransferError, match="checksum"):
                await rx.recv_blocks("bad", timeout=10)
            await tx.close()

    ucx_loop.run(go(), timeout=60)


def test_receiver_refuses_by_itself(ucx_loop):
    """The receiver checks too: bad ids from a sender that skipped its own checks never land,
    and the link keeps working afterwards."""
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, num_blocks=8, seed=1)
    before = dst.clone()

    async def go():
        async with UcxTransport(layout, dst) as rx:
            tx = UcxTransport(layout)
            conn = await tx.connect(rx.address)
            conn.peer_num_blocks = 100  # a sender with a wrong idea of the peer
            with pytest.raises(TransferError, match="out of range"):
                await conn.send_blocks("bad", src, [1], [50])
            with pytest.raises(TransferError):
                await rx.recv_blocks("bad", timeout=10)
            assert torch.equal(dst, before)
            await conn.send_blocks("good", src, [1], [7])
            await tx.close()

    ucx_loop.run(go(), timeout=60)
    assert torch.equal(dst[:, :, 7], src[:, :, 1])


@pytest.mark.parametrize("mode", ["worker", "listener"])
def test_direct_runs_land_in_place(ucx_loop, mode):
    """Direct path: three runs of consecutive ids (with a lone block) go straight from cache to
    cache, with checksums; nothing outside the dst ids changes, and the next request with
    scattered ids falls back to the staged path on the same link."""
    layout = tiny_layout("bfloat16")
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)
    before = dst.clone()
    s_ids, d_ids = [1, 2, 3, 10, 11, 20], [4, 5, 6, 30, 31, 7]

    async def go():
        async with UcxTransport(layout, dst, mode=mode) as rx:
            tx = UcxTransport(layout, checksum=True, direct=True)
            conn = await tx.connect(rx.address)
            conn.trace = True
            await conn.send_blocks("d", src, s_ids, d_ids, sample_extras())
            went_direct, trace = conn.last_direct, conn.last_trace
            got = await rx.recv_blocks("d", timeout=10)
            # 50 runs of one block: 300 messages, more than the tag space holds.
            ids = list(range(50))
            await conn.send_blocks("s", src, ids, list(reversed(ids)))
            staged = not conn.last_direct
            await tx.close()
            return went_direct, trace, got, staged

    went_direct, trace, got, staged = ucx_loop.run(go(), timeout=60)
    assert went_direct and staged
    assert trace["chunks"] == 0 and len(trace["rx"]["landed"]) == 1
    assert trace["ready"][0] <= trace["rx"]["landed"][0] <= trace["rx"]["ack"] <= trace["acked"]
    assert torch.equal(got["draft_tokens"], sample_extras()["draft_tokens"])
    ids = list(range(50))
    assert torch.equal(dst[:, :, list(reversed(ids))], src[:, :, ids])
    untouched = [b for b in range(64) if b not in ids]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])


def test_direct_refusal_drains_and_link_survives(ucx_loop):
    """A direct request whose runs do not match its dst ids is refused by the receiver, which
    still drains every message; the cache is untouched and the link keeps working."""
    layout = tiny_layout()
    src, dst = random_kv(layout), random_kv(layout, num_blocks=16, seed=1)
    before = dst.clone()

    async def go():
        async with UcxTransport(layout, dst) as rx:
            tx = UcxTransport(layout, direct=True, timeout=10)
            conn = await tx.connect(rx.address)
            send = conn._send

            def lying_header(buf, seq, kind):  # runs that point elsewhere than dst
                hdr = wire.decode(buf) if kind == wire.HEADER else {}
                if hdr.get("op") == "send":
                    hdr["direct"] = [[9, 2]]
                    buf = wire.encode(hdr)
                return send(buf, seq, kind)

            conn._send = lying_header
            with pytest.raises(TransferError, match="direct runs"):
                await conn.send_blocks("bad", src, [1, 2], [3, 4])
            assert torch.equal(dst, before)
            conn._send = send
            await conn.send_blocks("good", src, [1, 2], [3, 4])
            await tx.close()

    ucx_loop.run(go(), timeout=60)
    assert torch.equal(dst[:, :, [3, 4]], src[:, :, [1, 2]])


def test_direct_plan():
    assert wire.block_runs([1, 2, 3, 7, 8, 9], [5, 6, 9, 1, 2, 3]) == [
        (1, 5, 2), (3, 9, 1), (7, 1, 3)]
    assert wire.block_runs([], []) == []
    mib = 1 << 20
    assert wire.direct_min_bytes("cpu") == mib and wire.direct_min_bytes("cuda") == 16 * mib
    # 4 layers x K/V x 1 run = 8 messages of 3 blocks x 1 MiB each.
    assert wire.plan_direct([0, 1, 2], [5, 6, 7], 4, mib, None) == [(0, 5, 3)]
    assert wire.plan_direct([0, 1, 2], [5, 6, 7], 4, mib, None, 16 * mib) is None
    # Messages of 512 KiB: under the 1 MiB default, staged unless forced.
    assert wire.plan_direct([0, 2], [5, 7], 4, mib // 2, None) is None
    assert wire.plan_direct([0, 2], [5, 7], 4, mib // 2, True) == [(0, 5, 1), (2, 7, 1)]
    assert wire.plan_direct([0, 1, 2], [5, 6, 7], 4, 1 << 20, False) is None
    many = list(range(0, 400, 2))  # 200 runs x 2 x 4 messages: more than the tags
    assert wire.plan_direct(many, many, 4, 1 << 30, True) is None
    assert wire.plan_direct([], [], 4, 1 << 20, True) is None


def test_refusal_comes_from_the_receiver(ucx_loop):
    async def go():
        async with UcxTransport(tiny_layout(), random_kv(tiny_layout())) as rx:
            tx = UcxTransport(tiny_layout(head_dim=16))
            with pytest.raises(LayoutMismatch, match="receiver refused") as err:
                await tx.connect(rx.address)
            await tx.close()
            assert not rx._links
            return err.value

    assert ucx_loop.run(go(), timeout=60).fields == ("head_dim",)


def test_missing_ack_times_out(ucx_loop):
    """A receiver that went away: the sender's lease expires instead of hanging."""
    layout = tiny_layout()

    async def go():
        rx = UcxTransport(layout, random_kv(layout))
        await rx.start()
        conn = await UcxTransport(layout, timeout=0.5).connect(rx.address)
        await rx.close()
        with pytest.raises(TransferError, match="no ack"):
            await conn.send_blocks("late", random_kv(layout), [1], [2])
        await conn.close()

    ucx_loop.run(go(), timeout=60)


def test_idle_receiver_does_not_spin(ucx_loop):
    """Pending receives must wait on futures, not busy-yield: the hosts have 2 cores."""
    layout = tiny_layout()

    async def go():
        async with UcxTransport(layout, random_kv(layout)) as rx:
            conn = await UcxTransport(layout).connect(rx.address)
            cpu = time.process_time()
            await asyncio.sleep(0.5)  # an accept loop, a serve loop: both waiting
            cpu = time.process_time() - cpu
            await conn.close()
            return cpu

    assert ucx_loop.run(go(), timeout=60) < 0.2


def test_connecting_to_a_closed_receiver_fails_fast(ucx_loop):
    layout = tiny_layout()

    async def go():
        rx = UcxTransport(layout, random_kv(layout))
        await rx.start()
        address = rx.address
        await rx.close()
        tx = UcxTransport(layout, timeout=0.5)
        with pytest.raises(ConnectionError, match="no handshake reply"):
            await tx.connect(address)
        await tx.close()

    ucx_loop.run(go(), timeout=60)


@pytest.mark.parametrize("mode,device,direct,ipc,checksum,push", [
    ("worker", "cpu", None, None, False, None), ("listener", "cpu", None, None, False, None),
    ("worker", "cpu", False, None, False, None),
    pytest.param("worker", "cuda", True, False, False, None, marks=pytest.mark.gpu),
    pytest.param("worker", "cuda", False, False, False, None, marks=pytest.mark.gpu),
    pytest.param("worker", "cuda", None, None, True, False, marks=pytest.mark.gpu),
    pytest.param("worker", "cuda", None, None, False, False, marks=pytest.mark.gpu),
    pytest.param("worker", "cuda", None, None, True, None, marks=pytest.mark.gpu),
    pytest.param("worker", "cuda", None, None, False, None, marks=pytest.mark.gpu)])
def test_two_processes(ucx_loop, mode, device, direct, ipc, checksum, push, capsys):
    """A receiver in a spawned process, over shared memory (worker) or TCP (listener). The big
    request's 2 MiB messages go direct on the host by default (forced on a GPU), staged when
    told; GPU caches go by push, or by pull where the sender declines it, unless `ipc=False`."""
    layout = tiny_layout(head_dim=64)  # 48 KiB per block
    src = random_kv(layout, num_blocks=512, seed=7).to(device)
    proc, pipe, address = spawn_receiver(layout, 512, mode, return_kv=True, device=device,
                                         ipc=ipc)
    big = list(range(256))
    pulls = device == "cuda" and ipc is not False
    ipc_path = "push" if push is None else "pull"

    async def go():
        tx = UcxTransport(layout, direct=direct, ipc=ipc, checksum=checksum, push=push)
        conn = await tx.connect(address)
        assert bool(conn.ipc_link.pull_from) == pulls
        assert (conn.ipc_link.early_ack_gpu is not None) == pulls
        await conn.send_blocks("warm", src, big, big)
        stats = await conn.send_blocks("big", src, big, [b + 256 for b in big])
        went_direct, path = conn.last_direct, conn.last_path
        await conn.send_blocks("a", src, [9, 8, 7], [0, 1, 2], sample_extras())
        assert conn.last_direct == (direct is True)  # 8 KiB messages: staged unless forced
        assert conn.last_path == (ipc_path if pulls else "direct" if direct else "staged")
        assert (conn.ipc_link.push_dst is not None) == (pulls and push is None)
        await tx.close()
        return stats, went_direct, path

    (stats, went_direct, path), dst = run_then_stop(ucx_loop, go(), (proc, pipe), layout)
    assert dst is not None and proc.exitcode == 0
    src = src.cpu()
    assert torch.equal(dst[:, :, [0, 1, 2]], src[:, :, [9, 8, 7]])
    assert torch.equal(dst[:, :, 3:256], src[:, :, 3:256])
    assert torch.equal(dst[:, :, 256:], src[:, :, :256])
    assert stats.bytes == 256 * layout.block_bytes
    assert went_direct == (direct is not False and not pulls)
    assert path == (ipc_path if pulls else "direct" if direct is not False else "staged")
    with capsys.disabled():
        print(f"\n[kvtransfer] ucx {mode} {device} {path}, 2 processes: "
              f"{stats.bytes / 2**20:.1f} MiB in {stats.seconds * 1e3:.1f} ms = "
              f"{stats.bytes_per_s / 1e9:.2f} GB/s")


def test_raw_baseline_between_processes(ucx_loop):
    """`measure_raw`: bare tagged messages to a receiver process, whole and in pieces, small
    and large enough for a rendezvous, several requests on one receiver."""
    layout = tiny_layout()
    proc, pipe, address = spawn_receiver(layout, 4)
    try:
        rows = ucx_loop.run(measure_raw(address, "cpu", [64 << 10, 4 << 20], [1, 3], 2),
                            timeout=60)
        again = ucx_loop.run(measure_raw(address, "cpu", [4 << 20], [1], 1), timeout=60)
    finally:
        stop_receiver(proc, pipe, layout)
    assert [(r["bytes"], r["pieces"]) for r in rows] == [
        (64 << 10, 1), (64 << 10, 3), (4 << 20, 1), (4 << 20, 3)]
    assert all(0 < r["landed_ms"] and 0 < r["sent_ms"] <= r["acked_ms"] for r in rows + again)
    assert proc.exitcode == 0



def test_bench_command_rows():
    """`python -m kvtransfer.bench` (its own process: ucxx binds to one event loop per
    process): one JSON row per transfer setting, then the bare UCX and the plain-copy
    baselines of the same bytes."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvtransfer.bench", "--blocks", "2",
                           "--layers", "2", "--chunks", "1", "--reps", "2", "--raw", "--copy",
                           "--ipc", "off"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    layout = BlockLayout("bench", "float32", 16, 2, 3, 64, 1)  # bench's default heads
    nbytes = 2 * layout.block_bytes
    assert [r.get("path") for r in rows] == ["staged", None, None]
    assert rows[0]["bytes"] == rows[1]["bytes"] == rows[2]["bytes"] == nbytes
    assert rows[2]["copy"] == "cpu" and rows[2]["gb_s"] > 0
