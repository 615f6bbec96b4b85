"""Replay figure 3's dynamic-K step traces (`bench.suite --fig3-trace`, `fig3_trace.json`)
through the cost model offline: what `StepCosts` read at each point of each run (plain step
ms, drafting's fixed part and price per draft, the measured gain per sequence), and each
run's steps grouped by drafts per sequence (count, median ms, tokens per ms).

    python -m bench.trace_replay TRACE.json [--match "c=2 burst"] [--every 10] [--json OUT]
        [--fig3 fig3_concurrency.json]
    python -m bench.trace_replay TRACE.json --levels --match "dynamic_k7 c=2 burst"

The traces hold every step the model was offered in the order the engine ran them (one
engine per variant, its runs one after another), so the replay feeds all of them to one
`StepCosts` and prints the runs whose key contains --match. Decisions are not replayed (they
depend on acceptance the trace does not hold): this shows what the model saw, from the
same code the engine runs."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

from engine.spec.policy import StepCosts, _bucket, switched


def replay(trace: dict, match: str = "", every: int = 10, walls: dict | None = None,
           pure: set[float] | None = None) -> list[dict]:
    """Per run whose key contains `match`: its steps by drafts per sequence and the cost
    model's readings every `every` steps (at the batch size of that step); with `walls`
    (figure 3's `trace_burst_wall_ms`), a burst run's wall ms and the part of it no traced
    step holds. Steps switching K are those the trace marks so (`how` ending in "switch");
    with `pure` (for traces recorded before the marks), drafting steps at any other level
    than these."""
    costs, out = StepCosts(), []
    for key, steps in trace.items():
        readings, groups = [], defaultdict(list)
        for i, (batch, drafts, ms, tokens, how, _) in enumerate(steps):
            if drafts is None:
                groups["untimed"].append((ms, 0))
                continue
            switch = switched(how) or (pure is not None and drafts > 0 and drafts not in pure)
            costs.record(batch, drafts, ms / 1e3, tokens, how, switch)
            groups[f"{drafts:g}"].append((ms, tokens or 0))
            if match in key and i % every == 0:
                b = _bucket(batch)
                gain = costs.measured_gain(batch)
                per = costs.per_token(batch)
                readings.append({
                    "step": i, "batch": batch,
                    "plain_ms": round(costs.plain[b] * 1e3, 3) if b in costs.plain else None,
                    "fixed": round(costs.fixed_cost(batch), 3),
                    "per_draft": None if per is None else round(per, 3),
                    "gain": None if gain is None else round(gain, 3)})
        if match not in key:
            continue
        by_level = {}
        for level, xs in sorted(groups.items(), key=lambda kv: (kv[0] == "untimed", kv[0])):
            ms = [m for m, _ in xs]
            by_level[level] = {"steps": len(xs), "median_ms": round(statistics.median(ms), 3),
                               "total_ms": round(sum(ms), 1), "tokens": sum(t for _, t in xs),
                               "tokens_per_ms": round(sum(t for _, t in xs) / sum(ms), 2)
                               if level != "untimed" else None}
        run = {"run": key, "steps": len(steps), "by_drafts": by_level, "readings": readings}
        if walls and key in walls:
            run["wall_ms"] = walls[key]
            run["outside_steps_ms"] = round(walls[key] - sum(s[2] for s in steps), 3)
        out.append(run)
    return out


def levels_table(trace: dict, match: str = "") -> dict:
    """The steps of every run whose key contains `match`, pooled by (full batch or tail,
    drafts per sequence): steps, mean ms, tokens a step and tokens per ms. A step runs at the
    full batch when its batch size is the run's concurrency (the key's "c=N"); the tail is
    every step after the first stream finished. Untimed steps are left out."""
    pooled: dict[tuple[str, str], list] = defaultdict(list)
    for key, steps in trace.items():
        if match not in key:
            continue
        conc = next((int(w[2:]) for w in key.split() if w.startswith("c=")), None)
        for batch, drafts, ms, tokens, _, _ in steps:
            if drafts is not None:
                part = "full" if batch == conc else "tail"
                pooled[(part, f"{drafts:g}")].append((ms, tokens or 0))
    out = {}
    for (part, level), xs in sorted(pooled.items(), key=lambda kv: (kv[0][0],
                                                                     float(kv[0][1]))):
        ms, tok = sum(m for m, _ in xs), sum(t for _, t in xs)
        out.setdefault(part, {})[level] = {
            "steps": len(xs), "mean_ms": round(ms / len(xs), 3),
            "tokens_per_step": round(tok / len(xs), 2), "tokens_per_ms": round(tok / ms, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--match", default="", help="only runs whose key contains this")
    p.add_argument("--every", type=int, default=10, help="a reading every this many steps")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--fig3", default=None,
                   help="the run's fig3_concurrency.json: burst runs' wall time against the "
                        "traced steps (its trace_burst_wall_ms)")
    p.add_argument("--pure", default=None,
                   help="drafting levels of steps that keep their K, comma-separated (e.g. "
                        "1,2.5,3.5,5.5,7 for K=1..7 on graphs of 1, 2, 4, 8 verify rows and "
                        "0, 1, 2, 4, 7 chain steps): others replay as switches of K, for "
                        "traces recorded before the engine marked them")
    p.add_argument("--levels", action="store_true",
                   help="instead: the matching runs' steps pooled by full batch or tail and "
                        "drafts per sequence (steps, mean ms, tokens a step, tokens per ms)")
    args = p.parse_args(argv)
    pure = None if args.pure is None else {float(x) for x in args.pure.split(",")}
    with open(args.trace) as f:
        trace = json.load(f)
    if args.levels:
        table = levels_table(trace, args.match)
        for part, rows in table.items():
            for level, g in rows.items():
                print(f"{part} drafts/seq {level:>5}: {g['steps']:4d} steps, {g['mean_ms']:.3f} "
                      f"ms, {g['tokens_per_step']} tokens a step, {g['tokens_per_ms']} tok/ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table, f, indent=1)
        return 0
    walls = None
    if args.fig3:
        with open(args.fig3) as f:
            walls = json.load(f).get("trace_burst_wall_ms")
    runs = replay(trace, args.match, args.every, walls, pure)
    for r in runs:
        wall = f", wall {r['wall_ms']} ms, {r['outside_steps_ms']} ms outside the steps" \
            if "wall_ms" in r else ""
        print(f"{r['run']}: {r['steps']} steps{wall}")
        for level, g in r["by_drafts"].items():
            print(f"  drafts/seq {level:>7}: {g['steps']:4d} steps, median {g['median_ms']:.3f} "
                  f"ms, {g['total_ms']:.1f} ms, {g['tokens']} tokens"
                  + (f", {g['tokens_per_ms']} tok/ms" if g["tokens_per_ms"] is not None else ""))
        print("  " + " ".join(
            f"{x['step']}|b{x['batch']}:p{x['plain_ms']}/f{x['fixed']}/c{x['per_draft']}"
            f"/g{x['gain']}" for x in r["readings"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
