"""After a step: each entry's verified tokens become its output (text, stop checks), its KV
advances, and it takes its next drafts (none while a speculative engine warms, `warming.py`);
requests that stop leave the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cost_feed import record_verifies
from engine.output import RequestOutput, cut, emit_each, stop_prefix_len
from engine.scheduler import Batch
from engine.sequence import Sequence
from engine.spec.runtime import Span

if TYPE_CHECKING:
    from engine.engine import Engine


class Postprocessor:
    """Turns a step's verify results into each request's output, updating the engine's
    requests, blocks and counters."""

    def __init__(self, eng: Engine):
        self.eng = eng

    def process(self, batch: Batch, fwd, results: dict, drafts: dict | None = None,
                count_step: bool = True, draft: bool = True) -> list[RequestOutput]:
        """Emit each entry's verified tokens (`results`: entry → (drafts sent, VerifyResult); a
        missing entry is a prefill chunk short of the prompt's end), advance its KV, and set its
        next drafts: `drafts` if the fused step made them, else proposed from `fwd` (`draft` off:
        the head steps over the new positions but proposes nothing)."""
        e = self.eng
        stats, spec = e.stats, e.spec
        # Only a prefix cache registers full blocks (a call per sequence saved without one).
        commit = e.blocks.commit if e.blocks.enable_prefix_caching else None
        stats.steps += count_step
        cap = self._captured(fwd)
        # While warming, no head work: no drafts, and the head skips these positions.
        propose = drafts is None and spec is not None and e.warming is None
        if spec is not None:  # before emitting: an output carries the accepted count
            record_verifies(spec, batch.seqs, results)
        outs, spans, row = [], [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            lo, r = seq.num_computed, results.get(i)
            if cap is not None:
                real = n - (r[0] if r else 0)
                e.capture(seq, lo, cap[0][row : row + real], cap[1][row : row + real])
            if lo < seq.num_prompt_tokens:
                stats.prefill_tokens += min(n, seq.num_prompt_tokens - lo)
            else:
                stats.decode_tokens += n
            if r is None:
                seq.num_computed += n
                if commit:
                    commit(seq)
                if propose:
                    spans.append(Span(seq, lo, n, row, draft=False))
                row += n
                continue
            k, res = r
            seq.draft_q = None
            out, reason = self.emit(seq, res.tokens)
            outs.append(out)
            # KV is valid for the real tokens and the accepted drafts; the last token is pending.
            seq.num_computed = min(lo + n - k + res.num_accepted, len(seq.token_ids) - 1)
            if commit:
                commit(seq)
            seq.draft = [] if reason or drafts is None else drafts[i]
            if propose and reason in (None, "handoff"):
                # A hand-off drafts here exactly as one engine would, so the decode side
                # verifies the same drafts and the request's RNG advances the same way.
                spans.append(Span(seq, lo, seq.num_computed - lo, row,
                                  draft=e.config.handoff_drafts if reason else draft))
            if reason:
                self.finish(seq, reason)
                if reason == "handoff":
                    out.handoff = True
                else:
                    out.finished, out.finish_reason = True, reason
            row += n
        if propose:
            # K is priced at the size of the batch these sequences decode in next: a prefill
            # chunk postprocessed apart from the running decodes (`Stepper.split`) joins them.
            size = max(len(batch), len(e.scheduler.running))
            spec.policy.begin_propose(stats.steps, size)
            spec.propose(spans, fwd.aux, e.blocks, size, e.generators)
        return outs

    def _captured(self, fwd) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the capture tap: the forward's hidden states and captured layer inputs side by
        side, concatenated and cast once for the whole step, into tensors of the tap's own (a
        graph's outputs are overwritten by its next replay)."""
        e = self.eng
        if e.capture is None:
            return None
        h = fwd.hidden
        a = torch.cat(fwd.aux, -1) if fwd.aux else h[:, :0]
        dtype = e.capture_dtype or h.dtype
        return h.to(dtype, copy=True), a.to(dtype)

    def emit(self, seq: Sequence, tokens: list[int]) -> tuple[RequestOutput, str | None]:
        """Append tokens until one stops the request; the text delta holds back any tail that
        could still become a stop string."""
        e = self.eng
        detok = e.detoks.get(seq.request_id)
        p, ids = seq.params, seq.token_ids
        eos = () if p.ignore_eos else e.eos_ids
        limit = seq.length_limit(e.config.max_model_len)
        if p.stop:
            emitted, reason = emit_each(seq, tokens, detok, eos, limit)
        else:
            # Without stop strings the ids and the length alone decide where the tokens stop,
            # and the text takes one detokenizer step.
            emitted, reason = cut(tokens, eos, p.stop_token_ids, limit - len(ids), seq.hold)
            ids.extend(emitted)
            if detok and emitted:
                seq.text += detok.step(ids)
        e.stats.generated_tokens += len(emitted)
        done = reason is not None and reason != "handoff"
        keep = len(seq.text) - (0 if done or not p.stop else stop_prefix_len(seq))
        text, seq.num_emitted_chars = seq.text[seq.num_emitted_chars : keep], keep
        return RequestOutput(seq.request_id, emitted, text, prompt_tokens=seq.num_prompt_tokens,
                             completion_tokens=seq.num_output_tokens,
                             cached_tokens=seq.num_cached_tokens,
                             accepted_tokens=seq.num_accepted), reason

    def finished_output(self, seq: Sequence) -> RequestOutput:
        """Report a request the scheduler had to stop (the KV cache cannot hold it)."""
        self.finish(seq, seq.finish_reason or "length")
        return RequestOutput(seq.request_id, [], "", True, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request: a hand-off is held with its blocks for the decode side, any other
        leaves the engine (its blocks freed now, or once the step in flight is read)."""
        e = self.eng
        if not seq.finished:
            later = e.overlap.inflight is not None and reason != "handoff"
            e.scheduler.finish(seq, reason, keep_blocks=reason == "handoff" or later)
            if later:
                e.overlap.deferred.append(seq)
        if e.spec is not None:
            e.spec.release(seq)
        e.seqs.pop(seq.request_id, None)
        if reason == "handoff":
            e.held[seq.request_id] = seq
            return
        e.generators.pop(seq.request_id, None)
        e.detoks.pop(seq.request_id, None)
        e.stats.finished[reason] = e.stats.finished.get(reason, 0) + 1
