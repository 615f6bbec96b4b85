"""Figure 3: SmolLM2 throughput against concurrent streams. Headline: the engine's default
speculation against none, and its challengers (fixed K=5, dynamic K up to --dynamic-k,
--fig3-candidate) against it; burst and steady measures, the variants taking turns in every
repetition."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

from bench.common import (
    acceptance,
    challenger_summary,
    default_best,
    eagle,
    engine_default,
    free_memory,
    head_summary,
    held_out_messages,
    lazy_torch,
    load_smol,
    log,
    paths_delta,
    precapture,
    ratio,
    rnd,
    spec_counts,
    spec_fields,
    step_paths,
    sync,
)
from engine.loader import shipped_head

DEFAULT = "engine_default"  # the variant the goals judge: what an engine speculates by default
GOAL_NO_SPEC = 0.97  # the default's least ratio to no speculation, at every concurrency
# Per measure: the prefix of its row keys (tokens_per_s, vs_no_spec, vs_default) and of its
# summary's key (ratio_vs_no_spec).
MEASURES = {"burst": "", "steady": "steady_", "steady_mixed": "steady_mixed_"}


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
                                   "finish in one step. All variants' engines stay "
                                   "alive and take turns in every repetition (the order "
                                   "rotated each time, bench.suite.turns)",
                     "prompts": "held-out split of cluster/prompt_sets.py, cycled"}
    log("fig 3: loading SmolLM2 + EAGLE-3 head")
    base = load_smol(args, spec=eagle(args, 5, False))
    res["config"]["eagle3_head"] = head_summary(args.head or shipped_head(base.config.model))
    msgs = held_out_messages(max(conc), args.prompt_offset)
    prompts = [base.encode_prompt(m) for m in msgs]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    spec = engine_default(args)
    res["config"]["engine_default_spec"] = asdict(spec)
    variants = {"no_spec": None, DEFAULT: spec, "eagle3_k5": eagle(args, 5, False),
                f"eagle3_dynamic_k{args.dynamic_k}": eagle(args, args.dynamic_k, True)}
    candidates = candidate_variants(DEFAULT, args.fig3_candidate)
    keys = {name: name[len(DEFAULT) + 1:] for name in candidates}  # "candidate", ...
    for name, fields in candidates.items():
        # the default with some SpecConfig fields changed, in turns with the rest
        variants[name] = replace(spec, **fields)
        key = keys[name]
        res["config"][key] = fields
        if fields.get("head"):  # a second head in turns with the first (head A/B at c streams)
            res["config"][f"{key}_eagle3_head"] = head_summary(fields["head"])
    res["config"]["challengers"] = [v for v in variants if v not in ("no_spec", DEFAULT)]
    table: dict[str, list[dict]] = {name: [] for name in variants}
    res["runs"] = table
    traces: dict[str, list] = {}  # --fig3-trace
    walls: dict[str, float] = {}  # --fig3-trace: each burst run's wall ms
    probes: dict[str, dict] = {}
    res["host_probe"] = probes  # the host's speed around each concurrency (bench.common)
    # All variants' engines stay alive and take turns in every repetition (`turns`): the
    # host's speed drifts between runs and processes, and a variant measured minutes after
    # its baseline would carry that drift into its ratio.
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
            # are admitted at once) compile here, not inside the timed window.
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
        # A steady window is short at high concurrency, so one stall inside it (a
        # collection, a descheduled host) moves its rate: each is repeated like the burst
        # and each run's stalls are recorded.
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
    concurrency_summary(res, list(keys.values()))
    if args.fig3_trace:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "fig3_trace.json")
        with open(path, "w") as f:
            json.dump(traces, f)
        res["trace"] = os.path.basename(path)
        res["trace_burst_wall_ms"] = walls
    res["break_even_fixed_k5"] = break_even(table["eagle3_k5"])
    low = {m: res["goals"][f"{DEFAULT}_min_ratio_{m}"] for m in MEASURES}
    log(f"fig 3: fixed K=5 break-even {res['break_even_fixed_k5']}; default min {low}")


def concurrency_summary(res: dict, candidates: list[str]) -> None:
    """From `res["runs"]` ({variant: a row per concurrency}): each speculative variant's ratio
    to no speculation per row and measure (`vs_no_spec`, ...) and per measure
    (`ratio_vs_no_spec`, ...); each challenger's (every variant but those two) ratio to the
    default per row (`vs_default`, ...) and summed up per measure (`res["challengers"]`,
    `challenger_summary`); then the goals. `candidates`: the --fig3-candidate keys
    ("candidate", "candidate2", ...), each with its least ratio to no speculation."""
    table, goals = res["runs"], {}
    names = [v for v in table if v not in ("no_spec", DEFAULT)]
    res["challengers"], every = {v: {} for v in names}, {}
    for measure, pre in MEASURES.items():
        tps, vs, vsd = f"{pre}tokens_per_s", f"{pre}vs_no_spec", f"{pre}vs_default"
        ref = {r["concurrency"]: r.get(tps) for r in table["no_spec"]}
        mine = {r["concurrency"]: r.get(tps) for r in table[DEFAULT]}
        res[f"{pre}ratio_vs_no_spec"] = {}
        for name in [DEFAULT, *names]:
            for r in table[name]:
                r[vs] = ratio(r.get(tps), ref.get(r["concurrency"]))
                if name != DEFAULT:
                    r[vsd] = ratio(r.get(tps), mine.get(r["concurrency"]))
            res[f"{pre}ratio_vs_no_spec"][name] = {str(r["concurrency"]): r[vs]
                                                   for r in table[name]}
        rows = {str(c): {DEFAULT: {"tokens_per_s": t}} for c, t in mine.items()}
        for name in names:
            for r in table[name]:
                rows.setdefault(str(r["concurrency"]), {})[name] = {
                    "tokens_per_s": r.get(tps), "vs_default": r[vsd]}
        for name, got in challenger_summary(rows, names).items():
            res["challengers"][name][measure] = got
        every.update({f"{measure} {c}": row for c, row in rows.items()})
        got = [r[vs] for r in table[DEFAULT]]
        low = None if not got or None in got else min(got)
        goals[f"{DEFAULT}_at_least_{GOAL_NO_SPEC}x_no_spec_everywhere_{measure}"] = \
            low is not None and low >= GOAL_NO_SPEC
        goals[f"{DEFAULT}_min_ratio_{measure}"] = low
        for key in candidates:
            name = f"{DEFAULT}_{key}"
            goals[f"{key}_min_ratio_{measure}"] = min(
                (r[vs] for r in table[name] if r[vs] is not None), default=None)
    # false where one challenger is faster than the default at every concurrency measured,
    # in every measure
    goals[f"{DEFAULT}_best_across_concurrencies"] = default_best(
        challenger_summary(every, names), len(every))
    res.setdefault("goals", {}).update(goals)


def host_probe_us(reps: int = 2000) -> dict:
    """The host's speed now, in microseconds per call of what an engine step does most:
    a pure-Python loop (per-sequence bookkeeping) and a small torch op on the host (op
    dispatch). Best of five stretches. The host's speed varies between processes: figure 3
    records this around each concurrency so its ratios can be read against the host they
    ran on."""
    import time

    torch = lazy_torch()
    x = torch.zeros(8)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) / reps * 1e6)
        return round(min(times), 3)

    def python_loop():
        acc = 0
        for i in range(reps):
            acc += len(str(i)) % 3
        return acc

    def torch_ops():
        for _ in range(reps):
            x.add_(1.0)

    return {"python_loop_us": best(python_loop), "torch_op_us": best(torch_ops)}


def start_trace(eng) -> bool:
    """Start recording every step a speculative engine's dynamic-K cost model is offered
    (`StepCosts.trace`); whether it records (False without speculation)."""
    if eng.spec is None:
        return False
    eng.spec.policy.costs.trace = []
    eng.spec.policy.picks = []
    return True


def take_trace(eng, picks: bool = False) -> list | tuple[list, list]:
    """The steps recorded since `start_trace` (with `picks`, also dynamic K's (K, why) of
    every fused step, `KPolicy.picks`), and stop recording."""
    pol = eng.spec.policy
    out, pol.costs.trace = pol.costs.trace, None
    chosen, pol.picks = pol.picks, None
    return (out, chosen) if picks else out


def step_costs(eng) -> dict | None:
    """The dynamic-K cost model as measured per batch bucket: plain step ms, the relative
    price of a draft and fixed cost of drafting, and drafting's measured tokens/s over
    plain's (`StepCosts.measured_gain`)."""
    if eng.spec is None or not eng.spec.spec.dynamic:
        return None
    c = eng.spec.policy.costs.fitted()
    gains = {b: c.measured_gain(b) for b in sorted(c.plain)}
    return {"plain_ms": {str(b): rnd(t * 1e3, 3) for b, t in sorted(c.plain.items())},
            "per_draft": {str(b): rnd(x, 3) for b, x in sorted(c.per_draft.items())},
            "fixed": {str(b): rnd(x, 3) for b, x in sorted(c.fixed.items())},
            "gain": {str(b): rnd(g, 3) for b, g in gains.items() if g is not None}}


def candidate_variants(base: str, texts: list[str] | str | None) -> dict[str, dict]:
    """Figure 3's candidates, one per `--fig3-candidate` ("field=value,..."): the SpecConfig
    fields each changes on the engine's default (`base` names it), named `<base>_candidate`,
    `<base>_candidate2`, ... in the order given. An empty text or a field twice over is
    refused (ValueError), as is a bad field or value (`spec_fields`)."""
    if texts is None:
        return {}
    out = {}
    for i, text in enumerate([texts] if isinstance(texts, str) else texts):
        fields = spec_fields(text)
        if not fields:
            raise ValueError(f"candidate {i + 1} changes no SpecConfig field: {text!r}")
        if fields in out.values():
            raise ValueError(f"candidate {i + 1} repeats an earlier one: {text!r}")
        out[f"{base}_candidate" + (str(i + 1) if i else "")] = fields
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
    from engine.spec.costs import STALL

    if not step_seconds:
        return {"steps": 0, "stalls": 0, "stalled_ms": 0.0, "median_step_ms": None,
                "max_step_ms": None}
    med = statistics.median(step_seconds)
    slow = [t for t in step_seconds if t >= STALL * med]
    return {"steps": len(step_seconds), "stalls": len(slow),
            "stalled_ms": rnd(sum(t - med for t in slow) * 1e3, 2),
            "median_step_ms": rnd(med * 1e3, 3), "max_step_ms": rnd(max(step_seconds) * 1e3, 2)}


def window_mark() -> tuple:
    """Where the Triton compile record, the graph-capture count and the collector's pauses
    stand now."""
    from engine import collector, jit_watch
    from engine.graphs import GraphSet

    collector.watch_pauses()
    return jit_watch.count(), GraphSet.captures, collector.pauses()


def window_events(mark: tuple) -> dict:
    """Kernels compiled ({name: [count, seconds]}), CUDA graphs captured and garbage
    collections ([count, seconds]) since `mark`: stalls inside a timed window."""
    from engine import collector, jit_watch
    from engine.graphs import GraphSet

    n, sec = collector.pauses()
    return {"compiles": jit_watch.summary(jit_watch.since(mark[0])),
            "captures": GraphSet.captures - mark[1],
            "gc": [n - mark[2][0], round(sec - mark[2][1], 4)]}


def steady_throughput(args, eng, prompts, c: int, n: int, generations: int = 3,
                      mixed: bool = False) -> SteadyRun:
    """Tokens/s with `c` streams always in flight: each finished request is replaced at once
    (its prefill counted), and the window ends when the last of generations * c requests is
    admitted. Every request decodes n tokens, or with `mixed` a length from `mixed_lengths`
    (mean n), so streams do not all finish in one step as equal lengths would."""
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
    """Keep c requests in flight, the i-th with max_tokens lengths[i], replacing each that
    finishes until all were admitted; returns the tokens generated and the ids still running.
    Only this run's requests count, since the first step may return outputs of requests an
    earlier run aborted."""
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
        xs = [r["concurrency"] for r in rows]
        # the headline, the engine's default, drawn black and thicker than its challengers
        kw = {"c": "k", "lw": 2.5} if name == DEFAULT else {"c": f"C{i}", "lw": 1.2}
        a.plot(xs, [r["tokens_per_s"] for r in rows], "o-", label=f"{name} burst", **kw)
        a.plot(xs, [r.get("steady_tokens_per_s") for r in rows], "s--",
               label=f"{name} steady", **kw)
        if name != "no_spec":
            b.plot(xs, [r["vs_no_spec"] for r in rows], "o-", label=f"{name} burst", **kw)
            b.plot(xs, [r.get("steady_vs_no_spec") for r in rows], "s--",
                   label=f"{name} steady", **kw)
            b.plot(xs, [r.get("steady_mixed_vs_no_spec") for r in rows], "^:",
                   label=f"{name} steady mixed", **kw)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.legend(fontsize=6)
    a.set_ylabel("tokens/s")
    b.axhline(1.0, c="gray", ls="--")
    b.axhline(GOAL_NO_SPEC, c="gray", ls=":")
    b.set_ylabel("vs no speculation")
    return fig
