"""One engine, decode streams running while long prompts arrive (figure 5's colocated case),
under several engine settings, each in its own process: a CUDA fault kills only its variant.

    python3 -m bench.long_prompt_check --out $OUT            # GPU, random 8B-shaped weights
    python3 -m bench.long_prompt_check --tiny --out /tmp/lp  # the mechanics on a CPU

Per variant: whether every request finished, the engine's steps by path, and the error (the
last lines of the child's output) if any. Variants: the default; programmatic dependent launch
off (TANDEM_PDL=0); decodes not split from admissions (`Engine._splits` off); a KV cache under
2^31 elements; and the default with CUDA_LAUNCH_BLOCKING=1 (a fault names its kernel).
Writes <out>/long_prompt_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": ({}, []),
    "pdl_off": ({"TANDEM_PDL": "0"}, []),
    "no_split": ({}, ["--no-split"]),
    "small_cache": ({}, ["--blocks", "1200"]),
    "launch_blocking": ({"CUDA_LAUNCH_BLOCKING": "1"}, []),
}


def child(args: argparse.Namespace) -> dict:
    import torch

    from bench.common import llama8b_shape, random_engine, step_paths
    from engine import Engine, SamplingParams
    from engine.config import tiny_config

    if args.no_split:
        Engine._splits = lambda self: False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ns = argparse.Namespace(dtype="bfloat16" if dev == "cuda" else "float32", device=dev)
    max_pos = args.long_tokens + 512
    cfg = tiny_config(max_position=max_pos, vocab_size=256) if args.tiny else \
        llama8b_shape(max_pos)
    eng = random_engine(ns, cfg, args.blocks)
    if args.precapture and dev == "cuda":  # as figure 5 and the nodes do: every bucket,
        eng.capture_graphs(list(range(1, args.streams + args.long + 1)))  # split-KV too
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    bg = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
    longp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(args.streams):
        eng.add_request(torch.randint(0, vocab, (128,), generator=gen).tolist(), bg,
                        request_id=f"bg{i}")
    first = args.first_arrival
    arrivals = {first + 15 * i: f"long{i}" for i in range(args.long)}
    done, steps, t0 = set(), 0, time.perf_counter()
    while eng.has_unfinished() and steps < 4 * args.steps:
        if steps in arrivals:
            eng.add_request(torch.randint(0, vocab, (args.long_tokens,), generator=gen).tolist(),
                            longp, request_id=arrivals[steps])
        for out in eng.step():
            if out.finished:
                done.add(out.request_id)
        steps += 1
    if dev == "cuda":
        torch.cuda.synchronize()
    return {"finished": len(done), "requests": args.streams + args.long, "steps": steps,
            "seconds": round(time.perf_counter() - t0, 2), "num_blocks": args.blocks,
            "paths": step_paths(eng)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/profile")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long", type=int, default=2, help="long prompts arriving")
    p.add_argument("--long-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=120, help="tokens per decode stream")
    p.add_argument("--blocks", type=int, default=5762)
    p.add_argument("--first-arrival", type=int, default=20, help="step of the first long one")
    p.add_argument("--precapture", action="store_true",
                   help="capture every graph first (long-context variants too), as nodes do")
    p.add_argument("--no-split", action="store_true")
    p.add_argument("--only", default="", help="comma-separated variants")
    p.add_argument("--child", action="store_true")
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    base = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    rows = {}
    for name, (env, extra) in VARIANTS.items():
        if args.only and name not in args.only.split(","):
            continue
        cmd = [sys.executable, "-m", "bench.long_prompt_check", *base, *extra, "--child"]
        t0 = time.time()
        try:
            r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                               timeout=args.timeout)
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or b"").decode() + (e.stderr or b"").decode(), "timeout"
        res = next((json.loads(line[7:]) for line in out.splitlines()
                    if line.startswith("RESULT ")), None)
        tail = [x for x in out.splitlines() if x.strip() and not x.startswith("frame #")]
        rows[name] = {"env": env, "args": extra, "rc": rc, "ok": rc == 0 and res is not None
                      and res["finished"] == res["requests"], "result": res,
                      "seconds": round(time.time() - t0, 1),
                      "tail": None if rc == 0 else tail[-30:]}
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "tail"}),
              flush=True)
        if rc != 0:
            print("\n".join(tail[-12:]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "long_prompt_check.json")
    with open(path, "w") as f:
        json.dump({"command": " ".join(["python3 -m bench.long_prompt_check", *base]),
                   "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "variants": rows}, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
