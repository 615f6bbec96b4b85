# 49: where a fused EAGLE-3 step's draft time goes at one stream. Random SmolLM2-shaped bf16
# target, the shipped head. Per spec config: replay us and per-kernel device us of the target's
# verify graph (q rows) and of the fused step's graphs (draft level d, q rows).
# usage: python3 bench/experiments/draftprof.py OUT
import argparse, json, os, sys, time
from collections import defaultdict
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import ProfilerActivity, profile
import bench.suite as S
import bench.common as C
from engine import SamplingParams
from engine.config import SpecConfig
from engine.graphs import replay_us
from engine.testing import smol_shape
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
p = argparse.ArgumentParser(); S.add_arguments(p); args = p.parse_args([])
args.device, args.dtype = "cuda", "bfloat16"
ITERS = 20


def kernels(graph):
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            graph.replay()
        torch.cuda.synchronize()
    per, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time / ITERS
            count[e.name] += 1
    top = sorted(per.items(), key=lambda kv: -kv[1])
    return {"sum_us": round(sum(per.values()), 2), "kernels": sum(count.values()) // ITERS,
            "top": [(k[:80], round(v, 2), count[k] // ITERS) for k, v in top[:16]]}


base = C.random_engine(args, smol_shape(), num_blocks=64)
g = torch.Generator().manual_seed(3)
prompt = torch.randint(100, 49000, (120,), generator=g).tolist()
res = {"gpu": torch.cuda.get_device_name(), "date": time.ctime(), "configs": {}}
for name, spec in (("default", SpecConfig()), ("k7", SpecConfig(num_tokens=7, dynamic=False, context_drafts=False))):
    eng = C.variant(base, None, False, spec=spec, num_blocks=256)
    C.precapture(eng, (1,))
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    torch.cuda.synchronize()
    r = {"head": type(eng.spec.drafter).__name__ if hasattr(eng.spec, "drafter") else None}
    h = getattr(eng.spec, "head", None) or getattr(getattr(eng.spec, "drafter", None), "head", None)
    if h is not None:
        r["head_lm"] = list(getattr(getattr(h, "lm_head", None), "weight", torch.empty(0)).shape)
        r["head_fused"] = bool(getattr(getattr(h, "midlayer", None), "fused", False))
    gr = eng.runner.graphs.graphs
    for (b, q, lng), (gph, _) in sorted(gr.items()):
        if b == 1 and not lng and gph is not None and q in (1, 6, 8):
            r[f"verify_q{q}"] = {"replay_us": round(replay_us(gph, 50), 2), **kernels(gph)}
    fused = eng.spec.fused
    for d, gs in zip(fused.draft_levels, fused.all_sets()):
        for (b, q, lng), (gph, _) in sorted(gs.graphs.items()):
            if b == 1 and not lng and gph is not None and q in (1, 6, 8):
                r[f"fused_d{d}_q{q}"] = {"replay_us": round(replay_us(gph, 50), 2), **kernels(gph)}
    res["configs"][name] = r
    print(name, {k: (v["replay_us"], v["sum_us"], v["kernels"]) if isinstance(v, dict) else v for k, v in r.items()}, flush=True)
    json.dump(res, open(os.path.join(out, "draftprof.json"), "w"), indent=1)
    eng = None; C.free_memory()
for name, r in res["configs"].items():
    for k in ("fused_d0_q1", "fused_d1_q1", "fused_d2_q1", "fused_d4_q1", "fused_d5_q1", "fused_d7_q1", "fused_d7_q8"):
        if k in r:
            print(name, k, r[k]["replay_us"], r[k]["top"][:10], flush=True)
