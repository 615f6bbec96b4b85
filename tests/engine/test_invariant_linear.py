"""The deterministic mode's kernels (`ops.invariant_linear` and the row-wise kernels around it):
a row computed alone equals, bit for bit, the same row inside a launch of 5, 17 or 64 rows
whose other rows hold random values; fp32 and fp16 under Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.attention import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
COUNTS = (5, 17, 64)


def _rnd(g, dtype):
    return lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)


def _alone_equals_batched(fn, rows: torch.Tensor, picks=(0, 3)) -> None:
    """fn(rows[:m]) for each m in COUNTS: its row i equals fn(rows[i:i + 1]) bit for bit."""
    for m in COUNTS:
        out = fn(rows[:m])
        for i in (*picks, m - 1):
            alone = fn(rows[i:i + 1])
            for a, b in zip(out if isinstance(out, tuple) else (out,),
                            alone if isinstance(alone, tuple) else (alone,)):
                assert torch.equal(a[i], b[0]), (m, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(40, 48), (24, 1100), (1024, 48)],
                         ids=["one-tile", "k-loop", "vocab"])
def test_invariant_linear_rows_do_not_depend_on_the_launch(dtype, n, k):
    """Plain (with a bias), norm + residual, norm alone and SiLU-and-mul projections: each row
    alone equals the row among 4..63 random others, K in one tile or over a loop with a
    masked tail, and an LM-head-shaped weight (its own tiles)."""
    g = torch.Generator().manual_seed(n + k)
    rnd = _rnd(g, dtype)
    w, b, nw = rnd(n, k) / 7, rnd(n), rnd(k)
    x, gu = rnd(64, 2 * k), rnd(64, 2 * k)
    xr = x.view(64, 2, k)  # [x | residual] per row, so slicing rows slices both alike

    def norm_res(t):
        return ops.invariant_linear(t[:, 0], w, norm_weight=nw, eps=1e-5, residual=t[:, 1])

    _alone_equals_batched(lambda t: ops.invariant_linear(t[:, 0], w, b), xr)
    _alone_equals_batched(norm_res, xr)
    _alone_equals_batched(lambda t: ops.invariant_linear(t[:, 0], w, norm_weight=nw,
                                                         eps=1e-5), xr)
    _alone_equals_batched(lambda t: ops.invariant_linear(t, w, silu=True), gu)


@pytest.mark.parametrize("dtype,n,k", [(DTYPES[0], 40, 48), (DTYPES[1], 24, 300)],
                         ids=["fp32-one-tile", "fp16-k-loop"])
def test_gate_up_epilogue_rows_do_not_depend_on_the_launch(dtype, n, k):
    """gate_up with SiLU-and-mul in its epilogue (`glu`), after a norm of x + residual: each row
    alone equals the row among others, and every row equals `silu_mul` of the plain projection
    bit for bit through the same tiles (the epilogue rounds where the separate kernel does)."""
    g = torch.Generator().manual_seed(n * k)
    rnd = _rnd(g, dtype)
    w, nw = rnd(2 * n, k) / 7, rnd(k)
    xr = rnd(64, 2 * k).view(64, 2, k)

    def glu(t):
        return ops.invariant_linear(t[:, 0], w, norm_weight=nw, eps=1e-5, residual=t[:, 1],
                                    glu=True)

    _alone_equals_batched(glu, xr)
    act, res = glu(xr)
    gu, res2 = ops.prologue_linear(xr[:, 0], w, norm_weight=nw, eps=1e-5, residual=xr[:, 1],
                                   tiles=ops.invariant_tiles(n, k, 64, glu=True))
    assert act.shape == (64, n) and torch.equal(res, res2)
    assert torch.equal(act, ops.silu_mul(gu))


def test_tiles_come_from_the_weight_shape_alone():
    """16-row tensor-core tiles from the weight's shape below PREFILL_ROWS rows (ROW_TILES
    unset): a small decoder-layer projection all of K in one tile up to WHOLE_K keys, else
    512-key tiles; GLU and large weights LAYER_TILES; from PREFILL_ROWS PREFILL_TILES (their
    own tests); an LM head 16-row tiles below HEAD_ROWS, HEAD_TILES from it (K cut to its
    power of two), and without a row count none can be told."""
    from engine.ops.invariant import (
        BLOCK_M,
        HEAD_ROWS,
        HEAD_TILES,
        LAYER_TILES,
        PREFILL_ROWS,
        ROW_TILES,
        WHOLE_K,
    )

    assert ROW_TILES is None and BLOCK_M == 16 and WHOLE_K == 1024 and PREFILL_ROWS == 256
    want = {(960, 576, False): (32, 1024), (576, 576, False): (32, 1024),
            (40, 48, False): (32, 64), (576, 1536, False): (16, 512),
            (1536, 576, True): LAYER_TILES[:2], (4096, 4096, False): LAYER_TILES[:2],
            (14336, 4096, True): LAYER_TILES[:2]}
    for (n, k, glu), (bn, bk) in want.items():
        for m in (1, 17, PREFILL_ROWS - 1):
            assert ops.invariant_tiles(n, k, m, glu) == (16, bn, bk, LAYER_TILES[2])
        assert ops.invariant_tiles(n, k, PREFILL_ROWS, glu)[0] > 16
    assert HEAD_ROWS == 32 and HEAD_TILES == (64, 128, 64, 4)
    for m in (1, HEAD_ROWS - 1):
        assert ops.invariant_tiles(49152, 576, m) == (16, *ops.LOGITS_DOT_TILES)
    for m in (HEAD_ROWS, 2048):
        assert ops.invariant_tiles(49152, 576, m) == HEAD_TILES
        assert ops.invariant_tiles(49152, 48, m) == (64, 128, 64, 4)
        assert ops.invariant_tiles(49152, 24, m) == (64, 128, 32, 4)
    with pytest.raises(ValueError, match="row count"):
        ops.invariant_tiles(49152, 576)


def test_invariant_linear_matches_the_gemm():
    """The tiles compute the projection: against F.linear to fp32 rounding."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=g).to(DEV) for s in [(9, 300), (24, 300), (24,)])
    torch.testing.assert_close(ops.invariant_linear(x, w, b), F.linear(x, w, b),
                               atol=1e-4, rtol=1e-4)


def test_default_tiles_differ_by_row_count():
    """Negative control: the default prologue linear takes a GEMV at one row and 16-row dot
    tiles at 17, which sum in other orders, so a row alone and in a launch of 17 part."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(17, 300, generator=g).to(DEV), torch.randn(24, 300, generator=g).to(DEV)
    assert ops.linear_tiles(1, 24, 300)[0] != ops.linear_tiles(17, 24, 300)[0]
    batched = ops.prologue_linear(x, w)
    alone = torch.cat([ops.prologue_linear(x[i:i + 1], w) for i in range(17)])
    assert not torch.equal(batched, alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_kernels_do_not_depend_on_the_launch(dtype):
    """add + RMSNorm (alone and with a residual), SiLU-and-mul and the row argmax of a vocabulary
    past ARGMAX_SPLIT (two launches, chunks side by side) take one program per row."""
    g = torch.Generator().manual_seed(4)
    rnd = _rnd(g, dtype)
    nw = rnd(48)
    xr = rnd(64, 2, 48)
    _alone_equals_batched(lambda t: ops.add_rmsnorm(t[:, 0], nw, 1e-5, t[:, 1]), xr)
    _alone_equals_batched(lambda t: ops.add_rmsnorm(t[:, 0].contiguous(), nw, 1e-5), xr)
    _alone_equals_batched(ops.silu_mul, rnd(64, 80))
    logits = rnd(64, ops.ARGMAX_SPLIT + 100)
    logits[:, 7] = logits[:, 8200] = 1e4  # a tie across chunks: the lower index wins
    _alone_equals_batched(ops.argmax_rows, logits)
    assert ops.argmax_rows(logits[:5]).tolist() == [7] * 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rows_do_not_depend_on_the_launch(dtype):
    """Rotary + KV store per token: elementwise with no fused multiply-add, so a token's q, k and
    cached k, v are the same bits alone or beside others."""
    g = torch.Generator().manual_seed(5)
    rnd = _rnd(g, dtype)
    nq, nkv, d, t = 4, 2, 16, 17
    cos, sin = torch.rand(64, d, generator=g).to(DEV), torch.rand(64, d, generator=g).to(DEV)
    heads = rnd(t, nq + 2 * nkv, d)
    pos = torch.randint(0, 64, (t,), generator=g).to(DEV)
    cache = torch.zeros(2, 8, 4, nkv, d, dtype=dtype, device=DEV)
    slots = torch.arange(t, device=DEV)
    together = ops.rope_store_(heads.clone(), nq, nkv, pos, cos, sin, cache, slots)
    cache1 = torch.zeros_like(cache)
    for i in range(t):
        alone = ops.rope_store_(heads[i:i + 1].clone(), nq, nkv, pos[i:i + 1], cos, sin,
                                cache1, slots[i:i + 1])
        assert torch.equal(together[i], alone[0]), i
    assert torch.equal(cache, cache1)
