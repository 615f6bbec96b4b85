"""How fast the host runs an engine step's small work on each CPU set (GPU machines).

    python -m bench.host_affinity --out FILE [--runs 3]

On the H200 machine whole processes of the same code ran their torch ops at ~3.4 or ~6.2 us
each (`bench.common.host_probe_us`; figure 3's `host_probe`), and at 64 streams, where a
step is host-bound, that decided whether speculation met its goal. This starts fresh
processes of the probe unpinned, pinned to each NUMA node's CPUs (`taskset`), and pinned to
the CPUs the GPU's PCI device reports as local, `--runs` times each, and writes what each
measured, with the machine's NUMA layout and the GPU's local CPUs."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

PROBE = ("import json; from bench.common import host_probe_us; "
         "print(json.dumps({'cpus': sorted(__import__('os').sched_getaffinity(0)), "
         "**host_probe_us()}))")


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' as [0, 1, 2, 3, 8, 10, 11]."""
    out = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def numa_nodes() -> dict[str, list[int]]:
    base = "/sys/devices/system/node"
    nodes = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.startswith("node") and name[4:].isdigit():
            cpus = read(f"{base}/{name}/cpulist")
            if cpus:
                nodes[name] = cpulist(cpus)
    return nodes


def gpu_local_cpus() -> list[dict]:
    """Per GPU: its PCI bus id, NUMA node and local CPU list, from nvidia-smi and sysfs."""
    if not shutil.which("nvidia-smi"):
        return []
    ids = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.split()
    out = []
    for bus in ids:
        # nvidia-smi: 00000000:19:00.0; sysfs: 0000:19:00.0
        dev = f"/sys/bus/pci/devices/{bus[-12:].lower()}"
        cpus = read(f"{dev}/local_cpulist")
        out.append({"bus_id": bus, "numa_node": read(f"{dev}/numa_node"),
                    "local_cpus": cpulist(cpus) if cpus else None})
    return out


def probe(cpus: list[int] | None) -> dict:
    cmd = [sys.executable, "-c", PROBE]
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cpus))] + cmd
    got = subprocess.run(cmd, capture_output=True, text=True, cwd=os.getcwd())
    if got.returncode:
        return {"error": got.stderr[-300:]}
    return json.loads(got.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-single", type=int, default=8,
                    help="single CPUs probed alone, spread over the allowed ones")
    args = ap.parse_args(argv)
    nodes, gpus = numa_nodes(), gpu_local_cpus()
    sets = {"unpinned": None, **{f"numa {n}": c for n, c in nodes.items()}}
    for i, g in enumerate(gpus):
        if g["local_cpus"]:
            sets[f"gpu {i} local"] = g["local_cpus"]
    allowed = sorted(os.sched_getaffinity(0))
    sets.update({f"cpu {c}": [c] for c in allowed[:: max(1, len(allowed) // args.max_single)]})
    rows = {}
    for _ in range(args.runs):  # interleaved, so drift spreads over every set
        for name, cpus in sets.items():
            rows.setdefault(name, []).append(probe(cpus))
            print(name, rows[name][-1], flush=True)
    res = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                 time.gmtime()),
           "machine": platform.node(), "cpus": os.cpu_count(), "numa_nodes": nodes,
           "gpus": gpus, "probes": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
