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
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/suite.py` and the `tandem` entry point
    sys.path.insert(0, ROOT)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---- shared helpers -------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def is_cuda(args) -> bool:
    return str(args.device).startswith("cuda")


def sync(args) -> None:
    if is_cuda(args):
        _torch().cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    torch = _torch()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(args) -> dict:
    torch = _torch()
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
           "gpu": None, "gpu_count": 0}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - a missing library is a fact to record
            env[name] = f"not importable: {e}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    return env


def command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):  # python bench/suite.py or python -m bench.suite
        argv = [os.path.basename(sys.executable), os.path.relpath(argv[0])] + argv[1:]
    return shlex.join(argv)


def header(args, name: str, num: int) -> dict:
    return {"figure": num, "name": name, "command": command_line(),
            "argv": list(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "environment": environment(args)}


def rnd(x, n: int = 3):
    return None if x is None else round(float(x), n)


def ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


def held_out_messages(n: int, offset: int = 0) -> list[list[dict]]:
    from cluster import prompt_sets

    _, held_out = prompt_sets.build()
    if not held_out:
        raise RuntimeError("cluster.prompt_sets.build() gave no held-out prompts")
    return [[{"role": "user", "content": held_out[(offset + i) % len(held_out)]}]
            for i in range(n)]


def torch_dtype(args):
    return getattr(_torch(), args.dtype)


_SMOL: dict = {}


def load_smol(args, spec=None, num_blocks: int = 1024):
    """The SmolLM2 engine whose weights (and EAGLE-3 head) every variant shares; loaded once
    per run (figures 1 and 3 both use it)."""
    from engine import Engine

    key = (args.model, args.device, args.dtype, spec, num_blocks)
    if key not in _SMOL:
        _SMOL[key] = Engine.from_pretrained(args.model, device=args.device,
                                            dtype=torch_dtype(args), num_blocks=num_blocks,
                                            enable_prefix_caching=False, spec=spec)
    return _SMOL[key]


def eagle(args, k: int, dynamic: bool):
    from engine.config import SpecConfig

    return SpecConfig(method="eagle3", num_tokens=k, dynamic=dynamic, head=args.head)


def ngram(k: int):
    from engine.config import SpecConfig

    return SpecConfig(method="ngram", num_tokens=k, dynamic=False)


def precapture(eng, batch_sizes, long_context: bool | None = False) -> str:
    """Capture the CUDA graphs the timed runs will replay, so no capture lands inside a timed
    region (`Engine.capture_graphs`); the returned note says what happened. Figures 1 and 3
    stay under LONG_CONTEXT tokens of context, so by default the long-context variants are
    left out (None: the engine's default, as nodes capture)."""
    if eng.runner.graphs is None:
        return "no CUDA graphs (eager)"
    try:
        n = eng.capture_graphs(batch_sizes, long_context=long_context)
        return f"captured {n} graphs before timing"
    except Exception as e:  # noqa: BLE001
        return f"precapture failed ({type(e).__name__}: {e}); relying on the warm-up run"


def spec_counts(eng) -> tuple[int, int]:
    if eng.spec is None:
        return 0, 0
    st = eng.spec.stats
    return st.emitted, st.verify_steps


def step_paths(eng) -> dict:
    """Counters of how an engine's steps ran (for `paths_delta`): engine steps, one-graph
    steps, of those launched before the previous was read, of those at K=0 with host-packed
    inputs, of those leaving out requests that had finished, and the K each fused
    speculative step was given."""
    pipe = eng.pipe
    out = {"steps": eng.stats.steps, "fused": getattr(pipe, "fused_runs", 0),
           "overlapped": getattr(pipe, "overlapped_runs", 0),
           "known_k0": getattr(pipe, "known_continuations", 0),
           "compacted": getattr(pipe, "compacted_runs", 0)}
    if eng.spec is not None:
        out.update({f"k{k}": n for k, n in eng.spec.policy.batch_ks.items()})
    return out


def paths_delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}


def step_costs(eng) -> dict | None:
    """The dynamic-K cost model as measured: plain step ms and relative draft price per
    batch bucket."""
    if eng.spec is None or not eng.spec.spec.dynamic:
        return None
    c = eng.spec.policy.costs
    return {"plain_ms": {str(b): rnd(t * 1e3, 3) for b, t in sorted(c.plain.items())},
            "per_draft": {str(b): rnd(x, 3) for b, x in sorted(c.per_draft.items())}}


def acceptance(before: tuple[int, int], after: tuple[int, int]):
    steps = after[1] - before[1]
    return round((after[0] - before[0]) / steps, 3) if steps else None


def first_diff(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def timed_ms(fn, reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds per call of fn, one CUDA-event pair per call; the host never waits between
    calls, so this is device time (host overhead shows only where it starves the GPU)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def save(out_dir: str, res: dict, plot=None) -> str:
    """Write figN_<name>.json (and the PNG when matplotlib imports and `plot` is given)."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"fig{res['figure']}_{res['name']}")
    if plot is not None and "error" not in res and "skipped" not in res:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as e:  # noqa: BLE001
            res["png"] = f"skipped: matplotlib not importable ({e})"
        else:
            try:
                fig = plot(plt, res)
                fig.tight_layout()
                fig.savefig(stem + ".png", dpi=120)
                plt.close(fig)
                res["png"] = os.path.basename(stem + ".png")
            except Exception:  # noqa: BLE001
                res["png"] = "failed: " + traceback.format_exc(limit=3)
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2, default=str)
        f.write("\n")
    return stem + ".json"


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
    before = spec_counts(eng)
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
            "graphs": note, "_outs": outs}


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
    res["config"]["attention_backend"] = base.config.backend_name
    res["config"]["cuda_graphs"] = base.config.use_cuda_graphs
    res["config"]["prologue_rows"] = sorted(base.model.prologue_rows) \
        if base.model.prologue_linears else []
    res["config"]["prologue_calibration_us"] = base.model.prologue_calibration
    prompts = [base.encode_prompt(m) for m in msgs]
    res["config"]["prompt_tokens"] = [len(p) for p in prompts]
    variants = {"no_spec": None, "eagle3_k5": eagle(args, 5, False),
                "eagle3_k7": eagle(args, 7, False),
                f"eagle3_dynamic_k{args.dynamic_k}": eagle(args, args.dynamic_k, True),
                "ngram_k5": ngram(5)}
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
        hf["eager"] = run_hf(args, model, prompts, n)
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
        hf["compiled"] = hf_compiled(args, model, prompts, n)
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
            r["streams"] = len(ref)
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
        if r.get("tokens_per_s"):
            names.append(f"tandem\n{k}")
            vals.append(r["tokens_per_s"])
    for k, r in res.get("hf", {}).items():
        if r.get("tokens_per_s"):
            names.append(f"HF\n{k}")
            vals.append(r["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(names, vals)
    ax.set_ylabel("tokens/s (single stream)")
    ax.set_title(f"fig 1: single stream, {res['environment'].get('gpu') or 'cpu'}")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    return fig


# ---- figure 2: Llama-3.1-8B shape --------------------------------------------------------


def llama8b_shape(max_position: int = 8192):
    from engine.config import ModelConfig, RopeConfig

    return ModelConfig(
        name="Llama-3.1-8B-shape (random weights)", model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position=8192),
        max_position=max_position, tie_word_embeddings=False, eos_token_ids=())


def random_engine(args, model_cfg, num_blocks: int, device: str | None = None, **kw):
    """An engine with random weights (timing only): matrices ~ N(0, 0.02), norms 1."""
    from engine import Engine, EngineConfig

    torch = _torch()
    torch.manual_seed(0)
    eng = Engine(EngineConfig(model=model_cfg, dtype=torch_dtype(args),
                              device=device or args.device, num_blocks=num_blocks,
                              enable_prefix_caching=False, **kw))
    with torch.no_grad():
        for p in eng.model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)
    return eng


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
                                   "(bench.suite.steady_throughput). steady mixed: the same "
                                   "with output lengths uniform in [n/2, 3n/2] (one seeded "
                                   "list for all variants), so no-spec streams do not all "
                                   "finish in one step",
                     "prompts": "held-out split of cluster/prompt_sets.py, cycled"}
    log("fig 3: loading SmolLM2 + EAGLE-3 head")
    base = load_smol(args, spec=eagle(args, 5, False))
    msgs = held_out_messages(max(conc), args.prompt_offset)
    prompts = [base.encode_prompt(m) for m in msgs]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    dyn = f"eagle3_dynamic_k{args.dynamic_k}"
    variants = {"no_spec": None, "eagle3_k5": eagle(args, 5, False),
                dyn: eagle(args, args.dynamic_k, True)}
    table: dict[str, list[dict]] = {}
    res["runs"] = table
    for name, spec in variants.items():
        log(f"fig 3: {name}")
        rows: list[dict] = []
        table[name] = rows
        eng = base.with_config(spec=spec, num_blocks=args.num_blocks)
        # Every batch size up to the largest: with speculation, streams advance at different
        # rates and finish apart, so each run's tail passes through the smaller buckets.
        note = precapture(eng, range(1, max(conc) + 1))
        # Every prompt once: the steady runs cycle through all of them, and a prompt length
        # not seen before may compile prefill kernels.
        eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        for c in conc:
            batch = [prompts[i % len(prompts)] for i in range(c)]
            # Untimed, the same batch: shapes only this concurrency meets (prefill spans,
            # mixed steps) compile and capture here, and dynamic K measures this batch size.
            eng.generate(batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            tps, acc = [], []
            for _ in range(args.fig3_reps):
                before, paths = spec_counts(eng), step_paths(eng)
                sync(args)
                t0 = time.perf_counter()
                outs = eng.generate(batch, params)
                sync(args)
                dt = time.perf_counter() - t0
                tps.append(sum(len(o.token_ids) for o in outs) / dt)
                acc.append(acceptance(before, spec_counts(eng)))
            rows.append({"concurrency": c, "tokens_per_s": rnd(statistics.median(tps), 1),
                         "reps_tokens_per_s": [rnd(x, 1) for x in tps],
                         "acceptance_length": acc[-1],
                         "paths": paths_delta(paths, step_paths(eng))})
            # Untimed, the same admissions with short requests: the prefill batches a steady
            # run makes (without speculation all c streams finish together and c prompts are
            # admitted at once) compile here, not inside the window (no speculation at 8
            # streams once measured a third of its burst rate).
            steady_throughput(args, eng, prompts, c, 4)
            before, paths = spec_counts(eng), step_paths(eng)
            rows[-1]["steady_tokens_per_s"] = rnd(steady_throughput(args, eng, prompts, c, n), 1)
            rows[-1]["steady_acceptance_length"] = acceptance(before, spec_counts(eng))
            rows[-1]["steady_paths"] = paths_delta(paths, step_paths(eng))
            rows[-1]["steady_mixed_tokens_per_s"] = rnd(
                steady_throughput(args, eng, prompts, c, n, mixed=True), 1)
            rows[-1]["step_costs"] = step_costs(eng)
            log(f"fig 3: {name} c={c}: burst {rows[-1]['tokens_per_s']} tok/s, steady "
                f"{rows[-1]['steady_tokens_per_s']} tok/s, steady mixed lengths "
                f"{rows[-1]['steady_mixed_tokens_per_s']} tok/s")
        res.setdefault("graphs", {})[name] = note
        eng = None
        free_memory()
    base = None
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
    res["break_even_fixed_k5"] = break_even(table["eagle3_k5"])
    res["goals"] = goals
    dyn_min = goals["dynamic_min_ratio_burst"]
    log(f"fig 3: fixed K=5 break-even {res['break_even_fixed_k5']}; dynamic min {dyn_min}")


def mixed_lengths(n: int, count: int) -> list[int]:
    """Output lengths of a mixed-traffic steady run: uniform in [n/2, 3n/2], the same seeded
    list for every variant."""
    import random

    rng = random.Random(1234)
    return [rng.randint(max(1, n // 2), max(1, 3 * n // 2)) for _ in range(count)]


def steady_throughput(args, eng, prompts, c: int, n: int, generations: int = 3,
                      mixed: bool = False) -> float:
    """Tokens/s with `c` streams always in flight, as a server under steady load runs: each
    finished request is replaced at once by the next prompt (its prefill counted), and the
    window ends when the last of generations * c requests is admitted (the drain at the end,
    where fewer than c streams remain, is not part of it). Every request decodes n tokens,
    or with `mixed` a length from `mixed_lengths` (mean n): without speculation, equal
    lengths make all c streams finish in the same step and be replaced in one admission,
    which traffic of varied lengths does not do."""
    from engine import SamplingParams

    total, started, tokens, live = generations * c, 0, 0, set()
    lengths = mixed_lengths(n, total) if mixed else [n] * total

    def admit():
        nonlocal started
        params = SamplingParams(temperature=0, max_tokens=lengths[started], ignore_eos=True)
        live.add(eng.add_request(prompts[started % len(prompts)], params))
        started += 1

    sync(args)
    t0 = time.perf_counter()
    for _ in range(c):
        admit()
    while started < total:
        for out in eng.step():
            tokens += len(out.token_ids)
            if out.finished:
                live.discard(out.request_id)
                if started < total:
                    admit()
    sync(args)
    dt = time.perf_counter() - t0
    for rid in live:
        eng.abort(rid)
    return tokens / dt


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
    devices synchronized, median of reps after 2 warm-ups."""
    torch = _torch()
    rows = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
        secs = []
        for i in range(reps + 2):
            sync_devices(src_dev, dst_dev)
            t0 = time.perf_counter()
            dst.copy_(src)
            sync_devices(src_dev, dst_dev)
            if i >= 2:
                secs.append(time.perf_counter() - t0)
        med = statistics.median(secs)
        rows.append({"bytes": nbytes, "median_ms": rnd(med * 1e3, 3),
                     "gb_s": rnd(nbytes / med / 1e9, 1)})
        log(f"fig 4: peer copy {nbytes / 2**20:.0f} MiB: {rows[-1]['gb_s']} GB/s")
        src = dst = None
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
    res["local_transport_vs_peer_copy"] = {
        str(r["bytes"]): ratio(r["gb_s"], by.get(r["bytes"])) for r in local}


def ucx_transfer(args, sizes) -> dict:
    """UCX from GPU 0 (this process) to a receiver process holding its cache on GPU 1, with
    kvtransfer/bench.py's machinery."""
    try:
        import ucxx  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"ucxx not importable ({type(e).__name__}: {e})"}
    try:
        import asyncio
        from types import SimpleNamespace

        from kvtransfer import bench as kvb
        from kvtransfer.layout import BlockLayout

        rows = []
        loop = asyncio.new_event_loop()  # ucxx binds to the first loop that uses it: keep one
        for nbytes in sizes:
            layout = BlockLayout("bench", "bfloat16", 16, 32, 8, 128, 0)
            blocks = max(1, nbytes // layout.block_bytes)
            proc, pipe, address = kvb.spawn_receiver(layout, blocks, "worker",
                                                     device="cuda:1")
            try:
                # Whole payload at once, and in 8 layer chunks (gather, wire and scatter
                # of successive chunks overlap).
                ns = SimpleNamespace(blocks=blocks, chunks=[1, 8], checksum=False,
                                     progress="thread", reps=args.fig4_reps, device="cuda:0")
                got = loop.run_until_complete(kvb.measure(ns, layout, address))
                best = max(got, key=lambda r: r["median_gb_s"])
                rows.append({"bytes": blocks * layout.block_bytes, "gb_s": best["median_gb_s"],
                             "median_ms": best["median_ms"], "chunks": best["chunks"],
                             "raw": got})
            finally:
                kvb.stop_receiver(proc, pipe, layout)
            log(f"fig 4: UCX {nbytes >> 20} MiB: {rows[-1]['gb_s']} GB/s")
        return {"rows": rows, "sender": "cuda:0", "receiver": "cuda:1 (separate process)"}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def plot_kv(plt, res):
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, rows in (("peer copy", res.get("peer_copy")),
                      ("local transport", (res.get("local_transport") or {}).get("rows")),
                      ("UCX", (res.get("ucx") or {}).get("rows"))):
        if rows:
            ax.plot([r["bytes"] / 2**20 for r in rows], [r["gb_s"] for r in rows], "o-",
                    label=key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MiB per transfer")
    ax.set_ylabel("GB/s")
    ax.legend()
    ax.set_title("KV transfer GPU 0 -> GPU 1")
    return fig


# ---- figure 5: inter-token latency, colocated vs disaggregated ------------------------------


def pct(xs: list[float], q: float):
    """Nearest-rank percentile (q in 0..100)."""
    import math

    if not xs:
        return None
    ys = sorted(xs)
    return ys[max(0, math.ceil(q / 100 * len(ys)) - 1)]


def itl_summary(gaps_s: list[float]) -> dict:
    ms = [g * 1e3 for g in gaps_s]
    return {"count": len(ms), "p50_ms": rnd(pct(ms, 50)), "p90_ms": rnd(pct(ms, 90)),
            "p99_ms": rnd(pct(ms, 99)), "max_ms": rnd(max(ms) if ms else None),
            "mean_ms": rnd(statistics.mean(ms) if ms else None)}


class Workload:
    """Background decode streams that keep running, and long prompts arriving on a clock.
    Records when each background stream got each token (host time after the step)."""

    def __init__(self, args, vocab: int):
        import random

        from engine import SamplingParams

        rng = random.Random(0)
        self.streams, self.arrivals = args.fig5_streams, args.fig5_arrivals
        self.interval = args.fig5_interval_ms / 1e3
        self.short = [[rng.randrange(vocab) for _ in range(args.fig5_short_len)]
                      for _ in range(self.streams)]
        self.long = [[rng.randrange(vocab) for _ in range(args.fig5_prompt_len)]
                     for _ in range(self.arrivals)]
        self.bg_params = SamplingParams(temperature=0, max_tokens=args.fig5_max_steps,
                                        ignore_eos=True)
        self.long_params = SamplingParams(temperature=0, max_tokens=args.fig5_long_tokens,
                                          ignore_eos=True)
        self.stamps: dict[str, list[float]] = {f"bg{i}": [] for i in range(self.streams)}
        self.arrived: dict[str, float] = {}
        self.first: dict[str, float] = {}  # long request -> time of its first token
        self.done: dict[str, float] = {}  # long request -> time it finished decoding
        self.tokens: dict[str, list[int]] = {}  # long request -> its output tokens
        self.t0 = None
        self.check_kv = bool(getattr(args, "fig5_check_kv", False))

    def record(self, outs, t: float) -> None:
        for o in outs:
            rid = o.request_id
            if rid in self.stamps and o.token_ids:
                self.stamps[rid].append(t)
            elif rid in self.arrived:
                self.tokens.setdefault(rid, []).extend(o.token_ids)
                if rid not in self.first and o.token_ids:
                    self.first[rid] = t
                if o.finished:
                    self.done[rid] = t

    def warm(self) -> bool:
        return all(len(v) >= 8 for v in self.stamps.values())

    def due(self, now: float) -> list[tuple[str, list[int]]]:
        """Long prompts whose arrival time has come and that were not added yet."""
        out = []
        for i in range(len(self.arrived), self.arrivals):
            rid = f"long{i}"
            if now < self.t0 + i * self.interval:
                break
            self.arrived[rid] = now
            out.append((rid, self.long[i]))
        return out

    def finished(self) -> bool:
        return len(self.done) == self.arrivals

    def summary(self, t_end: float) -> dict:
        quiet, busy = [], []
        for ts in self.stamps.values():
            for a, b in zip(ts, ts[1:]):
                (busy if self.t0 <= b <= t_end else quiet if b < self.t0 else []).append(b - a)
        ttft = [self.first[r] - self.arrived[r] for r in self.first]
        return {"itl_while_prompts_arrive": itl_summary(busy),
                "itl_before_arrivals": itl_summary(quiet),
                "window_s": rnd(t_end - self.t0),
                "long_ttft_ms": {"p50": rnd(pct([x * 1e3 for x in ttft], 50)),
                                 "max": rnd(max(ttft) * 1e3 if ttft else None),
                                 "all": [rnd(x * 1e3, 1) for x in ttft]},
                "background_tokens_in_window": len(busy),
                "background_tokens_per_stream": {r: len(ts) for r, ts in self.stamps.items()}}


FIG5_SMOKE = {"fig5_model": "tiny", "fig5_streams": 2, "fig5_short_len": 32,
              "fig5_arrivals": 2, "fig5_prompt_len": 128, "fig5_interval_ms": 50.0,
              "fig5_long_tokens": 8, "fig5_max_steps": 400, "fig5_step_limit": 2000,
              "fig5_check_kv": True}
FIG5_CHILD_TIMEOUT_S = 120.0  # the prefill process: start, build, warm, connect
FIG5_UCX_TIMEOUT_S = 60.0


def fig5_model(args, prompt_len: int):
    from engine.config import tiny_config

    need = max(prompt_len + args.fig5_long_tokens, args.fig5_short_len + args.fig5_max_steps)
    max_pos = -(-(need + 64) // 256) * 256
    if args.fig5_model == "tiny":
        return tiny_config(max_position=max_pos, vocab_size=256, name="tiny (random)")
    return llama8b_shape(max_position=max_pos)


def fig5_blocks(args) -> int:
    per_bg = -(-(args.fig5_short_len + args.fig5_max_steps + 16) // 16)
    per_long = -(-(args.fig5_prompt_len + args.fig5_long_tokens + 16) // 16)
    # + one long prompt's worth: the transport warm-up transfer lands in reserved blocks
    return args.fig5_streams * per_bg + (args.fig5_arrivals + 1) * per_long + 64


def fig5_devices(args) -> tuple[str, str]:
    """(decode, prefill): the decode engine (and the colocated one) on GPU 0, the prefill
    engine on GPU 1; on a CPU both are the CPU (a smoke test of the mechanics)."""
    return ("cuda:0", "cuda:1") if is_cuda(args) else (args.device, args.device)


def weights_fingerprint(eng) -> list[float]:
    """A strided sample of every weight, summed per tensor: equal lists mean the two engines
    (built in two processes from the same seed) hold the same random weights."""
    torch = _torch()
    with torch.no_grad():
        return [float(p.detach().reshape(-1)[::4099].double().sum())
                for p in eng.model.parameters()]


def kv_checksum(kv, ids) -> int:
    """Exact, order-sensitive fingerprint of blocks `ids` of a KV tensor (all layers, K and
    V): the raw bits as 16-bit integers, summed per block, weighted by the block's position.
    (Random tiny models decode nearly the same tokens from any context: equal outputs alone
    would not show that the right KV arrived.)"""
    torch = _torch()
    idx = torch.tensor(list(ids), dtype=torch.long, device=kv.device)
    bits = kv.index_select(2, idx).view(torch.int16).to(torch.int64)
    per_block = bits.sum(dim=(0, 1, 3, 4, 5))
    weight = torch.arange(1, len(ids) + 1, dtype=torch.int64, device=kv.device)
    return int((per_block * weight).sum())


def warm_engine(eng, w: Workload, batch_sizes) -> str:
    """Capture the decode graphs and JIT the prefill kernels once, outside the measurement."""
    note = precapture(eng, batch_sizes, long_context=None)  # 8k contexts
    eng.generate([w.long[0]], w.long_params)
    return note


def start_background(eng, w: Workload) -> int:
    """Start the background decode streams and step them until warm (32 steps at least);
    the measured window starts now. Returns the steps taken."""
    for i, p in enumerate(w.short):
        eng.add_request(p, w.bg_params, request_id=f"bg{i}")
    steps = 0
    while not w.warm() or steps < 32:
        w.record(eng.step(), time.perf_counter())
        steps += 1
    w.t0 = time.perf_counter()
    return steps


def run_colocated(eng, w: Workload, step_limit: int, deadline_s: float) -> dict:
    steps = start_background(eng, w)
    while not w.finished() and steps < step_limit and time.perf_counter() - w.t0 < deadline_s:
        for rid, p in w.due(time.perf_counter()):
            eng.add_request(p, w.long_params, request_id=rid)
        w.record(eng.step(), time.perf_counter())
        steps += 1
    t_end = time.perf_counter()
    for rid in list(eng.seqs):
        eng.abort(rid)
    out = w.summary(t_end)
    out["steps"] = steps
    out["complete"] = w.finished()
    return out


# -- the product path: prefill engine in its own process, KV over UCX -------------------------


def fig5_ucx_problem(kind: str):
    """None when the UCX path can run in this process, else why not."""
    if kind == "in-process":
        return "--fig5-transport in-process"
    try:
        from kvtransfer import wire  # imports ucxx, after kvtransfer set UCX's environment
    except Exception as e:  # noqa: BLE001
        return f"ucxx not importable ({type(e).__name__}: {e})"
    bound = next(iter(getattr(wire, "_bound_loop", ())), None)
    if bound is not None and bound.is_closed():
        return "ucxx is bound to an event loop of this process that was closed"
    return None


class UcxLoop:
    """The event loop this process's UCX transports run on, driven from another thread (ucxx
    with thread progress serves one loop per process: a fresh one, or the loop an earlier
    figure bound it to, run here on a thread while figure 5 needs it)."""

    def __init__(self):
        import asyncio
        import threading

        from kvtransfer import wire

        bound = next(iter(getattr(wire, "_bound_loop", ())), None)
        self._thread = None
        self.loop = bound or asyncio.new_event_loop()
        if self.loop.is_running():  # someone else drives it already: share
            return
        self._thread = threading.Thread(target=self.loop.run_forever, name="fig5-ucx",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = FIG5_UCX_TIMEOUT_S):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Stop driving the loop; it stays open (ucxx stays bound to it for this process, so
        a later figure 5 in this process can drive it again)."""
        if self._thread is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self._thread = None


def fig5_prefill_main(pipe, args, device: str) -> None:
    """The prefill process (spawned): the prefill engine on `device`, a UCX sender connected
    to the decode process, and a loop that prefills what the parent sends (hold=True), ships
    each request's blocks into the blocks the decode side reserved and reports the hand-off."""
    try:
        msg = pipe.recv()  # ("go", decode address): waits here while the parent runs colocated
        if msg[0] == "go":
            _prefill_serve(pipe, args, device, msg[1])
        else:  # stopped before it started
            pipe.send(("bye", {"started": False}))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent is gone or gave up: nothing left to report to
    except BaseException:  # noqa: BLE001 - the parent re-raises it with this traceback
        try:
            pipe.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        raise SystemExit(1) from None


def _prefill_serve(pipe, args, device: str, address: dict) -> None:
    from kvtransfer import LoopThread
    from kvtransfer.factory import make_transport
    from kvtransfer.layout import BlockLayout

    torch = _torch()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:  # a CPU smoke test: the decode process has the cores, do not fight it for them
        torch.set_num_threads(1)
    mcfg = fig5_model(args, args.fig5_prompt_len)
    t0 = time.perf_counter()
    pre = random_engine(args, mcfg, fig5_blocks(args), device=device)
    w = Workload(args, mcfg.vocab_size)
    graphs = warm_engine(pre, w, (1,))
    built_s = time.perf_counter() - t0
    lt = LoopThread("fig5-prefill-ucx")  # ucxx's loop in this process, driven from here
    if device.startswith("cuda"):  # that thread's CUDA calls go to this process's GPU too
        lt.run(_use_device(device), 30)
    tx = make_transport("ucx", BlockLayout.from_engine_config(pre.config))
    conn = None
    try:
        conn = lt.run(tx.connect(address), FIG5_UCX_TIMEOUT_S)
        pipe.send(("ready", {"pid": os.getpid(), "device": device, "graphs": graphs,
                             "build_and_warm_s": rnd(built_s, 1),
                             "fingerprint": weights_fingerprint(pre)}))
        _prefill_loop(pipe, pre, w, lt, conn)
    finally:
        if conn is not None:
            lt.run(conn.close(), 10)
        lt.run(tx.close(), 10)
        lt.close()


def _prefill_loop(pipe, pre, w: Workload, lt, conn) -> None:
    def stats_of(st, t_first: float, checksum=None) -> dict:
        return {"blocks": st.num_blocks, "bytes": st.bytes, "seconds": st.seconds,
                "first_token_at": t_first, "sent_at": time.perf_counter(),
                "src_checksum": checksum}

    check = w.check_kv

    dst: dict[str, list[int]] = {}
    sending: dict = {}  # rid -> (send_blocks future, Handoff, first token time, checksum)
    shipped = 0
    stopping = False
    while not stopping or sending:
        idle = not pre.has_unfinished() and not sending
        while pipe.poll(0.0005 if idle else 0):
            idle = False
            msg = pipe.recv()
            if msg[0] == "prefill":
                _, rid, i, blocks = msg
                dst[rid] = blocks
                pre.add_request(w.long[i], w.long_params, request_id=rid, hold=True)
            elif msg[0] == "warm":  # one transfer before timing: UCX sets up its paths
                st = lt.run(_warm_send(conn, pre, msg[1]), FIG5_UCX_TIMEOUT_S)
                pipe.send(("warmed", stats_of(st, time.perf_counter())))
            elif msg[0] == "stop":
                stopping = True
                for rid in list(pre.seqs):
                    pre.abort(rid)
        if pre.has_unfinished():
            outs = pre.step()
            t = time.perf_counter()
            for o in outs:
                if o.token_ids or o.finished:
                    pipe.send(("out", o.request_id, list(o.token_ids), t,
                               o.finished and not o.handoff))
                if o.handoff:
                    rid = o.request_id
                    h = pre.export_handoff(rid)
                    src = pre.held_blocks(rid)
                    blocks = dst.pop(rid)
                    src = src[: len(blocks)]
                    fut = lt.submit(conn.send_blocks(rid, pre.kv_cache, src, blocks))
                    sending[rid] = (fut, h, t, kv_checksum(pre.kv_cache, src) if check else None)
        for rid, (fut, h, t, checksum) in list(sending.items()):
            if fut.done():
                del sending[rid]
                pre.release(rid)  # the lease ends with the receiver's ack
                st = fut.result(0)  # a failed transfer fails the figure
                shipped += st.bytes
                pipe.send(("handoff", rid, h, stats_of(st, t, checksum)))
    pipe.send(("bye", {"bytes_shipped": shipped, "held_left": len(pre.held)}))


async def _use_device(device: str) -> None:
    _torch().cuda.set_device(device)


async def _warm_send(conn, pre, blocks: list[int]):
    """Blocks 0..n of the prefill cache (whatever they hold) into the decode side's blocks
    reserved as "warm": the decode side releases them unread."""
    return await conn.send_blocks("warm", pre.kv_cache, list(range(len(blocks))), blocks)


class PrefillProcess:
    """Parent's handle on the spawned prefill process; `close()` always leaves no child."""

    def __init__(self, args, device: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA / UCX state
        self.pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=fig5_prefill_main, args=(theirs, args, device),
                                name="fig5-prefill", daemon=True)
        self.proc.start()
        theirs.close()
        self.bye = None

    def send(self, msg) -> None:
        self.pipe.send(msg)

    def _check(self, msg):
        if msg[0] == "error":
            raise RuntimeError(f"the prefill process failed:\n{msg[1]}")
        return msg

    def messages(self) -> list:
        """What the child sent so far (never blocks); raises if it failed or died."""
        out = []
        while self.pipe.poll(0):
            out.append(self._check(self.pipe.recv()))
        if not out and not self.proc.is_alive():
            raise RuntimeError(f"the prefill process died (exit code {self.proc.exitcode})")
        return out

    def expect(self, kind: str, timeout: float):
        """Wait for the child's next message, which must be `kind`."""
        deadline = time.perf_counter() + timeout
        while not self.pipe.poll(0.05):
            if not self.proc.is_alive() and not self.pipe.poll(0):
                raise RuntimeError(f"the prefill process died (exit code {self.proc.exitcode})")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no {kind!r} from the prefill process in {timeout:.0f}s")
        msg = self._check(self.pipe.recv())
        if msg[0] != kind:
            raise RuntimeError(f"prefill process said {msg[0]!r}, expected {kind!r}")
        return msg

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask the child to stop (it finishes the sends in flight and says bye), then make
        sure it is gone: joined, or killed."""
        if self.proc.is_alive():
            try:
                self.send(("stop",))
                deadline = time.perf_counter() + timeout
                while self.bye is None and time.perf_counter() < deadline:
                    if self.pipe.poll(0.05):
                        msg = self.pipe.recv()  # late outputs are dropped; an error is kept
                        if msg[0] == "bye":
                            self.bye = msg[1]
                        elif msg[0] == "error":
                            self.bye = {"error": msg[1]}
                    elif not self.proc.is_alive():
                        break
            except Exception as e:  # noqa: BLE001 - a dead or stuck child is killed below
                self.bye = {"error": f"{type(e).__name__}: {e}"}
        self.proc.join(timeout if self.bye is not None else 1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.pipe.close()
        return self.proc.exitcode


def transfer_summary(rows: list[dict]) -> dict:
    if not rows:
        return {"count": 0}
    secs = [r["seconds"] for r in rows]
    total_b, total_s = sum(r["bytes"] for r in rows), sum(secs)
    out = {"count": len(rows), "bytes_total": total_b, "seconds_total": rnd(total_s, 4),
           "median_ms": rnd(statistics.median(secs) * 1e3),
           "max_ms": rnd(max(secs) * 1e3),
           "gb_s_overall": rnd(total_b / total_s / 1e9, 2) if total_s else None}
    checked = [r["kv_identical"] for r in rows if r.get("kv_identical") is not None]
    out["kv_identical"] = f"{sum(checked)}/{len(checked)}" if checked else "not checked"
    if rows[0].get("first_token_to_admit_ms") is not None:
        lat = [r["first_token_to_admit_ms"] for r in rows]
        out["first_token_to_admit_ms"] = {"p50": rnd(pct(lat, 50)), "max": rnd(max(lat))}
    return out


def run_disaggregated_process(args, pp: PrefillProcess, ucx: UcxLoop, rx, dec, w: Workload,
                              step_limit: int, deadline_s: float) -> dict:
    """This process is the decode node (and the router's clock): on each arrival it reserves
    blocks on `dec` and asks the prefill process to prefill into them; the prefill process
    ships the KV over UCX and sends the Handoff; `dec` admits it once `rx` says the blocks
    landed. The background streams decode on `dec` throughout; this loop is the one measured."""
    plen = args.fig5_prompt_len
    pending: dict = {}  # rid -> (future of rx.recv_blocks, Handoff, transfer stats)
    reserved: dict[str, list[int]] = {}
    transfers: list[dict] = []

    def handle(msg) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "out":  # the long request's first token, straight from prefill
            _, _, toks, t, finished = msg
            w.tokens.setdefault(rid, []).extend(toks)
            if toks and rid not in w.first:
                w.first[rid] = t
            if finished:  # done at its first token: nothing will arrive
                w.done[rid] = t
                dec.release(rid)
        elif kind == "handoff":
            _, _, h, st = msg
            pending[rid] = (ucx.submit(rx.recv_blocks(rid, FIG5_UCX_TIMEOUT_S)), h, st)
        else:
            raise RuntimeError(f"unexpected message from the prefill process: {msg[:2]}")

    steps = start_background(dec, w)
    while not w.finished() and steps < step_limit and time.perf_counter() - w.t0 < deadline_s:
        for rid, _ in w.due(time.perf_counter()):
            reserved[rid] = dec.reserve(rid, plen)
            pp.send(("prefill", rid, int(rid.removeprefix("long")), reserved[rid]))
        for msg in pp.messages():
            handle(msg)
        for rid, (fut, h, st) in list(pending.items()):
            if fut.done():
                del pending[rid]
                fut.result()  # a transfer the receiver failed fails the figure
                same = None
                if w.check_kv:  # before admit: decoding appends to the last block
                    blocks = reserved[rid][: st["blocks"]]
                    same = kv_checksum(dec.kv_cache, blocks) == st["src_checksum"]
                dec.admit(h)
                t = time.perf_counter()
                transfers.append({"request_id": rid, "blocks": st["blocks"],
                                  "bytes": st["bytes"], "seconds": rnd(st["seconds"], 5),
                                  "gb_s": rnd(st["bytes"] / max(st["seconds"], 1e-9) / 1e9, 2),
                                  "first_token_to_admit_ms": rnd(
                                      (t - st["first_token_at"]) * 1e3),
                                  "kv_identical": same})
        if dec.has_unfinished():
            w.record(dec.step(), time.perf_counter())
            steps += 1
        else:
            time.sleep(0.0002)
    t_end = time.perf_counter()
    for rid in list(dec.seqs) + list(dec.reserved):
        dec.abort(rid)
    for rid, (fut, _, _) in pending.items():
        fut.cancel()
        rx.inbox.discard(rid)
    out = w.summary(t_end)
    out["decode_steps"] = steps
    out["complete"] = w.finished()
    out["kv_transfers"] = transfer_summary(transfers)
    out["kv_transfer_rows"] = transfers
    return out


def fig5_process_row(args, res: dict, dec, w: Workload, pp: PrefillProcess, dev_prefill: str,
                     batches) -> tuple[dict, Workload]:
    """Start the UCX receiver on `dec`'s cache, let the prefill process build and connect,
    warm the link with one transfer, then measure. Everything it started is closed here."""
    from kvtransfer.factory import make_transport
    from kvtransfer.layout import BlockLayout

    torch = _torch()
    layout = BlockLayout.from_engine_config(dec.config)
    ucx = UcxLoop()
    rx = make_transport("ucx", layout, dec.kv_cache)
    started = False
    try:
        ucx.run(rx.start())
        started = True
        pp.send(("go", rx.address))  # the child builds its engine while we warm ours
        res["graphs"]["decode"] = warm_engine(dec, w, batches)
        ready = pp.expect("ready", FIG5_CHILD_TIMEOUT_S)[1]
        res["graphs"]["prefill"] = ready["graphs"]
        same = ready.pop("fingerprint") == weights_fingerprint(dec)
        res["prefill_process"] = {**ready, "weights_identical_to_decode": same}
        log(f"fig 5: prefill process {ready['pid']} ready on {dev_prefill} "
            f"({ready['build_and_warm_s']} s); same weights: {same}")
        blocks = dec.reserve("warm", args.fig5_prompt_len)
        pp.send(("warm", blocks))
        warm = pp.expect("warmed", FIG5_UCX_TIMEOUT_S)[1]
        ucx.run(rx.recv_blocks("warm", FIG5_UCX_TIMEOUT_S))
        dec.release("warm")
        res["prefill_process"]["warmup_transfer"] = {
            "blocks": warm["blocks"], "bytes": warm["bytes"],
            "ms": rnd(warm["seconds"] * 1e3)}
        if torch.device(dec.config.device).type == "cuda":
            torch.cuda.synchronize(dec.config.device)
        log("fig 5: disaggregated (separate processes, UCX)")
        w2 = Workload(args, dec.config.model.vocab_size)
        row = run_disaggregated_process(args, pp, ucx, rx, dec, w2, args.fig5_step_limit,
                                        args.fig5_deadline_s)
        row["path"] = "processes+ucx"
        return row, w2
    finally:
        exitcode = pp.close()
        res.setdefault("prefill_process", {}).update(exit_code=exitcode, bye=pp.bye)
        if started:
            try:
                ucx.run(rx.close(), 15)
            except Exception as e:  # noqa: BLE001
                res["prefill_process"]["receiver_close"] = f"{type(e).__name__}: {e}"
        ucx.close()


# -- the in-process variant: both engines in this process, KV by a plain copy ---------------


def run_disaggregated(args, pre, dec, w: Workload, step_limit: int,
                      deadline_s: float) -> dict:
    """Both engines in this process (sharing its GIL): the prefill engine in this thread, the
    decode engine on its own thread (own GPU). Long prompts prefill on `pre` (hold=True),
    their KV blocks are copied into blocks reserved on `dec`, and `dec` admits them; the
    background streams decode on `dec` throughout."""
    import concurrent.futures
    import queue
    import threading

    torch = _torch()
    ctrl: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    failure: list[BaseException] = []
    counter = {"steps": 0}
    dec_dev = torch.device(dec.config.device)
    block_bytes = dec.kv_cache[:, :, 0].numel() * dec.kv_cache.element_size()

    def decode_loop():
        try:
            if dec_dev.type == "cuda":
                torch.cuda.set_device(dec_dev)
            while not stop.is_set():
                while True:
                    try:
                        fn, fut = ctrl.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        fut.set_result(fn(dec))
                    except Exception as e:  # noqa: BLE001
                        fut.set_exception(e)
                if dec.has_unfinished() and counter["steps"] < step_limit:
                    w.record(dec.step(), time.perf_counter())
                    counter["steps"] += 1
                else:
                    time.sleep(0.0002)
        except BaseException as e:  # noqa: BLE001
            failure.append(e)

    def on_decode(fn, wait: bool = True):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        ctrl.put((fn, fut))
        return fut.result(timeout=120) if wait else fut

    side = torch.cuda.Stream(device=dec_dev) if dec_dev.type == "cuda" else None
    copies, admits = [], []

    def hand_off(rid: str) -> None:
        h = pre.export_handoff(rid)
        src = pre.held_blocks(rid)
        dst = on_decode(lambda e: e.reserve(rid, h.num_computed))
        t0 = time.perf_counter()
        copy_kv(pre.kv_cache, dec.kv_cache, src[: len(dst)], dst, side)
        secs = time.perf_counter() - t0
        same = (kv_checksum(pre.kv_cache, src[: len(dst)]) == kv_checksum(dec.kv_cache, dst)
                if w.check_kv else None)
        copies.append({"request_id": rid, "blocks": len(dst), "bytes": len(dst) * block_bytes,
                       "seconds": rnd(secs, 5),
                       "gb_s": rnd(len(dst) * block_bytes / max(secs, 1e-9) / 1e9, 2),
                       "kv_identical": same})
        pre.release(rid)
        admits.append(on_decode(lambda e: e.admit(h), wait=False))

    for i, p in enumerate(w.short):
        dec.add_request(p, w.bg_params, request_id=f"bg{i}")
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # two busy Python threads: hand the GIL over quickly
    th = threading.Thread(target=decode_loop, name="bench-decode", daemon=True)
    th.start()
    try:
        while not (w.warm() and counter["steps"] >= 32):
            if failure or not th.is_alive():
                raise RuntimeError("decode thread died") from (failure[0] if failure else None)
            time.sleep(0.001)
        w.t0 = time.perf_counter()
        while (not w.finished() and counter["steps"] < step_limit
               and time.perf_counter() - w.t0 < deadline_s):
            if failure:
                raise RuntimeError("decode thread failed") from failure[0]
            for rid, p in w.due(time.perf_counter()):
                pre.add_request(p, w.long_params, request_id=rid, hold=True)
            if pre.has_unfinished():
                outs = pre.step()
                t = time.perf_counter()
                for o in outs:
                    w.tokens.setdefault(o.request_id, []).extend(o.token_ids)
                    if o.token_ids and o.request_id not in w.first:
                        w.first[o.request_id] = t
                    if o.handoff:
                        hand_off(o.request_id)
                    elif o.finished:  # finished at its first token: nothing to hand off
                        w.done[o.request_id] = t
            else:
                time.sleep(0.0005)
        t_end = time.perf_counter()
    finally:
        stop.set()
        th.join(timeout=60)
        sys.setswitchinterval(old)
    for f in admits:
        if f.done():
            f.result()  # an admit that raised
    if failure:
        raise RuntimeError("decode thread failed") from failure[0]
    for rid in list(dec.seqs) + list(dec.reserved):
        dec.abort(rid)
    for rid in list(pre.seqs) + list(pre.held):
        pre.abort(rid)
    out = w.summary(t_end)
    out["decode_steps"] = counter["steps"]
    out["complete"] = w.finished()
    out["kv_transfers"] = transfer_summary(copies)
    out["kv_transfer_rows"] = copies
    out["path"] = "in-process"
    return out


def copy_kv(src_kv, dst_kv, src_ids, dst_ids, stream=None) -> None:
    """Blocks src_ids of src_kv into blocks dst_ids of dst_kv (all layers, K and V), on a side
    stream of the destination GPU so the decode engine's own stream never waits on it."""
    import contextlib

    torch = _torch()
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        data = src_kv.index_select(2, torch.tensor(src_ids, device=src_kv.device))
        data = data.to(dst_kv.device, non_blocking=True)
        dst_kv.index_copy_(2, torch.tensor(dst_ids, device=dst_kv.device), data)
    if stream is not None:
        stream.synchronize()


def fig5_in_process_row(args, res: dict, dec, w: Workload, dev_prefill: str, batches):
    """The one-process variant: a prefill engine on `dev_prefill` built here with `dec`'s
    weights, the decode engine on its own thread of this process."""
    import contextlib

    torch = _torch()
    on_dev = (torch.cuda.device(dev_prefill) if dev_prefill.startswith("cuda")
              else contextlib.nullcontext())
    with on_dev, torch.no_grad():
        pre = random_engine(args, dec.config.model, dec.num_blocks, device=dev_prefill)
        for a, b in zip(pre.model.parameters(), dec.model.parameters()):
            a.copy_(b)  # the same weights as the decode (and colocated) engine
        res["graphs"]["in_process_prefill"] = warm_engine(pre, w, (1,))
    res["graphs"]["in_process_decode"] = warm_engine(dec, w, batches)
    log("fig 5: disaggregated (one process, in-process copy)")
    w2 = Workload(args, dec.config.model.vocab_size)
    row = run_disaggregated(args, pre, dec, w2, args.fig5_step_limit, args.fig5_deadline_s)
    return row, w2


FIG5_PATHS = {
    "processes+ucx":
        "separate processes: the prefill engine in a spawned process on {prefill}, the decode "
        "engine in this one on {decode}; on each arrival this process reserves blocks on the "
        "decode engine (Engine.reserve), the prefill process prefills (hold=True), ships the "
        "request's KV blocks into them over UCX (kvtransfer UcxTransport, worker address, as "
        "prefill_node/decode_node do), releases its copy on the receiver's ack and sends the "
        "Handoff; the decode engine admits it once its receiver says the blocks landed. The "
        "link is warmed by one transfer before timing",
    "in-process":
        "one process (engines share the GIL): the prefill engine on {prefill} in the main "
        "thread, the decode engine on {decode} on its own thread; KV by an in-process copy "
        "(index_select, device copy, index_copy on a side stream of the decode device), no "
        "UCX, no second process",
}


def fig_itl_disagg(args, res: dict) -> None:
    torch = _torch()
    if getattr(args, "fig5_smoke", False):
        args = argparse.Namespace(**{**vars(args), **FIG5_SMOKE})
    if is_cuda(args) and torch.cuda.device_count() < 2:
        res["skipped"] = "needs 2 GPUs"
        return
    dev_dec, dev_pre = fig5_devices(args)  # CPU: a smoke test of the mechanics
    why_not_ucx = fig5_ucx_problem(args.fig5_transport)
    if why_not_ucx and args.fig5_transport == "ucx":
        raise RuntimeError(f"--fig5-transport ucx: {why_not_ucx}")
    main_path = "in-process" if why_not_ucx else "processes+ucx"
    mcfg = fig5_model(args, args.fig5_prompt_len)
    nb = fig5_blocks(args)
    limit = args.fig5_step_limit
    batches = list(range(1, args.fig5_streams + args.fig5_arrivals + 1))
    res["config"] = {
        "smoke": bool(getattr(args, "fig5_smoke", False)),
        "model": mcfg.name, "dtype": args.dtype, "background_streams": args.fig5_streams,
        "background_prompt_tokens": args.fig5_short_len, "long_prompts": args.fig5_arrivals,
        "long_prompt_tokens": args.fig5_prompt_len, "long_max_tokens": args.fig5_long_tokens,
        "arrival_interval_ms": args.fig5_interval_ms, "num_blocks": nb,
        "step_limit": limit, "deadline_s": args.fig5_deadline_s,
        "kv_checksums": bool(args.fig5_check_kv),
        "speculation": "none",
        "devices": {"colocated": dev_dec, "prefill": dev_pre, "decode": dev_dec},
        "itl": "gaps between successive tokens of the background streams (host time after "
               "each decode step), for gaps ending between the first arrival and the last long "
               "request's finish",
        "disaggregated_path": main_path,
        "transport": FIG5_PATHS[main_path].format(prefill=dev_pre, decode=dev_dec),
        "ucx_unavailable": why_not_ucx}
    if main_path == "processes+ucx":
        res["config"]["clock"] = ("TTFT and transfer latencies mix timestamps of the two "
                                  "processes: time.perf_counter, one system-wide monotonic "
                                  "clock on Linux")
        extra = args.fig5_in_process_row
        res["config"]["in_process_row"] = FIG5_PATHS["in-process"].format(
            prefill=dev_pre, decode=dev_dec) if extra else "skipped (--no-fig5-in-process-row)"
    # Spawned now: it imports while the colocated run goes, and waits for "go" to build.
    pp = PrefillProcess(args, dev_pre) if main_path == "processes+ucx" else None
    try:
        log(f"fig 5: building engines ({mcfg.name}, {nb} blocks each)")
        base = random_engine(args, mcfg, nb, device=dev_dec)
        res["config"]["max_num_batched_tokens"] = base.config.max_num_batched_tokens
        res["config"]["attention_backend"] = base.config.backend_name
        w = Workload(args, mcfg.vocab_size)
        res["graphs"] = {"colocated": warm_engine(base, w, batches)}
        log("fig 5: colocated")
        res["colocated"] = co = run_colocated(base, w, limit, args.fig5_deadline_s)
        log(f"fig 5: colocated ITL {co['itl_while_prompts_arrive']}")
        dec = base.with_config()  # same weights, fresh KV cache and queues
        base = None
        free_memory()
        rows = {}
        if pp is not None:
            rows["disaggregated"] = fig5_process_row(args, res, dec, w, pp, dev_pre, batches)
            pp = None
            if args.fig5_in_process_row:
                dec = dec.with_config()
                free_memory()
                rows["disaggregated_in_process"] = fig5_in_process_row(
                    args, res, dec, w, dev_pre, batches)
        else:
            rows["disaggregated"] = fig5_in_process_row(args, res, dec, w, dev_pre, batches)
            rows["disaggregated"][0]["path"] = f"in-process (fallback: {why_not_ucx})"
    finally:
        if pp is not None:  # an error before the process row took it over
            pp.close(timeout=5)
    dec = None
    free_memory()
    for key, (row, _) in rows.items():
        res[key] = row
    c = co["itl_while_prompts_arrive"]
    res["ratios"] = {"colocated_p99_over_idle_p99": ratio(
        c["p99_ms"], co["itl_before_arrivals"]["p99_ms"])}
    for key, (row, w2) in rows.items():
        d = row["itl_while_prompts_arrive"]
        log(f"fig 5: {key} ({row['path']}) ITL {d}; KV {row['kv_transfers']}")
        same = [w.tokens.get(r) == w2.tokens.get(r) for r in w.tokens]
        row["long_outputs_identical_to_colocated"] = f"{sum(same)}/{len(same)}"
        row["long_tokens_per_request"] = {r: len(t) for r, t in sorted(w2.tokens.items())}
        row["p99_over_idle_p99"] = ratio(d["p99_ms"], row["itl_before_arrivals"]["p99_ms"])
        res["ratios"][f"p99_itl_colocated_over_{key}"] = ratio(c["p99_ms"], d["p99_ms"])
        res["ratios"][f"p50_itl_colocated_over_{key}"] = ratio(c["p50_ms"], d["p50_ms"])
        res["ratios"][f"long_ttft_p50_{key}_over_colocated"] = ratio(
            row["long_ttft_ms"]["p50"], co["long_ttft_ms"]["p50"])
    main = res["disaggregated"]
    res["long_outputs_identical_colocated_vs_disaggregated"] = \
        main["long_outputs_identical_to_colocated"]
    res["goals"] = {"disaggregated_path": main["path"],
                    "disaggregated_p99_over_idle_p99": main["p99_over_idle_p99"],
                    "disaggregated_p99_at_most_1.2x_idle": (
                        None if main["p99_over_idle_p99"] is None
                        else main["p99_over_idle_p99"] <= 1.2)}
    if not all(r[0]["complete"] for r in rows.values()) or not co["complete"]:
        res["warning"] = ("a run hit --fig5-step-limit or --fig5-deadline-s before every long "
                          "request finished")


def plot_itl(plt, res):
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in ("colocated", "disaggregated", "disaggregated_in_process") if n in res]
    labels = {"colocated": "colocated", "disaggregated": res["disaggregated"]["path"],
              "disaggregated_in_process": "in-process"}
    for i, key in enumerate(("p50_ms", "p99_ms")):
        vals = [res[n]["itl_while_prompts_arrive"][key] or 0 for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4,
               label=key.replace("_ms", ""))
    ax.set_xticks([j + 0.2 for j in range(len(names))], [labels[n] for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("inter-token latency, ms")
    ax.legend()
    ax.set_title(f"fig 5: {res['config']['long_prompts']} x "
                 f"{res['config']['long_prompt_tokens']}-token prompts arriving")
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
    g = p.add_argument_group("figure 1 (single stream)")
    g.add_argument("--fig1-prompts", type=int, default=4)
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
    g.add_argument("--fig3-reps", type=int, default=2)
    g = p.add_argument_group("figure 4 (KV transfer)")
    g.add_argument("--fig4-reps", type=int, default=10)
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
    log(f"figures {nums} on {args.device} ({args.dtype}) -> {args.out}")
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
