"""The deterministic projections' opt-in tiles by row count (`invariant.ROW_TILES`). On the CPU:
the table picks each launch's BLOCK_M and BLOCK_N by its row count for the decoder layer's
projections only, bad tables are refused, `invariant_linear` hands the chosen tiles to
`prologue_linear`, and the results match torch (Triton's interpreter, fp32 and fp16). On a GPU
(bf16, SmolLM2-135M's and Llama-8B's projection shapes): each row's bits are the same alone and
among 8, 64 and 2048 rows, with the 16-row tiles and with a table that gives each of those
counts other tiles, unsplit and in 4 K-splits, with PREFILL_TILES (`PREFILL_ROWS`) and with
NORM_WARPS; and whether those give the 16-row tiles' bits; an LM head's HEAD_TILES likewise;
a norm apart from its projection (PREFILL_NORM_APART) likewise; a large model's weights in
`dot_tiles` (LARGE_WEIGHT) likewise, and its plain projections with the 16-row tiles' bits."""

from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.attention import triton_available
from engine.ops import invariant

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TABLE = ((1, 16, 16), (16, 16, 32), (1000000000, 32, 64))  # the module docstring's example
# Distinct tiles at 1, 8, 64 and 2048 rows: each launch of the GPU cases takes its own.
SPAN = ((1, 16, 16), (8, 16, 32), (64, 32, 64), (1000000000, 32, 128))
# The same with 64-row warp-group MMA tiles at 2048 rows (32 columns: BLOCK_K 1024 fits).
WIDE = ((1, 16, 16), (8, 16, 32), (64, 32, 64), (1000000000, 64, 32))
SHIPPED_HEAD_ROWS, SHIPPED_HEAD_TILES = invariant.HEAD_ROWS, invariant.HEAD_TILES


@pytest.fixture
def consts(tile_settings):
    """(table, splits, prefill, warps, head, ...): the tile settings for one test (conftest)."""
    return tile_settings


def _parts(out):
    return out if isinstance(out, tuple) else (out,)


def test_table_picks_tiles_by_row_count(consts):
    """The first entry whose max_rows holds the launch's rows gives BLOCK_M and BLOCK_N; BLOCK_K
    and the warps stay the shape's (no norm prologue here, whose warps NORM_WARPS sets), an LM
    head keeps its tiles, the splits follow the shape."""
    consts(TABLE)
    want = {0: (16, 16), 1: (16, 16), 2: (16, 32), 16: (16, 32), 17: (32, 64), 2048: (32, 64)}
    for m, (bm, bn) in want.items():
        for n, k, glu in [(960, 576, False), (1536, 576, True), (576, 1536, False)]:
            _, bk, warps = invariant.layer_tiles(n, k, glu)
            assert invariant.invariant_tiles(n, k, m, glu) == (bm, bn, bk, warps)
        assert invariant.invariant_tiles(40, 48, m) == (bm, bn, 64, 4)  # K in one tile
        assert invariant.invariant_tiles(49152, 576, m) == (16, *ops.LOGITS_DOT_TILES)
    assert invariant.invariant_splits(576, 1536) == 1
    with pytest.raises(ValueError, match="row count"):
        invariant.invariant_tiles(960, 576)
    assert invariant.invariant_tiles(49152, 576) == (16, *ops.LOGITS_DOT_TILES)
    consts(((8, 32, 16),))
    with pytest.raises(ValueError, match="up to 8 rows, not 9"):
        invariant.invariant_tiles(960, 576, 9)


def test_a_norm_walking_long_k_tiles_stays_within_shared_memory(consts):
    """A norm prologue walking K in 512-key tiles (Qwen-1.5B's qkv) takes at most 32 rows and
    NORM_LOOP_BLOCK_N columns of a table's tiles (SPAN's 32 x 128 and WIDE's 64 x 32 overflow
    an H100's shared memory there), its BLOCK_K and warps the shape's; other projections
    take the table's."""
    n, k = 2048, 1536
    bk, warps = invariant.layer_tiles(n, k)[1:]
    assert invariant.norm_loops(k, bk)
    for table in (SPAN, WIDE):
        consts(table)
        assert invariant.invariant_tiles(n, k, 2048, norm=True) == (
            32, invariant.NORM_LOOP_BLOCK_N, bk, warps)
        assert invariant.invariant_tiles(n, k, 2048)[:2] == table[-1][1:]
        assert invariant.invariant_tiles(960, 576, 2048, norm=True)[:2] == table[-1][1:]


@pytest.mark.parametrize("table,match", [
    ((), "must be None or"),
    ("((1,16,16),(10**9,32,64))", "must be None or"),  # what --set makes of a non-literal
    ([[1, 16, 16]], "must be None or"),
    (((1, 16),), "is not"),
    (((1.0, 16, 16),), "is not"),
    (((1, 128, 16),), "BLOCK_M 128"),
    (((1, 8, 16),), "BLOCK_M 8"),
    (((1, 16, 24),), "BLOCK_N 24"),
    (((1, 16, 8),), "BLOCK_N 8"),
    (((0, 16, 16),), "increase"),
    (((16, 16, 32), (8, 16, 16)), "increase"),
    (((1, 16, 16), (1, 16, 32)), "increase"),
], ids=["empty", "string", "list", "pair", "float", "bm128", "bm8", "bn24", "bn8", "zero",
        "decreasing", "repeated"])
def test_bad_tables_raise(consts, table, match):
    """A malformed table is refused with a ValueError naming what is wrong, at the first
    projection of a decoder layer's shape."""
    consts(table)
    with pytest.raises(ValueError, match=match):
        invariant.invariant_tiles(960, 576, 1)


def test_a_bool_is_refused_after_the_equal_int_table_passed(consts):
    """(True, 16, 16) equals and hashes as (1, 16, 16): the validation's memo tells them apart."""
    for tiles in (invariant.invariant_tiles, invariant.cached_tiles):  # the launches' path
        consts(((1, 16, 16), (10**9, 32, 64)))
        assert tiles(960, 576, 1)[:2] == (16, 16)
        consts(((True, 16, 16), (10**9, 32, 64)))
        with pytest.raises(ValueError, match="is not"):
            tiles(960, 576, 1)


def test_the_documented_setting_parses_to_a_valid_table():
    """The module docstring's `--set` value is a literal the bench turns into a valid table."""
    from bench.suite import parse_setting

    path, value = parse_setting(f"engine.ops.invariant.ROW_TILES={TABLE!r}".replace(" ", ""))
    assert (path, value) == ("engine.ops.invariant.ROW_TILES", TABLE)
    assert f"ROW_TILES={TABLE!r}".replace(" ", "") in invariant.__doc__.replace("\n", "")
    assert invariant.row_tiles(value, 5) == (16, 32)


def test_invariant_linear_hands_the_chosen_tiles_on(consts, monkeypatch):
    """Each launch reaches `prologue_linear` with the tiles of its own row count (gate_up's
    by its halves' shape), the splits from the shape; an LM head with its own tiles."""
    consts(TABLE, 2)
    seen = []
    real = invariant.prologue_linear

    def spy(x, w, *a, **kw):
        seen.append((x.shape[0], kw["tiles"], kw["splits"]))
        return real(x, w, *a, **kw)

    monkeypatch.setattr(invariant, "prologue_linear", spy)
    g = torch.Generator().manual_seed(7)
    w, gu, head = (torch.randn(*s, generator=g).to(DEV) for s in [(40, 300), (80, 300),
                                                                    (1024, 48)])
    for m in (1, 10, 40):
        ops.invariant_linear(torch.randn(m, 300, generator=g).to(DEV), w)
        ops.invariant_linear(torch.randn(m, 300, generator=g).to(DEV), gu, glu=True)
        ops.invariant_linear(torch.randn(m, 48, generator=g).to(DEV), head)
    layer = {1: (16, 16), 10: (16, 32), 40: (32, 64)}
    want = []
    for m, (bm, bn) in layer.items():
        want += [(m, (bm, bn, 128, 4), 2)] * 2 + [(m, (16, *ops.LOGITS_DOT_TILES[:1], 64, 4), 1)]
    assert seen == want


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_tiles_match_torch(consts, invariant_matches_torch, dtype, splits):
    """With the table set, at 1, 9 and 40 rows (one 16-row tile of 16 columns, 16 x 32, two
    32-row tiles of 64 with masked rows), K over a loop with a masked tail: plain with a bias,
    the norm of x + residual, gate_up's SiLU-and-mul epilogue equal torch's to rounding and
    x + residual exactly."""
    consts(TABLE, splits)
    invariant_matches_torch(dtype, (1, 9, 40), splits, DEV)


# GPU: the decoder layer's projections of SmolLM2-135M and Llama-8B as the deterministic
# forward runs them: weight [N, K], gate_up with SiLU-and-mul in its epilogue, the norm of x +
# residual in the prologue of qkv and gate_up; and a K of one tile, whose norm prologue loads
# x + residual once for the sums and the products (`ONE_LOAD`).
LAYER_SHAPES = [
    pytest.param(64, 96, False, True, id="one-tile"),
    pytest.param(960, 576, False, True, id="smol-qkv"),
    pytest.param(576, 576, False, False, id="smol-o"),
    pytest.param(3072, 576, True, True, id="smol-gate_up"),
    pytest.param(576, 1536, False, False, id="smol-down"),
    pytest.param(2048, 1536, False, True, id="qwen1.5b-qkv"),  # a norm walking 512-key tiles
    pytest.param(6144, 4096, False, True, id="llama8b-qkv"),
    pytest.param(4096, 4096, False, False, id="llama8b-o"),
    pytest.param(28672, 4096, True, True, id="llama8b-gate_up"),
    pytest.param(4096, 14336, False, False, id="llama8b-down"),
]
BATCHES = (8, 64, 2048)
ALONE = (0, 5, 7, 40, 63, 1031, 2047)  # rows computed alone: in each batch that holds them


def _layer(n: int, k: int, glu: bool, norm: bool):
    """(projection of rows [x | residual], 2048 such bf16 rows) for a weight of [n, k]."""
    g = torch.Generator(device="cuda").manual_seed(n + k)

    def rnd(*s):
        return torch.randn(*s, generator=g, device="cuda")

    w = (rnd(n, k) * k ** -0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * rnd(k)).to(torch.bfloat16)
    rows = rnd(2048, 2, k).to(torch.bfloat16)

    def proj(t):
        if norm:
            return ops.invariant_linear(t[:, 0], w, norm_weight=nw, eps=1e-5, residual=t[:, 1],
                                        glu=glu)
        return ops.invariant_linear(t[:, 0], w, glu=glu)

    return proj, rows


def _alone(proj, rows) -> dict:
    return {i: _parts(proj(rows[i:i + 1])) for i in ALONE}


def _alone_equals_batched(proj, rows, batches=BATCHES) -> None:
    """Each row of ALONE computed alone equals the same row among each of `batches` that holds
    it, every output bit for bit."""
    alone = _alone(proj, rows)
    for m in batches:
        out = _parts(proj(rows[:m]))
        for i in (i for i in ALONE if i < m):
            for a, b in zip(out, alone[i]):
                assert torch.equal(a[i], b[0]), (m, i)


@pytest.mark.gpu
@pytest.mark.parametrize("table,splits,prefill,warps", [
    (None, 1, None, None), (None, 4, None, None), (SPAN, 1, None, None), (SPAN, 4, None, None),
    (WIDE, 1, None, None), (None, 1, 64, None), (None, 4, 64, None), (None, 1, 64, 8),
    (SPAN, 1, None, 8), (None, 4, 64, 8)],
    ids=["default", "default-split4", "row-tiles", "row-tiles-split4", "row-tiles-wide",
         "prefill", "prefill-split4", "norm-warps8", "row-tiles-norm-warps8",
         "split4-norm-warps8"])
@pytest.mark.parametrize("n,k,glu,norm", LAYER_SHAPES)
def test_rows_alone_equal_batched_gpu(consts, table, splits, prefill, warps, n, k, glu, norm):
    """bf16 on the GPU: each row of ALONE computed alone equals, bit for bit, the same row among
    8, 64 and 2048 (of those that hold it), outputs and x + residual, with the 16-row tiles and
    with SPAN's (other tiles at each of those counts), unsplit and in 4 K-splits, with WIDE's
    64-row warp-group tiles at 2048, with PREFILL_TILES from 64 rows, and with NORM_WARPS 8
    below them (NORM_WARPS 8 is the default). All passed on an H200 at e00f556; ROW_TILES
    stays opt-in for want of a measured gain."""
    consts(table, splits, prefill, warps)
    half = n // 2 if glu else n
    counts = (1, *BATCHES)
    distinct = {invariant.invariant_tiles(half, k, m, glu, norm) for m in counts}
    # ROW_TILES: other tiles at each count, but where a norm walks K in >128-key tiles its
    # cap (at most 32 x NORM_LOOP_BLOCK_N) makes the two largest alike
    capped = norm and invariant.norm_loops(k, invariant.layer_tiles(half, k, glu)[1])
    assert len(distinct) == ((len(counts) - capped) if table else 2 if prefill else 1)
    _alone_equals_batched(*_layer(n, k, glu, norm))


@pytest.mark.gpu
@pytest.mark.parametrize("table,prefill,warps", [(SPAN, None, None), (WIDE, None, None),
                                                  (None, 1, None), (None, None, 8)],
                         ids=["span", "wide", "prefill", "norm-warps8"])
@pytest.mark.parametrize("n,k,glu,norm", LAYER_SHAPES)
def test_row_tiles_give_the_default_bits_gpu(consts, table, prefill, warps, n, k, glu, norm):
    """bf16 on the GPU: SPAN's (and WIDE's warp-group) tiles, PREFILL_TILES at every count, and
    8 warps on a norm prologue's 16-row tiles give every row the 16-row tiles' bits (alone and
    among 2048). Required of PREFILL_TILES and NORM_WARPS (on by default: a launch of
    PREFILL_ROWS - 1 rows and one of PREFILL_ROWS must agree, and one of NORM_WARPS_ROWS and
    one more); for the opt-in ROW_TILES it says setting them would not change the
    deterministic mode's outputs at all."""
    proj, rows = _layer(n, k, glu, norm)
    consts(None)
    want = _alone(proj, rows), _parts(proj(rows))
    consts(table, 1, prefill, warps)
    got = _alone(proj, rows), _parts(proj(rows))
    for i in ALONE:
        for a, b in zip(got[0][i], want[0][i]):
            assert torch.equal(a, b), i
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(49152, 576), (128256, 4096)], ids=["smol-head", "llama8b-head"])
def test_head_tiles_keep_their_bits_gpu(consts, n, k):
    """bf16 on the GPU, an LM head at the shipped HEAD_ROWS and HEAD_TILES: each row of ALONE
    alone equals the row among HEAD_ROWS - 1, HEAD_ROWS, 64 and 2048 rows, and every row equals
    the 16-row LOGITS_DOT_TILES' logits (HEAD_ROWS None). Required: the default switches tiles
    at HEAD_ROWS, and a CUDA graph's padded bucket may cross it."""
    rows_from = SHIPPED_HEAD_ROWS
    proj, rows = _layer(n, k, False, False)
    consts(None, 1, 64)
    want = _parts(proj(rows))
    consts(None, 1, 64, None, rows_from)
    assert invariant.HEAD_TILES == SHIPPED_HEAD_TILES
    assert invariant.invariant_tiles(n, k, rows_from) == SHIPPED_HEAD_TILES[:2] + (
        min(SHIPPED_HEAD_TILES[2], k), SHIPPED_HEAD_TILES[3])
    assert invariant.invariant_tiles(n, k, rows_from - 1) == (16, *ops.LOGITS_DOT_TILES)
    alone = _alone(proj, rows)
    for m in (rows_from - 1, rows_from, 64, 2048):
        out = _parts(proj(rows[:m]))
        assert torch.equal(out[0], want[0][:m]), m
        for i in (i for i in ALONE if i < m):
            assert torch.equal(out[0][i], alone[i][0][0]), (m, i)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,norm_k,apart", [(1, None, True), (4, None, True),
                                                  (1, 128, True), (1, None, "plain")],
                         ids=["unsplit", "split4", "norm-k", "plain-glu"])
@pytest.mark.parametrize("n,k,glu,norm", [p for p in LAYER_SHAPES if p.values[3]])
def test_a_norm_apart_gives_the_default_bits_gpu(consts, monkeypatch, splits, norm_k, apart, n,
                                                 k, glu, norm):
    """bf16 on the GPU, PREFILL_NORM_APART with PREFILL_TILES from 64 rows (the norm its own
    launch at 64 and 2048 rows), unsplit, in 4 K-splits, with NORM_K 128, and "plain" (gate_up
    one plain projection and silu_mul): each row of ALONE alone equals it among 8, 64 and 2048,
    and all 2048 rows have the bits of the 16-row tiles with the norm in their prologue (same
    splits and NORM_K). What must hold before it leaves opt-in."""
    proj, rows = _layer(n, k, glu, norm)
    consts(None, splits, norm_k=norm_k)
    want = _parts(proj(rows))
    consts(None, splits, 64, norm_k=norm_k)
    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", apart)
    assert invariant.norm_apart(n // 2 if glu else n, k, 64, False, True, 2)
    _alone_equals_batched(proj, rows)
    for a, b in zip(_parts(proj(rows)), want):
        assert torch.equal(a, b)


# PREFILL_TILES whose norm and GLU kinds walk K in 64 keys: only with NORM_K.
CHUNKED = {"norm": (64, 64, 64, 8), "glu": (64, 64, 64, 8), "plain": (64, 64, 64, 4)}


@pytest.mark.gpu
@pytest.mark.parametrize("block_k,splits", [(None, 1), (256, 1), (None, 4)],
                         ids=["shape-k", "block-k256", "split4"])
@pytest.mark.parametrize("n,k,glu,norm", [p for p in LAYER_SHAPES if p.values[3]])
def test_norm_k_rows_alone_equal_batched_gpu(consts, block_k, splits, n, k, glu, norm):
    """bf16 on the GPU, the norm's sums in 128-key chunks (NORM_K) and CHUNKED's 64-key tiles
    from 64 rows at 8 warps, below them the shape's BLOCK_K or 256 (NORM_BLOCK_K), unsplit and
    in 4 K-splits (which keep the shape's): each row of ALONE alone equals the same row among 8,
    64 and 2048, outputs and x + residual (NORM_K may leave opt-in once these and figure 6
    pass)."""
    consts(None, splits, 64, 8, norm_k=128, norm_block_k=block_k, tiles=CHUNKED)
    half = n // 2 if glu else n
    shape_k = invariant.invariant_tiles(half, k, 1, glu, norm, prefill=False)[2]
    assert invariant.invariant_tiles(half, k, 64, glu, norm)[2] == (64 if splits == 1
                                                                    else shape_k)
    _alone_equals_batched(*_layer(n, k, glu, norm))


LARGE_SHAPES = [p for p in LAYER_SHAPES if p.id.startswith("llama8b")] + [
    pytest.param(9728, 896, True, True, id="qwen0.5b-gate_up"),  # K off the 256-key tiles
    pytest.param(1536, 8960, False, False, id="qwen1.5b-down")]
SHIPPED_LARGE = invariant.LARGE_WEIGHT
# Counts that leave the 64- and 128-row tiles' last row block part full, beside BATCHES.
PART_BATCHES = (100, 2000)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,glu,norm", LARGE_SHAPES)
def test_large_rows_alone_equal_batched_gpu(consts, n, k, glu, norm):
    """bf16 on the GPU, a large model's weights at the shipped LARGE_WEIGHT and LARGE_TILES
    (`dot_tiles`, the norm and SiLU-and-mul apart): each row of ALONE alone equals the same row
    among 8, 64, 100, 2000 and 2048 (last row blocks full and part full), outputs and x +
    residual, each count of (1, 64, 2048) at other tiles. Required: a CUDA graph's padded
    bucket may cross LARGE_TILES' bounds."""
    consts(None, large=SHIPPED_LARGE)
    half = n // 2 if glu else n
    assert len({invariant.large_tiles(half, k, m, glu, False, True, 2)
                for m in (1, 64, 2048)}) == 3
    _alone_equals_batched(*_layer(n, k, glu, norm), batches=BATCHES + PART_BATCHES)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,glu,norm", [p for p in LARGE_SHAPES if not p.values[3]])
def test_large_plain_gives_the_16_row_bits_gpu(consts, n, k, glu, norm):
    """bf16 on the GPU: a large plain projection (o, down) in `dot_tiles` gives every row the
    16-row tiles' bits, alone and among 2048 (the same k16 MMA steps in K order)."""
    proj, rows = _layer(n, k, glu, norm)
    consts(None)
    want = _alone(proj, rows), _parts(proj(rows))
    consts(None, large=SHIPPED_LARGE)
    got = _alone(proj, rows), _parts(proj(rows))
    for i in ALONE:
        assert torch.equal(got[0][i][0], want[0][i][0]), i
    assert torch.equal(got[1][0], want[1][0])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [pytest.param(49152, 576, id="smol-head"),
                                 pytest.param(128256, 4096, id="llama8b-head")])
def test_large_heads_rows_alone_equal_batched_gpu(consts, monkeypatch, n, k):
    """bf16 on the GPU, LARGE_HEADS on: an LM head (by its shape) in `dot_tiles` gives each row
    of ALONE alone the bits it has among 8, 64, 100 and 384 rows (verify widths)."""
    consts(None, large=SHIPPED_LARGE)
    monkeypatch.setattr(invariant, "LARGE_HEADS", True)
    assert invariant.large_tiles(n, k, 384, False, False, True, 2) is not None
    _alone_equals_batched(*_layer(n, k, False, False), batches=(8, 64, 100, 384))
