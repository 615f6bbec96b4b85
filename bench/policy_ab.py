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

from bench.common import eagle
from bench.turns import run_turns, turn_arguments

FRESH, FIT = "engine.spec.policy.LOSING_FRESH", "engine.spec.policy.FIT_SWITCHES"


def variants(args) -> dict:
    from engine.spec.policy import LOSING_FRESH, StepCosts

    dyn = eagle(args, 7, True, True)
    old, new = StepCosts.STALE, LOSING_FRESH
    return {"no_spec": (None, {}), "eagle3_k5_context": (eagle(args, 5, False, True), {}),
            "dynamic now": (dyn, {FRESH: new, FIT: False}),
            "dynamic before": (dyn, {FRESH: old, FIT: True}),
            # the policy's measurements start afresh each turn, as on an engine's first
            "dynamic now reset": (dyn, {FRESH: new, FIT: False}, "reset"),
            "dynamic before reset": (dyn, {FRESH: old, FIT: True}, "reset"),
            "dynamic fresh losing only": (dyn, {FRESH: new, FIT: True}),
            "dynamic switches unfit only": (dyn, {FRESH: old, FIT: False})}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(p, "bench/results/profile/policy_ab.json", reps=3)
    p.add_argument("--traces", action="store_true",
                   help="keep every dynamic run's steps and K picks (trace, picks)")
    args = p.parse_args(argv)
    return run_turns("policy_ab", args, variants, traces=args.traces)


if __name__ == "__main__":
    main()
