"""Figure 1: SmolLM2 single-stream tokens/s. Headline: the engine's default speculation
against none on each domain's held-out split, and time to ready (`bench/fig1_domains.py`).
Beside it, a table of speculation variants against HF `generate` (eager, and static cache +
torch.compile) on the general held-out prompts, in the same run."""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict

from bench.common import (
    acceptance,
    eagle,
    first_diff,
    free_memory,
    head_summary,
    held_out_messages,
    is_cuda,
    lazy_torch,
    load_smol,
    log,
    ngram,
    paths_delta,
    precapture,
    ratio,
    rnd,
    save,
    spec_counts,
    step_paths,
    sync,
    torch_dtype,
)
from bench.fig1_domains import (
    domain_names,
    domain_prompts,
    domain_summary,
    engine_default,
    per_position,
    plot_domains,
    spec_hists,
    time_to_ready,
)
from engine.loader import shipped_head


def run_single(args, eng, msgs, n: int) -> dict:
    """Each prompt alone at batch 1, n tokens, EOS ignored; tokens/s = tokens / wall time of
    the generate call (prefill included)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    note = "prepared before" if eng.ready is not None else precapture(eng, (1,))
    # Warm-up: the full length on a prompt not in the timed set (Triton JIT, lazy graphs),
    # then each timed prompt alone for a few tokens, since a prompt length not seen before
    # may compile prefill and head kernels. Prefix caching is off, so nothing is reused.
    eng.generate(held_out_messages(1, offset=len(msgs) + args.prompt_offset + 7), params)
    for m in msgs:
        eng.generate([m], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    before, hists, paths = spec_counts(eng), spec_hists(eng), step_paths(eng)
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
            "acceptance_length": acceptance(before, spec_counts(eng)),
            **per_position(hists, spec_hists(eng)), "per_prompt": per,
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
    torch = lazy_torch()
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


def headline(args, res: dict, spec, n: int) -> None:
    """Time to ready and the first request (an engine with the default speculation, built
    before any other of this figure), then each domain's held-out prompts on that engine and
    on one without speculation; `res["ready"]`, `res["domains"]`, the headline and goals."""
    names = domain_names(args.fig1_domains)
    prompts = domain_prompts(names, args.fig1_domain_prompts)
    res["config"]["domains"] = {d: len(p) for d, p in prompts.items()}
    res["domains"], outs = {}, {}
    try:
        log("fig 1: time to ready (Engine.from_pretrained, default speculation)")
        first = held_out_messages(1, args.prompt_offset + args.fig1_prompts + 3)[0]
        eng, res["ready"] = time_to_ready(args, spec, first, n)
        log(f"fig 1: {eng.ready}; first request {res['ready']['first_over_steady']}x steady")
        for name in ("engine_default", "no_spec"):
            eng = eng if name == "engine_default" else eng.with_config(spec=None)
            for d, msgs in prompts.items():
                row = res["domains"].setdefault(d, {"prompts": len(msgs)})
                try:
                    ids = [eng.encode_prompt(m) for m in msgs]
                    row["prompt_tokens"] = [len(p) for p in ids]
                    row[name] = run_single(args, eng, ids, n)
                    outs.setdefault(d, {})[name] = row[name].pop("_outs")
                except Exception:  # noqa: BLE001 - one domain failing leaves the others
                    row[name] = {"error": traceback.format_exc()}
                log(f"fig 1: {d} {name}: {row[name].get('tokens_per_s')} tok/s, "
                    f"acceptance {row[name].get('acceptance_length')}")
    except Exception:  # noqa: BLE001 - the variant table still runs
        res["ready"] = res.get("ready") or {"error": traceback.format_exc()}
        res["domains_error"] = traceback.format_exc()
    eng = None
    free_memory()
    domain_summary(res, outs)


def table_variants(args, spec) -> dict:
    """The variant table's speculation settings by name, those --fig1-table keeps."""
    dyn = f"eagle3_dynamic_k{args.dynamic_k}"
    variants = {"no_spec": None, "eagle3_k5": eagle(args, 5, False, False),
                "eagle3_k7": eagle(args, 7, False, False),
                dyn: eagle(args, args.dynamic_k, True, False),
                "eagle3_k5_context": eagle(args, 5, False, True),
                "eagle3_k7_context": eagle(args, 7, False, True),
                f"{dyn}_context": eagle(args, args.dynamic_k, True, True),
                "ngram_k5": ngram(5), "engine_default": spec}
    if args.fig1_table.strip() == "all":
        return variants
    keep = [v.strip() for v in args.fig1_table.split(",") if v.strip() and v.strip() != "none"]
    bad = [v for v in keep if v not in variants]
    if bad:
        raise ValueError(f"--fig1-table: unknown {bad}; have {list(variants)}, all or none")
    return {v: variants[v] for v in keep}


def fig_single_stream(args, res: dict) -> None:
    n = args.fig1_tokens
    msgs = held_out_messages(args.fig1_prompts, args.prompt_offset)
    spec = engine_default(args)
    res["config"] = {"prompts": len(msgs), "max_tokens": n, "ignore_eos": True,
                     "greedy": True, "prefix_caching": False, "num_blocks": args.num_blocks,
                     "prompt_source": "held-out split of cluster/prompt_sets.py",
                     "tokens_per_s": "generated tokens / wall time of each generate call, "
                                     "prefill included, one prompt at a time",
                     "engine_default_spec": asdict(spec)}
    headline(args, res, spec, n)
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
    # HF's baselines generate the first prompts only (eager HF is slow): their rate,
    # beside tandem's over all of them
    hf_prompts = prompts[:args.fig1_hf_prompts or None]
    res["config"]["hf_prompts"] = len(hf_prompts)
    variants = table_variants(args, spec)
    runs: dict[str, dict] = {}
    res["tandem"] = runs
    for name, cfg in variants.items():
        log(f"fig 1: tandem {name}")
        try:
            eng = base.with_config(spec=cfg, num_blocks=args.num_blocks)
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
                      if k.startswith("eagle3") or k == "engine_default"), default=None)
    res.setdefault("goals", {}).update({
        "no_spec_at_least_1500_tok_s": None if nospec is None else nospec >= 1500,
        "best_eagle3_at_least_2.5x_no_spec": None if not best_eagle else best_eagle >= 2.5,
        "best_eagle3_vs_no_spec": best_eagle,
    })


def hf_compiled(args, model, prompts, n) -> dict:
    """HF generate with a static cache and torch.compile(mode="reduce-overhead",
    fullgraph=True). transformers compiles the decode step itself when the cache is static
    (prefill stays eager); that built-in path is tried first, then the manual
    `model.forward = torch.compile(...)` recipe, then the built-in path without fullgraph.
    The result names the path that ran and keeps the errors of those that failed."""
    import transformers

    torch = lazy_torch()
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
    fig, (top, ax) = plt.subplots(2, 1, figsize=(11, 9.6))
    plot_domains(top, res)
    ax.bar(names, vals)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("tokens/s (single stream)")
    ax.set_title("variants on the general held-out prompts, HF generate on the first "
                 f"{res['config'].get('hf_prompts')}")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    return fig
