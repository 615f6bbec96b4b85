"""Figure 1's single-stream runs with two EAGLE-3 heads taking turns in one process
(`bench.turns`): the shipped head (or --head) against --other (a newly trained one), each at
K=5 with its own drafts only, K=5 with context drafts, and dynamic K with context drafts (the
default), beside no-spec. Per run: tok/s, acceptance, token identity with no-spec.

    python -m bench.head_ab --model M --other HEAD --reps 3 --out bench/results/profile/head_ab.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--other", required=True, help="the head folder to compare")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--out", default="bench/results/profile/head_ab.json")
    args = p.parse_args(argv)

    model_defaults(args)
    args.prompt_offset = 0
    msgs = held_out_messages(args.prompts, 0)
    base = load_smol(args, spec=eagle(args, 5, False, False), num_blocks=args.num_blocks)
    prompts = [base.encode_prompt(m) for m in msgs]
    variants = {"no_spec": (None, {})}
    for label, head in (("shipped", args.head), ("other", args.other)):
        for name, spec in (("k5_head_only", eagle(args, 5, False, False)),
                           ("k5_context", eagle(args, 5, False, True)),
                           ("dynamic_k7_context", eagle(args, 7, True, True))):
            variants[f"{label} {name}"] = (replace(spec, head=head), {})
    res = {"name": "head_ab", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "heads": {"shipped": args.head or "the shipped head", "other": args.other},
           "prompts": len(prompts), "tokens": args.tokens, "reps": args.reps,
           **take_turns(args, base, prompts, variants, args.reps, args.num_blocks)}
    res["best_vs_no_spec"] = res.pop("best_vs_first")
    res["median_vs_no_spec"] = res.pop("median_vs_first")
    return {"path": save_json(args.out, res), **res}


if __name__ == "__main__":
    main()
