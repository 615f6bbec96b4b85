"""How the prologue linears lay out a few rows (a verify step's K+1, a small batch) on the GPU:
one GEMV program per row with the column blocks first in the grid (each row's programs walk
the whole weight before the next row's start), the same with the rows first (the programs
sharing a weight tile side by side), and 16-row tensor-core blocks (`ops.DOT_TILES`) in a
few tile shapes, which read each weight tile once for all rows.

    python -m bench.row_layouts --out DIR [--rows 1,2,4,8,16] [--layouts all]

Writes DIR/row_layouts.json: per layout, GPU microseconds per decode-graph replay of a random
SmolLM2-shaped bf16 model at each row count (every row count through the prologue linears),
its ratio to the one-row forward of the shipped layout, each projection's time per call
(weights from HBM: one copy per call of a graph; the LM head as the model calls it: with
`ops.LOGITS_DOT_TILES` unless the layout sets tiles for all) at 1 and 8 rows, and whether
every row came out bit-equal alone and beside the others (what greedy speculation's
losslessness needs).
Also the greedy token of a step: torch's cast + argmax against `ops.argmax_rows`. Timing
only: random weights."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

LAYOUTS = {  # name: (ROWS_FIRST, DOT_TILES)
    "gemv_cols_first": (False, None),
    "gemv_rows_first": (True, None),
    **{f"dot_{bn}x{bk}w{w}": (True, (bn, bk, w)) for bn, bk, w in [
        (16, 256, 4), (32, 256, 4), (64, 256, 4), (16, 512, 4), (32, 512, 4), (32, 128, 4),
        (16, 1024, 4), (32, 1024, 8), (64, 128, 4), (16, 256, 2)]},
}
PROJ = {"qkv": (960, 576, "norm"), "o": (576, 576, "plain"), "gate_up": (3072, 576, "norm"),
        "down": (576, 1536, "silu"), "lm_head": (49152, 576, "plain")}


def set_layout(name: str) -> None:
    from engine import ops

    ops.ROWS_FIRST, ops.DOT_TILES = LAYOUTS[name]


def op_us(name: str, rows: int) -> float:
    from engine import ops
    from engine.graphs import graph_time_us

    n, k, pro = PROJ[name]
    dt, dev = torch.bfloat16, "cuda"
    reps = max(2, min(40, int(3 * (64 << 20) // (n * k * 2))))
    ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    x = torch.randn(rows, 2 * k if pro == "silu" else k, dtype=dt, device=dev)
    nw = torch.rand(k, dtype=dt, device=dev) + 0.5

    def call(i):
        if pro == "norm":
            return ops.prologue_linear(x, ws[i], norm_weight=nw, eps=1e-5, residual=x)
        if name == "lm_head" and ops.DOT_TILES is None:  # as the model calls it
            return ops.prologue_linear(x, ws[i], dot=ops.LOGITS_DOT_TILES)
        return ops.prologue_linear(x, ws[i], silu=pro == "silu")

    return round(graph_time_us(call, reps, iters=20), 2)


def rows_bit_equal() -> bool:
    """Every row of an m-row launch equal to the same row alone, m = 2..8 (GEMV layouts: 9+
    rows take tl.dot blocks) or 2..DOT_MAX_ROWS (tensor-core layouts), for each prologue
    kind on SmolLM2 projection shapes."""
    from engine import ops

    max_rows = 8 if ops.DOT_TILES is None else ops.DOT_MAX_ROWS
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k, pro in PROJ.values():
        w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.05
        x = torch.randn(max_rows, 2 * k if pro == "silu" else k, device="cuda",
                        generator=g).to(torch.bfloat16)
        nw = torch.rand(k, device="cuda", generator=g).to(torch.bfloat16) + 0.5

        def f(a, w=w, nw=nw, pro=pro):
            if pro == "norm":
                return ops.prologue_linear(a, w, norm_weight=nw, eps=1e-5, residual=a)[0]
            return ops.prologue_linear(a, w, silu=pro == "silu")

        alone = torch.cat([f(x[i:i + 1]) for i in range(max_rows)])
        for m in range(2, max_rows + 1):
            if not torch.equal(f(x[:m]), alone[:m]):
                return False
    return True


def greedy_us(rows: int) -> dict:
    from engine import ops
    from engine.graphs import graph_time_us

    x = torch.randn(rows, 49152, device="cuda").to(torch.bfloat16)
    want = x.float().argmax(-1)
    assert torch.equal(ops.argmax_rows(x), want)
    return {"torch_cast_argmax_us": round(graph_time_us(lambda i: x.float().argmax(-1), 20), 2),
            "argmax_rows_us": round(graph_time_us(lambda i: ops.argmax_rows(x), 20), 2)}


def main(argv=None):
    from bench.linear_sweep import decode_forward_us, random_smol_engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/profile")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--op-rows", default="1,8")
    ap.add_argument("--layouts", default="all")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "row_layouts.json")
    names = list(LAYOUTS) if args.layouts == "all" else args.layouts.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    t0 = time.time()
    result = {"command": "python -m bench.row_layouts " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "note": __doc__.split("\n\n")[-1], "layouts": {}}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass

    def save():
        result["seconds"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    result["greedy"] = {r: greedy_us(r) for r in (1, 8)}
    print(json.dumps(result["greedy"]), flush=True)
    eng = random_smol_engine()
    eng.model.prologue_rows = frozenset(range(1, max(rows_list) + 1))
    base = None
    for name in names:
        set_layout(name)
        row = {"tiles": LAYOUTS[name]}
        try:
            row["bit_equal_rows"] = rows_bit_equal()
            row["forward_us"] = {r: round(decode_forward_us(eng, r), 1) for r in rows_list}
            if base is None:
                base = row["forward_us"][rows_list[0]]
            row["forward_vs_base_1row"] = {r: round(v / base, 3)
                                           for r, v in row["forward_us"].items()}
            row["ops_us"] = {p: {r: op_us(p, int(r)) for r in args.op_rows.split(",")}
                             for p in PROJ}
        except Exception as e:  # a tile that does not compile: keep the others
            row["error"] = repr(e)[:300]
        result["layouts"][name] = row
        print(name, json.dumps(row), flush=True)
        save()
    set_layout("gemv_rows_first")
    save()
    print("wrote", path)


if __name__ == "__main__":
    main()
