"""Quick GPU timing on a SmolLM2-shaped random model: eager torch backend vs Triton + graphs,
single stream, with and without EAGLE-3 drafting (random weights: timing only)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from engine import SamplingParams  # noqa: E402
from engine.config import SpecConfig  # noqa: E402
from tests.engine.test_gpu_engine import smol_shape  # noqa: E402


def run(eng, n=256, reps=2):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    eng.generate([list(range(100, 140))], sp)
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        c = eng.generate([list(range(100, 140))], sp)[0]
        torch.cuda.synchronize()
        best = max(best, len(c.token_ids) / (time.perf_counter() - t))
    return best


def main():
    from engine import Engine, EngineConfig

    res = {}
    base = Engine(EngineConfig(model=smol_shape(), dtype=torch.bfloat16, device="cuda",
                               num_blocks=4096, attention_backend="torch", cuda_graphs=False))
    res["torch_eager"] = run(base)
    res["triton_eager"] = run(base.with_config(attention_backend="triton", cuda_graphs=False))
    res["triton_graphs"] = run(base.with_config(attention_backend="triton", cuda_graphs=True))
    for k in (1, 3, 5):
        e = base.with_config(attention_backend="triton", cuda_graphs=True,
                             spec=SpecConfig(num_tokens=k, dynamic=False))
        res[f"triton_graphs_eagle3_k{k}_steps_per_s"] = run(e)
    import cProfile
    import io
    import pstats

    g = base.with_config(attention_backend="triton", cuda_graphs=True,
                         spec=SpecConfig(num_tokens=3, dynamic=False))
    run(g, n=64, reps=1)
    prof = cProfile.Profile()
    prof.enable()
    run(g, n=128, reps=1)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    table = buf.getvalue()
    out = os.environ.get("OUT", ".")
    with open(f"{out}/profile.txt", "w") as f:
        f.write(table)
    print(json.dumps(res, indent=1))
    with open(f"{out}/smoke.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
