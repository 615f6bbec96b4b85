"""What detokenizing costs the host per step: 64 streams (or --streams) of SmolLM2 text, each
call bringing a step's ids (1 without speculation, K+1 with every draft accepted), through
the three decode paths in turns: the tokenizer's own decode, the byte table decoding each
window (`Tokenizer.decode`), and the byte table decoding only the new ids
(`Detokenizer._step_joined`). CPU only; no model.

    python -m bench.detok_cost [--streams 64] [--ids 1,4] [--steps 40] [--reps 5]
        [--json OUT]

Every path's deltas are checked equal to the first's."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time


class _Plain:
    """The tokenizer's own decode (no byte table, no joined path)."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids):
        return self.tok._fast_decode(ids, skip_special_tokens=True)


class _Windows:
    """The byte table decoding whole windows (the generic path)."""

    def __init__(self, tok):
        self.decode = tok.decode


def run(tok, texts: list[list[int]], n: int, steps: int) -> tuple[float, list[str]]:
    """Microseconds per step of `steps` steps of n ids a call for every stream; the deltas."""
    from engine.loader import Detokenizer

    streams = [(Detokenizer(tok, ids[:8]), list(ids[:8]), ids) for ids in texts]
    out = []
    t0 = time.perf_counter()
    for s in range(steps):
        for d, cur, ids in streams:
            cur.extend(ids[8 + s * n : 8 + (s + 1) * n])
            out.append(d.step(cur))
    return (time.perf_counter() - t0) / steps * 1e6, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--ids", default="1,4", help="ids a call (comma-separated)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from cluster.prompt_sets import build
    from engine import loader

    tok = loader.Tokenizer.load(loader.resolve(None))
    if not tok._byte_table():
        print("this tokenizer has no byte table", file=sys.stderr)
        return 1
    _, held = build()  # the kept held-out prompts: English text, code, numbers
    ids = tok.encode(" ".join(held))
    need = 8 + args.steps * max(int(x) for x in args.ids.split(","))
    texts = [ids[(97 * i) % (len(ids) - need):][:need] for i in range(args.streams)]
    paths = {"tokenizer": _Plain(tok), "byte table, windows": _Windows(tok),
             "byte table, new ids": tok}
    res = {"command": "python -m bench.detok_cost " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.machine(),
           "python": platform.python_version(), "streams": args.streams, "runs": []}
    for n in (int(x) for x in args.ids.split(",")):
        best = {k: float("inf") for k in paths}
        first = None
        for _ in range(args.reps):  # the paths in turns, the fastest of each kept
            for name, t in paths.items():
                us, out = run(t, texts, n, args.steps)
                first = out if first is None else first
                if out != first:
                    raise AssertionError(f"{name}: deltas differ at {n} ids a call")
                best[name] = min(best[name], us)
        row = {"ids_per_call": n, "us_per_step": {k: round(v, 1) for k, v in best.items()},
               "us_per_call": {k: round(v / args.streams, 2) for k, v in best.items()}}
        res["runs"].append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
