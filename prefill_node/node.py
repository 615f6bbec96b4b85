"""The prefill node: the engine in prefill role. Chunked prefill of the target and the draft
layer, the first token straight back to the router, the request's KV blocks shipped to the
decode node's reserved blocks and held under a lease until the decode side acknowledges."""

from __future__ import annotations

from engine import Engine, SamplingParams
from engine.handoff import Handoff
from engine.output import RequestOutput
from kvtransfer.factory import make_transport
from kvtransfer.layout import BlockLayout
from router.local import EngineLoop


class PrefillNode:
    """Plain class; cluster/launcher.py runs it as a Ray actor."""

    def __init__(self, model: str | None, engine_kwargs: dict, transport: str = "ucx"):
        self.engine = Engine.from_pretrained(model, **engine_kwargs)
        self.loop = EngineLoop(self.engine)
        self.loop.start()
        self.layout = BlockLayout.from_engine_config(self.engine.config)
        self.transport = make_transport(transport, self.layout)
        self._conns: dict[str, object] = {}
        self.transferred_bytes = 0

    async def prefill(self, rid: str, ids: list[int], params: SamplingParams,
                      spec_cap: int | None, decode_address: dict, dst_blocks: list[int]
                      ) -> tuple[RequestOutput, Handoff | None]:
        """Prefill, then ship the KV; returns the first output and the hand-off (None when the
        request already finished at its first token)."""
        outs = [o async for o in self.loop.generate(rid, ids, params, spec_cap, hold=True)]
        out = outs[-1]
        if not out.handoff:
            return out, None
        try:
            h = await self.loop.call(lambda e: e.export_handoff(rid))
            src = await self.loop.call(lambda e: e.held_blocks(rid))
            conn = await self._connect(decode_address)
            stats = await conn.send_blocks(rid, self.engine.kv_cache, src[: len(dst_blocks)],
                                           dst_blocks)
            self.transferred_bytes += stats.bytes
        finally:  # the lease ends with the receiver's ack, or with the failure
            await self.loop.call(lambda e: e.release(rid))
        return out, h

    async def cancel(self, rid: str) -> None:
        await self.loop.call(lambda e: e.abort(rid))

    async def _connect(self, address: dict):
        key = repr(sorted(address.items()))
        if key not in self._conns:
            self._conns[key] = await self.transport.connect(address)
        return self._conns[key]

    async def stats(self) -> dict:
        return await self.loop.call(_engine_stats)

    async def info(self) -> dict:
        return engine_info(self.engine)


def engine_info(e: Engine) -> dict:
    """What the router needs to validate prompts and describe the model, without the model."""
    c = e.config
    return {"model": c.model.name, "vocab_size": c.model.vocab_size,
            "max_model_len": c.max_model_len, "block_size": c.block_size,
            "dtype": str(c.dtype).removeprefix("torch."), "num_blocks": e.num_blocks,
            "speculation": c.spec.method if c.spec else "none"}


def _engine_stats(e: Engine) -> dict:
    return {"blocks_free": e.blocks.num_free, "blocks_total": e.num_blocks,
            "running": len(e.seqs), "held": len(e.held), "reserved": len(e.reserved),
            "waiting": len(e.scheduler.waiting)}
