"""Gather and scatter of KV blocks through reusable staging buffers.

Copies use the `[layers*2, blocks, block_elems]` view (far faster than `index_select` on the
6-D cache) and pooled buffers (a fresh one pays its page faults each time). On a GPU they run
on a side stream per device, after what the caller's stream queued, waiting only for their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from engine.affinity import serial_torch
from kvtransfer.layout import BLOCKS_DIM


def rows(kv: torch.Tensor, layers: tuple[int, int]) -> torch.Tensor:
    """Layers [lo, hi) of a KV tensor as `[layers*2, blocks, block_elems]` (a view)."""
    lo, hi = layers
    return kv[lo:hi].view((hi - lo) * 2, kv.shape[BLOCKS_DIM], -1)


def block_ids(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long)
    return torch.tensor(list(ids), dtype=torch.long, device=device)


_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def copy_stream(device: torch.device | str) -> torch.cuda.Stream | None:
    """This process's staging stream on a CUDA device; None on the host (copies are
    synchronous there). Use it with `after_current` and `mark`; `torch.cuda.stream(None)` is a
    no-op, so `with torch.cuda.stream(copy_stream(dev))` works for both."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def after_current(stream: torch.cuda.Stream | None) -> None:
    """Make `stream` wait (on the GPU) for what is queued so far on its device's current
    stream: the KV as the engine has written it up to now."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))


def mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event after the work queued so far on `stream`; None on the host."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def queued(device: torch.device | str) -> torch.cuda.Event | None:
    """An event after the work queued so far on the device's current stream (what the
    engine has launched), for a transfer that reads or writes the cache itself rather than
    through the staging stream; None on the host."""
    device = torch.device(device)
    return mark(torch.cuda.current_stream(device)) if device.type == "cuda" else None


class _Waiters:
    """Daemon threads that wait on CUDA events for the transports, apart from the loop's
    default executor: a wait that never ends (an event of a peer that died mid-copy) holds
    one of these, neither a thread the rest of the process needs nor its exit (an executor's
    threads are joined at exit)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        with self._lock:
            if len(self._threads) < self.size:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"kvtransfer-wait-{len(self._threads)}")
                t.start()
                self._threads.append(t)
        return fut

    def _work(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine
                fut.set_exception(e)


_WAITERS = _Waiters()


async def wait_event(event: torch.cuda.Event | None) -> None:
    """Until `event` (None: nothing to wait for) has completed, without blocking the loop."""
    if event is not None and not event.query():
        await asyncio.wrap_future(_WAITERS.submit(event.synchronize))


async def wait_queued(device: torch.device | str) -> None:
    """Until the device has run what its current stream queued so far (`queued`), without
    blocking the loop: the writes a transfer reads, or the reads of blocks it overwrites."""
    await wait_event(queued(device))


def gather(kv: torch.Tensor, layers: tuple[int, int], ids: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:
    """Copy blocks `ids` of layers [lo, hi) into `out`, as `[layers, 2, n, block...]`."""
    src = rows(kv, layers)
    dst = out.view(kv.dtype).view(src.shape[0], len(ids), src.shape[2])
    if use_kernel(kv):
        copy_blocks(src, dst, ids, gather=True)
    else:
        with serial_torch():  # off the engine's thread: no OpenMP team of this thread's
            torch.index_select(src, 1, ids, out=dst)
    return dst.view((layers[1] - layers[0], 2, len(ids)) + tuple(kv.shape[3:]))


def scatter(kv: torch.Tensor, layers: tuple[int, int], ids: Sequence[int] | torch.Tensor,
            data: torch.Tensor) -> None:
    """Write gathered blocks `data` into layers [lo, hi) of `kv` at block ids `ids` (a list,
    or a tensor from `block_ids`: build it once per request, not once per layer chunk)."""
    dst = rows(kv, layers)
    src = data.to(kv.device).reshape(dst.shape[0], len(ids), dst.shape[2])
    ids = block_ids(ids, kv.device)
    if use_kernel(kv):
        copy_blocks(dst, src, ids, gather=False)
    else:
        with serial_torch():
            dst.index_copy_(1, ids, src)


# ---- the block copy kernel -------------------------------------------------------------------
# torch's index_select / index_copy_ along the blocks dimension run far below the device's
# copy rate (longer than the NVLink transfer itself); a tiled copy of whole blocks runs near it.

COPY_TILE = 4096  # elements of a block row per program


def use_kernel(kv: torch.Tensor) -> bool:
    from engine.attention import triton_available

    return kv.is_cuda and triton_available()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor: a copy moves bits, whatever the dtype."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def copy_blocks(kv_rows: torch.Tensor, packed: torch.Tensor, ids: torch.Tensor,
                gather: bool) -> None:
    """packed[r, j] = kv_rows[r, ids[j]] (gather) or the reverse (scatter), for
    `kv_rows` [R, blocks, E] and `packed` [R, n, E], both contiguous along E."""
    from kvtransfer._copy_kernel import copy_blocks_kernel

    r, n, e = packed.shape
    if r == 0 or n == 0:
        return
    a, b = _bits(kv_rows), _bits(packed)
    grid = (r * n, -(-e // COPY_TILE))
    # Triton launches on the current device: make it the tensors' (a transport thread's current
    # device may be another GPU of the process).
    with torch.cuda.device(kv_rows.device) if kv_rows.is_cuda else nullcontext():
        copy_blocks_kernel[grid](a, b, ids, n, e, a.stride(0), a.stride(1), b.stride(0),
                                 b.stride(1), GATHER=gather, TILE=COPY_TILE)


class StagingPool:
    """Free host staging buffers by power-of-two size, up to `max_bytes` kept idle.
    CUDA buffers are not pooled: torch's caching allocator already reuses them."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle = 0
        self._lock = threading.Lock()  # a colocated sender may run on another thread

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` (a view of a pooled one on the host)."""
        if torch.device(device).type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            free = self._free.get(size)
            if free:
                self._idle -= size
                return free.pop()[:nbytes]
        return torch.empty(size, dtype=torch.uint8)[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from `take`; only once nothing (UCX included) still uses it."""
        if buf.device.type != "cpu":
            return
        base = buf._base if buf._base is not None else buf
        size = base.numel()
        with self._lock:
            if size & (size - 1) == 0 and self._idle + size <= self.max_bytes:
                self._free.setdefault(size, []).append(base)
                self._idle += size
