# 47 (usage: python3 bench/experiments/apart.py OUT.json, CUDA): PREFILL_NORM_APART's speed: qkv / gate_up (norm + residual) at 256-2048 rows, the norm in
# the prologue (default) vs apart vs cuBLAS (torch.mm on a precomputed norm), in CUDA graphs,
# us a launch over 30 distinct weights; plus the bits of apart vs default (all rows).
import json, sys, torch
from engine import ops
from engine.ops import invariant
out = sys.argv[1]
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
SHAPES = {"qkv": (960, 576, False), "gate_up": (3072, 576, True),
          "llama8b_qkv": (6144, 4096, False), "llama8b_gate_up": (28672, 4096, True)}
res = {"gpu": torch.cuda.get_device_name(), "shapes": {}}


def timeit(fn, reps=10, per=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record(); torch.cuda.synchronize()
    return round(s.elapsed_time(e) * 1e3 / reps / per, 2)


for name, (n, k, glu) in SHAPES.items():
    nl = 30 if k < 1000 else 4
    ws = [(torch.randn(n, k, device=dev) * k ** -0.5).to(bf) for _ in range(nl)]
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(bf)
    res["shapes"][name] = {}
    for m in (256, 512, 2048):
        x, r = torch.randn(m, k, device=dev).to(bf), torch.randn(m, k, device=dev).to(bf)
        half = n // 2 if glu else n

        def det():
            for w in ws:
                ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu)

        def mm():
            for w in ws:
                torch.mm(x, w.t())
        row = {}
        for apart in (False, True):
            invariant.PREFILL_NORM_APART = apart
            row["apart" if apart else "prologue"] = timeit(det, per=nl)
            outs = ops.invariant_linear(x, ws[0], norm_weight=nw, eps=1e-5, residual=r, glu=glu)
            row["bits_" + ("apart" if apart else "prologue")] = outs
        want = row.pop("bits_prologue")
        row["equal"] = all(torch.equal(a, b) for a, b in zip(row.pop("bits_apart"), want))
        if glu:  # the norm apart, then [gate | up] as one plain projection and silu_mul
            from engine.ops.prologue import prologue_linear, prologue_norm
            one = invariant.invariant_tiles(half, k, 1, True, True)
            pt = invariant.invariant_tiles(n, k, m)

            def plain_glu(w):
                a, res_ = prologue_norm(x, nw, 1e-5, r, one)
                return ops.silu_mul(prologue_linear(a, w, tiles=pt)), res_

            def det2():
                for w in ws:
                    plain_glu(w)
            row["apart_plain_glu"] = timeit(det2, per=nl)
            row["plain_glu_tiles"] = pt
            got = plain_glu(ws[0])
            row["plain_glu_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
        row["cublas"] = timeit(mm, per=nl)
        invariant.PREFILL_NORM_APART = False
        res["shapes"][name][m] = row
        print(name, m, row, flush=True)
json.dump(res, open(out, "w"), indent=1)
