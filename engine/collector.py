"""The garbage collector around a serving engine.

A loaded engine holds hundreds of thousands of objects the cyclic collector tracks, so a full
collection pauses every running stream. `freeze_long_lived`, called after start-up (weights
loaded, graphs captured), moves every object alive then to the permanent generation, which
collections skip; what serving allocates afterwards is still collected as before.
`watch_pauses` times every collection (`pauses`: the engine metrics' and the figures' GC
pauses)."""

from __future__ import annotations

import atexit
import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_long_lived() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how
    many are frozen. For a process that keeps its engine for life (a node, `tandem serve`):
    frozen objects that later become cyclic garbage are never freed, so a process that
    discards engines calls `unfreeze` first (the benchmarks' `free_memory`). At exit they go
    back to the collector, so the interpreter's last collection frees them (frozen Triton
    objects would otherwise be reported as leaked by its bindings)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


atexit.register(gc.unfreeze)  # nothing to do in a process that froze nothing


def unfreeze() -> None:
    """Return frozen objects to the collector (the oldest generation)."""
    gc.unfreeze()


_pause = threading.Lock()
_paused = [0, False]  # threads inside `paused`, and whether the collector ran before the first


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside (any thread's): one may free a discarded engine's CUDA
    graphs, and destroying a graph while this thread captures another invalidates the capture.
    Nests across threads: the collector comes back when the last one leaves."""
    with _pause:
        if _paused[0] == 0:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1
    try:
        yield
    finally:
        with _pause:
            _paused[0] -= 1
            if _paused[0] == 0 and _paused[1]:
                gc.enable()


_pauses = [0, 0.0]  # collections finished, and their seconds, since `watch_pauses`
_gc_began: dict[int, float] = {}  # thread id -> when its running collection started


def _on_gc(phase: str, info: dict) -> None:
    me = threading.get_ident()
    if phase == "start":
        _gc_began[me] = time.perf_counter()
        return
    began = _gc_began.pop(me, None)
    if began is not None:
        _pauses[0] += 1
        _pauses[1] += time.perf_counter() - began


def watch_pauses() -> None:
    """Time every collection from now on (once per process; not during interpreter shutdown,
    whose collections may outlive this module's globals)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
        atexit.register(_unwatch)


def _unwatch() -> None:
    if _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)


def pauses() -> tuple[int, float]:
    """(collections, seconds they paused the process) since `watch_pauses`."""
    return _pauses[0], _pauses[1]
