"""Figure 6: the deterministic mode (`EngineConfig.deterministic`) beside the default mode. Per
comparison, how many held-out prompts keep the tokens of the single-stream no-speculation run
of the same mode: speculation, many streams arriving apart, a prefix-cache hit, chunked
prefill, disaggregation, seeded sampling and a restarted process; and what the mode costs in
tokens/s at 1 and many streams, with and without speculation."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace

from bench.common import (
    SETTINGS_ENV,
    acceptance,
    code_tasks,
    eagle,
    first_diff,
    free_memory,
    handed_off,
    head_summary,
    lazy_torch,
    load_smol,
    log,
    ngram,
    precapture,
    ratio,
    rnd,
    save,
    single,
    spec_counts,
    staggered,
    sync,
    torch_dtype,
    variant,
)

MODES = (("deterministic", True), ("default", False))
FIG6_SMOKE = {"fig6_prompts": 4, "fig6_tokens": 8, "fig6_short_tokens": 6, "fig6_min_len": 16,
              "fig6_max_len": 64, "fig6_streams": "8,4", "fig6_chunk": 16, "fig6_ks": "1,7",
              "fig6_cost_prompts": 2, "fig6_cost_reps": 1}
DIGESTS = "fig6 digests:"  # the restarted process's answer line


def fig6_base(args):
    """(engine holding the weights, its EAGLE-3 head, text -> prompt ids): SmolLM2 with the
    shipped head and its chat template, or with --fig6-smoke a tiny random model with a random
    head whose 256 ids are bytes."""
    from engine.config import SpecConfig

    if not getattr(args, "fig6_smoke", False):
        base = load_smol(args, spec=SpecConfig(head=args.head))
        return base, base.spec.head, \
            lambda text: base.encode_prompt([{"role": "user", "content": text}])
    from engine.testing import random_head, tiny_engine

    base = tiny_engine(0, vocab_size=256, max_position=512, num_blocks=64, block_size=16,
                       device=args.device, dtype=torch_dtype(args), enable_prefix_caching=False)
    return base, random_head(base), lambda text: list(text.encode())[:args.fig6_max_len]


def digests(outs: list[list[int]]) -> list[str]:
    return [hashlib.sha256(json.dumps(o).encode()).hexdigest()[:16] for o in outs]


def agreement(outs, refs, n: int) -> dict:
    """How many of `outs` equal their reference over the first `n` tokens, and where the others
    diverge (stream index -> first differing token)."""
    diverged = {}
    for i, (o, r) in enumerate(zip(outs, refs)):
        a, b = list(o[:n]), list(r[:n])
        if a != b:
            diverged[str(i)] = first_diff(a, b)
    return {"identical": len(outs) - len(diverged), "of": len(outs), "diverged_at": diverged}


def restarted(args, prompts, n: int, blocks: int, timeout: float) -> dict[str, list[str]]:
    """Per mode, digests of each prompt's tokens from a fresh process running the single-stream
    reference again (`child_main`), on engines of `blocks` KV blocks like this process's."""
    keys = ("model", "head", "device", "dtype", "fig6_smoke", "fig6_max_len", "context_drafts",
            "accept_model")
    spec = {"args": {k: getattr(args, k, None) for k in keys}, "prompts": prompts, "tokens": n,
            "num_blocks": blocks}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        # The same thread count: on a CPU it may change how a reduction splits.
        env = {**os.environ, "OMP_NUM_THREADS": str(lazy_torch().get_num_threads())}
        proc = subprocess.run([sys.executable, "-m", "bench.fig6_deterministic", f.name],
                              cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(DIGESTS)]
    if proc.returncode or not lines:
        raise RuntimeError(f"the restarted process failed ({proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len(DIGESTS):])


def child_main(path: str) -> None:
    """The restarted process: the same model and prompts, each mode's single-stream reference."""
    from engine import SamplingParams

    if os.environ.get(SETTINGS_ENV):  # the parent's --set values
        from bench.suite import apply_inherited
        apply_inherited()

    with open(path) as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"])
    base, head, _ = fig6_base(args)
    params = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
    out = {}
    for mode, det in MODES:
        eng = variant(base, head, det, num_blocks=spec["num_blocks"])
        precapture(eng, (1,))
        out[mode] = digests(single(args, eng, spec["prompts"], params)[0])
    print(DIGESTS + json.dumps(out), flush=True)


def cost_table(args, main, prompts, n: int, many: int) -> dict:
    """Tokens/s of each main engine, in turns (rotated each repetition), median: one stream
    (--fig6-cost-prompts prompts of lengths spread over all, one at a time) and `many` streams
    in one burst."""
    from bench.fig3_concurrency import turns
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    c, p = args.fig6_cost_prompts, len(prompts)
    ones = [prompts[round(i * (p - 1) / max(1, c - 1))] for i in range(min(c, p))]  # all lengths
    burst = [prompts[i % p] for i in range(many)]
    names = [(m, k) for m in main for k in main[m]]
    rates: dict = {key: {"1": [], str(many): []} for key in names}
    for rep in range(args.fig6_cost_reps):
        for m, k in turns(names, rep):
            eng = main[m][k]
            outs, secs = single(args, eng, ones, params)
            rates[(m, k)]["1"].append(sum(map(len, outs)) / secs)
            sync(args)
            t0 = time.perf_counter()
            outs = [done.token_ids for done in eng.generate(burst, params)]
            sync(args)
            rates[(m, k)][str(many)].append(sum(map(len, outs)) / (time.perf_counter() - t0))
    table: dict = {}
    for streams in ("1", str(many)):
        for k in main["default"]:
            cell = {m: rnd(statistics.median(rates[(m, k)][streams]), 1) for m in main}
            cell["reps"] = {m: [rnd(x, 1) for x in rates[(m, k)][streams]] for m in main}
            cell["deterministic_over_default"] = ratio(cell["deterministic"], cell["default"])
            table.setdefault(f"streams_{streams}", {})[k] = cell
    return table


def blocks_needed(prompts, streams: int, n: int, block_size: int) -> int:
    """KV blocks for `streams` streams cycling through `prompts`, n tokens each, drafts too."""
    per = [-(-(len(p) + n + 16) // block_size) + 1 for p in prompts]
    return sum(per[i % len(per)] for i in range(streams)) + 64


class Rows:
    """Figure 6's comparisons, each run in both modes against that mode's reference (each
    prompt alone on a no-speculation engine); the main engines (no-spec and EAGLE-3 default,
    per mode) serve the references, the stream and sampling rows and the cost table."""

    def __init__(self, args, res: dict, base, head, prompts):
        from engine import SamplingParams

        self.args, self.res, self.base, self.head, self.prompts = args, res, base, head, prompts
        self.start = time.perf_counter()
        self.n, self.short = args.fig6_tokens, min(args.fig6_short_tokens, args.fig6_tokens)
        self.many, self.few = (int(x) for x in str(args.fig6_streams).split(","))
        self.nb = blocks_needed(prompts, self.many, self.n, base.config.block_size)
        self.greedy = SamplingParams(temperature=0, max_tokens=self.n, ignore_eos=True)
        self.brief = replace(self.greedy, max_tokens=self.short)
        self.sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=args.fig6_seed + i,
                                       max_tokens=self.short, ignore_eos=True)
                        for i in range(len(prompts))]
        self.main: dict = {}
        self.ref: dict = {}
        self.sref: dict = {}
        res["comparisons"], res["skipped_comparisons"] = {}, []

    def references(self, spec0) -> None:
        """Build and capture the main engines, then each mode's greedy and sampled references."""
        self.main = {m: {"no_spec": variant(self.base, self.head, d, num_blocks=self.nb),
                         "eagle3": variant(self.base, self.head, d, spec=spec0,
                                           num_blocks=self.nb)} for m, d in MODES}
        self.res["graphs"] = {f"{m}_{k}": precapture(e, range(1, self.many + 1))
                              for m in self.main for k, e in self.main[m].items()}
        self.res["references"] = {}
        for m, _ in MODES:
            self.ref[m], secs = single(self.args, self.main[m]["no_spec"], self.prompts,
                                       self.greedy)
            self.sref[m] = single(self.args, self.main[m]["no_spec"], self.prompts,
                                  self.sampled)[0]
            self.res["references"][m] = {
                "tokens_per_s": rnd(sum(map(len, self.ref[m])) / secs, 1),
                "digests": digests(self.ref[m])}

    def late(self, name: str) -> bool:
        """Past --fig6-deadline-s: `name` is listed as skipped."""
        if time.perf_counter() - self.start <= self.args.fig6_deadline_s:
            return False
        self.res["skipped_comparisons"].append(name)
        return True

    def compare(self, name: str, what: str, tokens: int, run, idx=None,
                sampled: bool = False) -> None:
        """`run(mode, deterministic)` -> (outputs, extra fields), in both modes; stream i is
        compared with the reference of prompt idx[i] (default: i)."""
        if self.late(name):
            return
        row: dict = {"what": what, "tokens_compared": tokens}
        self.res["comparisons"][name] = row
        refs = self.sref if sampled else self.ref
        try:
            for m, d in MODES:
                t0 = time.perf_counter()
                outs, info = run(m, d)
                want = [refs[m][i] for i in (idx or range(len(outs)))]
                row[m] = {**agreement(outs, want, tokens), **info,
                          "seconds": rnd(time.perf_counter() - t0, 2)}
        except Exception:  # noqa: BLE001 - recorded; the next comparison still runs
            row["error"] = traceback.format_exc()
        free_memory()  # the engines this comparison built
        log(f"fig 6: {name}: " + ", ".join(
            f"{m} {row[m]['identical']}/{row[m]['of']}" for m, _ in MODES if m in row)
            + (" (failed)" if "error" in row else ""))
        save(self.args.out, dict(self.res, partial=f"running; {name} done"))

    def fresh(self, deterministic: bool, **kw):
        eng = variant(self.base, self.head, deterministic, num_blocks=self.nb, **kw)
        precapture(eng, (1,))
        return eng

    def alone(self, eng, params) -> tuple[list, dict]:
        before = spec_counts(eng)
        outs = single(self.args, eng, self.prompts, params)[0]
        return outs, {"acceptance_length": acceptance(before, spec_counts(eng))}

    def streams(self, k: int, key: str, params):
        """(run, idx): k streams of the prompts cycled on main engine `key`, arriving apart."""
        idx = [i % len(self.prompts) for i in range(k)]
        plist = [params[i] for i in idx] if isinstance(params, list) else params
        ps = [self.prompts[i] for i in idx]
        return (lambda m, d: (staggered(self.main[m][key], ps, plist, self.args.fig6_stagger),
                              {})), idx

    def prefix_hit(self, m: str, d: bool):
        eng = self.fresh(d, enable_prefix_caching=True)
        single(self.args, eng, self.prompts, replace(self.greedy, max_tokens=1))  # all cached
        hits = eng.blocks.prefix_hit_tokens
        outs = single(self.args, eng, self.prompts, self.brief)[0]
        return outs, {"prefix_hit_tokens": eng.blocks.prefix_hit_tokens - hits,
                      "prompt_tokens": sum(map(len, self.prompts))}

    def disaggregated(self, m: str, d: bool):
        pre, dec = self.fresh(d), self.fresh(d)
        return [handed_off(pre, dec, [p], self.brief)[0] for p in self.prompts], {}

    def restart(self) -> None:
        """A fresh process's single-stream references against this one's, per prompt digest."""
        if self.late("restarted_process"):
            return
        row: dict = {"what": "the single-stream reference again in a new process (digests of "
                             "each prompt's tokens)", "tokens_compared": self.n}
        self.res["comparisons"]["restarted_process"] = row
        left = self.args.fig6_deadline_s - (time.perf_counter() - self.start)
        t0 = time.perf_counter()
        try:
            kid = restarted(self.args, self.prompts, self.n, self.nb, timeout=max(60.0, left))
        except Exception:  # noqa: BLE001 - recorded; the comparisons go on
            row["error"] = traceback.format_exc()
            return
        for m, _ in MODES:
            mine = self.res["references"][m]["digests"]
            diverged = [i for i, (a, b) in enumerate(zip(kid[m], mine)) if a != b]
            row[m] = {"identical": len(mine) - len(diverged), "of": len(mine),
                      "diverged": diverged}
        row["seconds"] = rnd(time.perf_counter() - t0, 1)
        log(f"fig 6: restarted_process: deterministic {row['deterministic']['identical']}/"
            f"{len(mine)}, default {row['default']['identical']}/{len(mine)}")


def fig_deterministic(args, res: dict) -> None:
    from engine.config import SpecConfig

    if getattr(args, "fig6_smoke", False):
        args = argparse.Namespace(**{**vars(args), **FIG6_SMOKE})
    log("fig 6: loading the model, building the prompts")
    base, head, encode = fig6_base(args)
    prompts, shared = code_tasks(args.fig6_prompts, args.fig6_min_len, args.fig6_max_len, encode)
    r = Rows(args, res, base, head, prompts)
    spec0 = SpecConfig(head=args.head)  # what an engine speculates with unless told
    res["config"] = fig6_config(args, base, prompts, shared, r.nb, spec0)
    log(f"fig 6: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens; references (each prompt alone, no speculation)")
    r.references(spec0)
    main_rows(r)
    r.main = {}
    free_memory()
    fresh_rows(r)
    res["goals"] = fig6_goals(res)


def main_rows(r: Rows) -> None:
    """The comparisons on the main engines, then the cost table."""
    arrive = f"one arriving every {r.args.fig6_stagger} engine steps"
    r.compare("eagle3_default", "EAGLE-3 as engines run it unless told (dynamic K, context "
              "drafts), one stream", r.n, lambda m, d: r.alone(r.main[m]["eagle3"], r.greedy))
    for k, key in ((r.many, "no_spec"), (r.many, "eagle3"), (r.few, "eagle3")):
        r.compare(f"streams{k}_staggered_{key}", f"{k} concurrent streams ({key}), {arrive}",
                  r.short, *r.streams(k, key, r.brief))
    r.compare("sampled_eagle3", "seeded sampling (T=0.8, top-p 0.95, one seed per prompt), "
              "EAGLE-3 default, one stream", r.short,
              lambda m, d: r.alone(r.main[m]["eagle3"], r.sampled), sampled=True)
    for key in ("no_spec", "eagle3"):
        r.compare(f"sampled_streams{r.many}_staggered_{key}", f"seeded sampling, {r.many} "
                  f"streams ({key}), {arrive}", r.short, *r.streams(r.many, key, r.sampled),
                  sampled=True)
    if r.late("cost"):
        return
    log("fig 6: cost, the main engines in turns")
    try:
        r.res["cost"] = cost_table(r.args, r.main, r.prompts, r.n, r.many)
    except Exception:  # noqa: BLE001 - recorded; the comparisons go on
        r.res["cost_error"] = traceback.format_exc()
    save(r.args.out, dict(r.res, partial="running; cost done"))


def fresh_rows(r: Rows) -> None:
    """The comparisons that build engines of their own, one comparison at a time."""
    r.compare("prefix_cache_hit", "each prompt again on an engine whose prefix cache holds "
              "its full blocks (shared-prefix prompts hit from the first pass too)", r.short,
              r.prefix_hit)
    r.compare("chunked_prefill", f"prefill in chunks of at most {r.args.fig6_chunk} tokens "
              "(max_num_batched_tokens)", r.short,
              lambda m, d: (single(r.args, r.fresh(d, max_num_batched_tokens=r.args.fig6_chunk),
                                   r.prompts, r.brief)[0], {}))
    r.compare("disaggregated", "prefill engine -> KV blocks copied -> decode engine, in "
              "process, one prompt at a time", r.short, r.disaggregated)
    r.restart()
    r.compare("ngram_k5", "n-gram drafts, fixed K=5, one stream", r.n,
              lambda m, d: r.alone(r.fresh(d, spec=ngram(5)), r.greedy))
    for k in (int(x) for x in str(r.args.fig6_ks).split(",")):
        r.compare(f"eagle3_k{k}", f"EAGLE-3 fixed K={k}, one stream", r.n,
                  lambda m, d, k=k: r.alone(r.fresh(d, spec=eagle(r.args, k, False)),
                                            r.greedy))


def fig6_config(args, base, prompts, shared, nb: int, spec0) -> dict:
    from engine.loader import shipped_head

    smoke = bool(getattr(args, "fig6_smoke", False))
    out = {"smoke": smoke, "model": base.config.model.name, "dtype": args.dtype,
           "attention_backend": base.config.backend_name, "prompts": len(prompts),
           "prompt_source": "code-completion tasks: signatures and docstrings of Python's "
                            "standard library (STDLIB) as context, then a function to write; "
                            f"Python {sys.version.split()[0]}",
           "prompt_tokens": [len(p) for p in prompts], "shares_prefix_with": shared,
           "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16],
           "max_tokens": args.fig6_tokens, "ignore_eos": True, "num_blocks": nb,
           "reference": "per mode, each prompt alone on a no-speculation engine of that mode "
                        "(whole prefill, no prefix cache), greedy; for sampled rows the same "
                        "with the same seeds",
           "identical": "token for token over a comparison's first tokens_compared tokens",
           "streams": args.fig6_streams, "stagger_steps": args.fig6_stagger,
           "engine_default_spec": {"method": spec0.method, "num_tokens": spec0.num_tokens,
                                   "dynamic": spec0.dynamic,
                                   "context_drafts": spec0.context_drafts},
           "cost": f"tokens/s, median of {args.fig6_cost_reps} turns: one stream over "
                   f"{args.fig6_cost_prompts} prompts spread over the lengths, and one burst of "
                   f"{args.fig6_streams.split(',')[0]} streams; generate wall time, prefill "
                   "included"}
    if base.config.backend_name == "triton":
        import torch

        from engine.attention.triton_backend import long_context

        out["split_kv_threshold_keys"] = long_context(torch.device(args.device))
    if not smoke:
        out["eagle3_head"] = head_summary(args.head or shipped_head(base.config.model))
    return out


def fig6_goals(res: dict) -> dict:
    rows = [r for r in res["comparisons"].values() if "error" not in r]
    failed = [k for k, r in res["comparisons"].items() if "error" in r]

    def total(mode: str) -> str:
        return f"{sum(r[mode]['identical'] for r in rows)}/{sum(r[mode]['of'] for r in rows)}"

    differs = any(r["deterministic"]["identical"] < r["deterministic"]["of"] for r in rows)
    cells = [c for s in res.get("cost", {}).values() for c in s.values()]
    worst = min((c["deterministic_over_default"] for c in cells
                 if c["deterministic_over_default"] is not None), default=None)
    return {"deterministic_identical": total("deterministic"),
            "default_identical": total("default"),
            # None: every comparison that ran was identical, but some did not run or failed
            "deterministic_100pct_identical": False if differs or not rows
            else (None if res["skipped_comparisons"] or failed else True),
            "comparisons_skipped": list(res["skipped_comparisons"]),
            "comparisons_failed": failed,
            "deterministic_min_speed_vs_default": worst,
            "cost_at_most_10pct": None if worst is None else worst >= 0.90,
            "cost_at_most_5pct": None if worst is None else worst >= 0.95}


def plot_deterministic(plt, res):
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    names = [k for k, r in res["comparisons"].items() if "error" not in r]
    for j, (m, _) in enumerate(MODES):
        vals = [res["comparisons"][k][m]["identical"] / res["comparisons"][k][m]["of"]
                for k in names]
        a.barh([i + 0.4 * j for i in range(len(names))], vals, height=0.4, label=m)
    a.set_yticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
    a.invert_yaxis()
    a.set_xlabel("share of streams identical to the lone no-speculation run")
    a.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)  # above the bars
    cells = [(f"{s.removeprefix('streams_')} x {k}", c)
             for s, row in res.get("cost", {}).items() for k, c in row.items()]
    for j, (m, _) in enumerate(MODES):
        b.bar([i + 0.4 * j for i in range(len(cells))], [c[m] or 0 for _, c in cells],
              width=0.4, label=m)
    b.set_xticks([i + 0.2 for i in range(len(cells))], [n for n, _ in cells], fontsize=8)
    b.set_ylabel("tokens/s")
    b.set_yscale("log")
    b.legend()
    fig.suptitle(f"fig 6: deterministic mode, {res['environment'].get('gpu') or 'cpu'}")
    return fig


if __name__ == "__main__":
    child_main(sys.argv[1])
