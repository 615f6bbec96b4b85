"""Figure 1's headline: the engine's default speculation against none on each domain's
held-out split (`cluster.prompt_sets.domains()`), the acceptance of its drafts by position,
and how long an engine takes to be ready and to serve its first request."""

from __future__ import annotations

import statistics
import time

from bench.common import ratio, rnd, sync, torch_dtype

GOAL_EVERY = 2.5  # the default's tokens/s over no speculation, on every domain's split
GOAL_BEST = 3.0  # ... and beyond this on the best domain
GOAL_FIRST = 1.2  # the first request after ready, over the same request's steady latency
STEADY_REPS = 3  # runs of that request after the first: their median is the steady latency


def engine_default(args):
    """What an engine given `spec=SpecConfig()` runs: every field at its default (--head
    names another EAGLE-3 head)."""
    from engine.config import SpecConfig

    return SpecConfig(head=args.head)


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


def domain_summary(res: dict, outs: dict) -> None:
    """Per domain (`res["domains"]`): the default's ratio to no speculation, its acceptance,
    and how many of its streams are token-identical to no speculation's (`outs`: {domain:
    {variant: streams}}); then `res["headline"]` and the goals, from those numbers."""
    ratios = {}
    for d, row in res["domains"].items():
        mine, ref = row.get("engine_default", {}), row.get("no_spec", {})
        ratios[d] = row["vs_no_spec"] = ratio(mine.get("tokens_per_s"), ref.get("tokens_per_s"))
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
                           "acceptance_length": row["acceptance_length"]}
                       for d, row in res["domains"].items()},
        "min_vs_no_spec": worst, "best_domain": best, "best_vs_no_spec": measured.get(best)}
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
