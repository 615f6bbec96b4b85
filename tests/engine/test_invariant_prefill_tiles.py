"""The deterministic projections' tiles for wide launches (`invariant.PREFILL_ROWS`). On the
CPU: from PREFILL_ROWS rows up the decoder layer's projections take PREFILL_TILES by kind
(norm prologue, GLU epilogue, plain), a norm prologue and split-K keeping the shape's BLOCK_K;
bad settings are refused; `invariant_linear` tells the kind; the results match torch (Triton's
interpreter, fp32 and fp16). The GPU cases (bits alone vs among 2048, and against the 16-row
tiles) are in test_invariant_row_tiles.py."""

from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.attention import triton_available
from engine.ops import invariant

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")


@pytest.fixture
def prefill(tile_settings):
    """Sets `PREFILL_ROWS` and `LAYER_SPLITS` for one test, the other tile settings off
    (conftest's `tile_settings`)."""
    return lambda rows, splits=1: tile_settings(None, splits, rows)


def test_wide_launches_take_the_prefill_tiles(prefill):
    """Below PREFILL_ROWS the shape's tiles; from it PREFILL_TILES by kind: qkv (norm) and
    gate_up (GLU) keep their BLOCK_K, a norm walking K in 512-key tiles takes
    NORM_LOOP_BLOCK_N columns (shared memory), a norm of a tiny K whose layout along K the
    larger tile would change keeps the 16-row tiles, o and down walk K in 64 keys unless
    split-K is on; an LM head keeps its tiles; without a row count the tiles cannot be
    chosen; a device without PREFILL_TILES (`prefill=False`) never takes them."""
    prefill(64)
    norm, glu, plain = (invariant.PREFILL_TILES[k] for k in ("norm", "glu", "plain"))
    assert plain[2] == 64 and norm[2] is None and glu[2] is None
    loop = (norm[0], invariant.NORM_LOOP_BLOCK_N, 512, norm[3])
    shapes = {(960, 576, False, True): (*norm[:2], 1024, norm[3]),
              (1536, 576, True, True): (*glu[:2], 128, glu[3]),
              (2048, 1536, False, True): loop,  # Qwen2.5-1.5B's qkv
              (6144, 4096, False, True): (*norm[:2], 128, norm[3]),  # Llama-8B's qkv
              (64, 32, False, True): None,  # tiny K: the 16-row tiles stay
              (576, 576, False, False): plain, (576, 1536, False, False): plain,
              (40, 48, False, False): plain}
    for (n, k, g, nm), wide in shapes.items():
        bn, bk, warps = invariant.layer_tiles(n, k, g)
        small = (16, bn, min(bk, invariant.next_pow2(k, 16)), warps)
        assert invariant.invariant_tiles(n, k, 63, g, nm) == small
        for m in (64, 2048):
            assert invariant.invariant_tiles(n, k, m, g, nm) == (wide or small)
            assert invariant.invariant_tiles(n, k, m, g, nm, prefill=False) == small
    for m in (1, 2048):
        assert invariant.invariant_tiles(49152, 576, m) == (16, *ops.LOGITS_DOT_TILES)
        assert invariant.invariant_tiles(32000, 4096, m, head=True) == (16, *ops.LOGITS_DOT_TILES)
    with pytest.raises(ValueError, match="row count"):
        invariant.invariant_tiles(960, 576)
    prefill(64, splits=4)
    bk = invariant.layer_tiles(576, 1536)[1]
    assert invariant.invariant_tiles(576, 1536, 64) == (*plain[:2], bk, plain[3])


def test_prefill_tiles_only_where_shown(monkeypatch):
    """PREFILL_TILES on sm_90 and in Triton's interpreter (CPU), not on another GPU (their
    shared memory overflows an sm_80 / sm_89 one, sm_100 computes them with another MMA)."""
    suits = invariant.prefill_suits.__wrapped__
    assert suits(torch.device("cpu"))
    for cap, want in [((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=cap: c)
        assert suits(torch.device("cuda", 0)) is want, cap


def test_norm_warps_at_few_rows(prefill, monkeypatch):
    """NORM_WARPS gives qkv and gate_up (norm prologue) its warps in launches of at most
    NORM_WARPS_ROWS rows, their BLOCK_M, BLOCK_N and BLOCK_K unchanged; more rows, a plain
    projection and PREFILL_TILES keep theirs; without a row count the tiles cannot be chosen;
    a count other than 4 or 8 (or a NORM_WARPS_ROWS not a positive int) is refused by name;
    where 8 would lay a norm's K out otherwise (a 32-key K in a 16-row tile) the shape's warps
    stay."""
    prefill(64)
    shapes = [(960, 576, False, True), (1536, 576, True, True), (576, 576, False, False)]
    before = {(s, m): invariant.invariant_tiles(s[0], s[1], m, *s[2:])
              for s in shapes for m in (1, 16, 17, 63, 64)}
    monkeypatch.setattr(invariant, "NORM_WARPS", 8)
    for ((n, k, g, nm), m), old in before.items():
        got = invariant.invariant_tiles(n, k, m, g, nm)
        assert got == ((*old[:3], 8) if nm and m <= 16 else old), (n, m)
    assert invariant.invariant_tiles(960, 576, 1, norm=True)[3] == 8 != before[(shapes[0], 1)][3]
    monkeypatch.setattr(invariant, "NORM_WARPS_ROWS", 32)
    assert invariant.invariant_tiles(960, 576, 17, norm=True)[3] == 8
    with pytest.raises(ValueError, match="row count"):
        invariant.invariant_tiles(960, 576, norm=True)
    assert invariant.invariant_tiles(64, 32, 1, norm=True)[3] == invariant.layer_tiles(64, 32)[2]
    for bad in (0, 2.0, None):
        monkeypatch.setattr(invariant, "NORM_WARPS_ROWS", bad)
        with pytest.raises(ValueError, match="NORM_WARPS_ROWS"):
            invariant.invariant_tiles(960, 576, 1, norm=True)
    monkeypatch.setattr(invariant, "NORM_WARPS_ROWS", 16)
    for bad in (3, 16, 8.0, True):
        monkeypatch.setattr(invariant, "NORM_WARPS", bad)
        with pytest.raises(ValueError, match="NORM_WARPS"):
            invariant.invariant_tiles(960, 576, 1, norm=True)


def test_k_layout():
    """The layout along K a norm's sums follow: 8 keys a thread, up to 32 threads, then warps
    as K holds them; None where the tile has too few rows for the rest."""
    assert invariant.k_layout(16, 1024, 4) == invariant.k_layout(32, 1024, 8) == (32, 4)
    assert invariant.k_layout(16, 1024, 2) == (32, 2)  # another order: 2 warps along K
    assert invariant.k_layout(16, 128, 4) == invariant.k_layout(128, 128, 8) == (16, 1)
    assert invariant.k_layout(16, 128, 16) is None  # 32 rows of threads in a 16-row tile
    assert invariant.k_layout(16, 512, 4) == invariant.k_layout(32, 512, 8) == (32, 2)


def test_head_tiles_from_head_rows(tile_settings, monkeypatch):
    """An LM head keeps LOGITS_DOT_TILES at any row count (and without one) where HEAD_ROWS is
    None, else from HEAD_ROWS HEAD_TILES (split-K or not: a head is never split; PREFILL_ROWS
    on or off); below it unchanged, and on a device or dtype without PREFILL_TILES too, and
    with a norm prologue or GLU (their sums keep the 16-row tiles' order); a head narrower than
    VOCAB_RATIO x K is one by `head`."""
    tile_settings(prefill=64)
    head = (16, *ops.LOGITS_DOT_TILES)
    assert {invariant.invariant_tiles(49152, 576, m) for m in (None, 1, 64, 2048)} == {head}
    tile_settings(head=32)
    monkeypatch.setattr(invariant, "HEAD_TILES", (128, 64, 64, 8))
    assert invariant.invariant_tiles(49152, 576, 31) == head
    for m in (32, 2048):
        assert invariant.invariant_tiles(49152, 576, m) == (128, 64, 64, 8)
        assert invariant.invariant_tiles(32000, 4096, m, head=True) == (128, 64, 64, 8)
        assert invariant.invariant_tiles(49152, 576, m, prefill=False) == head
        assert invariant.invariant_tiles(49152, 576, m, elem=4) == head
    assert invariant.invariant_tiles(49152, 24, 64) == (128, 64, 32, 8)  # K's power of two
    assert invariant.invariant_splits(49152, 576) == invariant.invariant_splits(
        32000, 4096, head=True) == 1
    with pytest.raises(ValueError, match="row count"):
        invariant.invariant_tiles(49152, 576)
    for kw in ({"norm": True}, {"glu": True}):
        assert invariant.invariant_tiles(49152, 576, 64, **kw) == head
    tile_settings(splits=4, prefill=256, head=32)
    assert invariant.invariant_tiles(49152, 576, 32) == invariant.HEAD_TILES


@pytest.mark.parametrize("name,value,match", [
    ("HEAD_ROWS", 0, "HEAD_ROWS must be"), ("HEAD_ROWS", 2.0, "HEAD_ROWS must be"),
    ("HEAD_TILES", (48, 64, 64, 4), "HEAD_TILES must be"),
    ("HEAD_TILES", (64, 64, 64, 2), "HEAD_TILES must be"),
    ("HEAD_TILES", (64, 96, 64, 4), "HEAD_TILES must be"),
    ("HEAD_TILES", [64, 64, 64, 4], "HEAD_TILES must be")])
def test_bad_head_settings_raise(tile_settings, monkeypatch, name, value, match):
    """A malformed HEAD_ROWS or HEAD_TILES is refused by name at the first LM head."""
    tile_settings(head=16)
    monkeypatch.setattr(invariant, name, value)
    with pytest.raises(ValueError, match=match):
        invariant.invariant_tiles(49152, 576, 64)


@pytest.mark.parametrize("rows,match", [(0, "positive int"), (True, "positive int"),
                                        (2.5, "positive int"), ("256", "positive int")])
def test_bad_prefill_rows_raise(prefill, rows, match):
    """A PREFILL_ROWS that is not a positive int is refused by name at the first projection."""
    prefill(rows)
    with pytest.raises(ValueError, match=match):
        invariant.invariant_tiles(960, 576, 1)


@pytest.mark.parametrize("tiles", [
    {"norm": (32, 128, None, 8)}, {"plain": (64, 64)}, {"plain": (1, 64, 64, 4)},
    {"plain": (8, 64, 64, 4)}, {"plain": (64, 48, 64, 4)}, {"plain": (64, 64, 48, 4)},
    {"plain": (64, 64, 64, 3)}, {"plain": (64, 64, 64.0, 4)}, ((64, 64, 64, 4),)],
    ids=["no-kind", "pair", "bm1", "bm8", "bn48", "bk48", "warps3", "float", "tuple"])
def test_bad_prefill_tiles_raise(prefill, monkeypatch, tiles):
    """A PREFILL_TILES without the launch's kind, or of the wrong form (a GEMV's or too small a
    BLOCK_M, sizes that are no power of two, warps other than 4 or 8), is refused by name."""
    prefill(1)
    monkeypatch.setattr(invariant, "PREFILL_TILES", tiles)
    with pytest.raises(ValueError, match="PREFILL_TILES\\['plain'\\] must be"):
        invariant.invariant_tiles(576, 576, 1)


def test_a_norm_keeps_its_block_k(prefill, monkeypatch):
    """A BLOCK_K for the norm or GLU kind is refused: their row sums follow the shape's."""
    prefill(1)
    monkeypatch.setattr(invariant, "PREFILL_TILES", {"norm": (32, 128, 64, 8)})
    with pytest.raises(ValueError, match="PREFILL_TILES\\['norm'\\] must be"):
        invariant.invariant_tiles(960, 576, 1, norm=True)


def test_the_documented_setting_parses():
    """The module docstring's `--set` value is one the bench turns into PREFILL_ROWS (off)."""
    from bench.suite import parse_setting

    text = "engine.ops.invariant.PREFILL_ROWS=None"
    assert parse_setting(text) == ("engine.ops.invariant.PREFILL_ROWS", None)
    assert text in invariant.__doc__.replace("\n", " ")


def test_invariant_linear_tells_the_kind(prefill, monkeypatch):
    """Each wide launch reaches `prologue_linear` with its kind's tiles: a norm prologue's, a
    GLU's, a plain projection's (also after `silu`), by x's row count."""
    prefill(8)
    seen = []
    real = invariant.prologue_linear

    def spy(x, w, *a, **kw):
        seen.append((x.shape[0], kw["tiles"]))
        return real(x, w, *a, **kw)

    monkeypatch.setattr(invariant, "prologue_linear", spy)
    g = torch.Generator().manual_seed(3)
    w, gu, nw, x = (torch.randn(*s, generator=g).half() for s in [(40, 96), (80, 96), (96,),
                                                                   (8, 96)])
    ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=x)
    ops.invariant_linear(x, gu, norm_weight=nw, eps=1e-5, residual=x, glu=True)
    ops.invariant_linear(x, w)
    ops.invariant_linear(torch.randn(8, 192, generator=g).half(), w, silu=True)
    ops.invariant_linear(x[:7], w)
    tiles = invariant.PREFILL_TILES
    assert seen == [(8, (*tiles["norm"][:2], 128, tiles["norm"][3])),
                    (8, (*tiles["glu"][:2], 128, tiles["glu"][3])),
                    (8, tiles["plain"]), (8, tiles["plain"]),
                    (7, invariant.invariant_tiles(40, 96, 7))]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_tiles_match_torch(prefill, invariant_matches_torch, dtype, splits):
    """With PREFILL_ROWS 1, at 1, 9 and 130 rows (masked rows in one tile, then a second tile of
    each size), K over a loop with a masked tail, unsplit and in 2 K-splits: plain with a bias,
    the norm of x + residual, gate_up's SiLU-and-mul epilogue equal torch's to rounding and x +
    residual exactly (fp32 keeps the 16-row tiles: `test_other_dtypes_keep_the_small_tiles`)."""
    prefill(1, splits)
    invariant_matches_torch(dtype, (1, 9, 130), 5)


def test_norm_k_frees_the_norms_block_k(prefill, monkeypatch):
    """NORM_K (the norm's sums in fixed chunks): qkv and gate_up take NORM_BLOCK_K below
    PREFILL_ROWS and PREFILL_TILES' BLOCK_K from it (refused without NORM_K; None there is the
    shape's, not NORM_BLOCK_K), unsplit only;
    a NORM_K or NORM_BLOCK_K that is no power of two >= 16 is refused by name."""
    prefill(64)
    tiles = {"norm": (64, 64, 64, 8), "glu": (64, 64, 64, 8), "plain": (64, 64, 64, 4)}
    monkeypatch.setattr(invariant, "PREFILL_TILES", tiles)
    with pytest.raises(ValueError, match="PREFILL_TILES\\['norm'\\]"):
        invariant.invariant_tiles(960, 576, 64, norm=True)
    monkeypatch.setattr(invariant, "NORM_K", 128)
    monkeypatch.setattr(invariant, "NORM_BLOCK_K", 256)
    assert invariant.invariant_tiles(960, 576, 1, norm=True) == (16, 32, 256, 4)
    assert invariant.invariant_tiles(1536, 576, 1, True, True) == (16, 32, 256, 4)
    assert invariant.invariant_tiles(960, 576, 64, norm=True) == tiles["norm"]
    assert invariant.invariant_tiles(1536, 576, 64, True, True) == tiles["glu"]
    monkeypatch.setattr(invariant, "PREFILL_TILES", {**tiles, "glu": (128, 64, None, 8)})
    assert invariant.invariant_tiles(1536, 576, 64, True, True) == (128, 64, 128, 8)
    prefill(64, splits=4)
    for name, value in [("PREFILL_TILES", tiles), ("NORM_K", 128), ("NORM_BLOCK_K", 1024)]:
        monkeypatch.setattr(invariant, name, value)
    bk = invariant.layer_tiles(1536, 576, True)[1]
    assert invariant.invariant_tiles(1536, 576, 1, True, True)[2] == bk
    assert invariant.invariant_tiles(1536, 576, 64, True, True)[2] == bk
    for name, bad in [("NORM_K", 100), ("NORM_K", True), ("NORM_BLOCK_K", 1000)]:
        prefill(64)
        monkeypatch.setattr(invariant, "NORM_K", 128)
        monkeypatch.setattr(invariant, name, bad)
        with pytest.raises(ValueError, match=name):
            invariant.invariant_tiles(960, 576, 1, norm=True)


def test_norm_k_rows_keep_their_bits(prefill, monkeypatch):
    """With NORM_K 128, NORM_BLOCK_K 512 and 64-row prefill tiles of 64-key steps from 16 rows:
    through a weight that copies its input columns (exact products), each row's normed input
    alone equals the same row among 40, bit for bit (Triton's interpreter, fp16: 32-bit
    activations never take the prefill tiles); x + residual too."""
    prefill(16)
    monkeypatch.setattr(invariant, "NORM_K", 128)
    monkeypatch.setattr(invariant, "NORM_BLOCK_K", 512)
    monkeypatch.setattr(invariant, "PREFILL_TILES", {"norm": (64, 64, 64, 8),
                                                     "glu": (64, 64, 64, 8),
                                                     "plain": (64, 64, 64, 4)})
    g = torch.Generator().manual_seed(11)
    x, r = (torch.randn(40, 304, generator=g).half() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(304, generator=g)).half()
    eye = torch.eye(304, dtype=torch.float16)[:64]
    alone, among = (invariant.invariant_tiles(64, 304, m, norm=True, elem=2) for m in (1, 40))
    assert alone[:3] == (16, 32, 512) and among[:3] == (64, 64, 64), (alone, among)
    y, res = ops.invariant_linear(x, eye, norm_weight=nw, eps=1e-5, residual=r)
    for i in (0, 15, 39):
        yi, ri = ops.invariant_linear(x[i:i + 1], eye, norm_weight=nw, eps=1e-5,
                                      residual=r[i:i + 1])
        assert torch.equal(yi[0], y[i]) and torch.equal(ri[0], res[i]), i


def test_other_dtypes_keep_the_small_tiles(prefill, monkeypatch):
    """fp32 activations (4 keys a 16-byte load, and tiles that overflow shared memory) never
    take PREFILL_TILES; a K off the 16-byte multiple leaves a norm's layout untold, so a norm
    projection keeps its 16-row tiles there, NORM_WARPS leaving their warps too."""
    prefill(64)
    small = invariant.invariant_tiles(960, 576, 1, norm=True)
    assert invariant.invariant_tiles(960, 576, 2048, norm=True, elem=4) == small
    assert invariant.invariant_tiles(576, 576, 2048, elem=4)[0] == 16
    assert invariant.k_layout(16, 1024, 4, keys=4) == (32, 4) != invariant.k_layout(
        32, 1024, 8, keys=4)
    assert invariant.invariant_tiles(64, 300, 2048, norm=True)[0] == 16
    monkeypatch.setattr(invariant, "NORM_WARPS", 8)
    assert invariant.invariant_tiles(64, 300, 1, norm=True) == invariant.invariant_tiles(
        64, 300, 2048, norm=True)


def test_norm_warps_by_default():
    """By default qkv and gate_up take 8 warps up to NORM_WARPS_ROWS rows (their GPU cases
    give the 4-warp tiles' bits), the shape's from then on; a norm of a tiny K keeps its warps
    rather than failing (a model of any width runs deterministic), and its tiles, which no row
    count changes, are told without one (on a device without PREFILL_TILES, whose tiles do)."""
    assert invariant.NORM_WARPS == 8
    qkv, gate_up = (960, 576, False, True), (1536, 576, True, True)
    for n, k, glu, norm in (qkv, gate_up):
        shape_warps = invariant.layer_tiles(n, k, glu)[2]
        assert invariant.invariant_tiles(n, k, 1, glu, norm)[3] == 8 != shape_warps
        rows = invariant.NORM_WARPS_ROWS + 1
        assert invariant.invariant_tiles(n, k, rows, glu, norm)[3] == shape_warps
    assert invariant.invariant_tiles(576, 576, 1)[3] == invariant.layer_tiles(576, 576)[2]
    # fp32 (4 keys a load): 8 warps would lay qkv's K out in 8 warps, not 4, so 4 stay
    assert invariant.k_layout(16, 1024, 8, keys=4) != invariant.k_layout(16, 1024, 4, keys=4)
    assert invariant.invariant_tiles(960, 576, 1, norm=True, elem=4)[3] == 4
    for k in (32, 48, 300):
        assert invariant.invariant_tiles(64, k, 1, norm=True)[3] == invariant.layer_tiles(64, k)[2]
        assert invariant.invariant_tiles(64, k, norm=True, prefill=False) == (
            invariant.invariant_tiles(64, k, 1, norm=True))
    with pytest.raises(ValueError, match="NORM_WARPS is set"):
        invariant.invariant_tiles(960, 576, norm=True, prefill=False)


def test_malformed_settings_are_refused_at_any_row_count(prefill, monkeypatch):
    """A malformed LAYER_SPLITS, NORM_BLOCK_K (with or without NORM_K) or PREFILL_TILES entry is
    refused by name at one row as at many, not first when a launch would use it."""
    prefill(64)
    for bad in (0, -3, 2.0, True):
        monkeypatch.setattr(invariant, "LAYER_SPLITS", bad)
        for call in (lambda: invariant.invariant_tiles(960, 576, 1, norm=True),
                     lambda: invariant.invariant_tiles(576, 576, 1),
                     lambda: invariant.invariant_splits(960, 576)):
            with pytest.raises(ValueError, match="LAYER_SPLITS"):
                call()
    monkeypatch.setattr(invariant, "LAYER_SPLITS", 1)
    monkeypatch.setattr(invariant, "NORM_BLOCK_K", 1000)
    with pytest.raises(ValueError, match="NORM_BLOCK_K"):
        invariant.invariant_tiles(960, 576, 1, norm=True)
    monkeypatch.setattr(invariant, "NORM_BLOCK_K", None)
    monkeypatch.setattr(invariant, "PREFILL_TILES", {**invariant.PREFILL_TILES,
                                                     "plain": (64, 64, 48, 4)})
    for m in (1, 63, 64):
        with pytest.raises(ValueError, match="PREFILL_TILES"):
            invariant.invariant_tiles(576, 576, m)
    assert invariant.invariant_tiles(960, 576, 1, norm=True)[0] == 16  # other kinds unaffected


@pytest.mark.parametrize("glu,apart", [(False, True), (True, True), (True, "plain")],
                         ids=["qkv", "gate_up", "gate_up-plain"])
def test_a_norm_apart_keeps_each_rows_bits(prefill, monkeypatch, glu, apart):
    """PREFILL_NORM_APART: from PREFILL_ROWS rows a norm projection runs `prologue_norm` in the
    tiles a row alone takes, then the projection in its kind's tiles without the norm (a
    qkv-like weight walks K in the plain kind's 64 keys); each row alone equals it among 40,
    outputs and x + residual, bit for bit (Triton's interpreter, fp16, the plain kind at the
    shape's BLOCK_K: the interpreter's dot sums another BLOCK_K in another order, which the GPU
    case checks); below PREFILL_ROWS, and without the setting, the norm stays in the
    prologue. "plain": gate_up's [gate | up] is one plain projection (here at GLU's 128 keys),
    then `silu_mul`."""
    prefill(16)
    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", apart)
    monkeypatch.setitem(invariant.PREFILL_TILES, "plain", (64, 64, None if apart is True
                                                           else 128, 4))
    norms, tiles = [], []
    real_norm, real_linear = invariant.prologue_norm, invariant.prologue_linear
    monkeypatch.setattr(invariant, "prologue_norm",
                        lambda x, *a, **kw: norms.append(x.shape[0]) or real_norm(x, *a, **kw))
    monkeypatch.setattr(invariant, "prologue_linear", lambda x, w, *a, **kw: tiles.append(
        (x.shape[0], kw["tiles"])) or real_linear(x, w, *a, **kw))
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(40, 304, generator=g).half() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(304, generator=g)).half()
    w = (torch.randn(96 if glu else 48, 304, generator=g) / 17).half()
    y, res = ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu)
    kind = invariant.PREFILL_TILES["glu" if glu and apart is True else "plain"]
    assert norms == [40] and tiles[0][0] == 40 and tiles[0][1][:2] == kind[:2]
    assert tiles[0][1][2] == (128 if apart == "plain" else invariant.layer_tiles(48, 304, glu)[1])
    for i in range(40):
        yi, ri = ops.invariant_linear(x[i:i + 1], w, norm_weight=nw, eps=1e-5,
                                      residual=r[i:i + 1], glu=glu)
        assert torch.equal(yi[0], y[i]) and torch.equal(ri[0], res[i]), i
    assert norms == [40]  # one row: the norm in the prologue
    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", False)
    y2, res2 = ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu)
    assert norms == [40] and torch.equal(res2, res)
    torch.testing.assert_close(y2, y, atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", "yes")
    with pytest.raises(ValueError, match="PREFILL_NORM_APART"):
        ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=glu)


def test_a_norm_apart_matches_torch(prefill, monkeypatch, invariant_matches_torch):
    """With PREFILL_NORM_APART from 16 rows, `invariant_linear` still equals torch to rounding
    (fp32 keeps the prologue: 32-bit activations never take PREFILL_TILES; fp16 runs apart)."""
    prefill(16)
    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", True)
    for dtype in (torch.float32, torch.float16):
        invariant_matches_torch(dtype, (1, 40), 3)


@pytest.mark.parametrize("k,bk,norm_k", [(304, 512, 0), (304, 128, 0), (304, 128, 64),
                                         (96, 128, 32)],
                         ids=["one-load", "k-tiles", "norm-k", "one-tile-norm-k"])
@pytest.mark.parametrize("residual", [True, False])
def test_prologue_norm_is_the_prologues_norm(k, bk, norm_k, residual):
    """`prologue_norm` at given tiles and norm_k equals, bit for bit, what `prologue_linear`'s
    norm prologue computes at them: its projection through an identity weight in fp32 (each
    output is one product by 1, exact), K in one load, in BLOCK_K tiles, in NORM_K chunks;
    x + residual too (Triton's interpreter)."""
    from engine.ops.prologue import prologue_norm

    g = torch.Generator().manual_seed(k + bk + norm_k)
    x, r = (torch.randn(20, k, generator=g) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(k, generator=g)
    tiles, res = (16, 32, bk, 4), r if residual else None
    got = prologue_norm(x, nw, 1e-5, res, tiles, norm_k)
    want = ops.prologue_linear(x, torch.eye(k), norm_weight=nw, eps=1e-5, residual=res,
                               tiles=tiles, norm_k=norm_k)
    got, want = (t if residual else (t,) for t in (got, want))  # (y, x + residual) or (y,)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    h = torch.nn.functional.rms_norm(x + r if residual else x, (k,), nw, 1e-5)
    torch.testing.assert_close(got[0], h, atol=1e-5, rtol=1e-5)
