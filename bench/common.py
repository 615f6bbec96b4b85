"""Helpers the benchmark figures share: logging, the environment record, ratios and rounding,
graph pre-capture, the SmolLM2 engines and random-weight ones, speculation counters, and ways
to run prompts (each alone, arriving apart, handed from a prefill engine to a decode one)."""

from __future__ import annotations

import gc
import json
import os
import platform
import shlex
import sys
import time
import traceback

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def lazy_torch():
    """torch, imported on first use."""
    import torch

    return torch


def is_cuda(args) -> bool:
    return str(args.device).startswith("cuda")


def sync(args) -> None:
    if is_cuda(args):
        lazy_torch().cuda.synchronize()


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


def free_memory() -> None:
    from engine.collector import unfreeze

    unfreeze()  # what `precapture` froze: a discarded engine's cycles must be collectable
    gc.collect()
    torch = lazy_torch()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(args) -> dict:
    torch = lazy_torch()
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
           "gpu": None, "gpu_count": 0}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - a missing library is a fact to record
            env[name] = f"not importable: {e}"
    # The CPUs the host thread was kept on, and each allowed CPU's probe (engine/affinity.py)
    env["host_cpus"] = getattr(args, "host_cpus", None)
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


_HEAD_SUMMARIES: dict[tuple, dict] = {}


def head_summary(folder: str) -> dict:
    """Which EAGLE-3 head a figure ran: its folder, draft vocabulary, a hash of its weights
    and, where its training.json says, when and how well it trained. Hashed once per process
    while the weights file is unchanged (figures 1 and 3 in one run name the same head)."""
    st = os.stat(os.path.join(folder, "model.safetensors"))
    key = (os.path.abspath(folder), st.st_mtime_ns, st.st_size)
    if key not in _HEAD_SUMMARIES:
        _HEAD_SUMMARIES[key] = _head_summary(folder)
    return dict(_HEAD_SUMMARIES[key])


def _head_summary(folder: str) -> dict:
    import hashlib

    out = {"folder": folder}
    with open(os.path.join(folder, "config.json")) as f:
        out["draft_vocab_size"] = json.load(f).get("draft_vocab_size")
    h = hashlib.sha256()
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    out["weights_sha256"] = h.hexdigest()[:16]
    path = os.path.join(folder, "training.json")
    if os.path.isfile(path):
        with open(path) as f:
            t = json.load(f)
        last = (t.get("history") or [{}])[-1]
        out["trained"] = {"date": t.get("date"), "steps": t.get("steps"),
                          "unfinished": t.get("unfinished", False),
                          "eval_expected_acceptance": last.get("eval_expected_acceptance")}
    return out


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
    return getattr(lazy_torch(), args.dtype)


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


def variant(base, head, deterministic: bool, **kw):
    """A fresh engine on `base`'s weights (and EAGLE-3 `head`, where `spec` asks for EAGLE-3) in
    the deterministic mode or not, no speculation unless `spec` is given, other `EngineConfig`
    fields from `kw`."""
    from dataclasses import replace

    from engine import Engine

    kw.setdefault("spec", None)
    cfg = replace(base.config, deterministic=deterministic, **kw)
    eagle3 = cfg.spec is not None and cfg.spec.method == "eagle3"
    return Engine(cfg, weights_of=base, draft_head=head if eagle3 else None)


def decode_path() -> str | None:
    """How the loaded SmolLM2 engines' tokenizer decoded: "byte table" (`Tokenizer.decode`
    joining token bytes), "tokenizer", or None before any decode (or engine)."""
    for eng in _SMOL.values():
        table = eng.tokenizer._bytes
        if table is not None:
            return "byte table" if table else "tokenizer"
    return None


def eagle(args, k: int, dynamic: bool, context: bool | None = None):
    """EAGLE-3 at K=k; `context`: drafts from the context too (default: --context-drafts,
    else SpecConfig's default)."""
    from engine.config import SpecConfig

    if context is None:
        context = {"on": True, "off": False}.get(getattr(args, "context_drafts", None))
    extra = {} if context is None else {"context_drafts": context}
    return SpecConfig(method="eagle3", num_tokens=k, dynamic=dynamic, head=args.head,
                      accept_model=getattr(args, "accept_model", "geometric"), **extra)


def spec_fields(text: str | None) -> dict:
    """"field=value,field=value" as SpecConfig fields (values Python literals, else strings),
    checked against SpecConfig: an unknown field or a refused value raises ValueError."""
    import ast
    from dataclasses import fields, replace

    from engine.config import SpecConfig

    out = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in {f.name for f in fields(SpecConfig)}:
            raise ValueError(f"{item!r} is not SpecConfig field=value")
        try:
            out[name] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[name] = raw.strip()
    replace(SpecConfig(num_tokens=16), **out)  # refused values raise here
    return out


def ngram(k: int):
    from engine.config import SpecConfig

    return SpecConfig(method="ngram", num_tokens=k, dynamic=False)


def precapture(eng, batch_sizes, long_context: bool | None = None) -> str:
    """Capture the CUDA graphs the timed runs will replay, so no capture lands inside a timed
    region (`Engine.capture_graphs`); the returned note says what happened. By default with
    the split-KV variants (the engine's default, as nodes capture): figures 1 and 3 pass
    128 tokens of context (`long_context` on CUDA)."""
    from engine import jit_watch

    jit_watch.install()  # the figures record the compiles inside their timed windows
    if eng.runner.graphs is None:
        return "no CUDA graphs (eager)"
    try:
        # As a serving process prepares (graphs, then the objects alive frozen out of the
        # collector), for the batch sizes the figure runs; the engine then counts as ready,
        # so its first generate captures nothing more.
        n = eng.prepare_to_serve(batch_sizes=batch_sizes, long_context=long_context)
        return f"captured {n} graphs before timing in {eng.ready.graphs:.1f} s"
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
        out.update({f"why_{w}": n for w, n in eng.spec.policy.batch_why.items()})
    return out


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


def paths_delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}


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


def acceptance(before: tuple[int, int], after: tuple[int, int]):
    steps = after[1] - before[1]
    return round((after[0] - before[0]) / steps, 3) if steps else None


def first_diff(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def single(args, eng, prompts, params) -> tuple[list[list[int]], float]:
    """Each prompt alone (params: one, or one per prompt): its tokens, and the seconds all took."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    sync(args)
    t0 = time.perf_counter()
    outs = [eng.generate([p], sp)[0].token_ids for p, sp in zip(prompts, plist)]
    sync(args)
    return outs, time.perf_counter() - t0


def staggered(eng, prompts, params, every: int) -> list[list[int]]:
    """All prompts as concurrent streams, one arriving every `every` engine steps (at once
    when nothing runs); their tokens, in arrival order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    pending, seqs, step = list(zip(prompts, plist)), [], 0
    while pending or eng.has_unfinished():
        if pending and (step % every == 0 or not eng.has_unfinished()):
            seqs.append(eng.seqs[eng.add_request(*pending.pop(0))])
        eng.step()
        step += 1
    return [s.output_ids for s in seqs]


def handed_off(pre, dec, prompt, params) -> list[int]:
    """One prompt prefilled on `pre`, its KV blocks copied into blocks `dec` reserved, decoded
    on `dec` (in process, as a prefill node hands a request to a decode node)."""
    rid = pre.add_request(prompt, params, hold=True)
    out: list[int] = []
    while pre.has_unfinished() or dec.has_unfinished():
        for o in pre.step():
            out += o.token_ids
            if o.handoff:
                h = pre.export_handoff(rid)
                dst = dec.reserve(rid, h.num_computed)
                src = pre.held_blocks(rid)[:len(dst)]
                dec.kv_cache[:, :, dst] = pre.kv_cache[:, :, src].to(dec.kv_cache)
                pre.release(rid)
                dec.admit(h)
        for o in dec.step():
            out += o.token_ids
    return out


def timed_ms(fn, reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds per call of fn, one CUDA-event pair per call; the host never waits between
    calls, so this is device time (host overhead shows only where it starves the GPU)."""
    torch = lazy_torch()
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


def setting(path: str):
    """(module, NAME) of a "module.NAME" module constant; refuses a name the module lacks."""
    import importlib

    module, _, name = path.strip().rpartition(".")
    if not module or not name:
        raise ValueError(f"{path!r} is not module.NAME")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise AttributeError(f"{module} has no {name}")
    return mod, name


def parse_setting(item: str) -> tuple[str, object]:
    """("module.NAME", VALUE) of a "module.NAME=VALUE" string (VALUE a Python literal, else a
    string), checked against the module (`setting`) but not set."""
    import ast

    path, sep, raw = item.partition("=")
    if not sep:
        raise ValueError(f"{item!r} is not module.NAME=VALUE")
    setting(path)
    try:
        return path.strip(), ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        return path.strip(), raw.strip()


def apply_settings(items: list[str]) -> dict:
    """Set module constants from "module.NAME=VALUE" strings (`parse_setting`) for an A/B
    process; only names the module already has. Returns what was set."""
    done = {}
    for item in items:
        path, value = parse_setting(item)
        setattr(*setting(path), value)
        done[path] = value
    return done


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


def random_engine(args, model_cfg, num_blocks: int, device: str | None = None, **kw):
    """An engine with random weights (timing only): matrices ~ N(0, 0.02), norms 1."""
    from engine import Engine, EngineConfig

    torch = lazy_torch()
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
