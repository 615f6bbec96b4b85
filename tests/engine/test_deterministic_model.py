"""The deterministic mode at the model level: a token's hidden state and logits are the same bits
whether its forward holds one row or many (a prefill chunk, a batch of sequences); on the
reference path (torch backend, fp32 on the CPU) and on the fused path (Triton kernels, under
the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, TorchAttention, triton_available
from engine.config import tiny_config
from engine.model import LlamaModel

BLOCK = 4


class RowAttention(TorchAttention):
    """The torch reference attention under the name that puts a model on its fused path: every
    query row attends alone (deterministic), so what the test sees is the model's own kernels."""

    name = "triton"


def _model(backend_cls, deterministic: bool, **shape) -> LlamaModel:
    cfg = tiny_config(**shape)
    backend = backend_cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK,
                          deterministic=True)
    model = LlamaModel(cfg, backend)
    model.deterministic = deterministic  # the model's kernels alone: attention stays row-wise
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _forward(model, seqs):
    """Forward of sequences [(token ids, first position)] packed in one launch, each over its
    own blocks of `model.kv` (earlier positions' KV from an earlier call): (hidden, logits)."""
    ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
    for s, (toks, first) in enumerate(seqs):
        table = [s * 16 + b for b in range(16)]
        ids += toks
        pos += range(first, first + len(toks))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + len(toks))]
        starts.append(starts[-1] + len(toks))
        lens.append(first + len(toks))
        tables.append(table)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), max_query_len=max(
            len(t) for t, _ in seqs), max_seq_len=max(lens), query_start_cpu=starts,
        seq_lens_cpu=lens)
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.tensor(pos), model.kv, meta)
        return hidden, model.logits(hidden)


def _one_row_vs_many(model, dtype=torch.float32):
    """Token 9 of a prompt: (its hidden and logits decoded alone after a prefill of tokens 0-8,
    the same row inside the prompt's 12-row prefill beside two other sequences)."""
    cfg = model.cfg
    shape = (cfg.num_layers, 2, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    prompt = [(5 * i + 1) % cfg.vocab_size for i in range(12)]
    other = [(3 * i + 2) % cfg.vocab_size for i in range(7)]
    model.kv = torch.zeros(shape, dtype=dtype)
    _forward(model, [(prompt[:9], 0)])
    h1, l1 = _forward(model, [(prompt[9:10], 9)])
    model.kv = torch.zeros(shape, dtype=dtype)
    h, lg = _forward(model, [(other, 0), (prompt, 0), (other[:2], 0)])
    row = len(other) + 9
    return (h1[0], l1[0]), (h[row], lg[row])


def test_reference_path_rows_do_not_depend_on_the_launch():
    """Torch backend, fp32: bit for bit; and the row-at-a-time forward computes the model (the
    default forward's logits to rounding)."""
    model = _model(TorchAttention, True, hidden_size=256, intermediate_size=512)
    (h1, l1), (h, lg) = _one_row_vs_many(model)
    assert torch.equal(h1, h) and torch.equal(l1, lg)
    model.deterministic = False
    (_, d1), _ = _one_row_vs_many(model)
    torch.testing.assert_close(d1, l1, atol=1e-4, rtol=1e-4)


def test_reference_path_runs_every_projection_a_row_at_a_time(monkeypatch):
    """The dispatch itself (the control where a CPU GEMM happens to round a row alike): every
    linear call of the deterministic forward gets one row, the default forward's get them all."""
    rows = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    for deterministic in (True, False):
        rows.clear()
        _one_row_vs_many(_model(TorchAttention, deterministic))
        assert (set(rows) == {1}) == deterministic, rows


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_fused_path_rows_do_not_depend_on_the_launch(monkeypatch):
    """The fused forward (Triton kernels; the interpreter on the CPU): every projection and the
    LM head through `ops.invariant_linear`, bit for bit alike; never the default kernels."""
    from engine import ops

    model = _model(RowAttention, True)
    assert model.fused and model.deterministic
    assert model.calibrate_prologue_rows() is None and model.tune_large_linears() is None
    for name in ("prologue_linear", "linear", "gemv_silu"):
        monkeypatch.setattr(ops, name, lambda *a, name=name, **k: pytest.fail(name))
    (h1, l1), (h, lg) = _one_row_vs_many(model)
    assert torch.equal(h1, h) and torch.equal(l1, lg)
    assert torch.equal(model.greedy(h1[None]), model.greedy(h[None]))


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_fused_path_default_mode_differs():
    """Negative control: the default fused forward takes a GEMV at one row and the separate
    norm and GEMM at 22, so the token's logits part in their last bits."""
    model = _model(RowAttention, False)
    (h1, l1), (h, lg) = _one_row_vs_many(model)
    assert not torch.equal(l1, lg)
    torch.testing.assert_close(l1, lg, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_fused_path_with_the_norm_apart(tile_settings, monkeypatch):
    """fp16, PREFILL_TILES from 16 rows with the norm apart (PREFILL_NORM_APART; the plain kind
    at the shape's BLOCK_K, which the interpreter's dot needs for equal sums): the 21-row
    prefill's qkv and gate_up norms run as launches of their own, and the token's
    hidden state and logits still equal its one-row decode's, bit for bit."""
    from engine.ops import invariant, prologue

    tile_settings(None, 1, 16)
    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", True)
    monkeypatch.setitem(invariant.PREFILL_TILES, "plain", (64, 64, None, 4))
    apart = []
    real = prologue.prologue_norm
    monkeypatch.setattr(invariant, "prologue_norm",
                        lambda x, *a, **k: apart.append(x.shape[0]) or real(x, *a, **k))
    model = _model(RowAttention, True).half()
    (h1, l1), (h, lg) = _one_row_vs_many(model, torch.float16)
    assert apart == [21] * 2 * model.cfg.num_layers, apart
    assert torch.equal(h1, h) and torch.equal(l1, lg)
