"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def tile_settings(monkeypatch):
    """Sets the deterministic projections' tile settings (`engine.ops.invariant`) for one test:
    ROW_TILES, LAYER_SPLITS, PREFILL_ROWS, NORM_WARPS, HEAD_ROWS, NORM_K, NORM_BLOCK_K,
    LARGE_WEIGHT and LARGE_HEADS, each at its off value (None, 1, None, None, None, None, None,
    None, False) unless given, and PREFILL_TILES where given."""
    from engine.ops import invariant

    def set_(table=None, splits: int = 1, prefill: int | None = None, warps: int | None = None,
             head: int | None = None, norm_k: int | None = None, norm_block_k: int | None = None,
             tiles: dict | None = None, large: int | None = None, large_heads: bool = False):
        for name, value in [("ROW_TILES", table), ("LAYER_SPLITS", splits),
                            ("PREFILL_ROWS", prefill), ("NORM_WARPS", warps),
                            ("HEAD_ROWS", head), ("NORM_K", norm_k),
                            ("NORM_BLOCK_K", norm_block_k), ("LARGE_WEIGHT", large),
                            ("LARGE_HEADS", large_heads)]:
            monkeypatch.setattr(invariant, name, value)
        if tiles is not None:
            monkeypatch.setattr(invariant, "PREFILL_TILES", tiles)

    return set_


@pytest.fixture
def invariant_matches_torch():
    """check(dtype, rows, seed, device): `invariant_linear` of 40 x 304 weights (K a multiple
    of 8, the 16-byte loads, not of the tiles) at each row count of `rows`, plain with a bias,
    the norm of x + residual, and gate_up's SiLU-and-mul epilogue, equals torch's to rounding,
    x + residual exactly."""
    import torch
    import torch.nn.functional as F

    from engine import ops

    def check(dtype, rows, seed: int, device: str = "cpu") -> None:
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2,
                                                                             rtol=2e-2)
        n, k = 40, 304
        g = torch.Generator().manual_seed(seed)

        def rnd(*s):
            return torch.randn(*s, generator=g).to(dtype).to(device)

        w, b, nw, gu_w = rnd(n, k) / 7, rnd(n), rnd(k), rnd(2 * n, k) / 7
        for m in rows:
            x, r = rnd(m, k), rnd(m, k)
            xf, wf = x.float(), w.float()
            torch.testing.assert_close(ops.invariant_linear(x, w, b).float(),
                                       F.linear(xf, wf, b.float()), **tol)
            y, res = ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r)
            assert torch.equal(res, (xf + r.float()).to(dtype))
            h = F.rms_norm(res.float(), (k,), nw.float(), 1e-5)
            torch.testing.assert_close(y.float(), F.linear(h, wf), **tol)
            act, _ = ops.invariant_linear(x, gu_w, norm_weight=nw, eps=1e-5, residual=r,
                                          glu=True)
            gu = F.linear(h, gu_w.float())
            torch.testing.assert_close(act.float(), F.silu(gu[:, :n]) * gu[:, n:], **tol)

    return check
