"""One-row projections of the Llama-3.1-8B shape on the GPU: cuBLAS (F.linear) against a
split-K Triton GEMV, and both against a copy of the same bytes, per projection.

    python -m bench.gemv_sweep --out DIR [--budget 150] [--shapes qkv,o,gate_up,down,lm_head]
    python -m bench.gemv_sweep --out DIR --rows 1,2,4,6,8   # ops.gemv_rows vs cuBLAS by rows
    python -m bench.gemv_sweep --out DIR --dot 1,6,16       # ops.dot_rows tiles vs cuBLAS

Figure 2's decode step at batch 1 reads each weight once; cuBLAS reads them at 2.7-4.1 TB/s
(`profile/llama8b_linears.json`), the copy at ~4.3. The GEMV here splits K over `SPLIT`
programs per column block so that a projection of few columns still has thousands of
programs reading, and sums the splits deterministically: each program writes its fp32
partial, and the last to finish (a counter per column block) adds them in split order, in the
same launch. Each program accumulates a [BLOCK_N, BLOCK_K] tile of products and reduces it
once at the end; its first weight tile loads before the programmatic-launch wait.

Writes DIR/gemv_sweep.json: per projection, microseconds per call (a CUDA graph of `reps`
calls, each on its own copy of the weight, so weights come from HBM), GB/s, the best GEMV
tiles of a small sweep and each tile's time, the copy's time, and the largest difference of
the GEMV's output from an fp32 reference. Timing only: random weights."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = tl = None

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}

if triton is not None:

    @triton.jit
    def _gemv_splitk_kernel(X, W, Y, P, CNT, stride_w, N: tl.constexpr, K: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
        """Y[N] = W[N, K] @ X[K]; program (n, s) covers columns n * BLOCK_N.. over the s-th
        K / SPLIT of K. With SPLIT > 1 the fp32 partials go to P[SPLIT, N] and the last
        program of a column block (CNT[n] counts them, and is reset by that program) sums
        them in split order."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        KS: tl.constexpr = K // SPLIT
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        k0 = pid_s * KS
        wp = W + rn[:, None] * stride_w + (k0 + rk)[None, :]
        w = tl.load(wp, mask=n_ok[:, None] & (rk < KS)[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for kk in range(0, KS, BLOCK_K):
            x = tl.load(X + k0 + kk + rk, mask=kk + rk < KS, other=0.0)
            cur = w
            nk = kk + BLOCK_K + rk
            w = tl.load(wp + kk + BLOCK_K, mask=n_ok[:, None] & (nk < KS)[None, :], other=0.0)
            acc += cur.to(tl.float32) * x.to(tl.float32)[None, :]
        part = tl.sum(acc, 1)
        if SPLIT == 1:
            tl.store(Y + rn, part.to(Y.dtype.element_ty), mask=n_ok)
        else:
            tl.store(P + pid_s * N + rn, part, mask=n_ok)
            tl.debug_barrier()
            done = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tot = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s in range(SPLIT):
                    tot += tl.load(P + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(Y + rn, tot.to(Y.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(CNT + pid_n, 0)


DOT_TILES = [(bn, bk, st, 4) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 5)] + [
    (32, 512, 3, 4), (64, 128, 4, 8), (128, 64, 4, 8), (16, 512, 4, 4)]


def dot_times(name: str, rows: list[int], budget_end: float) -> dict:
    """`ops.dot_rows` tiles against cuBLAS and the one-row GEMV at each row count."""
    from engine import ops
    from engine.graphs import graph_time_us

    n, k = SHAPES[name]
    dt, dev = torch.bfloat16, "cuda"
    wbytes = n * k * 2
    reps = max(3, min(40, int(3 * (64 << 20) // wbytes)))
    ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    x = torch.randn(16, k, dtype=dt, device=dev)
    out = {"proj": name, "n": n, "k": k, "reps": reps, "rows": {},
           "gemv_1_row_us": round(graph_time_us(lambda i: ops.gemv_rows(x[:1], ws[i]), reps,
                                                20), 2)}
    for m in rows:
        xm = x[:m]
        r = {"cublas_us": round(graph_time_us(lambda i, xm=xm: F.linear(xm, ws[i]), reps, 20),
                                2)}
        for t in DOT_TILES:
            if time.time() > budget_end:
                break
            try:
                r["dot_{}x{}s{}w{}_us".format(*t)] = round(graph_time_us(
                    lambda i, t=t, xm=xm: ops.dot_rows(xm, ws[i], tiles=t), reps, 20), 2)
            except Exception as e:  # a tile that does not compile (shared memory)
                r["dot_{}x{}s{}w{}_us".format(*t)] = repr(e)[:60]
        ok = {t: v for t, v in r.items() if t.startswith("dot") and isinstance(v, float)}
        if ok:
            r["best"] = min(ok, key=ok.get)
        out["rows"][m] = r
        print(name, m, "cublas", r["cublas_us"], "best", r.get("best"), ok.get(r.get("best")),
              flush=True)
    y = ops.dot_rows(x, ws[0], tiles=DOT_TILES[0])
    out["rows_bit_equal_alone"] = all(
        torch.equal(ops.dot_rows(x[i:i + 1], ws[0], tiles=DOT_TILES[0])[0], y[i])
        for i in range(16))
    ws.clear()
    torch.cuda.empty_cache()
    return out


class SplitKGemv:
    """Scratch for `gemv_splitk` (partials and counters, sized for the largest projection);
    one per device, reused by every launch (the launches are ordered)."""

    def __init__(self, device, max_n: int, max_split: int = 16, max_blocks: int = 1 << 16):
        self.partials = torch.empty(max_split * max_n, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_blocks, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        from engine.attention.triton_backend import pdl_args

        bn, bk, split, warps = tiles
        n, k = w.shape
        assert x.numel() == k and k % split == 0 and w.stride(1) == 1
        y = out if out is not None else torch.empty(n, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(n, bn), split)
        assert grid[0] <= self.counters.numel() and split * n <= self.partials.numel()
        _gemv_splitk_kernel[grid](x, w, y, self.partials, self.counters, w.stride(0), N=n,
                                  K=k, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=warps,
                                  **pdl_args(x, always=True))
        return y


def tiles_for(n: int, k: int, sms: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, SPLIT, warps) to try, those nearest 8 programs a multiprocessor
    first: splits that keep 2-256 programs a multiprocessor and each split a whole number of
    K tiles."""
    out = []
    for bn, bk, split, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024),
                                                  (1, 2, 4, 8, 16), (4, 8)):
        progs = triton.cdiv(n, bn) * split
        if not 2 * sms <= progs <= 256 * sms or k % (split * bk):
            continue
        if bn * bk > 16384 or bn * bk / (32 * warps) < 16:  # registers / too little a thread
            continue
        out.append((bn, bk, split, warps))
    return sorted(out, key=lambda t: abs(math.log(triton.cdiv(n, t[0]) * t[2] / (8 * sms))))


def shape_times(name: str, gemv: SplitKGemv, budget_end: float) -> dict:
    from engine.graphs import graph_time_us

    n, k = SHAPES[name]
    dt, dev = torch.bfloat16, "cuda"
    wbytes = n * k * 2
    reps = max(3, min(40, int(3 * (64 << 20) // wbytes)))  # ~3x L2 of weights per graph
    ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    x = torch.randn(k, dtype=dt, device=dev)
    y = torch.empty(n, dtype=dt, device=dev)
    src = torch.empty(wbytes, dtype=torch.uint8, device=dev)
    dsts = [torch.empty_like(src) for _ in range(min(reps, 4))]

    def us(fn, r=reps):
        return round(graph_time_us(fn, r, iters=20), 2)

    row = {"proj": name, "n": n, "k": k, "weight_mb": round(wbytes / 2**20, 2), "reps": reps}
    row["cublas_us"] = us(lambda i: F.linear(x[None], ws[i]))
    row["copy_us"] = round(us(lambda i: dsts[i].copy_(src), len(dsts)) / 2, 2)  # read + write
    ref = (ws[0].float() @ x.float())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = {}
    for t in tiles_for(n, k, sms):
        if time.time() > budget_end:
            break
        key = "n{}k{}s{}w{}".format(*t)
        try:
            sweep[key] = us(lambda i, t=t: gemv(x, ws[i], t, y))
        except Exception as e:  # a tile that does not compile
            sweep[key] = repr(e)[:80]
    ok = {t: v for t, v in sweep.items() if isinstance(v, float)}
    if ok:
        best = min(ok, key=ok.get)
        row.update(best_tiles=best, best_us=ok[best])
        t = tuple(int(v) for v in best[1:].replace("k", " ").replace("s", " ")
                  .replace("w", " ").split())
        out = gemv(x, ws[0], t)
        row["best_max_abs_err"] = float((out.float() - ref).abs().max())
        row["cublas_max_abs_err"] = float((F.linear(x[None], ws[0])[0].float() - ref)
                                          .abs().max())
        again = gemv(x, ws[0], t)
        row["best_deterministic"] = bool(torch.equal(out, again))
        row["best_vs_cublas"] = round(ok[best] / row["cublas_us"], 3)
        row["best_gbps"] = round(wbytes / ok[best] / 1e3, 1)
    row["cublas_gbps"] = round(wbytes / row["cublas_us"] / 1e3, 1)
    row["copy_gbps"] = round(wbytes / row["copy_us"] / 1e3, 1)
    row["sweep"] = sweep
    ws.clear()
    dsts.clear()
    torch.cuda.empty_cache()
    return row


ROW_TILES = [(4, 1024, 8), (4, 512, 4), (8, 512, 8), (2, 1024, 4), (4, 512, 8)]


def rows_times(name: str, rows: list[int]) -> dict:
    """The engine's `ops.gemv_rows` (one program reads each weight tile once for all rows)
    against cuBLAS at each row count, with a few tiles (a model uses one for every count);
    and whether each row comes out bit-equal alone and beside the others."""
    from engine import ops
    from engine.graphs import graph_time_us

    n, k = SHAPES[name]
    dt, dev = torch.bfloat16, "cuda"
    wbytes = n * k * 2
    reps = max(3, min(40, int(3 * (64 << 20) // wbytes)))
    ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    x = torch.randn(max(rows), k, dtype=dt, device=dev)
    out = {"proj": name, "n": n, "k": k, "reps": reps, "rows": {}}
    for m in rows:
        xm = x[:m]
        r = {"cublas_us": round(graph_time_us(lambda i, xm=xm: F.linear(xm, ws[i]), reps, 20),
                                2)}
        for t in ROW_TILES:
            r["gemv_{}x{}w{}_us".format(*t)] = round(graph_time_us(
                lambda i, t=t, xm=xm: ops.gemv_rows(xm, ws[i], tiles=t), reps, 20), 2)
        out["rows"][m] = r
        print(name, m, json.dumps(r), flush=True)
    y = ops.gemv_rows(x, ws[0])
    out["rows_bit_equal_alone"] = all(
        torch.equal(ops.gemv_rows(x[i:i + 1], ws[0])[0], y[i]) for i in range(len(x)))
    ws.clear()
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", default="o,qkv,down,lm_head,gate_up")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the tile sweeps")
    ap.add_argument("--dot", default="", help="instead of the sweep: 16-row tensor-core "
                    "tiles against cuBLAS at these row counts (e.g. 1,6,16)")
    ap.add_argument("--rows", default="", help="instead of the sweep: ops.gemv_rows against "
                    "cuBLAS at these row counts (e.g. 1,2,4,6,8)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gemv_sweep.json")
    t0 = time.time()
    result = {"command": "python -m bench.gemv_sweep " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "note": __doc__.split("\n\n", 1)[1], "rows": []}
    names = args.shapes.split(",")
    per = args.budget / len(names)
    if args.dot:  # one mode per run: which measure, under which key of the JSON
        key, rows = "dot", [int(r) for r in args.dot.split(",")]
        measure = lambda s: dot_times(s, rows, time.time() + per)  # noqa: E731
    elif args.rows:
        key, rows = "by_rows", [int(r) for r in args.rows.split(",")]
        measure = lambda s: rows_times(s, rows)  # noqa: E731
    else:
        key, gemv = "rows", SplitKGemv("cuda", max(SHAPES[s][0] for s in names))
        measure = lambda s: shape_times(s, gemv, time.time() + per)  # noqa: E731
    result[key] = []
    for s in names:
        row = measure(s)
        result[key].append(row)
        if key == "rows":
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        result["seconds"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
