"""What a CUDA graph replay costs the host: for the one-stream decode graph (no speculation)
and the fused speculative step's graphs (one per number of next drafts), the graph's nodes by
type (driver API) and the host microseconds of `CUDAGraph.replay()` with the device idle and
with replays queued back to back, against the device microseconds of one replay.

    python -m bench.graph_launch --model GGUF --out DIR [--k 5] [--reps 50]

Writes DIR/graph_launch.json. CUDA only."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections import Counter

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait",
              10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


def node_types(raw_graph: int) -> dict:
    """The graph's nodes counted by type, and its edges, through libcuda."""
    cu = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    assert cu.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert cu.cuGraphGetNodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(n)) == 0
    kinds = Counter()
    for node in nodes:
        t = ctypes.c_int(0)
        assert cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) == 0
        kinds[NODE_TYPES.get(t.value, str(t.value))] += 1
    e = ctypes.c_size_t(0)
    if cu.cuGraphGetEdges(ctypes.c_void_p(raw_graph), None, None, ctypes.byref(e)) != 0:
        # (CUDA 12.3+ has the _v2 form with edge data; the old name may be gone.)
        cu.cuGraphGetEdges_v2(ctypes.c_void_p(raw_graph), None, None, None, ctypes.byref(e))
    return {"nodes": n.value, "edges": e.value, "by_type": dict(kinds)}


def replay_costs(g, reps: int) -> dict:
    import torch

    idle, queued = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        idle.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    for _ in range(reps):
        t = time.perf_counter()
        g.replay()
        queued.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    from engine.graphs import replay_us

    return {"host_us_idle": round(statistics.median(idle) * 1e6, 1),
            "host_us_queued": round(statistics.median(queued) * 1e6, 1),
            "device_us": round(replay_us(g, 20), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    import torch

    keep = torch.cuda.CUDAGraph

    class Kept(keep):  # keep the cudaGraph_t to count its nodes
        def __new__(cls, keep_graph=False):
            return super().__new__(cls, True)

        def __init__(self, keep_graph=False):
            super().__init__(True)

        def capture_end(self):
            super().capture_end()
            self.instantiate()

    torch.cuda.CUDAGraph = Kept
    from engine import Engine
    from engine.config import SpecConfig

    res = {"command": "python -m bench.graph_launch " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "graphs": []}
    for name, spec in (("no_spec", None),
                       ("eagle3", SpecConfig(method="eagle3", num_tokens=args.k,
                                             dynamic=False))):
        eng = Engine.from_pretrained(args.model, device="cuda", dtype=torch.bfloat16,
                                     num_blocks=512, enable_prefix_caching=False, spec=spec)
        eng.capture_graphs([1], long_context=False)
        sets = [("decode", eng.runner.graphs)]
        if eng.spec is not None and eng.spec.fused is not None:
            sets += [(f"fused_d{d}", s) for d, s in eng.spec.fused.sets.items()]
        for tag, gs in sets:
            for key, (g, _) in sorted(gs.graphs.items()):
                if g is None or key[0] != 1:
                    continue
                row = {"engine": name, "set": tag, "bucket": key[0], "query": key[1],
                       "long": key[2], **node_types(g.raw_cuda_graph()),
                       **replay_costs(g, args.reps)}
                print(json.dumps(row), flush=True)
                res["graphs"].append(row)
        del eng
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "graph_launch.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
