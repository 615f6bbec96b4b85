"""Prologue linears on the GPU (`ops.prologue_linear`): one launch for norm + projection and
for SiLU-and-mul + projection, against the two launches they replace, per projection shape
and row count, then the whole decode forward of a SmolLM2-shaped model with and without them.

    python -m bench.linear_sweep --out DIR [--rows 1,4,16,64] [--budget 240]

Writes DIR/linear_sweep.json:
- `ops`: per (model shape, projection, rows): microseconds per call of the separate kernels
  (`add_rmsnorm` / `silu_mul`, then cuBLAS through F.linear), of the prologue kernel with
  the default tiles, and of the best tiles found by a small sweep; each call in a CUDA graph
  of `reps` calls, each on its own copy of the weight so weights come from HBM as in a model
  (whose weights do not fit in L2), without and with PDL;
- `forward`: GPU milliseconds per decode-graph replay of a random SmolLM2-shaped bf16 model
  at each row count: separate kernels or prologue linears, each without and with
  programmatic dependent launch (PDL), and the ratios to separate without PDL;
- `calibration`: that engine's own timing at graph set-up (`calibrate_prologue_rows`), which
  decides the row counts its forward gives the prologue linears.
Timing only: random weights."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # projection: (N, K, prologue) with K the weight's input width
    "smol": {"qkv": (960, 576, "norm"), "o": (576, 576, "plain"),
             "gate_up": (3072, 576, "norm"), "down": (576, 1536, "silu")},
    "llama8b": {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "plain"),
                "gate_up": (28672, 4096, "norm"), "down": (4096, 14336, "silu")},
}
TILES = {  # (BLOCK_N, BLOCK_K, num_warps) tried: GEMV tiles (BLOCK_M <= 8), tl.dot tiles
    1: [(bn, bk, 4) for bn in (8, 16, 32) for bk in (256, 512)] +
       [(bn, 1024, w) for bn in (8, 16, 32) for w in (4, 8)] + [(16, 1024, 16), (16, 512, 8)],
    16: [(bn, bk, 4) for bn in (16, 32, 64) for bk in (64, 128)] +
        [(32, 256, 4), (32, 128, 8), (16, 128, 2)],
}


def _graph_us(fn, reps: int) -> float:
    """Microseconds per call of fn(i) (i: the weight copy to use), `reps` calls a graph."""
    from engine.graphs import graph_time_us

    return round(graph_time_us(fn, reps, iters=20), 2)


def op_times(model: str, name: str, rows: int, budget_end: float) -> dict:
    from engine import ops
    from engine.attention import triton_backend

    n, k, pro = SHAPES[model][name]
    dt, dev = torch.bfloat16, "cuda"
    wbytes = n * k * 2
    reps = max(4, min(40, int(3 * (64 << 20) // wbytes)))  # ~3x L2 of weights per graph
    ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    xin = torch.randn(rows, 2 * k if pro == "silu" else k, dtype=dt, device=dev)
    res = torch.randn(rows, k, dtype=dt, device=dev)
    nw = torch.rand(k, dtype=dt, device=dev) + 0.5

    def separate(i):
        if pro == "norm":
            x, _ = ops.add_rmsnorm(xin, nw, 1e-5, res)
        elif pro == "silu":
            x = ops.silu_mul(xin)
        else:
            x = xin
        return F.linear(x, ws[i])

    def fused(i):
        if pro == "norm":
            return ops.prologue_linear(xin, ws[i], norm_weight=nw, eps=1e-5, residual=res)
        return ops.prologue_linear(xin, ws[i], silu=pro == "silu")

    row = {"model": model, "proj": name, "rows": rows, "n": n, "k": k, "prologue": pro,
           "weight_mb": round(wbytes / 2**20, 2), "reps": reps}
    ops.LINEAR_TILES.clear()
    row["default_tiles"] = list(ops.linear_tiles(rows, n, k))
    triton_backend.PDL = False
    row["separate_us"] = _graph_us(separate, reps)
    row["prologue_no_pdl_us"] = _graph_us(fused, reps)
    triton_backend.PDL = None
    row["separate_pdl_norm_us"] = _graph_us(separate, reps)
    row["pdl"] = triton_backend.pdl_supported(xin.device)
    row["prologue_us"] = _graph_us(fused, reps)
    sweep = {}
    bm = row["default_tiles"][0]
    for bn, bk, w in TILES[1 if bm <= 8 else 16]:
        if time.time() > budget_end:
            break
        ops.LINEAR_TILES[(rows, n, k)] = (bm, bn, bk, w)
        try:
            sweep[f"{bn}x{bk}w{w}"] = _graph_us(fused, reps)
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            sweep[f"{bn}x{bk}w{w}"] = repr(e)[:80]
    ops.LINEAR_TILES.clear()
    ok = {t: v for t, v in sweep.items() if isinstance(v, float)}
    if ok:
        bt = min(ok, key=ok.get)
        row.update(best_tiles=bt, best_us=ok[bt])
    row["sweep"] = sweep
    row["prologue_vs_separate"] = round(row["prologue_us"] / row["separate_us"], 3)
    gbs = wbytes / (row["prologue_us"] * 1e-6) / 1e9
    row["prologue_weight_gbps"] = round(gbs, 1)
    ws.clear()
    torch.cuda.empty_cache()
    return row


VARIANTS = [  # (name, prologue linears, triton_backend.PDL)
    ("separate", False, False), ("separate_pdl", False, None),
    ("prologue", True, False), ("prologue_pdl", True, None)]


def random_smol_engine():
    """A SmolLM2-shaped bf16 engine on the GPU with random weights (N(0, 0.05), seed 0),
    Triton attention and CUDA graphs: timing only."""
    from engine import Engine, EngineConfig
    from tests.engine.test_gpu_engine import smol_shape

    torch.manual_seed(0)
    eng = Engine(EngineConfig(model=smol_shape(), dtype=torch.bfloat16, device="cuda",
                              num_blocks=4096, block_size=16, attention_backend="triton",
                              cuda_graphs=True))
    with torch.no_grad():
        for p in eng.model.parameters():
            p.normal_(0, 0.05)
    return eng


def decode_forward_us(eng, rows: int, ctx: int = 256) -> float:
    """GPU microseconds per replay of eng's decode graph for `rows` sequences of `ctx` tokens
    (captured afresh, so the current kernel settings apply; best of three runs of 50)."""
    from engine.graphs import pack, replay_us

    graphs = eng.runner.graphs
    per = ctx // 16 + 1
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
    inp = pack([5] * rows, [ctx] * rows, tables, [1] * rows, 16)
    graphs.graphs.clear()
    graphs.run(inp)  # captures the bucket, stages the inputs
    key = next(k for k in graphs.graphs if k[1] == 1)
    return replay_us(graphs.graphs[key][0], 50)


def forward_times(rows_list, ctx: int = 256) -> tuple[list[dict], dict | None]:
    """GPU ms per decode-graph replay of a random SmolLM2-shaped bf16 model: separate kernels
    or prologue linears (every row count allowed here), each without and with programmatic
    dependent launch; and the engine's own calibration at graph set-up ({rows: (prologue
    us, separate us)} for one layer's projections), which picks the rows it uses."""
    from engine.attention import triton_backend

    eng = random_smol_engine()
    rows_default = eng.model.prologue_rows
    out = []
    for rows in rows_list:
        row = {"rows": rows, "context": ctx}
        for name, flag, pdl in VARIANTS:
            eng.model.prologue_linears = flag
            eng.model.prologue_rows = frozenset(range(1, 65))
            triton_backend.PDL = pdl
            row[name + "_ms"] = round(decode_forward_us(eng, rows, ctx) / 1e3, 4)
        for name, _, _ in VARIANTS[1:]:
            row[name + "_vs_separate"] = round(row[name + "_ms"] / row["separate_ms"], 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    eng.model.prologue_linears, eng.model.prologue_rows = True, rows_default
    triton_backend.PDL = None
    return out, eng.model.prologue_calibration


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", default="1,2,4,8,16,64", help="row counts of the forward")
    ap.add_argument("--sweep-rows", default="1,4,8,16", help="row counts of the op sweep")
    ap.add_argument("--models", default="smol,llama8b")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the tile sweeps")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "linear_sweep.json")
    t0 = time.time()
    result = {"command": "python -m bench.linear_sweep " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name(0), "note": __doc__.split("\n\n")[-1]}

    def save():
        result["seconds"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    try:
        result["forward"], result["calibration"] = forward_times(
            [int(r) for r in args.rows.split(",")])
    except Exception as e:  # keep the op sweep's results whatever happens here
        result["forward_error"] = repr(e)
        print("forward failed:", repr(e), flush=True)
    save()
    jobs = [(m, p, int(r)) for m in args.models.split(",") for p in SHAPES[m]
            for r in args.sweep_rows.split(",")]
    per_job = args.budget / max(1, len(jobs))
    result["ops"] = []
    for m, p, r in jobs:
        row = op_times(m, p, r, time.time() + per_job)
        result["ops"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        save()
    print("wrote", path)


if __name__ == "__main__":
    main()
