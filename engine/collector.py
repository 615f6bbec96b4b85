"""The garbage collector around a serving engine.

A loaded engine holds several hundred thousand objects the cyclic collector tracks (modules,
parameters, tokenizer, captured graphs, compiled kernels); with SmolLM2 loaded on the
development machine a full collection walks ~395k of them in ~150 ms. Python runs one once
enough objects outlive the young generations, and under steady decoding that is every few
seconds: a pause of that size in the middle of a token stream. `freeze_long_lived` after
start-up (weights loaded, graphs captured) moves every object alive then to the permanent
generation, which collections skip (a full collection then took ~0 ms there); what serving
allocates afterwards is still collected as before."""

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
