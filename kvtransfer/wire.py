"""Wire format of the UCX transport: tags, control messages, byte views, extras packing.

Every message is a UCX tagged message with an explicit 64-bit tag:
`link id (32 bits) | request sequence number (24 bits) | kind (8 bits)`. The link id is random
per connection, so one receiver worker tells many senders (and many requests) apart, and
concurrent requests never interleave on a tag. Control messages are length-prefixed JSON.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import secrets
import struct
import threading
import zlib
from typing import Any

import numpy as np
import torch
import ucxx

from kvtransfer.layout import dtype_from_name, dtype_name

HELLO, HELLO_REPLY, HEADER, ACK, EXTRAS, TRAILER = range(6)
CHUNK = 16  # chunk i of a request's payload travels with kind CHUNK + i
MAX_CHUNKS = 256 - CHUNK
CTRL_SMALL = 64 << 10  # hello, replies, acks, trailers
CTRL_HEADER = 1 << 20  # a header carries the dst block ids: ~7 bytes each as JSON


def tag(link: int, seq: int, kind: int) -> int:
    return (link << 32) | ((seq & 0xFFFFFF) << 8) | kind


def new_id() -> int:
    """A random non-zero 32-bit link id."""
    return secrets.randbits(32) | 1


_bound_loop: list[asyncio.AbstractEventLoop] = []  # the loop ucxx delivers completions to


def ensure_ucx(progress_mode: str) -> None:
    """Initialise ucxx once per process, from the running loop, and make that loop progress it.

    In `thread` mode (the default here) UCX progresses on its own C++ thread and completions
    arrive as asyncio futures through ucxx's notifier thread, which is bound to the loop that
    initialised ucxx: every transport of a process must run on that one loop (use a
    `LoopThread` from synchronous code). Other modes (`blocking`, `polling`) make ucxx
    busy-yield on every pending receive, so an idle receiver spins a whole core.
    """
    loop = asyncio.get_running_loop()
    try:
        ucxx.init(progress_mode=progress_mode,
                  enable_python_future=progress_mode.startswith("thread"))
    except RuntimeError:
        pass  # already initialised in this process (its first caller chose the mode)
    else:
        _bound_loop.append(loop)
        # ucxx's notifier thread is not a daemon and never stops by itself: without this the
        # interpreter hangs at exit. Registered to run before non-daemon threads are joined.
        getattr(threading, "_register_atexit", atexit.register)(ucxx.stop_notifier_thread)
    if _bound_loop and _bound_loop[0] is not loop and _progress_mode().startswith("thread"):
        raise RuntimeError("ucxx (thread progress) is bound to the event loop that first used "
                           "it; run every UcxTransport of a process on that loop")
    ucxx.continuous_ucx_progress()


def _progress_mode() -> str:
    ctx = ucxx.core._ctx  # the process's ucxx context: read-only peek at its progress mode
    return "" if ctx is None else ctx.progress_mode


def worker_address_hex() -> str:
    return ucxx.get_worker_address().tobytes().hex()


async def endpoint_to_worker(address_hex: str) -> Any:
    """Endpoint to a worker whose address came out of band. Error handling must stay off:
    with it on, UCX refuses shared memory ("no peer failure handler") and falls back to TCP."""
    addr = ucxx.get_ucx_address_from_buffer(bytes.fromhex(address_hex))
    return await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)


def encode(msg: dict[str, Any]) -> np.ndarray:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return np.frombuffer(struct.pack("<I", len(data)) + data, dtype=np.uint8).copy()


def decode(buf: bytearray | np.ndarray) -> dict[str, Any]:
    raw = memoryview(buf).cast("B")
    (n,) = struct.unpack_from("<I", raw)
    return json.loads(bytes(raw[4:4 + n]))


async def recv_ctrl(t: int, size: int = CTRL_SMALL) -> dict[str, Any]:
    """Receive one control message on this process's worker (any sender) with tag `t`."""
    buf = bytearray(size)
    await ucxx.recv(buf, t)
    return decode(buf)


async def send(ep: Any, buf: Any, t: int) -> None:
    await ep.send(buf, tag=t, force_tag=True)


def drop(ep: Any) -> None:
    """Close an endpoint, flushing what was sent; give up after a second (a dead peer)."""
    ep.abort(period=10**9)


def as_buffer(t: torch.Tensor) -> Any:
    """The bytes of a contiguous tensor as UCX sees them: numpy on the host (bf16 has no
    numpy dtype, hence the uint8 view), the CUDA tensor itself on a GPU."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).cpu().numpy())


def layer_chunks(num_layers: int, num_chunks: int) -> list[tuple[int, int]]:
    """Split the layer dimension into `num_chunks` near-equal [lo, hi) ranges."""
    k = max(1, min(num_chunks, num_layers, MAX_CHUNKS))
    step = math.ceil(num_layers / k)
    return [(lo, min(lo + step, num_layers)) for lo in range(0, num_layers, step)]


# A direct transfer sends each (layer, K/V, run of consecutive blocks) straight from the
# sender's cache into the receiver's, with no gather or scatter; worth it once the messages are
# large enough that UCX's cost per message is less than copying the bytes twice. Measured:
# - between two H200s (figure 4, 8B layout, 64 messages a run), direct against staged in one
#   message: 3.40 vs 1.66 ms at 16 MiB, 5.10 vs 3.08 ms at 256 MiB (4 MiB messages), 5.81 vs
#   6.11 ms at 1 GiB (16 MiB messages): each message costs tens of microseconds;
# - between two host processes (shared memory), direct was 1.6-2x faster from 1 MiB messages.
DIRECT_MIN_BYTES = {"cuda": 16 << 20, "cpu": 1 << 20}


def direct_min_bytes(device: torch.device | str) -> int:
    """The mean message size from which a request on this device goes direct."""
    return DIRECT_MIN_BYTES["cuda" if torch.device(device).type == "cuda" else "cpu"]


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of the maximal runs where both id lists count up by one
    together: each run is one contiguous range of every layer's K and V in both caches."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def plan_direct(src: list[int], dst: list[int], num_layers: int, layer_block_bytes: int,
                direct: bool | None, min_bytes: int = DIRECT_MIN_BYTES["cpu"]
                ) -> list[tuple[int, int, int]] | None:
    """The runs of a direct transfer, or None to gather into staging buffers instead.
    `direct`: None decides by the mean message size (`min_bytes`, see `direct_min_bytes`),
    True whenever the messages fit the tag space, False never. `layer_block_bytes`: one block
    of one layer's K (or V)."""
    if not src or direct is False:
        return None
    runs = block_runs(src, dst)
    messages = 2 * num_layers * len(runs)
    if messages > MAX_CHUNKS:
        return None
    if direct is None and len(src) * 2 * num_layers * layer_block_bytes < messages * min_bytes:
        return None
    return runs


def direct_views(kv: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The contiguous pieces of a direct transfer in wire order (layer, K/V, run), each
    `kv[layer, kv, start:start + length]`; `runs` are (start, length) on this side."""
    return [kv[layer, j, start:start + n] for layer in range(kv.shape[0]) for j in (0, 1)
            for start, n in runs]


def run_sums(kv: torch.Tensor, runs: list[tuple[int, int, int]], side: int) -> list[int]:
    """crc32 of each piece (layer, K/V, run) of `kv` that block runs (s, d, k) read (side 0,
    the sender's cache) or write (side 1, the receiver's), in wire order: what the two ends of
    a push or pull compare."""
    return [crc(v) for v in direct_views(kv, [(r[side], r[2]) for r in runs])]


def pack_extras(extras: dict[str, torch.Tensor]) -> tuple[list[Any], torch.Tensor]:
    """(spec, blob): one host byte buffer for all extras, and how to cut it up again."""
    spec, parts = [], []
    for name, t in extras.items():
        parts.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
        spec.append([name, dtype_name(t.dtype), list(t.shape)])
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return spec, blob


def unpack_extras(spec: list[Any], blob: torch.Tensor,
                  device: torch.device) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for name, dt, shape in spec:
        dtype = dtype_from_name(dt)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        # clone(): a uint8 slice at an odd offset cannot be viewed as a wider dtype.
        out[name] = blob[off:off + n].clone().view(dtype).reshape(shape).to(device)
        off += n
    if off != blob.numel():
        raise ValueError(f"extras spec covers {off} bytes, blob has {blob.numel()}")
    return out
