"""Summarize a py-spy raw profile (`py-spy record -f raw`): each function's inclusive and own
share of the samples whose stack holds a given frame, e.g. the samples of one timed run.

    py-spy record -r 1000 --idle -f raw -o RAW -- python3 -m bench.step_profile ...
    python -m bench.pyspy_summary RAW [--under "main (bench/step_profile.py:271)"]
        [--top 60] [--json OUT]

A function is named as `name (file:line)` with the file's base name, the line its sample sat
on; `--by-function` folds the lines of a function together. Reads stdin with RAW `-`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter


def frame_name(frame: str, by_function: bool) -> str:
    """`fn (path/to/file.py:12)` as `fn (file.py:12)`, or `fn (file.py)` by function."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    where = os.path.basename(where.rstrip(")"))
    if by_function:
        where = where.split(":")[0]
    return f"{name} ({where})"


def summarize(lines, under: str = "", by_function: bool = False, top: int = 60) -> dict:
    """Inclusive and own sample shares (percent) of the stacks containing `under`."""
    incl: Counter = Counter()
    own: Counter = Counter()
    total = 0
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit() or under not in stack:
            continue
        count = int(n)
        frames = [frame_name(f, by_function) for f in stack.split(";")]
        total += count
        for f in set(frames):
            incl[f] += count
        own[frames[-1]] += count

    def pct(c: Counter) -> list:
        return [[name, round(100 * v / total, 2)] for name, v in c.most_common(top)] \
            if total else []

    return {"under": under, "samples": total, "inclusive_pct": pct(incl), "own_pct": pct(own)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--under", default="")
    ap.add_argument("--by-function", action="store_true")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    src = sys.stdin if args.raw == "-" else open(args.raw)
    with src:
        res = summarize(src, args.under, args.by_function, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['samples']} samples under {args.under!r}")
    for name, p in res["inclusive_pct"]:
        print(f"{p:6.2f}  {name}")
    print("-- own")
    for name, p in res["own_pct"][:30]:
        print(f"{p:6.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
