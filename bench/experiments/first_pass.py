# 49: where EAGLE-3's first pass (after its preparation) spends the ~70 ms no-spec does not.
no_spec python3 .gj/firstpass.py|no_spec python3 .gj/firstpass.py OUT.txt   (fresh process, cold Triton cache)
import argparse, cProfile, io, os, pstats, sys, tempfile, time
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp-triton-")
sys.path.insert(0, os.getcwd())
import bench.suite as S
import bench.common as C
from engine.testing import smol_shape
p = argparse.ArgumentParser(); S.add_arguments(p)
args = p.parse_args([]); args.device, args.dtype = "cuda", "bfloat16"
import torch
from engine import SamplingParams, warmup
from engine.config import SpecConfig
from engine import jit_watch
jit_watch.install()
mode, C1 = os.environ.get("MODE", "eagle3"), int(os.environ.get("CONC", 1))
base = C.random_engine(args, smol_shape(), num_blocks=16)
eng = C.variant(base, None, False, spec=SpecConfig() if mode == "eagle3" else None, num_blocks=2048)
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(100, 49000, (120 + 7 * i,), generator=g).tolist() for i in range(C1)]
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
pr = cProfile.Profile()
orig = warmup.prepare_on_first_use
marks = {}
def wrapped(e, b):
    t = time.perf_counter(); orig(e, b); torch.cuda.synchronize()
    marks["prep"] = time.perf_counter() - t; marks["served_from"] = time.perf_counter(); pr.enable()
warmup.prepare_on_first_use = wrapped
orig_pg, pg = warmup.pending_graphs, []
def timed_pg(*a, **k):
    pp = cProfile.Profile(); t = time.perf_counter(); pp.enable(); r = orig_pg(*a, **k); pp.disable(); pg.append((round(time.perf_counter() - t, 4), len(r)))
    o = io.StringIO(); pstats.Stats(pp, stream=o).sort_stats("cumulative").print_stats(30); pgs.append(o.getvalue()); return r
pgs = []
warmup.pending_graphs = timed_pg
import engine.engine as EE
EE.warmup.prepare_on_first_use = wrapped
t0 = time.perf_counter(); eng.generate(prompts, sp); torch.cuda.synchronize(); pr.disable()
t1 = time.perf_counter()
out = io.StringIO()
print(mode, "conc", C1, "first", round(t1 - t0, 4), "prep", round(marks.get("prep", -1), 4),
      "served", round(t1 - marks.get("served_from", t0), 4), "ready", eng.ready, "pending_graphs", pg, file=out)
t2 = time.perf_counter(); eng.generate(prompts, sp); torch.cuda.synchronize()
print("second", round(time.perf_counter() - t2, 4), "warming", eng.warming is not None, file=out)
st = pstats.Stats(pr, stream=out); st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(30)
open(sys.argv[1], "w").write(out.getvalue() + "\n".join(pgs))
print(out.getvalue()[:600])
