"""The pull path: a receiver copying blocks out of a sender's GPU cache (CUDA IPC)."""

from __future__ import annotations

import os

import pytest
import torch

from kvtransfer import TransferError, ipc
from tests.kvtransfer.conftest import random_kv, sample_extras, tiny_layout

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(dst, src, runs):
    out = dst.clone()
    for s, d, k in runs:
        out[:, :, d:d + k] = src[:, :, s:s + k]
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_pull_copies_each_run_across_pitches(device, monkeypatch):
    """Caches of different block counts (so different row pitches): each run lands whole, in
    every layer and K/V, and nothing else moves; on a GPU one 2-D copy per run, or one copy
    per row where the pitch is past the 2-D limit."""
    layout = tiny_layout()
    src = random_kv(layout, num_blocks=40, seed=1).to(device)
    dst = random_kv(layout, num_blocks=64, seed=2).to(device)
    runs = [(3, 60, 3), (9, 0, 1), (30, 7, 2)]
    want = _reference(dst, src, runs)
    stream = torch.cuda.Stream(device=device) if device == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # the clone above reads dst
    calls = ipc.pull(dst, src, runs, stream)
    if stream is not None:
        stream.synchronize()
        assert calls == len(runs)  # one cudaMemcpy2DAsync a run
    assert torch.equal(dst, want)
    if device == "cuda":
        monkeypatch.setattr(ipc, "MAX_PITCH", 1)  # every pitch too wide: row by row
        dst2 = random_kv(layout, num_blocks=64, seed=2).to(device)
        calls = ipc.pull(dst2, src, runs, stream)
        stream.synchronize()
        assert calls == len(runs) * layout.num_layers * 2
        assert torch.equal(dst2, want)


def test_pull_refuses_mismatched_caches():
    layout = tiny_layout()
    src = random_kv(layout, num_blocks=8)
    with pytest.raises(ValueError, match="shapes differ"):
        ipc.pull(random_kv(tiny_layout(num_layers=4), num_blocks=8), src, [(0, 0, 1)], None)


def test_export_and_open_refuse_what_they_cannot_share():
    with pytest.raises(ValueError, match="CUDA"):
        ipc.export(torch.zeros(4))
    spec = {"pid": os.getpid() + 1, "uuid": "GPU-not-on-this-host", "handle": "00"}
    with pytest.raises(ipc.IpcUnavailable, match="not visible"):
        ipc.open_export(spec)
    with pytest.raises(ipc.IpcUnavailable, match="no longer holds"):
        ipc.open_export({"pid": os.getpid(), "handle": "ff"})


# ---- the pull path inside the UCX transport (GPU) ------------------------------------------

def _refusing_receiver(*args):
    """A receiver process whose GPU mapping always fails (as for a process pinned to another
    GPU that still offered to pull): its senders must fall back to UCX messages."""
    from kvtransfer import bench

    def refuse(spec):
        raise ipc.IpcUnavailable("refused by the test")

    ipc.open_export = refuse
    bench.receiver_main(*args)


@pytest.mark.gpu
@cuda
def test_a_refused_pull_falls_back_to_messages(ucx_loop):
    """The receiver offers a pull but cannot map the sender's cache: the first request still
    lands (sent again as UCX messages, not reported failed), and the link keeps to messages."""
    pytest.importorskip("ucxx")
    from kvtransfer.bench import spawn_receiver, stop_receiver
    from kvtransfer.ucx import UcxTransport

    layout = tiny_layout()
    src = random_kv(layout, seed=3).cuda()
    proc, pipe, address = spawn_receiver(layout, 64, return_kv=True, device="cuda",
                                         target=_refusing_receiver)

    async def go():
        tx = UcxTransport(layout)
        conn = await tx.connect(address)
        offered = bool(conn.peer_gpus)
        await conn.send_blocks("first", src, [1, 2, 3], [10, 11, 12], sample_extras())
        first = conn.last_path
        await conn.send_blocks("second", src, [4], [13])
        await tx.close()
        return offered, first, conn.last_path, conn.peer_gpus

    try:
        offered, first, second, gpus = ucx_loop.run(go(), timeout=60)
    finally:
        dst = stop_receiver(proc, pipe, layout)
    assert offered and not gpus
    assert first == second == "staged"
    assert torch.equal(dst[:, :, 10:14], src.cpu()[:, :, 1:5])


@pytest.mark.gpu
@cuda
def test_pull_in_one_process_and_bad_ids(ucx_loop):
    """Sender and receiver in one process (no IPC mapping: the receiver reads the exported
    tensor itself): blocks land by pull; a request whose src ids run past the sender's cache
    fails at the receiver with a clear error, and the link still works after."""
    pytest.importorskip("ucxx")
    from kvtransfer.ucx import UcxTransport

    layout = tiny_layout("bfloat16")
    src = random_kv(layout, num_blocks=16, seed=4).cuda()
    dst = random_kv(layout, num_blocks=64, seed=5).cuda()

    async def go():
        async with UcxTransport(layout, dst) as rx:
            tx = UcxTransport(layout, checksum=True)
            conn = await tx.connect(rx.address)
            await conn.send_blocks("a", src, [0, 1, 2, 7], [40, 41, 42, 5], sample_extras())
            path = conn.last_path
            extras = await rx.recv_blocks("a", timeout=10)
            conn.peer_num_blocks = 64
            conn.check = lambda *a: None  # let a bad src id reach the receiver
            with pytest.raises(TransferError, match="src block ids out of range"):
                await conn.send_blocks("bad", src, [15, 16], [0, 1])
            with pytest.raises(TransferError, match="out of range"):
                await rx.recv_blocks("bad", timeout=10)
            await conn.send_blocks("b", src, [3], [6])
            await tx.close()
            return path, extras

    path, extras = ucx_loop.run(go(), timeout=60)
    torch.cuda.synchronize()
    assert path == "pull"
    assert torch.equal(extras["draft_tokens"], sample_extras()["draft_tokens"])
    assert torch.equal(dst[:, :, 40:43], src[:, :, 0:3])
    assert torch.equal(dst[:, :, 5:7], src[:, :, [7, 3]])
