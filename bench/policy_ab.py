"""Figure 1's single-stream runs under dynamic K's rules before and after a change, taking
turns in one process (`bench.turns`): the losing verdict's age limit for drafting steps
(`policy.LOSING_FRESH`: 64 now, `StepCosts.STALE` = 256 before) and whether steps switching
K are points of the cost fit (`policy.FIT_SWITCHES`: no now, yes before), each alone and
both, beside no-spec and fixed K=5 (which neither rule touches), and the two rules again
with the policy's measurements started afresh each turn. Per dynamic run: tok/s,
acceptance, token identity with no-spec, steps by draft count and why each got its K.

    python -m bench.policy_ab --model M --reps 3 --out bench/results/profile/policy_ab.json
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

FRESH, FIT = "engine.spec.policy.LOSING_FRESH", "engine.spec.policy.FIT_SWITCHES"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--out", default="bench/results/profile/policy_ab.json")
    p.add_argument("--traces", action="store_true",
                   help="keep every dynamic run's steps and K picks (trace, picks)")
    args = p.parse_args(argv)

    from engine.spec.policy import LOSING_FRESH, StepCosts

    model_defaults(args)
    args.prompt_offset = 0
    msgs = held_out_messages(args.prompts, 0)
    base = load_smol(args, spec=eagle(args, 5, False, False), num_blocks=args.num_blocks)
    prompts = [base.encode_prompt(m) for m in msgs]
    dyn = eagle(args, 7, True, True)
    old, new = StepCosts.STALE, LOSING_FRESH
    variants = {"no_spec": (None, {}), "eagle3_k5_context": (eagle(args, 5, False, True), {}),
                "dynamic now": (dyn, {FRESH: new, FIT: False}),
                "dynamic before": (dyn, {FRESH: old, FIT: True}),
                # the policy's measurements start afresh each turn, as on an engine's first
                "dynamic now reset": (dyn, {FRESH: new, FIT: False}, "reset"),
                "dynamic before reset": (dyn, {FRESH: old, FIT: True}, "reset"),
                "dynamic fresh losing only": (dyn, {FRESH: new, FIT: True}),
                "dynamic switches unfit only": (dyn, {FRESH: old, FIT: False})}
    res = {"name": "policy_ab", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "prompts": len(prompts), "tokens": args.tokens, "reps": args.reps,
           **take_turns(args, base, prompts, variants, args.reps, args.num_blocks,
                        traces=args.traces)}
    res["best_vs_no_spec"] = res.pop("best_vs_first")
    res["median_vs_no_spec"] = res.pop("median_vs_first")
    return {"path": save_json(args.out, res), **res}


if __name__ == "__main__":
    main()
