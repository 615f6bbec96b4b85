"""47: with the norm's row sums in fixed 128-key chunks (`prologue_linear(norm_k=128)`), may
qkv and gate_up take any BLOCK_K (and more warps) without a row's bits moving? Per norm
projection (SmolLM2's qkv and gate_up, Qwen2.5-1.5B's qkv), against the 16-row tiles with
norm_k=128 at 2048 rows: each candidate's outputs at 1, 8 (16-row candidates only), 256 and
2048 rows equal to those rows' (every row), and us a launch in a CUDA graph of 30 launches over
30 weights; today's tiles (norm_k 0) and cuBLAS + the separate kernels for comparison. Writes
JSON to argv[1] after each shape (cells past the time guard are marked skipped)."""

import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from engine import ops
from engine.ops import invariant
from engine.ops.elementwise import add_rmsnorm, silu_mul

dev, dt, L, NK = "cuda", torch.bfloat16, 30, 128
ROWS = (1, 8, 256, 2048)
SHAPES = {"qkv": (960, 576, False), "gate_up": (1536, 576, True),
          "qwen_qkv": (2048, 1536, False)}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps): one-row candidates, then prefill ones.
CANDIDATES = [(16, 32, 1024, 4), (16, 32, 1024, 8), (16, 32, 128, 8), (16, 32, 256, 4),
              (16, 16, 512, 8), (32, 128, 1024, 8), (64, 64, 64, 4), (64, 64, 64, 8),
              (128, 64, 64, 8), (64, 128, 64, 8), (128, 64, 128, 8), (32, 128, 128, 8)]
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*s):
    return (torch.randn(*s, generator=g, device=dev) / 8).to(dt)


def run(glu, w, nw, x, r, tiles, norm_k=NK):
    out = ops.prologue_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu,
                              tiles=tiles, norm_k=norm_k)
    return out[0]


def cublas(glu, w, nw, x, r):
    h, _ = add_rmsnorm(x, nw, 1e-5, r)
    y = F.linear(h, w)
    return silu_mul(y) if glu else y


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


def timed(glu, ws, nw, x, r, tiles=None, norm_k=NK):
    """us a launch of these tiles (None: cuBLAS and the separate kernels)."""
    if tiles is None:
        return time_graph(lambda i: cublas(glu, ws[i], nw, x, r))
    return time_graph(lambda i: run(glu, ws[i], nw, x, r, tiles, norm_k))


out = {"command": "python3 bench/experiments/det_norm_chunks.py " + " ".join(sys.argv[1:]),
       "date": time.ctime(), "gpu": torch.cuda.get_device_name(),
       "tree": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip(), "norm_k": NK, "shapes": {}}
t0 = time.time()
for name, (n, k, glu) in SHAPES.items():
    ws = [rnd(2 * n if glu else n, k) for _ in range(L)]
    nw, x, r = rnd(k), rnd(2048, k), rnd(2048, k)
    bk = invariant.layer_tiles(n, k, glu)[1]
    ref_tiles = (16, 32, min(bk, 1 << (k - 1).bit_length()), 4)
    ref = run(glu, ws[0], nw, x, r, ref_tiles)
    row = out["shapes"][name] = {"ref_tiles": ref_tiles, "cells": {}}
    alone = all(torch.equal(run(glu, ws[0], nw, x[i:i + 1], r[i:i + 1], ref_tiles)[0], ref[i])
                for i in (0, 7, 255, 2047))
    row["ref_rows_alone_equal"] = alone
    for m in ROWS:
        xm, rm_ = x[:m], r[:m]
        today = invariant.invariant_tiles(n, k, m, glu, True)
        row["cells"][f"today@{m}"] = {"tiles": today,
                                      "us": timed(glu, ws, nw, xm, rm_, today, 0)}
        row["cells"][f"cublas@{m}"] = {"us": timed(glu, ws, nw, xm, rm_)}
        for tiles in [ref_tiles] + [t for t in CANDIDATES if t != ref_tiles]:
            if m <= 8 and tiles[0] > 16:
                continue
            rec = row["cells"][f"{tiles}@{m}"] = {}
            if time.time() - t0 > 420:
                rec["skipped"] = "time guard"
                continue
            try:
                rec["bits_equal"] = torch.equal(run(glu, ws[0], nw, xm, rm_, tiles), ref[:m])
                rec["us"] = timed(glu, ws, nw, xm, rm_, tiles)
            except Exception as e:  # noqa: BLE001 - too large a tile: out of resources
                rec["error"] = repr(e)[:160]
        cells = {t: c for t, c in row["cells"].items() if t.endswith(f"@{m}") and "us" in c}
        print(name, m, {t.split("@")[0]: (c["us"], c.get("bits_equal")) for t, c in
                        cells.items()}, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
