"""bench.host_affinity: every CPU set is probed in its own process, pinned where asked."""

import json
import os
import shutil

import pytest

from bench import host_affinity


def test_cpulist_parses_ranges():
    assert host_affinity.cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]


@pytest.mark.skipif(not (hasattr(os, "sched_getaffinity") and shutil.which("taskset")),
                    reason="needs Linux and taskset")
def test_probes_each_set_pinned(tmp_path):
    out = tmp_path / "aff.json"
    assert host_affinity.main(["--out", str(out), "--runs", "1", "--max-single", "1"]) == 0
    res = json.loads(out.read_text())
    cpu = sorted(os.sched_getaffinity(0))[0]
    assert {"unpinned", f"cpu {cpu}"} <= set(res["probes"])
    for name, runs in res["probes"].items():
        assert len(runs) == 1 and runs[0]["torch_op_us"] > 0, (name, runs)
    assert res["probes"][f"cpu {cpu}"][0]["cpus"] == [cpu]
