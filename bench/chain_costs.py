"""What each launch of a chained draft step costs: the shipped EAGLE-3 head (its own bf16
weights from assets/, a random SmolLM2-shaped embedding table and draft KV), one sequence,
`--steps` chained steps (`fused.chain_steps`, as the fused graph runs them) captured in
one CUDA graph, at a few context lengths. Then the same chain with one launch taken out at a
time (its output left as it was): what folding that launch into a neighbour could save at
most. Timing only: the tokens are random and the skipped launches' outputs stale.

    python -m bench.chain_costs --out DIR [--contexts 160,320,640] [--steps 7]

Writes DIR/chain_costs.json with the command, GPU, versions and date."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import types
from unittest import mock

import torch

HEAD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                    "eagle3-smollm2-135m-instruct")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--contexts", default="160,320,640")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--head", default=HEAD)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    from bench.common import command_line, log, save_json
    from engine import ops
    from engine.attention import get_backend
    from engine.attention.triton_backend import draft_attention
    from engine.graphs import graph_time_us
    from engine.spec.eagle3 import load_head
    from engine.spec.fused import chain_steps
    from tests.engine.test_gpu_engine import smol_shape  # as gpu_smoke, linear_sweep

    dev, dt, bs = "cuda", torch.bfloat16, args.block_size
    target = smol_shape()
    head = load_head(args.head, target,
                     lambda c: get_backend("triton")(c.num_heads, c.num_kv_heads, c.head_dim, bs,
                                                     **draft_attention(torch.device(dev))),
                     dtype=dt, device=dev)
    backend = head.midlayer.self_attn.backend
    g = torch.Generator(device=dev).manual_seed(0)
    table = torch.randn(target.vocab_size, 576, device=dev, dtype=dt, generator=g) * 0.02
    width = target.max_position // bs  # a graph bucket's block table spans the model's length
    kv = torch.randn(2, width + 1, bs, 3, 64, device=dev, dtype=dt, generator=g)
    tables = torch.arange(1, width + 1, device=dev, dtype=torch.int32)[None, :]
    tok0 = torch.randint(0, target.vocab_size, (1,), device=dev, generator=g)
    hid0 = torch.randn(1, 576, device=dev, dtype=dt, generator=g)
    # stand-ins for a skipped launch's output
    x_dual = torch.randn(1, 1152, device=dev, dtype=dt, generator=g)
    attn_out = torch.randn(1, 9, 64, device=dev, dtype=dt, generator=g)

    variants = {
        "full": [],
        # the argmax in a launch of its own, not folded into the LM head's GEMV
        "argmax_launch": [(ops, "FUSED_ARGMAX", False)],
        # the one-warp GEMV tiles of the draft's gate_up and LM head switched
        f"wide_gemv_{'off' if ops.WIDE_GEMV else 'on'}": [(ops, "WIDE_GEMV", not ops.WIDE_GEMV)],
        "no_dual_norm": [(ops, "dual_rmsnorm", lambda *a, **k: x_dual)],
        "no_rope_store": [(ops, "rope_store_", lambda *a, **k: None)],
        "no_attention": [(backend, "attend", lambda q, kc, meta: attn_out)],
        "one_pass_attention": [(backend, "split_keys", 1 << 20)],
        # the target's attention tiles: 128-key splits, tiles of 32 rows or more
        "target_attention": [(backend, "split_keys", None), (backend, "min_tile", 32)],
    }
    results = []
    table_owner = types.SimpleNamespace(embed_tokens=types.SimpleNamespace(weight=table))
    one = torch.ones(1, device=dev, dtype=torch.int64)
    qs = torch.tensor([0, 1], device=dev, dtype=torch.int64)
    with torch.inference_mode():
        for ctx in [int(c) for c in args.contexts.split(",")]:
            start = torch.full((1,), ctx, device=dev, dtype=torch.int64)

            def chain(_i, start=start):  # as the fused step runs its chained drafts
                return chain_steps(head, table_owner, kv, bs, tables, tok0, hid0,
                                   one * (args.steps + 1), start, one, qs,
                                   target.max_position, args.steps)

            row = {"context": ctx, "steps": args.steps}
            for name, patches in variants.items():
                with contextlib.ExitStack() as stack:
                    for obj, attr, val in patches:
                        stack.enter_context(mock.patch.object(obj, attr, val))
                    us = graph_time_us(chain, reps=4, iters=20) / args.steps
                row[name] = round(us, 2)
                log(f"[chain_costs] context {ctx} {name}: {us:.2f} us a chained step")
            row["saved_us"] = {k: round(row["full"] - v, 2) for k, v in row.items()
                               if k in variants and k != "full"}
            results.append(row)
    out = {"command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "head": os.path.abspath(args.head),
           "results": results}
    save_json(os.path.join(args.out, "chain_costs.json"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
