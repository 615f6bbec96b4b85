"""Triton kernels compiled (or loaded from Triton's disk cache) while the process runs.

A kernel compiles on its first launch with a new specialization (constexprs, an integer's
divisibility, a pointer's alignment) and stalls the batch; after start-up any compile is a stall
a user sees. `install()` records each compile for the benchmarks; `warn_after()` marks the
process ready, after which each compile is logged and counted (`after_ready`). `use_cache_dir`
keeps compiled kernels on disk, so a restarted process loads them instead of compiling."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)
CACHE_ENV = "TRITON_CACHE_DIR"  # read by Triton when it looks a kernel up or stores one


@dataclass(frozen=True)
class Compile:
    name: str  # the kernel's function name
    at: float  # time.perf_counter() when it finished
    seconds: float  # host time from the cache miss to the compiled kernel


_events: list[Compile] = []
_lock = threading.Lock()
_started: dict[int, float] = {}  # thread id -> perf_counter at its latest cache miss
_installed = False
_warn_from: float | None = None  # the ready mark: compiles that start later are stalls
_after_ready = 0  # compiles that started after the ready mark


def install() -> bool:
    """Hook Triton's JIT (once per process; chains hooks already set). False without Triton
    or without its runtime hooks (older Triton): nothing is recorded then."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
        rt = knobs.runtime
        prev_miss, prev_done = rt.jit_cache_hook, rt.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def on_miss(*args, **kw):
        _started[threading.get_ident()] = time.perf_counter()
        return prev_miss(*args, **kw) if prev_miss else None

    def on_done(*args, **kw):
        global _after_ready
        now = time.perf_counter()
        fn = kw.get("fn")
        name = getattr(fn, "name", None) or str(kw.get("key", "?"))[:60]
        t0 = _started.pop(threading.get_ident(), now)
        event = Compile(name, now, now - t0)
        late = _warn_from is not None and t0 >= _warn_from
        with _lock:
            _events.append(event)
            _after_ready += late
        if late:
            log.warning("Triton kernel %s compiled while serving (%.0f ms): every stream of "
                        "the batch waited for it", name, event.seconds * 1e3)
        return prev_done(*args, **kw) if prev_done else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = on_miss, on_done
    _installed = True
    return True


def count() -> int:
    """Compiles recorded so far (a mark for `since`)."""
    return len(_events)


def since(mark: int) -> list[Compile]:
    """Compiles recorded after `count()` returned mark."""
    with _lock:
        return _events[mark:]


def warn_after(now: float | None = None) -> None:
    """Mark the process ready: log a warning for, and count, every compile that starts from
    now on (installs the hook)."""
    global _warn_from
    install()
    _warn_from = time.perf_counter() if now is None else now


def after_ready() -> int:
    """Compiles that started after the process was marked ready (`warn_after`), each one a
    stall of the batch that launched it."""
    return _after_ready


@contextmanager
def starting_up() -> Iterator[None]:
    """Compiles inside are start-up work, not stalls (another engine of the process preparing
    after a first one was ready): the ready mark is lifted while the body runs and set anew
    when it ends; an error puts the old mark back."""
    global _warn_from
    before, _warn_from = _warn_from, None
    try:
        yield
    except BaseException:
        _warn_from = before
        raise
    warn_after()


def use_cache_dir(path: str | None) -> None:
    """Keep Triton's compiled kernels in `path` (None: Triton's default, ~/.triton/cache), so
    that a restarted process loads them instead of compiling. Takes effect for kernels not
    compiled yet: call it before the engine is built."""
    if path:
        os.environ[CACHE_ENV] = path


def default_cache_dir() -> str:
    """The folder Triton keeps compiled kernels in when CACHE_ENV is unset."""
    try:
        from triton import knobs

        return knobs.cache.dir
    except (ImportError, AttributeError):
        return os.path.join(os.path.expanduser("~"), ".triton", "cache")


def summary(events: list[Compile]) -> dict:
    """{kernel name: [count, seconds]} of these compiles."""
    out: dict[str, list] = {}
    for e in events:
        c = out.setdefault(e.name, [0, 0.0])
        c[0] += 1
        c[1] = round(c[1] + e.seconds, 3)
    return out
