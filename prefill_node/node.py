"""The prefill node: the engine in prefill role. Chunked prefill of the target and the draft
layer, the first token straight back to the router, the request's KV blocks shipped to the
decode node's reserved blocks and held under a lease until the decode side acknowledges."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from node_common.node import Node, seal

if TYPE_CHECKING:
    from engine import SamplingParams
    from engine.handoff import Handoff
    from engine.output import RequestOutput


class PrefillNode(Node):
    """Plain class; cluster/launcher.py runs it as a Ray actor. The engine and the transport
    are imported in the actor (`node_common.node`), not where the class is placed.
    `cpu_threads`: as `Node`'s."""

    def __init__(self, model: str | None, engine_kwargs: dict, transport: str = "ucx",
                 metrics_port: int | None = None, transport_kwargs: dict | None = None,
                 metrics_host: str = "127.0.0.1", cpu_threads: int | None = None):
        from kvtransfer.factory import make_transport

        super().__init__("prefill", model, engine_kwargs, metrics_port, metrics_host, cpu_threads)
        self.transport = make_transport(transport, self.layout, **(transport_kwargs or {}))
        self._conns: dict[str, object] = {}
        self._active: set[str] = set()  # requests inside prefill()
        self._cancelled: set[str] = set()
        self._sending: dict[str, asyncio.Future] = {}
        self.transferred_bytes = 0
        self.transfer_paths: dict[str, int] = {}  # TransferStats.path -> transfers

    async def prefill(self, rid: str, ids: list[int], params: SamplingParams,
                      spec_cap: int | None, decode_address: dict, dst_blocks: list[int],
                      resume: tuple[int, int] | None = None
                      ) -> AsyncIterator[RequestOutput | bytes]:
        """Prefill and yield the first output at once (TTFT does not wait for the transfer);
        then ship the KV and yield the hand-off, sealed (`node_common.node.seal`). Nothing
        more when the request already finished at its first token. `resume`: a stream moved
        here after a worker died (`Engine.add_request`)."""
        self.guard_transport()
        self._active.add(rid)
        try:
            outs = [o async for o in self.loop.generate(rid, ids, params, spec_cap, hold=True,
                                                        resume=resume)]
            yield outs[-1]
            if not outs[-1].handoff or rid in self._cancelled:
                return
            # Registered before any await, so cancel() always sees a send it must wait for.
            send = asyncio.ensure_future(self._ship(rid, decode_address, dst_blocks))
            self._sending[rid] = send
            try:
                h = await send
            except Exception:
                if rid in self._cancelled:  # cancelled mid-ship: nobody waits for a hand-off
                    return
                raise
        finally:  # the lease ends with the receiver's ack, or with the failure
            self._active.discard(rid)
            self._cancelled.discard(rid)
            self._sending.pop(rid, None)
            await self.loop.call(lambda e: e.release(rid))
        yield seal(h)

    async def _ship(self, rid: str, decode_address: dict, dst_blocks: list[int]) -> Handoff:
        h = await self.loop.call(lambda e: e.export_handoff(rid))
        src = await self.loop.call(lambda e: e.held_blocks(rid))
        conn = await self._connect(decode_address)
        try:
            stats = await conn.send_blocks(rid, self.engine.kv_cache, src[: len(dst_blocks)],
                                           dst_blocks)
        except BaseException:
            self.metrics.observe_transfer(0, 0.0, ok=False)
            raise
        self.metrics.observe_transfer(stats.bytes, stats.seconds, ok=True, path=stats.path)
        self.transferred_bytes += stats.bytes
        self.transfer_paths[stats.path] = self.transfer_paths.get(stats.path, 0) + 1
        return h

    async def cancel(self, rid: str) -> None:
        """Stop the request here. Returns only once no transfer for it can still be writing
        into the decode side's blocks, so the decode side may then free them."""
        if rid in self._active:
            self._cancelled.add(rid)
        await self.loop.call(lambda e: e.abort(rid))
        send = self._sending.get(rid)
        if send is not None:
            await asyncio.wait([send])

    async def drop_links(self) -> int:
        """Close this node's UCX links to decode actors, as endpoints that broke (fault
        injection: `tandem soak`): a transfer in flight on one fails, the next one connects
        again. Returns how many were open."""
        conns = list(self._conns.values())
        self._conns.clear()
        for conn in conns:  # not awaited: a link to a dead peer waits out its timeout
            asyncio.ensure_future(conn.close())
        return len(conns)

    async def _connect(self, address: dict):
        key = repr(sorted(address.items()))
        if key not in self._conns:
            self._conns[key] = await self.transport.connect(address)
        return self._conns[key]
