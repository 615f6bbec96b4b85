"""Where an engine step's time goes: host sections (cProfile) and device kernels (torch
profiler) for no speculation, fixed-K EAGLE-3 and dynamic K at a few concurrencies.

    python -m bench.step_profile --model PATH.gguf --out DIR [--concurrency 1,16,64]

Writes DIR/step_profile.json (tokens/s, steps, ms per step, cumulative seconds of the step's
sections) and DIR/profile_<variant>_c<N>.txt (the top functions by own time) and, on CUDA,
DIR/kernels_<variant>_c<N>.txt (device time per kernel)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

SECTIONS = {
    "schedule": ("scheduler.py", "schedule"),
    "run": ("engine.py", "_run"),
    "forward": ("runner.py", "forward"),
    "postprocess": ("engine.py", "_postprocess"),
    "propose": ("runtime.py", "propose"),
    "eagle_first_step": ("runtime.py", "_step"),
    "chain": ("runtime.py", "_chain"),
    "graph_fill": ("graphs.py", "_fill"),
    "graph_replay": ("graphs.py", "run"),
    "emit": ("engine.py", "_emit"),
    "pack": ("graphs.py", "pack"),
}


def _timer_targets():
    from engine.engine import Engine
    from engine.graphs import GraphSet, HostStager
    from engine.plain_steps import PlainSteps
    from engine.spec.policy import KPolicy
    from engine.spec.runtime import SpecRunner

    return [(Engine, n) for n in ("step", "_postprocess", "_emit", "_time_step", "_settle",
                                  "_drain", "_step_overlapped", "_step_fresh")] + \
        [(SpecRunner, n) for n in ("fused_launch", "fused_continue", "_launch",
                                   "fused_finish", "_k_for")] + \
        [(KPolicy, n) for n in ("choose_batch", "begin_propose")] + \
        [(PlainSteps, n) for n in ("fused_continue", "_launch", "fused_finish")] + \
        [(GraphSet, n) for n in ("run", "_fill")] + [(HostStager, "index")] + \
        [(torch.cuda.CUDAGraph, "replay")]


def timed_sections(run) -> dict:
    """Wall seconds inside each hot function during run() (inclusive, calls counted), with
    plain perf_counter wrappers instead of cProfile's per-call overhead; `device_wait` is the
    time spent waiting for a step's outputs to reach the host."""
    from engine.graphs import HostStager

    acc: dict[str, list] = {}
    saved = []

    def wrap(cls, name):
        fn = getattr(cls, name)
        key = f"{cls.__name__}.{name}"
        slot = acc.setdefault(key, [0.0, 0])

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                slot[0] += time.perf_counter() - t
                slot[1] += 1

        raw = cls.__dict__[name]
        saved.append((cls, name, raw))
        setattr(cls, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)

    for cls, name in _timer_targets():
        wrap(cls, name)
    fetch = HostStager.fetch
    wait_slot = acc.setdefault("device_wait", [0.0, 0])

    def timed_fetch(self, t):
        w = fetch(self, t)

        def wait():
            t0 = time.perf_counter()
            try:
                return w()
            finally:
                wait_slot[0] += time.perf_counter() - t0
                wait_slot[1] += 1
        return wait

    HostStager.fetch = timed_fetch
    try:
        run()
    finally:
        HostStager.fetch = fetch
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    return {k: {"s": round(v[0], 5), "calls": v[1]} for k, v in acc.items() if v[1]}


def sections(prof: cProfile.Profile) -> dict:
    st = pstats.Stats(prof)
    out = {}
    for name, (file, fn) in SECTIONS.items():
        tot = 0.0
        for (f, _, func), (_, _, _, ct, _) in st.stats.items():
            if func == fn and f.endswith(file):
                tot = max(tot, ct)
        out[name] = round(tot, 4)
    return out


def kernel_table(eng, batch, out: str, tag: str) -> float:
    """Device time per kernel and host time per op or CUDA runtime call over a short run
    (torch profiler); returns the busy seconds."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        eng.generate(batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        torch.cuda.synchronize()
    avg = tp.key_averages()
    with open(os.path.join(out, f"kernels_{tag}.txt"), "w") as f:
        f.write(avg.table(sort_by="self_cuda_time_total", row_limit=40))
    # The host side of the same run: CUDA runtime calls (cudaGraphLaunch, cudaLaunchKernel,
    # cudaEventSynchronize...) and ops by their own CPU time.
    with open(os.path.join(out, f"cpu_{tag}.txt"), "w") as f:
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=40))
    return round(sum(e.self_device_time_total for e in avg) / 1e6, 4)


def llama8b_breakdown(out: str, reps: int = 5) -> dict:
    """Eager decode forwards (batch 1, 512 tokens of context) of the random Llama-3.1-8B
    shape under the profiler: device time per op and input shape, and for every linear layer
    the bandwidth its weight read achieved (weight bytes / kernel time)."""
    from types import SimpleNamespace

    from torch.profiler import ProfilerActivity, profile

    from bench.common import llama8b_shape, random_engine
    from engine.graphs import pack

    args = SimpleNamespace(device="cuda", dtype="bfloat16")
    eng = random_engine(args, llama8b_shape(), 128, cuda_graphs=False)
    ctx = 512
    inp = pack([11], [ctx], [list(range(1, 1 + ctx // 16 + 1))], [1], 16)
    with torch.inference_mode():
        for _ in range(3):
            eng.runner.forward_packed(inp, [0])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     record_shapes=True) as tp:
            for _ in range(reps):
                _ = eng.runner.forward_packed(inp, [0]).logits  # the LM head too
            torch.cuda.synchronize()
    by_shape = tp.key_averages(group_by_input_shape=True)
    with open(os.path.join(out, "ops_llama8b.txt"), "w") as f:
        f.write(by_shape.table(sort_by="cuda_time_total", row_limit=40))
    with open(os.path.join(out, "kernels_llama8b.txt"), "w") as f:
        f.write(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
    linears, total = [], 0.0
    for e in by_shape:
        if e.key == "aten::linear" and e.input_shapes and len(e.input_shapes) >= 2:
            n, k = e.input_shapes[1][:2]
            us = e.device_time_total / e.count
            linears.append({"weight": [n, k], "per_step": e.count // reps,
                            "us": round(us, 1), "gb_s": round(n * k * 2 / us / 1e3, 1)})
            total += e.device_time_total / reps
    return {"linears": linears, "linear_us_per_step": round(total, 1),
            "device_us_per_step": round(sum(e.self_device_time_total for e in
                                            tp.key_averages()) / reps, 1)}


def steady_tokens(eng, prompts, c: int, n: int, generations: int = 3) -> int:
    """Figure 3's steady mixed workload (`bench.suite.steady_throughput`): c streams in
    flight, each finished request replaced at once until generations * c were admitted, output
    lengths from `mixed_lengths`; returns the tokens generated (the unfinished are aborted)."""
    from bench.suite import mixed_lengths, steady_run

    tokens, live = steady_run(eng, prompts, c, mixed_lengths(n, generations * c))
    for rid in live:
        eng.abort(rid)
    while eng.has_unfinished():  # aborted requests leave with the next step
        eng.step()
    return tokens


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None,
                   help="SmolLM2 GGUF; without it random SmolLM2-shaped weights")
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--variants", default="no_spec,eagle3_k5,eagle3_dynamic_k7")
    p.add_argument("--steady", action="store_true",
                   help="figure 3's steady mixed workload instead of one generate call: c "
                        "streams in flight, each finished request replaced at once, output "
                        "lengths uniform in [tokens/2, 3*tokens/2]")
    p.add_argument("--llama8b", action="store_true",
                   help="also break down an eager 8B-shape decode forward by op and shape")
    p.add_argument("--quiet-cpus", type=int, default=4, metavar="N",
                   help="on a GPU, keep the host thread on the N quietest CPUs "
                        "(engine/affinity.py; 0: leave the affinity alone)")
    args = p.parse_args(argv)
    from bench.common import held_out_messages, hold_at_k
    from engine import Engine, SamplingParams
    from engine.config import SpecConfig

    os.makedirs(args.out, exist_ok=True)
    cuda = args.device.startswith("cuda")
    if cuda and args.quiet_cpus:
        from engine.affinity import pin_quiet_cpus

        print("host CPUs:", json.dumps(pin_quiet_cpus(args.quiet_cpus)), flush=True)
    dt = torch.bfloat16 if cuda else torch.float32
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.model:
        base = Engine.from_pretrained(
            args.model, device=args.device, dtype=dt, num_blocks=8192,
            enable_prefix_caching=False,
            spec=SpecConfig(method="eagle3", num_tokens=5, dynamic=False))
        prompts = [base.encode_prompt(m) for m in held_out_messages(max(conc))]
    else:  # no checkpoint: random SmolLM2-shaped weights with the shipped head (timing only)
        from bench.common import random_engine
        from tests.engine.test_gpu_engine import smol_shape  # as gpu_smoke, linear_sweep

        ns = argparse.Namespace(dtype="bfloat16" if cuda else "float32", device=args.device)
        base = random_engine(ns, smol_shape(), 8192,
                             spec=SpecConfig(method="eagle3", num_tokens=5, dynamic=False))
        prompts = [[(31 * i + 7 * j) % 40000 + 100 for j in range(96 + 13 * i)]
                   for i in range(max(conc))]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    variants = {"no_spec": None,
                "eagle3_k5": SpecConfig(method="eagle3", num_tokens=5, dynamic=False),
                "eagle3_dynamic_k7": SpecConfig(method="eagle3", num_tokens=7, dynamic=True),
                # Speculation's machinery at K=0 throughout (head KV kept current, nothing
                # drafted): what a dynamic batch that switched drafting off costs per step.
                "eagle3_k0": SpecConfig(method="eagle3", num_tokens=7, dynamic=True),
                # Drafts proposed on the host from the sequence's own n-grams.
                "ngram_k5": SpecConfig(method="ngram", num_tokens=5, dynamic=False)}
    given = sys.argv[1:] if argv is None else argv
    res = {"command": "python -m bench.step_profile " + " ".join(given),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "runs": []}
    for name in args.variants.split(","):
        eng = base.with_config(spec=variants[name], num_blocks=8192)
        if name == "eagle3_k0":
            hold_at_k(eng)
        eng.capture_graphs(range(1, max(conc) + 1))  # every bucket a tail meets
        for c in conc:
            batch = [prompts[i % len(prompts)] for i in range(c)]

            def work(e=eng, bt=batch, c=c, n=args.tokens):
                """Tokens generated by one run of the workload."""
                if args.steady:
                    return steady_tokens(e, prompts, c, n)
                return sum(len(o.token_ids) for o in e.generate(bt, params))

            work()  # warm: JIT, allocations, the dynamic-K cost model
            steps0 = eng.stats.steps
            sync(cuda)
            t0 = time.perf_counter()
            toks = work()
            sync(cuda)
            wall = time.perf_counter() - t0
            steps = eng.stats.steps - steps0
            prof = cProfile.Profile()  # a second run under the profiler, for the sections
            prof.enable()
            work()
            sync(cuda)
            prof.disable()
            row = {"variant": name, "concurrency": c, "steady": args.steady,
                   "tokens_per_s": round(toks / wall, 1),
                   "steps": steps, "ms_per_step": round(1000 * wall / steps, 3),
                   "tokens_per_step": round(toks / steps, 2), "seconds": round(wall, 3),
                   "profiled_sections_s": sections(prof)}
            s0 = eng.stats.steps
            timers = timed_sections(lambda w=work: (w(), sync(cuda)))
            n = eng.stats.steps - s0
            row["timed_us_per_step"] = {k: round(1e6 * v["s"] / n, 1) for k, v in
                                        sorted(timers.items(), key=lambda kv: -kv[1]["s"])}
            row["timed_calls_per_step"] = {k: round(v["calls"] / n, 2)
                                           for k, v in timers.items()}
            if eng.spec is not None:
                row["acceptance_length"] = round(eng.spec.stats.acceptance_length, 3)
                costs = eng.spec.policy.costs.fitted()
                row["per_draft_cost"] = {str(k): round(v, 3) for k, v in costs.per_draft.items()}
                row["fixed_draft_cost"] = {str(k): round(v, 3) for k, v in costs.fixed.items()}
                row["plain_step_ms"] = {str(k): round(1000 * v, 3) for k, v in costs.plain.items()}
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
            with open(os.path.join(args.out, f"profile_{name}_c{c}.txt"), "w") as f:
                f.write(buf.getvalue())
            if cuda:
                try:
                    row["device_busy_s"] = kernel_table(eng, batch, args.out, f"{name}_c{c}")
                except Exception as e:  # noqa: BLE001
                    row["device_busy_s"] = f"profiler failed: {e}"
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
        eng = None
    if args.llama8b and cuda:
        base = None
        torch.cuda.empty_cache()
        try:
            res["llama8b"] = llama8b_breakdown(args.out)
        except Exception as e:  # noqa: BLE001
            res["llama8b"] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res["llama8b"]), flush=True)
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
