"""What the engine of each role is built with, from the topology config: the keyword arguments
of `engine.Engine.from_pretrained`, the torch dtype, the speculation config."""

from __future__ import annotations

from typing import Any

from cluster.config import ClusterConfig, SpecSection


def engine_kwargs(cfg: ClusterConfig, role: str) -> dict[str, Any]:
    """Keyword arguments for `engine.Engine.from_pretrained(cfg.model.path, **kwargs)`."""
    sec = cfg.role_section(role)
    device = sec.resolved_device
    kw: dict[str, Any] = {
        "device": device,
        "dtype": torch_dtype(cfg.model.dtype, device),
        "block_size": cfg.model.block_size,
        "max_num_seqs": sec.max_num_seqs,
        "max_num_batched_tokens": sec.max_num_batched_tokens,
        "enable_prefix_caching": sec.enable_prefix_caching,
        "admission_delay_steps": sec.admission_delay_steps,
        "admit_in_flight": sec.admit_in_flight,
        # Prefill needs the spec too: it fills the EAGLE-3 draft layer's KV that it ships.
        "spec": spec_config(cfg.speculation),
        "overlap": cfg.speculation.overlap,  # greedy decode steps, with speculation or not
    }
    if role == "prefill":
        kw["handoff_drafts"] = cfg.speculation.prefill_drafts
    optional = {"kv_cache_bytes": sec.kv_cache_bytes, "max_model_len": cfg.model.max_model_len,
                "gpu_memory_utilization": sec.gpu_memory_utilization}
    kw.update({k: v for k, v in optional.items() if v is not None})
    return kw


def torch_dtype(name: str, device: str):
    """The torch dtype for a config dtype name; auto is bfloat16 on CUDA, float32 on CPU."""
    import torch

    if name == "auto":
        name = "bfloat16" if device.startswith("cuda") else "float32"
    return getattr(torch, name)


def spec_config(spec: SpecSection):
    """The engine's `SpecConfig` for this section, or None for method none."""
    if spec.method == "none":
        return None
    from engine.config import SpecConfig

    return SpecConfig(method=spec.method, num_tokens=spec.num_tokens, head=spec.head,
                      dynamic=spec.dynamic, context_drafts=spec.context_drafts)
