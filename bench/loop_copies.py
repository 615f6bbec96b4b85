"""Figure 1's single-stream runs with context copies continued as loops (`ngram.CONTINUE_LOOPS`,
the default) and cut where they reach the present, in one process: the variants take turns,
the order rotated each repetition, so host drift lands on all alike. Also writes the no-spec
greedy answers (for replaying drafters offline) and, per dynamic-K run, how many steps ran
at each draft count with their median time and tokens, and why each step got its K.

    python -m bench.loop_copies --model M --out bench/results/profile/loop_copies.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict

from bench.common import (
    command_line,
    eagle,
    environment,
    held_out_messages,
    load_smol,
    log,
    model_arguments,
    model_defaults,
    rnd,
    save_json,
    start_trace,
    take_trace,
)


def trace_summary(trace: list) -> dict:
    """Steps by drafts per sequence: count, median ms, mean tokens (`StepCosts.trace` rows;
    steps that are not a pure decode, drafts None, under "other")."""
    by = defaultdict(list)
    for _, drafts, ms, tokens, _, _ in trace:
        by[-1.0 if drafts is None else drafts].append((ms, tokens or 0))
    return {"other" if d < 0 else str(d): {
        "steps": len(v), "median_ms": rnd(statistics.median(m for m, _ in v), 4),
        "mean_tokens": rnd(statistics.fmean(t for _, t in v), 3)} for d, v in sorted(by.items())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--out", default="bench/results/profile/loop_copies.json")
    args = p.parse_args(argv)

    from bench.suite import run_single
    from engine.spec import ngram

    model_defaults(args)
    args.prompt_offset = 0
    msgs = held_out_messages(args.prompts, 0)
    base = load_smol(args, spec=eagle(args, 5, False, False), num_blocks=args.num_blocks)
    prompts = [base.encode_prompt(m) for m in msgs]
    specs = {"no_spec": None, "eagle3_dynamic_k7_context": eagle(args, 7, True, True),
             "eagle3_k5_context": eagle(args, 5, False, True),
             "eagle3_k7_context": eagle(args, 7, False, True)}
    # (variant, loops) -> engine, built and captured on its first turn with its flag set
    # (the device lookup's flag is baked into the captured graphs).
    keys = [(n, loops) for n in specs for loops in (True, False) if specs[n] or loops]
    engines: dict = {}
    res = {"name": "loop_copies", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "prompts": len(prompts), "tokens": args.tokens, "reps": args.reps,
           "runs": {f"{n} loops={'on' if lp else 'off'}": [] for n, lp in keys}}
    for rep in range(args.reps):
        r = rep % len(keys)
        for name, loops in keys[r:] + keys[:r]:
            ngram.CONTINUE_LOOPS = loops
            eng = engines.get((name, loops))
            if eng is None:
                eng = engines[(name, loops)] = base.with_config(spec=specs[name],
                                                                num_blocks=args.num_blocks)
            tracing = specs[name] is not None and specs[name].dynamic and start_trace(eng)
            why = Counter(eng.spec.policy.batch_why) if tracing else None
            out = run_single(args, eng, prompts, args.tokens)
            outs = out.pop("_outs")
            if tracing:
                out["steps_by_drafts"] = trace_summary(take_trace(eng))
                # why dynamic K picked each fused step's K in this run (`KPolicy.batch_why`)
                out["why"] = dict(sorted((Counter(eng.spec.policy.batch_why) - why).items()))
            if name == "no_spec" and rep == 0:
                res["answers"] = {"prompts": prompts, "outputs": outs}
            else:
                out["token_identical_to_no_spec"] = sum(
                    a == b for a, b in zip(outs, res.get("answers", {}).get("outputs", [])))
            res["runs"][f"{name} loops={'on' if loops else 'off'}"].append(out)
            log(f"rep {rep} {name} loops={loops}: {out['tokens_per_s']} tok/s, "
                f"acceptance {out['acceptance_length']}")
    ngram.CONTINUE_LOOPS = True
    no_spec = max(r["tokens_per_s"] for r in res["runs"]["no_spec loops=on"])
    res["best_vs_no_spec"] = {k: rnd(max(r["tokens_per_s"] for r in v) / no_spec, 3)
                              for k, v in res["runs"].items()}
    log(f"best of each / best no-spec: {res['best_vs_no_spec']}")
    return {"path": save_json(args.out, res), **res}


if __name__ == "__main__":
    main()
