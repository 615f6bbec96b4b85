"""Disaggregation: the state besides its KV blocks that moves with a request from a prefill
engine to a decode engine, so the decode side continues exactly as one engine would. The
prefill side holds a finished request's blocks until sent; the decode side reserves blocks for
the KV, then admits the request."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.errors import InvalidRequestError, ResourceExhaustedError
from engine.sampler import new_generator
from engine.sequence import SamplingParams, Sequence
from engine.spec.lookup import store_tokens
from engine.tokenizer import Detokenizer

if TYPE_CHECKING:
    from engine.engine import Engine


@dataclass
class Handoff:
    """Plain data (picklable, JSON-able but for `rng_state`), built by `export` on the prefill
    side and consumed by `admit` on the decode side."""

    request_id: str
    token_ids: list[int]  # prompt + the first generated token
    num_prompt_tokens: int
    num_computed: int  # positions whose KV ships in the blocks (target and draft layers)
    params: dict
    cached_tokens: int = 0
    rng_state: bytes | None = None  # the request's sampler RNG after the first token
    text: str = ""  # detokenized output so far, and how much of it was streamed
    num_emitted_chars: int = 0
    detok_offsets: tuple[int, int] | None = None
    draft: list[int] = field(default_factory=list)  # drafts the first decode step verifies
    draft_q: torch.Tensor | None = None  # their draft distributions when sampled [K, vocab]
    max_draft: int | None = None  # the request's own cap on drafts per step
    # The EAGLE-3 head's hidden state at the last prompt position (built from the fused target
    # features): with no drafts above, the decode side drafts from it itself.
    hidden: torch.Tensor | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(**self.params)

    @staticmethod
    def params_dict(p: SamplingParams) -> dict:
        return asdict(p)


def export(eng: Engine, request_id: str) -> Handoff:
    """Everything but the KV blocks that a decode engine needs to continue a held request."""
    seq = eng.held[request_id]
    g = eng.generators.get(request_id)
    detok = eng.detoks.get(request_id)
    return Handoff(request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed,
                   Handoff.params_dict(seq.params), seq.num_cached_tokens,
                   bytes(g.get_state().numpy().tobytes()) if g is not None else None,
                   seq.text, seq.num_emitted_chars,
                   (detok.prefix, detok.read) if detok else None, list(seq.draft),
                   None if seq.draft_q is None else seq.draft_q.cpu(), seq.max_draft,
                   None if seq.draft_hidden is None else seq.draft_hidden.cpu())


def reserve(eng: Engine, request_id: str, num_tokens: int) -> list[int]:
    """Set aside blocks for `num_tokens` tokens of KV about to arrive; returns their ids."""
    if request_id in eng.reserved or request_id in eng.seqs:
        raise InvalidRequestError(f"request id {request_id!r} is already here")
    placeholder = Sequence([0], SamplingParams(), request_id)
    if not eng.blocks.can_grow(placeholder, num_tokens):
        raise ResourceExhaustedError(f"no room for {num_tokens} tokens of KV "
                                     f"({eng.blocks.num_free} blocks free)")
    eng.blocks.grow(placeholder, num_tokens)
    eng.reserved[request_id] = placeholder
    return list(placeholder.block_table)


def admit(eng: Engine, h: Handoff) -> None:
    """Start decoding a request whose KV has landed in its reserved blocks."""
    cfg, spec = eng.config, eng.spec
    res = eng.reserved.pop(h.request_id)
    params = h.sampling()
    seq = Sequence(h.token_ids, params, h.request_id)
    seq.num_prompt_tokens, seq.num_cached_tokens = h.num_prompt_tokens, h.cached_tokens
    seq.block_table, seq.num_computed = res.block_table, h.num_computed
    seq.text, seq.num_emitted_chars = h.text, h.num_emitted_chars
    seq.max_draft = h.max_draft
    if spec is not None and h.draft:
        seq.draft = list(h.draft)[: spec.spec.num_tokens]
        if h.draft_q is not None:
            seq.draft_q = h.draft_q[: len(seq.draft)].to(cfg.device)
    eng.blocks.commit(seq)
    if eng.token_store is not None:  # the KV came over the wire, its tokens did not
        _store_tokens(eng, seq, 0, seq.num_computed)
    if not params.greedy:
        g = new_generator(None, cfg.device)
        if h.rng_state is not None:
            g.set_state(torch.frombuffer(bytearray(h.rng_state), dtype=torch.uint8))
        eng.generators[h.request_id] = g
    if spec is not None and not seq.draft and h.hidden is not None:
        with eng.on_device():
            spec.draft_from_hidden(seq, h.hidden, eng.blocks,
                                   len(eng.scheduler.running) + 1, eng.generators)
    if eng.tokenizer is not None:
        d = Detokenizer(eng.tokenizer, h.token_ids[: h.num_prompt_tokens])
        if h.detok_offsets:
            d.prefix, d.read = h.detok_offsets
        eng.detoks[h.request_id] = d
    eng.seqs[h.request_id] = seq
    eng.scheduler.admit_running(seq)


def _store_tokens(eng: Engine, seq: Sequence, lo: int, hi: int) -> None:
    """The token store's entries for positions lo..hi-1 of seq, from the host."""
    bs, pos = eng.config.block_size, np.arange(lo, hi)
    slots = np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
    dev = eng.config.device
    store_tokens(eng.token_store, torch.tensor(seq.token_ids[lo:hi], device=dev),
                 torch.from_numpy(slots).to(dev))


def release(eng: Engine, request_id: str) -> None:
    """Free a held (prefill) or reserved (decode) request's blocks."""
    seq = eng.held.pop(request_id, None) or eng.reserved.pop(request_id, None)
    if seq is None:
        return
    eng.blocks.release(seq)
    eng.generators.pop(request_id, None)
    eng.detoks.pop(request_id, None)
