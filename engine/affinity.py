"""Keeping the engine's host thread on quiet CPUs.

At many streams a step is host-bound, and a thread on a CPU shared with other work runs every
step slower. `pin_quiet_cpus` times each allowed CPU and keeps the calling thread (and threads
it starts later) on the quietest few. Linux only; elsewhere the affinity stays as it is."""

from __future__ import annotations

import os
import time


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


def pin_quiet_cpus(count: int = 4, rounds: int = 3) -> dict:
    """Keep the calling thread, and threads it starts from now on, on the `count` quietest
    allowed CPUs (`cpu_speeds`). Returns the CPUs' speeds and the choice (for a benchmark's
    JSON); with `count` covering every allowed CPU, or off Linux, changes nothing."""
    if not hasattr(os, "sched_setaffinity"):
        return {"pinned": None, "why": "no sched_setaffinity here"}
    allowed = sorted(os.sched_getaffinity(0))
    if count <= 0 or count >= len(allowed):
        return {"pinned": None, "why": f"{len(allowed)} CPUs allowed, {count} asked"}
    speeds = cpu_speeds(rounds)
    chosen = sorted(sorted(speeds, key=speeds.get)[:count])
    os.sched_setaffinity(0, chosen)
    return {"pinned": chosen, "probe_us": {c: round(t, 3) for c, t in speeds.items()}}
