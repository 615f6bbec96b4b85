"""bench.live_rows' tile overrides (the GPU timing itself runs on the H200 only)."""

from __future__ import annotations


def test_tile_overrides_give_each_named_projection_its_tiles_at_every_row_count():
    from bench.live_rows import SMOL, tile_overrides
    from engine import ops

    got = tile_overrides({"gate_up": "8x1024w2", "qkv": "4x1024w1"})
    n, k = SMOL["gate_up"]
    assert {got[(q, n, k)] for q in range(1, 9)} == {(1, 8, 1024, 2)}
    n, k = SMOL["qkv"]
    assert {got[(q, n, k)] for q in range(1, 9)} == {(1, 4, 1024, 1)}
    assert len(got) == 16  # o and down keep the engine's tiles
    saved = dict(ops.LINEAR_TILES)
    try:  # what the timed layer stack launches with: the override, whatever the defaults
        ops.LINEAR_TILES.update(got)
        assert ops.linear_tiles(3, *SMOL["gate_up"]) == (1, 8, 1024, 2)
        assert ops.linear_tiles(3, *SMOL["o"]) != (1, 8, 1024, 2) or ops.WIDE_GEMV
    finally:
        ops.LINEAR_TILES.clear()
        ops.LINEAR_TILES.update(saved)
