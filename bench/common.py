"""Helpers the benchmark figures share: logging, the environment record, ratios and rounding,
challengers against the engine's default speculation, held-out prompts, graph pre-capture, the
SmolLM2 engines and random-weight ones, speculation counters, and ways to run prompts (each
alone, arriving apart, handed from a prefill engine to a decode one)."""

from __future__ import annotations

import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback

from cluster.gpu_check import first_diff  # noqa: F401 - the figures compare streams with it

T0 = time.perf_counter()
SETTINGS_ENV = "TANDEM_BENCH_SET"  # a figure's --set values, for the processes it starts


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
                          "eval_expected_acceptance": last.get("eval_expected_acceptance"),
                          "eval_tokens_per_forward": last.get("eval_tokens_per_forward")}
    return out


def rnd(x, n: int = 3):
    return None if x is None else round(float(x), n)


def ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


def challenger_summary(rows: dict, names: list[str]) -> dict:
    """Per challenger, over rows keyed by what was measured (a domain, a concurrency), each
    {variant: {"tokens_per_s", "vs_default"}}: the keys where it is faster than engine_default
    (both measured), and the least and mean of its measured ratios to engine_default."""
    out = {}
    for c in names:
        got = [r[c]["vs_default"] for r in rows.values()
               if r.get(c, {}).get("vs_default") is not None]
        out[c] = {"beats_default_on": [
            d for d, r in rows.items() if r.get(c, {}).get("tokens_per_s") is not None
            and r.get("engine_default", {}).get("tokens_per_s") is not None
            and r[c]["tokens_per_s"] > r["engine_default"]["tokens_per_s"]],
            "min_vs_default": min(got, default=None),
            "mean_vs_default": rnd(statistics.fmean(got)) if got else None}
    return out


def default_best(challengers: dict, rows: int) -> bool | None:
    """False when some challenger (`challenger_summary`) is faster than engine_default on each
    of the `rows` rows (one that failed to measure is not beaten), else True; None when no
    challenger measured a ratio."""
    ran = [s for s in challengers.values() if s["min_vs_default"] is not None]
    if not ran or not rows:
        return None
    return not any(len(s["beats_default_on"]) == rows for s in ran)


def held_out_messages(n: int, offset: int = 0) -> list[list[dict]]:
    from cluster import prompt_sets

    _, held_out = prompt_sets.build()
    if not held_out:
        raise RuntimeError("cluster.prompt_sets.build() gave no held-out prompts")
    return [[{"role": "user", "content": held_out[(offset + i) % len(held_out)]}]
            for i in range(n)]


# Python's own standard library: signatures and docstrings, text no prompt set here holds.
STDLIB = ("posixpath", "shutil", "textwrap", "statistics", "difflib", "inspect", "fractions",
          "calendar", "ipaddress", "string", "json", "csv", "fnmatch", "heapq", "bisect", "html",
          "urllib.parse", "email.utils", "random", "tempfile", "argparse", "functools",
          "zipfile", "gzip", "pprint", "shlex", "copy", "dataclasses", "base64",
          "configparser", "logging", "pathlib", "tarfile", "mailbox", "ftplib", "imaplib")
DOC_CHARS = 900  # of one docstring, so no single stub makes a prompt jump past its length
SHARE_EVERY = 4  # every fourth prompt asks about another function after its predecessor's text


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


def engine_default(args):
    """What an engine given `spec=SpecConfig()` runs: every field at its default (--head
    names another EAGLE-3 head)."""
    from engine.config import SpecConfig

    return SpecConfig(head=args.head)


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
    the split-KV variants (the engine's default, as nodes capture): contexts past
    `long_context` (one split) take them."""
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


def paths_delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}


def acceptance(before: tuple[int, int], after: tuple[int, int]):
    steps = after[1] - before[1]
    return round((after[0] - before[0]) / steps, 3) if steps else None


def single(args, eng, prompts, params) -> tuple[list[list[int]], float]:
    """Each prompt alone (params: one, or one per prompt): its tokens, and the seconds all took."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    sync(args)
    t0 = time.perf_counter()
    outs = [eng.generate([p], sp)[0].token_ids for p, sp in zip(prompts, plist)]
    sync(args)
    return outs, time.perf_counter() - t0


def staggered(eng, prompts, params, every: int) -> list[list[int]]:
    """All prompts as concurrent streams, one arriving every `every` engine steps (all at once
    for 0, and whenever nothing runs); their tokens, in arrival order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    pending, seqs, step = list(zip(prompts, plist)), [], 0
    while pending or eng.has_unfinished():
        while pending and (not every or step % every == 0 or not eng.has_unfinished()):
            seqs.append(eng.seqs[eng.add_request(*pending.pop(0))])
            if every:
                break
        eng.step()
        step += 1
    return [s.output_ids for s in seqs]


def handed_off(pre, dec, prompts, params) -> list[list[int]]:
    """Each prompt prefilled on `pre` (all in flight at once), its KV blocks copied into blocks
    `dec` reserved, decoded on `dec` (in process, as a prefill node hands a request to a decode
    node); their tokens, in order."""
    rids = [pre.add_request(p, params, hold=True) for p in prompts]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    while pre.has_unfinished() or dec.has_unfinished():
        for o in pre.step():
            outs[o.request_id] += o.token_ids
            if o.handoff:
                h = pre.export_handoff(o.request_id)
                dst = dec.reserve(o.request_id, h.num_computed)
                src = pre.held_blocks(o.request_id)[:len(dst)]
                dec.kv_cache[:, :, dst] = pre.kv_cache[:, :, src].to(dec.kv_cache)
                pre.release(o.request_id)
                dec.admit(h)
        for o in dec.step():
            outs[o.request_id] += o.token_ids
    return [outs[r] for r in rids]


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
