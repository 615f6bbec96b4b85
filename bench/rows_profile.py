"""Experiment (not kept): why each extra verify row costs ~30 us at one stream on the GPU.

After a real generate, replays the target's graphs at one sequence and query widths 1..7
(verify) and the plain decode graph under torch.profiler, and sums each kernel's device time
per replay; also the fused EAGLE-3 step at the top draft level. JSON to $OUT/rows_profile.json.
Usage: python3 rows_profile.py MODEL"""

import json
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import held_out_messages
from engine import Engine, SamplingParams
from engine.config import SpecConfig
from engine.graphs import replay_us

ITERS = 20


def kernels(graph) -> dict:
    """Device microseconds per replay of `graph`, by kernel name (the 12 largest, rest summed)."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(float)
    count = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time / ITERS
            count[e.name] += 1
    top = sorted(per.items(), key=lambda kv: -kv[1])
    out = {k[:90]: {"us": round(v, 2), "launches": count[k] // ITERS} for k, v in top[:14]}
    out["_rest_us"] = round(sum(v for _, v in top[14:]), 2)
    out["_sum_us"] = round(sum(per.values()), 2)
    out["_kernels"] = sum(count.values()) // ITERS
    return out


def main():
    model = sys.argv[1]
    spec = Engine.from_pretrained(model, device="cuda", dtype=torch.bfloat16, spec=SpecConfig(),
                                  num_blocks=8192)
    plain = spec.with_config(spec=None)
    for e in (spec, plain):
        e.prepare_to_serve()
    prompt = spec.encode_prompt(held_out_messages(1)[0])
    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for e in (spec, plain):
        e.generate([prompt], p)
    torch.cuda.synchronize()
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "prompt_tokens": len(prompt), "iters": ITERS}
    g = plain.runner.graphs.graphs.get((1, 1, False))
    res["plain_q1"] = {"replay_us": round(replay_us(g[0], 100), 2), "kernels": kernels(g[0])}
    for (b, q, long), (graph, _) in sorted(spec.runner.graphs.graphs.items()):
        if b == 1 and not long and graph is not None:
            res[f"verify_q{q}"] = {"replay_us": round(replay_us(graph, 100), 2),
                                   "kernels": kernels(graph)}
    fused = spec.spec.fused
    if fused is not None:
        top = list(zip(fused.draft_levels, fused.all_sets()))[-1]
        for (b, q, long), (graph, _) in sorted(top[1].graphs.items()):
            if b == 1 and not long and graph is not None and q in (1, 6):
                res[f"fused_d{top[0]}_q{q}"] = {"replay_us": round(replay_us(graph, 100), 2),
                                                "kernels": kernels(graph)}
    for name, row in res.items():
        if isinstance(row, dict):
            print(name, row["replay_us"], row["kernels"]["_sum_us"], row["kernels"]["_kernels"])
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "rows_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
