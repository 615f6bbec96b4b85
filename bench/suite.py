"""`tandem bench`: the benchmark figures, each a ratio against a baseline measured in the same run.

    tandem bench --figures 1,2,3 --model /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m bench.suite --figures 1,2,3,4 --out bench/results       # the same

Figures (`figN_<name>.json` in --out, plus a PNG when matplotlib imports):

1. single_stream  SmolLM2 single-stream tokens/s: the engine's default speculation against
                  none per prompt domain, time to ready; a table of EAGLE-3 settings,
                  n-gram, HF `generate` eager and static cache + torch.compile.
2. llama8b_shape  random-weight Llama-3.1-8B shape: decode step vs the weight-read floor,
                  verify cost (K+1 tokens vs 1), batch 1..64.
3. concurrency    SmolLM2 throughput vs concurrent streams, speculation vs none.
4. kv_transfer    KV movement between two GPUs: peer copy, in-process transport, UCX.
5. itl_disagg     P50/P99 inter-token latency of decodes while long prompts arrive:
                  colocated vs prefill in its own process on GPU 1, KV over UCX.
6. deterministic  SmolLM2 output identical to a lone no-speculation run across speculation,
                  streams, prefix cache, chunking, disaggregation, sampling and a restart,
                  deterministic mode beside the default; its cost in tokens/s.
7. cold_start     the Python API's first pass over figure 3's workload in fresh processes,
                  speculation vs none; time to ready; compiles after ready.

Each figure records its command, date, GPU, versions and numbers; a failing figure records
its traceback and the next still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from bench.common import (
    SETTINGS_ENV,
    decode_path,
    free_memory,
    header,
    is_cuda,
    lazy_torch,
    log,
    rnd,
    save,
)
from bench.fig1_single_stream import fig_single_stream, plot_single_stream
from bench.fig2_llama8b_shape import fig_llama8b_shape, plot_llama8b
from bench.fig3_concurrency import (  # noqa: F401 - window_*: read from here by tests/engine
    candidate_variants,
    fig_concurrency,
    plot_concurrency,
    window_events,
    window_mark,
)
from bench.fig4_kv_transfer import fig_kv_transfer, plot_kv
from bench.fig5_itl_disagg import fig_itl_disagg, plot_itl
from bench.fig6_deterministic import fig_deterministic, plot_deterministic
from bench.fig7_cold_start import fig_cold_start, plot_cold_start
from cluster.engine_args import unusable_device
from cluster.subcommands import unwritable

FIGURES = {
    1: ("single_stream", fig_single_stream, plot_single_stream),
    2: ("llama8b_shape", fig_llama8b_shape, plot_llama8b),
    3: ("concurrency", fig_concurrency, plot_concurrency),
    4: ("kv_transfer", fig_kv_transfer, plot_kv),
    5: ("itl_disagg", fig_itl_disagg, plot_itl),
    6: ("deterministic", fig_deterministic, plot_deterministic),
    7: ("cold_start", fig_cold_start, plot_cold_start),
}


def setting(path: str):
    """(module, NAME) of a "module.NAME" module constant; refuses a name the module lacks."""
    import importlib

    module, _, name = path.strip().rpartition(".")
    if not module or not name or module.startswith(".") or ".." in module:
        raise ValueError(f"{path!r} is not module.NAME")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise AttributeError(f"{module} has no {name}")
    if callable(getattr(mod, name)) or isinstance(getattr(mod, name), type(importlib)):
        raise ValueError(f"{path} is not a constant (a function, class or module)")
    return mod, name


def parse_setting(item: str) -> tuple[str, object]:
    """("module.NAME", VALUE) of a "module.NAME=VALUE" string (VALUE a Python literal, else a
    string), checked against the module (`setting`) but not set."""
    import ast

    path, sep, raw = item.partition("=")
    if not sep:
        raise ValueError(f"{item!r} is not module.NAME=VALUE")
    old = getattr(*setting(path))
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    number = (int, float)  # None passes: a setting's "off"
    if value is not None and (isinstance(old, bool) and not isinstance(value, bool) or isinstance(
            old, number) and (isinstance(value, bool) or not isinstance(value, number))):
        raise ValueError(f"{path.strip()} is {type(old).__name__} {old!r}, got {value!r}")
    return path.strip(), value


def apply_settings(items: list[str]) -> dict:
    """Set module constants from "module.NAME=VALUE" strings (`parse_setting`) for an A/B
    process; only names the module already has. Returns what was set. They are also left in
    SETTINGS_ENV, so the processes a figure starts (`apply_inherited`) run as this one."""
    done = {}
    for item in items:
        path, value = parse_setting(item)
        setattr(*setting(path), value)
        done[path] = value
    if items:
        os.environ[SETTINGS_ENV] = json.dumps(list(items))
    return done


def apply_inherited() -> dict:
    """In a process a figure started: the parent's --set values (`apply_settings`)."""
    return apply_settings(json.loads(os.environ.get(SETTINGS_ENV) or "[]"))


def count(text: str) -> int:
    """argparse type: a whole number of at least 1 (a count, a size, repetitions)."""
    n = whole(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"wants a whole number of at least 1, got {text!r}")
    return n


def whole(text: str) -> int:
    """argparse type: a whole number of at least 0."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"wants a whole number of at least 0, got {text!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--figures", default="1,2,3,4,5",
                   help="comma-separated figure numbers: 1 single_stream, 2 llama8b_shape, "
                        "3 concurrency, 4 kv_transfer, 5 itl_disagg, 6 deterministic, "
                        "7 cold_start (default: 1-5)")
    p.add_argument("--out", default="bench/results", help="folder for figN_<name>.json/.png")
    p.add_argument("--model", default=None,
                   help="SmolLM2 .gguf file or HF folder (default: the embedded model)")
    p.add_argument("--head", default=None, help="EAGLE-3 head folder (default: the shipped one)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-blocks", type=count, default=8192,
                   help="KV blocks (of 16 tokens) per SmolLM2 engine variant")
    p.add_argument("--prompt-offset", type=whole, default=0,
                   help="first held-out prompt used")
    p.add_argument("--dynamic-k", type=int, default=7, help="max K for dynamic EAGLE-3")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a module constant before any figure runs, for A/B processes "
                        "(e.g. bench.fig5_process.FIG5_UCX_TIMEOUT_S=90); repeatable, recorded "
                        "in each figure's argv")
    p.add_argument("--context-drafts", choices=("on", "off"), default=None,
                   help="EAGLE-3 drafts from the context too (SpecConfig.context_drafts; "
                        "default: its default). Figure 1 runs both.")
    p.add_argument("--quiet-cpus", type=whole, default=4, metavar="N",
                   help="on a GPU, keep the host thread on the N quietest CPUs, timed at start, "
                        "less busy ones (engine/affinity.py; 0: leave the affinity alone)")
    p.add_argument("--accept-model", choices=("geometric", "runs"), default="geometric",
                   help="how dynamic K predicts a K-draft step's tokens (SpecConfig)")
    g = p.add_argument_group("figure 1 (single stream)")
    g.add_argument("--fig1-prompts", type=count, default=16,
                   help="held-out prompts, one at a time (acceptance, and so the ratios, "
                        "move with the text)")
    g.add_argument("--fig1-hf-prompts", type=whole, default=4, metavar="N",
                   help="the HF baselines generate the first N prompts (0: all)")
    g.add_argument("--fig1-tokens", type=count, default=256)
    g.add_argument("--fig1-domains", default="all", metavar="D,D",
                   help="the headline's domains (cluster/prompt_sets.py: code, chat, json, "
                        "summarize, math, general; default all): the engine's default "
                        "speculation against none on each held-out split")
    g.add_argument("--fig1-domain-prompts", type=count, default=16, metavar="N",
                   help="held-out prompts per domain, one at a time")
    g.add_argument("--fig1-domain-variants",
                   default="eagle3_k5_context,eagle3_k7_context,eagle3_dynamic_k7_context",
                   metavar="V,V",
                   help="variants of the table also run on every domain, after engine_default "
                        "and no_spec, each against engine_default (headline challengers, "
                        "figure 3's fixed K=5 and dynamic K<=7 among them; goal "
                        "engine_default_best_across_domains); empty: none")
    g.add_argument("--fig1-table", default="all", metavar="V,V",
                   help="variants of the table on the --fig1-prompts prompts (no_spec, "
                        "eagle3_k5, ..., ngram_k5, engine_default; all; none)")
    g.add_argument("--no-hf-compile", action="store_true",
                   help="skip the HF static cache + torch.compile baseline (minutes of compile)")
    g = p.add_argument_group("figure 2 (Llama-3.1-8B shape)")
    g.add_argument("--fig2-context", type=whole, default=512, help="tokens already in the KV")
    g.add_argument("--fig2-reps", type=count, default=50)
    g.add_argument("--fig2-max-batch", type=count, default=64)
    g.add_argument("--fig2-blocks", type=count, default=2048)
    g.add_argument("--fig2-decode-tokens", type=count, default=128,
                   help="engine.step() decode steps timed at batch 1")
    g.add_argument("--hbm-gib", type=float, default=4.0, help="size of the bandwidth copy")
    g = p.add_argument_group("figure 3 (concurrency)")
    g.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    g.add_argument("--fig3-tokens", type=count, default=128)
    g.add_argument("--fig3-reps", type=count, default=3)
    g.add_argument("--fig3-candidate", action="append", default=None,
                   metavar="FIELD=VALUE,...",
                   help="one more variant: the engine's default speculation with these "
                        "SpecConfig fields changed (e.g. num_tokens=7; dense_levels_from=4; "
                        "head=DIR: another EAGLE-3 head), taking turns with the others and "
                        "challenging the default; goals candidate_min_ratio_*. Repeatable: the "
                        "second is engine_default_candidate2 (goals candidate2_min_ratio_*), "
                        "and so on")
    g.add_argument("--fig3-trace", action="store_true",
                   help="write fig3_trace.json: each dynamic-K window's steps as the cost "
                        "model saw them (batch size, drafts per sequence, ms, tokens, path, "
                        "timed)")
    g = p.add_argument_group("figure 4 (KV transfer)")
    g.add_argument("--fig4-reps", type=count, default=10)
    g.add_argument("--fig4-progress", default="thread", choices=("thread", "thread-polling"),
                   help="ucxx progress mode of the UCX rows (this process and the receivers)")
    g = p.add_argument_group("figure 5 (ITL, colocated vs disaggregated)")
    g.add_argument("--fig5-model", default="llama8b", choices=("llama8b", "tiny"),
                   help="random-weight model shape (tiny: a CPU smoke test)")
    g.add_argument("--fig5-streams", type=count, default=8, help="background decode streams")
    g.add_argument("--fig5-short-len", type=count, default=128, help="their prompt tokens")
    g.add_argument("--fig5-arrivals", type=count, default=8, help="long prompts that arrive")
    g.add_argument("--fig5-prompt-len", type=count, default=8192, help="tokens per long prompt")
    g.add_argument("--fig5-interval-ms", type=float, default=500.0, help="between arrivals")
    g.add_argument("--fig5-long-tokens", type=count, default=16,
                   help="tokens each long request decodes")
    g.add_argument("--fig5-max-steps", type=count, default=2000,
                   help="max tokens of a background stream (it is aborted at the end)")
    g.add_argument("--fig5-step-limit", type=count, default=5000,
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
    g = p.add_argument_group("figure 6 (deterministic mode against the default)")
    g.add_argument("--fig6-prompts", type=count, default=32,
                   help="held-out code-completion prompts (stdlib signatures + docstrings)")
    g.add_argument("--fig6-tokens", type=count, default=256,
                   help="greedy tokens of the references, speculation rows and restart")
    g.add_argument("--fig6-short-tokens", type=count, default=128,
                   help="tokens of the stream, cache, chunking, disaggregation and sampling rows")
    g.add_argument("--fig6-min-len", type=count, default=64, help="shortest prompt, about")
    g.add_argument("--fig6-max-len", type=count, default=2048, help="longest prompt, about")
    g.add_argument("--fig6-streams", default="64,8", metavar="MANY,FEW",
                   help="concurrent streams of the stream rows and the cost table")
    g.add_argument("--fig6-stagger", type=whole, default=2,
                   help="engine steps between arrivals in the stream rows")
    g.add_argument("--fig6-chunk", type=count, default=96,
                   help="max_num_batched_tokens of the chunked-prefill row")
    g.add_argument("--fig6-seed", type=int, default=1234, help="seed of prompt 0 (i: +i)")
    g.add_argument("--fig6-ks", default="1,2,3,4,5,6,7", help="EAGLE-3 fixed K rows")
    g.add_argument("--fig6-cost-prompts", type=count, default=8,
                   help="prompts of the cost table's one-stream measure")
    g.add_argument("--fig6-cost-reps", type=count, default=2)
    g.add_argument("--fig6-deadline-s", type=float, default=390.0,
                   help="start no comparison after this many seconds (skipped ones are listed)")
    g.add_argument("--fig6-smoke", action="store_true",
                   help="tiny sizes on a tiny random model: a smoke test, e.g. --device cpu")
    g = p.add_argument_group("figure 7 (cold start through the Python API)")
    g.add_argument("--fig7-concurrency", default="1,8,64",
                   help="streams of figure 3's workload (--fig3-tokens each), one fresh "
                        "process per variant and concurrency")
    g.add_argument("--fig7-triton-cache", choices=("cold", "warm"), default="cold",
                   help="each process's TRITON_CACHE_DIR: cold = a fresh empty folder per "
                        "process; warm = this process's (TRITON_CACHE_DIR, else Triton's "
                        "default), shared")
    g.add_argument("--fig7-ready-reps", type=count, default=3,
                   help="after prepare_to_serve and one request, the same request this many "
                        "times (its median: the steady latency)")
    g.add_argument("--fig7-reps", type=count, default=3,
                   help="cold processes per variant and concurrency, run as no-spec/EAGLE-3 "
                        "pairs (the first alternating); a ratio is the median over pairs "
                        "(one stream's pairs vary: bench/README.md, figure 7)")
    g.add_argument("--fig7-deadline-s", type=float, default=500.0,
                   help="start no ready process or cold pair expected to end after this many "
                        "seconds (skipped ones are listed); 500 keeps reps=3 (~400 s) "
                        "inside BENCH_TIMEOUT=560 on an H100 when figure 7 runs alone")
    g.add_argument("--fig7-child-timeout-s", type=float, default=300.0,
                   help="a process running longer is killed and recorded as failed")
    g.add_argument("--fig7-smoke", action="store_true",
                   help="tiny sizes on a tiny random model with SmolLM2's tokenizer and a "
                        "random EAGLE-3 head: a smoke test, e.g. --device cpu")


def _counts(text: str, n: int | None = None) -> list[int] | None:
    """The positive counts of a "1,8,64" list (exactly n of them where n is given), or None."""
    try:
        got = [int(c) for c in str(text).split(",")]
    except ValueError:
        return None
    return got if got and min(got) >= 1 and n in (None, len(got)) else None


def _bad_run_args(args, nums: list[int]) -> str | None:
    """What is wrong with the device, the model and head, the figures' lists or --out (None:
    nothing), before any figure runs."""
    if why := unusable_device(str(args.device)):
        return why
    for item in args.set:
        try:
            parse_setting(item)
        except (ValueError, ImportError, AttributeError) as e:
            return f"--set: {e}"
    for flag, path in (("--model", args.model), ("--head", args.head)):
        if path is not None and not os.path.exists(path):
            return f"{flag} {path}: no such file or folder"
    lists = [("--concurrency", args.concurrency, None, 3 in nums or 7 in nums),
             ("--fig6-streams", args.fig6_streams, 2, 6 in nums),
             ("--fig6-ks", args.fig6_ks, None, 6 in nums),
             ("--fig7-concurrency", args.fig7_concurrency, None, 7 in nums)]
    for flag, text, n, used in lists:
        if used and _counts(text, n) is None:
            return (f"{flag} wants positive counts like 1,8" + (f" ({n} of them)" if n else "")
                    + f", got {text!r}")
    if 1 in nums:
        from bench.fig1_single_stream import domain_names

        try:
            domain_names(args.fig1_domains)
        except ValueError as e:
            return str(e)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out}: a file, not a folder"
    parent = os.path.dirname(os.path.abspath(args.out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"--out {args.out}: {parent} is a file"
    why = unwritable(args.out) if args.out else "not a folder this process can write in"
    return f"--out {args.out!r}: {why}" if why else None  # (made now: no result lost for it)


def run(args) -> int:
    torch = lazy_torch()
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
    if bad or not nums:
        print(f"error: no figure {bad or args.figures!r}; have {sorted(FIGURES)}",
              file=sys.stderr)
        return 2
    nums = list(dict.fromkeys(nums))  # each once, in the order asked
    why = _bad_run_args(args, nums)
    if why:
        print(f"error: {why}", file=sys.stderr)
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
