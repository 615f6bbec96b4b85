"""Speculation inside the engine step: verify the drafts a forward just checked, then propose
the next ones (EAGLE-3 head over the target's hidden states, or n-gram lookup)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.model import LlamaModel
from engine.sampler import processed_probs, sample_from
from engine.sequence import Sequence
from engine.spec.eagle3 import Eagle3Head
from engine.spec.ngram import NgramDrafter
from engine.spec.policy import KPolicy
from engine.spec.verify import VerifyResult, verify_greedy, verify_sampled


@dataclass
class Span:
    """Positions [lo, lo+m) of `seq` computed by the last forward whose next token is known,
    starting at packed row `row`; `draft` says whether to propose tokens after them."""

    seq: Sequence
    lo: int
    m: int
    row: int
    draft: bool


@dataclass
class SpecStats:
    """Acceptance counters, ready for metrics."""

    k_max: int
    verify_steps: int = 0  # target forwards that carried drafts (per sequence)
    emitted: int = 0  # tokens those forwards produced (accepted + the target's own)
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafted_per_pos = [0] * self.k_max
        self.accepted_per_pos = [0] * self.k_max

    def record(self, k: int, res: VerifyResult) -> None:
        self.verify_steps += 1
        self.emitted += len(res.tokens)
        for i in range(k):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < res.num_accepted

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verifying target forward (accepted + bonus)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0


def verify(seq: Sequence, k: int, logits: torch.Tensor, argmax: list[int],
           generator: torch.Generator | None) -> VerifyResult:
    """Check seq's first k drafts against the target's k+1 logits rows (k=0: plain sampling)."""
    draft = seq.draft[:k]
    if seq.params.greedy:
        return verify_greedy(draft, argmax)
    q = seq.draft_q[:k] if seq.draft_q is not None and k else None
    return verify_sampled(draft, q, logits, seq.params, generator)


class SpecRunner:
    """Proposes drafts for the sequences of a finished step."""

    def __init__(self, cfg: EngineConfig, model: LlamaModel, kv_cache: torch.Tensor,
                 head: Eagle3Head | None):
        assert cfg.spec is not None
        self.cfg, self.spec, self.model, self.head = cfg, cfg.spec, model, head
        self.kv = kv_cache[cfg.model.num_layers] if head is not None else None
        self.ngram = NgramDrafter(cfg.spec.ngram_max, cfg.spec.ngram_min) \
            if cfg.spec.method == "ngram" else None
        self.policy = KPolicy(cfg.spec)
        self.stats = SpecStats(cfg.spec.num_tokens)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.cfg.aux_layer_ids if self.head is not None else ()

    def release(self, seq: Sequence) -> None:
        if self.ngram is not None:
            self.ngram.release(seq.request_id)

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

    def _k(self, span: Span, blocks, batch_size: int) -> int:
        """K for this sequence, capped by what it may still emit and by free KV blocks."""
        seq = span.seq
        left = min(seq.params.max_tokens - len(seq.output_ids),
                   self.cfg.max_model_len - len(seq)) - 1
        k = min(self.policy.choose(seq, batch_size), max(left, 0))
        if seq.max_draft is not None:
            k = min(k, seq.max_draft)
        need = span.lo + span.m + 1  # the pending token, then k drafts
        while k and not blocks.can_grow(seq, need + k):
            k -= 1
        if k:
            blocks.grow(seq, need + k)
        return k

    @torch.inference_mode()
    def _eagle(self, spans: list[Span], aux: list[torch.Tensor], ks: list[int],
               generators: dict[str, torch.Generator]) -> None:
        head, dev = self.head, self.cfg.device
        rows = torch.tensor([r for s in spans for r in range(s.row, s.row + s.m)], device=dev)
        fused = head.fuse([a[rows] for a in aux])
        toks = [t for s in spans for t in s.seq.token_ids[s.lo + 1 : s.lo + s.m + 1]]
        pos = [p for s in spans for p in range(s.lo, s.lo + s.m)]
        out = self._step(spans, [s.m for s in spans], toks, pos, fused)
        ends = torch.tensor(list(itertools.accumulate(s.m for s in spans)), device=dev) - 1
        h = out[ends]
        live = [i for i, k in enumerate(ks) if k]
        drafts: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        h = h[live]
        step = 0
        while live:
            logits = head.full_vocab_logits(h)
            for j, i in enumerate(live):
                seq = spans[i].seq
                if seq.params.greedy:
                    tok = int(logits[j].argmax())
                else:
                    q = processed_probs(logits[j : j + 1], seq.params)
                    tok = int(sample_from(q, generators[seq.request_id])[0])
                    qs[i].append(q[0])
                drafts[i].append(tok)
            keep = [j for j, i in enumerate(live) if len(drafts[i]) < ks[i]]
            if not keep:
                break
            live = [live[j] for j in keep]
            step += 1
            sel = [spans[i] for i in live]
            toks = [drafts[i][-1] for i in live]
            pos = [s.lo + s.m - 1 + step for s in sel]
            h = self._step(sel, [1] * len(sel), toks, pos, h[keep])
        for i in drafts:
            seq = spans[i].seq
            seq.draft = drafts[i]
            seq.draft_q = torch.stack(qs[i]) if qs[i] else None

    def _step(self, spans: list[Span], lens: list[int], toks: list[int], pos: list[int],
              hidden: torch.Tensor) -> torch.Tensor:
        """One head forward: `lens[i]` tokens of span i at positions `pos`, into the draft
        layer's KV slot."""
        dev, bs = self.cfg.device, self.cfg.block_size
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
        tables = [s.seq.block_table for s in spans]
        slots = []
        seq_lens, starts = [], [0]
        it = iter(pos)
        for table, n in zip(tables, lens):
            ps = [next(it) for _ in range(n)]
            slots += [table[p // bs] * bs + p % bs for p in ps]
            seq_lens.append(ps[-1] + 1)
            starts.append(starts[-1] + n)
        width = max(map(len, tables))
        meta = AttentionMetadata(
            slot_mapping=t(slots), query_start=t(starts, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=t([tb + [0] * (width - len(tb)) for tb in tables], torch.int32),
            max_query_len=max(lens), max_seq_len=max(seq_lens), query_start_cpu=starts,
            seq_lens_cpu=seq_lens)
        embeds = self.model.embed_tokens(t(toks))
        return self.head(embeds, hidden.to(embeds.dtype), t(pos), self.kv, meta)

