"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def tile_settings(monkeypatch):
    """Sets the deterministic projections' tile settings (`engine.ops.invariant`) for one test:
    ROW_TILES, LAYER_SPLITS, PREFILL_ROWS, NORM_WARPS and PREFILL_HEAD, each at its off value
    (None, 1, None, None, False) unless given."""
    from engine.ops import invariant

    def set_(table=None, splits: int = 1, prefill: int | None = None, warps: int | None = None,
             head: bool = False):
        for name, value in [("ROW_TILES", table), ("LAYER_SPLITS", splits),
                            ("PREFILL_ROWS", prefill), ("NORM_WARPS", warps),
                            ("PREFILL_HEAD", head)]:
            monkeypatch.setattr(invariant, name, value)

    return set_
