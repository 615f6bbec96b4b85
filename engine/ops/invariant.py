"""Row-invariant projections of the deterministic mode (`EngineConfig.deterministic`): at any
row count, each row of a projection is computed by the same code, with tiles chosen from the
weight's shape alone, in the same K order with fp32 accumulation, so its bits are the same
whether it is alone, in a verify step or in a prefill chunk. No split-K, no choice by row
count, no choice by timing (a restarted process must pick the same tiles).

Two kernel families, one per weight shape:
- a projection of the decoder layer: `_rows_linear_kernel`, the one-row GEMV of
  `prologue_linear` (its norm or SiLU-and-mul folded in) run for ROWS rows in turn by each
  program, the weight tile read once for them; at one row it is the default mode's kernel;
- the LM head (N at least VOCAB_RATIO times K): `prologue_linear`'s 16-row tensor-core tiles
  at every row count; rows past the count are masked to zeros and an MMA computes each output
  row from its own inputs, so the rows of a tile do not mix."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import next_pow2, pdl_args, triton, triton_available
from engine.ops.prologue import LOGITS_DOT_TILES, linear_tiles, prologue_linear

ROWS = 16  # rows each GEMV program computes in turn, sharing its weight tile
VOCAB_RATIO = 16  # N / K from which a weight is an LM head (tensor-core tiles)

if triton_available():
    import triton.language as tl

    from engine.ops.prologue import _mac, _prologue_act, _prologue_norm, _prologue_sum, _row_sumsq

    @triton.jit
    def _row_act(X, R, NW, RES_OUT, rm, m_ok, rk, stride_x, stride_r, pid_n, eps,
                 K: tl.constexpr, PRO: tl.constexpr, HAS_RES: tl.constexpr,
                 BLOCK_K: tl.constexpr):
        """Row rm's activation over its K columns in one tile (`prologue_linear`'s rounding)."""
        if PRO == 1:
            xs = _prologue_sum(X, R, RES_OUT, rm, m_ok, rk, stride_x, stride_r, pid_n, K,
                               HAS_RES)
            rstd = tl.math.rsqrt(_row_sumsq(xs) / K + eps)
            return _prologue_norm(xs, NW, rk, rstd, K)
        rstd = tl.zeros([1], dtype=tl.float32)
        return _prologue_act(X, R, NW, rm, m_ok, rk, stride_x, stride_r, rstd, K, PRO, HAS_RES)

    @triton.jit
    def _row_loop(X, R, NW, W, RES_OUT, rm, m_ok, rn, n_ok, rk0, stride_x, stride_r, stride_w,
                  pid_n, eps, K: tl.constexpr, PRO: tl.constexpr, HAS_RES: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
        """Row rm's products over K in BLOCK_K tiles, its norm's mean square first."""
        rstd = tl.zeros([1], dtype=tl.float32)
        if PRO == 1:
            ss = tl.zeros([1], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ss += _row_sumsq(_prologue_sum(X, R, RES_OUT, rm, m_ok, k0 + rk0, stride_x,
                                               stride_r, pid_n, K, HAS_RES))
            rstd = tl.math.rsqrt(ss / K + eps)
        acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + rk0
            a = _prologue_act(X, R, NW, rm, m_ok, rk, stride_x, stride_r, rstd, K, PRO, HAS_RES)
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :],
                        mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
            acc = _mac(acc, a, w, 1, PREC)
        return acc

    @triton.jit(do_not_specialize=["M"])  # the row count varies by the step
    def _rows_linear_kernel(X, R, NW, W, B, Y, RES_OUT, M, eps, stride_x, stride_r, stride_w,
                            stride_y, N: tl.constexpr, K: tl.constexpr, PRO: tl.constexpr,
                            HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PREC: tl.constexpr, USE_PDL: tl.constexpr):
        """Y[M, N] = a(X) @ W[N, K].T (+ B), a() as `_prologue_linear_kernel`'s PRO: rows
        pid_m * ROWS .. + ROWS in turn, each a one-row GEMV over BLOCK_N columns. K in one
        tile: the weight tile is loaded once (before the wait on the kernel before) for all of
        them; else each row loops over K."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk0 = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w = tl.load(W + rn[:, None] * stride_w + rk0[None, :],
                    mask=n_ok[:, None] & (rk0 < K)[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_BIAS:
            bias = tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        for i in range(ROWS):
            row = pid_m * ROWS + i
            if row < M:
                rm = row + tl.arange(0, 1)
                m_ok = rm < M
                if K <= BLOCK_K:
                    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
                    acc = _mac(acc, _row_act(X, R, NW, RES_OUT, rm, m_ok, rk0, stride_x,
                                             stride_r, pid_n, eps, K, PRO, HAS_RES, BLOCK_K),
                               w, 1, PREC)
                else:
                    acc = _row_loop(X, R, NW, W, RES_OUT, rm, m_ok, rn, n_ok, rk0, stride_x,
                                    stride_r, stride_w, pid_n, eps, K, PRO, HAS_RES, BLOCK_N,
                                    BLOCK_K, PREC)
                if HAS_BIAS:
                    acc += bias
                tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                         mask=m_ok[:, None] & n_ok[None, :])


def invariant_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the deterministic projection of an [n, k] weight,
    from the shape alone: BLOCK_M 1 is the GEMV family (ROWS rows a program), 16 the LM head's
    tensor-core tiles."""
    if n >= VOCAB_RATIO * k:
        bn, bk, warps = LOGITS_DOT_TILES
        return 16, bn, min(bk, next_pow2(k, 16)), warps
    return linear_tiles(1, n, k)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu: bool = False):
    """`prologue_linear` (a norm, with a residual, or SiLU-and-mul folded in; the same returns)
    through `invariant_tiles`: each row's bits the same at any row count."""
    if x.stride(1) != 1:
        x = x.contiguous()
    n, k = weight.shape
    bm, bn, bk, warps = invariant_tiles(n, k)
    if bm > 1:
        return prologue_linear(x, weight, bias, norm_weight=norm_weight, eps=eps,
                               residual=residual, silu=silu, tiles=(bm, bn, bk, warps))
    m = x.shape[0]
    assert x.shape[1] == (2 * k if silu else k) and weight.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if m:
        r = residual if residual is not None else x
        _rows_linear_kernel[(triton.cdiv(m, ROWS), triton.cdiv(n, bn))](
            x, r, norm_weight if norm_weight is not None else weight, weight,
            bias if bias is not None else weight, y, res_out if res_out is not None else y, m,
            eps, x.stride(0), r.stride(0), weight.stride(0), y.stride(0), N=n, K=k,
            PRO=1 if norm_weight is not None else 2 if silu else 0,
            HAS_RES=residual is not None, HAS_BIAS=bias is not None, ROWS=ROWS, BLOCK_N=bn,
            BLOCK_K=bk, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
            **pdl_args(x, always=True))
    return y if residual is None else (y, res_out)
