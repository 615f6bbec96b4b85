"""Keeping the engine's host thread on quiet CPUs.

At 64 streams an engine step is host-bound, so the host's speed decides throughput. On the
H200 machine (16 vCPUs, one NUMA node) some vCPUs ran a small torch op at 4.4-5.6 us and a
Python loop iteration at 0.16-0.19 us where the others ran 2.95-3.2 and 0.083
(`bench/results/profile/host_affinity_*/`): CPUs shared with other work. Two vCPUs were slow
in every round of that probe, others in some. A process whose busy main thread landed on
one ran its whole benchmark ~2x slower on the host (figure 3's `host_probe`: torch ops at
6.2 against 3.4 us), which decided whether speculation met its goal at 64 streams.

`pin_quiet_cpus` times each allowed CPU a few times over and keeps the calling thread (and
the threads it starts later) on the quietest few. Linux only; elsewhere it leaves the
affinity as it is."""

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
    allowed CPUs (`cpu_speeds`). Returns what was measured and chosen (for a benchmark's
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
