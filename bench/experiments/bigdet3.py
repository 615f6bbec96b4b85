# bigdet3: dot_tiles (the shipped kernel) on Llama-8B's shapes: PDL on/off and GROUP_M 1/8 per
# tile, at 16-2048 rows; us a launch (CUDA graph over weight copies past L2); bits vs a 128-row ref.
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from engine.ops import gemv
from engine.attention import triton_backend as tb
dev = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (16, 32, 48, 64, 96, 128, 256, 384, 1024, 2048)
TILES = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 4),
         (64, 128, 64, 3, 8), (128, 128, 64, 4, 8)]
g = torch.Generator(device=dev).manual_seed(0)
rnd = lambda *s: (torch.randn(*s, generator=g, device=dev) / 16).to(torch.bfloat16)


def timed(fn, ws, reps=10):
    fn(ws[0]); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(w)
    graph.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record(); torch.cuda.synchronize()
    return round(a.elapsed_time(b) * 1e3 / (reps * len(ws)), 2)


res = {"gpu": torch.cuda.get_device_name(), "date": time.ctime(), "tiles": "(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps)",
       "keys": "tile|pdl|group", "shapes": {}}
out = sys.argv[1]
for name, (n, k) in SHAPES.items():
    ws = [rnd(n, k) for _ in range(max(2, -(-160 * 2**20 // (n * k * 2))))]
    x = rnd(max(ROWS), k)
    gemv.DOT_GROUP_M, tb.PDL = 1, None
    ref = gemv.dot_tiles(x, ws[0], None, (128, 128, 64, 4, 8))
    r = res["shapes"][name] = {}
    for m in ROWS:
        xm = x[:m].contiguous()
        c = r[str(m)] = {"cublas": timed(lambda w: torch.nn.functional.linear(xm, w), ws)}
        for t in TILES:
            if t[0] >= 2 * max(m, 16) and t[0] > 16:
                continue
            for pdl in (None, False):
                for grp in ((1, 8) if m > t[0] else (1,)):
                    gemv.DOT_GROUP_M, tb.PDL = grp, pdl
                    y = gemv.dot_tiles(xm, ws[0], None, t)
                    c[f"{t}|{pdl is None}|{grp}"] = (timed(lambda w: gemv.dot_tiles(xm, w, None, t), ws),
                                                     bool(torch.equal(y, ref[:m])))
        best = min((v[0], kk) for kk, v in c.items() if kk != "cublas")
        c["best"] = best
        print(name, m, "cublas", c["cublas"], "best", best, "all eq", all(v[1] for kk, v in c.items() if kk not in ("cublas", "best")), flush=True)
        json.dump(res, open(out, "w"), indent=1)
    del ws, x, ref
    torch.cuda.empty_cache()
gemv.DOT_GROUP_M, tb.PDL = 8, None
json.dump(res, open(out, "w"), indent=1)
