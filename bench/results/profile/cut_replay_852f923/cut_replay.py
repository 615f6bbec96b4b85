"""Replay: fixed K=7 with the verify cut where the head's cumulative draft probability
falls below tau (dead rows and drafts priced as absent), priced on the H200's fused costs."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 4)))
import argparse

from bench import draft_oracle as do  # noqa: E402
from bench.common import model_arguments, replay_engine, torch_dtype  # noqa: E402

p = argparse.ArgumentParser()
model_arguments(p)
p.add_argument("--costs", default="bench/results/profile/fused_costs_784d963/fused_costs.json")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--other", type=int, default=0)
p.add_argument("--out", default="/tmp/cut_replay.json")
args = p.parse_args()
from dataclasses import replace  # noqa: E402

from cluster import prompt_sets  # noqa: E402
from cluster.train_eagle3 import self_distill  # noqa: E402
from engine import Engine  # noqa: E402
from engine.config import SpecConfig  # noqa: E402

K = 7
base = replay_engine(args)
spec = Engine(replace(base.config, spec=SpecConfig(num_tokens=K)), weights_of=base)
head = spec.spec.head.eval()
max_n = spec.config.spec.ngram_max
min_n = spec.config.spec.context_min_n
_, held = prompt_sets.build()
prompts = held[: args.prompts] + held[args.prompts : args.prompts + args.other]
t0 = time.time()
recs = self_distill(
    base, prompts, 256, head.cfg.aux_layer_ids, torch_dtype(args), desc="x", ignore_eos=True
)
print("distil", time.time() - t0, flush=True)
plain, cost = do.step_prices(args.costs)
lvl = do.every_level(cost)
reps = []
for r in recs:
    ids = r.ids.tolist()
    chains, pr = do.head_chains(head, base.model, r, K)  # (its own copy of this at 852f923)
    ctx = do.context_copies(ids, r.prompt_len, K, max_n)
    reps.append((ids, r.prompt_len, chains, pr, ctx))
res = {}
for tau in [0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5]:
    for floor in [0, 1, 2]:
        t = toks = 0.0
        steps = 0
        rows = 0
        for ids, plen, chains, pr, ctx in reps:
            n = plen + 1
            toks += len(ids) - n
            while n < len(ids):
                m, cd = ctx[n]
                if m >= min_n:
                    c = K
                    acc = do.lead(cd[:K], ids, n)
                else:
                    cum, c = 1.0, 0
                    for j in range(K):
                        cum *= pr[n - 2][j]
                        if cum < tau and j >= floor:
                            break
                        c += 1
                    acc = do.lead(chains[n - 2][:c], ids, n)
                d = min(c + 1, K)
                t += lvl[(c + 1, d)]
                rows += c + 1
                steps += 1
                n += 1 + acc
        res[f"tau{tau}_floor{floor}"] = {
            "speed": round(toks * plain / t, 3),
            "acceptance": round(toks / steps, 3),
            "rows": round(rows / steps, 2),
        }
        print(tau, floor, res[f"tau{tau}_floor{floor}"], flush=True)
json.dump(res, open(args.out, "w"), indent=1)
