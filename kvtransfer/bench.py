"""Throughput of UCX block transfers between two processes on this host.

    python -m kvtransfer.bench --mode worker --chunks 1 31 --blocks 128

The default shape is SmolLM2-135M with its EAGLE-3 draft layer (31 KV layers, 3 KV heads,
head_dim 64, block 16, fp32: 0.73 MiB per block), i.e. a 2k-token prompt by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from kvtransfer.layout import BlockLayout


def receiver_main(pipe: Pipe, layout: dict[str, Any], num_blocks: int, mode: str,
                  return_kv: bool, progress: str = "thread", device: str = "cpu") -> None:
    """Child process: a receiver that serves until the parent says stop."""
    from kvtransfer.ucx import UcxTransport

    lay = BlockLayout.from_dict(layout)
    kv = torch.zeros(lay.kv_shape(num_blocks), dtype=lay.torch_dtype, device=device)

    async def serve() -> None:
        async with UcxTransport(lay, kv, mode=mode, progress_mode=progress) as rx:
            pipe.send(rx.address)
            await asyncio.get_running_loop().run_in_executor(None, pipe.recv)

    asyncio.run(serve())
    # As numpy bytes: a pickled torch tensor would travel as a shared-memory fd that dies
    # with this process.
    pipe.send(kv.cpu().view(torch.uint8).numpy() if return_kv else None)


def spawn_receiver(layout: BlockLayout, num_blocks: int, mode: str = "worker",
                   return_kv: bool = False, progress: str = "thread", device: str = "cpu"
                   ) -> tuple[Any, Pipe, dict[str, Any]]:
    """Start a receiver in a fresh (spawned) process; return it, its pipe and its address.
    Stop it with `stop_receiver`."""
    ctx = mp.get_context("spawn")  # never fork a process that has loaded UCX / CUDA
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, daemon=True,
                       args=(theirs, layout.to_dict(), num_blocks, mode, return_kv, progress,
                             device))
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
    from kvtransfer.ucx import UcxTransport

    kv = torch.randn(layout.kv_shape(args.blocks)).to(layout.torch_dtype).to(args.device)
    ids = list(range(args.blocks))
    rows = []
    for chunks in args.chunks:
        tx = UcxTransport(layout, num_chunks=chunks, checksum=args.checksum,
                          progress_mode=args.progress)
        async with await tx.connect(address) as conn:
            await conn.send_blocks("warmup", kv, ids, ids)
            secs = [(await conn.send_blocks(f"r{i}", kv, ids, ids)).seconds
                    for i in range(args.reps)]
        await tx.close()
        nbytes = args.blocks * layout.block_bytes
        rows.append({"mode": address["mode"], "device": args.device,
                     "progress": args.progress, "chunks": chunks,
                     "checksum": args.checksum,
                     "mib": round(nbytes / 2**20, 1),
                     "median_gb_s": round(nbytes / statistics.median(secs) / 1e9, 2),
                     "best_gb_s": round(nbytes / min(secs) / 1e9, 2),
                     "median_ms": round(statistics.median(secs) * 1e3, 2)})
    return rows


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
    p.add_argument("--progress", choices=["thread", "blocking", "polling"], default="thread")
    args = p.parse_args(argv)
    layout = BlockLayout("bench", args.dtype, 16, args.layers, args.kv_heads, args.head_dim, 1)
    proc, pipe, address = spawn_receiver(layout, args.blocks, args.mode, progress=args.progress,
                                         device=args.device)
    try:
        for row in asyncio.run(measure(args, layout, address)):
            print(json.dumps(row))
    finally:
        stop_receiver(proc, pipe, layout)


if __name__ == "__main__":
    main()
