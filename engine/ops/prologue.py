"""Prologue linears: one Triton launch for a small model's projection together with the
activation before it (rmsnorm of x + residual, or SiLU-and-mul), so a decoder layer of few
rows is six launches, each free to start while the one before it finishes (PDL)."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import (
    BoundLaunch,
    cdiv,
    next_pow2,
    pdl_args,
    triton,
    triton_available,
)
from engine.ops import splitk

# Row counts the prologue linears serve before calibration: single-stream decode, where a
# layer is a chain of latency-bound launches.
LINEAR_MAX_ROWS = 1
# Row counts up to which `LlamaModel.calibrate_prologue_rows` times the prologue linears
# against the separate kernels on the GPU at hand (at graph set-up) and keeps the faster.
CALIBRATE_MAX_ROWS = 8
# Weights of at most this many elements take them: small models' projections, whose reads
# are latency-bound; larger ones read faster through cuBLAS or `engine.ops.gemv`.
LINEAR_MAX_WEIGHT = 4 << 20
# The same bound for a draft head's LM head (its GEMV folds the argmax in): 7281 draft ids of
# SmolLM2's 576-wide head. Its own, so a larger draft vocabulary can be measured on that path.
LM_HEAD_MAX_WEIGHT = LINEAR_MAX_WEIGHT
# Up to this many rows a projection runs one GEMV program per row and column block.
GEMV_ROWS = 8
GEMV_WARPS = 4  # warps of a GEMV program of a projection that is not wider than long
# 16-row tensor-core tiles (BLOCK_N, BLOCK_K, warps) of the LM head: its weight is too large
# to stay in L2 between one row's GEMV and the next, so it is read once for all rows.
LOGITS_DOT_TILES = (64, 128, 4)
DOT_MAX_ROWS = 16  # rows a launch with `dot` tiles computes in its one 16-row block


def tile_width(v: int) -> bool:
    """Whether v is a power of two >= 16: a tile's BLOCK_N / BLOCK_K or a norm chunk."""
    return v >= 16 and not v & (v - 1)


if triton_available():
    import triton.language as tl

    from engine.ops.argmax import argmax_key
    from engine.ops.splitk import fold_splits

    @triton.jit
    def _prologue_sum(X, R, RES_OUT, rm, m_ok, rk, stride_x, stride_r, pid_n,
                      K: tl.constexpr, HAS_RES: tl.constexpr):
        """x (+ r, rounded as `add_rmsnorm` rounds it) over the K columns rk; the sum also goes
        to RES_OUT (by the program whose pid_n is 0: the first column block's first split)."""
        ok = m_ok[:, None] & (rk < K)[None, :]
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(R + rm[:, None] * stride_r + rk[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            if pid_n == 0:
                tl.store(RES_OUT + rm[:, None] * K + rk[None, :], x, mask=ok)
        return x

    @triton.jit
    def _row_sumsq(x):
        """Per row, the fp32 sum of squares of a tile."""
        xf = x.to(tl.float32)
        return tl.sum(xf * xf, 1)

    @triton.jit
    def _chunked_rstd(X, R, RES_OUT, rm, m_ok, stride_x, stride_r, pid, eps, K: tl.constexpr,
                      NORM_K: tl.constexpr, BLOCK_M: tl.constexpr, HAS_RES: tl.constexpr):
        """rsqrt(mean square + eps) of the rows rm of x (+ r), the squares summed over K in
        NORM_K-key chunks in order (x + r also to RES_OUT where pid is 0): a norm prologue's
        first pass where K is not one load, in `_prologue_linear_kernel` and
        `_prologue_norm_kernel` alike."""
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        rc = tl.arange(0, NORM_K)
        for k0 in range(0, K, NORM_K):
            ss += _row_sumsq(_prologue_sum(X, R, RES_OUT, rm, m_ok, k0 + rc, stride_x, stride_r,
                                           pid, K, HAS_RES))
        return tl.math.rsqrt(ss / K + eps)

    @triton.jit
    def _prologue_norm(a, NW, rk, rstd, K: tl.constexpr):
        """rmsnorm of the rows a (x + r already summed) over the K columns rk, times NW,
        rounded as `add_rmsnorm` rounds it."""
        dt = a.dtype
        h = (a.to(tl.float32) * rstd[:, None]).to(dt)
        nw = tl.load(NW + rk, mask=rk < K, other=0.0)
        return (nw.to(tl.float32)[None, :] * h.to(tl.float32)).to(dt)

    @triton.jit
    def _mac(acc, a, w, BLOCK_M: tl.constexpr, PREC: tl.constexpr):
        """acc + a @ w.T: a GEMV's products summed along K (BLOCK_M 1), else tl.dot."""
        if BLOCK_M == 1:
            return acc + tl.sum(a.to(tl.float32) * w.to(tl.float32), 1)[None, :]
        return tl.dot(a, tl.trans(w), acc, input_precision=PREC)

    @triton.jit
    def _prologue_act(X, R, NW, rm, m_ok, rk, stride_x, stride_r, rstd, K: tl.constexpr,
                      PRO: tl.constexpr, HAS_RES: tl.constexpr):
        """`_prologue_linear_kernel`'s activation a() of rows rm over the K columns rk."""
        dt = X.dtype.element_ty
        k_ok = rk < K
        ok = m_ok[:, None] & k_ok[None, :]
        if PRO == 2:
            g = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=ok, other=0.0)
            u = tl.load(X + rm[:, None] * stride_x + K + rk[None, :], mask=ok, other=0.0)
            gf = g.to(tl.float32)
            sg = (gf / (1.0 + tl.exp(-gf))).to(dt)
            a = (sg.to(tl.float32) * u.to(tl.float32)).to(dt)
        else:
            a = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=ok, other=0.0)
            if PRO == 1:
                if HAS_RES:
                    r = tl.load(R + rm[:, None] * stride_r + rk[None, :], mask=ok, other=0.0)
                    a = (a.to(tl.float32) + r.to(tl.float32)).to(dt)
                a = _prologue_norm(a, NW, rk, rstd, K)
        return a

    @triton.jit(do_not_specialize=["M"])  # the row count varies by the step
    def _prologue_linear_kernel(X, R, NW, W, B, Y, RES_OUT, KEYS, WS, CNT, M, eps, stride_x,
                                stride_r, stride_w, stride_y, N: tl.constexpr, K: tl.constexpr,
                                PRO: tl.constexpr, HAS_RES: tl.constexpr,
                                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                PREC: tl.constexpr, ONE_LOAD: tl.constexpr,
                                ARGMAX: tl.constexpr, USE_PDL: tl.constexpr,
                                GLU: tl.constexpr = False, SPLITS: tl.constexpr = 1,
                                SPLIT_K: tl.constexpr = 0, NORM_K: tl.constexpr = 0):
        """Y[M, N] = a(X) @ W[N, K].T (+ B), a() computed per K tile and rounded where the separate
        kernels round:
        PRO 0: a(x) = x;
        PRO 1: a(x) = rmsnorm(x + r) * NW (x + r also goes to RES_OUT), `add_rmsnorm`'s rounding;
        PRO 2: a([g | u]) = silu(g) * u for X = [M, 2K], `silu_mul`'s rounding.
        Programs sharing a weight tile run side by side so it comes from HBM once. ONE_LOAD (PRO 1
        with K in one tile): x (+ r) is read once. ARGMAX: Y is not written; each program
        atomically maxes its columns' largest output into KEYS[row] (pre-filled with KEY_EMPTY).
        GLU: W is [2N, K] = [gate | up] and Y = silu(a(X) @ gate.T) * (a(X) @ up.T), each
        product rounded to Y's dtype first and combined as `silu_mul` combines them (no bias).
        SPLITS > 1: program_id(2) takes the K columns [s * SPLIT_K, (s + 1) * SPLIT_K) and the
        splits' partial tiles are summed in split order (`splitk.fold_splits`, workspace WS,
        counters CNT) before the epilogue. NORM_K (PRO 1, not ONE_LOAD): the row sums go over K
        in chunks of NORM_K keys (BLOCK_K, unless `prologue_linear`'s norm_k fixes it)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = 0
        k_lo = 0
        k_hi = K
        if SPLITS > 1:
            pid_s = tl.program_id(2)
            k_lo = pid_s * SPLIT_K
            k_hi = tl.minimum(k_lo + SPLIT_K, K)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk0 = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        rw = k_lo + rk0  # the program's first weight tile
        w = tl.load(W + rn[:, None] * stride_w + rw[None, :],
                    mask=n_ok[:, None] & (rw < k_hi)[None, :], other=0.0)
        w2 = w
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GLU:  # the up rows matching this program's gate rows
            w2 = tl.load(W + (rn + N)[:, None] * stride_w + rw[None, :],
                         mask=n_ok[:, None] & (rw < k_hi)[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ONE_LOAD:  # one tile: x (+ r) loaded once, kept for the products
            xs = _prologue_sum(X, R, RES_OUT, rm, m_ok, rk0, stride_x, stride_r, pid_n, K,
                               HAS_RES)
            rstd = tl.math.rsqrt(_row_sumsq(xs) / K + eps)
        elif PRO == 1:  # the row's mean square first: one pass over x (+ r)
            rstd = _chunked_rstd(X, R, RES_OUT, rm, m_ok, stride_x, stride_r, pid_n + pid_s,
                                 eps, K, NORM_K, BLOCK_M, HAS_RES)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ONE_LOAD:
            a = _prologue_norm(xs, NW, rk0, rstd, K)
            acc = _mac(acc, a, w, BLOCK_M, PREC)
            if GLU:
                acc2 = _mac(acc2, a, w2, BLOCK_M, PREC)
        else:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                rk = k0 + rk0
                a = _prologue_act(X, R, NW, rm, m_ok, rk, stride_x, stride_r, rstd, K, PRO,
                                  HAS_RES)
                cur = w
                nk = rk + BLOCK_K  # the next tile's weights (masked off past the range: no traffic)
                w = tl.load(W + rn[:, None] * stride_w + nk[None, :],
                            mask=n_ok[:, None] & (nk < k_hi)[None, :], other=0.0)
                acc = _mac(acc, a, cur, BLOCK_M, PREC)
                if GLU:
                    cur2 = w2
                    w2 = tl.load(W + (rn + N)[:, None] * stride_w + nk[None, :],
                                 mask=n_ok[:, None] & (nk < k_hi)[None, :], other=0.0)
                    acc2 = _mac(acc2, a, cur2, BLOCK_M, PREC)
        if SPLITS > 1:  # the program that finishes the tile last sums it and writes it
            acc, acc2, mine = fold_splits(WS, CNT, acc, acc2, pid_m * tl.num_programs(1) + pid_n,
                                          pid_s, SPLITS, GLU, BLOCK_M, BLOCK_N)
            m_ok = m_ok & mine
        _epilogue(acc, acc2, B, Y, KEYS, rm, rn, m_ok, n_ok, pid_n, stride_y, HAS_BIAS,
                  BLOCK_N, ARGMAX, GLU)

    @triton.jit(do_not_specialize=["M"])
    def _prologue_norm_kernel(X, R, NW, Y, RES_OUT, M, eps, stride_x, stride_r,
                              K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr, ONE_LOAD: tl.constexpr,
                              NORM_K: tl.constexpr, USE_PDL: tl.constexpr):
        """Y[M, K] = rmsnorm(X + R) * NW (X + R also to RES_OUT), each row as
        `_prologue_linear_kernel`'s PRO 1 prologue computes it at the same BLOCK_M, BLOCK_K,
        NORM_K, ONE_LOAD and warps: the same tiles of x loaded, summed and rounded alike."""
        pid_m = tl.program_id(0)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk0 = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if ONE_LOAD:
            xs = _prologue_sum(X, R, RES_OUT, rm, m_ok, rk0, stride_x, stride_r, 0, K, HAS_RES)
            rstd = tl.math.rsqrt(_row_sumsq(xs) / K + eps)
            a = _prologue_norm(xs, NW, rk0, rstd, K)
            tl.store(Y + rm[:, None] * K + rk0[None, :], a,
                     mask=m_ok[:, None] & (rk0 < K)[None, :])
        else:
            rstd = _chunked_rstd(X, R, RES_OUT, rm, m_ok, stride_x, stride_r, 0, eps, K, NORM_K,
                                 BLOCK_M, HAS_RES)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + rk0
                a = _prologue_act(X, R, NW, rm, m_ok, rk, stride_x, stride_r, rstd, K, 1,
                                  HAS_RES)
                tl.store(Y + rm[:, None] * K + rk[None, :], a,
                         mask=m_ok[:, None] & (rk < K)[None, :])

    @triton.jit
    def _epilogue(acc, acc2, B, Y, KEYS, rm, rn, m_ok, n_ok, pid_n, stride_y,
                  HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ARGMAX: tl.constexpr,
                  GLU: tl.constexpr):
        """GLU's silu(gate) * up, the bias, then the rows' outputs stored (or their argmax)."""
        if GLU:  # silu(gate) * up, rounded where `silu_mul` rounds
            dt = Y.dtype.element_ty
            gf = acc.to(dt).to(tl.float32)
            sg = (gf / (1.0 + tl.exp(-gf))).to(dt)
            acc = sg.to(tl.float32) * acc2.to(dt).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ARGMAX:
            v = tl.where(n_ok[None, :], acc.to(Y.dtype.element_ty).to(tl.float32),
                         float("-inf"))
            v = tl.where(v != v, float("inf"), v)
            best = tl.max(v, 1)
            col = pid_n * BLOCK_N + tl.argmax(v, 1, tie_break_left=True)
            tl.atomic_max(KEYS + rm, argmax_key(best, col), mask=m_ok)
        else:
            tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])

    # Launched from Python every eager forward (prefill chunks past the graphs' sizes):
    # past Triton's binding, straight to the compiled variant.
    _LINEAR, _NORM = BoundLaunch(_prologue_linear_kernel), BoundLaunch(_prologue_norm_kernel)


def prologue_suits(weights, bound: int | None = None) -> bool:
    """Whether projections of these weight shapes ([N, K] each) take the prologue linears:
    each of at most `bound` elements (None: LINEAR_MAX_WEIGHT)."""
    bound = LINEAR_MAX_WEIGHT if bound is None else bound
    return all(n * k <= bound for n, k in weights)


def linear_tiles(m: int, n: int, k: int, dot: tuple[int, int, int] | None = None
                 ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [k, n] prologue linear: one 16-row
    tl.dot block up to DOT_MAX_ROWS rows when dot is given, else one GEMV program per row up to
    GEMV_ROWS rows, else one tl.dot block per 16 rows.

    Up to GEMV_ROWS rows the tiles do not depend on the row count, so a verify step's rows round
    exactly as the one-row decode step (greedy speculation stays token-identical). Wide
    projections take narrow programs so more of them share a multiprocessor."""
    if dot is not None and m <= DOT_MAX_ROWS:
        bn, bk, warps = dot
        return 16, bn, min(bk, next_pow2(k, 16)), warps
    if m <= GEMV_ROWS:
        bk = min(1024, next_pow2(k, 16))
        if n >= 4 * k:
            return 1, 8, bk, 1
        if 2 * n >= 3 * k:
            return 1, 4, bk, 1
        return 1, gemv_block_n(n, k), bk, GEMV_WARPS
    return 16, 32, min(128, next_pow2(k, 16)), 4


def gemv_block_n(n: int, k: int) -> int:
    """Columns of a GEMV program: 16, or 8 for a projection at least twice as long as it is
    wide, which has few column blocks for its long rows (twice the programs run faster)."""
    return 8 if k >= 2 * n else 16


def prologue_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual: torch.Tensor | None = None, silu: bool = False,
                    dot: tuple[int, int, int] | None = None,
                    tiles: tuple[int, int, int, int] | None = None,
                    keys: torch.Tensor | None = None, glu: bool = False, splits: int = 1,
                    norm_k: int = 0):
    """One launch for `linear(rmsnorm(x + residual))` (norm_weight given; returns (y, x +
    residual), or y without a residual), `linear(silu_mul(x))` (silu), or plain `linear(x)`.
    weight is nn.Linear's [N, K]; activations round as `add_rmsnorm` / `silu_mul` do. dot:
    16-row tensor-core tiles (BLOCK_N, BLOCK_K, warps) up to DOT_MAX_ROWS rows. tiles: (BLOCK_M,
    BLOCK_N, BLOCK_K, warps) at every row count instead of `linear_tiles`'. keys ([M] int64
    place. glu: weight is [gate | up] ([2N, K]) and y = silu_mul(x' @ weight.T), [M, N] (no
    bias, no keys). splits: K cut into up to this many ranges of whole K tiles, summed in
    range order (`splitk`); the ranges follow from K and the tiles, not from M. norm_k (a
    power of two >= 16, with norm_weight): the norm's row sums in chunks of that many keys,
    whatever the tiles (0: in the tiles' BLOCK_K)."""
    m = x.shape[0]
    assert keys is None or (keys.shape == (m,) and keys.dtype == torch.int64)
    n, k = weight.shape
    if glu:
        assert bias is None and keys is None and not silu and n % 2 == 0
        n //= 2
    pro = 1 if norm_weight is not None else 2 if silu else 0
    if norm_k and (pro != 1 or not tile_width(norm_k)):
        raise ValueError(f"norm_k {norm_k} needs a norm_weight and a power of two >= 16")
    assert x.shape[1] == (2 * k if silu else k) and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty(m if keys is None else 1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if m:
        bm, bn, bk, warps = tiles or linear_tiles(m, n, k, dot)
        assert bm == 1 or bm >= 16, "row blocks are GEMVs (1) or tl.dot tiles (16+)"
        r = residual if residual is not None else x
        grid = (cdiv(m, bm), cdiv(n, bn))
        s, split_k = splitk.split_plan(k, bk, splits)
        ws, cnt = splitk.workspace(x, grid[0] * grid[1], s, glu, bm, bn) if s > 1 else (y, y)
        _LINEAR[grid + (s,)](
            x, r, norm_weight if norm_weight is not None else weight,
            weight, bias if bias is not None else weight, y,
            res_out if res_out is not None else y, keys if keys is not None else y, ws, cnt, m,
            eps, x.stride(0), r.stride(0), weight.stride(0), y.stride(0), N=n, K=k, PRO=pro,
            HAS_RES=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, PREC="ieee" if x.dtype == torch.float32 else "tf32",
            ONE_LOAD=pro == 1 and k <= bk and not norm_k, ARGMAX=keys is not None, GLU=glu,
            SPLITS=s, SPLIT_K=split_k if s > 1 else 0,
            NORM_K=(norm_k or bk) if pro == 1 else 0, num_warps=warps,
            **pdl_args(x, always=True))
    if keys is not None:
        y = keys
    return y if residual is None else (y, res_out)


def prologue_norm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, tiles: tuple[int, int, int, int],
                  norm_k: int = 0):
    """`rmsnorm(x + residual) * norm_weight` as a launch of its own, each row's bits those of
    `prologue_linear`'s norm prologue at `tiles` (BLOCK_M, BLOCK_N unused, BLOCK_K, warps)
    and norm_k: a wide launch's projection can then take tiles whose layout along K would
    sum the norm in another order. Returns (y, x + residual), or y without a residual."""
    m, k = x.shape
    assert x.stride(1) == 1 and (not norm_k or tile_width(norm_k))
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None \
        else None
    if m:
        bm, _, bk, warps = tiles
        r = residual if residual is not None else x
        _NORM[(cdiv(m, bm),)](
            x, r, norm_weight, y, res_out if res_out is not None else y, m, eps, x.stride(0),
            r.stride(0), K=k, HAS_RES=residual is not None, BLOCK_M=bm, BLOCK_K=bk,
            ONE_LOAD=k <= bk and not norm_k, NORM_K=norm_k or bk, num_warps=warps,
            **pdl_args(x, always=True))
    return y if residual is None else (y, res_out)
