"""Which drafts a greedy step should verify: the EAGLE-3 head's, the context's, or both.

The target's greedy answer is fixed, so every rule for picking drafts can be replayed on it
without the engine: the answers and their features are generated once (`self_distill`),
the head's chain is run teacher-forced from every position (`ttt_forward`, which the
engine's paged drafting is pinned to), the context lookup (`ngram.ngram_match`) from every
position, and each rule walks the answer step by step: a step at position n verifies the
chosen K drafts, accepts the longest prefix that equals the answer and moves on by that
plus the target's own token. Tokens per step is acceptance length as `SpecStats` counts it.

    python -m bench.draft_oracle --out bench/results/profile/draft_oracle.json [--k 5,7]

Rules: `head` (the head alone), `context_min{m}` (the context's copy where a suffix of at
least m tokens matches, else the head: what `SpecConfig.context_drafts` does with
`context_min_n` = m), `both_min{m}` (both chains verified in one step, the longer accepted
kept: a two-branch tree's upper bound, 1 + 2K verify rows), `confident{p}_min{m}` (as
context_min{m}, but where the two first drafts differ the head's is kept when its
probability is at least p). CPU (fp32) or GPU (bf16); writes one JSON.

`--costs FILE` (a `bench.fused_costs` JSON; its batch-1 row) also prices the steps: a step
verifying K drafts runs the fused graph of the verify level above K and the draft level at or
above the next step's K, the device microseconds measured there, and speed is relative to its
plain decode step. For the shipped rule (context from `--rule-min-n`, else the head) it
gives every fixed K and the best any dynamic-K policy could do with foresight (a shortest
path over (position, K): the bound on what choosing K can buy with this head and these costs),
under the measured prices, the same prices at every K (`every_level`: each K its own graph)
and three cheaper ones (`what_if`). `--cut` prices fixed K at the largest `--k` under the
device cut of the verify (`engine.spec.fused.CUT_PROB`: drafts verified while the product
of the head's probabilities holds), rows past the drafts verified dead at `--dead-row-us`.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from bench.common import (
    command_line,
    environment,
    log,
    model_arguments,
    replay_engine,
    save_json,
    torch_dtype,
)


def head_chains(head, target, rec, k: int):
    """Per position t of the record: the head's k chained drafts from t (teacher-forced:
    drafts that are right feed the next step as the engine's own drafts would) as target
    ids [L, k] (row t predicts ids[t+2 .. t+k+1]), and each draft's probability under the
    head [L, k]."""
    import torch

    from cluster.train_eagle3 import ttt_forward

    dev = next(head.parameters()).device
    ids = rec.ids.to(dev)
    aux = rec.aux.to(dev, next(head.parameters()).dtype)[None]
    with torch.no_grad():
        outs = ttt_forward(head, target.embed_tokens, aux, ids[1:][None], k)
        preds, probs = [], []
        for out in outs:
            lp = head.logits(out[0]).softmax(-1)
            best = lp.argmax(-1)
            preds.append(head.draft_to_target[best])
            probs.append(lp.gather(-1, best[:, None])[:, 0])
    return (torch.stack(preds, 1).cpu().tolist(),
            torch.stack(probs, 1).float().cpu().tolist())


def lead(drafts, answer, n: int) -> int:
    """How many of `drafts` (for positions n, n+1, ...) equal the answer there."""
    a = 0
    for d in drafts:
        if n + a >= len(answer) or answer[n + a] != d:
            break
        a += 1
    return a


def walk(answer, start: int, pick) -> list[int]:
    """Tokens emitted per step from position `start` (tokens before it known) to the end:
    `pick(n)` is how many drafts the step at n gets accepted."""
    n, steps = start, []
    while n < len(answer):
        got = min(pick(n) + 1, len(answer) - n)
        steps.append(got)
        n += got
    return steps


def context_copies(answer, prompt_len: int, k: int, max_n: int) -> dict:
    """{position n: (m, drafts)}: the longest suffix of at most max_n tokens before n with an
    earlier copy (m tokens; 0: none) and the k tokens the copy drafts there. A rule of
    context_min_n = m' copies where m >= m' (the lookup tries the longest suffix first)."""
    from engine.spec import ngram

    ctx = {}
    for n in range(prompt_len + 1, len(answer)):
        m, end = ngram.ngram_match(answer[:n], max_n, 1)
        ctx[n] = (m, ngram.continue_copy(answer[:n], end, k) if m else [])
    return ctx


def replay(answer, prompt_len: int, chains, probs, ctx: dict, k: int, min_ns, confidences):
    """Every rule's steps on one answer (ids = prompt + answer) at K = k: `chains` and `ctx`
    (`context_copies`) may hold longer drafts, of which the first k count; `probs` the
    chains' drafts' probabilities (`head_chains`)."""

    def head_acc(n):
        return lead(chains[n - 2][:k], answer, n)

    def ctx_acc(n):
        return lead(ctx[n][1][:k], answer, n)

    def context(n, m):
        return ctx_acc(n) if ctx[n][0] >= m else head_acc(n)

    def both(n, m):
        return max(head_acc(n), ctx_acc(n)) if ctx[n][0] >= m else head_acc(n)

    def confident(n, m, p):
        if ctx[n][0] >= m and (ctx[n][1][0] == chains[n - 2][0] or probs[n - 2][0] < p):
            return ctx_acc(n)
        return head_acc(n)

    rules = {"head": head_acc}
    for m in min_ns:
        rules[f"context_min{m}"] = partial(context, m=m)
        rules[f"both_min{m}"] = partial(both, m=m)
        for p in confidences:
            rules[f"confident{p}_min{m}"] = partial(confident, m=m, p=p)
    start = prompt_len + 1  # after the prefill the target's first token is known
    return {name: walk(answer, start, f) for name, f in rules.items()}


def step_prices(path: str) -> tuple[float, dict]:
    """(plain decode us, {(q, d): fused step us}) from a `bench.fused_costs` JSON's batch-1
    row."""
    import json

    with open(path) as f:
        row = next(r for r in json.load(f)["rows"] if r["batch"] == 1)
    return row["plain_decode_us"], {(c["q"], c["drafts"]): c["device_us"] for c in row["fused"]}


def rule_accepts(answer, chains, ctx: dict, k: int, min_n: int) -> dict:
    """{position n: drafts of the k-long chain the shipped rule verifies there (the
    context's copy where a suffix of at least min_n tokens matches, else the head's) that
    the answer accepts}. A K-chain for K < k is its prefix: min(K, this) of it pass."""
    return {n: lead(d[:k] if m >= min_n else chains[n - 2][:k], answer, n)
            for n, (m, d) in ctx.items()}


def cut_accepts(answer, chains, probs, ctx: dict, k: int, min_n: int, cut: float) -> dict:
    """{position n: (drafts accepted, drafts verified)} of the shipped rule at fixed K=k with
    the device cut (`engine.spec.fused.CUT_PROB` = cut): the head's chain is verified only
    while the product of its drafts' probabilities stays at least `cut`; a context copy
    (suffix of at least min_n tokens) is never cut (its drafts count as probability 1)."""
    out = {}
    for n, (m, d) in ctx.items():
        if m >= min_n:
            out[n] = (lead(d[:k], answer, n), k)
            continue
        kept, p = 0, 1.0
        for j in range(k):
            p *= probs[n - 2][j]
            if p < cut:
                break
            kept += 1
        out[n] = (lead(chains[n - 2][:kept], answer, n), kept)
    return out


def cut_timing(answers, prices, kmax: int, dead_us: float) -> dict:
    """Speed over plain decoding (as `timing`) of fixed K=kmax steps under the device cut:
    answers [(end, start, {n: (accepted, verified)})] (`cut_accepts`). A step's graph keeps
    its verify level's rows; of them, rows past the drafts verified are dead (their GEMV
    programs exit, `ops.SKIP_DEAD_ROWS`) at dead_us each, the rest at the measured price of
    that many rows (`every_level`); the chain always drafts kmax. Also the mean drafts
    verified a step and the acceptance length."""
    plain, cost = prices
    full = every_level(cost)
    qlev = next(x for x in sorted({q for q, _ in cost}) if x > kmax)
    dlev = next(x for x in sorted({d for _, d in cost}) if x >= kmax)
    t = steps = verified = tokens = 0
    for end, start, acc in answers:
        n = start
        tokens += end - start
        while n < end:
            got, kept = acc[n]
            t += full[(kept + 1, dlev)] + (qlev - kept - 1) * dead_us
            steps += 1
            verified += kept
            n += 1 + min(got, kept)
    return {"speed": round(tokens * plain / t, 3), "acceptance": round(tokens / steps, 3),
            "verified": round(verified / steps, 2)}


def every_level(cost: dict) -> dict:
    """The fused-step prices {(q, d): us} at every q and d inside the measured grid, linear
    between the measured levels (first along d at each measured q, then along q): the
    graphs an engine would have with a level for every K (fixed K=5's own q=6, d=5 where
    a K=7 table has only q=8, d=7)."""
    qs = sorted({q for q, _ in cost})
    ds = sorted({d for _, d in cost})

    def between(x, xs, at):
        hi = next(i for i, v in enumerate(xs) if v >= x)
        if xs[hi] == x:
            return at(xs[hi])
        lo = hi - 1
        w = (x - xs[lo]) / (xs[hi] - xs[lo])
        return (1 - w) * at(xs[lo]) + w * at(xs[hi])

    def at(q, d):
        return between(q, qs, lambda qq: between(d, ds, lambda dd: cost[(qq, dd)]))

    return {(q, d): at(q, d) for q in range(qs[0], qs[-1] + 1)
            for d in range(ds[0], ds[-1] + 1)}


def what_if(prices) -> dict:
    """The measured step prices and three cheaper worlds: verify rows free (each step at
    its draft level's one-row price), drafts free (each at its verify level's no-draft
    price), and everything a step costs beyond a plain decode halved; and the measured
    prices at every level (`every_level`: each K its own graph, as a fixed-K engine has)."""
    plain, cost = prices
    return {"measured": prices, "every_level": (plain, every_level(cost)),
            "verify_rows_free": (plain, {(q, d): cost[(1, d)] for q, d in cost}),
            "drafts_free": (plain, {(q, d): cost[(q, 0)] for q, d in cost}),
            "overhead_halved": (plain, {k: plain + 0.5 * (v - plain) for k, v in cost.items()})}


def geometric_rule(end: int, start: int, acc, price, plain: float, kmax: int) -> float:
    """Time over one answer of dynamic K's model rule (`policy.DynamicK.choose` at one
    stream, without its measured-win and losing overrides) given the prices exactly: the
    sequence's acceptance rate a (accepted over tried drafts, each sum decayed by
    ACCEPT_DECAY a verify; the prior until the first), K maximizing (1 - a^(K+1)) / (1 - a)
    over the step's price relative to a plain decode, drafting only past MARGIN and each
    deeper K past MARGIN of the best shallower, a one-draft probe every PROBE_EVERY idle
    steps. Its drafts are made a step ahead: the K verified at n was chosen at the step
    before."""
    from engine.spec import policy

    a_acc = a_tried = 0.0
    rate, idle = 0.6, 0
    n, t, k = start, 0.0, 0
    while n < end:
        a = min(rate, 0.999)
        best_k, best, need = 0, 1.0, policy.MARGIN
        for kk in range(1, kmax + 1):
            gain = (1 - a ** (kk + 1)) / (1 - a) / (price(kk, kk) / plain)
            if gain > best * need:
                best_k, best, need = kk, gain, policy.MARGIN
        if best_k == 0:
            idle += 1
            if idle % policy.PROBE_EVERY == 0:
                best_k = 1
        t += price(k, best_k)
        got = min(k, acc[n])
        if k:
            a_acc = policy.ACCEPT_DECAY * a_acc + got
            a_tried = policy.ACCEPT_DECAY * a_tried + got + (1 if got < k else 0)
            rate = a_acc / a_tried
        n += 1 + got
        k = best_k
    return t


def live_rule(answers, price, levels: tuple, kmax: int, plain: float,
              spec=None) -> tuple[float, dict]:
    """Time over the answers [(end, start, accepts)] of the engine's own dynamic K for fused
    steps at one stream (`policy.KPolicy`: `begin_propose` and `choose_batch` with its plain
    and draft probes, retries and measured overrides, `update`, and `StepCosts.record` fed
    each step's exact price), in the overlapped pipeline's order: step t's next K is chosen
    at its launch, before step t-1's result is read (a two-step lag), and verified at step
    t+1. One policy across the answers, as one engine serves them; each answer a fresh
    sequence. `spec`: the SpecConfig to run (default: SpecConfig's own at K=kmax). Returns
    (microseconds, the picks' counts by (K, why))."""
    from collections import Counter
    from types import SimpleNamespace

    from engine.config import SpecConfig
    from engine.spec import policy

    pol = policy.KPolicy(spec or SpecConfig(num_tokens=kmax))
    pol.levels = levels
    pol.picks = []
    t_us, step = 0.0, 0
    for end, start, acc in answers:
        seq = SimpleNamespace(accept_rate=None, accept_counts=None, accept_runs=None,
                              idle_steps=0, params=SimpleNamespace(greedy=True, seed=None))
        n, kcur, pending = start, 0, None  # pending: step t-1's (k, got, us, tokens, kn)
        while n < end:
            pol.begin_propose(step, 1)
            want = pol.choose_batch([seq], 1)
            if pending is not None:  # step t-1's result, read after step t's launch
                k, got, us, tokens, kn = pending
                pol.update(seq, k, got)
                pol.costs.record(1, pol.paid(k, kn), us * 1e-6, tokens, "fused",
                                 pol.paid(k) != pol.paid(kn))
            kn = max(0, min(want, end - n - kcur - 2))  # what the answer may still emit
            us = price(kcur, kn)
            got = min(kcur, acc[n])
            pending = (kcur, got, us, 1 + got, kn)
            t_us += us
            n += 1 + got
            kcur, step = kn, step + 1
    return t_us, dict(Counter(f"{k}:{why}" for k, why in pol.picks))


def live_variants(answers, price, levels: tuple, kmax: int, plain: float,
                  variants: dict) -> dict:
    """`live_rule` under each variant, name -> (SpecConfig fields, {"module.NAME": value}
    set for its replay and put back after, `bench.spec_ab.parse_variant`): its speed over
    plain decoding and its picks."""
    from dataclasses import replace

    from bench.common import module_settings
    from engine.config import SpecConfig

    tokens = sum(end - start for end, start, _ in answers)
    out = {}
    for name, (fields, sets) in variants.items():
        with module_settings(sets):
            t, picks = live_rule(answers, price, levels, kmax, plain,
                                 replace(SpecConfig(num_tokens=kmax), **fields))
        out[name] = {"speed": round(tokens * plain / t, 3), "picks": dict(sorted(picks.items()))}
    return out


def timing(answers, prices, kmax: int, variants: dict | None = None) -> dict:
    """Speed relative to plain decoding (tokens x plain step / time) of the answers
    [(length, start, accepts)] pooled, per fixed K and for the best K sequence chosen with
    foresight. A step verifying k drafts and drafting k2 for the next costs the fused
    graph of the verify level above k and the draft level at or above k2. `variants`: the
    engine's dynamic K replayed under each too (`live_variants`)."""
    plain, cost = prices
    qs = sorted({q for q, _ in cost})
    ds = sorted({d for _, d in cost})

    def price(k, k2):
        return cost[(next(x for x in qs if x > k), next(x for x in ds if x >= k2))]

    tokens = sum(end - start for end, start, _ in answers)
    out = {"plain_us": plain, "fixed_k": {}}
    for k in range(kmax + 1):
        t = 0.0
        for end, start, acc in answers:
            n = start
            while n < end:
                t += price(k, k)
                n += 1 + min(k, acc[n])
        out["fixed_k"][k] = round(tokens * plain / t, 3)
    t = 0.0
    for end, start, acc in answers:
        t += geometric_rule(end, start, acc, price, plain, kmax)
    out["geometric_rule"] = round(tokens * plain / t, 3)
    t, picks = live_rule(answers, price, (tuple(qs), tuple(ds)), kmax, plain)
    out["live_rule"] = round(tokens * plain / t, 3)
    out["live_picks"] = dict(sorted(picks.items()))
    if variants:
        out["live_variants"] = live_variants(answers, price, (tuple(qs), tuple(ds)), kmax,
                                             plain, variants)
    t_best = 0.0
    for end, start, acc in answers:
        # best[n][k]: the least time from position n, k drafts (made the step before) to
        # verify there, to the answer's end. The first step's drafts come with the prefill.
        best = {end + j: [0.0] * (kmax + 1) for j in range(kmax + 1)}
        for n in range(end - 1, start - 1, -1):
            best[n] = [min(price(k, k2) + best[n + 1 + min(k, acc[n])][k2]
                           for k2 in range(kmax + 1)) for k in range(kmax + 1)]
        t_best += min(best[start])
    out["foresight_bound"] = round(tokens * plain / t_best, 3)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--k", default="5,7", help="comma list of draft counts")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--fig1-prompts", type=int, default=16,
                   help="figure 1's prompts (its first held-out ones; 4 before 83efbc4)")
    p.add_argument("--other-prompts", type=int, default=12)
    p.add_argument("--min-n", default="2,3,4", help="comma list of context_min_n values")
    p.add_argument("--confidence", default="0.5,0.8,0.95",
                   help="comma list of head first-draft probabilities for confident*")
    p.add_argument("--costs", default="bench/results/profile/fused_costs_784d963/fused_costs.json",
                   help="bench.fused_costs JSON to price steps with ('' for none)")
    p.add_argument("--rule-min-n", type=int, default=3,
                   help="context_min_n of the rule --costs prices")
    p.add_argument("--cut", default="0,0.005,0.01,0.02,0.03,0.05",
                   help="comma list of CUT_PROB values to price at the largest --k")
    p.add_argument("--dead-row-us", type=float, default=8.8,
                   help="what a dead verify row costs (us; the H200 at 05f9b80: 8 dead rows "
                        "+61 us over one, bench/results/profile/dead_rows_05f9b80)")
    p.add_argument("--live-variant", action="append", default=None,
                   metavar="NAME:FIELD=VALUE,...",
                   help="with --costs, replay the engine's dynamic K also under these "
                        "SpecConfig fields and module constants (module.NAME=VALUE, as "
                        "bench.spec_ab takes them; repeatable)")
    p.add_argument("--out", default="bench/results/profile/draft_oracle.json")
    args = p.parse_args(argv)
    from bench.spec_ab import parse_variant

    try:
        variants = {name: (fields, sets) for name, fields, sets
                    in map(parse_variant, args.live_variant or [])}
    except ValueError as e:
        p.error(str(e))

    from dataclasses import replace

    from cluster import prompt_sets
    from cluster.train_eagle3 import self_distill
    from engine import Engine
    from engine.config import SpecConfig

    base = replay_engine(args)
    ks = [int(x) for x in args.k.split(",")]
    spec = Engine(replace(base.config, spec=SpecConfig(num_tokens=max(ks), head=args.head)),
                  weights_of=base)
    head, max_n = spec.spec.head.eval(), spec.config.spec.ngram_max
    layers = head.cfg.aux_layer_ids
    _, held_out = prompt_sets.build()
    n1, n2 = args.fig1_prompts, args.other_prompts
    sets = {"fig1": (held_out[:n1], True), "other": (held_out[n1 : n1 + n2], False)}
    min_ns = [int(x) for x in args.min_n.split(",")]
    confs = [float(x) for x in args.confidence.split(",") if x]
    prices = step_prices(args.costs) if args.costs else None
    res = {"name": "draft_oracle", "command": command_line(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
           "max_tokens": args.tokens, "ngram_max": max_n, "sets": {}}
    for name, (prompts, ignore_eos) in sets.items():
        t0 = time.perf_counter()
        recs = self_distill(base, prompts, args.tokens, layers, torch_dtype(args),
                            desc=name, ignore_eos=ignore_eos)
        out = {"num_prompts": len(prompts), "ignore_eos": ignore_eos,
               "answer_tokens": [len(r.ids) - r.prompt_len for r in recs], "k": {}}
        kmax = max(ks)
        # Per answer once, at the longest K: a shorter chain or copy is its prefix.
        reps = []
        for r in recs:
            chains, probs = head_chains(head, base.model, r, kmax)
            ids = r.ids.tolist()
            reps.append((ids, r.prompt_len, chains, probs,
                         context_copies(ids, r.prompt_len, kmax, max_n)))
        if prices is not None:
            answers = [(len(ids), plen + 1, rule_accepts(ids, chains, ctx, kmax,
                                                         args.rule_min_n))
                       for ids, plen, chains, _, ctx in reps]
            out["priced"] = {"rule": f"context_min{args.rule_min_n}", "costs": args.costs,
                             **{what: timing(answers, c, kmax,
                                             variants if what == "measured" else None)
                                for what, c in what_if(prices).items()}}
            log(f"{name} priced: " + ", ".join(
                f"{w} fixed K best {max(v['fixed_k'].values())} geometric rule "
                f"{v['geometric_rule']} bound {v['foresight_bound']}"
                for w, v in out["priced"].items() if isinstance(v, dict)))
            for vname, v in out["priced"]["measured"].get("live_variants", {}).items():
                log(f"{name} live rule {vname}: {v['speed']} {v['picks']}")
            # the device cut at K=kmax, dead rows at --dead-row-us (0: no cut, rows past
            # the drafts dead all the same)
            out["priced"]["cut"] = {
                "dead_row_us": args.dead_row_us, "k": kmax,
                **{str(c): cut_timing([(len(ids), plen + 1, cut_accepts(
                    ids, chains, probs, ctx, kmax, args.rule_min_n, c))
                    for ids, plen, chains, probs, ctx in reps], prices, kmax,
                    args.dead_row_us)
                   for c in (float(x) for x in args.cut.split(",") if x)}}
            log(f"{name} cut at K={kmax}: " + ", ".join(
                f"{c} {v['speed']} ({v['verified']} verified)"
                for c, v in out["priced"]["cut"].items() if isinstance(v, dict)))
        for k in ks:
            per_rule: dict[str, list] = {}
            for ids, plen, chains, probs, ctx in reps:
                steps = replay(ids, plen, chains, probs, ctx, k, min_ns, confs)
                for rule, s in steps.items():
                    per_rule.setdefault(rule, []).append(s)
            out["k"][k] = {rule: {"acceptance_length": round(sum(map(sum, s)) /
                                                             max(sum(map(len, s)), 1), 3),
                                  "per_prompt": [round(sum(x) / max(len(x), 1), 3) for x in s],
                                  "steps": sum(map(len, s))}
                           for rule, s in per_rule.items()}
            log(f"{name} K={k}: " + ", ".join(f"{rule} {v['acceptance_length']}"
                                              for rule, v in out["k"][k].items()))
        out["seconds"] = round(time.perf_counter() - t0, 1)
        res["sets"][name] = out
    return {"path": save_json(args.out, res), **res}


if __name__ == "__main__":
    main()
