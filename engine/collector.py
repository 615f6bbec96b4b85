"""The garbage collector around a serving engine.

A loaded engine holds several hundred thousand objects the cyclic collector tracks (modules,
parameters, tokenizer, captured graphs, compiled kernels); with SmolLM2 loaded on the
development machine a full collection walks ~395k of them in ~150 ms. Python runs one when
the objects that survived the young generations since the last full one pass a quarter of
the old generation: soon after start-up's own allocations (graph capture makes many), and
later whenever serving has kept enough objects alive. Each is a pause of that size in the
middle of every running stream. `freeze_long_lived` after start-up (weights loaded, graphs
captured) moves every object alive then to the permanent generation, which collections
skip (a full collection then took ~0 ms there); what serving allocates afterwards is still
collected as before. (How often such pauses landed in the benchmarks' timed windows on the
GPU host is not measured.)"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how
    many are frozen. For a process that keeps its engine for life (a node, `tandem serve`):
    frozen objects that later become cyclic garbage are never freed, so a process that
    discards engines calls `unfreeze` first (the benchmarks' `free_memory`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Return frozen objects to the collector (the oldest generation)."""
    gc.unfreeze()
