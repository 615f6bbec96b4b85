"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def tile_settings(monkeypatch):
    """Sets the deterministic projections' tile settings (`engine.ops.invariant`) for one test:
    ROW_TILES, LAYER_SPLITS, PREFILL_ROWS, NORM_WARPS, PREFILL_HEAD, NORM_K and NORM_BLOCK_K,
    each at its off value (None, 1, None, None, False, None, None) unless given, and
    PREFILL_TILES where given."""
    from engine.ops import invariant

    def set_(table=None, splits: int = 1, prefill: int | None = None, warps: int | None = None,
             head: bool = False, norm_k: int | None = None, norm_block_k: int | None = None,
             tiles: dict | None = None):
        for name, value in [("ROW_TILES", table), ("LAYER_SPLITS", splits),
                            ("PREFILL_ROWS", prefill), ("NORM_WARPS", warps),
                            ("PREFILL_HEAD", head), ("NORM_K", norm_k),
                            ("NORM_BLOCK_K", norm_block_k)]:
            monkeypatch.setattr(invariant, name, value)
        if tiles is not None:
            monkeypatch.setattr(invariant, "PREFILL_TILES", tiles)

    return set_
