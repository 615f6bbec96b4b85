"""What the engine of each role is built with, from the topology config: the keyword arguments
of `engine.Engine.from_pretrained`. `node_kwargs` gives them without torch types (the dtype by
name, the speculation config as a dict), as the router process sends them to its actors."""

from __future__ import annotations

import os
import re
from typing import Any

from cluster.config import ClusterConfig, SpecSection


def engine_kwargs(cfg: ClusterConfig, role: str) -> dict[str, Any]:
    """Keyword arguments for `engine.Engine.from_pretrained(cfg.model.path, **kwargs)`."""
    from node_common.node import engine_types

    return engine_types(node_kwargs(cfg, role))


def node_kwargs(cfg: ClusterConfig, role: str) -> dict[str, Any]:
    """`engine_kwargs` with the dtype by name and the speculation config as a dict, which a
    node actor turns into torch types (`node_common.node.engine_types`): building them would
    load torch into the router's process."""
    sec, spec = cfg.role_section(role), cfg.speculation
    kw: dict[str, Any] = {
        "device": sec.resolved_device,
        "dtype": dtype_name(cfg.model.dtype, sec.resolved_device),
        "block_size": cfg.model.block_size,
        "max_num_seqs": sec.max_num_seqs,
        "max_num_batched_tokens": sec.max_num_batched_tokens,
        "enable_prefix_caching": sec.enable_prefix_caching,
        "admission_delay_steps": sec.admission_delay_steps,
        "admit_in_flight": sec.admit_in_flight,
        # Prefill needs the spec too: it fills the EAGLE-3 draft layer's KV that it ships.
        "spec": None if spec.method == "none" else spec_fields(spec),
        "overlap": cfg.speculation.overlap,  # greedy decode steps, with speculation or not
        "deterministic": cfg.engine.deterministic,
    }
    if role == "prefill":
        kw["handoff_drafts"] = cfg.speculation.prefill_drafts
    optional = {"kv_cache_bytes": sec.kv_cache_bytes, "max_model_len": cfg.model.max_model_len,
                "gpu_memory_utilization": sec.gpu_memory_utilization}
    kw.update({k: v for k, v in optional.items() if v is not None})
    return kw


def dtype_name(name: str, device: str) -> str:
    """A config dtype name with auto resolved: bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return name


def spec_fields(spec: SpecSection) -> dict[str, Any]:
    """The `SpecConfig` fields a speculation section sets."""
    return {"method": spec.method, "num_tokens": spec.num_tokens, "head": spec.head,
            "dynamic": spec.dynamic, "context_drafts": spec.context_drafts,
            "collapse_below": spec.collapse_below}


def bad_device(device: str) -> str | None:
    """Why a --device value names no device an engine runs on (None: cpu, cuda or cuda:N)."""
    return None if re.fullmatch(r"cpu|cuda(:\d+)?", device) else \
        f"--device: {device!r} is not cpu, cuda or cuda:N"


def unusable_device(device: str) -> str | None:
    """`bad_device`, or why this machine cannot run on it (CUDA asked for, none here)."""
    if why := bad_device(device):
        return why
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}: no CUDA device here (use --device cpu)"
    return None


def missing_head(folder: str) -> str | None:
    """Why `folder` holds no EAGLE-3 head to load (None: it has a config.json), for the
    CLI's one-line refusals before an engine starts."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return None
    return f"no EAGLE-3 head in {folder!r} (want a folder with config.json and model.safetensors)"
