"""`tandem bench`: the benchmark figures, each a ratio against a baseline measured in the same run.

    tandem bench --figures 1,2,3 --model /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m bench.suite --figures 1,2,3,4 --out bench/results       # the same, from the repo root

Figures (one JSON per figure in --out, `figN_<name>.json`, plus a PNG when matplotlib imports):

1. single_stream  SmolLM2 single-stream tokens/s: tandem without speculation, EAGLE-3 (fixed K
                  and dynamic K), n-gram, HF `generate` eager and HF static cache + torch.compile.
2. llama8b_shape  random-weight Llama-3.1-8B-shaped engine: HBM bandwidth measured here, decode
                  step vs the weight-read floor, verify cost (K+1 tokens vs 1), batch 1..64.
3. concurrency    SmolLM2 throughput vs concurrent streams, speculation vs none.
4. kv_transfer    KV movement between two GPUs: peer copy, the in-process transport, UCX.
5. itl_disagg     P50/P99 inter-token latency of running decodes while long prompts arrive:
                  one engine (colocated) vs a decode engine on GPU 0 and a prefill engine in its
                  own process on GPU 1, the KV shipped over UCX as the nodes do.

Every figure records the command line, date, GPU, library versions and every number; a figure
that raises records its traceback and the next one still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/suite.py` and the `tandem` entry point
    sys.path.insert(0, ROOT)

from bench.common import (  # noqa: E402 - after the sys.path fix above
    _torch,
    acceptance,
    apply_settings,
    decode_path,
    eagle,
    first_diff,
    free_memory,
    head_summary,
    header,
    held_out_messages,
    host_probe_us,
    is_cuda,
    llama8b_shape,
    load_smol,
    log,
    ngram,
    paths_delta,
    precapture,
    random_engine,
    ratio,
    rnd,
    save,
    spec_counts,
    spec_fields,
    start_trace,
    step_costs,
    step_paths,
    sync,
    take_trace,
    timed_ms,
    torch_dtype,
)
from bench.fig5 import fig_itl_disagg, plot_itl  # noqa: E402
from engine.loader import shipped_head  # noqa: E402

# Figure 5 lives in bench/fig5.py, the helpers every figure shares in bench/common.py.


# ---- figure 1: single stream -------------------------------------------------------------


def run_single(args, eng, msgs, n: int) -> dict:
    """Each prompt alone at batch 1, n tokens, EOS ignored; tokens/s = tokens / wall time of
    the generate call (prefill included)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    note = precapture(eng, (1,))
    # Warm-up: the full length on a prompt not in the timed set (Triton JIT, lazy graphs),
    # then each timed prompt alone for a few tokens: a prompt length not seen before may
    # compile prefill and head kernels (a first prompt once ran at a third of the others'
    # speed). Prefix caching is off here, so this leaves the timed runs nothing to reuse.
    eng.generate(held_out_messages(1, offset=len(msgs) + args.prompt_offset + 7), params)
    for m in msgs:
        eng.generate([m], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    before, paths = spec_counts(eng), step_paths(eng)
    per, outs, secs = [], [], 0.0
    for m in msgs:
        sync(args)
        t0 = time.perf_counter()
        c = eng.generate([m], params)[0]
        sync(args)
        dt = time.perf_counter() - t0
        secs += dt
        outs.append(c.token_ids)
        per.append({"tokens": len(c.token_ids), "seconds": rnd(dt, 4),
                    "tokens_per_s": rnd(len(c.token_ids) / dt, 1)})
    toks = sum(len(o) for o in outs)
    return {"tokens": toks, "seconds": rnd(secs, 4), "tokens_per_s": rnd(toks / secs, 1),
            "acceptance_length": acceptance(before, spec_counts(eng)), "per_prompt": per,
            # how the timed steps ran: fused / overlapped, and dynamic K's picks and reasons
            "paths": paths_delta(paths, step_paths(eng)), "graphs": note, "_outs": outs}


def load_hf(args):
    import transformers

    from engine import loader

    ck = loader.resolve(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ck.folder, dtype=torch_dtype(args), **ck.hf_kwargs()).to(args.device).eval()
    # Never stop on EOS, like tandem's ignore_eos: HF takes the argmax at every step.
    model.generation_config.eos_token_id = None
    return model


def hf_generate(args, model, ids: list[int], n: int, **kw) -> tuple[list[int], float]:
    torch = _torch()
    x = torch.tensor([ids], device=args.device)
    sync(args)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                             do_sample=False, **kw)
    sync(args)
    dt = time.perf_counter() - t0
    toks = out[0, len(ids):].tolist()
    if len(toks) != n:
        raise RuntimeError(f"HF generated {len(toks)} tokens, expected {n}")
    return toks, dt


def run_hf(args, model, prompts: list[list[int]], n: int, **kw) -> dict:
    per, outs, secs = [], [], 0.0
    for ids in prompts:
        toks, dt = hf_generate(args, model, ids, n, **kw)
        secs += dt
        outs.append(toks)
        per.append({"tokens": len(toks), "seconds": rnd(dt, 4),
                    "tokens_per_s": rnd(len(toks) / dt, 1)})
    total = sum(len(o) for o in outs)
    return {"tokens": total, "seconds": rnd(secs, 4), "tokens_per_s": rnd(total / secs, 1),
            "per_prompt": per, "_outs": outs}


def fig_single_stream(args, res: dict) -> None:
    from engine.config import SpecConfig

    n = args.fig1_tokens
    msgs = held_out_messages(args.fig1_prompts, args.prompt_offset)
    res["config"] = {"prompts": len(msgs), "max_tokens": n, "ignore_eos": True,
                     "greedy": True, "prefix_caching": False, "num_blocks": args.num_blocks,
                     "prompt_source": "held-out split of cluster/prompt_sets.py",
                     "tokens_per_s": "generated tokens / wall time of each generate call, "
                                     "prefill included, one prompt at a time"}
    log("fig 1: loading SmolLM2 + EAGLE-3 head")
    base = load_smol(args, spec=eagle(args, 5, False))
    res["config"]["model"] = base.config.model.name
    res["config"]["eagle3_head"] = head_summary(args.head or shipped_head(base.config.model))
    res["config"]["attention_backend"] = base.config.backend_name
    res["config"]["cuda_graphs"] = base.config.use_cuda_graphs
    res["config"]["prologue_rows"] = sorted(base.model.prologue_rows) \
        if base.model.prologue_linears else []
    res["config"]["prologue_calibration_us"] = base.model.prologue_calibration
    prompts = [base.encode_prompt(m) for m in msgs]
    res["config"]["prompt_tokens"] = [len(p) for p in prompts]
    # HF's baselines generate the first prompts only (eager runs ~19 tok/s on the H200):
    # their rate, beside tandem's over all of them
    hf_prompts = prompts[:args.fig1_hf_prompts or None]
    res["config"]["hf_prompts"] = len(hf_prompts)
    dyn = f"eagle3_dynamic_k{args.dynamic_k}"
    variants = {"no_spec": None, "eagle3_k5": eagle(args, 5, False, False),
                "eagle3_k7": eagle(args, 7, False, False),
                dyn: eagle(args, args.dynamic_k, True, False),
                "eagle3_k5_context": eagle(args, 5, False, True),
                "eagle3_k7_context": eagle(args, 7, False, True),
                f"{dyn}_context": eagle(args, args.dynamic_k, True, True),
                "ngram_k5": ngram(5)}
    # What an engine runs without a SpecConfig of its own (dynamic K at most 5, context
    # drafts), where --dynamic-k asks for another K
    k_default = SpecConfig().num_tokens
    default = f"eagle3_dynamic_k{k_default}_context"
    if default not in variants:
        variants[default] = eagle(args, k_default, True, True)
    res["config"]["engine_default"] = default
    runs: dict[str, dict] = {}
    res["tandem"] = runs
    for name, spec in variants.items():
        log(f"fig 1: tandem {name}")
        try:
            eng = base.with_config(spec=spec, num_blocks=args.num_blocks)
            runs[name] = run_single(args, eng, prompts, n)
        except Exception:  # noqa: BLE001 - one variant failing leaves the others
            runs[name] = {"error": traceback.format_exc()}
        eng = None
        free_memory()
        log(f"fig 1: tandem {name}: {runs[name].get('tokens_per_s')} tok/s, "
            f"acceptance {runs[name].get('acceptance_length')}")
    base = None
    free_memory()
    hf: dict[str, dict] = {}
    res["hf"] = hf
    try:
        log("fig 1: loading the HF model")
        model = load_hf(args)
        log("fig 1: HF generate, eager (dynamic cache)")
        hf["eager"] = run_hf(args, model, hf_prompts, n)
        log(f"fig 1: HF eager {hf['eager']['tokens_per_s']} tok/s")
    except Exception:  # noqa: BLE001
        hf["eager"] = {"error": traceback.format_exc()}
        model = None
    outs = {name: r.pop("_outs", None) for name, r in runs.items()}
    outs.update({f"hf_{k}": r.pop("_outs", None) for k, r in hf.items()})
    single_stream_ratios(res, outs)
    if model is not None and is_cuda(args) and not args.no_hf_compile:
        # Compiling can take minutes: keep what is measured so far if the run dies here.
        save(args.out, dict(res, partial="HF static cache + torch.compile still running"))
        hf["compiled"] = hf_compiled(args, model, hf_prompts, n)
        outs["hf_compiled"] = hf["compiled"].pop("_outs", None)
    elif model is not None:
        hf["compiled"] = {"skipped": "--no-hf-compile" if args.no_hf_compile else
                          "torch.compile reduce-overhead (CUDA graphs) needs CUDA"}
    model = None
    free_memory()
    single_stream_ratios(res, outs)
    res["note"] = ("greedy identity with speculation is informational: verify (K+1 queries) "
                   "and decode (1 query) may round differently in bf16")


def single_stream_ratios(res: dict, outs: dict) -> None:
    """Every run against tandem without speculation and against both HF baselines; token
    identity of each run's streams with tandem's no-speculation streams."""
    runs, hf = res["tandem"], res["hf"]
    ref = outs.get("no_spec")
    hf_ref = hf.get("compiled", {}).get("tokens_per_s")
    eager_ref = hf.get("eager", {}).get("tokens_per_s")
    nospec = runs.get("no_spec", {}).get("tokens_per_s")
    for name, r in list(runs.items()) + [(f"hf_{k}", v) for k, v in hf.items()]:
        if "tokens_per_s" not in r:
            continue
        r["vs_tandem_no_spec"] = ratio(r["tokens_per_s"], nospec)
        r["vs_hf_compiled"] = ratio(r["tokens_per_s"], hf_ref)
        r["vs_hf_eager"] = ratio(r["tokens_per_s"], eager_ref)
        mine = outs.get(name)
        if ref is not None and mine is not None and name != "no_spec":
            r["streams"] = min(len(mine), len(ref))
            r["token_identical_to_no_spec"] = sum(a == b for a, b in zip(mine, ref))
            r["first_divergence"] = [first_diff(a, b) for a, b in zip(mine, ref)]
    best_eagle = max((r.get("vs_tandem_no_spec") or 0 for k, r in runs.items()
                      if k.startswith("eagle3")), default=None)
    res["goals"] = {
        "no_spec_at_least_1500_tok_s": None if nospec is None else nospec >= 1500,
        "best_eagle3_at_least_2.5x_no_spec": None if not best_eagle else best_eagle >= 2.5,
        "best_eagle3_vs_no_spec": best_eagle,
    }


def hf_compiled(args, model, prompts, n) -> dict:
    """HF generate with a static cache and torch.compile(mode="reduce-overhead",
    fullgraph=True). transformers compiles the decode step itself when the cache is static
    (prefill stays eager); that built-in path is tried first, then the manual
    `model.forward = torch.compile(...)` recipe, then the built-in path without fullgraph.
    The result names the path that ran and keeps the errors of those that failed."""
    import transformers

    torch = _torch()
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
            hf_generate(args, model, longest, n, **kw)
            compile_s = time.perf_counter() - t0
            if "compile_config" in kw and "_compiled_call" not in model.__dict__:
                # transformers skips compilation silently when its criteria are not met
                raise RuntimeError("transformers did not compile the decode step")
            # A second prompt length: where the prefill is compiled too (the manual recipe),
            # dynamo recompiles once with dynamic shapes here rather than in a timed call.
            hf_generate(args, model, longest[:-1], n, **kw)
            hf_generate(args, model, longest, n, **kw)
            r = run_hf(args, model, prompts, n, **kw)
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


def plot_single_stream(plt, res):
    names, vals = [], []
    for k, r in res.get("tandem", {}).items():
        if r.get("tokens_per_s"):  # "eagle3_dynamic_k7_context" -> one word a line
            names.append("tandem\n" + k.replace("_", "\n"))
            vals.append(r["tokens_per_s"])
    for k, r in res.get("hf", {}).items():
        if r.get("tokens_per_s"):
            names.append(f"HF\n{k}")
            vals.append(r["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(11, 4.8))
    ax.bar(names, vals)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("tokens/s (single stream)")
    ax.set_title(f"fig 1: single stream, {res['environment'].get('gpu') or 'cpu'}")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    return fig


# ---- figure 2: Llama-3.1-8B shape --------------------------------------------------------


def hbm_bandwidth(gib: float, reps: int = 10) -> dict:
    """Device-to-device copy of `gib` GiB: bytes read + bytes written over the copy time."""
    torch = _torch()
    nbytes = int(gib * (1 << 30))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), reps, warmup=2)
    src = dst = None
    free_memory()
    med = statistics.median(ms)
    return {"bytes_copied": nbytes, "reps": reps, "median_ms": rnd(med, 3),
            "ms": [rnd(x, 3) for x in ms],
            "bandwidth_gb_s": rnd(2 * nbytes / (med / 1e3) / 1e9, 1),
            "method": "torch copy_ of a uint8 tensor on the same GPU; bandwidth = 2*bytes/time"}


def fig_llama8b_shape(args, res: dict) -> None:
    torch = _torch()
    if not is_cuda(args):
        res["skipped"] = "needs CUDA"
        return
    from engine import SamplingParams
    from engine.graphs import pack

    ctx, reps = args.fig2_context, args.fig2_reps
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.fig2_max_batch]
    qlens = list(range(1, 9))
    per_seq = -(-(ctx + max(qlens) + 1) // 16)
    num_blocks = max(args.fig2_blocks, max(batches) * per_seq + 1)
    res["config"] = {"context_tokens": ctx, "reps": reps, "batches": batches,
                     "query_lens": qlens, "num_blocks": num_blocks, "block_size": 16,
                     "dtype": args.dtype, "weights": "random, N(0, 0.02); norms 1"}
    log("fig 2: HBM bandwidth")
    res["hbm"] = bw = hbm_bandwidth(args.hbm_gib)
    log(f"fig 2: HBM copy bandwidth {bw['bandwidth_gb_s']} GB/s")
    log("fig 2: building the random Llama-3.1-8B-shaped engine")
    eng = random_engine(args, llama8b_shape(), num_blocks)
    cfg = eng.config
    m = cfg.model
    res["config"].update(attention_backend=cfg.backend_name, cuda_graphs=cfg.use_cuda_graphs,
                         model=m.name)
    params = {id(p): p for p in eng.model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    embed = eng.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    # A decode step reads every weight but the embedding table (one row of it).
    weight_read = total - embed_bytes + embed.shape[1] * embed.element_size()
    kv_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * embed.element_size()
    kv_read = kv_per_token * (ctx + 1)
    gbps = bw["bandwidth_gb_s"] * 1e9
    floor_ms = (weight_read + kv_read) / gbps * 1e3
    res["floor"] = {"param_bytes": total, "embedding_bytes": embed_bytes,
                    "weight_bytes_read_per_step": weight_read,
                    "kv_bytes_read_per_step_at_context": kv_read,
                    "floor_ms": rnd(floor_ms, 4),
                    "floor_weights_only_ms": rnd(weight_read / gbps * 1e3, 4),
                    "definition": "(weights read + KV read at the context) / measured HBM "
                                  "copy bandwidth"}
    log(f"fig 2: params {total / 2**30:.2f} GiB, floor {floor_ms:.3f} ms")
    if cfg.use_cuda_graphs:
        eng.runner.enable_graphs(max(batches), qlens, ())
    # Which kernel each large projection takes at one row and at several (GEMV / 16-row
    # tensor-core tiles or cuBLAS), as timed on this GPU at graph set-up, with the timings.
    res["large_linears"] = eng.model.large_linear_tuning
    runner = eng.runner

    def tables(b: int) -> list[list[int]]:
        return [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(b)]

    def fwd(b: int, q: int):
        ids = [(7 * i + 11) % m.vocab_size for i in range(b * q)]
        pos = [ctx + j for _ in range(b) for j in range(q)]
        inp = pack(ids, pos, tables(b), [q] * b, cfg.block_size)
        rows = list(range(b * q))
        return lambda: runner.forward_packed(inp, rows)

    verify = []
    with torch.inference_mode():
        for q in qlens:
            ms = timed_ms(fwd(1, q), reps)
            verify.append({"tokens": q, "median_ms": rnd(statistics.median(ms), 4),
                           "min_ms": rnd(min(ms), 4)})
            log(f"fig 2: batch 1, {q} tokens/forward: {verify[-1]['median_ms']} ms")
        one = verify[0]["median_ms"]
        for v in verify:
            v["vs_1_token"] = ratio(v["median_ms"], one)
        batch = []
        for b in batches:
            ms = timed_ms(fwd(b, 1), reps)
            med = statistics.median(ms)
            batch.append({"batch": b, "median_ms": rnd(med, 4), "min_ms": rnd(min(ms), 4),
                          "tokens_per_s": rnd(b / med * 1e3, 1)})
            log(f"fig 2: batch {b} decode step: {batch[-1]['median_ms']} ms")
        for r in batch:
            r["step_vs_batch_1"] = ratio(r["median_ms"], batch[0]["median_ms"])
            r["throughput_vs_batch_1"] = ratio(r["tokens_per_s"], batch[0]["tokens_per_s"])
    res["verify_cost"] = verify
    res["batch_decode"] = batch
    res["forward_timing"] = ("runner.forward_packed (graph replay when captured, plus the LM "
                             "head), CUDA events per call, host never waits between calls")
    # The engine step as users see it: schedule, forward, sample, one host sync per step.
    log("fig 2: engine.step() at batch 1")
    n = args.fig2_decode_tokens
    prompt = [(13 * i + 5) % m.vocab_size for i in range(ctx)]
    eng.generate([prompt[:64]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n + 1,
                                                 ignore_eos=True))
    stamps, done = [], False
    while not done:
        outs = eng.step()
        stamps.append(time.perf_counter())
        done = any(o.request_id == rid and o.finished for o in outs)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]  # the decode steps after prefill
    step_ms = statistics.median(steps) * 1e3
    res["engine_step_batch1"] = {
        "decode_steps": len(steps), "median_ms": rnd(step_ms, 4),
        "mean_ms": rnd(statistics.mean(steps) * 1e3, 4),
        "tokens_per_s": rnd(1e3 / step_ms, 1)}
    fwd_ms = verify[0]["median_ms"]
    six = next(v["vs_1_token"] for v in verify if v["tokens"] == 6)
    res["pct_of_floor"] = {
        "definition": "100 * floor_ms / step_ms (100 = moves bytes at the measured copy "
                      "bandwidth)",
        "forward_device_time": rnd(100 * floor_ms / fwd_ms, 1),
        "engine_step": rnd(100 * floor_ms / step_ms, 1)}
    res["goals"] = {
        "engine_step_at_least_85pct_of_floor": 100 * floor_ms / step_ms >= 85,
        "forward_at_least_85pct_of_floor": 100 * floor_ms / fwd_ms >= 85,
        "verify_6_tokens_at_most_1.10x": six <= 1.10, "verify_6_tokens_vs_1": six}
    log(f"fig 2: engine step {step_ms:.3f} ms = {100 * floor_ms / step_ms:.1f}% of floor; "
        f"forward {fwd_ms:.3f} ms; 6-token verify {six}x")


def plot_llama8b(plt, res):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    v = res["verify_cost"]
    a.plot([r["tokens"] for r in v], [r["vs_1_token"] for r in v], "o-")
    a.axhline(1.10, ls="--", c="gray")
    a.set_xlabel("tokens per forward (K+1)")
    a.set_ylabel("time vs 1-token step")
    a.set_title("verify cost, batch 1")
    bd = res["batch_decode"]
    b.plot([r["batch"] for r in bd], [r["median_ms"] for r in bd], "o-", label="step")
    b.axhline(res["floor"]["floor_ms"], ls="--", c="gray", label="floor (batch 1)")
    b.set_xscale("log", base=2)
    b.set_xlabel("batch")
    b.set_ylabel("decode step ms")
    b.legend()
    b.set_title("Llama-3.1-8B shape, bf16")
    return fig


# ---- figure 3: concurrency ----------------------------------------------------------------


def fig_concurrency(args, res: dict) -> None:
    from engine import SamplingParams

    conc = [int(c) for c in args.concurrency.split(",")]
    n = args.fig3_tokens
    res["config"] = {"concurrency": conc, "max_tokens": n, "ignore_eos": True,
                     "reps": args.fig3_reps, "num_blocks": args.num_blocks,
                     "throughput": "burst: total generated tokens / wall time of one generate "
                                   "call with all streams (prefill included; the streams "
                                   "start together and the run ends with a tail of the "
                                   "slowest), median of reps. steady: c streams always in "
                                   "flight, each finished request replaced at once, tokens / "
                                   "wall time until the last of 3c requests is admitted "
                                   "(bench.suite.steady_throughput), median of reps, each "
                                   "run's stalls (steps of 3x its median step or more) "
                                   "recorded. steady mixed: the same "
                                   "with output lengths uniform in [n/2, 3n/2] (one seeded "
                                   "list for all variants), so no-spec streams do not all "
                                   "finish in one step. The three variants' engines stay "
                                   "alive and take turns in every repetition (the order "
                                   "rotated each time, bench.suite.turns)",
                     "prompts": "held-out split of cluster/prompt_sets.py, cycled"}
    log("fig 3: loading SmolLM2 + EAGLE-3 head")
    base = load_smol(args, spec=eagle(args, 5, False))
    res["config"]["eagle3_head"] = head_summary(args.head or shipped_head(base.config.model))
    msgs = held_out_messages(max(conc), args.prompt_offset)
    prompts = [base.encode_prompt(m) for m in msgs]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    dyn = f"eagle3_dynamic_k{args.dynamic_k}"
    variants = {"no_spec": None, "eagle3_k5": eagle(args, 5, False),
                dyn: eagle(args, args.dynamic_k, True)}
    candidates = candidate_variants(dyn, args.fig3_candidate)
    keys = {name: name[len(dyn) + 1:] for name in candidates}  # "candidate", "candidate2", ...
    for name, fields in candidates.items():
        # dynamic K with some SpecConfig fields changed, in turns with the rest
        variants[name] = replace(variants[dyn], **fields)
        key = keys[name]
        res["config"][key] = fields
        if fields.get("head"):  # a second head in turns with the first (head A/B at c streams)
            res["config"][f"{key}_eagle3_head"] = head_summary(fields["head"])
    table: dict[str, list[dict]] = {name: [] for name in variants}
    res["runs"] = table
    traces: dict[str, list] = {}  # --fig3-trace
    walls: dict[str, float] = {}  # --fig3-trace: each burst run's wall ms
    probes: dict[str, dict] = {}
    res["host_probe"] = probes  # the host's speed around each concurrency (bench.common)
    # All variants' engines stay alive and take turns in every repetition (`turns`): the
    # host's speed drifts between runs and between processes (two steady K=5 profiles of one
    # commit, one after the other, ran 29.7k and 33.9k tok/s at 64 streams on the same
    # device time), and a variant measured minutes after its baseline carried that drift
    # into its ratio.
    engines = {}
    for name, spec in variants.items():
        log(f"fig 3: {name}: capturing")
        eng = base.with_config(spec=spec, num_blocks=args.num_blocks)
        # Every batch size up to the largest: with speculation, streams advance at different
        # rates and finish apart, so each run's tail passes through the smaller buckets.
        res.setdefault("graphs", {})[name] = precapture(eng, range(1, max(conc) + 1))
        # Every prompt once: the steady runs cycle through all of them, and a prompt length
        # not seen before may compile prefill kernels.
        eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engines[name] = eng
    for c in conc:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        probes[str(c)] = {"before": host_probe_us()}
        for eng in engines.values():
            # Untimed, the same batch: shapes only this concurrency meets (prefill spans,
            # mixed steps) compile and capture here, and dynamic K measures this batch size.
            eng.generate(batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            # Untimed, the same admissions with short requests: the prefill batches a steady
            # run makes (without speculation all c streams finish together and c prompts
            # are admitted at once) compile here, not inside the window (no speculation at
            # 8 streams once measured a third of its burst rate).
            steady_throughput(args, eng, prompts, c, 4)
        before = {name: (spec_counts(eng), step_paths(eng)) for name, eng in engines.items()}
        tps = {name: [] for name in engines}
        acc = {name: [] for name in engines}
        events = {name: [] for name in engines}
        for rep in range(args.fig3_reps):
            for name in turns(list(engines), rep):
                eng = engines[name]
                counts, mark = spec_counts(eng), window_mark()
                tracing = trace_start(args, eng)
                sync(args)
                t0 = time.perf_counter()
                outs = eng.generate(batch, params)
                sync(args)
                dt = time.perf_counter() - t0
                if tracing:
                    traces[f"{name} c={c} burst {rep}"] = take_trace(eng)
                    # against the traced steps' sum: the time no traced step holds
                    walls[f"{name} c={c} burst {rep}"] = rnd(dt * 1e3, 3)
                tps[name].append(sum(len(o.token_ids) for o in outs) / dt)
                acc[name].append(acceptance(counts, spec_counts(eng)))
                events[name].append(window_events(mark))
        for name, eng in engines.items():
            table[name].append({"concurrency": c,
                                "tokens_per_s": rnd(statistics.median(tps[name]), 1),
                                "reps_tokens_per_s": [rnd(x, 1) for x in tps[name]],
                                "reps_events": events[name],
                                "acceptance_length": acc[name][-1],
                                "paths": paths_delta(before[name][1], step_paths(eng))})
        # Each steady window lasts about a second at 64 streams: one stall inside it (a
        # collection, a descheduled host) moved a variant's figure by up to 2x between runs,
        # so each is repeated like the burst and each run's stalls are recorded.
        for key, mixed in (("steady", False), ("steady_mixed", True)):
            before = {name: (spec_counts(eng), step_paths(eng)) for name, eng in engines.items()}
            runs = {name: [] for name in engines}
            for rep in range(args.fig3_reps):
                for name in turns(list(engines), rep):
                    eng = engines[name]
                    tracing = trace_start(args, eng)
                    runs[name].append(steady_throughput(args, eng, prompts, c, n, mixed=mixed))
                    if tracing:
                        traces[f"{name} c={c} {key} {rep}"] = take_trace(eng)
            for name, eng in engines.items():
                row, rates = table[name][-1], [r.tokens_per_s for r in runs[name]]
                row[f"{key}_tokens_per_s"] = rnd(statistics.median(rates), 1)
                row[f"{key}_reps_tokens_per_s"] = [rnd(x, 1) for x in rates]
                row[f"{key}_stalls"] = [r.stalls for r in runs[name]]
                if not mixed:
                    row["steady_acceptance_length"] = acceptance(before[name][0],
                                                                 spec_counts(eng))
                    row["steady_paths"] = paths_delta(before[name][1], step_paths(eng))
        probes[str(c)]["after"] = host_probe_us()
        for name, eng in engines.items():
            row = table[name][-1]
            row["step_costs"] = step_costs(eng)
            log(f"fig 3: {name} c={c}: burst {row['tokens_per_s']} tok/s, steady "
                f"{row['steady_tokens_per_s']} tok/s, steady mixed lengths "
                f"{row['steady_mixed_tokens_per_s']} tok/s")
        log(f"fig 3: c={c} host probe {probes[str(c)]}")
    engines = eng = base = None
    free_memory()
    # Per measure: the rows' throughput key, their ratio key, the summary's key.
    measures = {"burst": ("tokens_per_s", "vs_no_spec", "ratio_vs_no_spec"),
                "steady": ("steady_tokens_per_s", "steady_vs_no_spec",
                           "steady_ratio_vs_no_spec"),
                "steady_mixed": ("steady_mixed_tokens_per_s", "steady_mixed_vs_no_spec",
                                 "steady_mixed_ratio_vs_no_spec")}
    goals = {}
    for measure, (tps, vs, summary) in measures.items():
        ref = {r["concurrency"]: r[tps] for r in table["no_spec"]}
        res[summary] = {}
        for name in variants:
            if name == "no_spec":
                continue
            for r in table[name]:
                r[vs] = ratio(r[tps], ref[r["concurrency"]])
            res[summary][name] = {str(r["concurrency"]): r[vs] for r in table[name]}
        low = min(r[vs] for r in table[dyn])
        goals[f"dynamic_at_least_0.97x_no_spec_everywhere_{measure}"] = low >= 0.97
        goals[f"dynamic_min_ratio_{measure}"] = low
        for name, key in keys.items():
            goals[f"{key}_min_ratio_{measure}"] = min(r[vs] for r in table[name])
    if args.fig3_trace:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "fig3_trace.json")
        with open(path, "w") as f:
            json.dump(traces, f)
        res["trace"] = os.path.basename(path)
        res["trace_burst_wall_ms"] = walls
    res["break_even_fixed_k5"] = break_even(table["eagle3_k5"])
    res["goals"] = goals
    dyn_min = goals["dynamic_min_ratio_burst"]
    log(f"fig 3: fixed K=5 break-even {res['break_even_fixed_k5']}; dynamic min {dyn_min}")


def candidate_variants(dyn: str, texts: list[str] | str | None) -> dict[str, dict]:
    """Figure 3's candidates, one per `--fig3-candidate` ("field=value,..."): the SpecConfig
    fields each changes on dynamic K, named `<dyn>_candidate`, `<dyn>_candidate2`, ... in the
    order given. An empty text or a field twice over is refused (ValueError), as is a bad
    field or value (`spec_fields`)."""
    if texts is None:
        return {}
    out = {}
    for i, text in enumerate([texts] if isinstance(texts, str) else texts):
        fields = spec_fields(text)
        if not fields:
            raise ValueError(f"candidate {i + 1} changes no SpecConfig field: {text!r}")
        if fields in out.values():
            raise ValueError(f"candidate {i + 1} repeats an earlier one: {text!r}")
        out[f"{dyn}_candidate" + (str(i + 1) if i else "")] = fields
    return out


def turns(names: list[str], rep: int) -> list[str]:
    """The order the variants take their turns in repetition `rep`: rotated by one each
    repetition, so none always runs first (after another variant's run) or last."""
    r = rep % len(names) if names else 0
    return names[r:] + names[:r]


def trace_start(args, eng) -> bool:
    """With --fig3-trace, `start_trace` on a dynamic-K engine; whether it records."""
    return bool(args.fig3_trace and eng.spec is not None and eng.spec.spec.dynamic
                and start_trace(eng))


def mixed_lengths(n: int, count: int) -> list[int]:
    """Output lengths of a mixed-traffic steady run: uniform in [n/2, 3n/2], the same seeded
    list for every variant."""
    import random

    rng = random.Random(1234)
    return [rng.randint(max(1, n // 2), max(1, 3 * n // 2)) for _ in range(count)]


@dataclass
class SteadyRun:
    """One steady window: its tokens/s, and its stalls (`stalls`)."""

    tokens_per_s: float
    stalls: dict


def stalls(step_seconds: list[float]) -> dict:
    """Steps of a window that took `STALL` times its median step or more (the threshold the
    dynamic-K policy leaves out of its rates): how many, the time they took beyond the
    median, and the longest step (ms)."""
    from engine.spec.policy import STALL

    if not step_seconds:
        return {"steps": 0, "stalls": 0, "stalled_ms": 0.0, "median_step_ms": None,
                "max_step_ms": None}
    med = statistics.median(step_seconds)
    slow = [t for t in step_seconds if t >= STALL * med]
    return {"steps": len(step_seconds), "stalls": len(slow),
            "stalled_ms": rnd(sum(t - med for t in slow) * 1e3, 2),
            "median_step_ms": rnd(med * 1e3, 3), "max_step_ms": rnd(max(step_seconds) * 1e3, 2)}


def window_mark() -> tuple[int, int]:
    """Where the Triton compile record and the graph-capture count stand now."""
    from engine import jit_watch
    from engine.graphs import GraphSet

    return jit_watch.count(), GraphSet.captures


def window_events(mark: tuple[int, int]) -> dict:
    """Kernels compiled ({name: [count, seconds]}) and CUDA graphs captured since `mark`:
    one-time costs that, inside a timed window, are stalls no later run has."""
    from engine import jit_watch
    from engine.graphs import GraphSet

    return {"compiles": jit_watch.summary(jit_watch.since(mark[0])),
            "captures": GraphSet.captures - mark[1]}


def steady_throughput(args, eng, prompts, c: int, n: int, generations: int = 3,
                      mixed: bool = False) -> SteadyRun:
    """Tokens/s with `c` streams always in flight, as a server under steady load runs: each
    finished request is replaced at once by the next prompt (its prefill counted), and the
    window ends when the last of generations * c requests is admitted (the drain at the end,
    where fewer than c streams remain, is not part of it). Every request decodes n tokens,
    or with `mixed` a length from `mixed_lengths` (mean n): without speculation, equal
    lengths make all c streams finish in the same step and be replaced in one admission,
    which traffic of varied lengths does not do."""
    total = generations * c
    lengths = mixed_lengths(n, total) if mixed else [n] * total
    steps: list[float] = []
    mark = window_mark()
    sync(args)
    t0 = time.perf_counter()
    tokens, live = steady_run(eng, prompts, c, lengths, steps)
    sync(args)
    dt = time.perf_counter() - t0
    for rid in live:
        eng.abort(rid)
    return SteadyRun(tokens / dt, {**stalls(steps), **window_events(mark)})


def steady_run(eng, prompts, c: int, lengths: list[int],
               step_seconds: list[float] | None = None) -> tuple[int, set]:
    """Keep c requests in flight, the i-th with max_tokens lengths[i], replacing each one
    that finishes until all were admitted; returns the tokens generated and the ids of the
    requests still running. Only this run's requests count: the first step may return
    outputs of requests an earlier run aborted (read by the abort's drain of the step in
    flight), and taking their finishes for this run's would admit extra streams."""
    from engine import SamplingParams

    started, tokens, live = 0, 0, set()

    def admit():
        nonlocal started
        params = SamplingParams(temperature=0, max_tokens=lengths[started], ignore_eos=True)
        live.add(eng.add_request(prompts[started % len(prompts)], params))
        started += 1

    for _ in range(c):
        admit()
    clock = time.perf_counter
    while started < len(lengths):
        t0 = clock()
        outs = eng.step()
        if step_seconds is not None:
            step_seconds.append(clock() - t0)
        for out in outs:
            if out.request_id not in live:  # a request's finishing output is its last
                continue
            tokens += len(out.token_ids)
            if out.finished:
                live.discard(out.request_id)
                if started < len(lengths):
                    admit()
    return tokens, live


def break_even(rows: list[dict]) -> dict:
    """Where speculation stops paying: the first concurrency with ratio < 1, and the crossing
    interpolated on log2(concurrency)."""
    import math

    prev = None
    for r in rows:
        if r["vs_no_spec"] < 1:
            out = {"first_concurrency_below_1": r["concurrency"],
                   "last_concurrency_at_or_above_1": prev["concurrency"] if prev else None}
            if prev:
                x0, x1 = math.log2(prev["concurrency"]), math.log2(r["concurrency"])
                y0, y1 = prev["vs_no_spec"], r["vs_no_spec"]
                x = x0 + (y0 - 1) * (x1 - x0) / (y0 - y1) if y0 != y1 else x0
                out["interpolated_concurrency"] = rnd(2**x, 1)
            return out
        prev = r
    return {"first_concurrency_below_1": None,
            "note": "fixed K pays at every measured concurrency"}


def plot_concurrency(plt, res):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, rows) in enumerate(res["runs"].items()):
        xs, color = [r["concurrency"] for r in rows], f"C{i}"
        a.plot(xs, [r["tokens_per_s"] for r in rows], "o-", c=color, label=f"{name} burst")
        a.plot(xs, [r.get("steady_tokens_per_s") for r in rows], "s--", c=color,
               label=f"{name} steady")
        if name != "no_spec":
            b.plot(xs, [r["vs_no_spec"] for r in rows], "o-", c=color, label=f"{name} burst")
            b.plot(xs, [r.get("steady_vs_no_spec") for r in rows], "s--", c=color,
                   label=f"{name} steady")
            b.plot(xs, [r.get("steady_mixed_vs_no_spec") for r in rows], "^:", c=color,
                   label=f"{name} steady mixed")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.legend()
    a.set_ylabel("tokens/s")
    b.axhline(1.0, c="gray", ls="--")
    b.axhline(0.97, c="gray", ls=":")
    b.set_ylabel("vs no speculation")
    return fig


# ---- figure 4: KV transfer ----------------------------------------------------------------


def sync_devices(*devices) -> None:
    torch = _torch()
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def peer_copy(src_dev, dst_dev, sizes, reps: int) -> list[dict]:
    """Plain tensor copy src_dev -> dst_dev (peer-to-peer between GPUs), wall time with both
    devices synchronized, median of reps after 2 warm-ups (`kvtransfer.bench.copy_seconds`)."""
    from kvtransfer.bench import copy_seconds

    rows = []
    for nbytes in sizes:
        med = copy_seconds(src_dev, dst_dev, nbytes, reps)
        rows.append({"bytes": nbytes, "median_ms": rnd(med * 1e3, 3),
                     "gb_s": rnd(nbytes / med / 1e9, 1)})
        log(f"fig 4: peer copy {nbytes / 2**20:.0f} MiB: {rows[-1]['gb_s']} GB/s")
    return rows


def local_transport(layout, src_dev, dst_dev, block_counts, reps: int) -> list[dict]:
    """The engine's in-process path (kvtransfer.local): gather blocks on the source device,
    copy, scatter on the destination; `send_blocks` time, median of reps after 2 warm-ups."""
    import asyncio

    from kvtransfer.local import LocalTransport

    torch = _torch()
    nblk = max(block_counts)
    kv0 = torch.randn(layout.kv_shape(nblk), device=src_dev).to(layout.torch_dtype)
    kv1 = torch.zeros(layout.kv_shape(nblk), dtype=layout.torch_dtype, device=dst_dev)
    rows = []

    async def go():
        rx = LocalTransport(layout, kv1)
        await rx.start()
        conn = await LocalTransport(layout).connect(rx.address)
        for nb in block_counts:
            ids = list(range(nb))
            secs = []
            for i in range(reps + 2):
                sync_devices(src_dev)
                st = await conn.send_blocks(f"b{nb}-{i}", kv0, ids, ids)
                await rx.recv_blocks(f"b{nb}-{i}", timeout=30)
                if i >= 2:
                    secs.append(st.seconds)
            med = statistics.median(secs)
            rows.append({"blocks": nb, "bytes": nb * layout.block_bytes,
                         "median_ms": rnd(med * 1e3, 3),
                         "gb_s": rnd(nb * layout.block_bytes / med / 1e9, 1)})
            log(f"fig 4: local transport {nb} blocks: {rows[-1]['gb_s']} GB/s")
        await conn.close()
        await rx.close()

    asyncio.run(go())
    return rows


def fig_kv_transfer(args, res: dict) -> None:
    torch = _torch()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        res["skipped"] = "needs 2 GPUs"
        return
    from kvtransfer.layout import BlockLayout

    sizes = [16 << 20, 64 << 20, 256 << 20, 1 << 30]
    res["config"] = {"sizes_bytes": sizes, "reps": args.fig4_reps,
                     "ucx_progress": args.fig4_progress,
                     "peer_access_0_to_1": torch.cuda.can_device_access_peer(0, 1)}
    res["peer_copy"] = peer = peer_copy("cuda:0", "cuda:1", sizes, args.fig4_reps)
    # Llama-3.1-8B layout: 2 MiB per 16-token block in bf16.
    layout = BlockLayout("llama8b-shape", "bfloat16", 16, 32, 8, 128, 0)
    counts = sorted({max(1, s // layout.block_bytes) for s in sizes})
    local = local_transport(layout, "cuda:0", "cuda:1", counts, args.fig4_reps)
    res["local_transport"] = {"layout": layout.to_dict(), "block_bytes": layout.block_bytes,
                              "rows": local}
    free_memory()
    res["ucx"] = ucx_transfer(args, sizes)
    by = {r["bytes"]: r["gb_s"] for r in peer}
    ucx_rows = res["ucx"].get("rows")
    if ucx_rows:
        res["ucx_vs_peer_copy"] = {str(r["bytes"]): ratio(r["gb_s"], by.get(r["bytes"]))
                                   for r in ucx_rows}
        res["ucx_messages_vs_peer_copy"] = {
            str(r["bytes"]): ratio(r["messages_gb_s"], by.get(r["bytes"])) for r in ucx_rows}
    res["local_transport_vs_peer_copy"] = {
        str(r["bytes"]): ratio(r["gb_s"], by.get(r["bytes"])) for r in local}
    if ucx_rows:
        landed = {r["bytes"]: r["bytes"] / r["landed_ms"] / 1e6 for r in ucx_rows
                  if r.get("landed_ms")}
        res["ucx_landed_vs_peer_copy"] = {str(b): ratio(rnd(g, 2), by.get(b))
                                          for b, g in landed.items()}
    free_memory()
    # Transfer time as a share of prefill: the prompt whose KV is that many bytes, prefilled
    # by the random 8B-shaped engine on GPU 0 (the same layout: 128 KiB of KV per token).
    tokens = {b: b // layout.block_bytes * layout.block_size for b in sizes}
    res["prefill"] = pre = prefill_times(args, sorted(set(tokens.values())), args.fig4_reps)
    pre_ms = {r["tokens"]: r["median_ms"] for r in pre}
    res["transfer_share_of_prefill"] = {
        str(r["bytes"]): rnd(r["median_ms"] / pre_ms[tokens[r["bytes"]]], 4)
        for r in ucx_rows or local if tokens.get(r["bytes"]) in pre_ms}


def prefill_times(args, counts: list[int], reps: int) -> list[dict]:
    """Wall time to the first token (prefill, chunked as the engine schedules it, then one
    sampled token) of a random prompt of each length on the random 8B-shaped engine."""
    from engine import SamplingParams

    torch = _torch()
    eng = random_engine(args, llama8b_shape(max(counts) + 64), max(counts) // 16 + 8,
                        device="cuda:0")
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in counts:
        prompt = torch.randint(0, 128000, (n,), generator=gen).tolist()
        eng.generate(prompt, sp)  # compiles what this length needs
        secs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(prompt, sp)
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        rows.append({"tokens": n, "median_ms": rnd(statistics.median(secs) * 1e3, 3),
                     "max_num_batched_tokens": eng.config.max_num_batched_tokens})
        log(f"fig 4: prefill of {n} tokens: {rows[-1]['median_ms']} ms")
    del eng
    free_memory()
    return rows


def ucx_transfer(args, sizes, devices: tuple[str, str] = ("cuda:0", "cuda:1")) -> dict:
    """UCX from GPU 0 (this process) to a receiver process holding its cache on GPU 1, with
    kvtransfer/bench.py's machinery. Per size: blocks 0..n-1 to the same ids (one run, as a
    fresh prefill into a fresh reservation often is) by the push path (the sender copies into
    the receiver's cache, mapped through CUDA IPC; UCX carries header and ack), by the pull
    path (the receiver copies out of the sender's cache), and as UCX messages by the direct
    path and the staged path (whole, and in 8 layer chunks); the row's headline is the path
    the transport picks by itself (push where the receiver offers its cache, else pull where
    it offers to, else `wire.plan_direct`), `messages_gb_s` the message path it would pick
    otherwise. At the largest size also scattered ids (random order on both sides, as after
    much churn), each way. Where the two caches sit on two GPUs, the pull is measured with
    either GPU's copy engines (`kvtransfer.ipc.pull`, `pull_gb_s`).
    `args.fig4_progress`: ucxx's progress mode (process-wide: the first transport of this
    process decides; the receivers' too). `devices`: (sender, receiver); host ones check
    the plumbing on any machine."""
    try:
        import ucxx  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"ucxx not importable ({type(e).__name__}: {e})"}
    try:
        import asyncio
        import random
        from types import SimpleNamespace

        from kvtransfer import bench as kvb
        from kvtransfer import ipc, wire
        from kvtransfer.layout import BlockLayout

        progress = getattr(args, "fig4_progress", "thread")
        default_engine = ipc.DEFAULT_ENGINE
        engines = [default_engine] + ([e for e in ipc.ENGINES if e != default_engine]
                                      if devices[0] != devices[1] else [])
        rows, scattered = [], None
        loop = asyncio.new_event_loop()  # ucxx binds to the first loop that uses it: keep one
        layout = BlockLayout("bench", "bfloat16", 16, 32, 8, 128, 0)
        layer_block = layout.block_bytes // (2 * layout.num_layers)
        for nbytes in sizes:
            blocks = max(1, nbytes // layout.block_bytes)
            proc, pipe, address = kvb.spawn_receiver(layout, blocks, "worker",
                                                     device=devices[1], progress=progress)
            try:
                ns = SimpleNamespace(blocks=blocks, chunks=[1, 8], direct=[True, False],
                                     checksum=False, progress=progress, reps=args.fig4_reps,
                                     device=devices[0], trace=True, ipc=False)
                got = loop.run_until_complete(kvb.measure(ns, layout, address))
                ids = list(range(blocks))
                auto = wire.plan_direct(ids, ids, layout.num_layers, layer_block, None,
                                        wire.direct_min_bytes(devices[0]))
                messages = next(r for r in got if r["went_direct"] == (auto is not None))
                # The transport's own pick (push where the receiver offers its cache), then
                # the pull on each copy engine (the sender declining the push).
                ns.ipc, ns.direct, ns.chunks, ns.push = None, [None], [1], None
                own = len(got)
                got += loop.run_until_complete(kvb.measure(ns, layout, address))
                ns.push = False
                for engine in engines if got[own]["path"] in ("push", "pull") else []:
                    if got[own]["path"] == "pull" and engine == default_engine:
                        continue  # no push offered: the pick was this pull already
                    ns.pull_engine = engine
                    got += loop.run_until_complete(kvb.measure(ns, layout, address))
                    if got[-1]["path"] != "pull":
                        break  # no pull offered: once is enough
                pick = got[own] if got[own]["path"] in ("push", "pull") else messages
                ns.pull_engine, ns.push = default_engine, None
                best = max(got, key=lambda r: r["median_gb_s"])
                rows.append({"bytes": blocks * layout.block_bytes, "gb_s": pick["median_gb_s"],
                             "median_ms": pick["median_ms"], "landed_ms": pick.get("landed_ms"),
                             "path": _path_label(pick), "best_gb_s": best["median_gb_s"],
                             "messages_gb_s": messages["median_gb_s"],
                             "messages_path": _path_label(messages),
                             "pull_gb_s": {r["pull_engine"]: r["median_gb_s"]
                                           for r in got if r["path"] == "pull"},
                             "push_gb_s": next((r["median_gb_s"] for r in got
                                                if r["path"] == "push"), None),
                             "raw": [{k: v for k, v in r.items() if k != "traces"}
                                     for r in got],
                             "traces": {_path_label(r): r["traces"][:3] for r in got}})
                if nbytes == max(sizes):
                    rng = random.Random(0)
                    ns.ids = (rng.sample(ids, blocks), rng.sample(ids, blocks))
                    got = []
                    for offer in (False, None):
                        ns.ipc = offer
                        got += loop.run_until_complete(kvb.measure(ns, layout, address))
                    pick = got[-1]
                    scattered = {"bytes": pick["bytes"], "gb_s": pick["median_gb_s"],
                                 "median_ms": pick["median_ms"], "path": _path_label(pick),
                                 "messages_gb_s": got[0]["median_gb_s"],
                                 "raw": [{k: v for k, v in r.items() if k != "traces"}
                                         for r in got]}
            finally:
                kvb.stop_receiver(proc, pipe, layout)
            log(f"fig 4: UCX {nbytes >> 20} MiB: {rows[-1]['gb_s']} GB/s ({rows[-1]['path']}); "
                f"as messages {rows[-1]['messages_gb_s']} ({rows[-1]['messages_path']})")
        return {"rows": rows, "scattered_ids": scattered, "sender": devices[0],
                "receiver": f"{devices[1]} (separate process)",
                "direct_min_bytes": wire.direct_min_bytes(devices[0]),
                "progress": progress, "pull_engine": default_engine}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def _path_label(row: dict) -> str:
    """How a `kvtransfer.bench.measure` row's payload travelled, in the figure's words."""
    if row["path"] == "staged":
        return f"staged, {row['chunks']} chunk(s)"
    if row["path"] == "pull" and row.get("pull_engine", "dst") != "dst":
        return f"pull ({row['pull_engine']} engine)"
    return row["path"]


def plot_kv(plt, res):
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, rows in (("peer copy", res.get("peer_copy")),
                      ("local transport", (res.get("local_transport") or {}).get("rows")),
                      ("UCX link (its own pick)", (res.get("ucx") or {}).get("rows"))):
        if rows:
            ax.plot([r["bytes"] / 2**20 for r in rows], [r["gb_s"] for r in rows], "o-",
                    label=key)
    ucx_rows = (res.get("ucx") or {}).get("rows") or []
    if any("messages_gb_s" in r for r in ucx_rows):
        ax.plot([r["bytes"] / 2**20 for r in ucx_rows], [r["messages_gb_s"] for r in ucx_rows],
                "o--", label="UCX messages only")
    for engine in ("dst", "src"):  # the pull, where the pick was the push
        pts = [(r["bytes"] / 2**20, r["pull_gb_s"][engine]) for r in ucx_rows
               if engine in (r.get("pull_gb_s") or {}) and not r["path"].startswith("pull")]
        if pts:
            ax.plot(*zip(*pts), "x:", label=f"pull ({engine} copy engines)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MiB per transfer")
    ax.set_ylabel("GB/s")
    ax.legend()
    ax.set_title("KV transfer GPU 0 -> GPU 1")
    return fig


# ---- driver -----------------------------------------------------------------------------------

FIGURES = {
    1: ("single_stream", fig_single_stream, plot_single_stream),
    2: ("llama8b_shape", fig_llama8b_shape, plot_llama8b),
    3: ("concurrency", fig_concurrency, plot_concurrency),
    4: ("kv_transfer", fig_kv_transfer, plot_kv),
    5: ("itl_disagg", fig_itl_disagg, plot_itl),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--figures", default="1,2,3,4,5",
                   help="comma-separated figure numbers: 1 single_stream, 2 llama8b_shape, "
                        "3 concurrency, 4 kv_transfer, 5 itl_disagg (default: all)")
    p.add_argument("--out", default="bench/results", help="folder for figN_<name>.json/.png")
    p.add_argument("--model", default=None,
                   help="SmolLM2 .gguf file or HF folder (default: the embedded model)")
    p.add_argument("--head", default=None, help="EAGLE-3 head folder (default: the shipped one)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-blocks", type=int, default=8192,
                   help="KV blocks (of 16 tokens) per SmolLM2 engine variant")
    p.add_argument("--prompt-offset", type=int, default=0,
                   help="first held-out prompt used")
    p.add_argument("--dynamic-k", type=int, default=7, help="max K for dynamic EAGLE-3")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a module constant before any figure runs, for A/B processes "
                        "(e.g. engine.spec.policy.LOSING_FRESH=256); repeatable, recorded "
                        "in each figure's argv")
    p.add_argument("--context-drafts", choices=("on", "off"), default=None,
                   help="EAGLE-3 drafts from the context too (SpecConfig.context_drafts; "
                        "default: its default). Figure 1 runs both.")
    p.add_argument("--quiet-cpus", type=int, default=4, metavar="N",
                   help="on a GPU, keep the host thread on the N quietest CPUs, timed at start "
                        "(engine/affinity.py; 0: leave the affinity alone)")
    p.add_argument("--accept-model", choices=("geometric", "runs"), default="geometric",
                   help="how dynamic K predicts a K-draft step's tokens (SpecConfig)")
    g = p.add_argument_group("figure 1 (single stream)")
    g.add_argument("--fig1-prompts", type=int, default=16,
                   help="held-out prompts, one at a time (acceptance, and so the ratios, "
                        "move with the text: 4 prompts read 2.27x where 16 read 2.42x)")
    g.add_argument("--fig1-hf-prompts", type=int, default=4, metavar="N",
                   help="the HF baselines generate the first N prompts (0: all)")
    g.add_argument("--fig1-tokens", type=int, default=256)
    g.add_argument("--no-hf-compile", action="store_true",
                   help="skip the HF static cache + torch.compile baseline (minutes of compile)")
    g = p.add_argument_group("figure 2 (Llama-3.1-8B shape)")
    g.add_argument("--fig2-context", type=int, default=512, help="tokens already in the KV")
    g.add_argument("--fig2-reps", type=int, default=50)
    g.add_argument("--fig2-max-batch", type=int, default=64)
    g.add_argument("--fig2-blocks", type=int, default=2048)
    g.add_argument("--fig2-decode-tokens", type=int, default=128,
                   help="engine.step() decode steps timed at batch 1")
    g.add_argument("--hbm-gib", type=float, default=4.0, help="size of the bandwidth copy")
    g = p.add_argument_group("figure 3 (concurrency)")
    g.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    g.add_argument("--fig3-tokens", type=int, default=128)
    g.add_argument("--fig3-reps", type=int, default=3)
    g.add_argument("--fig3-candidate", action="append", default=None,
                   metavar="FIELD=VALUE,...",
                   help="one more variant: dynamic K with these SpecConfig fields changed "
                        "(e.g. num_tokens=5; dense_levels_from=4; head=DIR: another EAGLE-3 "
                        "head), taking turns with the others; its ratios beside dynamic K's, "
                        "goals candidate_min_ratio_*. Repeatable: the second is "
                        "<dynamic>_candidate2 (goals candidate2_min_ratio_*), and so on")
    g.add_argument("--fig3-trace", action="store_true",
                   help="write fig3_trace.json: each dynamic-K window's steps as the cost "
                        "model saw them (batch size, drafts per sequence, ms, tokens, path, "
                        "timed)")
    g = p.add_argument_group("figure 4 (KV transfer)")
    g.add_argument("--fig4-reps", type=int, default=10)
    g.add_argument("--fig4-progress", default="thread", choices=("thread", "thread-polling"),
                   help="ucxx progress mode of the UCX rows (this process and the receivers)")
    g = p.add_argument_group("figure 5 (ITL, colocated vs disaggregated)")
    g.add_argument("--fig5-model", default="llama8b", choices=("llama8b", "tiny"),
                   help="random-weight model shape (tiny: a CPU smoke test)")
    g.add_argument("--fig5-streams", type=int, default=8, help="background decode streams")
    g.add_argument("--fig5-short-len", type=int, default=128, help="their prompt tokens")
    g.add_argument("--fig5-arrivals", type=int, default=8, help="long prompts that arrive")
    g.add_argument("--fig5-prompt-len", type=int, default=8192, help="tokens per long prompt")
    g.add_argument("--fig5-interval-ms", type=float, default=500.0, help="between arrivals")
    g.add_argument("--fig5-long-tokens", type=int, default=16,
                   help="tokens each long request decodes")
    g.add_argument("--fig5-max-steps", type=int, default=2000,
                   help="max tokens of a background stream (it is aborted at the end)")
    g.add_argument("--fig5-step-limit", type=int, default=5000,
                   help="stop a run after this many steps even if unfinished")
    g.add_argument("--fig5-deadline-s", type=float, default=60.0,
                   help="stop a measured run after this many seconds even if unfinished")
    g.add_argument("--fig5-transport", default="auto", choices=("auto", "ucx", "in-process"),
                   help="disaggregated half: auto = prefill engine in its own process with KV "
                        "over UCX when ucxx imports, else both engines in this process with an "
                        "in-process copy (labelled in the JSON); ucx = fail without ucxx")
    g.add_argument("--fig5-in-process-row", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="also run the one-process variant (in-process KV copy) as an extra row "
                        "when the main row ran over UCX")
    g.add_argument("--fig5-check-kv", action="store_true",
                   help="compare a checksum of each request's KV blocks on both sides of the "
                        "transfer (extra work in the measured loop: on with --fig5-smoke)")
    g.add_argument("--fig5-smoke", action="store_true",
                   help="tiny sizes (tiny random model, 2 streams, 2 prompts of 128 tokens): "
                        "a smoke test of the mechanics, e.g. with --device cpu")


def run(args) -> int:
    torch = _torch()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if is_cuda(args) else "float32"
    try:
        nums = [int(x) for x in str(args.figures).split(",") if x.strip()]
    except ValueError:
        print(f"error: --figures wants numbers like 1,2,3, got {args.figures!r}",
              file=sys.stderr)
        return 2
    bad = [n for n in nums if n not in FIGURES]
    if bad:
        print(f"error: no figure {bad}; have {sorted(FIGURES)}", file=sys.stderr)
        return 2
    try:
        settings = apply_settings(args.set)
    except (ValueError, ImportError, AttributeError) as e:
        print(f"error: --set: {e}", file=sys.stderr)
        return 2
    try:
        candidate_variants("dynamic", args.fig3_candidate)
    except ValueError as e:
        print(f"error: --fig3-candidate: {e}", file=sys.stderr)
        return 2
    log(f"figures {nums} on {args.device} ({args.dtype}) -> {args.out}"
        + (f", settings {settings}" if settings else ""))
    if is_cuda(args) and args.quiet_cpus:
        # (GPU runs only: a CPU run may share its process with others, tests among them.)
        from engine.affinity import pin_quiet_cpus

        args.host_cpus = pin_quiet_cpus(args.quiet_cpus)
        log(f"host thread on CPUs {args.host_cpus['pinned']} "
            f"(probe us per CPU {args.host_cpus.get('probe_us')})")
    failed = []
    for num in nums:
        name, fn, plot = FIGURES[num]
        log(f"=== figure {num}: {name} ===")
        res = header(args, name, num)
        t0 = time.perf_counter()
        try:
            fn(args, res)
        except Exception:  # noqa: BLE001 - record it; the next figure still runs
            res["error"] = traceback.format_exc()
            failed.append(num)
            print(res["error"], flush=True)
        res["seconds"] = rnd(time.perf_counter() - t0, 1)
        res["environment"]["detokenizer"] = decode_path()
        free_memory()
        path = save(args.out, res, plot)
        status = "error" if "error" in res else res.get("skipped", "ok")
        log(f"figure {num} {name}: {status} in {res['seconds']}s -> {path}")
        if res.get("goals"):
            log(f"figure {num} goals: {json.dumps(res['goals'])}")
    log(f"done; failed figures: {failed or 'none'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
