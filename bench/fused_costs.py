"""Device time of each graph a decode step replays, by batch bucket, verify rows and drafts.

    python -m bench.fused_costs --model /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR

For the no-spec engine's decode graph and for the speculative engine's fused step (verify q
rows per sequence, then draft d tokens: the head's first step and d - 1 chained steps), every
graph is replayed back to back between CUDA events, so the time is the device's alone (a
replay's host launch is shorter than its device time). Contexts hold `--context` tokens; the
verified rows store no KV. A kernel table for the single-stream graphs shows where a draft's
time goes. Writes fused_costs.json (+ kernels_*.txt) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fill(gs, b: int, q: int, context: int, block_size: int, drafts: int,
         long: bool = False, dead: bool = False) -> None:
    """Valid inputs in a captured bucket's static buffers: b sequences of `context` tokens
    whose last q rows are queried, blocks 1, 2, ... per sequence, each row storing its KV at
    its position (`dead`: no row stores KV, slot -1, so every row is dead to the projections
    of `ops.SKIP_DEAD_ROWS`; how this filled every bucket until 05f9b80)."""
    ids, pos, meta, extras = gs._views(b, q, long)
    dev = ids.device
    nblk = -(-(context + 16) // block_size)
    ids.copy_(torch.randint(100, 20000, (b * q,), device=dev))
    p = (torch.arange(q, device=dev) + context - q).repeat(b)
    pos.copy_(p)
    meta.query_start.copy_(torch.arange(b + 1, device=dev) * q)
    meta.seq_lens.fill_(context)
    tab = torch.arange(b * nblk, device=dev).view(b, nblk) + 1
    meta.block_tables.zero_()
    meta.block_tables[:, :nblk].copy_(tab)
    # each row's slot in its sequence's blocks (the table's), or none
    blk = tab.gather(1, p.view(b, q) // block_size).view(-1)
    meta.slot_mapping.copy_(torch.full_like(p, -1) if dead else
                            blk * block_size + p % block_size)
    for e in extras:  # the fused step's per-row draft counts
        e.zero_()
        e.view(b, q, -1)[:, 0] = drafts


def device_us(g: torch.cuda.CUDAGraph, reps: int = 50) -> tuple[float, float]:
    """(device us per replay, best of 3; host us to launch one replay on an idle device)."""
    from engine.graphs import replay_us

    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    host = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    return round(replay_us(g, reps), 1), round(host, 1)


def kernels(g: torch.cuda.CUDAGraph, path: str, reps: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(f"{reps} replays\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                          max_name_column_width=70))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def admission_setting(text: str) -> dict:
    """`delay:share`, or `delay:share:drain` (arrivals wait for a drain instead of being
    prefilled beside the step in flight), as EngineConfig fields."""
    d, sh, *rest = text.split(":")
    if rest not in ([], ["drain"]):
        raise ValueError(f"admission setting {text!r}: delay:share or delay:share:drain")
    return {"admission_delay_steps": int(d), "admission_share": int(sh),
            "admit_in_flight": not rest}


def steady_ab(spec_eng, plain, concurrency: list[int], reps: int, tokens: int = 128,
              admission: list[str] = (), fixed_k: list[int] = (),
              trace_dir: str | None = None) -> list[dict]:
    """Figure 3's steady mixed workload at each concurrency, the no-spec engine, the
    speculative engine held at K=0 and the one with dynamic K taking turns `reps` times, so a
    drift of the host's speed between runs lands on all three alike. `admission`: settings
    (`admission_setting`) under which a no-spec and a dynamic engine also take their turns
    (`no_spec@d:s`, `eagle3_dynamic@d:s:drain`, ...). `fixed_k`: speculative engines held at
    each of these K take turns too (`eagle3_k<K>`): the true price of each K under this
    load, against which dynamic K's choices can be read. `trace_dir`: each speculative
    engine's steps as its cost model saw them in the timed runs (`StepCosts.trace`) go to
    trace_c<c>.json there."""
    from bench.common import (
        held_out_messages,
        hold_at_k,
        paths_delta,
        start_trace,
        step_costs,
        step_paths,
        take_trace,
    )
    from bench.step_profile import steady_tokens

    if not concurrency:
        return []

    def paths(e) -> dict:  # `step_paths` and the arrivals prefilled beside a step in flight
        return step_paths(e) | {"beside": e.admitted_in_flight}

    forced = spec_eng.with_config(num_blocks=8192)
    hold_at_k(forced)
    engines = {"no_spec": plain, "eagle3_k0": forced, "eagle3_dynamic": spec_eng}
    for k in fixed_k:
        engines[f"eagle3_k{k}"] = held = spec_eng.with_config(num_blocks=8192)
        hold_at_k(held, k)
    for a in admission:
        for name, e in (("no_spec", plain), ("eagle3_dynamic", spec_eng)):
            engines[f"{name}@{a}"] = e.with_config(num_blocks=8192, **admission_setting(a))
    prompts = [spec_eng.encode_prompt(m) for m in held_out_messages(max(concurrency))]
    out = []
    for c in concurrency:
        for e in engines.values():
            e.capture_graphs(range(1, c + 1))
            steady_tokens(e, prompts, c, tokens)  # warm: JIT, the dynamic-K cost model
        runs = {k: [] for k in engines}
        before = {k: paths(e) for k, e in engines.items()}
        tracing = [k for k, e in engines.items() if start_trace(e)]
        for _ in range(reps):
            for k, e in engines.items():
                sync()
                t0 = time.perf_counter()
                toks = steady_tokens(e, prompts, c, tokens)
                sync()
                runs[k].append(round(toks / (time.perf_counter() - t0), 1))
        row = {"concurrency": c, "tokens_per_s": runs,
               "best_vs_no_spec": {k: round(max(v) / max(runs["no_spec"]), 3) for k, v in
                                   runs.items()},
               # How the timed steps ran: fused / overlapped steps, K of each fused step,
               # arrivals prefilled beside the step in flight; and the dynamic-K cost model.
               "paths": {k: paths_delta(before[k], paths(e)) for k, e in engines.items()},
               "step_costs": {k: cost for k, e in engines.items()
                              if (cost := step_costs(e)) is not None}}
        print(json.dumps(row), flush=True)
        out.append(row)
        traces = {k: take_trace(engines[k]) for k in tracing}
        if trace_dir is not None:
            with open(os.path.join(trace_dir, f"trace_c{c}.json"), "w") as f:
                json.dump(traces, f)
    return out


def main(argv=None) -> int:
    from bench.common import apply_settings, save_json
    from engine import Engine
    from engine.config import SpecConfig

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--batches", default="1,2,4,8,32,64")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--ab", default="2,8",
                   help="concurrencies of the interleaved steady A/B (no-spec, K=0, dynamic); "
                        "empty: skip")
    p.add_argument("--ab-reps", type=int, default=3)
    p.add_argument("--ab-admission", default="",
                   help="admission settings delay:share[:drain] (e.g. 2:16:drain,4:8) "
                        "that a no-spec and a dynamic engine also run the A/B under; "
                        "drain: arrivals wait for a drain, not prefilled beside the step "
                        "in flight")
    p.add_argument("--ab-fixed-k", default="",
                   help="K values (e.g. 1,2,5) at which held speculative engines also run "
                        "the A/B")
    p.add_argument("--dead-rows", action="store_true",
                   help="every row stores no KV (slot -1): with engine.ops.SKIP_DEAD_ROWS=True "
                        "what a verify's cut rows cost (the default: every row stores KV)")
    p.add_argument("--set", action="append", default=[], metavar="module.NAME=VALUE",
                   help="set a module constant before the engine loads (repeatable), e.g. "
                        "engine.spec.fused.FOLD_CHAIN=False")
    args = p.parse_args(argv)
    try:
        settings = apply_settings(args.set)  # before anything is captured
    except (ValueError, ImportError, AttributeError) as e:
        p.error(f"--set: {e}")
    fixed_k = [int(k) for k in args.ab_fixed_k.split(",") if k]
    admission = [a for a in args.ab_admission.split(",") if a]
    for a in admission:
        admission_setting(a)  # a bad setting fails here, before the model loads
    os.makedirs(args.out, exist_ok=True)
    spec = SpecConfig(method="eagle3", num_tokens=args.k, dynamic=True)
    eng = Engine.from_pretrained(args.model, device="cuda", dtype=torch.bfloat16,
                                 num_blocks=8192, enable_prefix_caching=False, spec=spec)
    plain = eng.with_config(spec=None, num_blocks=8192)
    bs = eng.config.block_size
    fused = eng.spec.fused
    # First, while no graph buffer was made under inference mode (the engines' own steps run
    # outside it).
    ab = steady_ab(eng, plain, [int(c) for c in args.ab.split(",") if c], args.ab_reps,
                   admission=admission, fixed_k=fixed_k, trace_dir=args.out)
    rows = []
    with torch.inference_mode():
        for b in [int(x) for x in args.batches.split(",") if x]:
            gs = plain.runner.graphs
            # the attention variant the engine's steps take at this context (split-KV past
            # long_context keys, where the batch is few enough sequences)
            long = gs.long_variant(b, args.context)
            gs.capture(b, 1, long)
            fill(gs, b, 1, args.context, bs, 0, long, args.dead_rows)
            dev, host = device_us(gs.graphs[(b, 1, long)][0])
            row = {"batch": b, "split_kv": long, "plain_decode_us": dev,
                   "plain_launch_host_us": host, "fused": []}
            if b == 1:
                kernels(gs.graphs[(b, 1, long)][0], os.path.join(args.out, "kernels_plain_b1.txt"))
            for q in fused.query_levels:
                for d in fused.draft_levels:
                    fs = fused.set_for(d)
                    flong = fs.long_variant(b, args.context)
                    fs.capture(b, q, flong)
                    fill(fs, b, q, args.context, bs, d, flong, args.dead_rows)
                    g = fs.graphs[(b, q, flong)][0]
                    dev, host = device_us(g)
                    row["fused"].append({"q": q, "drafts": d, "device_us": dev,
                                         "launch_host_us": host})
                    print(f"b={b} q={q} d={d}: {dev} us (launch {host} us)", flush=True)
                    if b == 1 and (q, d) in ((1, 0), (1, 1), (fused.query_levels[-1],
                                                             fused.draft_levels[-1])):
                        kernels(g, os.path.join(args.out, f"kernels_fused_b1_q{q}_d{d}.txt"))
            print(f"b={b} plain decode {row['plain_decode_us']} us", flush=True)
            rows.append(row)
    res = {"command": "python -m bench.fused_costs " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(),
           "context": args.context, "k": args.k, "settings": settings,
           "dead_rows": args.dead_rows, "rows": rows,
           "steady_ab": ab}
    save_json(os.path.join(args.out, "fused_costs.json"), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
