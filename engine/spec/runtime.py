"""Speculation inside the engine step: verify the drafts a forward just checked, then propose
the next ones (EAGLE-3 head over the target's hidden states, or n-gram lookup).

`SpecRunner` is what the engine calls; its parts are `DraftBudget` (K per sequence and its KV
blocks), `HeadDrafter` (step-by-step drafting with the head) and `FusedLauncher` (the fused
step's launch, continuation and read-back)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model import LlamaModel
from engine.sequence import Sequence
from engine.spec.budget import DraftBudget
from engine.spec.drafting import HeadDrafter, Span
from engine.spec.eagle3 import Eagle3Head
from engine.spec.fused import FusedHandle, FusedSteps
from engine.spec.launcher import FusedLauncher
from engine.spec.ngram import NgramDrafter
from engine.spec.policy import KPolicy
from engine.spec.stats import SpecStats
from engine.staging import HostStager

__all__ = ["Span", "SpecRunner"]


def _of(part: str, name: str, default=None) -> property:
    """A read-only attribute kept by one of the runner's parts (`default` without that part)."""
    def get(self):
        obj = getattr(self, part)
        return default if obj is None else getattr(obj, name)
    return property(get, doc=f"`{part}.{name}`")


class SpecRunner:
    """Proposes drafts for the sequences of a finished step."""

    # The head's graph sets (None without a head or before `enable_graphs`).
    graphs = _of("drafter", "graphs")
    first_graphs = _of("drafter", "first_graphs")
    prefill_graphs = _of("drafter", "prefill_graphs")
    chain_graphs = _of("drafter", "chain_graphs")
    # The fused step (None until `enable_graphs` builds it) and its counts.
    fused = _of("launcher", "fused")
    fused_runs = _of("launcher", "fused_runs")
    overlapped_runs = _of("launcher", "overlapped_runs")
    known_continuations = _of("launcher", "known_continuations")
    compacted_runs = _of("launcher", "compacted_runs")
    joined_runs = _of("launcher", "joined_runs")

    def __init__(self, cfg: EngineConfig, model: LlamaModel, kv_cache: torch.Tensor,
                 head: Eagle3Head | None, tokens: torch.Tensor | None = None):
        assert cfg.spec is not None
        self.cfg, self.spec, self.model, self.head = cfg, cfg.spec, model, head
        # Token ids by KV slot: drafting from the context on the device (lookup.py).
        self.tokens = tokens if head is not None else None
        self.kv_cache = kv_cache
        self.ngram = NgramDrafter(cfg.spec.ngram_max, cfg.spec.ngram_min) \
            if cfg.spec.method == "ngram" else None
        # The host side of context drafts: an incremental index per sequence.
        self.context = NgramDrafter(cfg.spec.ngram_max, cfg.spec.context_min_n) \
            if self.tokens is not None else None
        self.policy = KPolicy(cfg.spec)
        self.stats = SpecStats(cfg.spec.num_tokens)
        self.stager = HostStager(cfg.device, 1 << 12)
        self.budget = DraftBudget(self.policy, cfg.max_model_len)
        self.drafter = HeadDrafter(cfg, model, head, kv_cache[cfg.model.num_layers],
                                   self.stager) if head is not None else None
        self.launcher = FusedLauncher(cfg, self.policy, self.budget, self.stager)

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
            self.drafter.draft(spans, aux, ks, generators)
            self._from_context(s.seq for s in spans)

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
            self.drafter.chain([span], [0], [k], h, generators)
            self._from_context([seq])

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
        return self.budget.k_for(span.seq, span.lo + span.m + 1, blocks, batch_size) or 0

    def enable_graphs(self, max_batch: int) -> None:
        """Graphs for the head (`HeadDrafter.enable_graphs`) and, with `SpecConfig.fused_step`,
        the fused step built over their memory pool."""
        if self.head is None:
            return
        self.drafter.enable_graphs(max_batch)
        if self.spec.fused_step and self.spec.num_tokens:
            f = FusedSteps(self.model, self.head, self.kv_cache, self.aux_layers, self.cfg,
                           max_batch, self.graphs.pool, self.tokens)
            self.launcher.fused = f
            self.policy.levels = f.small
            if f.small != f.large:
                self.policy.levels_at = f.levels_at

    def fused_launch(self, batch, blocks, step: int, capture=None) -> FusedHandle | None:
        """`FusedLauncher.launch`: a fused step for the batch, or None (step-by-step path)."""
        return self.launcher.launch(batch, blocks, step, capture)

    def fused_continue(self, prev: FusedHandle, blocks, step: int,
                       keep: list[int] | None = None, join=()) -> FusedHandle | None:
        """`FusedLauncher.launch_after`: the step after `prev`, launched before it is read."""
        return self.launcher.launch_after(prev, blocks, step, keep, join)

    def fused_finish(self, h: FusedHandle):
        """`FusedLauncher.finish`: ({entry: (k, VerifyResult)}, {entry: drafts}) of `h`."""
        return self.launcher.finish(h)
