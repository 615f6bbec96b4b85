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

from bench.common import eagle
from bench.turns import run_turns, turn_arguments

LOOPS = "engine.spec.ngram.CONTINUE_LOOPS"


def variants(args) -> dict:
    """No-spec, then each context variant with copies continued and cut. (The device
    lookup's flag is baked into each engine's graphs at its first turn.)"""
    out = {"no_spec loops=on": (None, {LOOPS: True})}
    for name, spec in (("eagle3_dynamic_k7_context", eagle(args, 7, True, True)),
                       ("eagle3_k5_context", eagle(args, 5, False, True)),
                       ("eagle3_k7_context", eagle(args, 7, False, True))):
        for loops in (True, False):
            out[f"{name} loops={'on' if loops else 'off'}"] = (spec, {LOOPS: loops})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(p, "bench/results/profile/loop_copies.json", reps=2)
    return run_turns("loop_copies", p.parse_args(argv), variants)


if __name__ == "__main__":
    main()
