"""Row argmax kernels: one launch for draft-sized rows, two (chunks, then a join) for a target
vocabulary, and the argmax keys a GEMV folds its outputs into (`prologue_linear(keys=)`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.attention.triton_backend import cdiv, next_pow2, pdl_args, triton, triton_available

# Rows wider than ARGMAX_SPLIT (a target vocabulary) take the two-launch argmax: chunks of
# ARGMAX_CHUNK values side by side, then each row's first maximum over its chunks; one
# program walking a whole target row is the slowest launch of a one-stream step.
ARGMAX_SPLIT = 8192
ARGMAX_CHUNK = 2048
# What an argmax key buffer starts from (`prologue_linear(keys=)`): below every key.
KEY_EMPTY = -(1 << 63)
# A chained draft step's greedy argmax folded into its LM head's GEMV (`Eagle3Head.chain_step`).
FUSED_ARGMAX = True

if triton_available():
    import triton.language as tl

    @triton.jit
    def key_index(key):
        """The column an argmax key (`argmax_key`) holds."""
        return 4294967295 - (key & 4294967295)

    @triton.jit
    def argmax_key(v, col):
        """int64 keys ordered as (value, then the lower column first): the largest key of a
        row is its first maximum, as torch.argmax finds it. v holds no NaN (the caller has
        made NaN the largest value, +inf, before picking each program's maximum)."""
        bits = (v + 0.0).to(tl.int32, bitcast=True)  # -0 as +0
        ordered = tl.where(bits < 0, bits ^ 2147483647, bits)
        return (ordered.to(tl.int64) << 32) | (4294967295 - col.to(tl.int64))

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
        col = key_index(tl.load(KEYS + r, mask=ok, other=0))
        if HAS_OFF:
            col += tl.load(OFF + col, mask=ok, other=0)
        tl.store(OUT + r, col, mask=ok)


class Keyed(NamedTuple):
    """Token ids still packed as argmax keys (`prologue_linear(keys=)`): the id of row t is
    the column keys[t] holds + offsets[column]; whoever decodes them writes them to out."""
    keys: torch.Tensor
    offsets: torch.Tensor
    out: torch.Tensor


def argmax_rows(x: torch.Tensor, offsets: torch.Tensor | None = None,
                prob: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax, [T] int64: the first of equal maxima, as torch.argmax; NaN counts as
    largest, so a padding row still gives an index inside the row. offsets (a draft-to-target
    id map): offsets[argmax] is added. prob ([T] fp32): also receives each row's softmax
    probability of its argmax."""
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


def _argmax_split(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    t, v = x.shape
    chunks = cdiv(v, ARGMAX_CHUNK)
    pm = torch.empty(t, chunks, dtype=torch.float32, device=x.device)
    pi = torch.empty(t, chunks, dtype=torch.int64, device=x.device)
    _argmax_part_kernel[(t, chunks)](x, pm, pi, x.stride(0), V=v, BLOCK=ARGMAX_CHUNK,
                                     num_warps=4, **pdl_args(x))
    _argmax_join_kernel[(t,)](pm, pi, out, CHUNKS=chunks, BLOCK=next_pow2(chunks, 16),
                              num_warps=1, **pdl_args(x))
    return out


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
