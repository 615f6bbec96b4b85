# 49: verify forwards at one stream with R-row GEMV programs (prologue.GEMV_ROW_BLOCK), random
# SmolLM2-shaped bf16 weights, the shipped EAGLE-3 head at fixed K=7: graph replay us of the
# target at 1..8 query rows and of the fused step; tokens/s and per-step ms of a 256-token
# generate; no-spec alike. usage: python3 bench/experiments/verifyrows.py OUT [env BLOCKS="1 2 4 8"]
import argparse, json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import bench.suite as S
import bench.common as C
from engine import SamplingParams
from engine.config import SpecConfig
from engine.graphs import replay_us
from engine.ops import prologue
from engine.testing import smol_shape
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
p = argparse.ArgumentParser(); S.add_arguments(p); args = p.parse_args([])
args.device, args.dtype = os.environ.get("DEV", "cuda"), os.environ.get("DT", "bfloat16")
base = C.random_engine(args, smol_shape(), num_blocks=64)
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(100, 49000, (n,), generator=g).tolist() for n in (60, 200, 90, 400)]
sp = SamplingParams(temperature=0, max_tokens=int(os.environ.get("TOKENS", 256)), ignore_eos=True)
res = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.ctime(), "blocks": {}}
for R in map(int, os.environ.get("BLOCKS", "1 2 4 8").split()):
    prologue.GEMV_ROW_BLOCK = R
    r = {}
    for name, spec in (("nospec", None), ("eagle3_k7", SpecConfig(num_tokens=7, dynamic=False, context_drafts=False))):
        eng = C.variant(base, None, False, spec=spec, num_blocks=256)
        r[name + "_precapture"] = C.precapture(eng, (1,))
        outs = [eng.generate([q], sp)[0].token_ids for q in prompts]
        C.sync(args); t0 = time.perf_counter()
        for q in prompts:
            eng.generate([q], sp)
        C.sync(args); dt = time.perf_counter() - t0
        r[name + "_tok_s"] = round(len(prompts) * sp.max_tokens / dt, 1)
        r[name + "_tokens_hash"] = hash(tuple(map(tuple, outs))) % 10**8
        r[name + "_calibration"] = eng.model.prologue_calibration
        r[name + "_rows"] = sorted(eng.model.prologue_rows)
        gr = eng.runner.graphs.graphs if eng.runner.graphs else {}
        r[name + "_replay_us"] = {f"q{q}": round(replay_us(gph, 50), 2) for (b, q, lng), (gph, _) in sorted(gr.items()) if b == 1 and not lng and gph is not None}
        fused = eng.spec.fused if spec is not None and eng.spec is not None else None
        if fused is not None:
            lvl, sets = list(zip(fused.draft_levels, fused.all_sets()))[-1]
            r[name + f"_fused_d{lvl}_us"] = {f"q{q}": round(replay_us(gph, 50), 2) for (b, q, lng), (gph, _) in sorted(sets.graphs.items()) if b == 1 and not lng and gph is not None}
        if spec is not None:
            st = eng.stats
            r[name + "_stats"] = {k: getattr(st, k) for k in dir(st) if not k.startswith("_") and isinstance(getattr(st, k), (int, float))}
        eng = None; C.free_memory()
    res["blocks"][R] = r
    print(R, {k: v for k, v in r.items() if "calibration" not in k and "stats" not in k}, flush=True)
    json.dump(res, open(os.path.join(out, "verifyrows.json"), "w"), indent=1)
