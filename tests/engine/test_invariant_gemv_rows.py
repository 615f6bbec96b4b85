"""The deterministic projections' opt-in GEMV rows (`invariant.LAYER_GEMV`, `prologue_linear`'s
`rows`): each program holds a column block's weights over all of K and computes its rows in
turn. On the CPU (Triton's interpreter, fp32 and fp16): the results match torch and the
one-program-per-row GEMV, and each row's bits are the same alone and among 3, 17 and 40 rows,
for every prologue (none, norm + residual, SiLU-and-mul, gate-up's epilogue). On a GPU (bf16,
SmolLM2-135M's shapes): the same bits alone and among 8, 64 and 2048 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.attention import triton_available
from engine.ops import invariant
from engine.ops.prologue import prologue_linear

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["plain", "norm", "silu", "glu"]


def _case(kind: str, m: int, n: int, k: int, dtype, seed: int = 0):
    """(x, weight, kwargs) of a projection of kind `kind` over m rows."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)

    w = rnd(2 * n if kind == "glu" else n, k, scale=k ** -0.5)
    x = rnd(m, 2 * k if kind == "silu" else k)
    kw = {"silu": True} if kind == "silu" else {}
    if kind in ("norm", "glu"):
        kw = {"norm_weight": rnd(k).abs() + 0.5, "eps": 1e-5, "residual": rnd(m, k),
              "glu": kind == "glu"}
    return x, w, kw


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _torch(kind, x, w, kw):
    """The same projection in torch (fp32)."""
    x, w = x.float(), w.float()
    if kind == "silu":
        g, u = x.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w)
    if kind in ("norm", "glu"):
        h = x + kw["residual"].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + kw["eps"]) * kw["norm_weight"].float()
        y = F.linear(h, w)
        if kind == "glu":
            g, u = y.chunk(2, dim=-1)
            return F.silu(g) * u
        return y
    return F.linear(x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_rows_match_torch_and_the_one_row_gemv(kind, dtype):
    n, k, m = 24, 48, 5
    x, w, kw = _case(kind, m, n, k, dtype)
    tiles = (1, 8, 64, 1)
    rows = _out(prologue_linear(x, w, tiles=tiles, rows=3, **kw))
    gemv = _out(prologue_linear(x, w, tiles=tiles, **kw))
    assert torch.equal(rows, gemv)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rows.float(), _torch(kind, x, w, kw), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_alone_and_in_any_launch(kind):
    n, k, big = 24, 40, 40
    x, w, kw = _case(kind, big, n, k, torch.float16, seed=1)
    tiles = (1, 8, 64, 1)
    full = _out(prologue_linear(x, w, tiles=tiles, rows=4, **kw))
    for m in (1, 3, 17):
        part = {key: (v[:m] if key == "residual" else v) for key, v in kw.items()}
        got = _out(prologue_linear(x[:m].contiguous(), w, tiles=tiles, rows=4, **part))
        assert torch.equal(got, full[:m]), m


def test_rows_take_gemv_tiles_over_all_of_k():
    x, w, _ = _case("plain", 4, 24, 48, torch.float32)
    with pytest.raises(AssertionError, match="GEMV tiles over all of K"):
        prologue_linear(x, w, tiles=(16, 16, 64, 4), rows=2)
    with pytest.raises(AssertionError, match="GEMV tiles over all of K"):
        prologue_linear(x, w, tiles=(1, 8, 16, 1), rows=2)


def test_layer_gemv_sets_the_decoder_layers_projections(monkeypatch):
    """With LAYER_GEMV set, a decoder layer's projection takes GEMV tiles holding all of K and
    its rows, from the weight's shape alone; an LM head keeps its tensor-core tiles; and
    `invariant_linear` gives what `prologue_linear` gives with them."""
    assert invariant.invariant_gemv(960, 576) is None  # off by default
    monkeypatch.setattr(invariant, "LAYER_GEMV", (8, 4, 16))
    assert invariant.invariant_gemv(960, 576) == ((1, 8, 1024, 4), 16)
    assert invariant.invariant_gemv(576, 1536) == ((1, 8, 2048, 4), 16)
    assert invariant.invariant_gemv(49152, 576) is None
    assert invariant.invariant_gemv(4096, 14336) is None  # Llama-8B's down: the tiles instead
    x, w, kw = _case("norm", 6, 24, 48, torch.float32)
    want = _out(prologue_linear(x, w, tiles=(1, 8, 64, 4), rows=16, **kw))
    assert torch.equal(_out(ops.invariant_linear(x, w, **kw)), want)
    for bad in ((12, 4, 16), (8, 0, 16), (8, 4, 0)):
        monkeypatch.setattr(invariant, "LAYER_GEMV", bad)
        with pytest.raises(ValueError, match="LAYER_GEMV"):
            ops.invariant_linear(x, w, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.parametrize("kind,n,k", [("norm", 960, 576), ("plain", 576, 576),
                                      ("glu", 1536, 576), ("plain", 576, 1536)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_rows_alone_equal_batched_gpu(monkeypatch, kind, n, k, rows):
    monkeypatch.setattr(invariant, "LAYER_GEMV", (8, 4, rows))
    x, w, kw = _case(kind, 2048, n, k, torch.bfloat16, seed=2)
    full = _out(ops.invariant_linear(x, w, **kw))
    for m in (1, 8, 64):
        part = {key: (v[:m] if key == "residual" else v) for key, v in kw.items()}
        assert torch.equal(_out(ops.invariant_linear(x[:m].contiguous(), w, **part)), full[:m])
