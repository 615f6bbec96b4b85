# 47 (usage: PYTHONPATH=$PWD python3 bench/experiments/host_time.py OUT.json, CUDA)
# busy by a sleep so launches only queue; and what a direct compiled launch would cost.
import json, sys, time, torch
import torch.nn.functional as F
import triton
from engine import ops
from engine.ops import invariant, prologue
from engine.ops.elementwise import add_rmsnorm
out = sys.argv[1]
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)
res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "us_host": {}}


def host(fn, n=100):
    fn(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every launch below only queues
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        best = min(best, t)
    return round(best, 2)


for name, (n, k, glu) in {"qkv": (960, 576, False), "gate_up": (3072, 576, True)}.items():
    for m in (1024,):
        x, r = torch.randn(m, k, device=dev).to(bf), torch.randn(m, k, device=dev).to(bf)
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(bf)
        nw = torch.ones(k, device=dev, dtype=bf)
        d = res["us_host"][f"{name}_{m}"] = {}
        d["empty"] = host(lambda: torch.empty(m, n, dtype=bf, device=dev))
        d["cublas_linear"] = host(lambda: F.linear(x, w))
        d["add_rmsnorm"] = host(lambda: add_rmsnorm(x, nw, 1e-5, r))
        d["default_pair"] = host(lambda: F.linear(add_rmsnorm(x, nw, 1e-5, r)[0], w))
        for mode in (False, True):
            invariant.PREFILL_NORM_APART = mode
            d[f"invariant_linear_apart{int(mode)}"] = host(
                lambda: ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu))
        invariant.PREFILL_NORM_APART = False
        t = invariant.invariant_tiles(n // 2 if glu else n, k, m, glu, True, False, True, 2)
        d["tiles_call"] = host(lambda: invariant.invariant_tiles(n // 2 if glu else n, k, m, glu, True, False, True, 2), 1000)
        d["prologue_linear_given_tiles"] = host(lambda: prologue.prologue_linear(
            x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu, tiles=t, norm_k=invariant.norm_chunk()))
        one = invariant.invariant_tiles(n // 2 if glu else n, k, 1, glu, True, False, True, 2)
        d["prologue_norm"] = host(lambda: prologue.prologue_norm(x, nw, 1e-5, r, one, invariant.norm_chunk()))
        # the JIT launch vs a direct run of the compiled kernel (what FastLaunch does)
        fn = prologue._prologue_norm_kernel
        y, ro = torch.empty_like(x), torch.empty_like(x)
        bm, _, bk, warps = one
        nk = invariant.norm_chunk() or bk
        args = (x, r, nw, y, ro, m, 1e-5, x.stride(0), r.stride(0))
        kw = dict(K=k, HAS_RES=True, BLOCK_M=bm, BLOCK_K=bk, ONE_LOAD=False, NORM_K=nk,
                  num_warps=warps, **prologue.pdl_args(x, always=True))
        grid = (triton.cdiv(m, bm),)
        d["jit_launch_norm"] = host(lambda: fn[grid](*args, **kw))
        kern = fn[grid](*args, **kw)
        device = torch.cuda.current_device()
        binder = fn.device_caches[device][4]
        d["binder"] = host(lambda: binder(*args, **kw), 1000)
        bound = tuple(binder(*args, **kw)[0].values())
        from triton.runtime import driver
        def direct():
            s = driver.active.get_current_stream(device)
            kern.run(grid[0], 1, 1, s, kern.function, kern.packed_metadata, None, None, None, *bound)
        d["direct_launch_norm"] = host(direct)
        y2 = torch.empty_like(x); ro2 = torch.empty_like(x)
        torch.cuda.synchronize()
        fn[grid](*args, **kw); torch.cuda.synchronize(); a = y.clone()
        y.zero_(); direct(); torch.cuda.synchronize()
        d["direct_equal"] = bool(torch.equal(a, y))
        print(name, m, d, flush=True)
json.dump(res, open(out, "w"), indent=1)
