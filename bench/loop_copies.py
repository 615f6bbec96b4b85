"""Figure 1's single-stream runs with context copies continued as loops (`ngram.CONTINUE_LOOPS`,
the default) and cut where they reach the present, in one process: the variants take turns,
the order rotated each repetition, so host drift lands on all alike (`bench.turns`). Also
writes the no-spec greedy answers (for replaying drafters offline) and, per dynamic-K run,
how many steps ran at each draft count with their median time and tokens, and why each step
got its K.

    python -m bench.loop_copies --model M --out bench/results/profile/loop_copies.json
"""

from __future__ import annotations

import argparse
import time

from bench.common import (
    command_line,
    eagle,
    environment,
    held_out_messages,
    load_smol,
    model_arguments,
    model_defaults,
    save_json,
)
from bench.turns import take_turns

LOOPS = "engine.spec.ngram.CONTINUE_LOOPS"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--out", default="bench/results/profile/loop_copies.json")
    args = p.parse_args(argv)

    model_defaults(args)
    args.prompt_offset = 0
    msgs = held_out_messages(args.prompts, 0)
    base = load_smol(args, spec=eagle(args, 5, False, False), num_blocks=args.num_blocks)
    prompts = [base.encode_prompt(m) for m in msgs]
    specs = {"eagle3_dynamic_k7_context": eagle(args, 7, True, True),
             "eagle3_k5_context": eagle(args, 5, False, True),
             "eagle3_k7_context": eagle(args, 7, False, True)}
    # (The device lookup's flag is baked into each engine's graphs at its first turn.)
    variants = {"no_spec loops=on": (None, {LOOPS: True})}
    for name, spec in specs.items():
        for loops in (True, False):
            variants[f"{name} loops={'on' if loops else 'off'}"] = (spec, {LOOPS: loops})
    res = {"name": "loop_copies", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "prompts": len(prompts), "tokens": args.tokens, "reps": args.reps,
           **take_turns(args, base, prompts, variants, args.reps, args.num_blocks)}
    res["best_vs_no_spec"] = res.pop("best_vs_first")
    res["median_vs_no_spec"] = res.pop("median_vs_first")
    return {"path": save_json(args.out, res), **res}


if __name__ == "__main__":
    main()
