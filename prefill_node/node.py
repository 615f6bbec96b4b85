"""The prefill node: the engine in prefill role. Chunked prefill of the target and the draft
layer, the first token straight back to the router, the request's KV blocks shipped to the
decode node's reserved blocks and held under a lease until the decode side acknowledges."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from engine import Engine, SamplingParams
from engine.handoff import Handoff
from engine.loop import EngineLoop
from engine.output import RequestOutput
from kvtransfer.factory import make_transport
from kvtransfer.layout import BlockLayout

# Set (to "1") by the launcher for GPU actors with `transfer.ipc_across_gpus`: Ray then leaves
# CUDA_VISIBLE_DEVICES as the node had it, so an actor sees every GPU of its node (a prefill
# actor can map a decode actor's cache on another GPU, or the other way) and runs on its own
# by index.
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
GUARD_S = 1.0  # how often a node checks its transport's receive loops
log = logging.getLogger("tandem.node")


def gpu_index(gpu_id: int | str, visible: str | None) -> int:
    """Where Ray's GPU id `gpu_id` is in this process's CUDA numbering: its place in
    `CUDA_VISIBLE_DEVICES` when the node set one (Ray's ids are then its entries), else the
    id itself."""
    gid = str(gpu_id).strip()
    if not visible:
        return int(gid)
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if gid not in listed:
        raise RuntimeError(f"Ray gave this actor GPU {gid}, which CUDA_VISIBLE_DEVICES="
                           f"{visible!r} does not list")
    return listed.index(gid)


def node_device(device: str | None) -> str | None:
    """The device this actor's engine runs on: with every GPU of the node visible (`NOSET_ENV`),
    "cuda" becomes the GPU Ray gave this actor, by index, and it is made this thread's
    current device; any other device as it is."""
    import os

    if device != "cuda" or os.environ.get(NOSET_ENV) != "1":
        return device
    import ray
    import torch

    ids = sorted(ray.get_gpu_ids(), key=str)
    if not ids:
        return device
    index = gpu_index(ids[0], os.environ.get("CUDA_VISIBLE_DEVICES"))
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _on_own_gpu(engine_kwargs: dict) -> dict:
    return {**engine_kwargs, "device": node_device(engine_kwargs.get("device"))} \
        if "device" in engine_kwargs else engine_kwargs


class Liveness:
    """What the router asks a node actor to learn whether it still lives, and the guard of
    its transport's receive loops."""

    _guard: asyncio.Task | None = None

    def guard_transport(self) -> None:
        """Start `_guard_loop` once, on the actor's event loop."""
        if self._guard is None or self._guard.done():
            self._guard = asyncio.ensure_future(self._guard_loop())

    async def _guard_loop(self) -> None:
        """Counts the transport's dropped messages; a receive loop that died ends this process,
        so Ray restarts the actor and the router moves its streams, rather than a node that
        acks nothing serving on."""
        seen = 0
        while True:
            await asyncio.sleep(GUARD_S)
            dropped = self.transport.dropped_messages
            if dropped > seen:
                self.metrics.kv_dropped.inc(dropped - seen)
                seen = dropped
            if not self.transport.healthy:
                log.error("kvtransfer: %s; exiting so that Ray restarts this actor",
                          getattr(self.transport, "failure", None) or "a receive loop died")
                logging.shutdown()
                os._exit(70)

    async def ping(self) -> bool:
        """Alive (answered at once, whatever the engine is doing)."""
        return True

    async def watch(self) -> None:
        """Never returns while this actor lives: the router keeps one call pending per actor,
        which fails the moment the actor dies."""
        await asyncio.Event().wait()


class PrefillNode(Liveness):
    """Plain class; cluster/launcher.py runs it as a Ray actor."""

    def __init__(self, model: str | None, engine_kwargs: dict, transport: str = "ucx",
                 metrics_port: int | None = None, transport_kwargs: dict | None = None,
                 metrics_host: str = "127.0.0.1"):
        self.engine = Engine.from_pretrained(model, **_on_own_gpu(engine_kwargs))
        self.engine.prepare_to_serve()  # graphs captured, objects frozen, compiles logged
        self.metrics, self.metrics_port = serve_metrics("prefill", metrics_port, metrics_host)
        self.loop = EngineLoop(self.engine)
        self.loop.on_step = self.metrics.engine_step
        self.metrics.watch_engine(self.engine)
        self.loop.start()
        self.layout = BlockLayout.from_engine_config(self.engine.config)
        self.transport = make_transport(transport, self.layout,
                                        **(transport_kwargs or {}))
        self._conns: dict[str, object] = {}
        self._active: set[str] = set()  # requests inside prefill()
        self._cancelled: set[str] = set()
        self._sending: dict[str, asyncio.Future] = {}
        self.transferred_bytes = 0
        self.transfer_paths: dict[str, int] = {}  # TransferStats.path -> transfers

    async def prefill(self, rid: str, ids: list[int], params: SamplingParams,
                      spec_cap: int | None, decode_address: dict, dst_blocks: list[int],
                      resume: tuple[int, int] | None = None
                      ) -> AsyncIterator[RequestOutput | Handoff]:
        """Prefill and yield the first output at once (TTFT does not wait for the transfer);
        then ship the KV and yield the hand-off. Nothing more when the request already
        finished at its first token. `resume`: a stream moved here after a worker died
        (`Engine.add_request`)."""
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
        yield h

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

    async def stats(self) -> dict:
        return await self.loop.call(_engine_stats)

    async def info(self) -> dict:
        return node_info(self)


def serve_metrics(role: str, port: int | None, host: str = "127.0.0.1"):
    """This node's Prometheus metrics, exposed over HTTP on `host` unless port is None (0: a
    free port)."""
    from engine.metrics import Metrics

    m = Metrics(role)
    return m, (m.serve(host, port)[1] if port is not None else None)


def engine_info(e: Engine) -> dict:
    """What the router needs to validate prompts and describe the model, without the model."""
    c = e.config
    return {"model": c.model.name, "vocab_size": c.model.vocab_size,
            "max_model_len": c.max_model_len, "block_size": c.block_size,
            "dtype": str(c.dtype).removeprefix("torch."), "num_blocks": e.num_blocks,
            "speculation": c.spec.method if c.spec else "none"}


def node_info(node) -> dict:
    return {**engine_info(node.engine), "metrics_port": node.metrics_port,
            "placement": placement(node.engine)}


def placement(e: Engine) -> dict:
    """Where this node runs: its device, the GPU Ray gave it, the attention backend."""
    import os

    import torch

    dev = str(e.config.device)
    out = {"device": dev, "attention_backend": e.config.backend_name,
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "cuda_graphs": e.config.use_cuda_graphs}
    if dev.startswith("cuda"):
        out["visible_gpus"] = torch.cuda.device_count()
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["gpu_uuid"] = str(torch.cuda.get_device_properties(dev).uuid)
    return out


def _engine_stats(e: Engine) -> dict:
    return {"blocks_free": e.blocks.num_free, "blocks_total": e.num_blocks,
            "running": len(e.seqs), "held": len(e.held), "reserved": len(e.reserved),
            "waiting": len(e.scheduler.waiting)}
