"""The disaggregated cluster on two GPUs: placement, UCX over CUDA memory, and equality.

Starts `deploy/examples/two-gpu.yaml` behind the gRPC router, streams N concurrent greedy chat
requests through the SDK, and compares every token with one colocated engine. Reports actor
placement, KV bytes moved, TTFT and tokens/s as JSON.

    python -m cluster.gpu_check --model /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out bench/results/cluster_two_gpu.json [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "List three fruits that are red.", "Translate 'good morning, my friend' into Spanish.",
           "Explain what a hash table is to a ten-year-old.",
           'Give me a JSON object with keys "name" and "age" for a fictional person.',
           "Write a haiku about the ocean at night.", "What is 17 times 23? Show your steps."]


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length where it is
    the other's head); None where they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def kill_decode_mid_stream(c, target: str, messages, max_tokens: int, want) -> dict:
    """Stream one greedy request and kill the decode actor after 8 tokens (Ray restarts it;
    the router moves the stream): where it died, the longest gap between chunks, the moves,
    and whether the tokens equal the uninterrupted run's `want`."""
    import ray

    from tandem_client import Client

    toks, stamps, killed_at, resumes = [], [], None, c.backend.resumes
    t0 = time.perf_counter()
    with Client(target, timeout=600, retries=0) as cl:
        for ch in cl.generate(messages=messages, temperature=0, max_tokens=max_tokens,
                              ignore_eos=True):
            stamps.append(time.perf_counter())
            toks.extend(ch.token_ids)
            if killed_at is None and len(toks) >= 8:
                killed_at = len(toks)
                ray.kill(c.decodes[0], no_restart=False)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"killed_at_token": killed_at, "tokens": len(toks), "tokens_equal": toks == want,
            "pause_s": round(max(gaps), 3) if gaps else None,
            "stream_s": round(stamps[-1] - t0, 3) if stamps else None,
            "resumes": c.backend.resumes - resumes}


def main() -> int:
    # imported here, so that `first_diff` costs its importers no torch or Ray
    import ray
    import torch

    from cluster import launcher
    from cluster.config import apply_overrides, load_config
    from cluster.engine_args import engine_kwargs
    from engine import Engine, SamplingParams
    from router.server import GenerationService, start_server
    from tandem_client import Client

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default="deploy/examples/two-gpu.yaml")
    ap.add_argument("--dtype", default="float32", help="float32 makes equality exact-ish")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/cluster_two_gpu.json")
    ap.add_argument("--kill-decode", action="store_true",
                    help="then stream request 0 again and kill the decode actor after 8 "
                         "tokens: Ray restarts it, the router moves the stream; records the "
                         "pause and whether the tokens equal the uninterrupted ones")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides, e.g. transfer.ipc_across_gpus=true (the KV "
                         "then moves between the actors' GPUs by CUDA IPC, push or pull)")
    args = ap.parse_args()
    sets = [f"model.dtype={args.dtype}", "metrics.port_base=0"] + args.set
    if "gpu" in args.config:
        sets += ["prefill.gpu_memory_utilization=0.3", "decode.gpu_memory_utilization=0.3"]
    if args.model:
        sets.append(f"model.path={args.model}")
    cfg = apply_overrides(load_config(args.config), sets)
    res = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": {"gpus": [torch.cuda.get_device_name(i)
                                for i in range(torch.cuda.device_count())],
                       "platform": platform.platform(),
                       "torch": torch.__version__, "ray": ray.__version__,
                       "python": platform.python_version()},
           "config": args.config, "overrides": sets}
    t0 = time.perf_counter()
    c = launcher.start_from_config(cfg)
    res["startup_s"] = round(time.perf_counter() - t0, 1)
    infos = ray.get([a.info.remote() for a in c.prefills + c.decodes])
    res["placement"] = [i["placement"] for i in infos]
    uuids = {i["placement"].get("gpu_uuid") for i in infos}
    res["distinct_gpus"] = len(uuids - {None})
    print(json.dumps(res["placement"], indent=1), flush=True)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, port = asyncio.run_coroutine_threadsafe(
        start_server(GenerationService(c.backend)), loop).result(120)
    target = f"127.0.0.1:{port}"
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    got, ttft, secs = [None] * len(msgs), [0.0] * len(msgs), [0.0] * len(msgs)

    def run(i):
        with Client(target, timeout=90) as cl:
            t = time.perf_counter()
            toks, first = [], None
            for ch in cl.generate(messages=msgs[i], temperature=0, max_tokens=args.max_tokens,
                                  ignore_eos=True):
                if first is None and ch.token_ids:
                    first = time.perf_counter() - t
                toks.extend(ch.token_ids)
            got[i], ttft[i], secs[i] = toks, first or 0.0, time.perf_counter() - t

    try:
        run(0)  # warm-up: graph capture and kernel compilation on both actors
    except Exception as e:  # report, then stop: later requests would hang the same way
        res["error"] = repr(e)
        print(json.dumps(res, indent=1, default=str), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
        c.shutdown()
        return 1
    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(msgs))]
    t1 = time.perf_counter()
    [t.start() for t in ts]
    [t.join(600) for t in ts]
    wall = time.perf_counter() - t1
    stats = ray.get([a.stats.remote() for a in c.prefills + c.decodes])
    moved, paths = ray.get(c.prefills[0].__ray_call__.remote(
        lambda n: (n.transferred_bytes, n.transfer_paths)))
    if args.kill_decode:
        res["worker_death"] = kill_decode_mid_stream(c, target, msgs[0], args.max_tokens,
                                                     got[0])
        print(json.dumps(res["worker_death"]), flush=True)
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    c.shutdown()
    ray.shutdown()

    ref_eng = Engine.from_pretrained(args.model, **engine_kwargs(cfg, "decode"))
    want = [x.token_ids for x in ref_eng.generate(
        msgs, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))]
    res.update({
        "requests": len(msgs), "max_tokens": args.max_tokens,
        "identical_to_colocated": sum(a == b for a, b in zip(got, want)),
        "first_divergence": [first_diff(a, b) for a, b in zip(got, want)],
        "ttft_ms": [round(1000 * x, 1) for x in ttft],
        "tokens_per_s_per_stream": [round(len(g) / s, 1) for g, s in zip(got, secs)],
        "aggregate_tokens_per_s": round(sum(map(len, got)) / wall, 1),
        "kv_bytes_transferred": moved,
        "kv_transfer_paths": paths,  # pull only where an actor sees the other's GPU
        "ipc_across_gpus": cfg.transfer.ipc_across_gpus,
        "blocks_all_free_after": all(s["blocks_free"] == s["blocks_total"] for s in stats),
        "node_stats": stats,
    })
    print(json.dumps({k: v for k, v in res.items() if k != "node_stats"}, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
