"""The fused step's bookkeeping on the device: the verify's accepted counts and the head's KV
slots (`accept`), each chained draft step's positions and slots (`chain_positions`), and the
next step's inputs from this step's outputs (`continue_inputs`), each one launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.attention.triton_backend import (
    FastLaunch,
    next_pow2,
    no_specialize,
    triton,
    triton_available,
)


class FusedOut(NamedTuple):
    """A fused step's device outputs: the target's argmax of every row [b * q], the drafts
    each sequence accepted [b], and the drafts made for the next step [b, drafts] (None where
    the step drafted nothing). The step's graph returns them as a plain tuple (a graph's
    outputs are cut to the rows run, tensor by tensor); `FusedOut(*outputs)` names them."""

    argmax: torch.Tensor
    accepted: torch.Tensor
    drafts: torch.Tensor | None = None

    def clone(self) -> FusedOut:
        return FusedOut(*(None if t is None else t.clone() for t in self))


def continue_inputs(out: FusedOut, pq: int, pb: int, sel: torch.Tensor | None,
                    state: torch.Tensor, b: int, q: int, block_size: int, ids, pos, meta):
    """`continuation`'s prepare as one Triton launch: the step's token ids, positions, KV
    slots and context lengths from the previous step's outputs `out` (pb sequences, pq rows
    each), its rows `sel` (default: all), written into the graph's static inputs."""
    has_drafts = out.drafts is not None and q > 1
    # (without drafts, a stand-in of the same dtype that is not read)
    drafts = out.drafts if has_drafts else out.accepted
    w = min(drafts.shape[1], q - 1) if has_drafts else 0
    tables = meta.block_tables
    has_sel, qp = sel is not None, next_pow2(q, 1)
    _continue_launch((ids.device.index, has_sel, qp, tables.dtype, meta.seq_lens.dtype), (b,),
                     (out.argmax, out.accepted, drafts, sel if has_sel else state, state, tables,
                      ids, pos, meta.slot_mapping, meta.seq_lens, b, pq, drafts.stride(0),
                      tables.stride(0), block_size, q, w, has_sel, qp), num_warps=1)


def compile_continuation_variants(query_levels, block_size: int, device) -> None:
    """Compile `continue_inputs` for every variant a run can meet (each query level, with
    and without a row selection) now, not in the middle of serving."""
    if not (torch.device(device).type == "cuda" and triton_available()):
        return
    i64 = {"dtype": torch.int64, "device": device}
    for q in query_levels:
        for sel in (None, torch.zeros(1, **i64)):
            out = FusedOut(torch.zeros(q, **i64), torch.zeros(1, **i64),
                           torch.zeros(1, max(q - 1, 1), **i64))
            meta = _Meta(torch.ones(1, 4, **i64), torch.zeros(q, **i64), torch.zeros(1, **i64))
            continue_inputs(out, 1, 1, sel, torch.zeros(2, **i64), 1, q, block_size,
                            torch.zeros(q, **i64), torch.zeros(q, **i64), meta)


@dataclass
class _Meta:
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor


def compiled_continuations() -> int:
    """How many variants of the continuation kernel are compiled (all devices)."""
    caches = getattr(_continue_kernel, "device_caches", {})
    return sum(len(c[0]) for c in caches.values())


if triton_available():
    import triton.language as tl

    # Every integer (batch, row counts, strides, draft width) and pointer (slices of a staging
    # ring, at varying offsets) changes from step to step; specialized on their values or
    # alignment, the kernel would compile anew mid-run, stalling the step.
    _INTS = ["b", "pq", "d_stride", "t_stride", "bs", "q", "w"]
    _PTRS = ["GRID", "NACC", "DRAFTS", "SEL", "STATE", "TABLES", "IDS", "POS", "SLOTS", "LENS"]
    _NO_SPECIALIZE = no_specialize(_INTS, _PTRS)

    @triton.jit(**_NO_SPECIALIZE)
    def _continue_kernel(GRID, NACC, DRAFTS, SEL, STATE, TABLES, IDS, POS, SLOTS, LENS,
                         b, pq, d_stride, t_stride, bs, q, w, HAS_SEL: tl.constexpr,
                         Q: tl.constexpr):
        """Program j: sequence j of the step, row SEL[j] of the previous one."""
        j = tl.program_id(0)
        if HAS_SEL:
            src = tl.load(SEL + j).to(tl.int64)
        else:
            src = j.to(tl.int64)
        n = tl.load(NACC + src)
        kc = tl.load(STATE + b + j)
        lo = tl.load(STATE + j) + n + 1
        r = tl.arange(0, Q)
        real = r < q
        first = tl.load(GRID + src * pq + n)
        d = tl.load(DRAFTS + src * d_stride + (r - 1), mask=(r >= 1) & (r <= w) & (r <= kc),
                    other=0)
        tok = tl.where(r == 0, first, d)
        p = lo + tl.minimum(r, kc)
        blk = tl.load(TABLES + j * t_stride + p // bs, mask=real, other=0)
        slot = tl.where(r <= kc, blk.to(tl.int64) * bs + p % bs, -1)
        tl.store(IDS + j * q + r, tok, mask=real)
        tl.store(POS + j * q + r, p, mask=real)
        tl.store(SLOTS + j * q + r, slot, mask=real)
        tl.store(LENS + j, lo + q)

    # Launched from Python every overlapped step: past the first launch of each variant,
    # without Triton's per-call binding (its variant follows from the device and constexprs
    # only where the JIT leaves every pointer's alignment alone).
    _continue_launch = FastLaunch(_continue_kernel) \
        if "do_not_specialize_on_alignment" in _NO_SPECIALIZE else \
        (lambda key, grid, args, **options: _continue_kernel[grid](*args, **options))


def accepted(am: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, b: int, q: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept`'s first two outputs in torch ops: each sequence's accepted drafts and the
    head's KV slots (-1 past the last accepted row)."""
    grid, ids2 = am.view(b, q), ids.view(b, q)
    real = slots.view(b, q) >= 0
    match = (ids2[:, 1:] == grid[:, :-1]) & real[:, 1:]
    nacc = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    keep = real & (torch.arange(q, device=ids.device)[None, :] <= nacc[:, None])
    return nacc, torch.where(keep.view(-1), slots, -1)


def accept(am: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
           seq_lens: torch.Tensor, b: int, q: int, kernel: bool = True) -> tuple:
    """A fused step's verify bookkeeping for its [b, q] grid (argmax `am`, token `ids`, KV `slots`,
    positions `pos`, all [b * q]). Returns (accepted drafts nacc per sequence, the head's KV slots
    [b * q] (-1 past the last accepted), the chain's start position pos[row 0] + nacc + 1, the
    target token am[nacc], that row's index, live (seq_lens > 0), the chain's query starts 0..b).
    `kernel`: one Triton launch, else the equivalent torch ops."""
    dev = ids.device
    if not kernel:
        nacc, hslots = accepted(am, ids, slots, b, q)
        return (nacc, hslots,
                pos.view(b, q)[:, 0] + nacc + 1,
                am.view(b, q).gather(1, nacc[:, None])[:, 0],
                torch.arange(b, device=dev) * q + nacc, seq_lens > 0,
                torch.arange(b + 1, device=dev))
    nacc = torch.empty(b, dtype=torch.int64, device=dev)
    start, bonus, last = (torch.empty(b, dtype=torch.int64, device=dev) for _ in range(3))
    hslots = torch.empty(b * q, dtype=torch.int64, device=dev)
    live = torch.empty(b, dtype=torch.bool, device=dev)
    qs = torch.empty(b + 1, dtype=torch.int64, device=dev)
    _accept_kernel[(1,)](am, ids, slots, pos, seq_lens, nacc, hslots, start, bonus, last, live,
                         qs, b, q, BLOCK_B=next_pow2(b + 1, 2), QP=next_pow2(q, 2),
                         num_warps=4)
    return nacc, hslots, start, bonus, last, live, qs


def chain_positions(k, start, has_queries, tables, block_size: int, s: int, kernel: bool,
                    steps: int | None = None, keys: bool = False):
    """Chained draft step s's (positions, KV slots, context lengths), one row per sequence:
    position start + s - 1 where the sequence's k goes past s (else a padded row: 0, slot -1).
    `kernel`: one Triton launch instead of about ten. steps: steps s .. s + steps - 1 at once,
    each [steps, b]. keys (with kernel and steps): also a fourth [steps, b] of `ops.KEY_EMPTY`."""
    if kernel:
        b, n = k.shape[0], steps or 1
        p = torch.empty(n, b, dtype=torch.int64, device=k.device)
        slots, lens = torch.empty_like(p), torch.empty_like(p)
        kk = torch.empty_like(p) if keys else p
        _chain_kernel[(n,)](k, start, has_queries, tables, p, slots, lens, kk, b, k.stride(0),
                            start.stride(0), tables.stride(0), tables.shape[1], block_size, s,
                            BLOCK=next_pow2(b, 1), KEYS_ON=keys, num_warps=1)
        if keys:
            assert steps, "keys come with every step's outputs"
            return p, slots, lens, kk
        return (p, slots, lens) if steps else (p[0], slots[0], lens[0])
    if steps:
        every = [chain_positions(k, start, has_queries, tables, block_size, s + i, False)
                 for i in range(steps)]
        return tuple(torch.stack(x) for x in zip(*every))
    valid = (k > s) & has_queries
    p = torch.where(valid, start + (s - 1), 0)
    col = (p // block_size).clamp(max=tables.shape[1] - 1)
    blk = tables.gather(1, col[:, None])[:, 0]
    return (p, torch.where(valid, blk * block_size + p % block_size, -1),
            torch.where(valid, p + 1, has_queries.to(p.dtype)))


if triton_available():

    @triton.jit(do_not_specialize=["b", "q"])
    def _accept_kernel(AM, IDS, SLOTS, POS, LENS, NACC, HSLOTS, START, BONUS, LAST, LIVE, QS,
                       b, q, BLOCK_B: tl.constexpr, QP: tl.constexpr):
        """`accept` for all b sequences in one program ([BLOCK_B, QP] tiles of the grid)."""
        r = tl.arange(0, BLOCK_B)
        c = tl.arange(0, QP)
        rok = r < b
        base = r[:, None] * q + c[None, :]
        ok = rok[:, None] & (c[None, :] < q)
        slots = tl.load(SLOTS + base, mask=ok, other=-1)
        # column c holds draft c+1 against the argmax of row c (c < q - 1)
        mok = rok[:, None] & (c[None, :] < q - 1)
        nxt = tl.load(IDS + base + 1, mask=mok, other=0)
        arg = tl.load(AM + base, mask=mok, other=0)
        nslot = tl.load(SLOTS + base + 1, mask=mok, other=-1)
        match = mok & (nxt == arg) & (nslot >= 0)
        # the accepted count: the first column that does not match (column q - 1 never does)
        nacc = tl.min(tl.where(match, QP, c[None, :]), 1).to(tl.int64)
        keep = ok & (slots >= 0) & (c[None, :] <= nacc[:, None])
        tl.store(HSLOTS + base, tl.where(keep, slots, -1), mask=ok)
        rows = r.to(tl.int64) * q
        p0 = tl.load(POS + rows, mask=rok, other=0)
        tl.store(NACC + r, nacc, mask=rok)
        tl.store(START + r, p0 + nacc + 1, mask=rok)
        tl.store(BONUS + r, tl.load(AM + rows + nacc, mask=rok, other=0), mask=rok)
        tl.store(LAST + r, rows + nacc, mask=rok)
        tl.store(LIVE + r, tl.load(LENS + r, mask=rok, other=0) > 0, mask=rok)
        tl.store(QS + r, r.to(tl.int64), mask=r <= b)

    @triton.jit
    def _chain_kernel(K, START, HASQ, TABLES, P, SLOTS, LENS, KEYS, b, k_stride, s_stride,
                      t_stride, width, bs, s0, BLOCK: tl.constexpr, KEYS_ON: tl.constexpr):
        """`chain_positions` for all b rows in one program: program i does step s0 + i and
        writes row i of [steps, b] outputs (KEYS_ON: KEYS too, every entry KEY_EMPTY)."""
        i = tl.program_id(0)
        step = s0 + i
        out = i * b
        r = tl.arange(0, BLOCK)
        ok = r < b
        k = tl.load(K + r * k_stride, mask=ok, other=0)
        hq = tl.load(HASQ + r, mask=ok, other=0) != 0
        valid = (k > step) & hq
        st = tl.load(START + r * s_stride, mask=ok, other=0)
        p = tl.where(valid, st + (step - 1), 0).to(tl.int64)
        col = tl.minimum(p // bs, width - 1)
        blk = tl.load(TABLES + r * t_stride + col, mask=ok, other=0).to(tl.int64)
        tl.store(P + out + r, p, mask=ok)
        tl.store(SLOTS + out + r, tl.where(valid, blk * bs + p % bs, -1), mask=ok)
        tl.store(LENS + out + r, tl.where(valid, p + 1, hq.to(tl.int64)), mask=ok)
        if KEYS_ON:
            tl.store(KEYS + out + r, tl.full([BLOCK], -9223372036854775808, tl.int64),
                     mask=ok)
