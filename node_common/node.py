"""The role-independent part of a node actor: the engine on the actor's GPU with its loop and
metrics, the router's liveness calls, and the stats, info and tokenizer it reads. The engine,
torch and the transport are imported when an actor starts, so the router imports these
classes without torch."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import Engine
    from engine.handoff import Handoff
    from engine.tokenizer import TokenizerSpec

# Set to "1" by the launcher for GPU actors under `transfer.ipc_across_gpus`: Ray then leaves
# CUDA_VISIBLE_DEVICES alone, so an actor sees every GPU of its node (to map a peer's cache on
# another GPU) and runs on its own by index.
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


def on_own_gpu(engine_kwargs: dict) -> dict:
    """`engine_kwargs` with its device, if it names one, made this actor's own (`node_device`)."""
    return {**engine_kwargs, "device": node_device(engine_kwargs.get("device"))} \
        if "device" in engine_kwargs else engine_kwargs


def seal(h: Handoff) -> bytes:
    """The hand-off as bytes for its trip through the router, which passes it on unread: it
    holds tensors, and reading them would load torch into the router's process."""
    return pickle.dumps(h, protocol=pickle.HIGHEST_PROTOCOL)


def unseal(sealed: bytes) -> Handoff:
    """The hand-off a prefill node sealed (`seal`)."""
    return pickle.loads(sealed)


def engine_types(engine_kwargs: dict) -> dict:
    """`engine_kwargs` with a dtype given by name made the torch dtype and a speculation config
    given as a dict made the `SpecConfig`: a process without torch (the router) sends them so."""
    kw = dict(engine_kwargs)
    if isinstance(kw.get("dtype"), str):
        import torch

        kw["dtype"] = getattr(torch, kw["dtype"])
    if isinstance(kw.get("spec"), dict):
        from engine.config import SpecConfig

        kw["spec"] = SpecConfig(**kw["spec"])
    return kw


def serve_metrics(role: str, port: int | None, host: str = "127.0.0.1",
                  model_name: str | None = None):
    """This node's Prometheus metrics (labelled with `model_name`), exposed over HTTP on
    `host` unless port is None (0: a free port)."""
    from engine.metrics import Metrics

    m = Metrics(role, model_name=model_name)
    return m, (m.serve(host, port)[1] if port is not None else None)


def engine_info(e: Engine) -> dict:
    """What the router needs to validate prompts and describe the model, without the model."""
    c = e.config
    return {"model": c.model.name, "vocab_size": c.model.vocab_size,
            "max_model_len": c.max_model_len, "block_size": c.block_size,
            "dtype": str(c.dtype).removeprefix("torch."), "num_blocks": e.num_blocks,
            "speculation": c.spec.method if c.spec else "none", "deterministic": c.deterministic}


def node_info(node) -> dict:
    """`engine_info` of the node's engine, its metrics port and where it runs."""
    return {**engine_info(node.engine), "metrics_port": node.metrics_port,
            "placement": placement(node.engine)}


def placement(e: Engine) -> dict:
    """Where this node runs: its device, the GPU Ray gave it, the attention backend."""
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


def engine_stats(e: Engine) -> dict:
    """The engine's block and request counts (run on its loop's thread)."""
    return {"blocks_free": e.blocks.num_free, "blocks_total": e.num_blocks,
            "running": len(e.seqs), "held": len(e.held), "reserved": len(e.reserved),
            "waiting": len(e.scheduler.waiting)}


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


class Node(Liveness):
    """A node actor's engine, started on its own GPU and ready to serve, run by an
    `EngineLoop`, with its metrics; the subclass adds its role's transport and calls.
    `cpu_threads`: torch threads of an engine on the CPU (`engine.affinity.cpu_threads`; 0:
    OMP_NUM_THREADS as the actor was started with, else its CPUs); None: as they are."""

    def __init__(self, role: str, model: str | None, engine_kwargs: dict,
                 metrics_port: int | None, metrics_host: str, cpu_threads: int | None = None):
        from engine import Engine
        from engine.affinity import use_cpu_threads
        from engine.loop import EngineLoop
        from kvtransfer.layout import BlockLayout

        started = time.perf_counter()

        def make() -> Engine:  # on the engine's own thread (`EngineLoop`)
            # here: a thread keeps the torch thread count it had at its first parallel op
            use_cpu_threads(engine_kwargs.get("device"), cpu_threads)
            engine = Engine.from_pretrained(model, **on_own_gpu(engine_types(engine_kwargs)))
            # graphs captured, objects frozen, compiles logged and counted from here on
            engine.prepare_to_serve(started=started)
            return engine

        self.loop = EngineLoop(make=make)
        self.loop.start()
        self.engine = self.loop.engine
        print(f"{role} node {self.engine.ready}", file=sys.stderr, flush=True)
        self.metrics, self.metrics_port = serve_metrics(role, metrics_port, metrics_host,
                                                        self.engine.config.model.name)
        self.loop.on_step = self.metrics.engine_step
        self.metrics.watch_engine(self.engine)
        self.layout = BlockLayout.from_engine_config(self.engine.config)

    async def stats(self) -> dict:
        return await self.loop.call(engine_stats)

    async def info(self) -> dict:
        return node_info(self)

    async def tokenizer_spec(self) -> TokenizerSpec | None:
        """The engine's tokenizer as plain data (`Tokenizer.spec`), which the router encodes
        prompts with; None for an engine without one."""
        tok = self.engine.tokenizer
        return tok.spec() if tok is not None else None
