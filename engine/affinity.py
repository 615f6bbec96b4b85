"""The engine's CPUs: how many threads an engine on the CPU computes with, and keeping the
engine's host thread on quiet CPUs.

At many streams a step is host-bound, and a thread on a CPU shared with other work runs every
step slower. `pin_quiet_cpus` times each allowed CPU and keeps the calling thread (and threads
it starts later) on the quietest few. Linux only; elsewhere the affinity stays as it is.

`serial_torch`: CPU torch work off the engine's thread (a transport's KV copies) runs on the
calling thread alone. GNU OpenMP gives every thread that runs a parallel op a team of workers
for as long as it lives; with a second team on the cores, the workers of the engine's sleep
between products instead of spinning (its decode 1.3x slower)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

THREADS_ENV = "OMP_NUM_THREADS"


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def started_with(name: str) -> str | None:
    """`name` in the environment this process was started with: /proc/self/environ, which
    assignments to os.environ since leave as it was. None where it is unset or unreadable."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    key = name.encode() + b"="
    found = [e[len(key):] for e in entries if e.startswith(key)]
    return found[-1].decode(errors="replace") if found else None


def cpu_threads(count: int = 0) -> int:
    """Torch threads for an engine on the CPU: `count` when > 0; else OMP_NUM_THREADS as this
    process was started with (its shell, `ray start`, a Ray runtime_env), when a positive
    integer; else every CPU this process may run on. A Ray actor that books no CPUs finds
    OMP_NUM_THREADS=1, which Ray sets after the start: that value is not the user's."""
    if count > 0:
        return count
    given = (started_with(THREADS_ENV) or "").split(",")[0].strip()
    return int(given) if given.isdigit() and int(given) > 0 else allowed_cpus()


def use_cpu_threads(device: str | None, count: int | None = 0) -> int | None:
    """Give torch `cpu_threads(count)` intra-op threads when the engine runs on the CPU
    (`device` None is the engine's default, the CPU). Call it before the engine starts its
    threads: a thread keeps the count it found at its first parallel op. Returns the count set;
    None, changing nothing, for an engine on a GPU or `count` None."""
    if count is None or not str(device or "cpu").startswith("cpu"):
        return None
    import torch

    n = cpu_threads(count)
    torch.set_num_threads(n)
    return n


@contextmanager
def serial_torch() -> Iterator[None]:
    """Torch ops inside run on the calling thread alone (no OpenMP team), its thread count
    restored after. Torch's process-wide default is 1 meanwhile: a thread that runs its first
    parallel op then keeps one thread, so engines set theirs first (`use_cpu_threads`)."""
    import torch

    prev = torch.get_num_threads()
    if prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _probe_us(reps: int) -> float:
    """Microseconds per small torch op (op dispatch: the engine step's most common host
    work) on the CPU the calling thread runs on: best of three stretches."""
    import torch

    x = torch.zeros(8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            x.add_(1.0)
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def cpu_speeds(rounds: int = 3, reps: int = 300) -> dict[int, float]:
    """Per allowed CPU, the slowest of `rounds` probes (each the best of three stretches of
    `reps` ops), rounds interleaved over the CPUs: a CPU shared with other work only at
    times should not pass for quiet on one lucky stretch. The affinity is restored."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    allowed = sorted(os.sched_getaffinity(0))
    speeds: dict[int, float] = {}
    try:
        for _ in range(rounds):
            for c in allowed:
                os.sched_setaffinity(0, {c})
                speeds[c] = max(speeds.get(c, 0.0), _probe_us(reps))
    finally:
        os.sched_setaffinity(0, allowed)
    return speeds


# A CPU whose probe takes this many times the quietest CPU's is busy with other work: a thread
# allowed onto it runs there part of the time, so it is left out even when fewer than asked
# are quiet.
BUSY_OVER_QUIETEST = 1.25


def quiet_cpus(speeds: dict[int, float], count: int) -> list[int]:
    """The `count` quietest CPUs of `speeds` (probe microseconds per CPU), less those busy
    (BUSY_OVER_QUIETEST); at least the quietest one."""
    order = sorted(speeds, key=speeds.get)
    best = speeds[order[0]]
    return sorted(c for c in order[:count] if speeds[c] <= BUSY_OVER_QUIETEST * best)


def pin_quiet_cpus(count: int = 4, rounds: int = 3) -> dict:
    """Keep the calling thread, and threads it starts from now on, on the `count` quietest
    allowed CPUs that are not busy (`cpu_speeds`, `quiet_cpus`). Returns the CPUs' speeds and
    the choice (for a benchmark's JSON); with `count` covering every allowed CPU, or off Linux,
    changes nothing."""
    if not hasattr(os, "sched_setaffinity"):
        return {"pinned": None, "why": "no sched_setaffinity here"}
    allowed = sorted(os.sched_getaffinity(0))
    if count <= 0 or count >= len(allowed):
        return {"pinned": None, "why": f"{len(allowed)} CPUs allowed, {count} asked"}
    speeds = cpu_speeds(rounds)
    chosen = quiet_cpus(speeds, count)
    os.sched_setaffinity(0, chosen)
    return {"pinned": chosen, "probe_us": {c: round(t, 3) for c, t in speeds.items()}}
