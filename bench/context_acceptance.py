"""Acceptance length of EAGLE-3 with and without context drafts (`SpecConfig.context_drafts`),
at fixed K, on figure 1's prompts (EOS ignored, as figure 1 runs them) and on other held-out
prompts (stopping at EOS). CPU or GPU; writes one JSON.

    python -m bench.context_acceptance --out bench/results/profile/context_acceptance.json

Acceptance length is tokens per verify (drafts accepted + the target's own token), the
quantity speculation's speed scales with; it does not depend on batching.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from bench.common import (
    command_line,
    environment,
    held_out_messages,
    log,
    model_arguments,
    replay_engine,
    save_json,
)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--fig1-prompts", type=int, default=4)
    p.add_argument("--other-prompts", type=int, default=12)
    p.add_argument("--min-n", default="off,3,2,4",
                   help="comma list: off (head alone) or context_min_n values")
    p.add_argument("--out", default="bench/results/profile/context_acceptance.json")
    args = p.parse_args(argv)

    from engine import Engine, SamplingParams
    from engine.config import SpecConfig

    base = replay_engine(args)
    sets = {"fig1": (held_out_messages(args.fig1_prompts, 0), True),
            "other": (held_out_messages(args.other_prompts, args.fig1_prompts), False)}
    res = {"name": "context_acceptance", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "k": args.k, "max_tokens": args.tokens, "runs": []}
    head = None
    for mode in args.min_n.split(","):
        extra = ({"context_drafts": False} if mode == "off"
                 else {"context_drafts": True, "context_min_n": int(mode)})
        spec = SpecConfig(num_tokens=args.k, dynamic=False, head=args.head, **extra)
        for name, (msgs, ignore_eos) in sets.items():
            eng = Engine(replace(base.config, spec=spec), weights_of=base, draft_head=head)
            head = eng.spec.head
            t = time.perf_counter()
            outs = eng.generate(msgs, SamplingParams(temperature=0, max_tokens=args.tokens,
                                                     ignore_eos=ignore_eos))
            st = eng.spec.stats
            run = {"context_min_n": None if mode == "off" else int(mode), "prompts": name,
                   "num_prompts": len(msgs), "ignore_eos": ignore_eos,
                   "acceptance_length": round(st.acceptance_length, 4),
                   "verify_steps": st.verify_steps,
                   "tokens": sum(len(o.token_ids) for o in outs),
                   "seconds": round(time.perf_counter() - t, 1)}
            res["runs"].append(run)
            log(f"context_min_n={mode} {name}: acceptance {run['acceptance_length']}")
    return {"path": save_json(args.out, res), **res}


if __name__ == "__main__":
    main()
