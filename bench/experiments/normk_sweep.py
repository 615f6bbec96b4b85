"""47: with NORM_K=128 (the norm's row sums in 128-key chunks whatever the tile), which tiles
from PREFILL_ROWS rows keep a row's bits and run fastest for qkv and gate_up (norm prologue;
gate_up with its GLU epilogue)? Reference: the 16-row tiles at the same norm_k. Per rows in
ROWS: us a launch (CUDA graph of 30 launches over 30 weights), cuBLAS + separate norm / SiLU,
today's prefill tiles (no norm_k). Writes JSON to argv[1]. CPU (DEV=cpu, Triton's interpreter):
bits only, few rows and variants."""
import json, os, subprocess, sys, time
import torch
import torch.nn.functional as F
from engine import ops
from engine.ops import invariant
from engine.ops.elementwise import add_rmsnorm, silu_mul

dev = os.environ.get("DEV", "cuda")
cpu = dev == "cpu"
dt, L = (torch.float32 if cpu else torch.bfloat16), (2 if cpu else 30)
ROWS = (40,) if cpu else tuple(int(v) for v in os.environ.get("ROWS", "256,384,512,2048").split(","))
SHAPES = {"qkv": (960, 576, "norm"), "gate_up": (1536, 576, "glu")}
NK = 128
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*s):
    return (torch.randn(*s, generator=g, device=dev) / 8).to(dt)


def run(kind, w, nw, x, r, tiles, norm_k=NK):
    return ops.prologue_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=kind == "glu",
                               tiles=tiles, splits=1, norm_k=norm_k)


def cublas(kind, w, nw, x, r):
    h, _ = add_rmsnorm(x, nw, 1e-5, r)
    y = F.linear(h, w)
    return silu_mul(y) if kind == "glu" else y


def time_graph(fn):
    if cpu:
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(L):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(L):
            fn(i)
    graph.replay(); torch.cuda.synchronize()
    best = []
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            graph.replay()
        e1.record(); torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) * 1000 / 5 / L)
    return round(min(best), 2)


def parts(o):
    return o if isinstance(o, tuple) else (o,)


VARIANTS = [(bm, bn, bk, w) for bm in (64, 128) for bn in (64, 128) for bk in (64, 128)
            for w in (4, 8)] + [(32, 128, 64, 8), (32, 64, 64, 4), (32, 128, 128, 8)]
if cpu:
    VARIANTS = [(64, 64, 64, 8), (32, 128, 64, 4)]
out = {"command": "python3 bench/experiments/normk_sweep.py " + " ".join(sys.argv[1:]), "date": time.ctime(),
       "gpu": "cpu" if cpu else torch.cuda.get_device_name(),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip(), "norm_k": NK, "shapes": {}}
t0, limit = time.time(), float(os.environ.get("LIMIT", 250))
for name, (n, k, kind) in SHAPES.items():
    row = out["shapes"][name] = {}
    small = invariant.invariant_tiles(n, k, 1, kind == "glu", True, prefill=False)
    today = invariant.invariant_tiles(n, k, 4096, kind == "glu", True)
    for m in ROWS:
        ws = [rnd(2 * n if kind == "glu" else n, k) for _ in range(L)]
        nw, x, r = rnd(k), rnd(m, k), rnd(m, k)
        ref = parts(run(kind, ws[0], nw, x, r, small))
        alone = parts(run(kind, ws[0], nw, x[:1], r[:1], small))
        cell = row[m] = {"small": {"tiles": small, "us": time_graph(lambda i: run(kind, ws[i], nw, x, r, small)),
                                   "row0_alone_equal": all(torch.equal(a[:1], b) for a, b in zip(ref, alone))},
                         "today_no_norm_k": {"tiles": today, "us": time_graph(lambda i: run(kind, ws[i], nw, x, r, today, 0))},
                         "cublas": {"us": time_graph(lambda i: cublas(kind, ws[i], nw, x, r))}}
        for tiles in VARIANTS:
            if time.time() - t0 > limit:
                cell["cut"] = True
                break
            rec = cell[str(tiles)] = {}
            try:
                got = parts(run(kind, ws[0], nw, x, r, tiles))
                rec["bits_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
                rec["us"] = time_graph(lambda i: run(kind, ws[i], nw, x, r, tiles))
            except Exception as e:  # noqa: BLE001 - out of shared memory or registers
                rec["error"] = repr(e)[:160]
        ok = {t: c for t, c in cell.items() if c.get("bits_equal") and c.get("us")}
        best = sorted(ok, key=lambda t: ok[t]["us"])[:3]
        print(name, m, "small", cell["small"]["us"], cell["small"]["row0_alone_equal"], "today", cell["today_no_norm_k"]["us"],
              "cublas", cell["cublas"]["us"], "best", [(t, ok[t]["us"]) for t in best],
              "differ", [t for t, c in cell.items() if c.get("bits_equal") is False][:8],
              "errors", sum("error" in c for c in cell.values() if isinstance(c, dict)), flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
json.dump(out, open(sys.argv[1], "w"), indent=1)
