"""One graph per greedy speculative decode step.

A pure decode step of greedy EAGLE-3 requests does, per sequence: verify the pending token and
its k drafts with the target, emit the accepted drafts and one target token, run the head's
first step over the accepted positions, and chain the next k' drafts. Run as separate pieces
that is three graph replays, an eager feature fuse and LM head, and two host syncs. Here it is
one replay and one sync, because every data-dependent quantity stays on the device:

- Every sequence gets the same number of rows, q: its pending token, its drafts, then padding
  rows that store no KV (slot -1) and sit causally after the real rows, so they change nothing
  the real rows compute. The batch is then a [B, q] grid.
- Accepted drafts = the prefix where draft i+1 equals the target's argmax at row i. For
  accepted rows that argmax *is* the next token, so the head's first step reads the argmax row
  by row; it stores draft KV only up to the last accepted row.
- The chain starts from the head's state at the last accepted row, at position
  lo + accepted + 1, each step computing its positions and KV slots on the device.

The host then reads (argmax grid, accepted counts, next drafts) in one copy. The result is what
the step-by-step path computes (`SpecRunner.propose` after `Engine._run`), token for token:
verification is the same comparison, and the head sees the same tokens, features and
positions. Sampled requests, prefill chunks and hand-offs keep the step-by-step path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from engine import ops
from engine.attention import AttentionMetadata
from engine.attention.triton_backend import FastLaunch, next_pow2, triton, triton_available
from engine.graphs import GraphSet, PackedInputs, table_array
from engine.sequence import Sequence
from engine.spec.lookup import lookup, store_tokens

# The head's steps in the fused graph look their tokens' embeddings up inside their input
# norms, chained steps add the layer's last residual inside the LM head's prologue
# (`Eagle3Head.chain_step`), and one launch gives every chained step's positions, KV slots
# and lengths up front: the same numbers in three launches fewer a chained draft. Read when
# a graph is captured; False: the separate launches (an A/B's baseline).
FOLD_CHAIN = True
# The verify's bookkeeping (accepted counts, the head's KV slots, where the chain starts, the
# target's token after the accepted drafts, the rows the chain continues from) in one launch
# (`accept`) instead of ~17 small torch kernels a step. Read when a graph is captured; False:
# the torch kernels (an A/B's baseline).
FUSED_ACCEPT = True
# A device cut of each sequence's verify: draft j is verified only while the product of the
# head's probabilities of drafts 1..j (the context's copied drafts count as 1) stays at least
# CUT_PROB; rows past it store no KV (and the target's projections may skip them,
# `ops.SKIP_DEAD_ROWS`). Any subset of the drafts verified leaves the output as it was. A
# replay priced as if cut rows cost nothing promised ~+10% at 0.02-0.05 (K=7, figure 1's
# prompts on the CPU); on the H200 (bench/results/profile/spec_ab_852f923) cut rows saved no
# step time (1142 us a K=7 step cut at 0.03 against 1134-1145 uncut) while acceptance fell
# 4.74 -> 4.51, so it is off. That was with the dead rows' loads masked, which left their
# cost. With their programs exiting and the check free for live rows (e9012e4) it still
# does not pay: fixed K=7 + context 2.305x no-spec at 0.01, 2.268x at 0.02, uncut 2.304x
# (acceptance 4.69 / 4.55 / 4.74; bench/results/profile/spec_ab_e9012e4).
# Read when a graph is captured (whether the drafts' probabilities are kept) and at each
# continuation; 0: verify every draft.
CUT_PROB = 0.0


@dataclass
class FusedHandle:
    """A launched fused step: its sequences, drafts verified (kcur) and drafted next (kn),
    rows per sequence, its device outputs and the host copy being made of them."""

    seqs: list[Sequence]
    kcur: list[int]
    kn: list[int]
    q: int
    out: tuple
    flat: torch.Tensor
    fetch: object  # () -> list[int], waits for the copy
    continuable: bool = True  # blocks exist for the step after it
    tried: bool = False  # the copy holds each sequence's drafts verified (after nacc)

    def protect(self) -> None:
        """Own copies of the outputs the next step's continuation reads: before other graphs
        of the same memory pool replay between this step and that one (a prefill launched
        beside it, and the head's step after that prefill), whose scratch memory may be where
        this graph's outputs live."""
        self.out = tuple(t.clone() for t in self.out)


def continuation(prev: FusedHandle, state: torch.Tensor, b: int, q: int, block_size: int,
                 sel: torch.Tensor | None = None):
    """Device-side inputs of the step after `prev`: per sequence the target's token after
    the last accepted draft, then the drafts prev made, at positions after the accepted ones
    (`state`: num_computed per sequence before prev, then this step's draft counts). `sel`:
    the rows of prev that continue, in order (default: all of them)."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x if sel is None else x[sel]

    def prepare(ids, pos, meta):
        pq, pb = prev.q, len(prev.seqs)
        if ids.is_cuda and triton_available():  # one launch instead of about twenty
            continue_inputs(prev.out, pq, pb, sel, state, b, q, block_size, ids, pos, meta)
            return
        grid = rows(prev.out[0][: pb * pq].view(pb, pq))
        counts = prev.out[1]
        nacc = rows((counts[0] if counts.dim() == 2 else counts)[:pb])
        lo = state[:b] + nacc + 1
        kc = state[b:]
        if len(prev.out) > 3:  # cut where the drafts' probability falls below CUT_PROB
            kc = torch.minimum(kc, rows(kept_drafts(prev.out, pb)))
        r = torch.arange(q, device=ids.device)
        new_ids = torch.zeros(b, q, dtype=ids.dtype, device=ids.device)
        new_ids[:, 0] = grid.gather(1, nacc[:, None])[:, 0]
        if len(prev.out) > 2 and q > 1:
            d = rows(prev.out[2][:pb])
            w = min(d.shape[1], q - 1)
            new_ids[:, 1 : 1 + w] = torch.where(r[None, 1 : 1 + w] <= kc[:, None], d[:, :w], 0)
        p = lo[:, None] + torch.minimum(r[None, :], kc[:, None])
        tables = meta.block_tables[:b]
        blk = tables.gather(1, p // block_size)
        slots = torch.where(r[None, :] <= kc[:, None], blk * block_size + p % block_size, -1)
        ids[: b * q].copy_(new_ids.view(-1))
        pos[: b * q].copy_(p.view(-1))
        meta.slot_mapping[: b * q].copy_(slots.view(-1))
        meta.seq_lens[:b].copy_(lo + q)

    return prepare


def continue_inputs(out: tuple, pq: int, pb: int, sel: torch.Tensor | None,
                    state: torch.Tensor, b: int, q: int, block_size: int, ids, pos, meta):
    """`continuation`'s prepare as one Triton launch: the step's token ids, positions, KV
    slots and context lengths from the previous step's outputs `out` (pb sequences, pq rows
    each), its rows `sel` (default: all), written into the graph's static inputs."""
    has_drafts = len(out) > 2 and q > 1
    drafts = out[2] if has_drafts else out[1]  # (a stand-in of the same dtype: not read)
    w = min(drafts.shape[1], q - 1) if has_drafts else 0
    tables = meta.block_tables
    has_sel, qp = sel is not None, next_pow2(q, 1)
    has_cut = has_drafts and len(out) > 3
    has_ctx = has_cut and len(out) > 4
    pd = out[3] if has_cut else state  # (stand-ins: not read)
    ctx = out[4] if has_ctx else state
    _continue_launch((ids.device.index, has_sel, qp, tables.dtype, meta.seq_lens.dtype,
                      has_cut, has_ctx), (b,),
                     (out[0], out[1], drafts, sel if has_sel else state, state, tables, ids,
                      pos, meta.slot_mapping, meta.seq_lens, pd, ctx, b, pq, drafts.stride(0),
                      tables.stride(0), pd.stride(0), block_size, q, w, _log_cut(), has_sel,
                      qp, has_cut, has_ctx), num_warps=1)


def _log_cut() -> float:
    return float(np.log(CUT_PROB)) if CUT_PROB > 0 else -1e30


def kept_drafts(out: tuple, pb: int) -> torch.Tensor:
    """Per sequence of a step's outputs `out` (am, nacc, drafts, probabilities [drafts, b],
    context copy lengths if any), how many leading drafts the next step verifies: while the
    product of their probabilities (a copied draft's: 1) stays at least CUT_PROB. The torch
    ops of the continuation kernel's cut."""
    pd = out[3][:, :pb].float()
    lp = pd.clamp(min=0).log()
    cols = torch.arange(pd.shape[0], device=pd.device)[:, None]
    if len(out) > 4:
        lp = torch.where(cols < out[4][None, :pb], 0.0, lp)
    return (lp.cumsum(dim=0) >= _log_cut()).sum(dim=0)


def compile_continuation_variants(query_levels, block_size: int, device) -> None:
    """Compile `continue_inputs` for every variant a run can meet (each query level, with
    and without a row selection) now, not in the middle of serving."""
    if not (torch.device(device).type == "cuda" and triton_available()):
        return
    i64 = {"dtype": torch.int64, "device": device}
    f32 = {"dtype": torch.float32, "device": device}
    for q in query_levels:
        pd = torch.ones(max(q - 1, 1), 1, **f32)
        # the cut's variants (drafts' probabilities, context copy lengths) only where the
        # graphs captured now keep them (CUT_PROB > 0)
        extras = [(), (pd,), (pd, torch.zeros(1, **i64))] if CUT_PROB > 0 else [()]
        for sel in (None, torch.zeros(1, **i64)):
            for extra in extras:
                out = (torch.zeros(q, **i64), torch.zeros(1, **i64),
                       torch.zeros(1, max(q - 1, 1), **i64), *extra)
                meta = _Meta(torch.ones(1, 4, **i64), torch.zeros(q, **i64),
                             torch.zeros(1, **i64))
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
    # alignment, the kernel compiled anew mid-run (stalls of 0.5-1 s on the H200).
    _INTS = ["b", "pq", "d_stride", "t_stride", "p_stride", "bs", "q", "w"]
    _PTRS = ["GRID", "NACC", "DRAFTS", "SEL", "STATE", "TABLES", "IDS", "POS", "SLOTS", "LENS",
             "PD", "CTX"]
    _jit_params = inspect.signature(triton.jit).parameters
    _NO_SPECIALIZE = {k: v for k, v in (("do_not_specialize", _INTS),
                                        ("do_not_specialize_on_alignment", _INTS + _PTRS))
                      if k in _jit_params}

    @triton.jit(**_NO_SPECIALIZE)
    def _continue_kernel(GRID, NACC, DRAFTS, SEL, STATE, TABLES, IDS, POS, SLOTS, LENS, PD, CTX,
                         b, pq, d_stride, t_stride, p_stride, bs, q, w, log_cut,
                         HAS_SEL: tl.constexpr, Q: tl.constexpr, HAS_CUT: tl.constexpr,
                         HAS_CTX: tl.constexpr):
        """Program j: sequence j of the step, row SEL[j] of the previous one. HAS_CUT: its
        drafts end where the cumulative log-probability of the head's drafts (PD [drafts,
        p_stride]; the first CTX[src] copied from the context count 0) falls below log_cut."""
        j = tl.program_id(0)
        if HAS_SEL:
            src = tl.load(SEL + j).to(tl.int64)
        else:
            src = j.to(tl.int64)
        n = tl.load(NACC + src)
        kc = tl.load(STATE + b + j)
        lo = tl.load(STATE + j) + n + 1
        r = tl.arange(0, Q)
        if HAS_CUT:
            c = r - 1  # row r holds draft column r - 1
            has = (r >= 1) & (r <= w)
            lp = tl.log(tl.maximum(tl.load(PD + c * p_stride + src, mask=has, other=1.0), 0.0))
            if HAS_CTX:
                lp = tl.where(c < tl.load(CTX + src), 0.0, lp)
            cum = tl.cumsum(tl.where(has, lp, 0.0), 0)
            kc = tl.minimum(kc, tl.sum((has & (cum >= log_cut)).to(kc.dtype), 0))
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


def levels(n: int, dense_from: int | None = None) -> tuple[int, ...]:
    """1, 2, 4, ... below n, then n: the padded sizes graphs are captured for; from
    `dense_from` on, every second size (1, 2, 4, 6, 8 for n = 8 from 4)."""
    out, x = [], 1
    while x < n:
        out.append(x)
        x = x * 2 if dense_from is None or x < dense_from else x + 2
    return (*out, n)


def level_sets(k: int, dense_from: int | None, dense_min: int
               ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]],
                          tuple[tuple[int, ...], tuple[int, ...]]]:
    """((query levels, draft levels) below dense_min sequences, the same from dense_min on)
    of a fused step drafting up to k: doubling (`levels`), or from dense_from on every
    second size (`SpecConfig.dense_levels_from`) for every batch (dense_min 0) or for
    batches of dense_min sequences or more (`SpecConfig.dense_levels_min_batch`)."""
    dense = (levels(k + 1, dense_from), (0, *levels(k, dense_from)))
    if dense_from is None or dense_min <= 1:
        return dense, dense
    return (levels(k + 1), (0, *levels(k))), dense


def level_wanted(small, large, dense_min: int, d: int, q: int, lo: int, hi: int) -> bool:
    """Whether a batch of lo..hi sequences (a graph bucket's range) may run q verify rows in
    the graph set of d drafts, the levels below dense_min sequences `small`, from it `large`
    (`level_sets`): the graphs captured ahead of serving (any other is captured when first
    run)."""
    return ((lo < dense_min and q in small[0] and d in small[1])
            or (hi >= dense_min and q in large[0] and d in large[1]))


def pack_uniform(seqs, q: int, block_size: int) -> PackedInputs:
    """q rows per sequence: pending token, drafts, padding (KV slot -1, the last real position,
    context extended by the padding so causal offsets stay right)."""
    b = len(seqs)
    ids = np.zeros((b, q), dtype=np.int64)
    lo = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=b)
    k = np.fromiter((len(s.draft) for s in seqs), dtype=np.int64, count=b)
    for j, s in enumerate(seqs):
        ids[j, 0] = s.token_ids[s.num_computed]
        ids[j, 1 : k[j] + 1] = s.draft
    r = np.arange(q)
    real = r[None, :] <= k[:, None]
    pos = lo[:, None] + np.minimum(r[None, :], k[:, None])
    tab = table_array([s.block_table for s in seqs])
    slots = tab[np.arange(b)[:, None], pos // block_size] * block_size + pos % block_size
    slots = np.where(real, slots, -1)
    starts = np.arange(b + 1, dtype=np.int64) * q
    return PackedInputs(ids.reshape(-1), pos.reshape(-1), slots.reshape(-1), starts, lo + q,
                        tab, q)


def join_inputs(inp: PackedInputs, join, q: int, tab: np.ndarray,
                block_size: int) -> PackedInputs:
    """`inp` followed by q rows for each sequence of `join`, packed as `pack_uniform` packs
    them (pending token, drafts, padding), with `tab` the block tables of all of them."""
    if not join:
        return inp
    j = pack_uniform(join, q, block_size)
    cat = np.concatenate
    return PackedInputs(cat([inp.ids, j.ids]), cat([inp.pos, j.pos]), cat([inp.slots, j.slots]),
                        cat([inp.starts, j.starts[1:] + inp.starts[-1]]), cat([inp.lens, j.lens]),
                        tab, max(inp.max_query_len, q))


class FusedSteps:
    """The fused greedy step's graphs: one GraphSet per number of next drafts (a level of
    `levels(K)`, or 0: verify and keep the draft KV current, draft nothing)."""

    def __init__(self, model, head, kv_cache, aux_layers, cfg, max_batch: int, pool,
                 tokens: torch.Tensor | None = None):
        self.model, self.head, self.kv_cache = model, head, kv_cache
        self.tokens = tokens  # token ids by KV slot: drafts from the context (lookup.py)
        self.aux_layers, self.cfg = aux_layers, cfg
        self.max_batch, self.pool = max_batch, pool
        k = cfg.spec.num_tokens
        # (SpecConfig: dense levels off by default)
        self.dense_min = cfg.spec.dense_levels_min_batch
        self.small, self.large = level_sets(k, cfg.spec.dense_levels_from, self.dense_min)
        self.query_levels = tuple(sorted({*self.small[0], *self.large[0]}))
        self.draft_levels = tuple(sorted({*self.small[1], *self.large[1]}))
        # Padding rows may reach K positions past a sequence's last block: a few spare
        # block-table columns (zeros) keep those reads in bounds.
        self.max_blocks = cfg.max_blocks_per_seq + -(-(k + 1) // cfg.block_size)
        self.sets: dict[int, GraphSet] = {}

    def levels_at(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(query levels, draft levels) a fused step of this many sequences runs."""
        return self.large if batch >= self.dense_min else self.small

    def set_for(self, drafts: int, batch: int | None = None) -> GraphSet:
        """The graphs of the draft level for `drafts` next drafts at this batch size (None:
        the smallest level of any batch size that holds them)."""
        ds = self.draft_levels if batch is None else self.levels_at(batch)[1]
        d = next(x for x in ds if x >= drafts)
        if d not in self.sets:
            small, large, dense_min = self.small, self.large, self.dense_min
            self.sets[d] = GraphSet(
                self._fn(d), self.cfg.device, self.max_batch, self.query_levels,
                self.max_blocks, extras=((1, torch.int64),), pool=self.pool,
                wants=None if small == large else
                lambda q, lo, hi: level_wanted(small, large, dense_min, d, q, lo, hi))
        return self.sets[d]

    def all_sets(self) -> list[GraphSet]:
        return [self.set_for(d) for d in self.draft_levels]

    def warm_continuation(self) -> None:
        """Compile the continuation kernel's variants (`compile_continuation_variants`) now."""
        compile_continuation_variants(self.query_levels, self.cfg.block_size, self.cfg.device)

    def _fn(self, drafts: int):
        model, head, kv_cache, aux_layers = self.model, self.head, self.kv_cache, self.aux_layers
        kv, bs = kv_cache[self.cfg.model.num_layers], self.cfg.block_size
        tokens, spec = self.tokens, self.cfg.spec

        cut = CUT_PROB > 0

        def fn(ids, pos, meta, kn_rows):
            b = meta.seq_lens.shape[0]
            q = ids.shape[0] // b
            dev = ids.device
            if tokens is not None:
                store_tokens(tokens, ids, meta.slot_mapping)
            hidden, aux = model(ids, pos, kv_cache, meta, aux_layers)
            am = model.greedy(hidden)
            one = FUSED_ACCEPT and head.midlayer.fused  # the bookkeeping in one launch
            tried = cut and q > 1  # each sequence's drafts verified too: nacc [2, b]
            if one:
                nacc, hslots, start, bonus, last_rows, live, qs = accept(
                    am, ids, meta.slot_mapping, pos, meta.seq_lens, b, q, tried=tried)
            elif q == 1:
                # Nothing to verify (every K=0 step of a dynamic batch): no draft accepted,
                # and the head stores KV exactly where the target did. Eight small kernels
                # fewer than the general case below, which computes the same.
                nacc = torch.zeros(b, dtype=torch.int64, device=dev)
            else:
                nacc, hslots = accepted(am, ids, meta.slot_mapping, b, q)
                if tried:
                    nacc = torch.stack([nacc, verified(meta.slot_mapping, b, q)])
            counts, nacc = nacc, (nacc[0] if nacc.dim() == 2 else nacc)
            # The head's first step: row i reads the target's next token (the argmax) and the
            # fused features of row i; draft KV is stored for rows up to the last accepted.
            hmeta = meta if q == 1 else AttentionMetadata(
                slot_mapping=hslots, query_start=meta.query_start, seq_lens=meta.seq_lens,
                block_tables=meta.block_tables, max_query_len=q, max_seq_len=meta.max_seq_len)
            # (the target's next tokens' embeddings: looked up inside the head's first launch)
            emb, eids = ((model.embed_tokens.weight, am) if FOLD_CHAIN and head.midlayer.fused
                         else (model.embed_tokens(am), None))
            if drafts == 0:  # nothing to draft: only the draft KV the next steps attend to
                head.store_kv(emb, head.fuse(aux), pos, kv, hmeta, eids)
                return am, counts
            h = head(emb, head.fuse(aux), pos, kv, hmeta, eids)
            if one:
                last = h if q == 1 else h.index_select(0, last_rows)
            else:
                last = h.view(b, q, -1)[torch.arange(b, device=dev), nacc]
                # where the chain starts (and the sequence's known tokens end), who is live
                start, live = pos.view(b, q)[:, 0] + nacc + 1, meta.seq_lens > 0
            # the drafts' probabilities under the head, draft by draft: where the next
            # step's verify is cut (`continuation`)
            pd = torch.empty(drafts, b, dtype=torch.float32, device=dev) if cut else None
            t = head.greedy_tokens(last, pd[0] if cut else None)
            out = [t]
            if drafts > 1:
                if not one:
                    qs = torch.arange(b + 1, device=dev)
                out += chain_steps(head, model, kv, bs, meta.block_tables, t, last,
                                   kn_rows.view(b, q)[:, 0], start, live, qs,
                                   meta.max_seq_len, drafts - 1, pd)
            d = torch.stack(out, dim=1)
            lens = None
            if tokens is not None:
                # The sequence's tokens: positions up to the last accepted row are in the
                # store now, then the target's token after them.
                if not one:
                    bonus = am if q == 1 else am.view(b, q).gather(1, nacc[:, None])[:, 0]
                lens, got = lookup(tokens, meta.block_tables, bs, start, bonus, live, drafts,
                                   spec.ngram_max, spec.context_min_n,
                                   kernel=ids.is_cuda and triton_available())
                cols = torch.arange(drafts, device=dev)
                d = torch.where(cols[None, :] < lens[:, None], got, d)
            if not cut:
                return am, counts, d
            return (am, counts, d, pd) if lens is None else (am, counts, d, pd, lens)

        return fn


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


def verified(slots: torch.Tensor, b: int, q: int) -> torch.Tensor:
    """Drafts each sequence of a [b, q] grid verifies: its rows that store KV, less one."""
    return (slots.view(b, q) >= 0).sum(dim=1) - 1


def accept(am: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
           seq_lens: torch.Tensor, b: int, q: int, kernel: bool = True,
           tried: bool = False) -> tuple:
    """A fused step's verify bookkeeping for its [b, q] grid (argmax `am`, token `ids`, KV
    `slots`, positions `pos`, all [b * q]): per sequence the accepted drafts nacc (the
    prefix where draft i+1 equals the argmax at row i, on rows that store KV), then (nacc,
    the head's KV slots [b * q] (rows past the last accepted store nothing: -1), the chain's
    start position pos[row 0] + nacc + 1, the target's token after the accepted drafts
    am[nacc], that row's index in the step, live (seq_lens > 0), the chain's query starts
    0..b). `kernel`: one Triton launch (needs Triton; under its interpreter off CUDA), else
    the torch ops it replaces. tried: nacc is [2, b], the counts then each sequence's drafts
    verified (`verified`; two rows, so that a graph's outputs cut to its rows keep both)."""
    dev = ids.device
    if not kernel:
        nacc, hslots = accepted(am, ids, slots, b, q)
        return (torch.stack([nacc, verified(slots, b, q)]) if tried else nacc, hslots,
                pos.view(b, q)[:, 0] + nacc + 1,
                am.view(b, q).gather(1, nacc[:, None])[:, 0],
                torch.arange(b, device=dev) * q + nacc, seq_lens > 0,
                torch.arange(b + 1, device=dev))
    nacc = torch.empty((2, b) if tried else (b,), dtype=torch.int64, device=dev)
    start, bonus, last = (torch.empty(b, dtype=torch.int64, device=dev) for _ in range(3))
    hslots = torch.empty(b * q, dtype=torch.int64, device=dev)
    live = torch.empty(b, dtype=torch.bool, device=dev)
    qs = torch.empty(b + 1, dtype=torch.int64, device=dev)
    _accept_kernel[(1,)](am, ids, slots, pos, seq_lens, nacc, hslots, start, bonus, last, live,
                         qs, b, q, BLOCK_B=next_pow2(b + 1, 2), QP=next_pow2(q, 2),
                         TRIED=tried, num_warps=4)
    return nacc, hslots, start, bonus, last, live, qs


def chain_steps(head, model, kv, block_size: int, tables, t, h, k, start, has_queries,
                query_start, max_seq_len: int, steps: int, probs=None) -> list[torch.Tensor]:
    """`steps` chained greedy draft steps, one row per sequence, on the device: step s
    (1-based) embeds token t at position start + s - 1 with the previous step's state, and
    yields the next token. A sequence whose own k ends at step s stops writing KV (slot -1);
    padded sequences of a bucket (no queries) never write. probs ([steps + 1, b]): step s
    writes its drafts' probabilities to probs[s]."""
    outs = []
    fold = FOLD_CHAIN and head.midlayer.fused
    # each step's argmax inside its LM head (`Eagle3Head.chain_step`'s keys): the next
    # step's input norm decodes the tokens into ids, a last launch those of the last step
    keyed = fold and probs is None and head.fuses_argmax(t.shape[0])
    if fold:  # every step's positions, slots and lengths in one launch up front
        every = chain_positions(k, start, has_queries, tables, block_size, 1, True, steps,
                                keys=keyed)
    if keyed:
        ids = torch.empty(steps, t.shape[0], dtype=torch.int64, device=t.device)
    for s in range(1, steps + 1):
        p, slots, lens = (x[s - 1] for x in every[:3]) if fold else chain_positions(
            k, start, has_queries, tables, block_size, s, head.midlayer.fused)
        m = AttentionMetadata(slot_mapping=slots, query_start=query_start, seq_lens=lens,
                              block_tables=tables, max_query_len=1, max_seq_len=max_seq_len)
        pr = None if probs is None else probs[s]
        if keyed:
            h, keys = head.chain_step(model.embed_tokens.weight, t, h, p, kv, m,
                                      keys=every[3][s - 1])
            t = ops.Keyed(keys, head.d2t, ids[s - 1])
        elif fold:
            h, t = head.chain_step(model.embed_tokens.weight, t, h, p, kv, m, pr)
            outs.append(t)
        else:
            h = head(model.embed_tokens(t), h, p, kv, m)
            t = head.greedy_tokens(h, pr)
            outs.append(t)
    if keyed:
        ops.decode_keys(t.keys, head.d2t, out=ids[steps - 1])
        return list(ids.unbind(0))
    return outs


def chain_positions(k, start, has_queries, tables, block_size: int, s: int, kernel: bool,
                    steps: int | None = None, keys: bool = False):
    """Chained draft step s's (positions, KV slots, context lengths), one row per sequence:
    position start + s - 1 where the sequence's own k goes past s (else 0, slot -1 and the
    context of a padded row). `kernel` (the head's fused path, so Triton is there): in one
    Triton launch instead of about ten. steps: those of steps s .. s + steps - 1 at once,
    each [steps, b] (one launch, a program per step). keys (with kernel and steps): also a
    fourth [steps, b], every entry `ops.KEY_EMPTY` (each step's argmax keys)."""
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
                       b, q, BLOCK_B: tl.constexpr, QP: tl.constexpr, TRIED: tl.constexpr):
        """`accept` for all b sequences in one program ([BLOCK_B, QP] tiles of the grid);
        TRIED: NACC[b + i] = sequence i's drafts verified."""
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
        if TRIED:
            tl.store(NACC + b + r, tl.sum((ok & (slots >= 0)).to(tl.int64), 1) - 1, mask=rok)
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
