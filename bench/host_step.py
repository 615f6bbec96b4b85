"""Host cost of an engine step, the model replaced by a trivial function: what scheduling,
staging, continuation, postprocessing and emitting cost per step at a concurrency, on any
machine (no GPU needed). The decode graphs' function returns a fixed hidden state and a
token per row; prefill still runs the small random model.

    python -m bench.host_step --out DIR [--concurrency 16,64] [--steps 300] [--profile]
        [--spec-k0] [--spec-k 1,3] [--no-detok]

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

NOTE = ("model replaced by a trivial function: host work only; the text is detokenized with "
        "the embedded SmolLM2's tokenizer (the tiny model's ids are valid SmolLM2 ids), "
        "unless --no-detok")


SMOL_VOCAB = 49152


def make_engine(concurrency: int, max_tokens: int, spec_k: int | None = None,
                detok: bool = False):
    """No speculation (`spec_k` None); or an EAGLE-3 engine whose policy always drafts
    `spec_k` tokens, every draft accepted: K=0 is what a speculative engine pays per step
    when it has turned drafting off (the head's KV kept current), K>0 the host side of
    steps that verify K drafts and emit K+1 tokens per sequence. `detok`: the engine
    detokenizes with the embedded SmolLM2's tokenizer, as a served model does."""
    import torch

    from engine import Engine
    from engine.config import SpecConfig
    from tests.helpers import tiny_engine

    blocks = concurrency * (max_tokens // 4 + 4) + 64
    # With the tokenizer, SmolLM2's vocabulary size: the fake steps' ids then spread over
    # its tokens (the tiny model's first few hundred ids are mostly byte tokens, whose broken
    # characters make the detokenizer decode again and again).
    ref = tiny_engine(0, max_num_batched_tokens=4096, num_blocks=blocks,
                      attention_backend="torch", max_position=max(512, max_tokens + 64),
                      **({"vocab_size": SMOL_VOCAB} if detok else {}))
    vocab = ref.config.model.vocab_size
    tok = None
    if detok:
        from engine import loader

        tok = loader.Tokenizer.load(loader.resolve(None))
    if spec_k is None:
        eng = Engine(replace(ref.config, attention_backend="triton"), weights_of=ref,
                     tokenizer=tok)
        eng.runner.enable_graphs(max(concurrency, 1), (1,), ())

        def fake(ids, pos, meta, *extras):
            return torch.zeros(ids.shape[0], 8), (ids * 7 + 3) % vocab

        eng.runner.graphs.fn = fake
        return eng
    from bench.common import hold_at_k
    from tests.spec.test_eagle3 import random_head

    cfg = replace(ref.config, attention_backend="triton",
                  spec=SpecConfig(method="eagle3", num_tokens=7, dynamic=True))
    eng = Engine(cfg, weights_of=ref, draft_head=random_head(ref), tokenizer=tok)
    n = max(concurrency, 1)
    eng.runner.enable_graphs(n, range(1, 9), eng.spec.aux_layers)
    eng.spec.enable_graphs(n)
    hold_at_k(eng, spec_k)

    def fake(drafts: int):
        def fn(ids, pos, meta, kn_rows):
            # The target's token at each row is the draft after it: every draft accepted.
            b = meta.seq_lens.shape[0]
            grid = ids.view(b, -1)
            am = torch.cat([grid[:, 1:], (grid[:, -1:] * 7 + 3) % vocab], dim=1)
            real = meta.slot_mapping.view(b, -1) >= 0
            nacc = ((grid[:, 1:] == am[:, :-1]) & real[:, 1:]).to(torch.int64).cumprod(
                dim=1).sum(dim=1)
            if drafts == 0:
                return am.reshape(-1), nacc
            first = (am.gather(1, nacc[:, None]) * 5 + 1) % vocab
            return am.reshape(-1), nacc, (first + torch.arange(drafts)) % vocab
        return fn

    for d in eng.spec.fused.draft_levels:
        eng.spec.fused.set_for(d).fn = fake(d)
    return eng


def measure(concurrency: int, steps: int, profile: bool, spec_k: int | None = None,
            detok: bool = True) -> dict:
    from engine.sequence import SamplingParams

    per_step = 1 + (spec_k or 0)  # tokens a sequence emits a step (every draft accepted)
    tokens = (2 * steps + 40) * per_step  # the timed steps and the profiled ones all decode
    eng = make_engine(concurrency, tokens, spec_k, detok)
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
    row = {"engine": "no speculation" if spec_k is None else f"eagle3, K={spec_k} throughout",
           "concurrency": concurrency, "steps": steps,
           "us_per_step": round(min(chunks), 1),
           "us_per_step_stretches": [round(c, 1) for c in chunks],
           "overlapped_runs": eng.pipe.overlapped_runs}
    row["us_per_token"] = round(row["us_per_step"] / (concurrency * per_step), 2)
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(min(steps, 100)):
            eng.step()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        row["profile_top"] = out.getvalue().splitlines()[-32:]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/profile")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-detok", action="store_true",
                    help="no tokenizer: leave detokenizing out of the host's step")
    ap.add_argument("--spec-k0", action="store_true",
                    help="also the EAGLE-3 engine with drafting off (the fused K=0 step)")
    ap.add_argument("--spec-k", default="",
                    help="also EAGLE-3 engines at these K (comma-separated; 0: as --spec-k0), "
                         "every draft accepted")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the regular forward's kernels, off CUDA
    rows = []
    ks = [None] + ([0] if args.spec_k0 else []) + [int(k) for k in args.spec_k.split(",") if k]
    for k in ks:
        for c in args.concurrency.split(","):
            rows.append(measure(int(c), args.steps, args.profile, k, not args.no_detok))
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
