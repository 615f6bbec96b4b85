"""The cluster a soak runs against, in this process: what `tandem serve` starts (Ray prefill
and decode actors, KV over UCX with checksums, the gRPC router), with a router that can be
restarted on its port; also the model export and the settled-stats check the e2e tests share."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

# Small KV settings for a CPU: 256 MiB of cache per actor, no prefix caching (its blocks would
# make a request's output depend on what ran before), EAGLE-3 with three drafts.
ENGINE_KW = {"enable_prefix_caching": False, "kv_cache_bytes": 256 << 20, "max_model_len": 2048}
SPEC_TOKENS = 3


def engine_kwargs(kv_cache_mb: int = 256, device: str | None = None,
                  dtype: str | None = None, gpu_share: float = 0.0,
                  deterministic: bool = False) -> dict:
    """The actors' engine settings (`ENGINE_KW`, with EAGLE-3 at `SPEC_TOKENS` drafts), on
    `device` in `dtype` where given (else the engine's defaults: the CPU, fp32). On a GPU
    shared by actors (`gpu_share` each) the KV cache takes half an actor's share of the free
    memory: actors that start together all see the whole GPU free."""
    from engine.config import SpecConfig

    placed = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    if gpu_share > 0:
        placed["gpu_memory_utilization"] = round(gpu_share / 2, 4)
    if deterministic:
        placed["deterministic"] = True
    return {**ENGINE_KW, "kv_cache_bytes": kv_cache_mb << 20, **placed,
            "spec": SpecConfig(num_tokens=SPEC_TOKENS, dynamic=False)}


def embedded_export(cache: str | None = None) -> str:
    """The embedded SmolLM2 GGUF exported once to an HF folder (fp32 safetensors, config,
    tokenizer): the same model and outputs without the GGUF's slow metadata parse, so a killed
    actor is back in seconds. The folder keeps the model's name, which picks its EAGLE-3 head."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from engine import loader

    ck = loader.embedded_checkpoint()
    st = os.stat(os.path.join(ck.folder, ck.gguf_file))
    key = hashlib.sha256(f"{ck.gguf_file}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    root = os.path.join(cache or os.environ.get("XDG_CACHE_HOME")
                        or os.path.expanduser("~/.cache"), "tandem", f"export-{key[:12]}")
    out = os.path.join(root, loader.EMBEDDED_NAME)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root)  # renamed into place whole: a racing export loses cleanly
    AutoConfig.from_pretrained(ck.folder, **ck.hf_kwargs()).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(ck.folder, **ck.hf_kwargs()).save_pretrained(tmp)
    sd = loader.load_state_dict(ck, torch.float32)
    sd.pop("lm_head.weight", None)  # tied to the embedding
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def settled_stats(cluster, tries: int = 100) -> list[dict]:
    """Every actor's stats once nothing runs and every block is free (cancels land
    asynchronously), or the last stats seen."""
    import ray

    for _ in range(tries):
        stats = ray.get([a.stats.remote() for a in cluster.prefills + cluster.decodes])
        if all(s["blocks_free"] == s["blocks_total"] and s["running"] == 0 for s in stats):
            break
        threading.Event().wait(0.1)
    return stats


class Served:
    """What `tandem serve` runs, in this process: the disaggregated cluster (Ray prefill and
    decode actors, KV over UCX with checksums) and the gRPC router on its own event-loop thread,
    which `restart_router` can kill and bring back on the same port. `gpus`: the GPU share each
    actor books from Ray (fractions let every actor share one GPU)."""

    def __init__(self, model: str | None = None, engine_kw: dict | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, replicas: int = 1,
                 gpus: float = 0.0):
        import ray

        from cluster import launcher
        from cluster.config import TransferSection

        self._own_ray = not ray.is_initialized()
        self.cluster = launcher.start(model, engine_kw or engine_kwargs(), transport="ucx",
                                      transport_kwargs=TransferSection(
                                          checksum=True).transport_kwargs(),
                                      prefill_replicas=replicas, decode_replicas=replicas,
                                      prefill_gpus=gpus, decode_gpus=gpus)
        self.host = host
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="soak-router").start()
        self.service, self.server, self.port = self._call(self._boot(port))

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def _boot(self, port: int):
        from router.server import GenerationService, start_server

        service = GenerationService(self.cluster.backend)
        server, bound = await start_server(service, self.host, port)
        return service, server, bound

    def _call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def restart_router(self) -> None:
        """Stop the gRPC server at once (its calls break off, UNAVAILABLE) and start a new one
        on the same port over the same backend: a router that died and came back."""
        self._call(self.server.stop(0))
        self.service.close()
        self.service, self.server, port = self._call(self._boot(self.port))
        if port != self.port:
            raise RuntimeError(f"the router came back on port {port}, not {self.port}")

    def close(self) -> None:
        import ray

        self._call(self.server.stop(0))
        self.service.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.cluster.shutdown()
        if self._own_ray:
            ray.shutdown()
