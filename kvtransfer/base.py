"""The transfer contract: a receiver exposes an address, a sender connects (layout handshake
first), ships blocks plus a few small tensors, and returns once the receiver has acknowledged;
only then may the node free its copy. The node decides which blocks move, the transport moves
the bytes. Everything is asyncio (ucxx is); `LoopThread` lets synchronous code drive it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvtransfer.layout import BLOCKS_DIM, BlockLayout, check_compatible

Extras = dict[str, torch.Tensor]
# Called once per landed request with its extras, or with the error that failed it.
OnReceive = Callable[[str, "Extras | TransferError"], None]
T = TypeVar("T")
# The longest request id (UTF-8 bytes) a transport carries: it travels in every request's
# header and comes back in logs and errors. A sender refuses a longer one before sending
# anything (`RequestTooLarge`); the router can check it up front.
MAX_REQUEST_ID_BYTES = 256


class TransferError(RuntimeError):
    """A transfer failed after the handshake (bad ids, checksum, peer gone, timeout)."""


class RequestTooLarge(TransferError, ValueError):
    """Refused before anything was sent: the request id, or the header naming the blocks, is
    larger than the receiver takes (the message names the size and the limit)."""


@dataclass(frozen=True)
class TransferStats:
    """What one `send_blocks` moved and how long it took, ack included."""

    request_id: str
    num_blocks: int
    bytes: int  # KV payload: num_blocks * layout.block_bytes
    extras_bytes: int
    seconds: float
    path: str = ""  # how the blocks travelled, where the transport has several ways

    @property
    def bytes_per_s(self) -> float:
        return (self.bytes + self.extras_bytes) / max(self.seconds, 1e-9)


def check_block_ids(src: Sequence[int], dst: Sequence[int], src_blocks: int,
                    dst_blocks: int) -> None:
    """Refuse ids that would read or write outside the caches, or race on one dst block."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} src block ids but {len(dst)} dst block ids")
    for side, ids, n in (("src", src, src_blocks), ("dst", dst, dst_blocks)):
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"{side} block ids out of range 0..{n - 1}: {bad[:8]}")
    if len(set(dst)) != len(dst):
        raise ValueError("duplicate dst block ids (two sources would race on one block)")


def check_request_id(request_id: str) -> None:
    """Refuse a request id that is not a string or is longer than `MAX_REQUEST_ID_BYTES`."""
    if not isinstance(request_id, str):
        raise TypeError(f"a request id is a str, got {type(request_id).__name__}")
    size = len(request_id.encode("utf-8", "surrogatepass"))
    if size > MAX_REQUEST_ID_BYTES:
        raise RequestTooLarge(f"request id of {size} bytes (starts {request_id[:32]!r}) is "
                              f"longer than the {MAX_REQUEST_ID_BYTES} bytes a transport carries")


class Inbox:
    """Landed requests: handed to `on_receive`, or kept until `wait` collects them.

    Thread-safe, because a colocated sender may deliver from another thread or loop.
    """

    def __init__(self, on_receive: OnReceive | None = None):
        self._on_receive = on_receive
        self._lock = threading.Lock()
        self._ready: dict[str, Extras | TransferError] = {}
        self._waiters: dict[str, asyncio.Future] = {}

    def put(self, request_id: str, result: Extras | TransferError) -> None:
        if self._on_receive is not None:
            self._on_receive(request_id, result)
            return
        with self._lock:
            fut = self._waiters.pop(request_id, None)
            if fut is None:
                self._ready[request_id] = result
                return
        fut.get_loop().call_soon_threadsafe(_resolve, fut, result)

    async def wait(self, request_id: str, timeout: float | None = None) -> Extras:
        if self._on_receive is not None:
            raise RuntimeError("this inbox hands every request to its on_receive callback")
        with self._lock:
            result = self._ready.pop(request_id, None)
            if result is None:
                fut = asyncio.get_running_loop().create_future()
                self._waiters[request_id] = fut
        if result is None:
            try:
                result = await asyncio.wait_for(fut, timeout)
            finally:
                with self._lock:
                    self._waiters.pop(request_id, None)
        if isinstance(result, BaseException):
            raise result
        return result

    def discard(self, request_id: str) -> None:
        """Forget a landed request nobody will collect (e.g. it was aborted meanwhile)."""
        with self._lock:
            self._ready.pop(request_id, None)


def _resolve(fut: asyncio.Future, result: Extras | TransferError) -> None:
    if not fut.done():
        fut.set_result(result)


class Connection(ABC):
    """The sending half of a handshaken link to one receiver; made by `Transport.connect`."""

    def __init__(self, layout: BlockLayout, peer_layout: BlockLayout, peer_num_blocks: int):
        check_compatible(layout, peer_layout)
        self.layout, self.peer_layout, self.peer_num_blocks = layout, peer_layout, peer_num_blocks

    @abstractmethod
    async def send_blocks(self, request_id: str, kv_cache: torch.Tensor,
                          src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                          extras: Extras | None = None) -> TransferStats:
        """Copy `kv_cache[:, :, src]` (all layers, K and V) into the peer's blocks `dst`, and
        `extras`; return after the receiver acknowledged: the caller may then free `src`."""

    @abstractmethod
    async def close(self) -> None:
        """Say goodbye to the receiver and free the link."""

    def check(self, request_id: str, kv_cache: torch.Tensor, src: Sequence[int],
              dst: Sequence[int], extras: Extras | None) -> None:
        """The checks every implementation runs before moving a byte."""
        check_request_id(request_id)
        self.layout.check_tensor(kv_cache)
        check_block_ids(src, dst, kv_cache.shape[BLOCKS_DIM], self.peer_num_blocks)
        for name, t in (extras or {}).items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"extras must map str to torch.Tensor, got {name!r}: {type(t)}")

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Transport(ABC):
    """One engine's end: receives into `kv_cache` (if given) and connects to receivers."""

    def __init__(self, layout: BlockLayout, kv_cache: torch.Tensor | None = None,
                 on_receive: OnReceive | None = None):
        if kv_cache is not None:
            layout.check_tensor(kv_cache)
        self.layout, self.kv_cache = layout, kv_cache
        self.inbox = Inbox(on_receive)

    @property
    def num_blocks(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.shape[BLOCKS_DIM]

    @property
    def healthy(self) -> bool:
        """Whether this end still receives: False once a receive loop has died (its senders
        would then wait out their timeouts). Transports without loops are always healthy."""
        return True

    @property
    def dropped_messages(self) -> int:
        """How many malformed, oversized or undecodable messages this end has dropped."""
        return 0

    @property
    @abstractmethod
    def address(self) -> dict[str, Any]:
        """Plain data (picklable, JSON-able) a sender passes to `connect`; valid after start."""

    @abstractmethod
    async def start(self) -> None:
        """Begin accepting senders (receivers only)."""

    @abstractmethod
    async def connect(self, peer_address: dict[str, Any]) -> Connection:
        """Handshake with a receiver; raise `LayoutMismatch` before any data on a mismatch."""

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting and release everything; idempotent."""

    async def recv_blocks(self, request_id: str, timeout: float | None = None) -> Extras:
        """Wait until `request_id`'s blocks have landed in `kv_cache`; return its extras."""
        return await self.inbox.wait(request_id, timeout)

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class LoopThread:
    """An event loop on its own thread, so synchronous code (an engine loop) can drive a
    Transport and UCX keeps progressing while that code computes."""

    def __init__(self, name: str = "kvtransfer-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel what is still running, stop the loop and join its thread."""
        if self.loop.is_closed():
            return
        self.run(_cancel_others())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
