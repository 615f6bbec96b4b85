"""Host cost of an engine step, the model replaced by a trivial function: what scheduling,
staging, continuation, postprocessing and emitting cost per step at a concurrency, on any
machine (no GPU needed). The decode graphs' function returns a fixed hidden state and a
token per row; prefill still runs the small random model.

    python -m bench.host_step --out DIR [--concurrency 16,64] [--steps 300] [--profile]
        [--spec-k0]

Writes DIR/host_step.json: microseconds per step per concurrency (and with --profile the
top functions by own time, under cProfile, which inflates the absolute numbers)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import time
from dataclasses import replace

NOTE = ("model replaced by a trivial function: host work only; the tiny test model has no "
        "tokenizer, so detokenizing (about 1.6 us a token with SmolLM2's) is not in these "
        "numbers")


def make_engine(concurrency: int, max_tokens: int, spec_k0: bool = False):
    """No speculation; or (`spec_k0`) an EAGLE-3 engine whose dynamic policy drafts nothing,
    so every step is the fused K=0 step: what a speculative engine pays per step when it has
    turned drafting off (the head's KV kept current), against the plain step."""
    import torch

    from engine import Engine
    from engine.config import SpecConfig
    from tests.helpers import tiny_engine

    blocks = concurrency * (max_tokens // 4 + 4) + 64
    ref = tiny_engine(0, max_num_batched_tokens=4096, num_blocks=blocks,
                      attention_backend="torch")
    vocab = ref.config.model.vocab_size
    if not spec_k0:
        eng = Engine(replace(ref.config, attention_backend="triton"), weights_of=ref)
        eng.runner.enable_graphs(max(concurrency, 1), (1,), ())

        def fake(ids, pos, meta, *extras):
            return torch.zeros(ids.shape[0], 8), (ids * 7 + 3) % vocab

        eng.runner.graphs.fn = fake
        return eng
    from bench.common import hold_at_k0
    from tests.spec.test_eagle3 import random_head

    cfg = replace(ref.config, attention_backend="triton",
                  spec=SpecConfig(method="eagle3", num_tokens=7, dynamic=True))
    eng = Engine(cfg, weights_of=ref, draft_head=random_head(ref))
    n = max(concurrency, 1)
    eng.runner.enable_graphs(n, range(1, 9), eng.spec.aux_layers)
    eng.spec.enable_graphs(n)
    hold_at_k0(eng)

    def fake0(ids, pos, meta, kn_rows):
        return (ids * 7 + 3) % vocab, torch.zeros(meta.seq_lens.shape[0], dtype=torch.int64)

    eng.spec.fused.set_for(0).fn = fake0
    return eng


def measure(concurrency: int, steps: int, profile: bool, spec_k0: bool = False) -> dict:
    from engine.sequence import SamplingParams

    tokens = 2 * steps + 40  # the timed steps and the profiled ones all decode
    eng = make_engine(concurrency, tokens, spec_k0)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(concurrency):
        eng.add_request([1 + i % 50, 2, 3, 4], sp)
    for _ in range(5):  # prefill and the first decode steps
        eng.step()
    # The fastest of 5 equal stretches: a shared 2-core machine adds noise, never speed.
    chunks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps // 5):
            eng.step()
        chunks.append((time.perf_counter() - t0) / (steps // 5) * 1e6)
    row = {"engine": "eagle3, K=0 throughout" if spec_k0 else "no speculation",
           "concurrency": concurrency, "steps": steps,
           "us_per_step": round(min(chunks), 1),
           "us_per_step_stretches": [round(c, 1) for c in chunks],
           "overlapped_runs": eng.pipe.overlapped_runs}
    row["us_per_token"] = round(row["us_per_step"] / concurrency, 2)
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(min(steps, 100)):
            eng.step()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(15)
        row["profile_top"] = out.getvalue().splitlines()[-22:]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/profile")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--spec-k0", action="store_true",
                    help="also the EAGLE-3 engine with drafting off (the fused K=0 step)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the regular forward's kernels, off CUDA
    rows = []
    for k0 in (False, True) if args.spec_k0 else (False,):
        for c in args.concurrency.split(","):
            rows.append(measure(int(c), args.steps, args.profile, k0))
            r = rows[-1]
            print(f"{r['engine']}, {r['concurrency']} streams: {r['us_per_step']} us/step "
                  f"({r['us_per_token']} us/token)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    res = {"command": "python -m bench.host_step " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "note": NOTE, "runs": rows}
    path = os.path.join(args.out, "host_step.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
