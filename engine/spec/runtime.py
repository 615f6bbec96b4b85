"""Speculation inside the engine step: verify the drafts a forward just checked, then propose
the next ones (EAGLE-3 head over the target's hidden states, or n-gram lookup)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig
from engine.graphs import (
    GraphSet,
    HostStager,
    PackedInputs,
    TableRows,
    pack,
    pack_next,
    to_device,
)
from engine.model import LlamaModel
from engine.runner import prefill_graph_set
from engine.sampler import processed_probs, sample_from
from engine.sequence import Sequence
from engine.spec.eagle3 import Eagle3Head
from engine.spec.fused import (
    FusedHandle,
    FusedOut,
    FusedSteps,
    chain_steps,
    continuation,
    join_inputs,
    pack_uniform,
)
from engine.spec.ngram import NgramDrafter
from engine.spec.policy import KPolicy
from engine.spec.stats import SpecStats
from engine.spec.verify import VerifyResult


@dataclass
class Span:
    """Positions [lo, lo+m) of `seq` computed by the last forward whose next token is known,
    starting at packed row `row`; `draft` says whether to propose tokens after them."""

    seq: Sequence
    lo: int
    m: int
    row: int
    draft: bool


class SpecRunner:
    """Proposes drafts for the sequences of a finished step."""

    def __init__(self, cfg: EngineConfig, model: LlamaModel, kv_cache: torch.Tensor,
                 head: Eagle3Head | None, tokens: torch.Tensor | None = None):
        assert cfg.spec is not None
        self.cfg, self.spec, self.model, self.head = cfg, cfg.spec, model, head
        # Token ids by KV slot: drafting from the context on the device (lookup.py).
        self.tokens = tokens if head is not None else None
        self.kv_cache = kv_cache
        self.kv = kv_cache[cfg.model.num_layers] if head is not None else None
        self.ngram = NgramDrafter(cfg.spec.ngram_max, cfg.spec.ngram_min) \
            if cfg.spec.method == "ngram" else None
        # The host side of context drafts: an incremental index per sequence.
        self.context = NgramDrafter(cfg.spec.ngram_max, cfg.spec.context_min_n) \
            if self.tokens is not None else None
        self.policy = KPolicy(cfg.spec)
        self.stats = SpecStats(cfg.spec.num_tokens)
        self.stager = HostStager(cfg.device, 1 << 12)
        self.graphs: GraphSet | None = None
        self.first_graphs: GraphSet | None = None
        self.prefill_graphs: GraphSet | None = None  # the first step over prompt chunks
        self.chain_graphs: dict[int, GraphSet] = {}
        self.fused: FusedSteps | None = None
        self.fused_runs = 0  # steps that ran as one fused graph
        self.overlapped_runs = 0  # of those, launched from the previous step's device outputs
        self.known_continuations = 0  # of those, at K=0 with positions known on the host
        self.compacted_runs = 0  # of those, leaving out requests that finished meanwhile
        self.joined_runs = 0  # of those, taking in sequences prefilled beside the last
        self._tables = TableRows()  # the continuations' block tables, row by row

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.cfg.aux_layer_ids if self.head is not None else ()

    def release(self, seq: Sequence) -> None:
        for drafter in (self.ngram, self.context):
            if drafter is not None:
                drafter.release(seq.request_id)

    def propose(self, spans: list[Span], aux: list[torch.Tensor], blocks, batch_size: int,
                generators: dict[str, torch.Generator]) -> None:
        """Set seq.draft (and seq.draft_q when sampled) for every span that asks for drafts."""
        ks = [self._k(s, blocks, batch_size) if s.draft else 0 for s in spans]
        if self.ngram is not None:
            for s, k in zip(spans, ks):
                if k:
                    s.seq.draft = self.ngram.propose(s.seq.token_ids, k, s.seq.request_id)
        elif spans:
            self._eagle(spans, aux, ks, generators)
            self._from_context(s.seq for s in spans)

    def _from_context(self, seqs) -> None:
        """`SpecConfig.context_drafts` on the host (the fused step does it on the device): a
        greedy sequence whose suffix has an earlier copy drafts what followed it (continued
        as a loop where the copy reaches the present: all its drafts) instead of the head's."""
        if self.context is None:
            return
        for seq in seqs:
            if seq.draft and seq.params.greedy:
                got = self.context.propose(seq.token_ids, len(seq.draft), seq.request_id)
                if got:
                    seq.draft = got + seq.draft[len(got):]

    def _k(self, span: Span, blocks, batch_size: int) -> int:
        """K for this sequence, capped by what it may still emit and by free KV blocks."""
        return self._k_for(span.seq, span.lo + span.m + 1, blocks, batch_size) or 0

    def _k_for(self, seq: Sequence, need: int, blocks, batch_size: int,
               want: int | None = None) -> int | None:
        """K for `seq` whose pending token will be its token number `need` (`want`, or the
        policy's choice): capped by what it may still emit after that token and by free KV
        blocks. Grows the blocks for the pending token and the drafts; None if not even the
        pending token fits."""
        if not blocks.can_grow(seq, need):
            return None
        blocks.grow(seq, need)
        k = self._cap(seq, need, self.policy.choose(seq, batch_size) if want is None else want)
        while k and not blocks.can_grow(seq, need + k):
            k -= 1
        if k:
            blocks.grow(seq, need + k)
        return k

    def _cap(self, seq: Sequence, need: int, k: int) -> int:
        """k drafts capped by what `seq` may still emit after its pending token (token number
        `need`): each verify of k drafts emits k + 1 tokens, within its length limit; and by
        the request's own draft limit."""
        left = seq.length_limit(self.cfg.max_model_len) - need - 1
        k = min(k, left) if left > 0 else 0
        return k if seq.max_draft is None else min(k, seq.max_draft)

    def _ks_for(self, seqs, needs: list[int], blocks, want: int | None) -> list[int | None]:
        """`_k_for` over a batch (seqs[i]'s pending token will be token number needs[i]):
        None for a sequence whose pending token does not fit. A batch given one K (`want`,
        what the fused step's batch policy says) takes its caps and, when the blocks for
        every pending token and its drafts fit together, one check of the total and the
        grows instead of the per-sequence checks (at K=0 a quarter of the host's step at 64
        streams; at K=1 ~10%). Otherwise, or without `want`, sequence by sequence."""
        if want is not None:
            ks = [self._cap(s, n, want) for s, n in zip(seqs, needs)] if want else \
                [0] * len(seqs)
            if blocks.grow_all(seqs, [n + k for n, k in zip(needs, ks)]):
                return ks
        return [self._k_for(s, n, blocks, len(seqs), want) for s, n in zip(seqs, needs)]

    def fused_launch(self, batch, blocks, step: int, capture=None) -> FusedHandle | None:
        """Launch a fused step from the host's view of the batch; read it with
        `fused_finish`. None when the batch must take the step-by-step path."""
        f = self.fused
        if f is None or capture is not None:
            return None
        seqs = batch.seqs
        if not all(s.greedy_decode(n) for s, n in zip(seqs, batch.num_tokens)):
            return None
        if len(seqs) > f.max_batch or max(len(s.block_table) for s in seqs) > f.max_blocks:
            return None
        kcur = [len(s.draft) for s in seqs]
        # Next drafts are chosen before this step's acceptance is known (a one-step lag): the
        # pending token after this step is at most token len + k + 1.
        self.policy.begin_propose(step, len(seqs))
        want = self.policy.choose_batch(seqs, len(seqs))
        kn = self._ks_for(seqs, [len(s) + k + 1 for s, k in zip(seqs, kcur)], blocks, want)
        q = next(x for x in f.levels_at(len(seqs))[0] if x > max(kcur))
        inp = pack_uniform(seqs, q, self.cfg.block_size)
        h = self._launch(seqs, kcur, [k or 0 for k in kn], q, inp, None)
        h.continuable = None not in kn  # the next step's pending tokens have their blocks
        return h

    def fused_continue(self, prev: FusedHandle, blocks, step: int,
                       keep: list[int] | None = None, join=()) -> FusedHandle | None:
        """Launch the step after `prev` before reading it: the pending tokens, drafts,
        positions and KV slots come from prev's outputs on the device, so the host's work
        on prev's results overlaps this step's. K for the step after is chosen now (a
        two-step lag) and capped as if prev and this step accept everything. `keep`: only
        these of prev's rows continue (the others' requests finished meanwhile). `join`:
        sequences prefilled beside prev, whose pending token and drafts the host knows,
        take rows after prev's (packed as `fused_launch` packs them)."""
        f = self.fused
        rows = range(len(prev.seqs)) if keep is None else keep
        old = [prev.seqs[i] for i in rows]
        seqs = old + list(join)
        if not prev.continuable or max(len(s.block_table) for s in seqs) > f.max_blocks:
            return None
        kprev = [prev.kcur[i] for i in rows]
        kcur = [prev.kn[i] for i in rows] + [len(s.draft) for s in join]
        self.policy.begin_propose(step, len(seqs))
        want = self.policy.choose_batch(seqs, len(seqs))
        # This step's tokens were given blocks when prev chose its drafts (or, joining, when
        # the drafts were proposed); the pending token after it and the drafts it makes get
        # theirs now (none free: drain instead).
        needs = [len(s) + kp + kc + 2 for s, kp, kc in zip(old, kprev, kcur)] + \
            [len(s) + len(s.draft) + 1 for s in join]
        kn = self._ks_for(seqs, needs, blocks, want)
        if None in kn or max(len(s.block_table) for s in seqs) > f.max_blocks:
            return None
        q = next(x for x in f.levels_at(len(seqs))[0] if x > max(kcur))
        b, bs = len(old), self.cfg.block_size
        tab = self._tables([s.block_table for s in seqs])
        sel = None if keep is None else self.stager.index(keep)
        self.overlapped_runs += 1
        self.compacted_runs += keep is not None
        self.joined_runs += bool(join)
        if q == 1 and prev.q == 1:
            # Nothing verified by prev and nothing to verify now (a batch at K=0): prev
            # emits exactly one token, so every position is known here, as in a plain
            # decode; only the token ids come from prev's outputs.
            self.known_continuations += 1
            inp = join_inputs(pack_next(old, tab[:b], bs), join, q, tab, bs)
            return self._launch(seqs, kcur, kn, q, inp, prev, known=True, sel=sel, cont_rows=b)
        # Host part: block tables and query starts; the rest is a placeholder the device
        # overwrites. Context upper bound: every draft of prev accepted.
        bound = np.fromiter((len(s) + kp + q for s, kp in zip(old, kprev)), np.int64, b)
        inp = PackedInputs(np.zeros(b * q, np.int64), np.zeros(b * q, np.int64),
                           np.full(b * q, -1, np.int64), np.arange(b + 1, dtype=np.int64) * q,
                           bound, tab[:b], q)
        return self._launch(seqs, kcur, kn, q, join_inputs(inp, join, q, tab, bs), prev,
                            sel=sel, cont_rows=b)

    def _launch(self, seqs, kcur, kn, q, inp, prev: FusedHandle | None,
                known: bool = False, sel: torch.Tensor | None = None,
                cont_rows: int | None = None) -> FusedHandle:
        """Replay the fused step for inp; after `prev`, the device-side inputs of its first
        `cont_rows` rows (default all) come from prev's outputs (its rows `sel`, default
        all): all of them (`continuation`), or only the token ids when the host knew the
        rest (`known`: prev and this step are one row per sequence). Rows after those
        (sequences joining) keep what the host packed."""
        b = len(seqs)
        c = b if cont_rows is None else cont_rows
        cont, drafting = not known and prev is not None, any(kn)
        prepare = None
        if known:
            def prepare(ids, pos, meta):
                prev_ids = prev.out.argmax[: len(prev.seqs)]
                ids[:c].copy_(prev_ids if sel is None else prev_ids[sel])
        # One copy to the device for the continuation's state (num_computed per continued
        # sequence, then its draft count this step) and the draft count per row, which a
        # step drafting nothing never reads.
        parts = []
        if cont:
            parts += [np.fromiter((s.num_computed for s in seqs[:c]), np.int64, c),
                      np.asarray(kcur[:c], dtype=np.int64)]
        if drafting:
            rows = np.zeros(b * q, dtype=np.int64)
            rows[::q] = kn
            parts.append(rows)
        dev = self.stager.to_device(np.concatenate(parts)) if parts else None
        if cont:
            prepare = continuation(prev, dev[: 2 * c], c, q, self.cfg.block_size, sel)
        extras = (dev[-b * q:][:, None],) if drafting else ()
        out = FusedOut(*self.fused.set_for(max(kn), len(seqs)).run(inp, extras, prepare))
        self.fused_runs += 1
        # Outputs live in the graph pool, which the next replay overwrites: the host reads a
        # copy, and a continuation reads this step's outputs before its own replay. A step
        # that verified and drafted nothing (K=0) accepted nothing: only its tokens are read.
        if q == 1 and out.drafts is None:
            flat = out.argmax
        else:
            flat = torch.cat([out.argmax, out.accepted[:b]] +
                             ([out.drafts[:b].reshape(-1)] if out.drafts is not None else []))
        return FusedHandle(seqs, kcur, kn, q, out, flat, self.stager.fetch(flat))

    def fused_finish(self, h: FusedHandle):
        """Wait for a launched fused step; ({entry: (k, VerifyResult)}, {entry: drafts})."""
        flat = h.fetch()
        b, q, kcur, kn = len(h.seqs), h.q, h.kcur, h.kn
        grid = flat[: b * q]
        head = b * q + b  # where the drafts start
        if len(flat) == b * q:  # a K=0 step: its tokens only (`_launch`)
            nacc, width = [0] * b, 0
        else:
            nacc, width = flat[b * q : head], (len(flat) - head) // b
        results, drafts = {}, {}
        for j in range(b):
            n = nacc[j]
            results[j] = (kcur[j], VerifyResult(grid[j * q : j * q + n + 1], n))
            d0 = head + j * width
            drafts[j] = flat[d0 : d0 + kn[j]]
        return results, drafts

    def enable_graphs(self, max_batch: int) -> None:
        """Graphs for the head: its first step over each span (per longest span), one chained
        draft step (sampled requests), and whole greedy chains (`_chain_graph`)."""
        if self.head is None:
            return
        head, model, kv = self.head, self.model, self.kv
        if head.midlayer.prologue_rows and model.prologue_linears:
            # The head's layer takes the GEMVs at the row counts the target's calibration
            # chose (shapes alike: a layer of the target's width), and its stacked weights
            # exist before any capture.
            head.midlayer.prologue_rows = model.prologue_rows
        head.midlayer.merged_weights()

        def fn(ids, pos, meta, toks, hidden):
            out = head(model.embed_tokens(toks[:, 0]), hidden, pos, kv, meta)
            return out, head.greedy_tokens(out)

        def first(ids, pos, meta, hidden):
            return (head(model.embed_tokens(ids), hidden, pos, kv, meta),)

        max_blocks = self.cfg.max_blocks_per_seq
        width, dt = head.cfg.hidden_size, self.cfg.dtype
        self.graphs = GraphSet(fn, self.cfg.device, max_batch, (1,), max_blocks,
                               extras=((1, torch.int64), (width, dt)))
        self.first_graphs = GraphSet(first, self.cfg.device, max_batch,
                                     range(1, self.spec.num_tokens + 2), max_blocks,
                                     extras=((width, dt),), pool=self.graphs.pool)
        # The head over prompt chunks, padded up to the target's captured chunk lengths:
        # under steady load a new arrival's chunk comes nearly every step, and run eagerly
        # its head step would launch every kernel of the layer from Python.
        self.prefill_graphs = prefill_graph_set(first, self.cfg.device, max_batch,
                                                self.spec.num_tokens + 1, max_blocks,
                                                extras=((width, dt),), pool=self.graphs.pool)
        if self.spec.fused_step and self.spec.num_tokens:
            self.fused = FusedSteps(model, head, self.kv_cache, self.aux_layers, self.cfg,
                                    max_batch, self.graphs.pool, self.tokens)
            self.policy.levels = self.fused.small
            if self.fused.small != self.fused.large:
                self.policy.levels_at = self.fused.levels_at

    def _chain_graph(self, steps: int) -> GraphSet:
        """One graph for `steps` chained greedy draft steps of every sequence in a bucket:
        positions, KV slots and context lengths of step s are computed on the device from step
        1's, and a sequence whose own K ends earlier stops writing KV (slot -1)."""
        if steps in self.chain_graphs:
            return self.chain_graphs[steps]
        head, model, kv, bs = self.head, self.model, self.kv, self.cfg.block_size

        def fn(ids, pos, meta, toks, hidden, kvec):
            outs = chain_steps(head, model, kv, bs, meta.block_tables, toks[:, 0], hidden,
                               kvec[:, 0], pos, meta.seq_lens > 0, meta.query_start,
                               meta.max_seq_len, steps)
            return (torch.stack(outs, dim=1),)

        g = GraphSet(fn, self.cfg.device, self.graphs.max_batch, (1,), self.graphs.max_blocks,
                     extras=((1, torch.int64), (self.head.cfg.hidden_size, self.cfg.dtype),
                             (1, torch.int64)), pool=self.graphs.pool)
        self.chain_graphs[steps] = g
        return g

    @torch.inference_mode()
    def _eagle(self, spans: list[Span], aux: list[torch.Tensor], ks: list[int],
               generators: dict[str, torch.Generator]) -> None:
        """Draft k_i tokens for each span with the head, keeping tokens on the device: the
        whole chain costs one host sync, at the end."""
        head, idx = self.head, self.stager.index
        rows = idx([r for s in spans for r in range(s.row, s.row + s.m)])
        fused = head.fuse([a[rows] for a in aux])
        toks = [t for s in spans for t in s.seq.token_ids[s.lo + 1 : s.lo + s.m + 1]]
        pos = [p for s in spans for p in range(s.lo, s.lo + s.m)]
        out = self._step(spans, [s.m for s in spans], toks, pos, fused)
        ends = list(itertools.accumulate(s.m for s in spans))
        for i, s in enumerate(spans):
            if s.seq.hold and s.seq.finished:  # a hand-off ships the state drafting resumes from
                s.seq.draft_hidden = out[ends[i] - 1].clone()
        live = [i for i, k in enumerate(ks) if k]
        if not live:
            return
        self._chain(spans, live, ks, out[idx([ends[i] - 1 for i in live])], generators)

    @torch.inference_mode()
    def draft_from_hidden(self, seq: Sequence, hidden: torch.Tensor, blocks, batch_size: int,
                          generators: dict[str, torch.Generator]) -> None:
        """Decode role: draft for a handed-off request from the head's hidden state at its last
        computed position (its draft-layer KV came with the blocks)."""
        if self.head is None:
            return
        span = Span(seq, seq.num_computed - 1, 1, 0, draft=True)
        k = self._k(span, blocks, batch_size)
        if k:
            h = hidden.to(device=self.cfg.device, dtype=self.cfg.dtype)[None]
            self._chain([span], [0], [k], h, generators)
            self._from_context([seq])

    def _chain(self, spans: list[Span], live: list[int], ks: list[int], h: torch.Tensor,
               generators: dict[str, torch.Generator]) -> None:
        """From the head's hidden state `h` of each live span's last position, draft ks[i]
        tokens, chaining one-token head steps."""
        head, idx = self.head, self.stager.index
        tok = head.greedy_tokens(h)
        if self.graphs is not None and all(spans[i].seq.params.greedy for i in live):
            kmax = max(ks[i] for i in live)
            if kmax > 1 and self._chain_in_one_graph(spans, live, ks, kmax, tok, h):
                return
        steps: list[tuple[list[int], torch.Tensor]] = []
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        step = 0
        while True:
            tok = self._sample_drafts(spans, live, h, tok, qs, generators)
            # A graph's outputs live in its pool and the next replay overwrites them: keep a copy.
            steps.append((live, tok.clone()))
            keep = [j for j, i in enumerate(live) if step + 1 < ks[i]]
            if not keep:
                break
            if len(keep) < len(live):
                sel = idx(keep)
                tok, h = tok[sel], h[sel]
            live = [live[j] for j in keep]
            step += 1
            h, tok = self._chain_step([spans[i] for i in live], step, tok, h)
        flat = torch.cat([t for _, t in steps]).tolist()  # the one sync
        drafts: dict[int, list[int]] = {i: [] for i in steps[0][0]}
        it = iter(flat)
        for lv, _ in steps:
            for i in lv:
                drafts[i].append(next(it))
        for i, d in drafts.items():
            seq = spans[i].seq
            seq.draft = d
            seq.draft_q = torch.stack(qs[i]) if qs[i] else None

    def _chain_in_one_graph(self, spans, live, ks, kmax, tok, h) -> bool:
        """Greedy drafting of every live span in one graph replay; False if no graph fits."""
        sel = [spans[i] for i in live]
        inp = pack([0] * len(sel), [s.lo + s.m for s in sel], [s.seq.block_table for s in sel],
                   [1] * len(sel), self.cfg.block_size)
        g = self._chain_graph(kmax - 1)
        if not g.supports(inp):
            return False
        kvec = self.stager.index([ks[i] for i in live])
        (rest,) = g.run(inp, (tok[:, None], h, kvec[:, None]))
        rows = torch.cat([tok[:, None], rest], dim=1).tolist()  # the one sync
        for i, row in zip(live, rows):
            spans[i].seq.draft = row[: ks[i]]
            spans[i].seq.draft_q = None
        return True

    def _sample_drafts(self, spans, live, h, greedy_tok, qs, generators) -> torch.Tensor:
        """Greedy requests keep the head's argmax; sampled ones draw from q (kept for
        verification), written into the same device tensor."""
        sampled = [j for j, i in enumerate(live) if not spans[i].seq.params.greedy]
        if not sampled:
            return greedy_tok
        tok = greedy_tok.clone()
        logits = self.head.full_vocab_logits(h[self.stager.index(sampled)])
        for r, j in enumerate(sampled):
            seq = spans[live[j]].seq
            q = processed_probs(logits[r : r + 1], seq.params)
            tok[j : j + 1] = sample_from(q, generators[seq.request_id])
            qs[live[j]].append(q[0])
        return tok

    def _chain_step(self, spans: list[Span], step: int, tok: torch.Tensor, h: torch.Tensor):
        """Draft step `step` (>= 1): one token per span, from the device tokens just drafted."""
        bs = self.cfg.block_size
        pos = [s.lo + s.m - 1 + step for s in spans]
        inp = pack([0] * len(spans), pos, [s.seq.block_table for s in spans],
                   [1] * len(spans), bs)
        if self.graphs is not None and self.graphs.supports(inp):
            return self.graphs.run(inp, (tok[:, None], h))
        _, p, meta = to_device(inp, self.stager)
        out = self.head(self.model.embed_tokens(tok), h.to(self.cfg.dtype), p, self.kv, meta)
        return out, self.head.greedy_tokens(out)

    def _step(self, spans: list[Span], lens: list[int], toks: list[int], pos: list[int],
              hidden: torch.Tensor) -> torch.Tensor:
        """One head forward: `lens[i]` tokens of span i at positions `pos`, into the draft
        layer's KV slot."""
        inp = pack(toks, pos, [s.seq.block_table for s in spans], lens, self.cfg.block_size)
        g = next((g for g in (self.first_graphs, self.prefill_graphs)
                  if g is not None and g.supports(inp)), None)
        if g is not None:
            return g.run(inp, (hidden,))[0]
        pre = self.prefill_graphs
        if pre is not None and pre.supports_split(inp):  # more spans than a chunk holds
            return pre.run_split(inp, (hidden,))[0]
        ids, p, meta = to_device(inp, self.stager)
        embeds = self.model.embed_tokens(ids)
        return self.head(embeds, hidden.to(embeds.dtype), p, self.kv, meta)

