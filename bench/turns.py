"""Single-stream engines taking turns in one process (`bench.loop_copies`, `bench.policy_ab`):
figure 1's runs (`bench.suite.run_single`) of several variants, the order rotated each
repetition, so host drift lands on all alike. A variant is an engine config plus module
settings set before each of its turns (flags read at run time, or baked into graphs at the
engine's first turn)."""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict

from bench.common import (
    command_line,
    eagle,
    environment,
    held_out_messages,
    load_smol,
    log,
    model_arguments,
    model_defaults,
    rnd,
    save_json,
    setting,
    start_trace,
    take_trace,
)
from engine.spec.policy import switched


def trace_summary(trace: list) -> dict:
    """Steps by drafts per sequence: count, median ms, mean tokens (`StepCosts.trace` rows;
    steps that are not a pure decode, drafts None, under "other"; steps switching K are
    counted per level all the same, and apart under "switches")."""
    by = defaultdict(list)
    for _, drafts, ms, tokens, _, _ in trace:
        by[-1.0 if drafts is None else drafts].append((ms, tokens or 0))
    out = {"other" if d < 0 else str(d): {
        "steps": len(v), "median_ms": rnd(statistics.median(m for m, _ in v), 4),
        "mean_tokens": rnd(statistics.fmean(t for _, t in v), 3)} for d, v in sorted(by.items())}
    out["switches"] = sum(switched(how) for *_, how, _ in trace)
    return out


def _reset_policy(eng) -> None:
    """A new dynamic-K policy for the engine, keeping what its graphs set (`levels`,
    `levels_at`)."""
    from engine.spec.policy import KPolicy

    old = eng.spec.policy
    new = KPolicy(old.spec, old.prior, old.knee)
    new.levels, new.levels_at = old.levels, old.levels_at
    eng.spec.policy = new


def take_turns(args, base, prompts: list, variants: dict, reps: int, num_blocks: int,
               traces: bool = False) -> dict:
    """Run every variant (name -> (SpecConfig or None, {"module.ATTR": value}[, "reset"]))
    `reps` times over `prompts`, engines built from `base` on their first turn and kept
    ("reset": the dynamic-K policy's measurements and state start afresh each turn). Returns
    {"runs": name -> the runs' results (tok/s, acceptance, token identity with the first
    no-spec variant's answers under the same settings, else the first variant's, and for
    dynamic K its steps by draft count and `why` each fused step got its K; with `traces`,
    every step as the cost model saw it and every pick, (K, why), in order), "answers": the
    first variant's first answers and their prompts}. Each turn starts from the settings as
    they were (only its own changed), and they are put back as they were after."""
    names = list(variants)
    saved = {p: getattr(*setting(p)) for v in variants.values() for p in v[1]}
    from bench.suite import run_single

    engines: dict = {}
    out: dict = {"runs": {n: [] for n in names}}
    # Token identity is against the first no-spec variant with the same settings (kernel
    # settings change rounding, so no-spec under each is its own baseline), else the first.
    plain = [n for n in names if variants[n][0] is None]
    base_of = {n: next((b for b in plain if variants[b][1] == variants[n][1]), names[0])
               for n in names}
    base_answers: dict = {}  # baseline name -> its first answers
    try:
        for rep in range(reps):
            r = rep % len(names)
            for name in names[r:] + names[:r]:
                spec, sets, *how = variants[name]
                # every setting any variant names as it was, then this variant's: a variant
                # naming none runs at the defaults, not at the last turn's values
                for path, value in {**saved, **sets}.items():
                    setattr(*setting(path), value)
                eng = engines.get(name)
                if eng is None:
                    eng = engines[name] = base.with_config(spec=spec, num_blocks=num_blocks)
                elif "reset" in how:
                    _reset_policy(eng)
                tracing = spec is not None and spec.dynamic and start_trace(eng)
                why = Counter(eng.spec.policy.batch_why) if tracing else None
                res = run_single(args, eng, prompts, args.tokens)
                outs = res.pop("_outs")
                if tracing:
                    steps, picks = take_trace(eng, picks=True)
                    res["steps_by_drafts"] = trace_summary(steps)
                    if traces:
                        res["trace"], res["picks"] = steps, picks
                    # why dynamic K picked each fused step's K in this run (`KPolicy.batch_why`)
                    res["why"] = dict(sorted((Counter(eng.spec.policy.batch_why) - why).items()))
                if name in (names[0], base_of[name]) and name not in base_answers:
                    base_answers[name] = outs
                    if name == names[0]:
                        out["answers"] = {"prompts": prompts, "outputs": outs}
                else:
                    res["token_identical_to_no_spec"] = sum(
                        a == b for a, b in zip(outs, base_answers.get(base_of[name], [])))
                out["runs"][name].append(res)
                log(f"rep {rep} {name}: {res['tokens_per_s']} tok/s, "
                    f"acceptance {res['acceptance_length']}")
    finally:
        for path, value in saved.items():
            setattr(*setting(path), value)
    first = max(r["tokens_per_s"] for r in out["runs"][names[0]])
    out["best_vs_first"] = {k: rnd(max(r["tokens_per_s"] for r in v) / first, 3)
                            for k, v in out["runs"].items()}
    out["median_vs_first"] = {
        k: rnd(statistics.median(r["tokens_per_s"] for r in v)
               / statistics.median(r["tokens_per_s"] for r in out["runs"][names[0]]), 3)
        for k, v in out["runs"].items()}
    log(f"best of each / best {names[0]}: {out['best_vs_first']}")
    log(f"median of each / median {names[0]}: {out['median_vs_first']}")
    return out


def turn_arguments(p, out: str, reps: int) -> None:
    """The options every turn-taking script shares: the model's, and --prompts, --tokens,
    --reps, --num-blocks, --out."""
    model_arguments(p)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--out", default=out)


def run_turns(name: str, args, make_variants, extra: dict | None = None,
              traces: bool = False) -> dict:
    """Load SmolLM2, take figure 1's first held-out prompts, run `make_variants(args)`'s
    variants in turns (`take_turns`, the first of them no-spec) and write the JSON to
    args.out: the command, date, environment, `extra`, every run, and each variant's best
    and median tok/s over no-spec's."""
    model_defaults(args)
    args.prompt_offset = 0
    msgs = held_out_messages(args.prompts, 0)
    base = load_smol(args, spec=eagle(args, 5, False, False), num_blocks=args.num_blocks)
    prompts = [base.encode_prompt(m) for m in msgs]
    res = {"name": name, "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           **(extra or {}), "prompts": len(prompts), "tokens": args.tokens, "reps": args.reps,
           **take_turns(args, base, prompts, make_variants(args), args.reps, args.num_blocks,
                        traces=traces)}
    res["best_vs_no_spec"] = res.pop("best_vs_first")
    res["median_vs_no_spec"] = res.pop("median_vs_first")
    return {"path": save_json(args.out, res), **res}
