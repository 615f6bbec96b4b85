"""The decode node: the engine in decode role with speculation. Reserves blocks for incoming
requests, receives their KV, and streams tokens back."""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine import Engine
from engine.handoff import Handoff
from engine.loop import EngineLoop
from engine.output import RequestOutput
from kvtransfer.factory import make_transport
from kvtransfer.layout import BlockLayout
from prefill_node.node import Liveness, _engine_stats, _on_own_gpu, node_info, serve_metrics

RECV_TIMEOUT_S = 60.0


class DecodeNode(Liveness):
    """Plain class; cluster/launcher.py runs it as a Ray actor."""

    def __init__(self, model: str | None, engine_kwargs: dict, transport: str = "ucx",
                 metrics_port: int | None = None, transport_kwargs: dict | None = None,
                 metrics_host: str = "127.0.0.1"):
        self.engine = Engine.from_pretrained(model, **_on_own_gpu(engine_kwargs))
        self.engine.prepare_to_serve()  # graphs captured, objects frozen, compiles logged
        self.metrics, self.metrics_port = serve_metrics("decode", metrics_port, metrics_host)
        self.loop = EngineLoop(self.engine)
        self.loop.on_step = self.metrics.engine_step
        self.metrics.watch_engine(self.engine)
        self.loop.start()
        self.layout = BlockLayout.from_engine_config(self.engine.config)
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

    async def generate(self, h: Handoff) -> AsyncIterator[RequestOutput]:
        """Wait for the request's KV to land, then decode it, yielding outputs as they come."""
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

    async def stats(self) -> dict:
        return await self.loop.call(_engine_stats)

    async def info(self) -> dict:
        return node_info(self)
