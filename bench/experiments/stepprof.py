# 49: per-step device time of real steps (fresh inputs, not stale graph replays) at one stream.
# Random SmolLM2-shaped bf16 target, the shipped head. Per config: a 256-token generate under
# torch.profiler; wall ms, steps, device us per step by kernel.
# usage: python3 bench/experiments/stepprof.py OUT
import argparse, json, os, sys, time
from collections import defaultdict
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import ProfilerActivity, profile
import bench.suite as S
import bench.common as C
from engine import SamplingParams
from engine.config import SpecConfig
from engine.testing import smol_shape
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
p = argparse.ArgumentParser(); S.add_arguments(p); args = p.parse_args([])
args.device, args.dtype = "cuda", "bfloat16"
base = C.random_engine(args, smol_shape(), num_blocks=64)
g = torch.Generator().manual_seed(3)
prompt = torch.randint(100, 49000, (120,), generator=g).tolist()
N = 256
sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
res = {"gpu": torch.cuda.get_device_name(), "date": time.ctime(), "tokens": N, "configs": {}}
for name, spec in (("nospec", None), ("k5", SpecConfig(num_tokens=5, dynamic=False, context_drafts=False)),
                   ("k7", SpecConfig(num_tokens=7, dynamic=False, context_drafts=False)), ("k2", SpecConfig(num_tokens=2, dynamic=False, context_drafts=False))):
    eng = C.variant(base, None, False, spec=spec, num_blocks=256)
    C.precapture(eng, (1,))
    eng.generate([prompt], sp); eng.generate([prompt], sp)
    torch.cuda.synchronize()
    s0 = eng.stats.steps
    t0 = time.perf_counter(); eng.generate([prompt], sp); torch.cuda.synchronize(); wall = time.perf_counter() - t0
    steps = eng.stats.steps - s0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate([prompt], sp); torch.cuda.synchronize()
    per, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time; count[e.name] += 1
    top = sorted(per.items(), key=lambda kv: -kv[1])
    r = {"wall_ms": round(wall * 1e3, 2), "steps": steps, "wall_us_per_step": round(wall * 1e6 / max(steps, 1), 1),
         "tok_s": round(N / wall, 1), "device_us_per_step_sum": round(sum(per.values()) / max(steps, 1), 1),
         "per_step": [(k[:80], round(v / max(steps, 1), 2), round(count[k] / max(steps, 1), 2)) for k, v in top[:18]]}
    res["configs"][name] = r
    print(name, {k: v for k, v in r.items() if k != "per_step"}, flush=True)
    for row in r["per_step"][:8]:
        print("   ", row, flush=True)
    json.dump(res, open(os.path.join(out, "stepprof.json"), "w"), indent=1)
    eng = None; C.free_memory()
