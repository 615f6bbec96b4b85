"""The deterministic projections of a large model's weights (`invariant.LARGE_WEIGHT`): which
launches take `dot_tiles`' pipelined tiles (LARGE_TILES by row count), bad settings refused by
name, and results equal to torch's with the norm and SiLU-and-mul apart (Triton's interpreter,
fp16). The GPU cases (each row's bits alone and among 2048, bf16, Llama-8B's shapes) are in
test_invariant_row_tiles.py."""

from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.attention import triton_available
from engine.ops import invariant

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
SHIPPED = invariant.LARGE_WEIGHT
SHIPPED_TILES = invariant.LARGE_TILES
SMALL_TILES = ((1, 0, (16, 32, 32, 2, 4)), (None, 0, (32, 64, 64, 2, 4)))  # interpreter-sized


def test_large_weights_take_the_pipelined_tiles(tile_settings):
    """A decoder layer's weight above LARGE_WEIGHT elements (gate_up counting both halves)
    takes LARGE_TILES' first entry for its row count and columns ([gate | up]'s both halves), in
    16-bit activations on PREFILL_TILES' devices; a small model's weights, an LM head, fp32
    activations, another GPU and LARGE_WEIGHT None keep the other tiles."""
    tile_settings(large=SHIPPED)
    table = invariant.LARGE_TILES
    assert table[-1][:2] == (None, 0)
    for m in (1, 16, 17, 64, 65, 128, 129, 2048):
        for n, k, glu in [(6144, 4096, False), (4096, 14336, False), (14336, 4096, True)]:
            cols = 2 * n if glu else n
            want = next(t for rows, least, t in table
                        if (rows is None or m <= rows) and cols >= least)
            assert invariant.large_tiles(n, k, m, glu, False, True, 2) == want
    # at 17-64 rows gate_up's 28672 columns take 64-row tiles, the narrower 16-row ones
    wide, narrow = (invariant.large_tiles(n, 4096, 64, g, False, True, 2)
                    for n, g in [(14336, True), (6144, False)])
    assert wide[0] == 64 and narrow[0] == 16 and wide != narrow
    assert invariant.large_tiles(6144, 4096, 1, False, False, True, 2)[0] == 16
    assert invariant.large_tiles(6144, 4096, 2048, False, False, True, 2)[0] > 16
    assert invariant.large_tiles(1024, 2048, 1, True, False, True, 2) is None  # 2 x 2M: 4M
    assert invariant.large_tiles(1024, 4096, 1, True, False, True, 2) is not None  # 2 x 4M
    for args in [(960, 576, 1, False, False, True, 2),  # SmolLM2's qkv
                 (128256, 4096, 1, False, False, True, 2),  # an LM head by its shape
                 (4096, 4096, 1, False, True, True, 2),  # one said to be a head
                 (4096, 4096, 1, False, False, True, 4),  # fp32
                 (4096, 4096, 1, False, False, False, 2)]:  # not sm_90
        assert invariant.large_tiles(*args) is None, args
    tile_settings(large=None)
    assert invariant.large_tiles(4096, 4096, 1, False, False, True, 2) is None


def test_large_heads_take_the_pipelined_tiles_where_opted_in(tile_settings, monkeypatch):
    """LARGE_HEADS: an LM head over LARGE_WEIGHT takes LARGE_TILES by rows and columns like a
    layer's weight, SmolLM2's and Llama-8B's alike; a head at or under it, fp32 activations
    and another GPU still do not; a non-bool refused by name."""
    tile_settings(large=SHIPPED)
    monkeypatch.setattr(invariant, "LARGE_HEADS", True)
    for n, k in [(49152, 576), (128256, 4096)]:
        for m in (1, 64, 384):
            want = next(t for rows, least, t in invariant.LARGE_TILES
                        if (rows is None or m <= rows) and n >= least)
            assert invariant.large_tiles(n, k, m, False, True, True, 2) == want
        assert invariant.large_tiles(n, k, 1, False, True, True, 4) is None
        assert invariant.large_tiles(n, k, 1, False, True, False, 2) is None
    assert invariant.large_tiles(4096, 576, 1, False, True, True, 2) is None  # 2.4M: small
    monkeypatch.setattr(invariant, "LARGE_HEADS", 1)
    with pytest.raises(ValueError, match="LARGE_HEADS"):
        invariant.large_tiles(128256, 4096, 1, False, True, True, 2)


def test_large_head_logits_match_torch_and_keep_rows(tile_settings, monkeypatch):
    """With LARGE_HEADS and interpreter-sized LARGE_TILES, an LM head's logits through
    `invariant_linear` go through `dot_tiles`, equal torch's to rounding, and each row alone
    equals the same row among 40 (Triton's interpreter, fp16)."""
    tile_settings(large=0)
    monkeypatch.setattr(invariant, "LARGE_TILES", SMALL_TILES)
    monkeypatch.setattr(invariant, "LARGE_HEADS", True)
    seen = []
    real = invariant.dot_tiles
    monkeypatch.setattr(invariant, "dot_tiles",
                        lambda x, w, b, t: seen.append(x.shape[0]) or real(x, w, b, t))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 64, generator=g).half(), (torch.randn(1024, 64, generator=g) / 8).half()
    y = ops.invariant_linear(x, w, head=True)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for i in (0, 17, 39):
        assert torch.equal(ops.invariant_linear(x[i:i + 1], w, head=True)[0], y[i]), i
    assert seen == [40, 1, 1, 1]


@pytest.mark.parametrize("name,value", [
    ("LARGE_WEIGHT", -1), ("LARGE_WEIGHT", 1.5), ("LARGE_WEIGHT", "4M"),
    ("LARGE_TILES", ((16, 0, (16, 32, 256, 5, 4)),)),  # no catch-all last
    ("LARGE_TILES", ((None, 4096, (16, 32, 256, 5, 4)),)),  # a catch-all with min_cols
    ("LARGE_TILES", ((None, 0, (16, 48, 256, 5, 4)),)),  # BLOCK_N not a power of two
    ("LARGE_TILES", ((None, 0, (24, 32, 256, 5, 4)),)),  # BLOCK_M not an MMA's
    ("LARGE_TILES", ((None, 0, (16, 32, 256, 5, 2)),)),  # warps
    ("LARGE_TILES", ((None, 0, (16, 32, 256, 5)),)), ("LARGE_TILES", None),
    ("LARGE_TILES", ((None, (16, 32, 256, 5, 4)),)),  # no min_cols
    ("LARGE_TILES", ((None, -1, (16, 32, 256, 5, 4)),)),
    ("LARGE_TILES", (16, 0, (16, 32, 256, 5, 4))),  # one entry, not a table
    ("LARGE_TILES", ((128, 0, (16, 32, 256, 5, 4)), (16, 0, (64, 64, 64, 4, 4)),
                     (None, 0, (128, 128, 64, 4, 8)))),  # max_rows decreasing
    ("LARGE_TILES", ((0, 0, (16, 32, 256, 5, 4)), (None, 0, (128, 128, 64, 4, 8)))),
    ("LARGE_TILES", ()), ("LARGE_TILES", [(None, 0, (16, 32, 256, 5, 4))])])  # a list
def test_bad_large_settings_raise(tile_settings, monkeypatch, name, value):
    """A malformed LARGE_WEIGHT or LARGE_TILES is refused by name at the first large weight."""
    tile_settings(large=SHIPPED)
    monkeypatch.setattr(invariant, name, value)
    with pytest.raises(ValueError, match=name):
        invariant.large_tiles(4096, 4096, 1, False, False, True, 2)


def test_a_bool_large_table_is_refused_after_the_equal_int_one(tile_settings, monkeypatch):
    """min_cols False equals and hashes as 0: the validation's memo, filled by the shipped
    table, still refuses the table holding it."""
    tile_settings(large=SHIPPED)
    assert invariant.large_tiles(4096, 4096, 1, False, False, True, 2) is not None
    (rows, cols, tiles), *rest = invariant.LARGE_TILES
    assert cols == 0
    monkeypatch.setattr(invariant, "LARGE_TILES", ((rows, False, tiles), *rest))
    assert invariant.LARGE_TILES == SHIPPED_TILES
    with pytest.raises(ValueError, match="LARGE_TILES"):
        invariant.large_tiles(4096, 4096, 1, False, False, True, 2)


def test_large_path_matches_torch(tile_settings, invariant_matches_torch, monkeypatch):
    """With LARGE_WEIGHT 0 (every decoder weight large) and interpreter-sized LARGE_TILES, at
    1, 9 and 130 rows (one tile, then both): plain with a bias, the norm of x + residual and
    gate_up's SiLU-and-mul equal torch's to rounding and x + residual exactly, every launch
    through `dot_tiles` at its count's tiles."""
    tile_settings(large=0)
    monkeypatch.setattr(invariant, "LARGE_TILES", SMALL_TILES)
    seen = []
    real = invariant.dot_tiles

    def spy(x, w, b, tiles):
        seen.append((x.shape[0], tiles))
        return real(x, w, b, tiles)

    monkeypatch.setattr(invariant, "dot_tiles", spy)
    invariant_matches_torch(torch.float16, (1, 9, 130), 7)
    assert {m for m, _ in seen} == {1, 9, 130} and len(seen) == 9
    assert all(t == (SMALL_TILES[0][2] if m == 1 else SMALL_TILES[1][2]) for m, t in seen)


def test_large_path_rows_keep_their_bits(tile_settings, monkeypatch):
    """Through a weight that copies its input columns (exact products), each row's normed input
    and x + residual alone equal the same row among 40 (16-row tiles alone, 32-row ones among
    them; Triton's interpreter, fp16)."""
    tile_settings(large=0)
    monkeypatch.setattr(invariant, "LARGE_TILES", SMALL_TILES)
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(40, 304, generator=g).half() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(304, generator=g)).half()
    eye = torch.eye(304, dtype=torch.float16)[:64]
    y, res = ops.invariant_linear(x, eye, norm_weight=nw, eps=1e-5, residual=r)
    want, want_res = ops.add_rmsnorm(x, nw, 1e-5, r)
    assert torch.equal(y, want[:, :64]) and torch.equal(res, want_res)
    for i in (0, 15, 39):
        yi, ri = ops.invariant_linear(x[i:i + 1], eye, norm_weight=nw, eps=1e-5,
                                      residual=r[i:i + 1])
        assert torch.equal(yi[0], y[i]) and torch.equal(ri[0], res[i]), i


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_dot_tiles_grid_order_covers_every_tile_alike(monkeypatch, group):
    """`dot_tiles` walks GROUP_M row blocks per column block, the last group part-full (5 row
    blocks x 3 column blocks): every output is written, equal to torch's to rounding and bit
    for bit to the column-blocks-first order's (Triton's interpreter, fp32)."""
    from engine.ops import gemv

    g = torch.Generator().manual_seed(11 + group)  # no stale buffer of another case matches
    x, w, b = torch.randn(70, 64, generator=g), torch.randn(48, 64, generator=g), \
        torch.randn(48, generator=g)
    tiles = (16, 16, 32, 2, 4)
    monkeypatch.setattr(gemv, "DOT_GROUP_M", 1)
    ref = gemv.dot_tiles(x, w, b, tiles)
    monkeypatch.setattr(gemv, "DOT_GROUP_M", group)
    y = gemv.dot_tiles(x, w, b, tiles)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, ref)
