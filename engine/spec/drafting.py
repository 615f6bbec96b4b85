"""Step-by-step drafting with the EAGLE-3 head: its first step over the spans a forward just
computed, then chained one-token steps (or a whole greedy chain in one graph replay), keeping
tokens on the device so that a chain costs one host sync."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.graphs import GraphSet, pack, to_device
from engine.model import LlamaModel
from engine.runner import prefill_graph_set
from engine.sampler import gumbel_tokens, processed_probs, sample_from
from engine.sequence import Sequence
from engine.spec.eagle3 import Eagle3Head
from engine.spec.fused import chain_steps
from engine.staging import HostStager


@dataclass
class Span:
    """Positions [lo, lo+m) of `seq` computed by the last forward whose next token is known,
    starting at packed row `row`; `draft` says whether to propose tokens after them."""

    seq: Sequence
    lo: int
    m: int
    row: int
    draft: bool


class HeadDrafter:
    """Drafts with the head over its own KV layer, through captured graphs where they fit."""

    def __init__(self, cfg: EngineConfig, model: LlamaModel, head: Eagle3Head,
                 kv: torch.Tensor, stager: HostStager):
        self.cfg, self.model, self.head, self.kv, self.stager = cfg, model, head, kv, stager
        self.graphs: GraphSet | None = None
        self.first_graphs: GraphSet | None = None
        self.prefill_graphs: GraphSet | None = None  # the first step over prompt chunks
        self.chain_graphs: dict[int, GraphSet] = {}

    def enable_graphs(self, max_batch: int) -> None:
        """Graphs for the head: its first step over each span (per longest span), one chained
        draft step (sampled requests), and whole greedy chains (`chain_graph`)."""
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

        k, max_blocks = self.cfg.spec.num_tokens, self.cfg.max_blocks_per_seq
        width, dt = head.cfg.hidden_size, self.cfg.dtype
        self.graphs = GraphSet(fn, self.cfg.device, max_batch, (1,), max_blocks,
                               extras=((1, torch.int64), (width, dt)))
        self.first_graphs = GraphSet(first, self.cfg.device, max_batch, range(1, k + 2),
                                     max_blocks, extras=((width, dt),), pool=self.graphs.pool)
        # The head over prompt chunks, padded up to the target's captured chunk lengths:
        # under steady load a new arrival's chunk comes nearly every step, and run eagerly
        # its head step would launch every kernel of the layer from Python.
        self.prefill_graphs = prefill_graph_set(first, self.cfg.device, max_batch, k + 1,
                                                max_blocks, extras=((width, dt),),
                                                pool=self.graphs.pool)

    def chain_graph(self, steps: int) -> GraphSet:
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
    def draft(self, spans: list[Span], aux: list[torch.Tensor], ks: list[int],
              generators: dict[str, torch.Generator]) -> None:
        """Draft k_i tokens for each span with the head, keeping tokens on the device: the
        whole chain costs one host sync, at the end."""
        head, idx = self.head, self.stager.index
        rows = idx([r for s in spans for r in range(s.row, s.row + s.m)])
        fused = head.fuse([a[rows] for a in aux])
        toks = [t for s in spans for t in s.seq.token_ids[s.lo + 1 : s.lo + s.m + 1]]
        pos = [p for s in spans for p in range(s.lo, s.lo + s.m)]
        out = self.forward(spans, [s.m for s in spans], toks, pos, fused)
        ends = list(itertools.accumulate(s.m for s in spans))
        for i, s in enumerate(spans):
            if s.seq.hold and s.seq.finished:  # a hand-off ships the state drafting resumes from
                s.seq.draft_hidden = out[ends[i] - 1].clone()
        live = [i for i, k in enumerate(ks) if k]
        if not live:
            return
        self.chain(spans, live, ks, out[idx([ends[i] - 1 for i in live])], generators)

    def chain(self, spans: list[Span], live: list[int], ks: list[int], h: torch.Tensor,
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
            tok = self._sample_drafts(spans, live, h, tok, qs, generators, step)
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
        g = self.chain_graph(kmax - 1)
        if not g.supports(inp):
            return False
        kvec = self.stager.index([ks[i] for i in live])
        (rest,) = g.run(inp, (tok[:, None], h, kvec[:, None]))
        rows = torch.cat([tok[:, None], rest], dim=1).tolist()  # the one sync
        for i, row in zip(live, rows):
            spans[i].seq.draft = row[: ks[i]]
            spans[i].seq.draft_q = None
        return True

    def _sample_drafts(self, spans, live, h, greedy_tok, qs, generators,
                       step: int) -> torch.Tensor:
        """Greedy requests keep the head's argmax; sampled ones draw from q (kept for
        verification), written into the same device tensor. In the deterministic mode they draw
        with the noise the target's draw at the same index uses (verification then accepts a
        draft iff it equals the target's token, and shared noise makes that likelier)."""
        sampled = [j for j, i in enumerate(live) if not spans[i].seq.params.greedy]
        if not sampled:
            return greedy_tok
        tok = greedy_tok.clone()
        logits = self.head.full_vocab_logits(h[self.stager.index(sampled)])
        for r, j in enumerate(sampled):
            s = spans[live[j]]
            seq, g = s.seq, generators[s.seq.request_id]
            if self.cfg.deterministic:  # this step drafts the token at index lo + m + 1 + step
                tok[j : j + 1] = gumbel_tokens(logits[r : r + 1], seq.params, g.initial_seed(),
                                               s.lo + s.m + 1 + step)
                continue
            q = processed_probs(logits[r : r + 1], seq.params)
            tok[j : j + 1] = sample_from(q, g)
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

    def forward(self, spans: list[Span], lens: list[int], toks: list[int], pos: list[int],
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
