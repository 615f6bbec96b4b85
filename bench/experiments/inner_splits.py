"""Per-launch us of the deterministic projections on SmolLM2's layer shapes: today's invariant
tiles, cross-program split-K, and one program walking all K ranges (`inner`), at 1/8/64/512
rows; CUDA graph of 30 launches over 30 distinct weights (more than L2). Bits: inner equals
the split programs, and a row alone equals it among 64. Writes JSON to argv[1]."""

import json
import subprocess
import sys
import time

import torch

from engine import ops
from engine.ops import invariant

dev = "cuda"
dt = torch.bfloat16
L = 30
ROWS = (1, 8, 64, 512)
# name: (N, K, kwargs maker, glu)
SHAPES = {
    "qkv": (960, 576, "norm"),
    "o": (576, 576, "plain"),
    "gate_up": (1536, 576, "glu"),
    "down": (576, 1536, "plain"),
}
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*s):
    return (torch.randn(*s, generator=g, device=dev) / 8).to(dt)


def variants(n, k, kind):
    v = {"det": dict(tiles=invariant.invariant_tiles(n, k, None, kind == "glu"), splits=1)}
    for bn, bk, s in ((32, 128, 2), (32, 128, 4), (16, 128, 4), (32, 64, 4), (16, 64, 4)):
        v[f"inner_{bn}_{bk}_{s}"] = dict(tiles=(16, bn, bk, 4), splits=s, inner=True)
    v["split_32_128_4"] = dict(tiles=(16, 32, 128, 4), splits=4)
    return v


def launcher(kind, n, k, m, cfg):
    ws = [rnd(2 * n if kind == "glu" else n, k) for _ in range(L)]
    nw = rnd(k)
    x, r = rnd(m, k), rnd(m, k)

    def one(i, cfg=cfg, x=x):
        kw = dict(cfg)
        if kind == "norm":
            return ops.prologue_linear(x, ws[i], norm_weight=nw, eps=1e-5, residual=r, **kw)
        if kind == "glu":
            return ops.prologue_linear(x, ws[i], norm_weight=nw, eps=1e-5, residual=r,
                                       glu=True, **kw)
        return ops.prologue_linear(x, ws[i], **kw)
    return one, x


def parts(o):
    return o if isinstance(o, tuple) else (o,)


def time_graph(fn):
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
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) * 1000 / 20 / L)
    return round(min(best), 2)


out = {"command": "python3 bench/experiments/inner_splits.py $OUT/inner.json", "date": time.ctime(),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?",
       "gpu": torch.cuda.get_device_name(), "shapes": {}}
t0 = time.time()
for name, (n, k, kind) in SHAPES.items():
    row = out["shapes"][name] = {}
    for vname, cfg in variants(n, k, kind).items():
        if time.time() - t0 > 230:
            break
        rec = row[vname] = {"us": {}}
        try:
            for m in ROWS:
                fn, _ = launcher(kind, n, k, m, cfg)
                rec["us"][m] = time_graph(fn)
            if cfg.get("inner"):  # bits: inner == split programs; a row alone == among 64
                fn, x = launcher(kind, n, k, 64, cfg)
                split = dict(cfg, inner=False)
                a = parts(fn(0))
                b = parts(fn(0, cfg=split))
                rec["eq_split"] = all(torch.equal(p, q) for p, q in zip(a, b))
                alone = parts(fn(0, x=x[5:6].clone())) if kind != "norm" and kind != "glu" else None
                if alone is not None:
                    rec["row_alone_eq"] = torch.equal(a[0][5], alone[0][0])
        except Exception as e:  # noqa: BLE001
            rec["error"] = repr(e)[:300]
    print(name, {v: r.get("us") for v, r in list(row.items())[:3]}, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
# per variant, the layer (four projections) at each row count; variants every shape ran
common = set.intersection(*[{v for v, r in row.items() if "error" not in r
                             and r.get("eq_split", True) and len(r["us"]) == len(ROWS)}
                            for row in out["shapes"].values()])
layer = {v: {m: round(sum(row[v]["us"][m] for row in out["shapes"].values()), 2) for m in ROWS}
         for v in common}
out["layer_us"] = layer
out["bits_ok"] = all(r.get("eq_split", True) for row in out["shapes"].values()
                     for r in row.values())
json.dump(out, open(sys.argv[1], "w"), indent=1)
for v in sorted(layer, key=lambda v: layer[v][1]):
    print(v, layer[v])
print("bits_ok", out["bits_ok"], "errors", [(n, v) for n, row in out["shapes"].items()
                                            for v, r in row.items() if "error" in r][:5])
