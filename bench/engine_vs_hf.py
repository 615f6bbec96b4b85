"""Tandem against HF transformers: `make bench`'s CPU comparison, and figure 1's HF baselines
(`load_hf`, `hf_generate`, `run_hf`, `hf_compiled`).

The CPU comparison: decode throughput of tandem's `Engine.generate` vs HF `generate` in one
process, one run, same prompts and weights (the embedded SmolLM2-135M-Instruct, fp32, CPU), so
HF is a same-run baseline. Greedy decoding of exactly --max-tokens tokens per prompt, EOS
ignored on both sides. Writes JSON (default bench/results/engine_vs_hf_cpu.json):

    .venv/bin/python -m bench.engine_vs_hf [--max-tokens 64] [--out PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch
from tqdm import tqdm

from bench.common import first_diff, log, rnd
from engine import Engine, SamplingParams
from engine.loader import resolve

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a haiku about a lighthouse in winter.",
    "List five tips for writing clean Python code.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
    "Give me a recipe for a quick vegetarian pasta dinner.",
]
WARMUP = ["Say hello and introduce yourself.", "Name three colours."]
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "engine_vs_hf_cpu.json")


def machine_info(device: str) -> dict:
    import transformers

    return {
        "platform": platform.platform(), "machine": platform.machine(),
        "processor": platform.processor(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "torch_num_threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "device": device,
    }


def load_hf(model: str | None = None, dtype=torch.float32, device: str = "cpu"):
    """HF's model of the checkpoint tandem loads for `model` (None: the embedded SmolLM2)."""
    import transformers  # on first use: `tandem bench` imports this module to build its parser

    ck = resolve(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ck.folder, dtype=dtype, **ck.hf_kwargs()).to(device).eval()
    # Never stop on EOS, so HF, like tandem with ignore_eos, takes the argmax at every step
    # (min_new_tokens would mask EOS instead, which changes the greedy path).
    hf.generation_config.eos_token_id = None
    return hf


def hf_generate(model, ids: list[int], n: int, **kw) -> tuple[list[int], float, float]:
    """HF `generate`, greedy, exactly n tokens after `ids` at batch 1 (`kw`: more of its
    arguments): the tokens, the wall seconds and the process CPU seconds it took."""
    x = torch.tensor([ids], device=model.device)
    # Explicit mask: otherwise HF infers one from pad_token_id (= <|im_end|> here) and masks
    # the prompt's own <|im_end|> tokens out.
    mask = torch.ones_like(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)
    if x.is_cuda:
        torch.cuda.synchronize()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    toks = out[0, len(ids):].tolist()
    if len(toks) != n:
        raise RuntimeError(f"HF generated {len(toks)} tokens, expected {n}")
    return toks, dt, cpu


def run_hf(model, prompts: list[list[int]], n: int, **kw) -> dict:
    """Each prompt alone through `hf_generate`: tokens/s over all of them, each prompt's, and
    the streams (`_outs`)."""
    per, outs, secs = [], [], 0.0
    for ids in prompts:
        toks, dt, _ = hf_generate(model, ids, n, **kw)
        secs += dt
        outs.append(toks)
        per.append({"tokens": len(toks), "seconds": rnd(dt, 4),
                    "tokens_per_s": rnd(len(toks) / dt, 1)})
    total = sum(len(o) for o in outs)
    return {"tokens": total, "seconds": rnd(secs, 4), "tokens_per_s": rnd(total / secs, 1),
            "per_prompt": per, "_outs": outs}


def hf_compiled(model, prompts: list[list[int]], n: int) -> dict:
    """HF generate with a static cache and torch.compile(mode="reduce-overhead",
    fullgraph=True). transformers compiles the decode step itself when the cache is static
    (prefill stays eager); that built-in path is tried first, then the manual
    `model.forward = torch.compile(...)` recipe, then the built-in path without fullgraph.
    The result names the path that ran and keeps the errors of those that failed."""
    import transformers

    longest = max(prompts, key=len)

    def auto(fullgraph: bool):
        model.__dict__.pop("_compiled_call", None)
        cc = transformers.CompileConfig(fullgraph=fullgraph, mode="reduce-overhead")
        return (dict(cache_implementation="static", compile_config=cc),
                lambda: model.__dict__.pop("_compiled_call", None))

    def manual():
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        return (dict(cache_implementation="static", disable_compile=True),
                lambda: model.__dict__.pop("forward", None))

    attempts = [
        ("transformers auto-compile: cache_implementation='static', "
         "CompileConfig(fullgraph=True, mode='reduce-overhead')", lambda: auto(True)),
        ("manual: model.forward = torch.compile(model.forward, mode='reduce-overhead', "
         "fullgraph=True), cache_implementation='static', disable_compile=True", manual),
        ("transformers auto-compile: cache_implementation='static', "
         "CompileConfig(fullgraph=False, mode='reduce-overhead')", lambda: auto(False)),
    ]
    errors = []
    for how, setup in attempts:
        undo = None
        try:
            kw, undo = setup()
            log(f"fig 1: HF compiled ({how[:60]}...): compiling on the longest prompt")
            t0 = time.perf_counter()
            # Longest prompt first: the static cache keeps the largest size seen, so timed
            # calls reuse its shape and do not recompile.
            hf_generate(model, longest, n, **kw)
            compile_s = time.perf_counter() - t0
            if "compile_config" in kw and "_compiled_call" not in model.__dict__:
                # transformers skips compilation silently when its criteria are not met
                raise RuntimeError("transformers did not compile the decode step")
            # A second prompt length: where the prefill is compiled too (the manual recipe),
            # dynamo recompiles once with dynamic shapes here rather than in a timed call.
            hf_generate(model, longest[:-1], n, **kw)
            hf_generate(model, longest, n, **kw)
            r = run_hf(model, prompts, n, **kw)
            r["method"] = how
            r["warmup_compile_seconds"] = rnd(compile_s, 1)
            if errors:
                r["earlier_attempts_failed"] = errors
            log(f"fig 1: HF compiled {r['tokens_per_s']} tok/s")
            return r
        except Exception:  # noqa: BLE001
            errors.append(f"{how}:\n{traceback.format_exc()}")
            log(f"fig 1: HF compiled attempt failed: {how[:60]}...")
            if undo is not None:
                undo()
            torch._dynamo.reset()
    return {"error": "\n\n".join(errors)}


def tandem_run(eng: Engine, prompts: list[list[int]], params: SamplingParams):
    t0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(len(c.token_ids) == params.max_tokens for c in outs), "short tandem completion"
    return outs, dt, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep tandem's prefix cache on (off by default: HF has none)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.max_tokens
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} on {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads", flush=True)
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        print("warning: the machine is busy; multi-threaded figures will be noisy", flush=True)

    print("loading tandem engine ...", flush=True)
    eng = Engine.from_pretrained(None, enable_prefix_caching=args.prefix_caching)
    print("loading HF model ...", flush=True)
    hf = load_hf()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    chat = lambda text: eng.tokenizer.apply_chat([{"role": "user", "content": text}])
    prompts = [chat(p) for p in PROMPTS]

    print("warming up ...", flush=True)
    hf_generate(hf, chat(WARMUP[0]), n)
    tandem_run(eng, [chat(WARMUP[0])], params)
    tandem_run(eng, [chat(w) for w in WARMUP], params)  # a batch > 1, for the batched mode

    # (a) single stream, batch 1. HF and tandem alternate who goes first, so slow drift in
    # background load on the machine hits both sides alike.
    rows = []
    for i, ids in enumerate(tqdm(prompts, desc="single-stream", unit="prompt")):
        if i % 2 == 0:
            hf_toks, hf_s, hf_cpu = hf_generate(hf, ids, n)
            (tc,), t_s, t_cpu = tandem_run(eng, [ids], params)
        else:
            (tc,), t_s, t_cpu = tandem_run(eng, [ids], params)
            hf_toks, hf_s, hf_cpu = hf_generate(hf, ids, n)
        rows.append({
            "prompt": PROMPTS[i], "prompt_tokens": len(ids), "generated_tokens": n,
            "hf_seconds": hf_s, "hf_cpu_seconds": hf_cpu, "hf_tok_s": n / hf_s,
            "tandem_seconds": t_s, "tandem_cpu_seconds": t_cpu, "tandem_tok_s": n / t_s,
            "ratio_tandem_over_hf": hf_s / t_s, "tandem_cached_tokens": tc.cached_tokens,
            "greedy_identical": tc.token_ids == hf_toks,
            "first_divergence": first_diff(tc.token_ids, hf_toks),
            "tandem_text": tc.text, "hf_text": eng.tokenizer.decode(hf_toks),
            "_tandem_ids": tc.token_ids,
        })

    # (b) tandem batched: every prompt in one eng.generate call (continuous batching).
    print(f"tandem batched ({len(prompts)} prompts at once) ...", flush=True)
    outs, b_s, b_cpu = tandem_run(eng, prompts, params)
    for r, c in zip(rows, outs):
        r["batched_matches_single"] = c.token_ids == r.pop("_tandem_ids")

    total = n * len(prompts)
    hf_total = sum(r["hf_seconds"] for r in rows)
    t_total = sum(r["tandem_seconds"] for r in rows)
    hf_tps, t_tps, b_tps = total / hf_total, total / t_total, total / b_s
    hf_cpu = sum(r["hf_cpu_seconds"] for r in rows)
    t_cpu = sum(r["tandem_cpu_seconds"] for r in rows)
    result = {
        "benchmark": "engine_vs_hf",
        "command": sys.argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(eng.config.device),
        "load_average_start_end": [list(load_start), list(os.getloadavg())],
        "config": {
            "model": eng.config.model.name, "dtype": str(eng.config.dtype).removeprefix("torch."),
            "max_tokens": n, "num_prompts": len(prompts), "decoding": "greedy, EOS ignored",
            "tandem_prefix_caching": args.prefix_caching,
            "tokens_per_s": "generated tokens / wall time of the generate call (prefill included)",
        },
        "single_stream": {
            "hf_tok_s": hf_tps, "tandem_tok_s": t_tps,
            "ratio_tandem_over_hf": t_tps / hf_tps,
            "hf_seconds_total": hf_total, "tandem_seconds_total": t_total,
            # process CPU time: less sensitive than wall time to other load on a shared machine
            "hf_cpu_seconds_total": hf_cpu, "tandem_cpu_seconds_total": t_cpu,
            "ratio_tandem_over_hf_by_cpu_time": hf_cpu / t_cpu,
            "per_prompt_ratio_mean": sum(r["ratio_tandem_over_hf"] for r in rows) / len(rows),
            "greedy_identical": sum(r["greedy_identical"] for r in rows),
        },
        "tandem_batched": {
            "batch_size": len(prompts), "seconds": b_s, "cpu_seconds": b_cpu, "tok_s": b_tps,
            "ratio_over_hf_batch1_sequential": b_tps / hf_tps,
            "note": "HF measured at batch 1 only; this ratio is not like-for-like",
        },
        "per_prompt": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")

    print(f"\n{'prompt':<44} {'HF tok/s':>9} {'tandem':>9} {'ratio':>6} {'same':>5}")
    for r in rows:
        print(f"{r['prompt'][:44]:<44} {r['hf_tok_s']:9.2f} {r['tandem_tok_s']:9.2f} "
              f"{r['ratio_tandem_over_hf']:6.2f} {'yes' if r['greedy_identical'] else 'no':>5}")
    print(f"{'single stream, all prompts':<44} {hf_tps:9.2f} {t_tps:9.2f} {t_tps / hf_tps:6.2f}")
    print(f"single stream ratio by process CPU time: {hf_cpu / t_cpu:.2f}")
    print(f"tandem batched x{len(prompts)}: {b_tps:.2f} tok/s "
          f"({b_tps / hf_tps:.2f}x HF batch-1 sequential; not like-for-like)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
