"""The decode node: the engine in decode role with speculation. Reserves blocks for incoming
requests, receives their KV, and streams tokens back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from node_common.node import Node, unseal

if TYPE_CHECKING:
    from engine.output import RequestOutput

RECV_TIMEOUT_S = 60.0


class DecodeNode(Node):
    """Plain class; cluster/launcher.py runs it as a Ray actor. The engine and the transport
    are imported in the actor (`node_common.node`), not where the class is placed.
    `cpu_threads`: as `Node`'s."""

    def __init__(self, model: str | None, engine_kwargs: dict, transport: str = "ucx",
                 metrics_port: int | None = None, transport_kwargs: dict | None = None,
                 metrics_host: str = "127.0.0.1", cpu_threads: int | None = None):
        from kvtransfer.factory import make_transport

        super().__init__("decode", model, engine_kwargs, metrics_port, metrics_host, cpu_threads)
        self.transport = make_transport(transport, self.layout, self.engine.kv_cache,
                                        **(transport_kwargs or {}))
        self._started = False

    async def address(self) -> dict:
        if not self._started:
            await self.transport.start()
            self._started = True
            self.guard_transport()
        return self.transport.address

    async def reserve(self, rid: str, num_tokens: int) -> list[int]:
        return await self.loop.call(lambda e: e.reserve(rid, num_tokens))

    async def generate(self, sealed: bytes) -> AsyncIterator[RequestOutput]:
        """Wait for the request's KV to land, then decode it, yielding outputs as they come.
        `sealed`: the prefill node's hand-off (`node_common.node.seal`)."""
        h = unseal(sealed)
        try:
            await self.transport.recv_blocks(h.request_id, RECV_TIMEOUT_S)
        except BaseException:
            await self.loop.call(lambda e: e.release(h.request_id))
            raise
        async for out in self.loop.generate(h.request_id, None, None, handoff=h):
            yield out

    async def cancel(self, rid: str) -> None:
        """Cancel a running request or drop a reservation; its blocks are free after this."""
        await self.loop.call(lambda e: e.abort(rid))
        self.transport.inbox.discard(rid)  # KV that landed for nobody
