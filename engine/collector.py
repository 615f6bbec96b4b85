"""The garbage collector around a serving engine.

A loaded engine holds hundreds of thousands of objects the cyclic collector tracks, so a full
collection pauses every running stream. `freeze_long_lived`, called after start-up (weights
loaded, graphs captured), moves every object alive then to the permanent generation, which
collections skip; what serving allocates afterwards is still collected as before."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside (any thread's): one may free a discarded engine's CUDA
    graphs, and destroying a graph while this thread captures another invalidates the capture."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
