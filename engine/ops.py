"""Fused elementwise kernels for the fast path: residual-add + RMSNorm, rotary, SiLU-and-mul.

Each kernel rounds to the storage dtype where the torch reference (engine/layers.py,
engine/model.py) rounds, so fused and unfused models differ only by the order of the norm's
sum; a decode step falls from about 40 launches per layer to about 9 (rotary and the KV
store share one launch, `rope_store_`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.attention.triton_backend import next_pow2, pdl_args, sm_count, triton, triton_available

if triton_available():
    import triton.language as tl

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
    def _rms_row(X, W, Y, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        """One row of `_add_rmsnorm_kernel` without a residual."""
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        w = tl.load(W + offs, mask=mask, other=0.0)
        x = tl.load(X + offs, mask=mask, other=0.0)
        tl.store(Y + offs, _rms(x, w, eps, N).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _key_index(key):
        """The column an argmax key (`_argmax_key`) holds."""
        return 4294967295 - (key & 4294967295)

    @triton.jit
    def _argmax_key(v, col):
        """int64 keys ordered as (value, then the lower column first): the largest key of a
        row is its first maximum, as torch.argmax finds it. v holds no NaN (the caller has
        made NaN the largest value, +inf, before picking each program's maximum)."""
        bits = (v + 0.0).to(tl.int32, bitcast=True)  # -0 as +0
        ordered = tl.where(bits < 0, bits ^ 2147483647, bits)
        return (ordered.to(tl.int64) << 32) | (4294967295 - col.to(tl.int64))

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
                    col = _key_index(tok)
                    tok = col + tl.load(OFF + col)
                    tl.store(IDS_OUT + row, tok)
                src = tl.minimum(tl.maximum(tok, 0), rows_a - 1).to(tl.int64)
            else:
                src = row
            _rms_row(A + src * stride_a, WA, Y + row * stride_y, eps, N, BLOCK)
        else:
            _rms_row(B + row * stride_b, WB, Y + row * stride_y + N, eps, N, BLOCK)

    @triton.jit
    def _chunk_argmax(ROW, start, V, BLOCK: tl.constexpr):
        """The largest of ROW[start : start + BLOCK] (indices below V) and the first index
        holding it, by torch.argmax's rules: NaN counts as the largest value."""
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(ROW + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        return tl.max(x, 0), tl.argmax(x, 0, tie_break_left=True).to(tl.int64) + start

    @triton.jit
    def _argmax_kernel(X, OFF, OUT, PROB, stride_x, V: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_OFF: tl.constexpr, HAS_PROB: tl.constexpr = False,
                       USE_PDL: tl.constexpr = False):
        """OUT[t] = the first index of row t's largest value (+ OFF[index]); HAS_PROB: PROB[t]
        = that value's softmax probability over the row, 1 / sum(exp(x - max))."""
        row = tl.program_id(0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        best = tl.full([], float("-inf"), tl.float32)
        idx = tl.full([], 0, tl.int64)
        for v0 in range(0, V, BLOCK):
            m, i = _chunk_argmax(X + row * stride_x, v0, V, BLOCK)
            take = m > best  # strictly: an equal value later in the row loses
            idx = tl.where(take, i, idx)
            best = tl.where(take, m, best)
        if HAS_PROB:
            total = tl.full([], 0.0, tl.float32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                x = tl.load(X + row * stride_x + offs, mask=offs < V,
                            other=float("-inf")).to(tl.float32)
                total += tl.sum(tl.exp(x - best), 0)
            tl.store(PROB + row, 1.0 / total)
        if HAS_OFF:
            idx += tl.load(OFF + idx)
        tl.store(OUT + row, idx)

    @triton.jit
    def _argmax_part_kernel(X, PM, PI, stride_x, V: tl.constexpr, BLOCK: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        """Chunk c of row t: its largest value and the first index holding it."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m, i = _chunk_argmax(X + row * stride_x, c * BLOCK, V, BLOCK)
        chunks = tl.num_programs(1)
        tl.store(PM + row * chunks + c, m)
        tl.store(PI + row * chunks + c, i)

    @triton.jit
    def _argmax_join_kernel(PM, PI, OUT, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        """Row t's first maximum over its chunks' (max, index) pairs, chunks in order."""
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m = tl.load(PM + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
        i = tl.argmax(m, 0, tie_break_left=True)  # the first chunk holding the maximum
        tl.store(OUT + row, tl.load(PI + row * CHUNKS + tl.minimum(i, CHUNKS - 1)))

    @triton.jit
    def _decode_keys_kernel(KEYS, OFF, OUT, n, BLOCK: tl.constexpr, HAS_OFF: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        r = tl.arange(0, BLOCK)
        ok = r < n
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        col = _key_index(tl.load(KEYS + r, mask=ok, other=0))
        if HAS_OFF:
            col += tl.load(OFF + col, mask=ok, other=0)
        tl.store(OUT + r, col, mask=ok)

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

    @triton.jit
    def _prologue_sum(X, R, RES_OUT, rm, m_ok, rk, stride_x, stride_r, pid_n,
                      K: tl.constexpr, HAS_RES: tl.constexpr):
        """x (+ r, rounded as `_add_rmsnorm_kernel` rounds it) over the K columns rk; the sum
        also goes to RES_OUT (by the first column block)."""
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
    def _prologue_norm(a, NW, rk, rstd, K: tl.constexpr):
        """rmsnorm of the rows a (x + r already summed) over the K columns rk, times NW,
        rounded as `_add_rmsnorm_kernel` rounds it."""
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
    def _prologue_linear_kernel(X, R, NW, W, B, Y, RES_OUT, LIVE, M, eps, stride_x, stride_r,
                                stride_w, stride_y, N: tl.constexpr, K: tl.constexpr,
                                PRO: tl.constexpr, HAS_RES: tl.constexpr,
                                HAS_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                                ROWS_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
                                ASM_EXIT: tl.constexpr = False, K_MAIN: tl.constexpr = 0,
                                TAIL: tl.constexpr = 0, ONE_LOAD: tl.constexpr = False,
                                KEYS=None, ARGMAX: tl.constexpr = False):
        """Y[M, N] = a(X) @ W[N, K].T (+ B), the activation a() computed per K tile in the
        prologue and rounded where the separate kernels round:
        PRO 0: a(x) = x;
        PRO 1: a(x) = rmsnorm(x + r) * NW (the sum x + r also goes to RES_OUT, by the first
               column block), `_add_rmsnorm_kernel`'s rounding;
        PRO 2: a([g | u]) = silu(g) * u for X = [M, 2K], `_silu_mul_kernel`'s rounding.
        Weight tiles load one iteration ahead; the first before the programmatic-launch wait
        (USE_PDL), so it overlaps the kernel before, whose outputs only X and R are.
        ROWS_FIRST: the grid's first axis walks the row blocks, so the programs reading one
        weight tile run side by side (the tile comes from HBM once, for the others from L2).
        HAS_LIVE (one-row programs, BLOCK_M == 1): a row whose LIVE entry (its KV slot) is
        negative is dead, a padding row whose output nothing reads; its programs write zeros
        (to RES_OUT too) and exit, computing nothing. LIVE must be written before the launch
        before this one (it is read ahead of the programmatic-launch wait).
        K_MAIN / TAIL (`gemv_k_split`): the BLOCK_K tiles cover K_MAIN columns of K and one
        tile of TAIL columns the rest, so a K that is no power of two (SmolLM2's 576 = 512 +
        64) is read without the padding of one 1024-wide tile; both weight tiles load before
        the wait. K_MAIN 0: BLOCK_K tiles over all of K, the last padded.
        ONE_LOAD (PRO 1 where one BLOCK_K tile covers K): x (+ r) is read once, for its mean
        square and for the products, not once for each (the same numbers, one round trip
        to memory fewer before the products).
        ARGMAX: Y is not written; each program folds its columns' largest output (rounded to
        Y's type) into KEYS[row] (`_argmax_key`, an atomic max), so KEYS, filled with
        KEY_EMPTY before, ends holding each row's first maximum."""
        KM: tl.constexpr = K if K_MAIN == 0 else K_MAIN
        if ROWS_FIRST:
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(1)
        else:
            pid_n = tl.program_id(0)
            pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk0 = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        w = tl.load(W + rn[:, None] * stride_w + rk0[None, :],
                    mask=n_ok[:, None] & (rk0 < KM)[None, :], other=0.0)
        if TAIL > 0:
            rt = KM + tl.arange(0, TAIL)
            wt = tl.load(W + rn[:, None] * stride_w + rt[None, :],
                         mask=n_ok[:, None] & (rt < K)[None, :], other=0.0)
        if HAS_LIVE:  # one row a program (BLOCK_M == 1): a dead row's writes zeros, exits
            # (its KV slot read beside the first weight tile's load, before the wait)
            dead = tl.load(LIVE + pid_m) < 0
            if not ASM_EXIT:  # Triton's interpreter: an early return
                if dead:
                    tl.store(Y + pid_m * stride_y + rn,
                             tl.zeros([BLOCK_N], Y.dtype.element_ty), mask=n_ok)
                    if PRO == 1 and HAS_RES and pid_n == 0:
                        for k0 in range(0, K, BLOCK_K):
                            rk = k0 + rk0
                            tl.store(RES_OUT + pid_m * K + rk,
                                     tl.zeros([BLOCK_K], RES_OUT.dtype.element_ty),
                                     mask=rk < K)
                    return
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if HAS_LIVE and ASM_EXIT:
            # On the GPU the zeros are stores predicated on the row being dead and the exit
            # one predicated PTX `exit`, so the live path has no branch: with an early return
            # ptxas gave the norm-prologue variant 153 registers instead of 96 (three
            # programs an SM instead of five; 8 live rows +15% a layer, a K=7 verify step
            # -7%: bench/results/profile/live_rows_c05e680).
            tl.store(Y + pid_m * stride_y + rn, tl.zeros([BLOCK_N], Y.dtype.element_ty),
                     mask=n_ok & dead)
            if PRO == 1 and HAS_RES:
                for k0 in range(0, K, BLOCK_K):
                    rk = k0 + rk0
                    tl.store(RES_OUT + pid_m * K + rk,
                             tl.zeros([BLOCK_K], RES_OUT.dtype.element_ty),
                             mask=(rk < K) & dead & (pid_n == 0))
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $1, 0; @p exit; mov.u32 $0, 0; }", "=r,r",
                [dead.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ONE_LOAD:  # one tile: x (+ r) loaded once, kept for the products
            xs = _prologue_sum(X, R, RES_OUT, rm, m_ok, rk0, stride_x, stride_r, pid_n, K,
                               HAS_RES)
            rstd = tl.math.rsqrt(_row_sumsq(xs) / K + eps)
        elif PRO == 1:  # the row's mean square first: one pass over x (+ r)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, KM, BLOCK_K):
                ss += _row_sumsq(_prologue_sum(X, R, RES_OUT, rm, m_ok, k0 + rk0, stride_x,
                                               stride_r, pid_n, K, HAS_RES))
            if TAIL > 0:
                ss += _row_sumsq(_prologue_sum(X, R, RES_OUT, rm, m_ok, rt, stride_x,
                                               stride_r, pid_n, K, HAS_RES))
            rstd = tl.math.rsqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ONE_LOAD:
            acc = _mac(acc, _prologue_norm(xs, NW, rk0, rstd, K), w, BLOCK_M, PREC)
        else:
            for k0 in range(0, KM, BLOCK_K):
                rk = k0 + rk0
                a = _prologue_act(X, R, NW, rm, m_ok, rk, stride_x, stride_r, rstd, K, PRO,
                                  HAS_RES)
                cur = w
                nk = rk + BLOCK_K  # the next tile's weights (masked off past K: no traffic)
                w = tl.load(W + rn[:, None] * stride_w + nk[None, :],
                            mask=n_ok[:, None] & (nk < KM)[None, :], other=0.0)
                acc = _mac(acc, a, cur, BLOCK_M, PREC)
            if TAIL > 0:
                a = _prologue_act(X, R, NW, rm, m_ok, rt, stride_x, stride_r, rstd, K, PRO,
                                  HAS_RES)
                acc = _mac(acc, a, wt, BLOCK_M, PREC)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ARGMAX:
            v = tl.where(n_ok[None, :], acc.to(Y.dtype.element_ty).to(tl.float32),
                         float("-inf"))
            v = tl.where(v != v, float("inf"), v)
            best = tl.max(v, 1)
            col = pid_n * BLOCK_N + tl.argmax(v, 1, tie_break_left=True)
            tl.atomic_max(KEYS + rm, _argmax_key(best, col), mask=m_ok)
        else:
            tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])


if triton_available():

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
        """Y[M, N] = X[M, K] @ W[N, K].T (+ B) for M <= 8 rows, one program per BLOCK_N
        columns reading each weight tile once for all rows. Each row has its own [BLOCK_N,
        BLOCK_K] fp32 accumulator, reduced along K once at the end, so a row's result does
        not depend on M (nor on the other rows): a verify step's rows round as the one-row
        decode does. The first weight tile loads before the programmatic-launch wait."""
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


if triton_available():

    @triton.jit
    def _gemv_silu_kernel(X, W, Y, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        """Y[N] = silu(g) * u for one row x, g = W[:N] @ x and u = W[N:2N] @ x (gate_up's
        weight [2N, K]): each program reads BLOCK_N gate rows and the matching up rows, so the
        SiLU-and-mul runs in its epilogue instead of a launch of its own. g and u round to
        the storage dtype first, as gate_up's output does before `_silu_mul_kernel`."""
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
                         USE_PDL: tl.constexpr):
        """Y[M, N] = X[M, K] @ W[N, K].T (+ B) for M <= 16: one 16-row tensor-core block per
        program over BLOCK_N columns, Triton's software pipeline keeping STAGES weight tiles
        in flight. Rows past M are masked (zeros): mma rows are independent, so each row
        rounds alike whatever M."""
        pid = tl.program_id(0)
        rm = tl.arange(0, 16)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k_ok = (k0 + rk < K) | EVEN_K  # no K mask (vector loads) where tiles divide K
            x = tl.load(X + rm[:, None] * stride_x + (k0 + rk)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + rn[:, None] * stride_w + (k0 + rk)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


# Large projections (more than LINEAR_MAX_WEIGHT elements: Llama-8B's, any LM head) at up to
# DOT_ROWS_MAX rows on a GPU in half precision take our kernels instead of cuBLAS, per weight
# shape as `tune_large_linear` measured on the GPU at hand (defaults until then: the GEMV at
# one row, cuBLAS above). One row: `gemv_rows`, whose 4 x 1024 tiles with 8 warps read the
# 8B projections at 3.5-4.6 TB/s against cuBLAS's 2.7-4.2 on the H200
# (bench/results/profile/gemv_sweep_bb82e82.json: o 9.7 vs 12.7 us, qkv 13.6 vs 17.0, down
# 29.4 vs 32.1, gate_up 54.3 vs 57.8, the LM head 231 vs 247; figure 2's 8B decode step went
# from 4.70 to 4.18 ms). At 2-8 rows the GEMV's fp32 products on CUDA cores are the limit
# (`profile/gemv_rows_5427c10.json`: 6 rows of down_proj 57-172 us against cuBLAS's 32), so
# several rows take `dot_rows`, one 16-row tensor-core block per program, where it beats
# cuBLAS for the shape (`profile/gemv_dot_e31b3de.json`, 6 rows: o 11.2 vs 13.3, qkv 15.6 vs
# 16.1, down 30.9 vs 32.6, the LM head 239.9 vs 249.1; gate_up 58.7 vs 57.8).
GEMV_MAX_ROWS = 1
GEMV_TILES = (4, 1024, 8)  # BLOCK_N, BLOCK_K, num_warps
DOT_ROWS_MAX = 16
# What `tune_large_linear` tries: GEMV tiles at one row, dot tiles (BLOCK_N, BLOCK_K,
# STAGES, warps) at DOT_TUNE_ROWS rows; cuBLAS is always a candidate.
GEMV_CANDIDATES = [(4, 1024, 8), (4, 512, 4), (16, 512, 4), (8, 512, 8)]
DOT_CANDIDATES = [(32, 256, 5, 4), (32, 128, 5, 4), (64, 256, 3, 4), (32, 512, 3, 4)]
DOT_TUNE_ROWS = 8
# At one row a kernel other than the default replaces it only when timed alone at least this
# much faster: on the H200 per-shape tiles and the fused gate_up + SiLU won 1.5-3.6% alone,
# yet figure 2's 8B forward with them took 4.160-4.163 ms against 4.138 with the defaults
# (the programmatic-launch overlap between kernels is not in a lone kernel's timing).
TUNE_MARGIN = 1.05
# (N, K, dtype, device) -> {"one": GEMV tiles or None (cuBLAS), "rows": dot tiles or None,
# and for gate_up "silu": `gemv_silu` tiles or None}; shapes not in it take DEFAULT_CHOICE.
LARGE_LINEAR: dict[tuple, dict] = {}
DEFAULT_CHOICE = {"one": GEMV_TILES, "rows": None, "silu": None}


def large_suits(weight: torch.Tensor) -> bool:
    """Whether projections with this weight may take `gemv_rows` / `dot_rows`."""
    n, k = weight.shape
    return (n * k > LINEAR_MAX_WEIGHT and weight.is_cuda and triton_available()
            and weight.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1)


def _large_key(weight: torch.Tensor) -> tuple:
    return (*weight.shape, weight.dtype, weight.device)


def large_choice(weight: torch.Tensor) -> dict:
    """The kernels chosen for this weight's shape (`tune_large_linear`), or DEFAULT_CHOICE."""
    return LARGE_LINEAR.get(_large_key(weight), DEFAULT_CHOICE)


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
    _gemv_rows_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, n, x.stride(0), weight.stride(0),
        y.stride(0), K=k, M=m, HAS_BIAS=bias is not None, BLOCK_N=bn,
        BLOCK_K=min(bk, next_pow2(k, 16)), num_warps=warps, **pdl_args(x, always=True))
    return y


def gemv_silu_suits(m: int, gate_up) -> bool:
    """Whether gate_up (an nn.Linear or Projection) then SiLU-and-mul over m rows takes
    `gemv_silu`: one row of a large bias-free weight for which `tune_gemv_silu` measured it
    faster than the GEMV followed by `silu_mul` (never before that measurement)."""
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
    _gemv_silu_kernel[(triton.cdiv(n, bn),)](
        x.contiguous(), weight, y, n, weight.stride(0), K=k, BLOCK_N=bn,
        BLOCK_K=min(bk, next_pow2(k, 16)), num_warps=warps, **pdl_args(x, always=True))
    return y


def dot_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for at most 16 rows in one 16-row tensor-core block per program
    (`_dot_rows_kernel`; rows past the count masked, so each row rounds alike whatever the
    count). tiles: (BLOCK_N, BLOCK_K, STAGES, warps)."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= DOT_ROWS_MAX and weight.shape[1] == k and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    bn, bk, stages, warps = tiles or DOT_CANDIDATES[0]
    bk = min(bk, next_pow2(k, 16))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _dot_rows_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, m, n, x.stride(0),
        weight.stride(0), y.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_N=bn,
        BLOCK_K=bk, STAGES=stages, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=k % bk == 0, num_warps=warps,
        **pdl_args(x, always=True))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, or for large weights on a GPU `gemv_rows` (one row) / `dot_rows` (up to
    DOT_ROWS_MAX rows) as `LARGE_LINEAR` says for the shape."""
    m = x.shape[0]
    if gemv_suits(m, weight):  # gemv_rows takes the shape's chosen tiles
        return gemv_rows(x, weight, bias)
    if GEMV_MAX_ROWS < m <= DOT_ROWS_MAX and large_suits(weight):
        tiles = large_choice(weight)["rows"]
        if tiles is not None:
            return dot_rows(x, weight, bias, tiles)
    return torch.nn.functional.linear(x, weight, bias)


def _rows_choice(rows: dict):
    """The fastest dot tile for several rows, unless cuBLAS beats it by TUNE_MARGIN: inside
    the H200 forward a 6-token verify ran 86 us faster with dot tiles for gate_up (32 layers)
    than with cuBLAS, which had timed 2% faster alone (our kernel loads its first weight
    tiles while the kernel before it finishes; cuBLAS cannot)."""
    dots = [t for t in rows if t != "cublas"]
    return _beats(rows, min(dots, key=rows.get)) if dots else "cublas"


def _beats(times: dict, default):
    """The key of the fastest time, unless it beats `default`'s by less than TUNE_MARGIN."""
    best = min(times, key=times.get)
    return best if times[best] * TUNE_MARGIN <= times[default] else default


def _tuning(weights: list[torch.Tensor], rows: int, reps: int):
    """(x, us) for timing kernels on these weights: `rows` random rows in their dtype, and
    us(fn), GPU microseconds per call of fn(weight) in a CUDA graph that cycles through the
    weights (with several copies each call reads its weight from HBM, as a forward does)."""
    from engine.graphs import graph_time_us

    w0 = weights[0]
    gen = torch.Generator(device=w0.device).manual_seed(0)
    x = torch.randn(rows, w0.shape[1], device=w0.device, dtype=w0.dtype, generator=gen)
    n_reps = min(reps, len(weights)) if len(weights) > 1 else 2

    def us(fn):
        return round(graph_time_us(lambda i: fn(weights[i % len(weights)]), n_reps), 2)

    return x, us


def tune_gemv_silu(weights: list[torch.Tensor], reps: int = 8) -> dict:
    """For gate_up weights ([2N, K], already in LARGE_LINEAR with a one-row GEMV): time
    `gemv_silu` (each candidate GEMV tile with half its columns per half, so a program still
    reads as many weight rows) against the chosen GEMV followed by `silu_mul`, and record the
    faster in LARGE_LINEAR (key "silu": tiles, or None for the two launches). On the H200 a
    first version, with the GEMV's whole tile per half, made figure 2's 8B forward 0.5% slower
    than the two launches."""
    choice = LARGE_LINEAR[_large_key(weights[0])]
    x, us = _tuning(weights, 1, reps)
    times = {"gemv+silu_mul": us(lambda w: silu_mul(gemv_rows(x, w, tiles=choice["one"])))}
    for bn, bk, warps in GEMV_CANDIDATES:
        t = (max(1, bn // 2), bk, warps)
        times[t] = us(lambda w, t=t: gemv_silu(x, w, tiles=t))
    best = _beats(times, "gemv+silu_mul")
    choice["silu"] = None if best == "gemv+silu_mul" else best
    return {"silu": choice["silu"], "silu_us": {str(t): v for t, v in times.items()}}


def tune_large_linear(weights: list[torch.Tensor], reps: int = 8) -> dict:
    """Choose, on this GPU, the kernel for one row (GEMV tiles or cuBLAS) and for several rows
    (dot tiles or cuBLAS) of projections with these weights (one shape; several copies, e.g.
    every layer's, so each call of a timing graph reads its weight from HBM as a forward
    does). Records the choice in LARGE_LINEAR and returns it with the timings (us)."""
    x, us = _tuning(weights, DOT_TUNE_ROWS, reps)
    one = {"cublas": us(lambda w: torch.nn.functional.linear(x[:1], w))}
    for t in GEMV_CANDIDATES:
        one[t] = us(lambda w, t=t: gemv_rows(x[:1], w, tiles=t))
    rows = {"cublas": us(lambda w: torch.nn.functional.linear(x, w))}
    for t in DOT_CANDIDATES:
        try:
            rows[t] = us(lambda w, t=t: dot_rows(x, w, tiles=t))
        except Exception:  # noqa: BLE001 - a tile this GPU cannot run (shared memory)
            continue
    best_one, best_rows = _beats(one, GEMV_TILES), _rows_choice(rows)
    choice = {"one": None if best_one == "cublas" else best_one,
              "rows": None if best_rows == "cublas" else best_rows}
    LARGE_LINEAR[_large_key(weights[0])] = choice
    return {**choice, "one_us": {str(t): v for t, v in one.items()},
            "rows_us": {str(t): v for t, v in rows.items()}}


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None):
    """norm(x) (no residual) or (norm(x + residual), x + residual)."""
    t, n = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else y
    if t:
        _add_rmsnorm_kernel[(t,)](x, residual if residual is not None else x, weight, y, res_out,
                                  x.stride(0), (residual if residual is not None else x).stride(0),
                                  y.stride(0), eps, N=n, BLOCK=next_pow2(n, 1),
                                  HAS_RES=residual is not None, num_warps=4, **pdl_args(x))
    return y if residual is None else (y, res_out)


def dual_rmsnorm(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor,
                 eps: float, ids=None) -> torch.Tensor:
    """[norm(a) * wa | norm(b) * wb] ([T, 2n] from two [T, n]) in one launch, each half
    rounded as `add_rmsnorm` rounds it. ids ([T] token ids): the first half is norm(a[ids])
    instead, a an embedding table, and the lookup costs no launch of its own. ids may also
    be `Keyed` argmax keys, decoded here (and the ids written to its `out`)."""
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


class Keyed(NamedTuple):
    """Token ids still packed as argmax keys (`prologue_linear(keys=)`): the id of row t is
    the column keys[t] holds + offsets[column]; whoever decodes them writes them to out."""
    keys: torch.Tensor
    offsets: torch.Tensor
    out: torch.Tensor


def argmax_rows(x: torch.Tensor, offsets: torch.Tensor | None = None,
                prob: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as torch.argmax; NaN counts as the
    largest, so a row of garbage, say a graph bucket's padding row, still gives an index
    inside the row), plus offsets[argmax]
    when given (a draft-to-target id map), in one launch (rows wider than ARGMAX_SPLIT
    without offsets: two): [T] int64. prob ([T] fp32, one launch): also each row's softmax
    probability of its argmax, written there."""
    t, v = x.shape
    assert x.stride(1) == 1
    out = torch.empty(t, dtype=torch.int64, device=x.device)
    if t and offsets is None and prob is None and v > ARGMAX_SPLIT:
        return _argmax_split(x, out)
    if t:
        assert prob is None or (prob.shape == (t,) and prob.dtype == torch.float32)
        block = min(next_pow2(v, 1), 4096)
        _argmax_kernel[(t,)](x, offsets if offsets is not None else out, out,
                             prob if prob is not None else x, x.stride(0), V=v, BLOCK=block,
                             HAS_OFF=offsets is not None, HAS_PROB=prob is not None,
                             num_warps=8 if block >= 2048 else 4, **pdl_args(x))
    return out


# Rows wider than this (a target vocabulary) take the two-launch argmax: chunks of
# ARGMAX_CHUNK values side by side, then each row's first maximum over its chunks. One
# program walking 49152 logits took ~13 us of a one-stream step (torch's reduce likewise).
ARGMAX_SPLIT = 8192
ARGMAX_CHUNK = 2048


def _argmax_split(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    t, v = x.shape
    chunks = triton.cdiv(v, ARGMAX_CHUNK)
    pm = torch.empty(t, chunks, dtype=torch.float32, device=x.device)
    pi = torch.empty(t, chunks, dtype=torch.int64, device=x.device)
    _argmax_part_kernel[(t, chunks)](x, pm, pi, x.stride(0), V=v, BLOCK=ARGMAX_CHUNK,
                                     num_warps=4, **pdl_args(x))
    _argmax_join_kernel[(t,)](pm, pi, out, CHUNKS=chunks, BLOCK=next_pow2(chunks, 16),
                              num_warps=1, **pdl_args(x))
    return out


# Launch options of kernels whose rounding must follow torch's op by op (the rotary ones:
# each product rounded to the dtype, then the sum): no fused multiply-add. With contraction
# on, the compiler fused one product of each sum into an FMA, and which one depended on the
# order of the kernel's instructions (sm_90 PTX: `fma.rn.f16` over x1 * sin in one kernel,
# over x2 * cos in the other), so rope_store_ and rope_ parted bit-wise once rope_store_
# read its cos/sin earlier.
ROUND_LIKE_TORCH = {"enable_fp_fusion": False}


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
          ) -> torch.Tensor:
    """Rotate x ([T, heads, head_dim], last dim contiguous) in place."""
    t, h, d = x.shape
    if t:
        bh = _rope_heads(t, h, x.device)
        _rope_kernel[(t, triton.cdiv(h, bh))](
            x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0), NH=h, HALF=d // 2,
            BLOCK_H=bh, BLOCK=next_pow2(d // 2, 1), num_warps=_rope_warps(bh, d),
            **ROUND_LIKE_TORCH)
    return x


def _rope_heads(tokens: int, heads: int, device: torch.device) -> int:
    """Heads per rotary program (a power of two). On a GPU the grid keeps about four programs
    per multiprocessor: a single-token decode gets one head per program (48 programs for a
    Llama-8B qkv, where one program for the token's 48 heads ran about a microsecond a layer
    longer); a prefill chunk gets whole tokens. Under Triton's interpreter each program costs
    host time, so a program takes all heads of its token."""
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
        _rope_store_kernel[(t, triton.cdiv(nh, bh))](
            heads, cos, sin, positions, kc, vc, slots, heads.stride(0), heads.stride(1),
            cos.stride(0), kc.stride(1), NQ=num_q, NKV=num_kv, HALF=d // 2, BLOCK_H=bh,
            BLOCK=next_pow2(d // 2, 1), num_warps=_rope_warps(bh, d), **pdl_args(heads),
            **ROUND_LIKE_TORCH)
    return heads


# Row counts from 2 up to this let silu_mul's dependent launch only once its own stores are
# issued; one row, and more rows than this, let it go at once.
SILU_LATE_ROWS = 8


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim, launched early (PDL) like
    the kernels around it: it was the one launch of a decoder layer that waited for gate_up's
    GEMV to end. Figure 2 on the H200 (8B shape, batch 1): one token 4.14 -> 4.09 ms. Its
    dependent's early launch is let go at once for one row and past SILU_LATE_ROWS rows, and
    after the stores in between: let go at once there too, the 6-token verify ran 4.53 ->
    4.69 ms, after the stores 4.49 ms (one kernel looping over the rows in 14 blocks, 4.90
    ms). Without PDL past 8 rows (d8f68e4..0fe6dfa) figure 3's dynamic K slowed at 64
    streams: its K=3 steps (256 verify rows) took 1.9-2.9 ms against 1.65-2.15 with PDL at
    once, in one A/B on the H200 (burst 0.74 -> 1.02x no-spec, steady 0.63 -> 0.93x;
    bench/results/profile/silu_pdl_ab/fig3_*)."""
    t, n2 = gate_up.shape
    n = n2 // 2
    y = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, next_pow2(n, 1))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, y, gate_up.stride(0), N=n,
                                                    BLOCK=block, num_warps=4,
                                                    EARLY=not 1 < t <= SILU_LATE_ROWS,
                                                    **pdl_args(gate_up))
    return y


# Row counts the prologue linears serve before calibration: single-stream decode, where a
# layer is a chain of latency-bound launches. There the six launches of a layer are all ours,
# so each can start (PDL) while the one before finishes: a SmolLM2 forward measured 0.63 ms
# against 0.92 with separate kernels and cuBLAS. On a GPU, `LlamaModel.calibrate_prologue_rows`
# then times 1..CALIBRATE_MAX_ROWS rows at graph set-up and keeps the faster path per count
# (two multi-row designs measured slower than cuBLAS, bench/results/profile/linear_sweep*.json).
LINEAR_MAX_ROWS = 1
# Row counts up to which `LlamaModel.calibrate_prologue_rows` times the prologue linears
# against the separate kernels on the GPU at hand (at graph set-up) and keeps the faster.
CALIBRATE_MAX_ROWS = 8
# ... and weights of at most this many elements: small models' projections, whose reads are
# latency-bound. Llama-8B's (25M+ elements) read faster through cuBLAS (linear_sweep.json).
LINEAR_MAX_WEIGHT = 4 << 20
# Tile overrides for sweeps (bench/linear_sweep.py): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps).
LINEAR_TILES: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
# Grid order of multi-row launches: row blocks first, so the programs sharing a weight tile
# run side by side and read it from HBM once (bench/row_layouts.py).
ROWS_FIRST = True
# Tiles (BLOCK_N, BLOCK_K, num_warps) of a tensor-core layout for every row count up to
# DOT_MAX_ROWS: one 16-row tl.dot block whatever the count, so a tile is read once for all
# rows and each row still rounds the same alone or beside others (mma rows are independent).
# None: one GEMV program per row. On the H200 (bench/results/profile/row_layouts_7322324)
# the GEMV stays the faster layout for a SmolLM2 layer's projections at one row (1.3-3.0 us
# against 1.9-7 us for the best 16-row tiles, and the SiLU prologue of down_proj far worse),
# so the layers keep it; the LM head's 49152 x 576 takes LOGITS_DOT_TILES (17.4 / 18.0 us at
# 1 / 8 rows against the GEMV's 19.9 / 116: its 56 MB do not stay in L2 for the next row).
DOT_TILES: tuple[int, int, int] | None = None
# The target's folded projections skip the rows that store no KV (`prologue_linear`'s live):
# a graph bucket's padding rows and a verify step's rows past its sequence's drafts, which
# the device may cut short (`engine.spec.fused.CUT_PROB`). A dead row's programs write zeros
# and exit (8 dead verify rows +61 us over one row against +297 live:
# profile/dead_rows_05f9b80); since e9012e4 the check costs live rows <1% (it cost 7% of a
# K=7 step as an early return, spec_ab_036dc12). Off: live on figure 1 it bought nothing
# without the cut (2.287x no-spec against 2.304x, spec_ab_e9012e4), and the cut does not pay.
SKIP_DEAD_ROWS = False
LOGITS_DOT_TILES = (64, 128, 4)
DOT_MAX_ROWS = 16


def prologue_suits(weights) -> bool:
    """Whether projections of these weight shapes ([N, K] each) take the prologue linears."""
    return all(n * k <= LINEAR_MAX_WEIGHT for n, k in weights)


# A norm prologue whose K fits one tile reads x (+ r) once, for its mean square and for the
# products (`_prologue_linear_kernel`'s ONE_LOAD): the same numbers.
ONE_LOAD = True
GEMV_WARPS = 4  # warps of a one-row GEMV program (every row count up to 8)


def linear_tiles(m: int, n: int, k: int, dot: tuple[int, int, int] | None = None
                 ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [k, n] prologue linear. Up to 8 rows:
    one GEMV program per row and column block over narrow, long weight tiles (16 or 8
    (`gemv_block_n`) x 1024: 1.1-3.5 us for each SmolLM2 projection on the H200 under PDL); the
    rows' programs read the same tiles, all but the first from L2. (Sharing each tile across
    rows inside one program measured 1.5-2.5x slower in three designs; the last, at 20723cd,
    lost even at one row: bench/results/profile/shared_rows_20723cd/.) Above: one tl.dot row
    block per 16 rows.

    Up to 8 rows the tiles must not depend on the row count: each row is then computed by
    the same program, bit for bit, alone or beside others, so a verify step's rows round
    exactly as the one-row decode step does and greedy speculation stays token-identical to
    no speculation. (4 warps at 2-8 rows beside 8 at one row broke that: 0-1 of 4 streams
    identical in figure 1.) `GEMV_WARPS` is the setting for all of them (projections wider
    than long take one warp at every row count instead: WIDE_GEMV, MID_GEMV): 4, which on the
    H200 ran the SmolLM2 decode forward in 0.604 / 0.651 / 0.763 / 0.939 ms at 1 / 2 / 4 / 8
    rows against 0.622 / 0.713 / 0.892 / 1.248 with 8
    (`bench/results/profile/linear_sweep_gemv_w4.json`, `linear_sweep_gemv_w8.json`)."""
    if (m, n, k) in LINEAR_TILES:
        return LINEAR_TILES[(m, n, k)]
    dot = dot or DOT_TILES
    if dot is not None and m <= DOT_MAX_ROWS:
        bn, bk, warps = dot
        return 16, bn, min(bk, next_pow2(k, 16)), warps
    if m <= 8:
        bk = min(1024, next_pow2(k, 16))
        if WIDE_GEMV and n >= 4 * k:
            return 1, 8, bk, 1
        if MID_GEMV and 2 * n >= 3 * k and n < 4 * k:
            return 1, 4, bk, 1
        return 1, gemv_block_n(n, k), bk, GEMV_WARPS
    return 16, 32, min(128, next_pow2(k, 16)), 4


# One-warp GEMV programs for the projections wider than long, the same at every row count
# up to 8 (a verify row still rounds as the one-row step does). WIDE_GEMV: at least four
# times as wide as long (SmolLM2's gate_up, 3072 x 576; its draft head's gate_up and LM head,
# 7168 x 576), 8 columns a program. MID_GEMV: 1.5-4 times (qkv, 960 x 576), 4 columns. On
# the H200 a SmolLM2-shaped layer stack (`bench.live_rows --combos`,
# bench/results/profile/live_rows_079057e/) ran 8.53 / 9.76 / 11.56 / 15.78 us a layer at
# 1 / 2 / 4 / 8 rows with both against 8.44 / 10.23 / 12.90 / 18.28 with neither (gate_up
# alone 8.70 / 10.40 / 12.14 / 16.00; 2 warps, the first try, 8.52 / 10.85 / 12.41 / 17.18;
# qkv with 8 columns 8.93 / 10.33 / 11.89 / 15.26). A narrow program's few warps hold few
# registers, so an SM runs more of them at once: an 8-row verify's programs fit in fewer
# waves. A chained draft: 19.74 against 20.10 us (`bench.chain_costs`). Live, figure 1's
# first 16 held-out prompts in turns (bench/results/profile/spec_ab_0849b6f/): fixed K=7 +
# context 2.635x no-spec against 2.418x (acceptance 4.977 against 5.03: the answers
# differ, as any rounding change makes them), no-spec itself +1.2%.
WIDE_GEMV = True
MID_GEMV = True


# A GEMV program reads K as BLOCK_K tiles plus one tail tile where K is no power of two
# (`gemv_k_split`): SmolLM2's K = 576 as 512 + 64 instead of one 1024-wide tile 44% padding,
# whose registers bound the programs an SM holds (qkv and gate_up 96 registers: five; the
# 1536 gate_up programs of an 8-row verify then run in three waves). Off: slower at every
# row count on the H200 (8.54 / 18.30 us a SmolLM2 layer at 1 / 8 rows without, 9.96 / 24.46
# with, 10.14 / 19.33 with "match"; bench/results/profile/live_rows_c932980/). "match": also
# warps = BLOCK_K / 256 where
# K is split, so that a 512-wide tile is laid out for loading as it is for the products (at
# 4 warps Triton 3.6 moves the whole [16, 512] weight tile through shared memory between the
# two; at 2 warps it does not: 128 registers x 64 threads, 8 programs an SM).
EXACT_K: bool | str = False


def gemv_k_split(k: int, block_k: int) -> tuple[int, int, int]:
    """(BLOCK_K, K_MAIN, TAIL) of a GEMV program over K = k with tiles of at most block_k:
    with `EXACT_K`, BLOCK_K tiles of the largest power of two <= k cover K_MAIN columns and
    one tile of TAIL (a power of two >= 16, 0: none) the rest; without, (block_k, 0, 0): the
    kernel's BLOCK_K tiles over all of K, the last padded. Depends on k only, never on the
    row count."""
    if not EXACT_K:
        return block_k, 0, 0
    b = min(block_k, 1 << (k.bit_length() - 1))
    main = k // b * b
    return b, main, (next_pow2(k - main, 16) if k > main else 0)


def gemv_block_n(n: int, k: int) -> int:
    """Columns of a GEMV program: 16, or 8 for a projection at least twice as long as it is
    wide (SmolLM2's down, 576 x 1536), which has few column blocks for its long rows: twice
    the programs there ran a SmolLM2-shaped layer stack's four projections 0.5 / 0.8 / 0.5 /
    0.3 us a layer faster at 1 / 2 / 4 / 8 rows on the H200; 8 columns on the others lost
    at one row (`bench.live_rows --tiles`, bench/results/profile/live_rows_e9012e4/)."""
    return 8 if k >= 2 * n else 16


def prologue_tiles(m: int, n: int, k: int, dot: tuple[int, int, int] | None = None
                   ) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, K_MAIN, TAIL) of `prologue_linear`'s launch over
    m rows of an [n, k] weight: `linear_tiles`, then on the GEMV `gemv_k_split` (with
    EXACT_K "match", warps = BLOCK_K / 256 where K is split)."""
    bm, bn, bk, warps = linear_tiles(m, n, k, dot)
    k_main, tail = 0, 0
    if bm == 1:
        bk, k_main, tail = gemv_k_split(k, bk)
        if tail and EXACT_K == "match":
            warps = max(1, bk // 256)
    return bm, bn, bk, warps, k_main, tail


def prologue_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual: torch.Tensor | None = None, silu: bool = False,
                    dot: tuple[int, int, int] | None = None, live: torch.Tensor | None = None,
                    keys: torch.Tensor | None = None):
    """One launch for what takes two: `linear(rmsnorm(x + residual))` (norm_weight given;
    returns (y, x + residual), or y without a residual), `linear(silu_mul(x))` (silu), or a
    plain `linear(x)`. weight is nn.Linear's [N, K]; each activation rounds exactly where
    `add_rmsnorm` / `silu_mul` round, so only the GEMM's summation order differs from the
    separate kernels. dot: 16-row tensor-core tiles (BLOCK_N, BLOCK_K, warps) for up to
    DOT_MAX_ROWS rows instead of the GEMV (see DOT_TILES). live: per row an integer (the
    row's KV slot) that is negative where the row is dead (padding, or verify rows past a
    sequence's drafts): on the one-program-a-row GEMV, dead rows compute nothing and come
    out as zeros (the residual sum too); the others are computed exactly as without it
    (the 16-row tiles compute every row). It must be written before the launch before this
    one (a graph's static input is). keys ([M] int64 filled with KEY_EMPTY): the output is
    not written; each row's argmax goes into keys instead (`decode_keys`), and keys takes
    y's place in what is returned."""
    m = x.shape[0]
    assert live is None or live.shape[0] >= m, "a live entry for every row"
    assert keys is None or (keys.shape == (m,) and keys.dtype == torch.int64)
    n, k = weight.shape
    pro = 1 if norm_weight is not None else 2 if silu else 0
    assert x.shape[1] == (2 * k if silu else k) and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty(m if keys is None else 1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if m:
        bm, bn, bk, warps, k_main, tail = prologue_tiles(m, n, k, dot)
        assert bm == 1 or bm >= 16, "row blocks are GEMVs (1) or tl.dot tiles (16+)"
        r = residual if residual is not None else x
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        _prologue_linear_kernel[grid[::-1] if ROWS_FIRST else grid](
            x, r, norm_weight if norm_weight is not None else weight,
            weight, bias if bias is not None else weight, y,
            res_out if res_out is not None else y, live if live is not None else y, m, eps,
            x.stride(0), r.stride(0), weight.stride(0), y.stride(0), N=n, K=k, PRO=pro,
            HAS_RES=residual is not None, HAS_BIAS=bias is not None,
            HAS_LIVE=live is not None and bm == 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            PREC="ieee" if x.dtype == torch.float32 else "tf32", ROWS_FIRST=ROWS_FIRST,
            ASM_EXIT=x.is_cuda and torch.version.hip is None, K_MAIN=k_main, TAIL=tail,
            ONE_LOAD=ONE_LOAD and pro == 1 and not k_main and k <= bk,
            KEYS=keys if keys is not None else y, ARGMAX=keys is not None,
            num_warps=warps, **pdl_args(x, always=True))
    if keys is not None:
        y = keys
    return y if residual is None else (y, res_out)


# A chained draft step's greedy argmax folded into its LM head's GEMV (`prologue_linear`'s
# keys; `Eagle3Head.chain_step`): one launch fewer a draft.
FUSED_ARGMAX = True
# What an argmax key buffer starts from (`prologue_linear(keys=)`): below every key.
KEY_EMPTY = -(1 << 63)


def decode_keys(keys: torch.Tensor, offsets: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax each key of `prologue_linear(keys=)` holds, + offsets[argmax] when given
    (a draft-to-target id map): [T] int64 (written to out when given), one launch."""
    out = torch.empty_like(keys) if out is None else out
    if keys.numel():
        _decode_keys_kernel[(1,)](keys, offsets if offsets is not None else keys, out,
                                  keys.numel(), BLOCK=next_pow2(keys.numel(), 1),
                                  HAS_OFF=offsets is not None, num_warps=1, **pdl_args(keys))
    return out
