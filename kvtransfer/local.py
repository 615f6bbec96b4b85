"""In-process transport: both engines live in one process (unit tests, colocated mode).

A transfer is one gather and one scatter (`dst[:, :, dst_ids] = src[:, :, src_ids]`) with a
device move in between; the handshake still checks the layouts, so colocated mode refuses the
same mismatches the UCX path would.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer import staging
from kvtransfer.base import Connection, Extras, TransferError, TransferStats, Transport
from kvtransfer.layout import BlockLayout, check_compatible

# Live receivers by id: addresses stay plain data, so nodes exchange them exactly as they
# exchange UCX addresses. Weak, so a dropped transport disappears without a close().
_RECEIVERS: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()


class LocalTransport(Transport):
    """Receiver and sender for engines in the same process."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._id = uuid.uuid4().hex
        self.pool = staging.StagingPool()

    @property
    def address(self) -> dict[str, Any]:
        return {"kind": "local", "id": self._id}

    async def start(self) -> None:
        if self.kv_cache is None:
            raise ValueError("a receiver needs a kv_cache")
        _RECEIVERS[self._id] = self

    async def connect(self, peer_address: dict[str, Any]) -> LocalConnection:
        if peer_address.get("kind") != "local":
            raise ValueError(f"not a local transport address: {peer_address!r}")
        peer = _RECEIVERS.get(peer_address["id"])
        if peer is None:
            raise ConnectionError(f"no local receiver {peer_address['id']} (not started?)")
        # Both ends check, as over the wire: the receiver must refuse a mismatched sender too.
        peer.admit(self.layout)
        return LocalConnection(self, peer)

    def admit(self, sender_layout: BlockLayout) -> None:
        """Receiver side of the handshake."""
        check_compatible(self.layout, sender_layout)

    async def close(self) -> None:
        _RECEIVERS.pop(self._id, None)


class LocalConnection(Connection):
    """A link to a `LocalTransport` receiver in this process."""

    def __init__(self, sender: LocalTransport, receiver: LocalTransport):
        super().__init__(sender.layout, receiver.layout, receiver.num_blocks)
        self._receiver: LocalTransport | None = receiver

    async def send_blocks(self, request_id: str, kv_cache: torch.Tensor,
                          src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                          extras: Extras | None = None) -> TransferStats:
        peer = self._receiver
        if peer is None or _RECEIVERS.get(peer._id) is not peer or peer.kv_cache is None:
            raise TransferError(f"{request_id}: connection or receiver closed")
        self.check(request_id, kv_cache, src_block_ids, dst_block_ids, extras)
        t0 = time.perf_counter()
        dst_kv = peer.kv_cache
        n = len(src_block_ids)
        if n:
            layers = (0, self.layout.num_layers)
            buf = peer.pool.take(n * self.layout.block_bytes, kv_cache.device)
            idx = staging.block_ids(src_block_ids, kv_cache.device)
            staging.scatter(dst_kv, layers, dst_block_ids,
                            staging.gather(kv_cache, layers, idx, buf))
            peer.pool.give(buf)
        # Copies, so the sender may reuse its tensors as soon as we return.
        got = {k: v.detach().to(dst_kv.device, copy=True) for k, v in (extras or {}).items()}
        if dst_kv.is_cuda:
            torch.cuda.synchronize(dst_kv.device)  # "landed" must mean readable by the engine
        peer.inbox.put(request_id, got)
        return TransferStats(request_id, n, n * self.layout.block_bytes,
                             sum(t.numel() * t.element_size() for t in got.values()),
                             time.perf_counter() - t0, "local")

    async def close(self) -> None:
        self._receiver = None
