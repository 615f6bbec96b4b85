"""engine/affinity.py: timing each CPU restores the affinity; pinning keeps the calling thread
on the quietest CPUs asked for, and changes nothing when asked for all of them; a transport
thread's KV copies start no OpenMP team."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.affinity import cpu_speeds, pin_quiet_cpus, quiet_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
ROOT = Path(__file__).resolve().parents[2]


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


_SIDE_THREAD = """
import os, sys, threading, torch
from kvtransfer import staging
torch.set_num_threads(2)  # as a node's engine has them
kv = torch.zeros(4, 2, 64, 16, 3, 64)  # [layers, K/V, blocks, block...]: 1.5M elements
ids = torch.arange(0, 64, 2)
tasks = lambda: len(os.listdir("/proc/self/task"))
ones = torch.ones(4 * 2 * 32 * 16 * 3 * 64)
grew, got = [], []

def side():  # a transport's thread: gathers and scatters KV, and lives on
    before = tasks()
    data = torch.empty(4 * 2 * 32 * 16 * 3 * 64)
    staging.scatter(kv, (0, 4), ids, ones)
    out = staging.gather(kv, (0, 4), ids, data)
    grew.append(tasks() - before)
    grew.append(torch.get_num_threads())
    got.append(out)

th = threading.Thread(target=side)
th.start()
th.join()
assert float(kv[:, :, ids].min()) == 1.0 and float(kv.sum()) == kv[:, :, ids].numel()
assert float(got[0].min()) == 1.0  # what landed reads back
print(grew)
"""


def test_kv_copies_off_the_engine_thread_start_no_openmp_team():
    """A transport thread's CPU gathers and scatters run on it alone (`serial_torch`): an
    OpenMP team of its own would outlive them and slow the engine thread's products."""
    out = subprocess.run([sys.executable, "-c", _SIDE_THREAD], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[0,", "2]"]  # no worker threads; the thread count restored
