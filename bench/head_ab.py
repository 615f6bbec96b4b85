"""Figure 1's single-stream runs with two EAGLE-3 heads taking turns in one process
(`bench.turns`): the shipped head (or --head) against --other (a newly trained one), each at
K=5 with its own drafts only, K=5 with context drafts, and dynamic K with context drafts (the
default), beside no-spec. Per run: tok/s, acceptance, token identity with no-spec.

    python -m bench.head_ab --model M --other HEAD --reps 3 --out bench/results/profile/head_ab.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from bench.common import eagle
from bench.turns import run_turns, turn_arguments


def variants(args) -> dict:
    out = {"no_spec": (None, {})}
    for label, head in (("shipped", args.head), ("other", args.other)):
        for name, spec in (("k5_head_only", eagle(args, 5, False, False)),
                           ("k5_context", eagle(args, 5, False, True)),
                           ("dynamic_k7_context", eagle(args, 7, True, True))):
            out[f"{label} {name}"] = (replace(spec, head=head), {})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(p, "bench/results/profile/head_ab.json", reps=3)
    p.add_argument("--other", required=True, help="the head folder to compare")
    args = p.parse_args(argv)
    heads = {"heads": {"shipped": args.head or "the shipped head", "other": args.other}}
    return run_turns("head_ab", args, variants, heads)


if __name__ == "__main__":
    main()
