"""47: can the deterministic projections take large tensor-core tiles in prefill-sized launches
without changing a row's bits? Per SmolLM2 layer projection (with its real prologue: norm of x +
residual for qkv and gate_up, GLU epilogue for gate_up), at 512 and 2048 rows: today's invariant
tiles, and larger ones (`VARIANTS`), warps 4 or 8. Bits: every output equal to today's tiles
(all rows). Time: us a launch in a CUDA graph of 30 launches over 30 weights, against cuBLAS
plus the separate norm / SiLU kernels (the default mode's prefill). Writes JSON to argv[1]."""

import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from engine import ops
from engine.ops import invariant
from engine.ops.elementwise import add_rmsnorm, silu_mul

dev, dt, L = "cuda", torch.bfloat16, 30
# argv[2] "rows": only invariant.prefill_tiles against today's, at fewer rows too (where
# PREFILL_ROWS should start).
# argv[2] "one": at 1 and 8 rows, 16-row tiles with other BLOCK_N / warps (and BLOCK_K where
# no norm prologue pins it).
ROWS_MODE = sys.argv[2:] == ["rows"]
ONE_MODE = sys.argv[2:] == ["one"]
ROWS = (16, 32, 64, 128, 256, 512, 2048) if ROWS_MODE else (1, 8) if ONE_MODE else (512, 2048)
SHAPES = {"qkv": (960, 576, "norm"), "o": (576, 576, "plain"),
          "gate_up": (1536, 576, "glu"), "down": (576, 1536, "plain")}
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*s):
    return (torch.randn(*s, generator=g, device=dev) / 8).to(dt)


def make(kind, n, k, m):
    ws = [rnd(2 * n if kind == "glu" else n, k) for _ in range(L)]
    return ws, rnd(k), rnd(m, k), rnd(m, k)


def det(kind, w, nw, x, r, tiles):
    kw = dict(tiles=tiles, splits=1)
    if kind == "plain":
        return ops.prologue_linear(x, w, **kw)
    return ops.prologue_linear(x, w, norm_weight=nw, eps=1e-5, residual=r,
                               glu=kind == "glu", **kw)


def cublas(kind, w, nw, x, r):
    if kind == "plain":
        return F.linear(x, w)
    h, _ = add_rmsnorm(x, nw, 1e-5, r)
    y = F.linear(h, w)
    return silu_mul(y) if kind == "glu" else y


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
    graph.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) * 1000 / 5 / L)
    return round(min(best), 2)


def parts(o):
    return o if isinstance(o, tuple) else (o,)


def timed(kind, ws, nw, x, r, tiles=None):
    """us a launch of today's / given tiles (tiles None: cuBLAS and the separate kernels)."""
    if tiles is None:
        return time_graph(lambda i: cublas(kind, ws[i], nw, x, r))
    return time_graph(lambda i: det(kind, ws[i], nw, x, r, tiles))


# (BLOCK_M, BLOCK_N, BLOCK_K) per shape, each at 4 and 8 warps: those that fit sm_90's shared
# memory (compiled offline). A norm prologue (qkv, gate_up) keeps the shape's BLOCK_K, where
# its row sums' layout along K is the same at every BLOCK_M; the others may take 64.
VARIANTS = {
    "qkv": [(16, 64, 1024), (16, 128, 1024), (32, 64, 1024), (32, 128, 1024), (64, 32, 1024)],
    "o": [(32, 128, 1024), (64, 32, 1024), (64, 64, 64), (64, 128, 64), (128, 64, 64),
          (128, 128, 64)],
    "gate_up": [(32, 64, 128), (32, 128, 128), (64, 64, 128), (64, 128, 128), (128, 64, 128),
                (128, 128, 128)],
    "down": [(32, 64, 512), (32, 128, 512), (64, 32, 512), (64, 64, 64), (64, 128, 64),
             (128, 64, 64), (128, 128, 64)],
}


def variants(name):
    n, k, kind = SHAPES[name]
    if ONE_MODE:
        bk = invariant.invariant_tiles(n, k, None, kind == "glu")[2]
        bks = (256, 512, 1024) if kind == "plain" else (bk,)
        bns = (16, 32) if kind != "norm" else (16, 32, 64)
        return [(16, bn, b, w) for bn in bns for b in bks for w in (1, 2, 4, 8)]
    if ROWS_MODE:
        bk = invariant.invariant_tiles(n, k, None, kind == "glu")[2]
        return [invariant.prefill_tiles(bk, kind == "glu", kind != "plain")]
    return [(bm, bn, bk, wp) for bm, bn, bk in VARIANTS[name] for wp in (4, 8)]


out = {"command": "python3 bench/experiments/det_prefill_tiles.py " + " ".join(sys.argv[1:]),
       "date": time.ctime(), "gpu": torch.cuda.get_device_name(),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip(), "shapes": {}}
t0 = time.time()
for name, (n, k, kind) in SHAPES.items():
    row = out["shapes"][name] = {}
    today = invariant.invariant_tiles(n, k, None, kind == "glu")
    for m in ROWS:
        ws, nw, x, r = make(kind, n, k, m)
        ref = parts(det(kind, ws[0], nw, x, r, today))
        cell = row[m] = {"today": {"tiles": today, "us": timed(kind, ws, nw, x, r, today)},
                         "cublas": {"us": timed(kind, ws, nw, x, r)}}
        for tiles in variants(name):
            if tiles == today or time.time() - t0 > 480:
                continue
            rec = cell[str(tiles)] = {}
            try:
                got = parts(det(kind, ws[0], nw, x, r, tiles))
                rec["bits_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
                rec["us"] = timed(kind, ws, nw, x, r, tiles)
            except Exception as e:  # noqa: BLE001 - too large a tile: out of resources
                rec["error"] = repr(e)[:200]
        ok = {t: c for t, c in cell.items() if c.get("bits_equal") and "us" in c}
        best = min(ok, key=lambda t: ok[t]["us"]) if ok else None
        print(name, m, "today", cell["today"]["us"], "cublas", cell["cublas"]["us"],
              "best", best, ok.get(best, {}).get("us"),
              "bits differ:", [t for t, c in cell.items() if c.get("bits_equal") is False][:6],
              flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
