"""Throughput of UCX block transfers between two processes on this host.

    python -m kvtransfer.bench --mode worker --chunks 1 31 --blocks 128 --direct on off

The default shape is SmolLM2-135M with its EAGLE-3 draft layer (31 KV layers, fp32, 16-token
blocks). `--raw` adds bare UCX (`measure_raw`) as the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from kvtransfer.layout import BlockLayout

log = logging.getLogger(__name__)
# Tag kinds of the raw baseline; the transport uses kinds 0-5 and 16 up (`wire`).
RAW_CTRL, RAW_ACK = 8, 9


def receiver_main(pipe: Pipe, layout: dict[str, Any], num_blocks: int, mode: str,
                  return_kv: bool, progress: str = "thread", device: str = "cpu",
                  ipc: bool | None = None) -> None:
    """Child process: a receiver that serves until the parent says stop."""
    from kvtransfer.ucx import UcxTransport

    lay = BlockLayout.from_dict(layout)
    kv = torch.zeros(lay.kv_shape(num_blocks), dtype=lay.torch_dtype, device=device)

    async def serve() -> None:
        from kvtransfer import wire

        async with UcxTransport(lay, kv, mode=mode, progress_mode=progress, ipc=ipc) as rx:
            raw = asyncio.ensure_future(raw_server(rx._id, device))
            pipe.send(rx.address)
            await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
            me = await wire.endpoint_to_worker(wire.worker_address_hex())
            await wire.send(me, wire.encode({"op": "stop"}), wire.tag(rx._id, 0, RAW_CTRL))
            await asyncio.wait_for(raw, 10)
            wire.drop(me)

    asyncio.run(serve())
    # As numpy bytes: a pickled torch tensor would travel as a shared-memory fd that dies
    # with this process.
    pipe.send(kv.cpu().view(torch.uint8).numpy() if return_kv else None)


def spawn_receiver(layout: BlockLayout, num_blocks: int, mode: str = "worker",
                   return_kv: bool = False, progress: str = "thread", device: str = "cpu",
                   ipc: bool | None = None, target: Any = None
                   ) -> tuple[Any, Pipe, dict[str, Any]]:
    """Start a receiver in a fresh (spawned) process; return it, its pipe and its address.
    Stop it with `stop_receiver`. `ipc` False: it offers no pull (UCX messages only);
    `target`: a function to run instead of `receiver_main`, with its arguments."""
    ctx = mp.get_context("spawn")  # never fork a process that has loaded UCX / CUDA
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target or receiver_main, daemon=True,
                       args=(theirs, layout.to_dict(), num_blocks, mode, return_kv, progress,
                             device, ipc))
    proc.start()
    if not ours.poll(60):
        proc.kill()
        raise RuntimeError("the receiver process did not come up")
    return proc, ours, ours.recv()


def stop_receiver(proc: Any, pipe: Pipe, layout: BlockLayout,
                  timeout: float = 30.0) -> torch.Tensor | None:
    """Stop a receiver from `spawn_receiver`; return its kv_cache if it was asked to."""
    pipe.send("stop")
    raw = pipe.recv() if pipe.poll(timeout) else None
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    return None if raw is None else torch.from_numpy(raw).view(layout.torch_dtype)


async def measure(args: argparse.Namespace, layout: BlockLayout,
                  address: dict[str, Any]) -> list[dict[str, Any]]:
    """Time `send_blocks` of blocks 0..args.blocks-1 (or `args.ids`: (src, dst) lists), once
    per entry of `args.chunks` and `args.direct` (None: the transport picks): a warm-up, then
    `args.reps` timed. Optional `args.ipc`, `args.push`, `args.pull_engine` go to the sender's
    `UcxTransport`; `args.trace` adds each transfer's timeline and `landed_ms`."""
    from kvtransfer import ipc
    from kvtransfer.ucx import UcxTransport

    # Made on the device: a GiB of host randn costs seconds.
    kv = torch.randn(layout.kv_shape(args.blocks), device=args.device).to(layout.torch_dtype)
    src, dst = getattr(args, "ids", None) or (list(range(args.blocks)),) * 2
    trace = getattr(args, "trace", False)
    rows = []
    directs = getattr(args, "direct", [None])
    # A forced direct transfer has no chunks: once is enough.
    for chunks, direct in [(c, d) for d in directs for c in args.chunks[:1 if d else None]]:
        tx = UcxTransport(layout, num_chunks=chunks, checksum=args.checksum,
                          progress_mode=args.progress, direct=direct,
                          ipc=getattr(args, "ipc", None),
                          pull_engine=getattr(args, "pull_engine", None) or ipc.DEFAULT_ENGINE,
                          push=getattr(args, "push", None))
        traces = []
        async with await tx.connect(address) as conn:
            conn.trace = trace
            await conn.send_blocks("warmup", kv, src, dst)
            secs = []
            for i in range(args.reps):
                secs.append((await conn.send_blocks(f"r{i}", kv, src, dst)).seconds)
                if trace:
                    traces.append(conn.last_trace)
            went_direct, path = conn.last_direct, conn.last_path
        await tx.close()
        nbytes = len(src) * layout.block_bytes
        rows.append({"mode": address["mode"], "device": args.device,
                     "progress": args.progress, "chunks": chunks if path == "staged" else 0,
                     "direct": direct, "went_direct": went_direct, "path": path,
                     "checksum": args.checksum, "bytes": nbytes,
                     "pull_engine": tx.pull_engine if path == "pull" else None,
                     "mib": round(nbytes / 2**20, 1),
                     "median_gb_s": round(nbytes / statistics.median(secs) / 1e9, 2),
                     "best_gb_s": round(nbytes / min(secs) / 1e9, 2),
                     "median_ms": round(statistics.median(secs) * 1e3, 3),
                     "ms": [round(x * 1e3, 3) for x in secs]})
        if trace:
            rows[-1]["traces"] = traces
            # An early-acked pull (`UcxTransport`) acks before its copy is done: no "synced".
            landed = [t["rx"]["synced"] for t in traces if (t.get("rx") or {}).get("synced")]
            if landed:
                rows[-1]["landed_ms"] = round(statistics.median(landed) * 1e3, 3)
    return rows


async def raw_server(rx_id: int, device: str) -> None:
    """Receiver half of `measure_raw`, beside a receiver transport (its id names the tag):
    per request, a buffer on `device` that receives `reps` messages of `pieces` parts each
    and acknowledges each message once all its parts are in. Ends on {"op": "stop"}."""
    import ucxx

    from kvtransfer import wire

    # One endpoint per sender for the server's life: UCX answers a rendezvous through the
    # endpoint pair, so dropping it between requests stalls the next large message.
    eps: dict[str, Any] = {}
    while True:
        try:
            msg = await wire.recv_ctrl(wire.tag(rx_id, 0, RAW_CTRL))
        except wire.MalformedMessage as e:  # dropped: the server goes on
            log.error("kvtransfer.bench: dropped a malformed raw request: %s", e)
            continue
        if msg.get("op") != "raw":
            break
        link = msg["link"]
        if msg["reply_to"] not in eps:
            eps[msg["reply_to"]] = await wire.endpoint_to_worker(msg["reply_to"])
        ep = eps[msg["reply_to"]]
        buf = torch.empty(msg["nbytes"], dtype=torch.uint8, device=device)
        parts = [wire.as_buffer(p) for p in buf.chunk(msg["pieces"])]
        for rep in range(msg["reps"]):
            await asyncio.gather(*[ucxx.recv(p, wire.tag(link, rep, wire.CHUNK + i))
                                   for i, p in enumerate(parts)])
            await wire.send(ep, wire.encode({"ok": True, "t": time.perf_counter()}),
                            wire.tag(link, rep, RAW_ACK))
    for ep in eps.values():
        wire.drop(ep)


async def measure_raw(address: dict[str, Any], device: str, sizes: list[int],
                      pieces: list[int], reps: int, timeout: float = 30.0
                      ) -> list[dict[str, Any]]:
    """Bare UCX from this process to a `receiver_main` (worker mode): per size and number of
    pieces, one warm-up and `reps` timed messages. `sent_ms`: until every send completed;
    `acked_ms`: until the receiver's ack arrived; `landed_ms`: until the receiver had it all
    (its clock; the same host)."""
    from kvtransfer import wire

    wire.ensure_ucx("thread")  # a no-op when a transport already initialised ucxx
    ep = await wire.endpoint_to_worker(address["worker"])
    me = wire.worker_address_hex()
    rows = []
    for nbytes in sizes:
        buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        for k in pieces:
            parts = [wire.as_buffer(p) for p in buf.chunk(k)]
            link = wire.new_id()
            await wire.send(ep, wire.encode({"op": "raw", "link": link, "nbytes": nbytes,
                                             "pieces": k, "reps": reps + 1, "reply_to": me}),
                            wire.tag(address["id"], 0, RAW_CTRL))
            sent, acked, landed = [], [], []
            for rep in range(reps + 1):
                ack = asyncio.ensure_future(wire.recv_ctrl(wire.tag(link, rep, RAW_ACK)))
                t0 = time.perf_counter()
                await asyncio.wait_for(asyncio.gather(
                    *[wire.send(ep, p, wire.tag(link, rep, wire.CHUNK + i))
                      for i, p in enumerate(parts)]), timeout)
                t1 = time.perf_counter()
                reply = await asyncio.wait_for(ack, timeout)
                t2 = time.perf_counter()
                if rep:  # the first one is the warm-up
                    sent.append(t1 - t0)
                    acked.append(t2 - t0)
                    landed.append(reply["t"] - t0)
            med = statistics.median
            rows.append({"bytes": nbytes, "pieces": k, "device": device,
                         "sent_ms": round(med(sent) * 1e3, 3),
                         "acked_ms": round(med(acked) * 1e3, 3),
                         "landed_ms": round(med(landed) * 1e3, 3),
                         "gb_s": round(nbytes / med(acked) / 1e9, 2),
                         "gb_s_landed": round(nbytes / max(med(landed), 1e-9) / 1e9, 2)})
        buf = None
    wire.drop(ep)
    return rows


def copy_seconds(src_dev: str, dst_dev: str, nbytes: int, reps: int,
                 warmup: int = 2) -> float:
    """Median wall time of one plain copy of `nbytes` from `src_dev` to `dst_dev` (a peer
    copy between GPUs, a device copy within one, a memcpy on the host), both devices
    synchronized around it, after `warmup` untimed copies: what a transfer compares with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    cuda = [torch.device(d) for d in {src_dev, dst_dev} if torch.device(d).type == "cuda"]

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    secs = []
    for i in range(reps + warmup):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= warmup:
            secs.append(time.perf_counter() - t0)
    return statistics.median(secs)


def measure_copy(device: str, nbytes: int, reps: int) -> dict[str, Any]:
    """The baseline beside a transfer on one host: one plain copy of `nbytes` within
    `device`'s memory (a device-to-device copy on a GPU, a memcpy on the host)."""
    med = copy_seconds(device, device, nbytes, reps)
    return {"copy": device, "bytes": nbytes, "median_ms": round(med * 1e3, 3),
            "gb_s": round(nbytes / med / 1e9, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["worker", "listener"], default="worker")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 31])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--layers", type=int, default=31)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--device", default="cpu", help="where both KV caches live (cpu, cuda)")
    p.add_argument("--progress", choices=["thread", "thread-polling", "blocking", "polling"],
                   default="thread")
    p.add_argument("--direct", choices=["auto", "on", "off"], nargs="+", default=["auto"],
                   help="payload path: the transport's choice, direct (no staging) or staged")
    p.add_argument("--ipc", choices=["auto", "off"], default="auto",
                   help="GPU caches on one host: copy the blocks through CUDA IPC (auto: push "
                        "or pull) or keep to UCX messages (off)")
    p.add_argument("--push", choices=["auto", "off"], default="auto",
                   help="with --ipc auto: the sender writes into the receiver's cache (auto) "
                        "or the receiver pulls from the sender's (off)")
    p.add_argument("--trace", action="store_true", help="per-transfer timelines in the rows")
    p.add_argument("--raw", action="store_true", help="also the bare UCX baseline")
    p.add_argument("--copy", action="store_true",
                   help="also a plain copy of the same bytes within --device")
    args = p.parse_args(argv)
    args.direct = [{"auto": None, "on": True, "off": False}[d] for d in args.direct]
    args.ipc = None if args.ipc == "auto" else False
    args.push = None if args.push == "auto" else False
    layout = BlockLayout("bench", args.dtype, 16, args.layers, args.kv_heads, args.head_dim, 1)
    proc, pipe, address = spawn_receiver(layout, args.blocks, args.mode, progress=args.progress,
                                         device=args.device)
    try:
        async def go() -> list[dict[str, Any]]:
            rows = await measure(args, layout, address)
            if args.raw:
                rows += await measure_raw(address, args.device,
                                          [args.blocks * layout.block_bytes], [1], args.reps)
            if args.copy:
                rows.append(measure_copy(args.device, args.blocks * layout.block_bytes,
                                         args.reps))
            return rows

        for row in asyncio.run(go()):
            print(json.dumps(row))
    finally:
        stop_receiver(proc, pipe, layout)


if __name__ == "__main__":
    main()
