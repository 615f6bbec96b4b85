"""Fused elementwise kernels: residual-add + RMSNorm, two norms side by side (with an embedding
lookup), rotary (with the KV store) and SiLU-and-mul.

Each kernel rounds to the storage dtype where the torch reference (engine/layers.py,
engine/model.py) rounds, so fused and unfused models differ only by the order of the norm's
sum.
"""

from __future__ import annotations

import torch

from engine.attention.triton_backend import (
    BoundLaunch,
    cdiv,
    next_pow2,
    pdl_args,
    sm_count,
    triton,
    triton_available,
)
from engine.ops.argmax import Keyed

# Launch options of kernels whose rounding must follow torch's op by op (the rotary ones: each
# product rounded to the dtype, then the sum): no fused multiply-add. With contraction on, the
# compiler fuses one product of each sum into an FMA, and which one depends on the order of
# the kernel's instructions, so `rope_store_` and `rope_` could part bit-wise.
ROUND_LIKE_TORCH = {"enable_fp_fusion": False}
# Row counts from 2 up to this let `silu_mul`'s dependent launch only once its own stores are
# issued; one row, and more rows than this, let it go at once (the faster order for each).
SILU_LATE_ROWS = 8

if triton_available():
    import triton.language as tl

    from engine.ops.argmax import key_index

    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, Y, RES_OUT, stride_x, stride_r, stride_y, eps,
                            N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        w = tl.load(W + offs, mask=mask, other=0.0)  # a weight: read before the wait
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(RES_OUT + row * N + offs, x, mask=mask)
        tl.store(Y + row * stride_y + offs, _rms(x, w, eps, N).to(Y.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _rms(x, w, eps, N: tl.constexpr):
        """w * norm(x) for one row x (masked lanes 0) and its norm weight w, in fp32, rounded
        to x's dtype where the torch reference rounds."""
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / N
        h = (h * tl.math.rsqrt(var + eps)).to(x.dtype)
        return w.to(tl.float32) * h.to(tl.float32)

    @triton.jit
    def _rms_row(X, W, Y, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        """One row of `_add_rmsnorm_kernel` without a residual."""
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        w = tl.load(W + offs, mask=mask, other=0.0)
        x = tl.load(X + offs, mask=mask, other=0.0)
        tl.store(Y + offs, _rms(x, w, eps, N).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _dual_rmsnorm_kernel(A, B, WA, WB, Y, IDS, OFF, IDS_OUT, stride_a, stride_b, stride_y,
                             eps, rows_a, N: tl.constexpr, BLOCK: tl.constexpr,
                             GATHER: tl.constexpr, KEYS: tl.constexpr = False,
                             USE_PDL: tl.constexpr = False):
        """Row t of [norm(a) | norm(b)]: program (t, 0) the first half, (t, 1) the second.
        GATHER: the first half's row is A's row IDS[t] (an embedding lookup), clamped into
        A's rows_a rows. KEYS: IDS holds argmax keys (`prologue_linear(keys=)`) of draft
        ids; the token is the key's column + OFF[column], also written to IDS_OUT[t]."""
        row = tl.program_id(0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if tl.program_id(1) == 0:
            if GATHER:
                tok = tl.load(IDS + row)
                if KEYS:
                    col = key_index(tok)
                    tok = col + tl.load(OFF + col)
                    tl.store(IDS_OUT + row, tok)
                src = tl.minimum(tl.maximum(tok, 0), rows_a - 1).to(tl.int64)
            else:
                src = row
            _rms_row(A + src * stride_a, WA, Y + row * stride_y, eps, N, BLOCK)
        else:
            _rms_row(B + row * stride_b, WB, Y + row * stride_y + N, eps, N, BLOCK)

    @triton.jit
    def _cos_sin(COS, SIN, p, stride_c, offs, mask, HALF: tl.constexpr):
        """The cos and sin halves of position p (offs/mask over HALF), for `_rotate`."""
        return (tl.load(COS + p * stride_c + offs, mask=mask, other=0.0),
                tl.load(COS + p * stride_c + HALF + offs, mask=mask, other=0.0),
                tl.load(SIN + p * stride_c + offs, mask=mask, other=0.0),
                tl.load(SIN + p * stride_c + HALF + offs, mask=mask, other=0.0))

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2):
        """The two halves of x*cos + rotate_half(x)*sin, rounding like torch; x1, x2:
        [heads, HALF] tiles of one token, (c1, c2, s1, s2) its position's `_cos_sin`."""
        dt = x1.dtype
        c1 = c1.to(dt).to(tl.float32)
        c2 = c2.to(dt)
        s1 = s1.to(dt).to(tl.float32)
        s2 = s2.to(dt)
        a1 = (x1.to(tl.float32) * c1[None, :]).to(dt).to(tl.float32)
        b1 = (-x2.to(tl.float32) * s1[None, :]).to(dt).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        return (a1 + b1).to(dt), (a2 + b2).to(dt)

    @triton.jit
    def _rope_kernel(X, COS, SIN, POS, stride_xt, stride_xh, stride_c, NH: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
        """In place on x [T, NH, 2*HALF], BLOCK_H heads of one token per program:
        x*cos + rotate_half(x)*sin, rounding like torch."""
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m2 = (h < NH)[:, None] & mask[None, :]
        p = tl.load(POS + t)
        base = X + t * stride_xt + h[:, None] * stride_xh + offs[None, :]
        x1 = tl.load(base, mask=m2, other=0.0)
        x2 = tl.load(base + HALF, mask=m2, other=0.0)
        c1, c2, s1, s2 = _cos_sin(COS, SIN, p, stride_c, offs, mask, HALF)
        y1, y2 = _rotate(x1, x2, c1, c2, s1, s2)
        tl.store(base, y1, mask=m2)
        tl.store(base + HALF, y2, mask=m2)

    @triton.jit
    def _rope_store_kernel(X, COS, SIN, POS, KC, VC, SLOTS, stride_xt, stride_xh, stride_c,
                           stride_cs, NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
        """BLOCK_H heads of one token of qkv [T, NQ + 2*NKV, 2*HALF] per program: q heads
        rotate in place, k heads rotate in place and go to cache slot SLOTS[t], v heads only
        go to the cache (slot -1: no store). The rotation rounds exactly as `_rope_kernel`."""
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        # The step's slots and positions (never written by the kernel before, the qkv
        # projection) and the position's cos/sin: read while that kernel still runs.
        slot = tl.load(SLOTS + t)
        p = tl.load(POS + t)
        c1, c2, s1, s2 = _cos_sin(COS, SIN, p, stride_c, offs, mask, HALF)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m2 = (h < NQ + 2 * NKV)[:, None] & mask[None, :]
        base = X + t * stride_xt + h[:, None] * stride_xh + offs[None, :]
        x1 = tl.load(base, mask=m2, other=0.0)
        x2 = tl.load(base + HALF, mask=m2, other=0.0)
        y1, y2 = _rotate(x1, x2, c1, c2, s1, s2)
        rot = (h < NQ + NKV)[:, None] & m2  # q and k heads
        tl.store(base, y1, mask=rot)
        tl.store(base + HALF, y2, mask=rot)
        if slot >= 0:
            kh = h - NQ  # k heads: the rotated halves to the key cache
            k_ok = rot & (h >= NQ)[:, None]
            dst = KC + slot * stride_cs + kh[:, None] * 2 * HALF + offs[None, :]
            tl.store(dst, y1.to(KC.dtype.element_ty), mask=k_ok)
            tl.store(dst + HALF, y2.to(KC.dtype.element_ty), mask=k_ok)
            vh = h - NQ - NKV  # v heads: as they are, to the value cache
            v_ok = m2 & (h >= NQ + NKV)[:, None]
            dst = VC + slot * stride_cs + vh[:, None] * 2 * HALF + offs[None, :]
            tl.store(dst, x1.to(VC.dtype.element_ty), mask=v_ok)
            tl.store(dst + HALF, x2.to(VC.dtype.element_ty), mask=v_ok)

    @triton.jit
    def _silu_mul_kernel(GU, Y, stride_g, N: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False, EARLY: tl.constexpr = True):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < N
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        g = tl.load(GU + row * stride_g + col, mask=mask, other=0.0)
        u = tl.load(GU + row * stride_g + N + col, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        y = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        tl.store(Y + row * N + col, y, mask=mask)
        if USE_PDL and not EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    # Launched from Python every eager forward: past Triton's JIT (`BoundLaunch`).
    _ADD_RMSNORM, _ROPE_STORE, _SILU_MUL = map(BoundLaunch, (
        _add_rmsnorm_kernel, _rope_store_kernel, _silu_mul_kernel))


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None):
    """norm(x) (no residual) or (norm(x + residual), x + residual)."""
    t, n = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else y
    if t:
        r = residual if residual is not None else x
        _ADD_RMSNORM[(t,)](x, r, weight, y, res_out, x.stride(0), r.stride(0),
                           y.stride(0), eps, N=n, BLOCK=next_pow2(n, 1),
                           HAS_RES=residual is not None, num_warps=4, **pdl_args(x))
    return y if residual is None else (y, res_out)


def dual_rmsnorm(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor,
                 eps: float, ids=None) -> torch.Tensor:
    """[norm(a) * wa | norm(b) * wb] ([T, 2n] from two [T, n]) in one launch, each half rounded
    as `add_rmsnorm` rounds it. ids ([T] token ids, or `Keyed` argmax keys decoded here): the
    first half is norm(a[ids]) instead, a being an embedding table, at no extra launch."""
    t, n = b.shape
    keyed = isinstance(ids, Keyed)
    src = ids.keys if keyed else ids
    assert a.shape[1] == n and a.stride(1) == 1 and b.stride(1) == 1
    assert a.shape[0] == t if src is None else src.shape == (t,)
    y = torch.empty(t, 2 * n, dtype=a.dtype, device=a.device)
    if t:
        _dual_rmsnorm_kernel[(t, 2)](a, b, wa, wb, y, src if src is not None else y,
                                     ids.offsets if keyed else y, ids.out if keyed else y,
                                     a.stride(0), b.stride(0), y.stride(0), eps, a.shape[0],
                                     N=n, BLOCK=next_pow2(n, 1), GATHER=src is not None,
                                     KEYS=keyed, num_warps=4, **pdl_args(b))
    return y


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
          ) -> torch.Tensor:
    """Rotate x ([T, heads, head_dim], last dim contiguous) in place."""
    t, h, d = x.shape
    if t:
        bh = _rope_heads(t, h, x.device)
        _rope_kernel[(t, cdiv(h, bh))](
            x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0), NH=h, HALF=d // 2,
            BLOCK_H=bh, BLOCK=next_pow2(d // 2, 1), num_warps=_rope_warps(bh, d),
            **ROUND_LIKE_TORCH)
    return x


def _rope_heads(tokens: int, heads: int, device: torch.device) -> int:
    """Heads per rotary program (a power of two). On a GPU the grid keeps about four programs
    per multiprocessor: a single-token decode gets one head per program, a prefill chunk
    whole tokens. Under Triton's interpreter each program costs host time, so a program
    takes all heads of its token."""
    whole = next_pow2(heads, 1)
    if device.type != "cuda":
        return whole
    per = tokens * heads // (4 * sm_count(device))
    return min(whole, 1 << max(0, per.bit_length() - 1))


def _rope_warps(heads: int, head_dim: int) -> int:
    """Warps of a rotary program: about 256 elements a warp, 1 to 8."""
    return max(1, min(8, next_pow2(heads * head_dim // 256, 1)))


def rope_store_(heads: torch.Tensor, num_q: int, num_kv: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """heads = qkv as [T, num_q + 2*num_kv, head_dim]: rotate q and k in place and store
    k and v into kv_cache ([2, blocks, block, num_kv, head_dim]) at `slots` (-1: skip), in
    one launch: what `rope_` then the backend's `store_kv` do in two."""
    t, nh, d = heads.shape
    assert nh == num_q + 2 * num_kv and heads.stride(2) == 1
    kc, vc = kv_cache[0], kv_cache[1]
    if t:
        bh = _rope_heads(t, nh, heads.device)
        _ROPE_STORE[(t, cdiv(nh, bh))](
            heads, cos, sin, positions, kc, vc, slots, heads.stride(0), heads.stride(1),
            cos.stride(0), kc.stride(1), NQ=num_q, NKV=num_kv, HALF=d // 2, BLOCK_H=bh,
            BLOCK=next_pow2(d // 2, 1), num_warps=_rope_warps(bh, d), **pdl_args(heads),
            **ROUND_LIKE_TORCH)
    return heads


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim, launched early (PDL) like
    the kernels around it, so it does not wait for gate_up's GEMV to end; its dependent may
    start at once, or after its stores at 2..SILU_LATE_ROWS rows."""
    t, n2 = gate_up.shape
    n = n2 // 2
    y = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, next_pow2(n, 1))
        _SILU_MUL[(t, cdiv(n, block))](gate_up, y, gate_up.stride(0), N=n, BLOCK=block,
                                       num_warps=4, EARLY=not 1 < t <= SILU_LATE_ROWS,
                                       **pdl_args(gate_up))
    return y
