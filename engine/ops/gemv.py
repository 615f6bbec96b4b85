"""Large projections (Llama-8B's, any LM head) at few rows on a GPU in half precision: a GEMV
at one row (`gemv_rows`, optionally with SiLU-and-mul in its epilogue, `gemv_silu`) and a
16-row tensor-core block at up to DOT_ROWS_MAX rows (`dot_rows`), each taken per weight shape
only where `engine.ops.tuning` measured it faster than cuBLAS on the GPU at hand."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import cdiv, next_pow2, pdl_args, triton, triton_available
from engine.ops.prologue import LINEAR_MAX_WEIGHT

GEMV_MAX_ROWS = 1  # rows that take `gemv_rows`: at more, its fp32 products on CUDA cores limit it
GEMV_TILES = (4, 1024, 8)  # the default one-row GEMV: BLOCK_N, BLOCK_K, num_warps
DOT_ROWS_MAX = 16  # rows `dot_rows` computes: one 16-row tensor-core block
DOT_ROWS_TILES = (32, 256, 5, 4)  # `dot_rows` without tuned tiles: BLOCK_N, BLOCK_K, STAGES, warps
# Row blocks `dot_tiles` walks per column block: they share its weight tiles in L2 (by column
# blocks alone, gate_up's 28672 columns of Llama-8B at 2048 rows ran 1.6x slower on an H100).
DOT_GROUP_M = 8
# (N, K, dtype, device) -> {"one": GEMV tiles or None (cuBLAS), "rows": dot tiles or None,
# and for gate_up "silu": `gemv_silu` tiles or None}, as tuning chose them; shapes not in it
# take DEFAULT_CHOICE (the GEMV at one row, cuBLAS above).
LARGE_LINEAR: dict[tuple, dict] = {}
DEFAULT_CHOICE = {"one": GEMV_TILES, "rows": None, "silu": None}

if triton_available():
    import triton.language as tl

    @triton.jit
    def _gemv_row(acc, X, row: tl.constexpr, M: tl.constexpr, stride_x, kk, rk,
                  K: tl.constexpr, wf):
        """Row `row`'s products with the weight tile wf (fp32) added to its accumulator."""
        if row < M:
            x = tl.load(X + row * stride_x + kk + rk, mask=kk + rk < K, other=0.0)
            acc += wf * x.to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _gemv_out(acc, B, Y, row: tl.constexpr, M: tl.constexpr, stride_y, rn, n_ok,
                  HAS_BIAS: tl.constexpr):
        if row < M:
            y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(Y + row * stride_y + rn, y.to(Y.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _gemv_rows_kernel(X, W, B, Y, N, stride_x, stride_w, stride_y, K: tl.constexpr,
                          M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        """Y[M, N] = X[M, K] @ W[N, K].T (+ B) for M <= 8 rows, each weight tile read once for all
        rows. Each row has its own fp32 accumulator reduced along K at the end, so a row's result
        does not depend on M: a verify step's rows round as the one-row decode does."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        wp = W + rn[:, None] * stride_w + rk[None, :]
        w = tl.load(wp, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a4 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a5 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a6 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a7 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for kk in range(0, K, BLOCK_K):
            wf = w.to(tl.float32)
            nk = kk + BLOCK_K + rk  # the next tile's weights (masked off past K: no traffic)
            w = tl.load(wp + kk + BLOCK_K, mask=n_ok[:, None] & (nk < K)[None, :], other=0.0)
            a0 = _gemv_row(a0, X, 0, M, stride_x, kk, rk, K, wf)
            a1 = _gemv_row(a1, X, 1, M, stride_x, kk, rk, K, wf)
            a2 = _gemv_row(a2, X, 2, M, stride_x, kk, rk, K, wf)
            a3 = _gemv_row(a3, X, 3, M, stride_x, kk, rk, K, wf)
            a4 = _gemv_row(a4, X, 4, M, stride_x, kk, rk, K, wf)
            a5 = _gemv_row(a5, X, 5, M, stride_x, kk, rk, K, wf)
            a6 = _gemv_row(a6, X, 6, M, stride_x, kk, rk, K, wf)
            a7 = _gemv_row(a7, X, 7, M, stride_x, kk, rk, K, wf)
        _gemv_out(a0, B, Y, 0, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a1, B, Y, 1, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a2, B, Y, 2, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a3, B, Y, 3, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a4, B, Y, 4, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a5, B, Y, 5, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a6, B, Y, 6, M, stride_y, rn, n_ok, HAS_BIAS)
        _gemv_out(a7, B, Y, 7, M, stride_y, rn, n_ok, HAS_BIAS)

    @triton.jit
    def _gemv_silu_kernel(X, W, Y, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        """Y[N] = silu(g) * u for one row x, g = W[:N] @ x and u = W[N:2N] @ x (gate_up's [2N, K]
        weight), so SiLU-and-mul runs in the epilogue; g and u round to the storage dtype first, as
        gate_up's output does before `silu_mul`."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        gp = W + rn[:, None] * stride_w + rk[None, :]
        up = gp + N * stride_w
        ok = n_ok[:, None] & (rk < K)[None, :]
        wg = tl.load(gp, mask=ok, other=0.0)
        wu = tl.load(up, mask=ok, other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        ag = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        au = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for kk in range(0, K, BLOCK_K):
            x = tl.load(X + kk + rk, mask=kk + rk < K, other=0.0).to(tl.float32)[None, :]
            cg, cu = wg.to(tl.float32), wu.to(tl.float32)
            nok = n_ok[:, None] & (kk + BLOCK_K + rk < K)[None, :]
            wg = tl.load(gp + kk + BLOCK_K, mask=nok, other=0.0)
            wu = tl.load(up + kk + BLOCK_K, mask=nok, other=0.0)
            ag += cg * x
            au += cu * x
        dt = Y.dtype.element_ty
        g = tl.sum(ag, 1).to(dt).to(tl.float32)
        u = tl.sum(au, 1).to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt)
        tl.store(Y + rn, (s.to(tl.float32) * u).to(dt), mask=n_ok)

    @triton.jit(do_not_specialize=["M"])
    def _dot_rows_kernel(X, W, B, Y, M, N, stride_x, stride_w, stride_y, K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         STAGES: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
                         USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
        """Y[M, N] = X[M, K] @ W[N, K].T (+ B): a BLOCK_M-row tensor-core block per program
        over BLOCK_N columns, Triton's software pipeline keeping STAGES weight tiles in flight;
        programs walk GROUP_M row blocks per column block, so those share its weight tiles in
        L2. Rows past M are masked (zeros): mma rows are independent, so each row rounds alike
        whatever M; each output accumulates its k16 MMA steps in K order whatever the tile."""
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        in_group = pid % (GROUP_M * num_n)
        first_m = pid // (GROUP_M * num_n) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        rm = (first_m + in_group % size_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = in_group // size_m * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k_ok = (k0 + rk < K) | EVEN_K  # no K mask (vector loads) where tiles divide K
            x = tl.load(X + rm[:, None] * stride_x + (k0 + rk)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + rn[:, None] * stride_w + (k0 + rk)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        # 64-bit row offsets: a 128256-wide head's output passes 2**31 elements at 16.7k rows
        tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :],
                 acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def large_suits(weight: torch.Tensor) -> bool:
    """Whether projections with this weight may take `gemv_rows` / `dot_rows`."""
    n, k = weight.shape
    return (n * k > LINEAR_MAX_WEIGHT and weight.is_cuda and triton_available()
            and weight.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1)


def large_key(weight: torch.Tensor) -> tuple:
    """The key of this weight's shape in LARGE_LINEAR."""
    return (*weight.shape, weight.dtype, weight.device)


def large_choice(weight: torch.Tensor) -> dict:
    """The kernels chosen for this weight's shape (LARGE_LINEAR), or DEFAULT_CHOICE."""
    return LARGE_LINEAR.get(large_key(weight), DEFAULT_CHOICE)


def gemv_suits(m: int, weight: torch.Tensor) -> bool:
    """Whether an [m, K] x weight.T projection takes `gemv_rows`."""
    return (1 <= m <= GEMV_MAX_ROWS and large_suits(weight)
            and large_choice(weight)["one"] is not None)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for at most 8 rows, each row computed alike whatever the row
    count (`_gemv_rows_kernel`)."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= 8 and weight.shape[1] == k and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    bn, bk, warps = tiles or large_choice(weight)["one"] or GEMV_TILES
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_rows_kernel[(cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, n, x.stride(0), weight.stride(0),
        y.stride(0), K=k, M=m, HAS_BIAS=bias is not None, BLOCK_N=bn,
        BLOCK_K=min(bk, next_pow2(k, 16)), num_warps=warps, **pdl_args(x, always=True))
    return y


def gemv_silu_suits(m: int, gate_up) -> bool:
    """Whether gate_up (an nn.Linear or Projection) then SiLU-and-mul over m rows takes
    `gemv_silu`: one row of a large bias-free weight for which tuning measured it faster
    than the GEMV followed by `silu_mul` (never before that measurement)."""
    return (gate_up.bias is None and gemv_suits(m, gate_up.weight)
            and large_choice(gate_up.weight).get("silu") is not None)


def gemv_silu(x: torch.Tensor, weight: torch.Tensor,
              tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """silu_mul(x @ weight.T) for one row x and gate_up's weight [2N, K], in one launch
    (`_gemv_silu_kernel`): the same values as `gemv_rows` then `silu_mul`, one launch and
    one [1, 2N] round trip fewer. tiles: the GEMV's (BLOCK_N per half, BLOCK_K, warps)."""
    m, k = x.shape
    n2 = weight.shape[0]
    assert m == 1 and n2 % 2 == 0 and weight.shape[1] == k and weight.stride(1) == 1
    n = n2 // 2
    bn, bk, warps = tiles or large_choice(weight).get("silu") or GEMV_TILES
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_silu_kernel[(cdiv(n, bn),)](
        x.contiguous(), weight, y, n, weight.stride(0), K=k, BLOCK_N=bn,
        BLOCK_K=min(bk, next_pow2(k, 16)), num_warps=warps, **pdl_args(x, always=True))
    return y


def dot_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for at most 16 rows in one 16-row tensor-core block per program
    (`_dot_rows_kernel`; rows past the count masked, so each row rounds alike whatever the
    count). tiles: (BLOCK_N, BLOCK_K, STAGES, warps)."""
    assert 1 <= x.shape[0] <= DOT_ROWS_MAX
    return dot_tiles(x, weight, bias, (16, *(tiles or DOT_ROWS_TILES)))


def dot_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              tiles: tuple[int, int, int, int, int]) -> torch.Tensor:
    """x @ weight.T (+ bias) at any row count in tensor-core tiles (BLOCK_M, BLOCK_N, BLOCK_K,
    STAGES, warps) of `_dot_rows_kernel`."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    bm, bn, bk, stages, warps = tiles
    bk = min(bk, next_pow2(k, 16))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _dot_rows_kernel[(cdiv(n, bn) * cdiv(m, bm),)](
            x, weight, bias if bias is not None else weight, y, m, n, x.stride(0),
            weight.stride(0), y.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_N=bn,
            BLOCK_K=bk, STAGES=stages, PREC="ieee" if x.dtype == torch.float32 else "tf32",
            EVEN_K=k % bk == 0, BLOCK_M=bm, GROUP_M=DOT_GROUP_M, num_warps=warps,
            **pdl_args(x, always=True))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, or for large weights on a GPU `gemv_rows` (one row) / `dot_rows` (up to
    DOT_ROWS_MAX rows) as LARGE_LINEAR says for the shape."""
    m = x.shape[0]
    if gemv_suits(m, weight):  # gemv_rows takes the shape's chosen tiles
        return gemv_rows(x, weight, bias)
    if GEMV_MAX_ROWS < m <= DOT_ROWS_MAX and large_suits(weight):
        tiles = large_choice(weight)["rows"]
        if tiles is not None:
            return dot_rows(x, weight, bias, tiles)
    return torch.nn.functional.linear(x, weight, bias)
