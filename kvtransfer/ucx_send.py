"""The sending half of a UCX link: gather blocks per layer chunk, send, wait for the ack."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer import staging, wire
from kvtransfer.base import Connection, Extras, TransferError, TransferStats
from kvtransfer.layout import BlockLayout

log = logging.getLogger(__name__)


class UcxConnection(Connection):
    """A handshaken link to one `UcxTransport` receiver; safe for concurrent `send_blocks`."""

    def __init__(self, ep: Any, link: int, layout: BlockLayout, peer_layout: BlockLayout,
                 peer_num_blocks: int, pool: staging.StagingPool, *, num_chunks: int = 1,
                 checksum: bool = False, timeout: float = 30.0):
        super().__init__(layout, peer_layout, peer_num_blocks)
        self._ep, self._link, self._seq, self._pool = ep, link, 0, pool
        self.num_chunks, self.checksum, self.timeout = num_chunks, checksum, timeout
        self._closed = False

    async def send_blocks(self, request_id: str, kv_cache: torch.Tensor,
                          src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                          extras: Extras | None = None) -> TransferStats:
        if self._closed:
            raise TransferError("connection closed")
        self.check(kv_cache, src_block_ids, dst_block_ids, extras)
        self._seq += 1
        seq, n, t0 = self._seq, len(src_block_ids), time.perf_counter()
        chunks = wire.layer_chunks(self.layout.num_layers, self.num_chunks) if n else []
        spec, blob = wire.pack_extras(extras or {})
        ack = asyncio.ensure_future(wire.recv_ctrl(self._tag(seq, wire.ACK)))
        hdr = {"op": "send", "seq": seq, "request_id": request_id, "dst": list(dst_block_ids),
               "chunks": chunks, "extras": spec, "extras_nbytes": blob.numel(),
               "checksum": self.checksum}
        bufs: list[torch.Tensor] = []
        try:
            await wire.send(self._ep, wire.encode(hdr), self._tag(0, wire.HEADER))
            sends, sums = await self._send_payload(seq, kv_cache, src_block_ids, chunks, blob,
                                                   bufs)
            if self.checksum:
                sends.append(self._send(wire.encode({"crc": sums}), seq, wire.TRAILER))
            await asyncio.wait_for(asyncio.gather(*sends), self.timeout)
            for buf in bufs:  # sent: UCX no longer reads them
                self._pool.give(buf)
            reply = await asyncio.wait_for(ack, self.timeout)
        except asyncio.TimeoutError:
            raise TransferError(f"{request_id}: no ack within {self.timeout}s") from None
        except Exception as e:  # UCX errors: the link broke; the lease must end all the same
            raise TransferError(f"{request_id}: {type(e).__name__}: {e}") from e
        finally:
            ack.cancel()  # no-op once done; on failure, stop waiting for an ack
        if not reply["ok"]:
            raise TransferError(f"{request_id}: the receiver failed it: {reply['error']}")
        return TransferStats(request_id, n, n * self.layout.block_bytes, blob.numel(),
                             time.perf_counter() - t0)

    async def _send_payload(self, seq: int, kv: torch.Tensor, src: Sequence[int],
                            chunks: list[tuple[int, int]], blob: torch.Tensor,
                            bufs: list[torch.Tensor]) -> tuple[list[asyncio.Future], list[int]]:
        """Gather chunk i+1 while chunk i is on the wire; return the sends and crc32s.
        The staging buffers go to `bufs`: the caller returns them to the pool once sent."""
        idx = staging.block_ids(src, kv.device)
        layer_bytes = len(src) * self.layout.block_bytes // self.layout.num_layers
        sends, sums = [], []
        for i, (lo, hi) in enumerate(chunks):
            bufs.append(self._pool.take((hi - lo) * layer_bytes, kv.device))
            data = staging.gather(kv, (lo, hi), idx, bufs[-1])
            if data.is_cuda:
                torch.cuda.current_stream(data.device).synchronize()  # UCX reads it directly
            if self.checksum:
                sums.append(wire.crc(data))
            sends.append(self._send(wire.as_buffer(data), seq, wire.CHUNK + i))
            await asyncio.sleep(0)  # let UCX progress the sends already posted
        if blob.numel():
            sends.append(self._send(blob.numpy(), seq, wire.EXTRAS))
        sums.append(wire.crc(blob))
        return sends, sums

    def _tag(self, seq: int, kind: int) -> int:
        return wire.tag(self._link, seq, kind)

    def _send(self, buf: Any, seq: int, kind: int) -> asyncio.Future:
        return asyncio.ensure_future(wire.send(self._ep, buf, self._tag(seq, kind)))

    async def close(self) -> None:
        """Tell the receiver this link is done (it stops serving it), then drop the endpoint."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(
                wire.send(self._ep, wire.encode({"op": "bye"}), self._tag(0, wire.HEADER)),
                self.timeout)
        except Exception:  # the receiver is already gone: nothing to say goodbye to
            log.debug("kvtransfer: bye not delivered", exc_info=True)
        wire.drop(self._ep)
