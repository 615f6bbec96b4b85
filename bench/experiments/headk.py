# headk: LM heads in dot_tiles (grouped, pipelined) vs the deterministic head tiles and cuBLAS,
# SmolLM2's (49152 x 576) and Llama-8B's (128256 x 4096), 1-384 rows; bits vs a 128-row ref.
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from engine import ops
from engine.ops import gemv
dev = "cuda"
SHAPES = {"smol_head": (49152, 576), "l8b_head": (128256, 4096)}
ROWS = (1, 6, 16, 32, 64, 128, 256, 384)
TILES = [(16, 32, 256, 5, 4), (16, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 3, 8),
         (128, 128, 64, 4, 8), (128, 128, 64, 5, 8)]
g = torch.Generator(device=dev).manual_seed(0)
rnd = lambda *s: (torch.randn(*s, generator=g, device=dev) / 16).to(torch.bfloat16)


def timed(fn, ws, reps=10):
    fn(ws[0]); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(w)
    graph.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record(); torch.cuda.synchronize()
    return round(a.elapsed_time(b) * 1e3 / (reps * len(ws)), 2)


res = {"gpu": torch.cuda.get_device_name(), "date": time.ctime(), "shapes": {}}
for name, (n, k) in SHAPES.items():
    ws = [rnd(n, k) for _ in range(max(2, -(-160 * 2**20 // (n * k * 2))))]
    x = rnd(max(ROWS), k)
    ref = gemv.dot_tiles(x, ws[0], None, (128, 128, 64, 4, 8))
    det_ref = ops.invariant_linear(x, ws[0], head=True)
    r = res["shapes"][name] = {}
    for m in ROWS:
        xm = x[:m].contiguous()
        c = r[str(m)] = {"cublas": timed(lambda w: torch.nn.functional.linear(xm, w), ws)}
        c["default_prologue"] = timed(lambda w: ops.prologue_linear(xm, w, None, dot=ops.LOGITS_DOT_TILES), ws)
        c["det_now"] = (timed(lambda w: ops.invariant_linear(xm, w, head=True), ws),
                        bool(torch.equal(ops.invariant_linear(xm, ws[0], head=True), det_ref[:m])))
        for t in TILES:
            if t[0] > 16 and t[0] >= 2 * max(m, 16):
                continue
            y = gemv.dot_tiles(xm, ws[0], None, t)
            c[str(t)] = (timed(lambda w: gemv.dot_tiles(xm, w, None, t), ws), bool(torch.equal(y, ref[:m])))
        best = min((v[0], kk) for kk, v in c.items() if isinstance(v, tuple))
        print(name, m, "cublas", c["cublas"], "det_now", c["det_now"], "best", best,
              "all eq", all(v[1] for kk, v in c.items() if isinstance(v, tuple) and kk != "det_now"), flush=True)
        json.dump(res, open(sys.argv[1], "w"), indent=1)
    del ws, x, ref
    torch.cuda.empty_cache()
