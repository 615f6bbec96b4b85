"""47 experiment: a CUDA-core projection over fixed blocks of R rows (no tensor cores). The
reduction order of a row depends only on constexprs (R, BN, BK, warps), never on the launch's
row count: row-invariant by construction. Question: is it near the default GEMV at 1 row and
near the deterministic tiles at 8-64 rows? usage: python3 .gj/rowblock.py OUT [--check]"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl


@triton.jit
def _rowblock(x_ptr, w_ptr, y_ptr, M, N, K, sx, sw, sy, R: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, LATE: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm * R + tl.arange(0, R)
    cols = pn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    rm, cm = rows < M, cols < N
    if LATE:  # products summed per k-lane over the chunks, one tree at the end
        acc3 = tl.zeros((R, BN, BK), tl.float32)
    else:
        acc = tl.zeros((R, BN), tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * sx + (k0 + ks)[None, :], mask=rm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None] * sw + (k0 + ks)[None, :], mask=cm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        p = x[:, None, :] * w[None, :, :]
        if LATE:
            acc3 += p
        else:
            acc += tl.sum(p, axis=2)
    if LATE:
        acc = tl.sum(acc3, axis=2)
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])


def rowblock(x, w, R=8, BN=16, BK=64, warps=4, late=False):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _rowblock[(triton.cdiv(M, R), triton.cdiv(N, BN))](x, w, y, M, N, K, x.stride(0), w.stride(0),
                                                        y.stride(0), R=R, BN=BN, BK=BK, LATE=late,
                                                        num_warps=warps)
    return y


def check(dev, dt, configs, shapes, ms=(1, 3, 8, 17, 64)):
    """Each row alone equals the same row in a batch of 64, bit for bit; close to x @ w.T."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for (n, k) in shapes:
        w = torch.randn(n, k, device=dev, dtype=dt, generator=g) / k ** 0.5
        x = torch.randn(max(ms), k, device=dev, dtype=dt, generator=g)
        for c in configs:
            full = rowblock(x, w, *c)
            ok = all(torch.equal(rowblock(x[i:i + m], w, *c), full[i:i + m])
                     for m in ms for i in (0, max(ms) - m))
            err = (full.float() - (x.float() @ w.float().T)).abs().max().item()
            out[f"{n}x{k} {c}"] = {"alone_eq_batched": ok, "max_abs_err": err}
    return out


if __name__ == "__main__":
    out = sys.argv[1]
    if "--check" in sys.argv:  # CPU: TRITON_INTERPRET=1, small shapes
        print(json.dumps(check("cpu", torch.float32, [(8, 16, 32, 4, False), (4, 8, 32, 4, True)],
                               [(40, 96), (24, 70)], ms=(1, 3, 8, 13)), indent=1))
        sys.exit()
    from engine.ops.prologue import prologue_linear
    from engine.ops.invariant import invariant_tiles
    dev, dt = "cuda", torch.bfloat16
    LAYERS, MS = 30, (1, 8, 64, 512)
    SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    CONFIGS = [(8, 16, 64, 4, False), (8, 8, 128, 4, False), (8, 32, 32, 4, False),
               (4, 16, 64, 4, False), (16, 8, 64, 4, False), (8, 8, 64, 4, True),
               (8, 16, 64, 8, False), (4, 8, 128, 4, True)]
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "check": check(dev, dt, CONFIGS, list(SHAPES.values()))}
    print("check", all(v["alone_eq_batched"] for v in res["check"].values()), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)

    def timed(f):
        for i in range(2):
            f(i)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for i in range(LAYERS):
                f(i)
        gr.replay(); torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(20):
            gr.replay()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t0) / 20 / LAYERS * 1e6, 2)

    tot, per = {}, {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) / k ** 0.5 for _ in range(LAYERS)]
        X = torch.randn(512, k, device=dev, dtype=dt, generator=g)
        cands = {"default": lambda x, w: prologue_linear(x, w),
                 "det_mma": lambda x, w, t=invariant_tiles(n, k, 1): prologue_linear(x, w, tiles=t)}
        for c in CONFIGS:
            cands["rb_" + "_".join(map(str, c))] = lambda x, w, c=c: rowblock(x, w, *c)
        row = {}
        for cname, f in cands.items():
            try:
                row[cname] = {m: timed(lambda i: f(X[:m], ws[i])) for m in MS}
                for m in MS:
                    tot.setdefault(cname, {}).setdefault(m, 0)
                    tot[cname][m] = round(tot[cname][m] + row[cname][m], 2)
            except Exception as e:
                row[cname] = f"failed {type(e).__name__}: {str(e)[:150]}"
        per[name] = row
        print(name, json.dumps(row), flush=True)
    res["shapes"], res["layer_us"] = per, tot
    print("per layer us", json.dumps(tot), flush=True)
    json.dump(res, open(os.path.join(out, "rowblock.json"), "w"), indent=1)
