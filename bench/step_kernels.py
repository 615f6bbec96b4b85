"""Where a captured decode forward's device time goes, kernel by kernel: the random
Llama-3.1-8B shape (figure 2's engine and inputs: batch 1, 512 tokens of context) replayed
from its CUDA graph under the profiler, at 1 query token and at a verify's 6.

    python -m bench.step_kernels --out DIR [--tokens 1,6] [--replays 20]

For each query count: the span of a forward (first kernel start to last kernel end), the sum
of kernel durations, and per kernel name its launches per forward and its marginal time, the
time by which it ends after the kernel before it ends. Under programmatic dependent launch a
kernel starts early and waits for the one before, so its own duration overstates its cost;
the marginal times add up to the span. Writes DIR/step_kernels.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from types import SimpleNamespace

import torch


def kernels_of_replays(fn, replays: int) -> list[list[tuple[str, float, float]]]:
    """(name, start us, end us) of each kernel of each call of fn, profiled; calls are told
    apart by a host sync and a gap between them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
            torch.cuda.synchronize()
            time.sleep(0.002)
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.device_time > 0 and "Memcpy" not in e.name and "Memset" not in e.name),
                 key=lambda e: e.time_range.start)
    calls, cur, last_end = [], [], None
    for e in evs:
        start, end = e.time_range.start, e.time_range.end
        if last_end is not None and start - last_end > 1000:  # the 2 ms host gap
            calls.append(cur)
            cur = []
        cur.append((e.name, start, end))
        last_end = end if last_end is None else max(last_end, end)
    if cur:
        calls.append(cur)
    return calls


def summarize(calls: list[list[tuple[str, float, float]]]) -> dict:
    """Median span, kernel-time sum and launches of a forward; per kernel name its launches
    per forward and median marginal us per forward."""
    spans, sums, counts = [], [], []
    per: dict[str, list[float]] = defaultdict(list)
    launches: dict[str, int] = {}
    for ks in calls[1:] or calls:  # the first call may carry profiler start-up
        spans.append(max(e for _, _, e in ks) - ks[0][1])
        sums.append(sum(e - s for _, s, e in ks))
        counts.append(len(ks))
        marg: dict[str, float] = defaultdict(float)
        n: dict[str, int] = defaultdict(int)
        prev_end = ks[0][1]
        for name, _, end in ks:
            marg[name] += max(0.0, end - prev_end)
            n[name] += 1
            prev_end = max(prev_end, end)
        for name, v in marg.items():
            per[name].append(v)
            launches[name] = n[name]
    kernels = {name[:90]: {"launches": launches[name],
                           "marginal_us": round(statistics.median(v), 1),
                           "marginal_us_per_launch": round(statistics.median(v)
                                                           / launches[name], 2)}
               for name, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))}
    return {"forwards": len(spans), "span_us": round(statistics.median(spans), 1),
            "kernel_time_sum_us": round(statistics.median(sums), 1),
            "launches": int(statistics.median(counts)), "kernels": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--tokens", default="1,6")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.step_kernels needs CUDA")
    from bench.common import command_line, environment, llama8b_shape, random_engine
    from engine.attention import triton_backend
    from engine.graphs import pack

    qlens = [int(x) for x in args.tokens.split(",")]
    ctx = args.context
    per_seq = -(-(ctx + max(qlens) + 1) // 16)
    ns = SimpleNamespace(device="cuda", dtype="bfloat16")
    eng = random_engine(ns, llama8b_shape(), per_seq + 8)
    eng.runner.enable_graphs(1, qlens, ())
    m = eng.config.model
    res = {"name": "step_kernels", "command": command_line(), "environment": environment(ns),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "model": m.name, "context_tokens": ctx, "pdl": triton_backend.PDL is not False,
           "forwards": {}}
    with torch.inference_mode():
        for q in qlens:
            ids = [(7 * j + 11) % m.vocab_size for j in range(q)]
            inp = pack(ids, [ctx + j for j in range(q)], [list(range(1, 1 + per_seq))], [q], 16)
            rows = list(range(q))
            fn = lambda inp=inp, rows=rows: eng.runner.forward_packed(inp, rows)  # noqa: E731
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            res["forwards"][q] = s = summarize(kernels_of_replays(fn, args.replays))
            print(f"{q} tokens: span {s['span_us']} us, kernels {s['kernel_time_sum_us']} us, "
                  f"{s['launches']} launches", flush=True)
            for name, k in list(s["kernels"].items())[:12]:
                print(f"  {k['marginal_us']:8.1f} us  x{k['launches']:<4d} {name}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
