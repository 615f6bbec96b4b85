"""EAGLE-3 draft head: fuses three target hidden states, runs one decoder layer over
[norm(embed(token)), norm(fused)], predicts over a reduced draft vocabulary.

Head folders (config.json + weights) in every public layout are read and written by
`engine/spec/head_io.py`; `load_head` and `save_head` are reachable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig, RopeConfig
from engine.layers import RMSNorm, Rotary
from engine.model import Projection, norm_proj, project, silu_proj
from engine.ops import prologue


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of the head and which target it belongs to."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int,
                   aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
        """A head shaped like one layer of `target`; taps (ascending) default to
        `default_taps`."""
        ids = tuple(sorted(aux_layer_ids)) if aux_layer_ids else default_taps(target.num_layers)
        return cls(target.hidden_size, target.intermediate_size, target.num_heads,
                   target.num_kv_heads, target.head_dim, target.rms_norm_eps, target.rope,
                   target.max_position, target.vocab_size, draft_vocab_size,
                   target.hidden_size, ids)

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a head trained for a different target, naming the mismatch."""
        problems = []
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"target hidden size {self.target_hidden_size} != {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab size {self.vocab_size} != {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(f"head hidden size {self.hidden_size} != target's "
                            f"{target.hidden_size} (the embedding is shared)")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"aux layers {bad} outside the target's {target.num_layers} layers")
        if problems:
            raise ValueError("EAGLE-3 head does not fit this target: " + "; ".join(problems))


def default_taps(num_layers: int) -> tuple[int, ...]:
    """Every runtime's default taps for a target of this depth, ascending: the hidden states
    entering layers 2, L//2 and L-3 (kept inside a shallow target)."""
    n = num_layers
    return tuple(sorted((min(2, n - 1), n // 2, max(n - 3, 0))))


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, backend: AttentionBackend, rotary: Rotary):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.backend, self.rotary = backend, rotary

    def forward(self, x, positions, kv_cache, meta):
        q = self.q_proj(x).view(-1, self.nh, self.hd)
        k = self.k_proj(x).view(-1, self.nkv, self.hd)
        v = self.v_proj(x).view(-1, self.nkv, self.hd)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta).flatten(1))


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config, backend: AttentionBackend, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, backend, rotary)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)
        self.norm_before_residual = c.norm_before_residual
        self.fused = backend.name == "triton" and ops.triton_available()
        # On the fused path, steps of these row counts take the prologue GEMVs
        # (`ops.prologue_linear`), as the target's projections do: the target's calibrated set
        # once `SpecRunner.enable_graphs` hands it over, one row before.
        h, hd = c.hidden_size, c.head_dim
        shapes = [((c.num_heads + 2 * c.num_kv_heads) * hd, 2 * h), (h, c.num_heads * hd),
                  (2 * c.intermediate_size, h), (h, c.intermediate_size)]
        self.prologue_rows = frozenset(range(1, ops.LINEAR_MAX_ROWS + 1)) \
            if self.fused and ops.prologue_suits(shapes) else frozenset()
        self._merged: tuple | None = None  # (source key, qkv weight, gate_up weight)

    def forward(self, embeds, hidden, positions, kv_cache, meta):
        if self.fused:
            return self._forward_fused(embeds, hidden, positions, kv_cache, meta)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, positions, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


    def store_kv(self, embeds, hidden, positions, kv_cache, meta, ids=None) -> None:
        """Only what a step leaves behind when its output is not needed: the layer's K and
        V at these positions, computed exactly as `forward` computes them. ids (fused path):
        embeds is the embedding table, the rows those of these tokens."""
        if self.fused:
            # The forward's own first launches (its k and v then round alike); q is rotated
            # too, and dropped.
            self._qkv_stored(self.merged_weights()[0], embeds, hidden, positions, kv_cache,
                             meta, ids)
            return
        assert ids is None, "token ids in place of embeddings: the fused path's"
        attn, hn, en = self.self_attn, self.hidden_norm, self.input_layernorm
        x = torch.cat([en(embeds), hn(hidden)], dim=-1)
        k = attn.k_proj(x).view(-1, attn.nkv, attn.hd)
        v = attn.v_proj(x).view(-1, attn.nkv, attn.hd)
        (k,) = attn.rotary(positions, k)
        attn.backend.store_kv(k, v, kv_cache, meta)

    def merged_weights(self) -> tuple[Projection, Projection]:
        """(q|k|v, gate|up) weights stacked for one projection each on the fused path; made
        again whenever a source weight is replaced or changed in place."""
        a, m = self.self_attn, self.mlp
        srcs = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, m.gate_proj.weight,
                m.up_proj.weight)
        key = tuple((w.data_ptr(), _version(w)) for w in srcs)
        if self._merged is None or self._merged[0] != key:
            with torch.no_grad():
                self._merged = (key, Projection(torch.cat(srcs[:3])),
                                Projection(torch.cat(srcs[3:])))
        return self._merged[1], self._merged[2]

    def _fold(self, x: torch.Tensor) -> bool:
        return x.shape[0] in self.prologue_rows

    def _qkv_stored(self, qkv: Projection, embeds, hidden, positions, kv_cache, meta,
                    ids=None):
        """The fused layer's first launches: x = [norm(embeds) | norm(hidden)], then q|k|v
        as [T, heads, head_dim] with q and k rotated in place and k, v in the cache. ids:
        embeds is the embedding table, and the rows are those of these tokens."""
        attn, hn, en = self.self_attn, self.hidden_norm, self.input_layernorm
        x = ops.dual_rmsnorm(embeds, en.weight, hidden, hn.weight, en.eps, ids=ids)
        heads = project(qkv, x, self._fold(x)).view(-1, attn.nh + 2 * attn.nkv, attn.hd)
        ops.rope_store_(heads, attn.nh, attn.nkv, positions, attn.rotary.cos, attn.rotary.sin,
                        kv_cache, meta.slot_mapping)
        return x, heads

    def _forward_fused(self, embeds, hidden, positions, kv_cache, meta, ids=None,
                       parts: bool = False):
        """The same math in the target layer's fused launches (`LlamaModel._forward_fused`). ids:
        token ids, embeds the embedding table (`_qkv_stored`). parts: return the output's two terms
        (residual, mlp) unsummed, for a next launch that adds them in its prologue."""
        attn = self.self_attn
        qkv, gate_up = self.merged_weights()
        x, heads = self._qkv_stored(qkv, embeds, hidden, positions, kv_cache, meta, ids)
        residual = x[:, hidden.shape[1]:] if self.norm_before_residual else hidden
        o = attn.backend.attend(heads[:, : attn.nh], kv_cache, meta).reshape(-1, attn.nh * attn.hd)
        fold = self._fold(x)
        gu, h = norm_proj(gate_up, project(attn.o_proj, o, fold), self.post_attention_layernorm,
                          residual, fold)
        mlp = silu_proj(self.mlp.down_proj, gu, fold)
        return (h, mlp) if parts else h + mlp


class Eagle3Head(nn.Module):
    """The draft head. The target's token embedding is shared: callers pass embeddings in."""

    def __init__(self, cfg: Eagle3Config, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg, backend, self.rotary)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # The LM head takes the layer's prologue GEMV (the norm folded in) where its weight
        # is at most `LM_HEAD_MAX_WEIGHT`; a larger draft vocabulary goes through torch's
        # linear, the layer keeping its GEMVs either way.
        self.lm_prologue = ops.prologue_suits([(cfg.draft_vocab_size, cfg.hidden_size)],
                                              prologue.LM_HEAD_MAX_WEIGHT)

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft vocabulary = these target ids, in this order (d2t as offsets, t2d as a mask)."""
        ids = target_ids.to(torch.int64)
        assert ids.numel() == self.cfg.draft_vocab_size
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """Three target hidden states [T, h] each → one [T, h] feature."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step over a packed batch; returns the head's hidden state (pre-norm),
        which is also what the next chained step takes as `hidden`. ids (the fused path
        only): embeds is the embedding table and these tokens' rows are looked up inside
        the layer's input norms, not by a launch of their own."""
        if ids is not None:
            assert self.midlayer.fused, "token ids in place of embeddings: the fused path's"
            return self.midlayer._forward_fused(embeds, hidden, positions, kv_cache, meta, ids)
        return self.midlayer(embeds, hidden, positions, kv_cache, meta)

    def store_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata,
                 ids: torch.Tensor | None = None) -> None:
        """The draft KV a step would store, without the rest of the step: for steps that
        keep the head's KV current but draft nothing (ids: as `forward`)."""
        self.midlayer.store_kv(embeds, hidden, positions, kv_cache, meta, ids)

    def chain_step(self, table: torch.Tensor, tokens, hidden: torch.Tensor,
                   positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   prob: torch.Tensor | None = None, keys: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained greedy draft step on the fused path, (hidden state, next tokens): the same
        numbers as `forward(table[tokens], hidden, ...)` then `greedy_tokens`, in fewer launches.
        prob: where the drafts' probabilities go (`greedy_tokens`). keys ([T] int64 filled with
        `ops.KEY_EMPTY`; where `fuses_argmax`): the argmax is folded into the LM head's GEMV and
        the tokens are returned packed in keys (as `ops.Keyed`). tokens may be `ops.Keyed`."""
        mid = self.midlayer
        assert mid.fused, "chain_step is the fused path's (Triton backend)"
        h, mlp = mid._forward_fused(table, hidden, positions, kv_cache, meta, ids=tokens,
                                    parts=True)
        if keys is not None:
            assert prob is None and self.fuses_argmax(h.shape[0])
            _, out = ops.prologue_linear(mlp, self.lm_head.weight, residual=h,
                                         norm_weight=self.norm.weight, eps=self.norm.eps,
                                         keys=keys)
            return out, keys
        if self._lm_gemv(h.shape[0]):
            logits, out = ops.prologue_linear(mlp, self.lm_head.weight, residual=h,
                                              norm_weight=self.norm.weight, eps=self.norm.eps)
            return out, ops.argmax_rows(logits, self.d2t, prob)
        out = h + mlp
        return out, self.greedy_tokens(out, prob)

    def fuses_argmax(self, rows: int) -> bool:
        """Whether `chain_step` can fold the greedy argmax into the LM head at this row
        count (`ops.FUSED_ARGMAX`, the LM head a prologue GEMV)."""
        return ops.FUSED_ARGMAX and self._lm_gemv(rows)

    def _lm_gemv(self, rows: int) -> bool:
        """Whether the LM head runs as the layer's prologue GEMV (final norm folded in) at
        this row count (never off the fused path, where prologue_rows is empty)."""
        return self.lm_prologue and rows in self.midlayer.prologue_rows

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, draft_vocab] in fp32."""
        return self.lm_head(self.norm(out)).float()

    def greedy_tokens(self, out: torch.Tensor, prob: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The head's argmax as target token ids, on the device. On the fused path at the
        layer's GEMV row counts: the norm folded into the LM head's GEMV, then one launch for
        the argmax and the id map (bf16 logits: their fp32 casts order alike). prob ([T]
        fp32): also each draft's probability under the head, written there."""
        if self._lm_gemv(out.shape[0]):
            logits = ops.prologue_linear(out.contiguous(), self.lm_head.weight,
                                         norm_weight=self.norm.weight, eps=self.norm.eps)
            return ops.argmax_rows(logits, self.d2t, prob)
        lg = self.logits(out)
        d = lg.argmax(dim=-1)
        if prob is not None:
            prob.copy_(lg.softmax(dim=-1).gather(1, d[:, None])[:, 0])
        return d + self.d2t[d]

    def full_vocab_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary: -inf outside the draft vocabulary."""
        dl = self.logits(out)
        full = dl.new_full((dl.shape[0], self.cfg.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = dl
        return full


def _version(t: torch.Tensor) -> int:
    """t's in-place version counter (inference tensors keep none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def __getattr__(name: str):
    # The head files' reader and writer live in head_io, which imports this module.
    if name in ("load_head", "save_head"):
        from engine.spec import head_io
        return getattr(head_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
