"""engine/affinity.py: timing each CPU restores the affinity; pinning keeps the calling thread
on the quietest CPUs asked for, and changes nothing when asked for all of them."""

from __future__ import annotations

import os

import pytest

from engine.affinity import cpu_speeds, pin_quiet_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def test_cpu_speeds_times_every_allowed_cpu_and_restores_the_affinity():
    allowed = os.sched_getaffinity(0)
    speeds = cpu_speeds(rounds=1, reps=50)
    assert set(speeds) == allowed and all(t > 0 for t in speeds.values())
    assert os.sched_getaffinity(0) == allowed


def test_pin_quiet_cpus_keeps_the_fastest_and_leaves_all_alone():
    allowed = os.sched_getaffinity(0)
    try:
        assert pin_quiet_cpus(len(allowed))["pinned"] is None
        assert os.sched_getaffinity(0) == allowed
        if len(allowed) < 2:
            return
        got = pin_quiet_cpus(1, rounds=1)
        assert os.sched_getaffinity(0) == set(got["pinned"]) and len(got["pinned"]) == 1
        assert got["probe_us"][got["pinned"][0]] == min(got["probe_us"].values())
    finally:
        os.sched_setaffinity(0, allowed)
