"""engine/affinity.py: timing each CPU restores the affinity; pinning keeps the calling thread
on the quietest CPUs asked for, and changes nothing when asked for all of them."""

from __future__ import annotations

import os

import pytest

from engine.affinity import cpu_speeds, pin_quiet_cpus, quiet_cpus

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


def test_busy_cpus_are_left_out_even_when_fewer_than_asked_are_quiet():
    """Probe times of a machine with two quiet CPUs of six (as a GPU host read them): four
    asked, the two quiet ones kept; the quietest alone where every other one is busy."""
    speeds = {0: 3.88, 1: 6.63, 2: 4.85, 3: 6.27, 4: 6.47, 13: 3.73}
    assert quiet_cpus(speeds, 4) == [0, 13]
    assert quiet_cpus(speeds, 1) == [13]
    assert quiet_cpus({5: 3.6, 6: 3.7, 7: 3.8, 8: 3.65}, 3) == [5, 6, 8]
    assert quiet_cpus({5: 2.0, 6: 9.0}, 2) == [5]
