"""Speculative decoding benchmark: acceptance per draft position for K = 1..7 on held-out
prompts, and single-stream tokens/s with EAGLE-3, n-gram and no speculation, in one run.

    python bench/spec_gpu.py --head assets/eagle3-smollm2-135m-instruct \
        --out bench/results/spec_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, ".")

from cluster import prompt_sets  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.config import SpecConfig  # noqa: E402


def variant(base: Engine, spec: SpecConfig | None) -> Engine:
    head = None
    if spec is not None and spec.method == "eagle3":
        head = base.spec.head if base.spec else None
    # A fixed KV size per variant: 8192 blocks of 16 tokens holds every run here.
    return Engine(replace(base.config, spec=spec, num_blocks=8192), weights_of=base,
                  draft_head=head)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def single_stream(eng: Engine, msgs, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    eng.generate([msgs[0]], SamplingParams(temperature=0, max_tokens=16))  # warm-up
    toks, secs, outs = 0, 0.0, []
    for m in msgs:
        sync()
        t0 = time.perf_counter()
        c = eng.generate([m], params)[0]
        sync()
        secs += time.perf_counter() - t0
        toks += len(c.token_ids)
        outs.append(c.token_ids)
    st = eng.spec.stats if eng.spec else None
    return {"tokens": toks, "seconds": round(secs, 3), "tokens_per_s": round(toks / secs, 1),
            "acceptance_length": round(st.acceptance_length, 3) if st else None,
            "_outs": outs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
    ap.add_argument("--head", default=None)
    ap.add_argument("--out", default="bench/results/spec_gpu.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--accept-prompts", type=int, default=48)
    ap.add_argument("--stream-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    base = Engine.from_pretrained(args.model, device=dev, dtype=dtype, enable_prefix_caching=False,
                                  num_blocks=8192,
                                  spec=SpecConfig(head=args.head, num_tokens=5, dynamic=False))
    _, held_out = prompt_sets.build()
    msgs = [[{"role": "user", "content": p}] for p in held_out]
    res = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": {"gpu": torch.cuda.get_device_name() if dev == "cuda" else None,
                       "platform": platform.platform(), "torch": torch.__version__,
                       "python": platform.python_version()},
           "dtype": args.dtype, "attention_backend": base.config.attention_backend,
           "prompts": "held-out split of cluster/prompt_sets.py (never trained on)"}
    acc = []
    for k in range(1, 8):
        # The head's own acceptance per position: context drafts off.
        eng = variant(base, SpecConfig(head=args.head, num_tokens=k, dynamic=False,
                                       context_drafts=False))
        eng.generate(msgs[: args.accept_prompts],
                     SamplingParams(temperature=0, max_tokens=args.max_tokens))
        st = eng.spec.stats
        acc.append({"k": k, "acceptance_length": round(st.acceptance_length, 3),
                    "accept_rate_per_pos": [round(a / max(d, 1), 4) for a, d in
                                            zip(st.accepted_per_pos, st.drafted_per_pos)],
                    "verify_steps": st.verify_steps})
        print(json.dumps(acc[-1]), flush=True)
    res["acceptance"] = acc
    stream = msgs[args.accept_prompts : args.accept_prompts + args.stream_prompts]
    runs = {"no_spec": None,
            "eagle3_k5": SpecConfig(head=args.head, num_tokens=5, dynamic=False),
            "eagle3_dynamic": SpecConfig(head=args.head, num_tokens=7, dynamic=True),
            "ngram_k5": SpecConfig(method="ngram", num_tokens=5, dynamic=False)}
    single = {}
    for name, spec in runs.items():
        single[name] = single_stream(variant(base, spec), stream, args.max_tokens)
        print(name, {k: v for k, v in single[name].items() if k != "_outs"}, flush=True)
    ref = single["no_spec"].pop("_outs")
    for name in runs:
        if name == "no_spec":
            continue
        outs = single[name].pop("_outs")
        single[name]["speedup_vs_no_spec"] = round(
            single[name]["tokens_per_s"] / single["no_spec"]["tokens_per_s"], 3)
        single[name]["greedy_identical_to_no_spec"] = sum(a == b for a, b in zip(outs, ref))
        single[name]["streams"] = len(ref)
    res["single_stream"] = single
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(single, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
