"""Experiment: how many of the target's greedy tokens the shipped EAGLE-3 head cannot draft at
all (outside its draft vocabulary), per figure-1 domain. CPU fp32, 16 held-out prompts per
domain, 128 greedy tokens (EOS ends an answer).
    .venv/bin/python -m bench.vocab_coverage bench/results/profile/draft_vocab_coverage_REV.json"""

import json
import platform
import subprocess
import sys
import time

import torch

from bench.fig1_single_stream import domain_prompts
from cluster.prompt_sets import domains
from engine import Engine, SamplingParams
from engine.config import SpecConfig


def main(out: str) -> None:
    eng = Engine.from_pretrained(None, device="cpu", dtype=torch.float32, num_blocks=4096,
                                 max_num_seqs=32)
    spec = eng.with_config(spec=SpecConfig())  # the shipped head, as engines load it
    ids = spec.spec.head.draft_to_target.cpu()
    inside = torch.zeros(eng.config.model.vocab_size, dtype=torch.bool)
    inside[ids] = True
    res = {"command": " ".join(["python -m bench.vocab_coverage", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
           "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
           "draft_vocab_size": len(ids), "domains": {}}
    params = SamplingParams(temperature=0, max_tokens=128)
    for d, msgs in domain_prompts(list(domains()), 16).items():
        outs = eng.generate([eng.encode_prompt(m) for m in msgs], params)
        toks = torch.tensor([t for o in outs for t in o.token_ids])
        res["domains"][d] = {"tokens": len(toks),
                             "in_draft_vocab": round(inside[toks].float().mean().item(), 4)}
        print(d, res["domains"][d], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
