"""What a serving engine does once before its first request, so that nothing stalls running
streams later: capture every CUDA graph, freeze the objects alive then out of the garbage
collector, and watch for Triton kernels compiled afterwards."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine import jit_watch
from engine.attention.triton_backend import long_context as _long_context
from engine.collector import freeze_long_lived

if TYPE_CHECKING:
    from engine.engine import Engine


def split_max_seqs(eng: Engine) -> int:
    """The most sequences any attention of the model (or draft head) splits keys for:
    larger buckets need no split-KV graph variant."""
    mods = list(eng.model.modules())
    if eng.spec is not None and eng.spec.head is not None:
        mods += list(eng.spec.head.modules())
    dev = torch.device(eng.config.device)
    backends = {id(b): b for b in (getattr(m, "backend", None) for m in mods) if b}
    return max((b.max_split_seqs(dev) for b in backends.values()), default=0)


def capture_graphs(eng: Engine, batch_sizes=None, progress: bool = False,
                   long_context: bool | None = None) -> int:
    """`Engine.capture_graphs`: capture the graphs batches of `batch_sizes` will replay."""
    if long_context is None:
        long_context = eng.config.max_model_len > _long_context(torch.device(eng.config.device))
    spec = eng.spec
    sets = [eng.runner.graphs, eng.runner.prefill_graphs]
    if spec is not None and spec.graphs is not None:
        k = spec.spec.num_tokens
        sets += [spec.first_graphs, spec.prefill_graphs, spec.graphs]
        sets += [spec._chain_graph(s) for s in range(1, k)]
        if spec.fused is not None:
            sets += spec.fused.all_sets()
    sets = [g for g in sets if g is not None]
    split_max = split_max_seqs(eng)
    for g in sets:
        g.long_max_batch = split_max
    keys = [(g, key) for g in sets for key in g.pending(batch_sizes, long_context)]
    bar = tqdm(total=len(keys), disable=not progress, desc="cuda graphs", unit="graph")
    with eng.on_device(), torch.inference_mode():
        for g, key in keys:
            g.capture(*key)
            bar.update(1)
        if spec is not None and spec.fused is not None:
            spec.fused.warm_continuation()
    bar.close()
    return len(keys)


def prepare_to_serve(eng: Engine, progress: bool = False) -> int:
    """`Engine.prepare_to_serve`: graphs, garbage collector, JIT watch; returns how many
    graphs were captured."""
    n = eng.capture_graphs(progress=progress)
    freeze_long_lived()
    jit_watch.warn_after()
    return n
