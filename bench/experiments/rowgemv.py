# 49: can 2-8 verify rows cost less than one GEMV program per row? SmolLM2's four layer
# projections (random bf16 weights, 30 layers' worth so weights come from HBM), per row count:
# us a layer for today's tiles (linear_tiles) and for R-row CUDA-core programs (each program's
# weight tile read once for R rows), plus whether each row's bits equal the row alone.
# usage: python3 bench/experiments/rowgemv.py OUT
import json, os, sys, time, itertools
sys.path.insert(0, os.getcwd())
import torch
from engine.ops.prologue import prologue_linear, linear_tiles, next_pow2
from engine.graphs import graph_time_us
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
dev, dt = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
if dev == "cpu":  # smoke: the interpreter, one timing call
    def graph_time_us(fn, reps):
        t0 = time.perf_counter(); fn(0); return (time.perf_counter() - t0) * 1e6
    L = 2
L = 30 if dev == 'cuda' else 2
g = torch.Generator(device=dev).manual_seed(0)
H, I, Q = 576, 1536, 960
KINDS = {"head": (49152 if dev == "cuda" else 512, H, "plain"), "qkv": (Q, H, "norm"), "o": (H, H, "plain"), "gate_up": (2 * I, H, "norm"), "down": (H, I, "silu")}
W = {k: [torch.randn(n, kk, device=dev, dtype=dt, generator=g) * 0.05 for _ in range(L)] for k, (n, kk, _) in KINDS.items()}
NW = [torch.randn(H, device=dev, dtype=dt, generator=g) for _ in range(L)]
ROWS = [1, 2, 4, 6, 8]
res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": time.ctime(), "rows": ROWS, "kinds": {}, "layer_us": {}}


def call(kind, x, w, nw, r, tiles):
    pro = KINDS[kind][2]
    if pro == "norm":
        return prologue_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, tiles=tiles)[0]
    if pro == "silu":
        return prologue_linear(x, w, silu=True, tiles=tiles)
    return prologue_linear(x, w, tiles=tiles)


def inputs(kind, m):
    n, k, pro = KINDS[kind]
    x = torch.randn(m, 2 * k if pro == "silu" else k, device=dev, dtype=dt, generator=g)
    r = torch.randn(m, k, device=dev, dtype=dt, generator=g)
    return x, r


def cands(kind, m):
    n, k, _ = KINDS[kind]
    base = linear_tiles(m, n, k, (64, 128, 4) if kind == "head" else None)
    out = {"gemv": base}
    b1 = linear_tiles(1, n, k)
    for R in (2, 4, 8):
        if R > 2 * m or (R > m and R != next_pow2(m)):
            continue
        for bn, warps, bk in itertools.product(sorted({b1[1], 2 * b1[1], max(4, b1[1] // 2)}), (1, 2, 4), sorted({b1[2], 256})):
            if R * bn * bk > 2048 * 32 * warps:  # products past 2048 a thread: spills
                continue
            out[f"r{R}_bn{bn}_w{warps}_bk{bk}"] = (R, bn, bk, warps)
    return out


best_layer = {m: {"gemv": 0.0, "best": 0.0} for m in ROWS}
for kind in KINDS:
    res["kinds"][kind] = {}
    for m in ROWS:
        x, r = inputs(kind, m)
        t1 = cands(kind, 1)["gemv"]
        alone = torch.cat([call(kind, x[i:i + 1], W[kind][0], NW[0], r[i:i + 1], t1) for i in range(m)])
        row = {}
        for name, t in cands(kind, m).items():
            try:
                y = call(kind, x, W[kind][0], NW[0], r, t)
                same = int((y == alone).all(dim=1).sum())
                us = graph_time_us(lambda i: call(kind, x, W[kind][i % L], NW[i % L], r, t), L)
                row[name] = {"us": round(us, 2), "rows_identical": same, "tiles": t}
            except Exception as e:  # a tile that does not compile: recorded
                row[name] = {"error": repr(e)[:200], "tiles": t}
        ok = {k: v for k, v in row.items() if "us" in v}
        b = min(ok, key=lambda k: ok[k]["us"])
        res["kinds"][kind][m] = {"gemv_us": row["gemv"]["us"], "best": b, "best_us": ok[b]["us"],
                                 "best_identical": ok[b]["rows_identical"],
                                 "best_identical_variant": min((k for k in ok if ok[k]["rows_identical"] == m), key=lambda k: ok[k]["us"], default=None),
                                 "all": row}
        if kind != "head":
            best_layer[m]["gemv"] += row["gemv"]["us"]; best_layer[m]["best"] += ok[b]["us"]
        print(kind, m, "gemv", row["gemv"]["us"], "best", b, ok[b]["us"], "ident", ok[b]["rows_identical"], flush=True)
        json.dump(res, open(os.path.join(out, "rowgemv.json"), "w"), indent=1)
res["layer_us"] = {m: {k: round(v, 2) for k, v in d.items()} for m, d in best_layer.items()}
print("layer us (4 projections)", res["layer_us"], flush=True)
json.dump(res, open(os.path.join(out, "rowgemv.json"), "w"), indent=1)
