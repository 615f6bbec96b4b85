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
    acceptance,
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
# Python's own standard library: signatures and docstrings, text no prompt set here holds.
STDLIB = ("posixpath", "shutil", "textwrap", "statistics", "difflib", "inspect", "fractions",
          "calendar", "ipaddress", "string", "json", "csv", "fnmatch", "heapq", "bisect", "html",
          "urllib.parse", "email.utils", "random", "tempfile", "argparse", "functools",
          "zipfile", "gzip", "pprint", "shlex", "copy", "dataclasses", "base64",
          "configparser", "logging", "pathlib", "tarfile", "mailbox", "ftplib", "imaplib")
DOC_CHARS = 900  # of one docstring, so no single stub makes a prompt jump past its length
SHARE_EVERY = 4  # every fourth prompt asks about another function after its predecessor's text
FIG6_SMOKE = {"fig6_prompts": 4, "fig6_tokens": 8, "fig6_short_tokens": 6, "fig6_min_len": 16,
              "fig6_max_len": 64, "fig6_streams": "8,4", "fig6_chunk": 16, "fig6_ks": "1,7",
              "fig6_cost_prompts": 2, "fig6_cost_reps": 1}
DIGESTS = "fig6 digests:"  # the restarted process's answer line


def stdlib_stubs() -> list[str]:
    """"def name(signature): docstring" of the documented pure-Python functions and methods of
    `STDLIB`, in a fixed order; signatures showing an object's address are left out (they
    change between processes)."""
    import importlib
    import inspect

    out = []
    for name in STDLIB:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for qual, fn in _functions(mod):
            doc = inspect.getdoc(fn)
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if doc and " at 0x" not in sig:
                body = "\n".join("    " + ln for ln in doc[:DOC_CHARS].splitlines())
                out.append(f"# {name}.{qual}\ndef {qual.rpartition('.')[2]}{sig}:\n"
                           f'    """\n{body}\n    """\n')
    return out


def _functions(mod) -> list[tuple[str, object]]:
    import inspect

    out = []
    for n, obj in sorted(vars(mod).items()):
        if n.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            out.append((n, obj))
        elif inspect.isclass(obj):
            out += [(f"{n}.{m}", f) for m, f in sorted(vars(obj).items())
                    if not m.startswith("_") and inspect.isfunction(f)]
    return out


def task(context: list[str], target: str) -> str:
    head = "Here are signatures and docstrings from Python's standard library:\n\n" \
        if context else ""
    return (f"{head}{''.join(context)}\nWrite the body of this function, then explain it in "
            f"two sentences:\n\n{target}")


def code_tasks(n: int, lo: int, hi: int, encode) -> tuple[list[list[int]], list]:
    """`n` code-completion prompts (token ids): stdlib stubs as context, then a function to
    write. Lengths rise geometrically from about `lo` to `hi` tokens; every `SHARE_EVERY`-th
    prompt keeps its predecessor's context and asks for the next function (a long shared
    prefix). Returns the prompts and, per prompt, the index it shares a prefix with."""
    stubs = stdlib_stubs()
    own = [i for i in range(n) if i % SHARE_EVERY != SHARE_EVERY - 1]
    goal = {i: lo * (hi / lo) ** (k / max(1, len(own) - 1)) for k, i in enumerate(own)}
    prompts, shared, windows = [], [], []
    for i in range(n):
        if i in goal:  # context stubs [start, end), then stub `end` to write
            start = (i * 97) % len(stubs)
            windows.append((start, _fill(stubs, start, goal[i], encode)))
            shared.append(None)
        else:  # the previous prompt's context, the function after its target
            windows.append((windows[-1][0], windows[-1][1] + 1))
            shared.append(i - 1)
        start, target = windows[-1]
        end = target if i in goal else windows[-2][1]
        text = task(_ring(stubs, start, end), _ring(stubs, target, target + 1)[0])
        if start == end and len(encode(text)) > goal.get(i, hi):  # the function's first line
            doc = text.split('"""')[1].strip().split("\n")[0]
            text = f'{text[:text.index(chr(34) * 3) + 3]}{doc}"""\n'
        prompts.append(encode(text))
    return prompts, shared


def _fill(stubs: list[str], start: int, goal: float, encode) -> int:
    """The end of the longest run of stubs from `start` whose task (the stub after it to
    write) stays within `goal` tokens."""
    end = start
    while end + 1 < start + len(stubs) and len(encode(task(
            _ring(stubs, start, end + 1), _ring(stubs, end + 1, end + 2)[0]))) <= goal:
        end += 1
    return end


def _ring(stubs: list[str], a: int, b: int) -> list[str]:
    return [stubs[j % len(stubs)] for j in range(a, b)]


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


def fig_deterministic(args, res: dict) -> None:
    from engine import SamplingParams
    from engine.config import SpecConfig

    if getattr(args, "fig6_smoke", False):
        args = argparse.Namespace(**{**vars(args), **FIG6_SMOKE})
    start = time.perf_counter()
    n, short = args.fig6_tokens, min(args.fig6_short_tokens, args.fig6_tokens)
    many, few = (int(x) for x in str(args.fig6_streams).split(","))
    every = args.fig6_stagger
    log("fig 6: loading the model, building the prompts")
    base, head, encode = fig6_base(args)
    prompts, shared = code_tasks(args.fig6_prompts, args.fig6_min_len, args.fig6_max_len, encode)
    nb = blocks_needed(prompts, many, n, base.config.block_size)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    brief = replace(greedy, max_tokens=short)
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=args.fig6_seed + i,
                              max_tokens=short, ignore_eos=True) for i in range(len(prompts))]
    spec0 = SpecConfig(head=args.head)  # what an engine speculates with unless told
    res["config"] = fig6_config(args, base, prompts, shared, nb, spec0)
    main = {m: {"no_spec": variant(base, head, d, num_blocks=nb),
                "eagle3": variant(base, head, d, spec=spec0, num_blocks=nb)} for m, d in MODES}
    res["graphs"] = {f"{m}_{k}": precapture(e, range(1, many + 1))
                     for m in main for k, e in main[m].items()}
    log(f"fig 6: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens; references (each prompt alone, no speculation)")
    ref, sref = {}, {}
    res["references"] = {}
    for m, _ in MODES:
        ref[m], secs = single(args, main[m]["no_spec"], prompts, greedy)
        sref[m] = single(args, main[m]["no_spec"], prompts, sampled)[0]
        res["references"][m] = {"tokens_per_s": rnd(sum(map(len, ref[m])) / secs, 1),
                                "digests": digests(ref[m])}
    cmp: dict = {}
    skipped: list[str] = []
    res["comparisons"], res["skipped_comparisons"] = cmp, skipped

    def compare(name: str, what: str, tokens: int, run, idx=None, refs=ref) -> None:
        if time.perf_counter() - start > args.fig6_deadline_s:
            skipped.append(name)
            return
        row: dict = {"what": what, "tokens_compared": tokens}
        cmp[name] = row
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
        save(args.out, dict(res, partial=f"running; {name} done"))

    def fresh(d, **kw):
        eng = variant(base, head, d, num_blocks=nb, **kw)
        precapture(eng, (1,))
        return eng

    def alone(eng, params):
        before = spec_counts(eng)
        outs = single(args, eng, prompts, params)[0]
        return outs, {"acceptance_length": acceptance(before, spec_counts(eng))}

    def streams(k: int, spec: str, params):
        idx = [i % len(prompts) for i in range(k)]
        plist = [params[i] for i in idx] if isinstance(params, list) else params
        return (lambda m, d: (staggered(main[m][spec], [prompts[i] for i in idx], plist,
                                        every), {})), idx

    def prefix_hit(m, d):
        eng = fresh(d, enable_prefix_caching=True)
        single(args, eng, prompts, replace(greedy, max_tokens=1))  # every prompt's blocks cached
        hits = eng.blocks.prefix_hit_tokens
        outs = single(args, eng, prompts, brief)[0]
        return outs, {"prefix_hit_tokens": eng.blocks.prefix_hit_tokens - hits,
                      "prompt_tokens": sum(map(len, prompts))}

    def disaggregated(m, d):
        pre, dec = fresh(d), fresh(d)
        return [handed_off(pre, dec, p, brief) for p in prompts], {}

    arrive = f"one arriving every {every} engine steps"
    compare("eagle3_default", "EAGLE-3 as engines run it unless told (dynamic K, context "
            "drafts), one stream", n, lambda m, d: alone(main[m]["eagle3"], greedy))
    for k, spec in ((many, "no_spec"), (many, "eagle3"), (few, "eagle3")):
        run, idx = streams(k, spec, brief)
        compare(f"streams{k}_staggered_{spec}", f"{k} concurrent streams ({spec}), {arrive}",
                short, run, idx)
    compare("sampled_eagle3", "seeded sampling (T=0.8, top-p 0.95, one seed per prompt), "
            "EAGLE-3 default, one stream", short,
            lambda m, d: alone(main[m]["eagle3"], sampled), refs=sref)
    for spec in ("no_spec", "eagle3"):
        run, idx = streams(many, spec, sampled)
        compare(f"sampled_streams{many}_staggered_{spec}", f"seeded sampling, {many} streams "
                f"({spec}), {arrive}", short, run, idx, refs=sref)
    if time.perf_counter() - start <= args.fig6_deadline_s:
        log("fig 6: cost, the main engines in turns")
        try:
            res["cost"] = cost_table(args, main, prompts, n, many)
        except Exception:  # noqa: BLE001 - recorded; the comparisons go on
            res["cost_error"] = traceback.format_exc()
        save(args.out, dict(res, partial="running; cost done"))
    else:
        skipped.append("cost")
    main = None
    free_memory()
    compare("prefix_cache_hit", "each prompt again on an engine whose prefix cache holds its "
            "full blocks (shared-prefix prompts hit from the first pass too)", short, prefix_hit)
    compare("chunked_prefill", f"prefill in chunks of at most {args.fig6_chunk} tokens "
            "(max_num_batched_tokens)", short,
            lambda m, d: (single(args, fresh(d, max_num_batched_tokens=args.fig6_chunk),
                                 prompts, brief)[0], {}))
    compare("disaggregated", "prefill engine -> KV blocks copied -> decode engine, in process, "
            "one prompt at a time", short, disaggregated)
    restart_row(args, res, prompts, n, start, skipped)
    compare("ngram_k5", "n-gram drafts, fixed K=5, one stream", n,
            lambda m, d: alone(fresh(d, spec=ngram(5)), greedy))
    for k in (int(x) for x in str(args.fig6_ks).split(",")):
        compare(f"eagle3_k{k}", f"EAGLE-3 fixed K={k}, one stream", n,
                lambda m, d, k=k: alone(fresh(d, spec=eagle(args, k, False)), greedy))
    res["goals"] = fig6_goals(res)


def restart_row(args, res: dict, prompts, n: int, start: float, skipped: list) -> None:
    """A fresh process's single-stream reference against this one's, per prompt digest."""
    left = args.fig6_deadline_s - (time.perf_counter() - start)
    if left <= 0:
        skipped.append("restarted_process")
        return
    t0 = time.perf_counter()
    row: dict = {"what": "the single-stream reference again in a new process (digests of each "
                         "prompt's tokens)", "tokens_compared": n}
    res["comparisons"]["restarted_process"] = row
    try:
        kid = restarted(args, prompts, n, res["config"]["num_blocks"], timeout=max(60.0, left))
    except Exception:  # noqa: BLE001 - recorded; the comparisons go on
        row["error"] = traceback.format_exc()
        return
    for m, _ in MODES:
        mine = res["references"][m]["digests"]
        diverged = [i for i, (a, b) in enumerate(zip(kid[m], mine)) if a != b]
        row[m] = {"identical": len(mine) - len(diverged), "of": len(mine),
                  "diverged": diverged}
    row["seconds"] = rnd(time.perf_counter() - t0, 1)
    log(f"fig 6: restarted_process: deterministic {row['deterministic']['identical']}/"
        f"{len(prompts)}, default {row['default']['identical']}/{len(prompts)}")


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
    a.legend(loc="lower left")
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
