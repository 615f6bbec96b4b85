# 47: are the deterministic projections slow at 64 rows only when each layer's weights are
# distinct (L2-cold), as in the engine? Per shape and rows: us a launch over 30 launches of
# one weight vs 30 distinct weights, deterministic (invariant_linear) vs cuBLAS (torch.mm).
import json, sys, torch
from engine import ops
out = sys.argv[1]
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
SHAPES = {"qkv": (960, 576, False, True), "o": (576, 576, False, False),
          "gate_up": (3072, 576, True, True), "down": (576, 1536, False, False)}
res = {"gpu": torch.cuda.get_device_name(), "shapes": {}}


def timeit(fn, reps=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / reps / 30  # us a launch


for name, (n, k, glu, norm) in SHAPES.items():
    ws = [(torch.randn(n, k, device=dev) * k ** -0.5).to(bf) for _ in range(30)]
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(bf)
    res["shapes"][name] = {}
    for m in (1, 16, 64, 128):
        x, r = torch.randn(m, k, device=dev).to(bf), torch.randn(m, k, device=dev).to(bf)

        def det(weights):
            def f():
                for w in weights:
                    if norm:
                        ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu)
                    else:
                        ops.invariant_linear(x, w, glu=glu)
            return f

        def mm(weights):
            def f():
                for w in weights:
                    torch.mm(x, w.t())
            return f
        row = {"det_same": timeit(det([ws[0]] * 30)), "det_distinct": timeit(det(ws)),
               "cublas_same": timeit(mm([ws[0]] * 30)), "cublas_distinct": timeit(mm(ws))}
        from engine.ops import invariant
        for bm, bn in ((32, 32), (64, 32), (32, 64)):
            if bm <= m:
                invariant.ROW_TILES = ((1000000000, bm, bn),)
                try:
                    row[f"det_distinct_rt{bm}x{bn}"] = timeit(det(ws))
                except Exception as e:
                    row[f"det_distinct_rt{bm}x{bn}"] = -1
                    print("rt", bm, bn, type(e).__name__, str(e)[:120])
                invariant.ROW_TILES = None
        res["shapes"][name][m] = {a: round(b, 2) for a, b in row.items()}
        print(name, m, res["shapes"][name][m], flush=True)
json.dump(res, open(out, "w"), indent=1)
