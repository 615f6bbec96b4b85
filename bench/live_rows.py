"""What `ops.prologue_linear`'s dead-row check (`live`) costs the rows it does not skip: a
SmolLM2-shaped layer stack's four projections (qkv and gate_up after a norm, o, down after
SiLU-and-mul), random bf16 weights, one CUDA graph of every layer's projections, PDL as
configured, at 1..8 rows: without `live`, with every row live, and with one row live and the
rest dead. Also each compiled variant's registers and spills. With --tiles, the same layer
stack with one projection's GEMV tiles changed at a time (the same tiles for 1..8 rows, as
the engine needs them: a verify row must round as the one-row decode does); with --combos,
several projections' tiles changed together. Timing only.

    python -m bench.live_rows --out DIR [--rows 1,2,8] [--layers 30]
    python -m bench.live_rows --out DIR --tiles 8x1024w4,32x1024w4 [--rows 1,8]
    python -m bench.live_rows --out DIR --combos gate_up=8x1024w2+qkv=4x1024w1 [--rows 1,8]
    python -m bench.live_rows --out DIR --rows 1,2,4,8 --exact-k
    python -m bench.live_rows --out DIR --rows 1,2,4,8 --one-load

Writes DIR/live_rows.json with the command, GPU, versions and date."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SMOL = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def compiled_variants(kernel) -> list[dict]:
    """Registers, spills, warps and shared memory of every compiled variant of a Triton kernel
(Triton 3.6's metadata names no constexpr values, so variants are told apart by these)."""
    out = []

    def walk(obj, depth=0):
        if depth > 4:
            return
        if hasattr(obj, "n_regs") and hasattr(obj, "metadata"):
            md = obj.metadata
            out.append({"n_regs": obj.n_regs, "n_spills": obj.n_spills,
                        "shared": getattr(md, "shared", None),
                        "num_warps": getattr(md, "num_warps", None)})
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)

    walk(getattr(kernel, "device_caches", {}))
    return out


def tile_overrides(tiles: dict[str, str]) -> dict:
    """`ops.LINEAR_TILES` entries giving each named projection ({"gate_up": "8x1024w2"}) its
    GEMV tiles BNxBKwWARPS at every row count 1..8."""
    out = {}
    for name, t in tiles.items():
        n, k = SMOL[name]
        bn, rest = t.split("x")
        bk, w = rest.split("w")
        out.update({(q, n, k): (1, int(bn), int(bk), int(w)) for q in range(1, 9)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="1,2,8")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--exact-k", action="store_true",
                   help="also every case with engine.ops.EXACT_K (K in power-of-two tiles and "
                        "a tail tile)")
    p.add_argument("--one-load", action="store_true",
                   help="also every case with engine.ops.ONE_LOAD off (the norm prologue "
                        "reading x twice)")
    p.add_argument("--combos", default="",
                   help="tile sets applied together, comma-separated, each PROJ=BNxBKwW joined "
                        "by '+', e.g. gate_up=8x1024w2+qkv=4x1024w1")
    p.add_argument("--tiles", default="",
                   help="GEMV tiles BNxBKwWARPS (comma-separated) tried on each projection")
    args = p.parse_args(argv)
    from bench.common import module_settings, save_json
    from engine import ops
    from engine.graphs import graph_time_us

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [{name: torch.randn(n, k, device=dev, dtype=dt, generator=g) * 0.02
               for name, (n, k) in SMOL.items()} for _ in range(args.layers)]
    norms = [torch.ones(576, device=dev, dtype=dt) for _ in range(2)]
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, 576, device=dev, dtype=dt, generator=g)
        r = torch.randn(m, 576, device=dev, dtype=dt, generator=g)
        gu = torch.randn(m, 2 * 1536, device=dev, dtype=dt, generator=g)
        live_all = torch.arange(m, device=dev, dtype=torch.int64)
        live_one = torch.full((m,), -1, device=dev, dtype=torch.int64)
        live_one[0] = 0
        # case: (live, GEMV tile overrides, module constants set for it)
        cases = {"no_check": (None, {}, {}), "all_live": (live_all, {}, {})}
        if m > 1:
            cases["one_live"] = (live_one, {}, {})
        if args.exact_k:  # the same with ops.EXACT_K (K = 576 as 512 + a 64-wide tail),
            # at the tiles' warps and at warps matched to the split tiles
            base = dict(cases)
            for mode, tag in ((True, "exact_k"), ("match", "exact_k_match")):
                cases.update({f"{tag}_{c}": (lv, t, {**st, "engine.ops.EXACT_K": mode})
                              for c, (lv, t, st) in base.items()})
        if args.one_load:  # the norm prologue reading x (+ r) twice, as before ONE_LOAD
            cases.update({f"two_loads_{c}": (lv, t, {**st, "engine.ops.ONE_LOAD": False})
                          for c, (lv, t, st) in list(cases.items())})
        if args.tiles or args.combos:  # the baseline, then each projection under each tile
            cases = {"default": (None, {}, {})}
            for name in SMOL:
                for t in filter(None, args.tiles.split(",")):
                    cases[f"{name}_{t}"] = (None, tile_overrides({name: t}), {})
            for combo in filter(None, args.combos.split(",")):  # several projections at once
                cases[combo] = (None, tile_overrides(dict(
                    part.split("=") for part in combo.split("+"))), {})
        for case, (live, tiles, settings) in cases.items():
            ops.LINEAR_TILES.clear()
            ops.LINEAR_TILES.update(tiles)
            def step(i, live=live, x=x, r=r, gu=gu):
                w = layers[i % len(layers)]
                ops.prologue_linear(x, w["qkv"], norm_weight=norms[0], eps=1e-5, residual=r,
                                    live=live)
                ops.prologue_linear(x, w["o"], live=live)
                ops.prologue_linear(x, w["gate_up"], norm_weight=norms[1], eps=1e-5,
                                    residual=r, live=live)
                ops.prologue_linear(gu, w["down"], silu=True, live=live)
            with module_settings(settings):
                us = [round(graph_time_us(step, args.layers, iters=20), 2) for _ in range(3)]
            results.append({"rows": m, "case": case, "us_per_layer": us,
                            "best": min(us)})
            print(f"[live_rows] rows {m} {case}: {min(us)} us a layer ({us})", flush=True)
        ops.LINEAR_TILES.clear()
    out = {"command": " ".join([os.path.basename(sys.executable), "-m", "bench.live_rows"]
                               + (argv if argv is not None else sys.argv[1:])),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "layers": args.layers,
           "results": results, "compiled": compiled_variants(ops._prologue_linear_kernel)}
    for c in out["compiled"]:
        print(f"[live_rows] variant {c['n_regs']} regs {c['n_spills']} spills "
              f"{c['num_warps']} warps {c['shared']} B shared")
    save_json(os.path.join(args.out, "live_rows.json"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
