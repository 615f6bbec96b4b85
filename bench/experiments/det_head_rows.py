"""47: from how many rows should the deterministic LM head (SmolLM2's 49152 x 576, bf16) leave
its 16-row tiles (LOGITS_DOT_TILES) for larger ones (HEAD_ROWS, HEAD_TILES)? Per row count and candidate
tile: outputs equal to the 16-row tiles' (every row) and us a launch (CUDA graph of 10 launches,
median of 20 replays). Writes JSON to argv[1]."""

import json
import subprocess
import sys
import time

import torch

from engine import ops
from engine.ops.prologue import LOGITS_DOT_TILES

dev, dt = "cuda", torch.bfloat16
ROWS = (1, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
BASE = (16, *LOGITS_DOT_TILES)
CANDIDATES = [(32, 64, 128, 4), (32, 128, 64, 8), (64, 64, 64, 4), (64, 128, 64, 4),
              (64, 64, 128, 4), (128, 64, 64, 8), (64, 128, 64, 8)]
g = torch.Generator(device=dev).manual_seed(0)
w = (torch.randn(49152, 576, generator=g, device=dev) / 8).to(dt)


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / reps)
    return round(sorted(ts)[len(ts) // 2], 2)


res = {"command": " ".join(["python3"] + sys.argv), "date": time.ctime(),
       "gpu": torch.cuda.get_device_name(),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip(),
       "base": BASE, "rows": {}}
for m in ROWS:
    x = (torch.randn(m, 576, generator=g, device=dev) / 8).to(dt)
    ref = ops.prologue_linear(x, w, tiles=BASE)
    cell = {"base_us": timed(lambda x=x: ops.prologue_linear(x, w, tiles=BASE)),
            "cublas_us": timed(lambda x=x: torch.nn.functional.linear(x, w))}
    for t in CANDIDATES:
        try:
            out = ops.prologue_linear(x, w, tiles=t)
            cell[str(t)] = {"bits_equal": bool(torch.equal(out, ref)),
                            "us": timed(lambda x=x, t=t: ops.prologue_linear(x, w, tiles=t))}
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is recorded
            cell[str(t)] = {"error": str(e)[:200]}
    res["rows"][m] = cell
    print(m, json.dumps(cell), flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
