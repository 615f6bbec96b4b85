"""Figure 1: SmolLM2 single-stream tokens/s. Headline: the engine's default speculation
against none and against the --fig1-domain-variants challengers on each domain's held-out split
(`cluster.prompt_sets.domains()`), the acceptance of its drafts by position, and how long an
engine takes to be ready and to serve its first request. Beside it, a table of speculation
variants against HF `generate` (eager, and static cache + torch.compile;
`bench.engine_vs_hf`) on the general held-out prompts, in the same run."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import asdict

from bench.common import (
    acceptance,
    challenger_summary,
    default_best,
    eagle,
    engine_default,
    first_diff,
    free_memory,
    head_summary,
    held_out_messages,
    is_cuda,
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
from bench.engine_vs_hf import hf_compiled, load_hf, run_hf
from engine.loader import shipped_head

GOAL_EVERY = 2.5  # the default's tokens/s over no speculation, on every domain's split
GOAL_BEST = 3.0  # ... and beyond this on the best domain
GOAL_FIRST = 1.2  # the first request after ready, over the same request's steady latency
STEADY_REPS = 3  # runs of that request after the first: their median is the steady latency


def domain_names(text: str) -> list[str]:
    """The domains --fig1-domains names ("all": every one `cluster.prompt_sets` keeps)."""
    from cluster.prompt_sets import DOMAINS

    names = list(DOMAINS) if text.strip() == "all" else \
        [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in DOMAINS]
    if bad or not names:
        raise ValueError(f"--fig1-domains: unknown {bad or text!r}; have {DOMAINS} or all")
    return names


def domain_prompts(names: list[str], n: int) -> dict[str, list[list[dict]]]:
    """The first n held-out chat-message lists of each named domain."""
    from cluster.prompt_sets import domains

    sets = domains()
    return {d: sets[d][1][:n] for d in names}


def spec_hists(eng) -> tuple[list[int], list[int]] | None:
    """(verifies by drafts carried, verifies by drafts accepted) of the engine so far; None
    without speculation."""
    if eng.spec is None:
        return None
    st = eng.spec.stats
    return list(st.drafted_hist), list(st.accepted_hist)


def per_position(before, after) -> dict:
    """Of the verifies between two `spec_hists`, at each draft position i = 1..K: the share
    whose draft i was accepted, the share that carried a draft i, and accepted of carried."""
    from engine.spec.stats import SpecStats

    if before is None or after is None:
        return {}
    window = SpecStats(len(after[0]) - 1)
    window.drafted_hist = [a - b for a, b in zip(after[0], before[0])]
    window.accepted_hist = [a - b for a, b in zip(after[1], before[1])]
    steps = sum(window.drafted_hist)  # only verifies that carried drafts are counted
    if not steps:
        return {}
    acc, drafted = window.accepted_per_pos, window.drafted_per_pos
    return {"verify_steps": steps,
            "per_position_acceptance": [rnd(a / steps, 4) for a in acc],
            "per_position_drafted": [rnd(d / steps, 4) for d in drafted],
            "per_position_given_drafted": [ratio(a, d) for a, d in zip(acc, drafted)]}


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


def time_to_ready(args, spec, prompt: list[int] | list[dict], n: int) -> tuple[object, dict]:
    """Build an engine as a serving process does (`Engine.from_pretrained`, then
    `prepare_to_serve`, timed as `eng.ready`), then send it one request right after ready and
    STEADY_REPS times more: the first latency against the steady one (their median), and the
    Triton compiles of each phase. Returns the engine too, for the domains."""
    from engine import Engine, SamplingParams, jit_watch, warmup

    jit_watch.install()
    mark = jit_watch.count()
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(args.model, device=args.device, dtype=torch_dtype(args),
                                 num_blocks=args.num_blocks, enable_prefix_caching=False,
                                 spec=spec)
    # `Engine.prepare_to_serve` without freezing the collector: this process discards its
    # engines, and a frozen one would never be freed
    warmup.prepare_to_serve(eng, started=t0, freeze=False)
    ready, at_ready = eng.ready, jit_watch.count()
    ids = eng.encode_prompt(prompt)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    secs, compiles = [], []
    for _ in range(1 + STEADY_REPS):
        before = jit_watch.count()
        sync(args)
        t = time.perf_counter()
        eng.generate([ids], params)
        sync(args)
        secs.append(time.perf_counter() - t)
        compiles.append(len(jit_watch.since(before)))
    steady = statistics.median(secs[1:])
    return eng, {
        "how": "Engine.from_pretrained + prepare_to_serve (every batch size), prefix cache "
               "off; then one request, greedy, EOS ignored, new to the engine",
        "load_s": rnd(ready.load), "graphs_s": rnd(ready.graphs), "total_s": rnd(ready.total),
        "compiles_to_ready": jit_watch.summary(jit_watch.since(mark)[:at_ready - mark]),
        "prompt_tokens": len(ids), "max_tokens": n,
        "first_request_s": rnd(secs[0], 4), "steady_request_s": rnd(steady, 4),
        "steady_runs_s": [rnd(s, 4) for s in secs[1:]],
        "first_over_steady": ratio(secs[0], steady),
        "compiles_per_request": compiles}


def headline(args, res: dict, spec, n: int, challengers: dict) -> None:
    """Time to ready and the first request (an engine with the default speculation, built
    before any other of this figure), then each domain's held-out prompts on that engine, on
    one without speculation and on one per challenger ({name: SpecConfig}, derived from it as
    the table derives its variants); `res["ready"]`, `res["domains"]`, the headline, goals."""
    names = domain_names(args.fig1_domains)
    prompts = domain_prompts(names, args.fig1_domain_prompts)
    res["config"]["domains"] = {d: len(p) for d, p in prompts.items()}
    res["config"]["domain_variants"] = list(challengers)
    res["domains"], outs = {}, {}
    try:
        log("fig 1: time to ready (Engine.from_pretrained, default speculation)")
        first = held_out_messages(1, args.prompt_offset + args.fig1_prompts + 3)[0]
        default, res["ready"] = time_to_ready(args, spec, first, n)
        log(f"fig 1: {default.ready}; first request {res['ready']['first_over_steady']}x steady")
        for name, cfg in {"engine_default": spec, "no_spec": None, **challengers}.items():
            try:  # one engine at a time beside the default's, whose weights the others share
                eng = default if name == "engine_default" else default.with_config(spec=cfg)
            except Exception:  # noqa: BLE001 - each domain records it; the next variant runs
                eng, failed = None, traceback.format_exc()
            for d, msgs in prompts.items():
                row = res["domains"].setdefault(d, {"prompts": len(msgs)})
                try:
                    if eng is None:
                        raise RuntimeError(f"engine not built:\n{failed}")
                    ids = [eng.encode_prompt(m) for m in msgs]
                    row["prompt_tokens"] = [len(p) for p in ids]
                    row[name] = run_single(args, eng, ids, n)
                    outs.setdefault(d, {})[name] = row[name].pop("_outs")
                except Exception:  # noqa: BLE001 - one domain failing leaves the others
                    row[name] = {"error": traceback.format_exc()}
                tps = row[name].get("tokens_per_s")
                vs = "" if name in ("engine_default", "no_spec") else \
                    f", {ratio(tps, row.get('engine_default', {}).get('tokens_per_s'))}x default"
                log(f"fig 1: {d} {name}: {tps} tok/s, "
                    f"acceptance {row[name].get('acceptance_length')}{vs}")
            eng = None
            free_memory()
    except Exception:  # noqa: BLE001 - the variant table still runs
        res["ready"] = res.get("ready") or {"error": traceback.format_exc()}
        res["domains_error"] = traceback.format_exc()
    eng = default = None
    free_memory()
    domain_summary(res, outs)


def domain_summary(res: dict, outs: dict) -> None:
    """Per domain (`res["domains"]`): the default's ratio to no speculation, its acceptance,
    and how many of its streams are token-identical to no speculation's (`outs`: {domain:
    {variant: streams}}), and each challenger's (`res["config"]["domain_variants"]`) ratio to
    the default; then `res["headline"]` and the goals, from those numbers."""
    ratios, names = {}, res["config"].get("domain_variants") or []
    for d, row in res["domains"].items():
        mine, ref = row.get("engine_default", {}), row.get("no_spec", {})
        ratios[d] = row["vs_no_spec"] = ratio(mine.get("tokens_per_s"), ref.get("tokens_per_s"))
        for c in names:
            if "tokens_per_s" in row.get(c, {}):
                row[c]["vs_default"] = ratio(row[c]["tokens_per_s"], mine.get("tokens_per_s"))
        row["acceptance_length"] = mine.get("acceptance_length")
        row["per_position_acceptance"] = mine.get("per_position_acceptance")
        a, b = outs.get(d, {}).get("engine_default"), outs.get(d, {}).get("no_spec")
        if a is not None and b is not None:
            row["token_identical"] = {"identical": sum(x == y for x, y in zip(a, b)),
                                      "of": min(len(a), len(b))}
    measured = {d: r for d, r in ratios.items() if r is not None}
    best = max(measured, key=measured.get, default=None)
    worst = min(measured.values(), default=None)
    res["headline"] = {
        "variant": "engine_default", "spec": res["config"].get("engine_default_spec"),
        "per_domain": {d: {"no_spec": row.get("no_spec", {}).get("tokens_per_s"),
                           "engine_default": row.get("engine_default", {}).get("tokens_per_s"),
                           "vs_no_spec": row["vs_no_spec"],
                           "acceptance_length": row["acceptance_length"],
                           "challengers": {c: {k: row.get(c, {}).get(k)
                                               for k in ("tokens_per_s", "vs_default")}
                                           for c in names}}
                       for d, row in res["domains"].items()},
        "min_vs_no_spec": worst, "best_domain": best, "best_vs_no_spec": measured.get(best),
        "challengers": challenger_summary(res["domains"], names)}
    first = res.get("ready", {}).get("first_over_steady")
    res.setdefault("goals", {}).update({
        # a domain that failed to measure fails the goal
        f"engine_default_at_least_{GOAL_EVERY}x_no_spec_every_domain":
            None if not ratios else len(measured) == len(ratios) and worst >= GOAL_EVERY,
        f"engine_default_best_domain_above_{GOAL_BEST:g}x":
            None if best is None else measured[best] > GOAL_BEST,
        "engine_default_min_vs_no_spec": worst,
        "engine_default_best_domain": best,
        f"first_request_within_{GOAL_FIRST}x_steady": None if first is None else
            first <= GOAL_FIRST,
        "engine_default_best_across_domains":
            default_best(res["headline"]["challengers"], len(res["domains"])),
    })


def spec_variants(args, spec) -> dict:
    """Every speculation setting of the variant table, by name."""
    dyn = f"eagle3_dynamic_k{args.dynamic_k}"
    return {"no_spec": None, "eagle3_k5": eagle(args, 5, False, False),
            "eagle3_k7": eagle(args, 7, False, False),
            dyn: eagle(args, args.dynamic_k, True, False),
            "eagle3_k5_context": eagle(args, 5, False, True),
            "eagle3_k7_context": eagle(args, 7, False, True),
            f"{dyn}_context": eagle(args, args.dynamic_k, True, True),
            "ngram_k5": ngram(5), "engine_default": spec}


def table_variants(args, spec) -> dict:
    """The variant table's speculation settings by name, those --fig1-table keeps."""
    variants = spec_variants(args, spec)
    if args.fig1_table.strip() == "all":
        return variants
    keep = [v.strip() for v in args.fig1_table.split(",") if v.strip() and v.strip() != "none"]
    bad = [v for v in keep if v not in variants]
    if bad:
        raise ValueError(f"--fig1-table: unknown {bad}; have {list(variants)}, all or none")
    return {v: variants[v] for v in keep}


def domain_variants(args, spec) -> dict:
    """The table's settings --fig1-domain-variants names, by name: the headline's challengers
    of engine_default on every domain (it and no_spec run there anyway, so are not named)."""
    have = {k: v for k, v in spec_variants(args, spec).items()
            if k not in ("no_spec", "engine_default")}
    names = [v.strip() for v in args.fig1_domain_variants.split(",") if v.strip()]
    bad = [v for v in names if v not in have]
    if bad:
        raise ValueError(f"--fig1-domain-variants: unknown {bad}; have {list(have)} "
                         "(no_spec and engine_default run on every domain anyway), or empty")
    return {v: have[v] for v in dict.fromkeys(names)}


def fig_single_stream(args, res: dict) -> None:
    n = args.fig1_tokens
    spec = engine_default(args)
    # both lists checked before anything runs: a misspelt name fails in seconds, not after
    # the headline
    variants, challengers = table_variants(args, spec), domain_variants(args, spec)
    msgs = held_out_messages(args.fig1_prompts, args.prompt_offset)
    res["config"] = {"prompts": len(msgs), "max_tokens": n, "ignore_eos": True,
                     "greedy": True, "prefix_caching": False, "num_blocks": args.num_blocks,
                     "prompt_source": "held-out split of cluster/prompt_sets.py",
                     "tokens_per_s": "generated tokens / wall time of each generate call, "
                                     "prefill included, one prompt at a time",
                     "engine_default_spec": asdict(spec)}
    headline(args, res, spec, n, challengers)
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
        model = load_hf(args.model, torch_dtype(args), args.device)
        log("fig 1: HF generate, eager (dynamic cache)")
        hf["eager"] = run_hf(model, hf_prompts, n)
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
        hf["compiled"] = hf_compiled(model, hf_prompts, n)
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


def plot_domains(ax, res: dict) -> None:
    """Grouped bars per domain, no speculation beside the engine's default, with the goal
    (GOAL_EVERY x no speculation) over each group and the ratio over each default bar."""
    rows = res.get("domains", {})
    names, w = list(rows), 0.38
    tps = {v: [rows[d].get(v, {}).get("tokens_per_s") or 0 for d in names]
           for v in ("no_spec", "engine_default")}
    ax.bar([i - w / 2 for i in range(len(names))], tps["no_spec"], w, label="no speculation")
    ax.bar([i + w / 2 for i in range(len(names))], tps["engine_default"], w,
           label="engine default speculation")
    for i, d in enumerate(names):
        ax.hlines(GOAL_EVERY * tps["no_spec"][i], i - w, i + w, colors="red", linestyles="--",
                  label=f"goal: {GOAL_EVERY}x no speculation" if i == 0 else None)
        if rows[d].get("vs_no_spec") is not None:
            ax.text(i + w / 2, tps["engine_default"][i], f"{rows[d]['vs_no_spec']:.2f}x",
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens/s (single stream)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    ready = res.get("ready", {})
    ax.set_title(f"fig 1: held-out split per domain, {res['environment'].get('gpu') or 'cpu'}; "
                 f"ready in {ready.get('total_s')} s, first request "
                 f"{ready.get('first_over_steady')}x steady")


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
