"""One graph per greedy speculative decode step.

A pure decode step of greedy EAGLE-3 requests (verify pending token and drafts, emit the
accepted ones, run the head, chain the next drafts) runs as one graph replay and one host sync,
since every data-dependent quantity stays on the device. Each sequence gets q rows (pending
token, drafts, then padding rows that store no KV), so the batch is a [B, q] grid; the result
equals the step-by-step path token for token. Sampled requests, prefill chunks and hand-offs
keep the step-by-step path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine import ops
from engine.attention import AttentionMetadata
from engine.attention.triton_backend import triton_available
from engine.graphs import GraphSet, PackedInputs, table_array
from engine.sequence import Sequence
from engine.spec.fused_kernels import (
    FusedOut,
    accept,
    accepted,
    chain_positions,
    compile_continuation_variants,
    continue_inputs,
)
from engine.spec.lookup import lookup, store_tokens


@dataclass
class FusedHandle:
    """A launched fused step: its sequences, drafts verified (kcur) and drafted next (kn),
    rows per sequence, its device outputs and the host copy being made of them."""

    seqs: list[Sequence]
    kcur: list[int]
    kn: list[int]
    q: int
    out: FusedOut
    flat: torch.Tensor
    fetch: object  # () -> list[int], waits for the copy
    continuable: bool = True  # blocks exist for the step after it

    def protect(self) -> None:
        """Own copies of the outputs the next step's continuation reads: before other graphs
        of the same memory pool replay between this step and that one (a prefill launched
        beside it, and the head's step after that prefill), whose scratch memory may be where
        this graph's outputs live."""
        self.out = self.out.clone()


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
        grid = rows(prev.out.argmax[: pb * pq].view(pb, pq))
        nacc = rows(prev.out.accepted[:pb])
        lo = state[:b] + nacc + 1
        kc = state[b:]
        r = torch.arange(q, device=ids.device)
        new_ids = torch.zeros(b, q, dtype=ids.dtype, device=ids.device)
        new_ids[:, 0] = grid.gather(1, nacc[:, None])[:, 0]
        if prev.out.drafts is not None and q > 1:
            d = rows(prev.out.drafts[:pb])
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

        def fn(ids, pos, meta, kn_rows):
            b = meta.seq_lens.shape[0]
            q = ids.shape[0] // b
            dev = ids.device
            if tokens is not None:
                store_tokens(tokens, ids, meta.slot_mapping)
            hidden, aux = model(ids, pos, kv_cache, meta, aux_layers)
            am = model.greedy(hidden)
            # The head's fused path: the verify's bookkeeping in one launch (`accept`), and
            # the next tokens' embeddings looked up inside the head's first launch.
            one = head.midlayer.fused
            if one:
                nacc, hslots, start, bonus, last_rows, live, qs = accept(
                    am, ids, meta.slot_mapping, pos, meta.seq_lens, b, q)
            elif q == 1:
                # Nothing to verify (every K=0 step of a dynamic batch): no draft accepted,
                # and the head stores KV exactly where the target did.
                nacc = torch.zeros(b, dtype=torch.int64, device=dev)
            else:
                nacc, hslots = accepted(am, ids, meta.slot_mapping, b, q)
            # The head's first step: row i reads the target's next token (the argmax) and the
            # fused features of row i; draft KV is stored for rows up to the last accepted.
            hmeta = meta if q == 1 else AttentionMetadata(
                slot_mapping=hslots, query_start=meta.query_start, seq_lens=meta.seq_lens,
                block_tables=meta.block_tables, max_query_len=q, max_seq_len=meta.max_seq_len)
            emb, eids = ((model.embed_tokens.weight, am) if one
                         else (model.embed_tokens(am), None))
            if drafts == 0:  # nothing to draft: only the draft KV the next steps attend to
                head.store_kv(emb, head.fuse(aux), pos, kv, hmeta, eids)
                return am, nacc
            h = head(emb, head.fuse(aux), pos, kv, hmeta, eids)
            if one:
                last = h if q == 1 else h.index_select(0, last_rows)
            else:
                last = h.view(b, q, -1)[torch.arange(b, device=dev), nacc]
                # where the chain starts (and the sequence's known tokens end), who is live
                start, live = pos.view(b, q)[:, 0] + nacc + 1, meta.seq_lens > 0
            t = head.greedy_tokens(last)
            out = [t]
            if drafts > 1:
                if not one:
                    qs = torch.arange(b + 1, device=dev)
                out += chain_steps(head, model, kv, bs, meta.block_tables, t, last,
                                   kn_rows.view(b, q)[:, 0], start, live, qs,
                                   meta.max_seq_len, drafts - 1)
            d = torch.stack(out, dim=1)
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
            return am, nacc, d

        return fn


def chain_steps(head, model, kv, block_size: int, tables, t, h, k, start, has_queries,
                query_start, max_seq_len: int, steps: int) -> list[torch.Tensor]:
    """`steps` chained greedy draft steps, one row per sequence, on the device: step s
    (1-based) embeds token t at position start + s - 1 with the previous step's state, and
    yields the next token. A sequence whose own k ends at step s stops writing KV (slot -1);
    padded sequences of a bucket (no queries) never write."""
    outs = []
    fold = head.midlayer.fused
    # each step's argmax inside its LM head (`Eagle3Head.chain_step`'s keys): the next
    # step's input norm decodes the tokens into ids, a last launch those of the last step
    keyed = fold and head.fuses_argmax(t.shape[0])
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
        if keyed:
            h, keys = head.chain_step(model.embed_tokens.weight, t, h, p, kv, m,
                                      keys=every[3][s - 1])
            t = ops.Keyed(keys, head.d2t, ids[s - 1])
        elif fold:
            h, t = head.chain_step(model.embed_tokens.weight, t, h, p, kv, m)
            outs.append(t)
        else:
            h = head(model.embed_tokens(t), h, p, kv, m)
            t = head.greedy_tokens(h)
            outs.append(t)
    if keyed:
        ops.decode_keys(t.keys, head.d2t, out=ids[steps - 1])
        return list(ids.unbind(0))
    return outs
