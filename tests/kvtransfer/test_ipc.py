"""The pull path: a receiver copying blocks out of a sender's GPU cache (CUDA IPC)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvtransfer import TransferError, ipc
from tests.kvtransfer.conftest import random_kv, run_then_stop, sample_extras, tiny_layout

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


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("engine", ["dst", "src"])
def test_pull_between_two_gpus_on_either_copy_engine(engine):
    """The sender's cache on GPU 1, the receiver's on GPU 0: either GPU's copy engines move
    the runs, and the receiver's stream still orders them (a write it queued before lands
    first; what it queues after sees the copied blocks)."""
    layout = tiny_layout("bfloat16")
    src = random_kv(layout, num_blocks=40, seed=1).to("cuda:1")
    dst = random_kv(layout, num_blocks=64, seed=2).to("cuda:0")
    runs = [(3, 60, 3), (9, 0, 1), (30, 7, 2)]
    want = _reference(dst.cpu(), src.cpu(), runs)
    stream = torch.cuda.Stream(device="cuda:0")
    stream.wait_stream(torch.cuda.current_stream("cuda:0"))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the copies must wait for this, then overwrite it
        dst[:, :, 60:63].fill_(7)
    assert ipc.pull(dst, src, runs, stream, engine) == len(runs)
    with torch.cuda.stream(stream):
        after = dst[:, :, 60:63].clone()
    stream.synchronize()
    assert torch.equal(dst.cpu(), want)
    assert torch.equal(after.cpu(), want[:, :, 60:63])


def test_pull_refuses_an_unknown_copy_engine():
    layout = tiny_layout()
    kv = random_kv(layout, num_blocks=8)
    with pytest.raises(ValueError, match="engine must be one of"):
        ipc.pull(kv.clone(), kv, [(0, 0, 1)], None, "both")
    pytest.importorskip("ucxx")
    from kvtransfer.ucx import UcxTransport

    with pytest.raises(ValueError, match="pull_engine must be one of"):
        UcxTransport(layout, pull_engine="both")


def test_pull_refuses_mismatched_caches():
    layout = tiny_layout()
    src = random_kv(layout, num_blocks=8)
    for other in (tiny_layout(num_layers=4), tiny_layout(head_dim=16), tiny_layout("bfloat16")):
        with pytest.raises(ValueError, match="shapes differ"):
            ipc.pull(random_kv(other, num_blocks=8), src, [(0, 0, 1)], None)


def test_export_and_open_refuse_what_they_cannot_share():
    with pytest.raises(ValueError, match="contiguous"):
        ipc.export(torch.zeros(4, 4).t())
    host = torch.zeros(4)
    assert ipc.open_export(ipc.export(host)) is host  # a host cache: within its process only
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


async def _first_and_second(tx, address, src):
    """Two requests on one link: (pull offered, first's path, second's path, what the link
    still pulls from)."""
    conn = await tx.connect(address)
    offered = bool(conn.ipc_link.pull_from)
    await conn.send_blocks("first", src, [1, 2, 3], [10, 11, 12], sample_extras())
    first = conn.last_path
    await conn.send_blocks("second", src, [4], [13])
    await tx.close()
    return offered, first, conn.last_path, conn.ipc_link.pull_from


@pytest.mark.gpu
@cuda
def test_a_refused_pull_falls_back_to_messages(ucx_loop):
    """The receiver offers a pull but cannot map the sender's cache: the first request still
    lands (sent again as UCX messages, not reported failed), and the link keeps to messages."""
    pytest.importorskip("ucxx")
    from kvtransfer.bench import spawn_receiver
    from kvtransfer.ucx import UcxTransport

    layout = tiny_layout()
    src = random_kv(layout, seed=3).cuda()
    proc, pipe, address = spawn_receiver(layout, 64, return_kv=True, device="cuda",
                                         target=_refusing_receiver)

    (offered, first, second, gpus), dst = run_then_stop(
        ucx_loop, _first_and_second(UcxTransport(layout, push=False), address, src),
        (proc, pipe), layout)
    assert offered and not gpus
    assert first == second == "staged"
    assert torch.equal(dst[:, :, 10:14], src.cpu()[:, :, 1:5])


@pytest.fixture
def host_pull(monkeypatch):
    """Host caches may pull within one process: the protocol runs without a GPU."""
    monkeypatch.setattr(ipc, "HOST_PULL", True)


def _pair(layout, dst, **kw):
    """(receiver, sender); the sender declines the push (these test the pull) unless told."""
    from kvtransfer.ucx import UcxTransport

    return UcxTransport(layout, dst), UcxTransport(layout, **{"push": False, **kw})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_pull_in_one_process_and_bad_ids(ucx_loop, host_pull, device):
    """Sender and receiver in one process (no IPC mapping: the receiver reads the exported
    tensor itself): blocks land by pull, with extras and checksums; a request whose src ids
    run past the sender's cache fails at the receiver with a clear error, and the link still
    works after; concurrent requests share the one export."""
    pytest.importorskip("ucxx")
    layout = tiny_layout("bfloat16")
    src = random_kv(layout, num_blocks=16, seed=4).to(device)
    dst = random_kv(layout, num_blocks=64, seed=5).to(device)

    async def go():
        rx, tx = _pair(layout, dst, checksum=True)
        async with rx:
            conn = await tx.connect(rx.address)
            await conn.send_blocks("a", src, [0, 1, 2, 7], [40, 41, 42, 5], sample_extras())
            path = conn.last_path
            extras = await rx.recv_blocks("a", timeout=10)
            conn.check = lambda *a: None  # let a bad src id reach the receiver
            with pytest.raises(TransferError, match="src block ids out of range"):
                await conn.send_blocks("bad", src, [15, 16], [0, 1])
            with pytest.raises(TransferError, match="out of range"):
                await rx.recv_blocks("bad", timeout=10)
            await asyncio.gather(*[conn.send_blocks(f"c{i}", src, [8 + i], [20 + i])
                                   for i in range(4)])
            await conn.send_blocks("b", src, [3], [6])
            assert conn.ipc_link.same_process  # exported by reference: no CUDA IPC handle
            paths = conn.last_path, len(conn.ipc_link.exports)
            await tx.close()
            return path, extras, paths

    path, extras, (last, exports) = ucx_loop.run(go(), timeout=60)
    if device == "cuda":
        torch.cuda.synchronize()
        spec = ipc.export(src, same_process=True)
        assert "uuid" not in spec and ipc.open_export(spec) is src
    assert path == last == "pull" and exports == 1
    assert torch.equal(extras["draft_tokens"].cpu(), sample_extras()["draft_tokens"])
    assert torch.equal(dst[:, :, 40:43], src[:, :, 0:3])
    assert torch.equal(dst[:, :, 5:7], src[:, :, [7, 3]])
    assert torch.equal(dst[:, :, 20:24], src[:, :, 8:12])


@pytest.mark.parametrize("asked", [None, "src"])
def test_the_sender_asks_for_a_copy_engine(ucx_loop, host_pull, monkeypatch, asked):
    """The receiver copies on its own default engine unless the sender asks for one."""
    pytest.importorskip("ucxx")
    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)
    used, real = [], ipc.pull

    def spy(dst_kv, src_kv, runs, stream, engine="dst"):
        used.append(engine)
        return real(dst_kv, src_kv, runs, stream, engine)

    monkeypatch.setattr(ipc, "pull", spy)

    async def go():
        rx, tx = _pair(layout, dst, **({"pull_engine": asked} if asked else {}))
        async with rx:
            conn = await tx.connect(rx.address)
            await conn.send_blocks("x", src, [1, 2], [5, 6])
            await tx.close()
            return conn.last_path

    assert ucx_loop.run(go(), timeout=60) == "pull"
    assert used == [asked or "dst"]
    assert torch.equal(dst[:, :, 5:7], src[:, :, 1:3])


@pytest.mark.parametrize("fail", ["map", "copy", "export"])
def test_a_failed_pull_lands_as_messages(ucx_loop, host_pull, monkeypatch, fail):
    """The receiver cannot map the cache, or the copy fails, or the sender cannot export it:
    the request still lands (sent as UCX messages, never reported failed to the receiver's
    inbox) and the link keeps to messages."""
    pytest.importorskip("ucxx")
    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)

    def boom(*a, **k):
        raise (RuntimeError if fail != "map" else ipc.IpcUnavailable)(f"{fail} refused")

    monkeypatch.setattr(ipc, {"map": "open_export", "copy": "pull", "export": "export"}[fail],
                        boom)
    got = []

    async def go():
        from kvtransfer.ucx import UcxTransport

        rx = UcxTransport(layout, dst, on_receive=lambda rid, r: got.append((rid, r)))
        async with rx:
            return await _first_and_second(UcxTransport(layout, push=False), rx.address, src)

    offered, first, second, left = ucx_loop.run(go(), timeout=60)
    assert offered and not left
    assert first == second == "staged"
    assert [rid for rid, _ in got] == ["first", "second"]
    assert all(isinstance(r, dict) for _, r in got)
    assert torch.equal(dst[:, :, 10:14], src[:, :, 1:5])


def test_no_pull_without_an_offer(ucx_loop, monkeypatch):
    """A host receiver offers nothing by default, and a sender told `ipc=False` ignores any
    offer: both keep to messages."""
    pytest.importorskip("ucxx")
    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)

    async def go(**kw):
        rx, tx = _pair(layout, dst, **kw)
        async with rx:
            conn = await tx.connect(rx.address)
            await conn.send_blocks("x", src, [1], [2])
            await tx.close()
            return conn.ipc_link.pull_from, conn.last_path

    assert ucx_loop.run(go(), timeout=60) == (set(), "staged")
    monkeypatch.setattr(ipc, "HOST_PULL", True)
    assert ucx_loop.run(go(ipc=False), timeout=60) == (set(), "staged")


@pytest.mark.gpu
@cuda
def test_early_ack_returns_only_once_the_copy_is_done(ucx_loop):
    """Without checksums a pull is acked as soon as its copy is queued; `send_blocks` must
    still return only once the blocks are in (it waits on the receiver's event): each check
    right after it sees every block."""
    pytest.importorskip("ucxx")
    layout = tiny_layout("bfloat16", num_layers=8, num_kv_heads=8, head_dim=128)  # 512 KiB
    src = random_kv(layout, num_blocks=256, seed=6).cuda()
    dst = torch.zeros_like(src)

    async def go():
        rx, tx = _pair(layout, dst)
        async with rx:
            conn = await tx.connect(rx.address)
            early = conn.ipc_link.early_ack_gpu is not None
            same = []
            for i in range(5):
                lo = 0 if i % 2 else 128
                await conn.send_blocks(f"r{i}", src, list(range(lo, lo + 128)),
                                       list(range(128 - lo, 256 - lo)))
                same.append(torch.equal(dst[:, :, 128 - lo:256 - lo], src[:, :, lo:lo + 128]))
                dst.zero_()
                torch.cuda.synchronize()
            path = conn.last_path
            await tx.close()
            return early, path, same

    early, path, same = ucx_loop.run(go(), timeout=60)
    assert early and path == "pull"
    assert same == [True] * 5


def _cycles_for(seconds: float) -> int:
    """`torch.cuda._sleep` cycles that hold the GPU about `seconds`, timed here: the rate of
    `_sleep` differs between GPUs."""
    probe = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    assert ms > 1.0, f"torch.cuda._sleep({probe}) held the GPU {ms:.3f} ms: no way to queue work"
    return int(probe * seconds * 1000 / ms)


def _send_behind_a_long_kernel(ucx_loop, push: bool):
    """Two processes on the GPU: the sender's writes of 8 blocks are queued behind a ~0.5 s
    kernel when it sends them. Returns (the transfer's trace, its path, the connection's
    ready-event pools, whether the receiver's blocks hold the new data)."""
    pytest.importorskip("ucxx")
    from kvtransfer.bench import spawn_receiver
    from kvtransfer.ucx import UcxTransport

    layout = tiny_layout(head_dim=64)
    src = random_kv(layout, num_blocks=64, seed=8).cuda()
    new = random_kv(layout, num_blocks=8, seed=9).cuda()
    cycles = _cycles_for(0.5)
    proc, pipe, address = spawn_receiver(layout, 64, return_kv=True, device="cuda")

    async def go():
        tx = UcxTransport(layout, push=None if push else False)
        conn = await tx.connect(address)
        await conn.send_blocks("warm", src, [0], [0])
        conn.trace = True
        torch.cuda._sleep(cycles)  # ~0.5 s on the current stream of this thread
        src[:, :, 8:16].copy_(new)  # queued behind it
        await conn.send_blocks("x", src, list(range(8, 16)), list(range(20, 28)))
        trace, path = conn.last_trace, conn.last_path
        pools = {k: len(v) for k, v in conn.ipc_link.ready.items()}  # close() drops the events
        await tx.close()
        return trace, path, pools

    (trace, path, pools), dst = run_then_stop(ucx_loop, go(), (proc, pipe), layout)
    return trace, path, pools, torch.equal(dst[:, :, 20:28], new.cpu())


@pytest.mark.gpu
@cuda
def test_a_pull_waits_on_the_gpu_for_the_senders_writes(ucx_loop):
    """The sender's writes of the blocks are still queued behind a long kernel when it sends:
    it does not wait for them on the host (the header goes at once), and the receiver's copy
    (in its own process) waits for them on the GPU, through the sender's ready event."""
    trace, path, pools, landed = _send_behind_a_long_kernel(ucx_loop, push=False)
    assert landed and path == "pull" and pools and all(pools.values())
    assert trace["ready"][0] < 0.1 < trace["acked"], trace  # no host wait before the header


# ---- the push path: the sender copies into the receiver's cache -----------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
@pytest.mark.parametrize("checksum", [False, True])
def test_push_in_one_process(ucx_loop, host_pull, device, checksum):
    """Sender and receiver in one process (the receiver's cache found by reference): blocks
    land by push, with extras, with or without checksums (acked at once without), for
    concurrent requests too; a dst id past the cache fails the push before any copy, and the
    request goes as messages, where the receiver refuses it with a clear error."""
    pytest.importorskip("ucxx")
    layout = tiny_layout("bfloat16")
    src = random_kv(layout, num_blocks=16, seed=4).to(device)
    dst = random_kv(layout, num_blocks=64, seed=5).to(device)

    async def go():
        rx, tx = _pair(layout, dst, checksum=checksum, push=None)
        async with rx:
            conn = await tx.connect(rx.address)
            mapped = conn.ipc_link.push_dst is dst
            await conn.send_blocks("a", src, [0, 1, 2, 7], [40, 41, 42, 5], sample_extras())
            path = conn.last_path
            extras = await rx.recv_blocks("a", timeout=10)
            await asyncio.gather(*[conn.send_blocks(f"c{i}", src, [8 + i], [20 + i])
                                   for i in range(4)])
            paths = conn.last_path
            conn.check = lambda *a: None  # let a bad dst id reach the copy
            with pytest.raises(TransferError, match="out of range"):
                await conn.send_blocks("bad", src, [1], [64])
            after = conn.last_path, conn.ipc_link.push_dst
            await tx.close()
            return mapped, path, paths, extras, after

    mapped, path, paths, extras, (after, push_dst) = ucx_loop.run(go(), timeout=60)
    if device == "cuda":
        torch.cuda.synchronize()
    assert mapped and path == paths == "push"
    assert after == "staged" and push_dst is None  # the failed push: messages from then on
    assert torch.equal(extras["draft_tokens"].cpu(), sample_extras()["draft_tokens"])
    assert torch.equal(dst[:, :, 40:43], src[:, :, 0:3])
    assert torch.equal(dst[:, :, 5:6], src[:, :, 7:8])
    assert torch.equal(dst[:, :, 20:24], src[:, :, 8:12])


def test_push_needs_both_ends(ucx_loop, host_pull):
    """A receiver told `push=False` offers no cache and a sender told so takes none: the pull
    carries the blocks; `pull=False` likewise for the pull; `ipc=False` turns both off."""
    pytest.importorskip("ucxx")
    from kvtransfer.ucx import UcxTransport

    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)

    async def go(rx_kw, tx_kw):
        rx, tx = UcxTransport(layout, dst, **rx_kw), UcxTransport(layout, **tx_kw)
        async with rx:
            conn = await tx.connect(rx.address)
            await conn.send_blocks("x", src, [1, 2], [3, 4])
            await tx.close()
            return conn.last_path

    assert ucx_loop.run(go({}, {}), timeout=60) == "push"
    assert ucx_loop.run(go({"push": False}, {}), timeout=60) == "pull"
    assert ucx_loop.run(go({}, {"push": False}), timeout=60) == "pull"
    assert ucx_loop.run(go({"ipc": False}, {}), timeout=60) == "staged"
    assert ucx_loop.run(go({"push": False}, {"pull": False}), timeout=60) == "staged"
    assert ucx_loop.run(go({"pull": False}, {"pull": False}), timeout=60) == "push"
    assert torch.equal(dst[:, :, 3:5], src[:, :, 1:3])


@pytest.mark.parametrize("fail", ["map", "copy"])
def test_a_failed_push_lands_as_messages(ucx_loop, host_pull, monkeypatch, fail):
    """The sender cannot map the receiver's cache (then it pulls), or its copy fails (then
    that request and the link's next go as messages); either way the blocks land."""
    pytest.importorskip("ucxx")
    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)
    real_open, real_copy = ipc.open_export, ipc.copy_runs

    def refuse_open(spec):
        if spec["handle"].endswith(str(dst.data_ptr())):  # the receiver's cache only
            raise ipc.IpcUnavailable("refused by the test")
        return real_open(spec)

    def refuse_push(d, s, runs, stream):
        if d is dst and s is src:
            raise RuntimeError("copy refused by the test")
        return real_copy(d, s, runs, stream)

    if fail == "map":
        monkeypatch.setattr(ipc, "open_export", refuse_open)
    else:
        monkeypatch.setattr(ipc, "copy_runs", refuse_push)

    async def go():
        rx, tx = _pair(layout, dst, push=None)
        async with rx:
            return await _first_and_second(tx, rx.address, src)

    offered, first, second, left = ucx_loop.run(go(), timeout=60)
    assert offered
    assert (first, second) == (("pull", "pull") if fail == "map" else ("staged", "staged"))
    assert torch.equal(dst[:, :, 10:14], src[:, :, 1:5])


@pytest.mark.gpu
@cuda
def test_a_push_copies_after_the_senders_writes(ucx_loop):
    """Two processes: the sender's writes are still queued behind a long kernel when it
    sends; its copy into the receiver's cache runs after them (on its own stream), the header
    goes at once, and `send_blocks` returns only once the copy is done."""
    trace, path, _, landed = _send_behind_a_long_kernel(ucx_loop, push=True)
    assert landed and path == "push"
    assert trace["ready"][0] < 0.1 < trace["acked"], trace


def test_a_receiver_exports_its_cache_once_for_all_links(ucx_loop, host_pull, monkeypatch):
    """Each CUDA export takes a slot of torch's IPC reference counts: a receiver makes its
    cache's export once, and every sender that connects is offered that one."""
    pytest.importorskip("ucxx")
    from kvtransfer.ucx import UcxTransport

    layout = tiny_layout()
    src, dst = random_kv(layout, seed=3), random_kv(layout, seed=4)
    made, real = [], ipc.export
    monkeypatch.setattr(ipc, "export", lambda kv, **kw: made.append(kv is dst) or real(kv, **kw))

    async def go():
        rx = UcxTransport(layout, dst)
        async with rx:
            paths = []
            for i in range(3):
                tx = UcxTransport(layout)
                conn = await tx.connect(rx.address)
                await conn.send_blocks(f"r{i}", src, [i], [10 + i])
                paths.append(conn.last_path)
                await tx.close()
            return paths

    assert ucx_loop.run(go(), timeout=60) == ["push"] * 3
    assert made == [True]
    assert torch.equal(dst[:, :, 10:13], src[:, :, 0:3])
