"""EAGLE-3 heads compared by acceptance alone: greedy speculative decoding at fixed K with the
head's own drafts (context drafts off), every head on the same prompts. Sets: the first
--held-out base held-out prompts; the held-out documentation prompts none of whose names the
heads' training prompts mention (`prompt_sets.unseen`, training sets from --trained-on); and
the first --per-prompt held-out prompts one at a time. Runs on the CPU (fp32) as well.

The prompt sets are the kept ones (`assets/prompt_sets.json.gz`), the same on every machine:
the first held-out prompts are figure 1's, and the unseen set is unseen by the training
prompts the heads were trained on (as --trained-on names them: 'base', 'extended', ':N' for
a --num-prompts cap, '+name-split' for --name-split).

    python -m bench.head_acceptance --heads assets/eagle3-smollm2-135m-instruct,OLD_HEAD \\
        --out bench/results/profile/head_acceptance.json
"""

from __future__ import annotations

import argparse
import platform
import time

from bench.common import command_line, environment, log, model_arguments, model_defaults, save_json

SHIPPED = "assets/eagle3-smollm2-135m-instruct"


def training_prompts(spec: str) -> list[str]:
    """'base' or 'extended', optionally ':N' (the --num-prompts cap) and '+name-split'
    (--name-split): that set's training side."""
    from cluster import prompt_sets

    spec, split, rest = spec.partition("+")
    if split and rest != "name-split":
        raise SystemExit(f"--trained-on: unknown option +{rest!r} (+name-split)")
    name, _, cap = spec.partition(":")
    if name not in ("base", "extended"):
        raise SystemExit(f"--trained-on: unknown prompt set {name!r} (base or extended)")
    return prompt_sets.build(int(cap) if cap else None, extended=name == "extended",
                             name_split=bool(split))[0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--heads", default=None,
                   help="comma-separated head folders (default: --head, else the shipped one)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--per-prompt", type=int, default=4)
    p.add_argument("--trained-on", default="base,extended:3500",
                   help="the heads' training sets, for the unseen set (the shipped head's)")
    p.add_argument("--out", default="bench/results/profile/head_acceptance.json")
    args = p.parse_args(argv)
    model_defaults(args)

    import torch

    from bench.common import load_smol
    from cluster import prompt_sets
    from cluster.train_eagle3 import _head_backend, engine_acceptance
    from engine.spec.eagle3 import load_head

    _, held = prompt_sets.build()
    unseen = prompt_sets.unseen(held, *(training_prompts(s)
                                        for s in args.trained_on.split(",")))
    sets = {f"held_out_{args.held_out}": held[: args.held_out], f"unseen_{len(unseen)}": unseen}
    sets.update({f"held_out_prompt_{i + 1}": [held[i]] for i in range(args.per_prompt)})
    base = load_smol(args, spec=None)
    res = {"name": "head_acceptance", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "k": args.k, "tokens": args.tokens, "trained_on": args.trained_on,
           "python": platform.python_version(),
           "prompts": sets, "heads": {}}
    dtype = getattr(torch, args.dtype)
    for folder in (args.heads or args.head or SHIPPED).split(","):
        head = load_head(folder, base.config.model, _head_backend(base.config.block_size),
                         dtype, args.device)
        res["heads"][folder] = got = {}
        for name, prompts in sets.items():
            got[name] = engine_acceptance(base, head, prompts, args.k, args.tokens)
            log(f"{folder} {name}: {got[name]['acceptance_length']}")
    save_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
