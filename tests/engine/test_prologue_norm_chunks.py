"""The prologue linear's norm summed in fixed chunks (`prologue_linear(norm_k=...)`), under
Triton's interpreter: the result still matches torch, and a row's norm no longer follows the
tile's BLOCK_K or the rows beside it, which a weight that copies its input columns shows bit for
bit (the products of one-hot rows are exact, so the output is the normed input itself)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.attention import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
K = 300  # three 128-key chunks, the last masked


def _inputs(m: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(m, K, generator=g).to(dtype).to(DEV) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(DEV)
    return x, r, nw


def _copy(x, r, nw, tiles, norm_k):
    """The normed x + r of each row, through a weight whose row j picks column j."""
    eye = torch.eye(K, dtype=x.dtype, device=x.device)[:64]
    y, _ = ops.prologue_linear(x, eye, norm_weight=nw, eps=1e-5, residual=r, tiles=tiles,
                               norm_k=norm_k)
    return y


TILES = [(16, 32, 64, 4), (16, 16, 512, 4), (32, 64, 128, 4), (64, 64, 256, 4)]


def test_chunked_norm_does_not_follow_the_tiles():
    """norm_k 128: every tile shape (BLOCK_K 64 to 512, 16 to 64 rows) gives every row the same
    bits, alone or among 40; without it, BLOCK_K changes the sums' order and some rows' bits
    (the control)."""
    x, r, nw = _inputs(40)
    ref = _copy(x, r, nw, TILES[0], 128)
    for tiles in TILES[1:]:
        assert torch.equal(_copy(x, r, nw, tiles, 128), ref), tiles
    for i in (0, 17, 39):
        assert torch.equal(_copy(x[i:i + 1], r[i:i + 1], nw, TILES[2], 128)[0], ref[i])
    plain = [_copy(x, r, nw, tiles, 0) for tiles in (TILES[0], TILES[1])]
    assert not torch.equal(*plain)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_norm_matches_torch(dtype, splits):
    """norm_k 64 and 128, at 1, 9 and 40 rows, plain and with gate_up's SiLU-and-mul, unsplit
    and in 2 K-splits: torch's rms_norm of x + residual, then the projection, to rounding; x +
    residual exactly."""
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    g = torch.Generator().manual_seed(splits)
    w, gu = (torch.randn(n, K, generator=g).div(7).to(dtype).to(DEV) for n in (40, 80))
    for norm_k in (64, 128):
        for m in (1, 9, 40):
            x, r, nw = _inputs(m, dtype, seed=m)
            h = F.rms_norm((x.float() + r.float()).to(dtype).float(), (K,), nw.float(), 1e-5)
            y, res = ops.prologue_linear(x, w, norm_weight=nw, eps=1e-5, residual=r,
                                         tiles=(16, 32, 128, 4), splits=splits, norm_k=norm_k)
            assert torch.equal(res, (x.float() + r.float()).to(dtype))
            torch.testing.assert_close(y.float(), F.linear(h, w.float()), **tol)
            act, _ = ops.prologue_linear(x, gu, norm_weight=nw, eps=1e-5, residual=r,
                                         tiles=(16, 32, 128, 4), glu=True, norm_k=norm_k)
            want = F.linear(h, gu.float())
            torch.testing.assert_close(act.float(), F.silu(want[:, :40]) * want[:, 40:], **tol)


@pytest.mark.parametrize("norm_k,norm", [(100, True), (8, True), (128, False)],
                         ids=["not-pow2", "too-small", "no-norm"])
def test_bad_norm_k_raises(norm_k, norm):
    """A chunk that is no power of two >= 16, or one without a norm to sum, is refused."""
    x, r, nw = _inputs(2)
    w = torch.ones(16, K, device=DEV)
    kw = dict(norm_weight=nw, eps=1e-5, residual=r) if norm else {}
    with pytest.raises(ValueError, match="norm_k"):
        ops.prologue_linear(x, w, tiles=(16, 16, 128, 4), norm_k=norm_k, **kw)
