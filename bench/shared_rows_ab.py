"""Figure 1's single-stream runs with the prologue GEMVs one program per row (rows sharing
weight tiles through L2) and with one program for up to `ops.SHARED_ROWS` rows (each weight
tile read once for all of them), taking turns in one process (`bench.turns`): no-spec,
EAGLE-3 K=5 with context drafts and dynamic K with context drafts under each. The setting is
baked into each engine's graphs at its first turn. Token identity is against no-spec under
the same setting.

    python -m bench.shared_rows_ab --model M --reps 3 --out DIR/shared_rows_ab.json
"""

from __future__ import annotations

import argparse

from bench.common import eagle
from bench.turns import run_turns, turn_arguments

ROWS, TILES = "engine.ops.SHARED_ROWS", "engine.ops.SHARED_TILES"


def variants(args) -> dict:
    tiles = tuple(int(t) for t in args.tiles.split(",")) if args.tiles else None
    settings = {"per_row": {ROWS: 0, TILES: None}, "shared": {ROWS: args.rows, TILES: tiles}}
    out = {}
    for label, sets in settings.items():  # no-spec first under each setting: its baseline
        out[f"no_spec {label}"] = (None, sets)
    for label, sets in settings.items():
        out[f"eagle3_k5_context {label}"] = (eagle(args, 5, False, True), sets)
        out[f"eagle3_dynamic_k7_context {label}"] = (eagle(args, 7, True, True), sets)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(p, "bench/results/profile/shared_rows_ab.json", reps=3)
    p.add_argument("--rows", type=int, default=8, help="ops.SHARED_ROWS of the shared variants")
    p.add_argument("--tiles", default="", help="ops.SHARED_TILES BLOCK_N,BLOCK_K,warps "
                                               "(default: the GEMV's)")
    args = p.parse_args(argv)
    return run_turns("shared_rows_ab", args, variants,
                     {"shared_rows": args.rows, "shared_tiles": args.tiles or None})


if __name__ == "__main__":
    main()
