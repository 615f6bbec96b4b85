"""Llama-family decoder on packed variable-length batches against the paged KV cache."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.graphs import graph_time_us
from engine.layers import RMSNorm, Rotary, rowwise, whole


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: Rotary):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.backend, self.rotary = backend, rotary

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata, each=whole):
        """Attention output (after o_proj); `each(fn, x)` runs the projections (`rowwise`: a row
        at a time)."""
        qkv = each(self.qkv_proj, x)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(-1, self.nh, self.hd)
        k = k.view(-1, self.nkv, self.hd)
        v = v.view(-1, self.nkv, self.hd)
        q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache, meta)
        return each(self.o_proj, o.reshape(-1, self.nh * self.hd))

    def attend_qkv(self, qkv, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output [T, heads * head_dim] (before o_proj) from the projected qkv: q and
        k rotate in place inside qkv and k, v go to the cache in one launch, then attend."""
        heads = qkv.view(-1, self.nh + 2 * self.nkv, self.hd)
        ops.rope_store_(heads, self.nh, self.nkv, positions, self.rotary.cos,
                        self.rotary.sin, kv_cache, meta.slot_mapping)
        o = self.backend.attend(heads[:, : self.nh], kv_cache, meta)
        return o.reshape(-1, self.nh * self.hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                      bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, positions, kv_cache, meta, each=whole):
        """The layer's output; `each(fn, x)` runs the norms, projections and MLP (`rowwise`: a
        row at a time, norm to down_proj in one go)."""
        h = h + self.self_attn(each(self.input_layernorm, h), positions, kv_cache, meta, each)
        return h + each(self._mlp, h)

    def _mlp(self, h):
        return self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. Parameter names follow the HF checkpoint layout, except that
    q/k/v and gate/up are stored fused (`qkv_proj`, `gate_up_proj`)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: Rotary | None = None,
                 init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position) if rotary is None else rotary
        # Drawn only where asked: a normal fill on the meta device costs a second (it imports
        # torch's compiler).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        if init:
            self.embed_tokens.reset_parameters()
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, self.rotary)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Fused elementwise kernels ride with the Triton backend (the fast path); the torch
        # backend keeps the plain reference code.
        self.fused = backend.name == "triton" and ops.triton_available()
        # Deterministic mode (`EngineConfig.deterministic`, carried by the backend): each row's
        # bits do not depend on the rows sharing a launch. Fused: every projection and the LM
        # head take `ops.invariant_linear`; reference: projections and norms run a row at a time.
        self.deterministic = bool(getattr(backend, "deterministic", False))
        # On the fused path, forwards of few rows (`prologue_rows`) fold each norm and the
        # SiLU-and-mul into the projection after it (`_forward_fused`): 6 launches a layer
        # instead of 9, all Triton (programmatic dependent launch where supported).
        first = self.layers[0]
        projections = (first.self_attn.qkv_proj, first.self_attn.o_proj,
                       first.mlp.gate_up_proj, first.mlp.down_proj)
        self.prologue_linears = self.fused and ops.prologue_suits(
            [p.weight.shape for p in projections])
        # Row counts that take them: one row until `calibrate_prologue_rows` times more.
        self.prologue_rows = frozenset(range(1, ops.LINEAR_MAX_ROWS + 1))
        self.prologue_calibration: dict | None = None
        # Large projections' kernels as `tune_large_linears` chose them on this GPU.
        self.large_linear_tuning: dict | None = None

    @classmethod
    def build(cls, cfg: ModelConfig, backend: AttentionBackend, device, dtype: torch.dtype,
              init: bool = True) -> LlamaModel:
        """The model on `device` in `dtype`, its weights randomly initialized; `init=False`: its
        weights left on the meta device, for a caller that assigns every one (no time or
        memory goes to weights it would drop). The RoPE tables are computed either way."""
        with torch.device(device):
            if init:
                return cls(cfg, backend).to(dtype)
            rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position)
        with torch.device("meta"):
            model = cls(cfg, backend, rotary, init=False)
        return model.to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, aux_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden states [T, hidden] and the hidden states entering `aux_layers`."""
        h = self.embed_tokens(input_ids)
        if self.fused:
            return self._forward_fused(h, positions, kv_cache, meta, aux_layers)
        taps, each = {}, rowwise if self.deterministic else whole
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                taps[i] = h
            h = layer(h, positions, kv_cache[i], meta, each)
        return each(self.norm, h), [taps[i] for i in aux_layers]

    def _forward_fused(self, h, positions, kv_cache, meta, aux_layers):
        """Same math, residual adds folded into the norms: norm(x + r) also returns x + r.
        Forwards of `prologue_rows` rows also fold each norm into the projection that reads
        it and SiLU-and-mul into down_proj (`ops.prologue_linear`): qkv, rotary+store,
        attention, o, gate_up, down, each one Triton launch. Deterministic: forwards of every
        row count take `ops.invariant_linear` (the norm in its prologue, SiLU-and-mul in gate_up's
        epilogue)."""
        inv = self.deterministic
        fold = inv or (self.prologue_linears and h.shape[0] in self.prologue_rows)
        taps, res = {}, None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, res = norm_proj(attn.qkv_proj, h, layer.input_layernorm, res, fold, inv)
            if i in aux_layers:
                taps[i] = res
            o = attn.attend_qkv(qkv, positions, kv_cache[i], meta)
            a = project(attn.o_proj, o, fold, inv)
            ln = layer.post_attention_layernorm
            if inv and mlp.gate_up_proj.bias is None:
                # SiLU-and-mul in the gate_up projection's epilogue, row-invariant as well.
                act, res = ops.invariant_linear(a, mlp.gate_up_proj.weight, norm_weight=ln.weight,
                                                eps=ln.eps, residual=res, glu=True)
                h = project(mlp.down_proj, act, fold, inv)
            elif not fold and ops.gemv_silu_suits(a.shape[0], mlp.gate_up_proj):
                # One row of a large model: SiLU-and-mul in the gate_up GEMV's epilogue.
                y, res = ops.add_rmsnorm(a, ln.weight, ln.eps, res)
                h = project(mlp.down_proj, ops.gemv_silu(y, mlp.gate_up_proj.weight), False)
            else:
                gu, res = norm_proj(mlp.gate_up_proj, a, ln, res, fold, inv)
                h = silu_proj(mlp.down_proj, gu, fold, inv)
        out, _ = ops.add_rmsnorm(h, self.norm.weight, self.norm.eps, res)
        return out, [taps[i] for i in aux_layers]

    @torch.inference_mode()
    def calibrate_prologue_rows(self, max_rows: int = ops.CALIBRATE_MAX_ROWS, reps: int = 16
                                ) -> dict | None:
        """Time a layer's four projections on this GPU through the prologue linears and through the
        separate kernels + cuBLAS at 1..max_rows rows, and keep the prologue linears where faster.
        Returns {rows: (prologue us, separate us)} (also in `prologue_calibration`); None where
        there is nothing to decide (CPU, projections too large for the prologue linears, or the
        deterministic mode, whose kernels never depend on the row count)."""
        if (not self.prologue_linears or not self.embed_tokens.weight.is_cuda
                or self.deterministic):
            return None
        with torch.cuda.device(self.embed_tokens.weight.device):
            timings = {m: self._time_projections(m, reps) for m in range(1, max_rows + 1)}
        self.prologue_rows = frozenset(m for m, (pro, sep) in timings.items() if pro < sep)
        self.prologue_calibration = timings
        return timings

    @torch.inference_mode()
    def tune_large_linears(self) -> dict | None:
        """On a GPU, on the fused path: for each projection too large for the prologue linears, time
        our GEMV and 16-row tiles against cuBLAS with the model's weights and keep the fastest per
        weight shape (`ops.tune_large_linear`). Returns {projection: choice and timings}; None where
        nothing is large, off CUDA or in the deterministic mode (`ops.invariant_linear` alone)."""
        w = self.embed_tokens.weight
        if not self.fused or not w.is_cuda or self.deterministic:
            return None
        groups = {"qkv": [la.self_attn.qkv_proj.weight for la in self.layers],
                  "o": [la.self_attn.o_proj.weight for la in self.layers],
                  "gate_up": [la.mlp.gate_up_proj.weight for la in self.layers],
                  "down": [la.mlp.down_proj.weight for la in self.layers],
                  "lm_head": [self.lm_head.weight]}
        out = {}
        with torch.cuda.device(w.device):
            for name, ws in groups.items():
                if not ops.large_suits(ws[0]):
                    continue
                known = ops.LARGE_LINEAR.get(ops.large_key(ws[0]))
                out[name] = dict(known) if known is not None else ops.tune_large_linear(ws)
                # gate_up + SiLU in one launch (`ops.gemv_silu` takes no bias)
                if name == "gate_up" and known is None and out[name]["one"] is not None \
                        and not self.cfg.mlp_bias:
                    out[name].update(ops.tune_gemv_silu(ws))
        self.large_linear_tuning = out or None
        return self.large_linear_tuning

    def share_calibration(self, other: LlamaModel) -> None:
        """Take `other`'s calibrated row counts (same weights, same device and dtype), so
        engines sharing weights decode through the same kernels and calibrate once."""
        w, v = self.embed_tokens.weight, other.embed_tokens.weight
        if (other.prologue_calibration is not None and self.prologue_linears
                and w.device == v.device and w.dtype == v.dtype):
            self.prologue_rows = other.prologue_rows
            self.prologue_calibration = other.prologue_calibration

    def _time_projections(self, m: int, reps: int) -> tuple[float, float]:
        """(prologue, separate) microseconds of one layer's projections over m rows; call i
        of a graph runs layer i's, so weights come from HBM as in a forward, not from L2."""
        w = self.embed_tokens.weight
        g = torch.Generator(device=w.device).manual_seed(m)
        first = self.layers[0]

        def rnd(n):
            return torch.randn(m, n, device=w.device, dtype=w.dtype, generator=g)

        x, o_in = rnd(first.input_layernorm.weight.shape[0]), rnd(
            first.self_attn.o_proj.weight.shape[1])
        gu_in = rnd(2 * first.mlp.down_proj.weight.shape[1])

        def projections(i, fold):
            layer = self.layers[i % len(self.layers)]
            attn, mlp = layer.self_attn, layer.mlp
            norm_proj(attn.qkv_proj, x, layer.input_layernorm, x, fold)
            project(attn.o_proj, o_in, fold)
            norm_proj(mlp.gate_up_proj, x, layer.post_attention_layernorm, x, fold)
            silu_proj(mlp.down_proj, gu_in, fold)

        return (round(graph_time_us(lambda i: projections(i, True), reps), 2),
                round(graph_time_us(lambda i: projections(i, False), reps), 2))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of each row. Where the projections take the prologue linears (`prologue_rows`), so
        does the LM head, with tiles independent of the row count: a verify step's logits then equal
        the one-row decode step's bit for bit, so greedy speculation matches no speculation in bf16.
        GPU only: off CUDA the interpreted Triton kernels are far slower than the GEMM."""
        return self._logits(hidden).float()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype. Through the prologue linears, the LM head takes
        16-row tensor-core tiles (`ops.LOGITS_DOT_TILES`): its weight is read once for all
        rows of a verify step, and each row still rounds as it does alone. Deterministic:
        `ops.invariant_linear` as an LM head (such tiles below `invariant.HEAD_ROWS`, and at
        every count off sm_90 or in fp32; `dot_tiles` with `invariant.LARGE_HEADS`), or on the
        reference path one row at a time. Leading dimensions other than rows (a trainer's
        [batch, length, hidden]) count as rows."""
        if hidden.dim() != 2:
            return self._logits(hidden.reshape(-1, hidden.shape[-1])).view(
                *hidden.shape[:-1], -1)
        if self.deterministic:
            if self.fused:
                return ops.invariant_linear(hidden, self.lm_head.weight, self.lm_head.bias,
                                            head=True)
            return rowwise(self.lm_head, hidden)
        if self.prologue_linears and hidden.is_cuda and hidden.shape[0] in self.prologue_rows:
            return ops.prologue_linear(hidden.contiguous(), self.lm_head.weight,
                                       self.lm_head.bias, dot=ops.LOGITS_DOT_TILES)
        if self.fused and not self.prologue_linears:  # large models: `ops.gemv_rows` on a GPU
            return ops.linear(hidden, self.lm_head.weight, self.lm_head.bias)
        return self.lm_head(hidden)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: the argmax of `logits(hidden)`. On the fused path on a
        GPU, two Triton launches over the logits in the model's dtype (their fp32 casts
        order alike) instead of a cast and torch's one-program-per-row reduce."""
        if self.fused and hidden.is_cuda:
            return ops.argmax_rows(self._logits(hidden))
        return self.logits(hidden).argmax(dim=-1)


# One projection of the fused forward, with its activation folded into the GEMV (`fold`,
# `ops.prologue_linear`) or as the separate kernel followed by the linear. `p` is an nn.Linear
# or a `Projection` (the EAGLE-3 head's stacked weights).

class Projection(NamedTuple):
    """A projection's weights outside an nn.Linear."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


def _folded(invariant: bool):
    """The one-launch projection: row-invariant tiles (deterministic) or `linear_tiles`'."""
    return ops.invariant_linear if invariant else ops.prologue_linear


def norm_proj(p, x, ln: RMSNorm, res, fold: bool, invariant: bool = False):
    """(p(norm(x + res)), x + res); res None (the embedding): (p(norm(x)), x). invariant:
    folded, through `ops.invariant_linear`."""
    if fold or invariant:
        lin = _folded(invariant)
        if res is None:
            return lin(x, p.weight, p.bias, norm_weight=ln.weight, eps=ln.eps), x
        return lin(x, p.weight, p.bias, norm_weight=ln.weight, eps=ln.eps, residual=res)
    if res is None:
        return ops.linear(ops.add_rmsnorm(x, ln.weight, ln.eps), p.weight, p.bias), x
    y, res = ops.add_rmsnorm(x, ln.weight, ln.eps, res)
    return ops.linear(y, p.weight, p.bias), res


def project(p, x, fold: bool, invariant: bool = False):
    if fold or invariant:
        return _folded(invariant)(x, p.weight, p.bias)
    return ops.linear(x, p.weight, p.bias)


def silu_proj(p, gate_up, fold: bool, invariant: bool = False):
    """p(silu(gate) * up) for gate_up = [gate | up]."""
    if fold or invariant:
        return _folded(invariant)(gate_up, p.weight, p.bias, silu=True)
    return ops.linear(ops.silu_mul(gate_up), p.weight, p.bias)
