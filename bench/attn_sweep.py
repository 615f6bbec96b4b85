"""Device time of one paged-attention call: the one-pass kernel against split-KV with a few
split sizes, for the SmolLM2 and Llama-3.1-8B head shapes, over batch, context and query
count. Each timing replays a CUDA graph of `--calls` attention calls (no launch gaps).

    python -m bench.attn_sweep --out DIR

Writes DIR/attn_sweep.json."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


def _meta(b: int, q: int, ctx: int, capacity: int, block: int, device):
    from engine.attention.base import AttentionMetadata

    nb = capacity // block
    tables = torch.arange(b * nb, dtype=torch.int32, device=device).view(b, nb)
    starts = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    slots = torch.zeros(b * q, dtype=torch.int64, device=device)
    return AttentionMetadata(slot_mapping=slots, query_start=starts, seq_lens=lens,
                             block_tables=tables, max_query_len=q, max_seq_len=ctx)


def time_graph(fn, calls: int, reps: int = 5) -> float:
    """Median µs per call of fn over a graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(1000 * a.elapsed_time(b) / calls)
    return sorted(out)[len(out) // 2]


def main(argv=None) -> int:
    from engine.attention.triton_backend import SPLIT_KEYS, TritonAttention

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--queries", default="1,6")
    p.add_argument("--splits", default="32,64,128,256")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    block = 16
    rows = []
    for shape, (h, kvh, d) in SHAPES.items():
        for b in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                cap = max(ctx, 1024)
                kv = torch.randn(2, b * cap // block, block, kvh, d, dtype=dt, device=dev)
                for q in map(int, args.queries.split(",")):
                    x = torch.randn(b * q, h, d, dtype=dt, device=dev)
                    meta = _meta(b, q, ctx, cap, block, dev)
                    row = {"shape": shape, "batch": b, "context": ctx, "queries": q,
                           "kv_mb": round(2 * b * ctx * kvh * d * 2 / 2**20, 2)}
                    be = TritonAttention(h, kvh, d, block)
                    ref = None
                    for sk in [0] + [int(s) for s in args.splits.split(",")]:
                        be.split_keys = sk or SPLIT_KEYS  # one pass: the engine's key blocks
                        out = torch.empty_like(x)
                        if sk == 0:
                            meta.max_seq_len = 0  # the one-pass kernel
                            fn = (lambda be=be, m=meta, x=x, kv=kv: be.attend(x, kv, m))
                        else:
                            splits = -(-cap // sk)
                            fn = (lambda be=be, m=meta, s=splits, o=out, x=x, kv=kv:
                                  be._attend_split(x, kv[0], kv[1], o, m, s))
                        res = fn()
                        if ref is None:
                            ref = res.float()
                        err = float((res.float() - ref).abs().max())
                        us = time_graph(fn, args.calls)
                        row["one_pass_us" if sk == 0 else f"split{sk}_us"] = round(us, 2)
                        if sk:
                            row[f"split{sk}_max_err"] = round(err, 5)
                    # What the engine runs: the default split size and its own choice of
                    # path (`TritonAttention.use_split`).
                    eng = TritonAttention(h, kvh, d, block)
                    meta.max_seq_len = ctx
                    row["engine_path"] = "split" if eng.use_split(meta, dev) else "one_pass"
                    row["engine_us"] = round(time_graph(
                        lambda e=eng, m=meta, x=x, kv=kv: e.attend(x, kv, m), args.calls), 2)
                    best = min((v, k) for k, v in row.items()
                               if k.endswith("_us") and k != "engine_us")
                    row["best"] = best[1]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    res = {"command": "python -m bench.attn_sweep " + " ".join(argv or []),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name(), "rows": rows}
    with open(os.path.join(args.out, "attn_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
