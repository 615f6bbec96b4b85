"""Row-invariant projections of the deterministic mode (`EngineConfig.deterministic`): at any row
count, each row of a projection is computed by the same kernel in the same K order with fp32
accumulation, so its bits are the same whether it is alone, in a verify step or in a prefill chunk.
No choice by timing (a restarted process must pick the same tiles).

A projection is `prologue_linear` with tensor-core tiles: rows past the count are masked to zeros
and an MMA computes each output row from its own inputs, so the rows of a tile do not mix. A norm
before it is the kernel's prologue: each tile computes its rows' mean squares over all of K in a
fixed order, one row at a time, so a row's norm does not depend on the tile's other rows either (a
separate norm launch per projection cost a decode step more than the norm itself). SiLU-and-mul is
gate_up's epilogue (`glu`): each program computes matching gate and up columns and combines them as
`silu_mul` would (the tiles' SiLU prologue on down_proj was slower); `silu=True` still runs
`silu_mul` before the projection.

By default the tiles come from the weight's shape alone below PREFILL_ROWS rows (an LM head's below
HEAD_ROWS), NORM_WARPS' warps at few rows aside: 16 rows, LAYER_TILES for the decoder layer's
projections (a small one without GLU walks K in fewer, longer steps: `layer_tiles`),
LOGITS_DOT_TILES for an LM head. ROW_TILES (opt-in, None by default) lets the decoder layer's
projections take BLOCK_M and BLOCK_N by the launch's row count: narrow column tiles at one row
(more programs for a latency-bound launch), 32- or 64-row tiles for a prefill (each weight tile
read once for that many rows, not 16). BLOCK_K and the warps stay what they are without it
(`layer_tiles`, NORM_WARPS, NORM_BLOCK_K), so each output element still accumulates the same k16
MMA steps in the same K order, and the norm prologue's per-row sums keep their layout along K where
the tile holds it (`k_layout`; other tables are refused). At BLOCK_M 64 Triton computes `tl.dot`
with Hopper's warp-group MMA instead of mma.sync; that it rounds alike is what the GPU cases' WIDE
table checks. A tile must fit shared memory, which a 1024-key K tile allows at (32, 128) and (64,
32), not (64, 64); a norm walking K in longer tiles than 128 keys takes at most 32 x
NORM_LOOP_BLOCK_N (x and the residual are double-buffered: Qwen-1.5B's qkv at 32 x 128 would need
297 KB of 227). Inside a CUDA graph the row count is the bucket's padded count, not the live rows':
that is only sound because the tiles do not change a row's bits (so too for PREFILL_TILES,
HEAD_TILES and NORM_WARPS). Whether they do not is a property of the GPU's MMA, not shown by the
interpreter: ROW_TILES stays opt-in until a GPU shows every row's bits unchanged across the table
(tests/engine/test_invariant_row_tiles.py's GPU cases) and figure 6 stays 100% identical. Set it
for an A/B process with, e.g., `--set
engine.ops.invariant.ROW_TILES=((1,16,16),(16,16,32),(1000000000,32,64))` (a Python literal:
`10**9` is not one).

From PREFILL_ROWS rows (prefill chunks, wide verifies) on sm_90 (`prefill_suits`: other GPUs'
shared memory or MMA are not shown), the decoder layer's projections take larger tiles by kind
(PREFILL_TILES): up to 128 rows a tile, 8 warps with a norm prologue, a plain projection's K in
64-key steps, each weight tile read once for that many rows. The MMA steps of each output element
stay the same k16 chain in K order, and a norm prologue keeps the shape's BLOCK_K and its layout
along K (where the larger tile would change it, the 16-row tiles stay), so a row's bits do not
change: the GPU cases check that (alone, among 2048, and against the 16-row tiles; on an H100,
SmolLM2's and Llama-8B's shapes), and figure 6 runs with it. Below that count the 16-row tiles are
faster. An A/B process sets it with, e.g., `--set engine.ops.invariant.PREFILL_ROWS=None` (off) or
`=512`.

From HEAD_ROWS rows an LM head without a norm prologue or GLU takes HEAD_TILES, on the devices and
activations that take PREFILL_TILES: the head's weight leaves L2 between tiles of rows (SmolLM2's
56 MB, Llama's 1 GB), so 16-row tiles read it from memory once per 16 rows of a wide verify. Larger
tiles keep each output element's k16 MMA chain in K order; that the warp-group MMA rounds it alike
is measured (SmolLM2's head on an H100, 1-512 rows), and the GPU cases check it for Llama-8B's head
too.

NORM_K and PREFILL_NORM_APART (opt-in) free a norm projection's BLOCK_K: the norm's row sums in
fixed chunks of keys (Triton lays a [BLOCK_M, 128] chunk out alike for every BLOCK_M from 16 at 4
or 8 warps: sm_90, bf16), or the norm as a launch of its own, each row as a row alone's tiles.

A large model's layer projections (`LARGE_WEIGHT`; its LM head too with LARGE_HEADS, opt-in) take
pipelined `dot_tiles` on PREFILL_TILES' devices (LARGE_TILES), the same k16 chain; no other setting
reaches them.

Split-K is opt-in (`LAYER_SPLITS`): the decoder layer's projections then cut K into ranges of whole
tiles fixed by the weight's shape, each range one program, the partial tiles summed in range order
(`engine.ops.splitk`): a row rounds alike at any row count, in another fp32 order than unsplit."""

from __future__ import annotations

from functools import lru_cache
from operator import itemgetter

import torch

from engine.attention.triton_backend import next_pow2
from engine.ops.elementwise import add_rmsnorm, silu_mul
from engine.ops.gemv import dot_tiles
from engine.ops.prologue import (
    LINEAR_MAX_WEIGHT,
    LOGITS_DOT_TILES,
    prologue_linear,
    prologue_norm,
    tile_width,
)
from engine.ops.tile_tables import (
    PREFILL_BLOCKS_M,
    k_layout,
    valid_large_tiles,
    valid_row_tiles,
    wide_tile,
)

BLOCK_M = 16  # rows of a tile by default: the smallest tensor-core block, so one row wastes least
VOCAB_RATIO = 16  # N / K from which a weight is an LM head: LOGITS_DOT_TILES
# (BLOCK_N, BLOCK_K, warps) of the decoder layer's projections.
LAYER_TILES = (32, 128, 4)
# A decoder-layer projection of at most LINEAR_MAX_WEIGHT elements and no GLU, latency-bound at
# few rows, takes all of K in one tile up to WHOLE_K keys, else (16 columns, 512 keys): 22% less
# time a layer at one row on an H100, less at 64 too (profile/det_tiles_e80366d.json), but long
# prefill chunks slower (profile/det64_cc08510.json). GLU keeps LAYER_TILES (two whole-row
# weight tiles run slower), and so does split-K (LAYER_SPLITS > 1).
WHOLE_K = 1024
# K-splits of the decoder layer's projections (1: none; an A/B process sets it with
# `--set engine.ops.invariant.LAYER_SPLITS=4`). More programs for a projection of few column
# blocks and a long K, which at few rows is latency-bound walking K.
LAYER_SPLITS = 1
# Opt-in (BLOCK_M, BLOCK_N) of the decoder layer's projections by row count: None (the
# tiles above at every count), or ((max_rows, BLOCK_M, BLOCK_N), ...) in increasing max_rows,
# a launch of m rows taking the first entry with m <= max_rows (see the module docstring).
ROW_TILES = None
# Launches of at least PREFILL_ROWS rows (None: none) take PREFILL_TILES on sm_90, where their
# shared memory fits and tl.dot rounds as the 16-row tiles' does (see the module docstring).
PREFILL_ROWS = 256
# (BLOCK_M, BLOCK_N, BLOCK_K, warps) from PREFILL_ROWS rows by the projection's kind, BLOCK_K
# None for the shape's: a norm prologue must keep it (its row sums are laid out along K by
# BLOCK_K), and so must split-K (it cuts K in whole BLOCK_K tiles).
PREFILL_TILES = {"norm": (32, 128, None, 8), "glu": (128, 64, None, 8), "plain": (64, 64, 64, 4)}
# BLOCK_N of the norm tile where K is walked in tiles of more than 128 keys: x and the residual
# are double-buffered then, and 128 columns would overflow shared memory.
NORM_LOOP_BLOCK_N = 32
# Warps of a projection with a norm prologue (qkv, gate_up) in launches of at most
# NORM_WARPS_ROWS rows (None: the shape's; else 4 or 8), where the tile lays the norm's K out
# as at the shape's warps (elsewhere those stay): more warps shorten a latency-bound launch of
# few rows (one stream 8% faster on an H100, same bits: profile/det64_nw8_33b1cef.json) and
# lengthen one of many row blocks.
NORM_WARPS = 8
NORM_WARPS_ROWS = 16
# Launches of at least HEAD_ROWS rows (None: none) give an LM head HEAD_TILES (BLOCK_M,
# BLOCK_N, BLOCK_K, warps) where PREFILL_TILES apply (`prefill_suits`, 16-bit activations): a
# wide verify's head is its largest projection. On an H100, SmolLM2's head in these tiles has
# the 16-row tiles' bits at 1-512 rows, as fast up to 16 and faster from 32
# (profile/det_head_rows_c34f373.json).
HEAD_ROWS = 32
HEAD_TILES = (64, 128, 64, 4)
# Opt-in: the norm prologue's row sums in chunks of NORM_K keys (`prologue_linear(norm_k=)`), an
# order no BLOCK_K changes, so qkv and gate_up may take any BLOCK_K (unsplit): NORM_BLOCK_K below
# PREFILL_ROWS (None: the shape's), PREFILL_TILES' own from it. Opt-in until figure 6 runs it.
NORM_K = None
NORM_BLOCK_K = None
# Opt-in: where a decoder layer's norm projection (qkv, gate_up) takes PREFILL_TILES, its norm
# runs as a launch of its own in the tiles a row alone takes (`prologue_norm`: the same sums
# and roundings) and the projection in the plain or GLU kind's tiles: with the norm in its
# prologue, qkv keeps its whole-K tile (72 us at 2048 rows on an H100, cuBLAS 10 us:
# profile/det64_nw8_33b1cef.json). "plain": gate_up then projects [gate | up] as one plain
# projection and `silu_mul` rounds as its GLU epilogue would. Opt-in: same bits on an H100, the
# kernels 1.2-2.6x faster at 256-2048 rows, but SmolLM2's host-bound eager prefill pays more for
# the extra launch than it saves (profile/det_host_time_98129b8.json).
PREFILL_NORM_APART = False
# A decoder layer's projection of over LARGE_WEIGHT elements (None: none; Llama-8B's, Qwen-1.5B's
# gate_up and down), 16-bit, on PREFILL_TILES' devices: `dot_tiles` (LARGE_TILES), norm and SiLU
# apart (a row a program). Pipelined, each output's k16 MMA steps in K order: on an H100, each
# row of Llama-8B's the same bits at any tile and 1-2048 rows, 1.4-3x the 16-row tiles' speed.
LARGE_WEIGHT = LINEAR_MAX_WEIGHT
LARGE_HEADS = False  # LM heads too: Llama-8B's faster, SmolLM2's not (profile/large_heads_*)
# ((max_rows, min_cols, (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps)), ...): m rows of c columns
# ([gate | up] both) take the first entry with m <= max_rows and c >= min_cols, (None, 0, tiles)
# last. On an H100 at 64 rows (profile/bigdet_31cd1b6.json) 16-row tiles suit narrow projections,
# 64-row ones gate_up's 28672 columns: a layer 188 us (all 64-row: 223; cuBLAS 172).
LARGE_TILES = ((16, 0, (16, 32, 256, 5, 4)), (64, 16384, (64, 128, 64, 3, 8)),
               (64, 0, (16, 64, 128, 4, 4)), (128, 0, (64, 64, 64, 4, 4)),
               (None, 0, (128, 128, 64, 4, 8)))


def row_tiles(table, m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a launch of m rows by the ROW_TILES table `table` (validated)."""
    for rows, bm, bn in valid_row_tiles(table):
        if m <= rows:
            return bm, bn
    raise ValueError(f"ROW_TILES covers up to {table[-1][0]} rows, not {m}")


def layer_tiles(n: int, k: int, glu: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of a decoder layer's projection of an [n, k] weight (n: the
    gate's columns with `glu`), from its shape alone (see WHOLE_K)."""
    bn, bk, warps = LAYER_TILES
    if glu or n * k > LINEAR_MAX_WEIGHT or layer_splits() > 1:  # split-K walks K in LAYER_TILES
        return bn, bk, warps
    return (32, next_pow2(k, 16), warps) if k <= WHOLE_K else (16, 512, warps)


def prefill_tiles(k: int, bk: int, glu: bool, norm: bool,
                  free_k: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of a projection of K `k` in a launch of at least
    PREFILL_ROWS rows, bk the shape's BLOCK_K (see PREFILL_TILES; ValueError if malformed);
    free_k: a norm's sums do not follow BLOCK_K (NORM_K), so its kind may name one (kept
    only unsplit, as a plain projection's)."""
    kind = "glu" if glu else "norm" if norm else "plain"
    tiles = PREFILL_TILES.get(kind) if isinstance(PREFILL_TILES, dict) else None
    if not isinstance(tiles, tuple) or len(tiles) != 4 or any(
            type(v) is not int for v in (tiles[0], tiles[1], tiles[3])) or not (
            wide_tile(tiles[0], tiles[1], tiles[3])
            and (tiles[2] is None or ((kind == "plain" or free_k) and type(tiles[2]) is int
                                      and tile_width(tiles[2])))):
        raise ValueError(f"PREFILL_TILES[{kind!r}] must be (BLOCK_M in {PREFILL_BLOCKS_M}, "
                         f"BLOCK_N, BLOCK_K (None with a norm prologue), warps 4 or 8), BLOCK_N "
                         f"and BLOCK_K powers of two >= 16, not {tiles!r}")
    bm, bn, wide_k, warps = tiles
    if wide_k is not None and layer_splits() <= 1:
        bk = wide_k
    if kind == "norm" and norm_loops(k, bk):
        bn = NORM_LOOP_BLOCK_N
    return bm, bn, bk, warps


def norm_loops(k: int, bk: int) -> bool:
    """Whether a norm prologue walks K in tiles of more than 128 keys: x and the residual are
    double-buffered then, so its tiles take at most NORM_LOOP_BLOCK_N columns."""
    return k > bk > 128


@lru_cache(maxsize=16)
def prefill_suits(device: torch.device) -> bool:
    """Whether launches on `device` take PREFILL_TILES: sm_90 (their shared memory fits, and
    its warp-group MMA rounds as mma.sync on the GPU cases), or Triton's interpreter."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) == (9, 0)


def invariant_tiles(n: int, k: int, m: int | None = None, glu: bool = False,
                    norm: bool = False, head: bool = False, prefill: bool = True,
                    elem: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the deterministic projection of an [n, k] weight
    (n: the gate's columns with `glu`; norm: with a norm prologue; head: an LM head, as is a
    weight of at least VOCAB_RATIO x k rows) in a launch of m rows (in a CUDA graph, its
    bucket's padded count): from the shape alone, but for a decoder layer's projection's tiles
    by m where ROW_TILES, PREFILL_ROWS or NORM_WARPS is set, an LM head's where HEAD_ROWS is
    (m None: only where they cannot depend on it); `prefill` False (a device without PREFILL_TILES,
    `prefill_suits`): never PREFILL_TILES or HEAD_TILES, nor for activations of `elem` bytes
    other than 2 (their tiles overflow shared memory). ValueError for a malformed setting."""
    kb = next_pow2(k, 16)  # a BLOCK_K past K is cut to K's power of two
    if is_head(n, k, head):  # a norm's sums or a GLU keep the 16-row tiles' order
        return head_tiles(kb, m, prefill and elem == 2 and not (norm or glu))
    wide = PREFILL_ROWS is not None and prefill and elem == 2
    if (ROW_TILES is not None or wide) and m is None:
        raise ValueError("ROW_TILES or PREFILL_ROWS is set: a decoder layer's tiles need the "
                         "row count")
    bn, bk, warps = layer_tiles(n, k, glu)
    shape_bk = bk
    sums = norm or glu  # a norm prologue's row sums, whose order the tiles must keep
    chunk = norm_chunk() if sums else 0
    free_k = bool(chunk) and layer_splits() == 1  # split-K cuts K in whole BLOCK_K tiles
    keys = 16 // max(1, elem)  # a thread's keys: one 16-byte load

    def span(b: int) -> int:  # the width of the tiles a norm's row sums go over
        return chunk or min(b, kb)

    # A K off the 16-byte load's multiple loads narrower: its layout is not told here.
    ref = k_layout(BLOCK_M, span(bk), warps, keys) if sums and k % keys == 0 else None

    def keeps(b: int, b_k: int, w: int) -> bool:  # sums a norm's rows as the 16-row tiles do
        return ref is not None and k_layout(b, span(b_k), w, keys) == ref

    bm, small = BLOCK_M, (BLOCK_M, warps)
    if NORM_BLOCK_K is not None and (type(NORM_BLOCK_K) is not int
                                     or not tile_width(NORM_BLOCK_K)):
        raise ValueError(f"NORM_BLOCK_K must be None or a power of two >= 16, not "
                         f"{NORM_BLOCK_K!r}")
    if free_k and NORM_BLOCK_K is not None:
        bk = NORM_BLOCK_K
    if ROW_TILES is not None:
        bm, bn = row_tiles(ROW_TILES, m)
        if norm and norm_loops(k, bk):
            bm, bn = min(bm, 32), min(bn, NORM_LOOP_BLOCK_N)
    if norm and NORM_WARPS is not None:
        if type(NORM_WARPS) is not int or NORM_WARPS not in (4, 8):
            raise ValueError(f"NORM_WARPS must be None, 4 or 8, not {NORM_WARPS!r}")
        if type(NORM_WARPS_ROWS) is not int or NORM_WARPS_ROWS < 1:
            raise ValueError(f"NORM_WARPS_ROWS must be a positive int, not {NORM_WARPS_ROWS!r}")
        if NORM_WARPS != warps and keeps(bm, bk, NORM_WARPS):
            if m is None:
                raise ValueError("NORM_WARPS is set: a norm projection's tiles need the row "
                                 "count")
            if m <= NORM_WARPS_ROWS:
                warps = NORM_WARPS
    if sums and (bm, warps) != small and not keeps(bm, bk, warps):
        raise ValueError(f"ROW_TILES give tiles {(bm, bn, bk, warps)} that would sum a "
                         f"norm's rows in another order")
    if wide:
        if type(PREFILL_ROWS) is not int or PREFILL_ROWS < 1:
            raise ValueError(f"PREFILL_ROWS must be None or a positive int, not {PREFILL_ROWS!r}")
        tiles = prefill_tiles(k, shape_bk, glu, norm, bool(chunk))  # checked at any count
        # A norm's sums must keep the small tiles' order; where that cannot be told (a tiny
        # K), those tiles stay.
        if m >= PREFILL_ROWS and (not sums or keeps(tiles[0], tiles[2], tiles[3])):
            bm, bn, bk, warps = tiles
    return bm, bn, min(bk, kb), warps


def cached_tiles(*args) -> tuple[int, int, int, int]:
    """`invariant_tiles(*args)`, remembered per snapshot of this module's settings (a prefill
    chunk's eager forward asks for them at every launch)."""
    if ROW_TILES is not None:  # checked by entry types, which the snapshot's key does not hold
        valid_row_tiles(ROW_TILES)
    g = globals()
    try:
        settings = _SETTINGS(g)  # with their types: 256.0 == 256 but only one is valid
        return _tiles_at(settings, tuple(map(type, settings)),
                         tuple(tuple(g[name].items()) if isinstance(g[name], dict) else g[name]
                               for name in _TABLES), *args)
    except TypeError:  # an unhashable (malformed) setting: `invariant_tiles` says which
        return invariant_tiles(*args)


@lru_cache(maxsize=4096)
def _tiles_at(settings: tuple, types: tuple, tables: tuple, *args) -> tuple[int, int, int, int]:
    return invariant_tiles(*args)


def head_tiles(kb: int, m: int | None, wide: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of an LM head of K's power of two `kb` in a launch of
    m rows: HEAD_TILES from HEAD_ROWS rows where `wide` (PREFILL_TILES' devices and
    activations), else 16 rows and LOGITS_DOT_TILES."""
    if HEAD_ROWS is not None and wide:
        if type(HEAD_ROWS) is not int or HEAD_ROWS < 1:
            raise ValueError(f"HEAD_ROWS must be None or a positive int, not {HEAD_ROWS!r}")
        t = HEAD_TILES
        if (not isinstance(t, tuple) or len(t) != 4 or any(type(v) is not int for v in t)
                or not (wide_tile(t[0], t[1], t[3]) and tile_width(t[2]))):
            raise ValueError(f"HEAD_TILES must be (BLOCK_M in {PREFILL_BLOCKS_M}, BLOCK_N, "
                             f"BLOCK_K powers of two >= 16, warps 4 or 8), not {t!r}")
        if m is None:
            raise ValueError("HEAD_ROWS is set: an LM head's tiles need the row count")
        if m >= HEAD_ROWS:
            return t[0], t[1], min(t[2], kb), t[3]
    bn, bk, warps = LOGITS_DOT_TILES
    return BLOCK_M, bn, min(bk, kb), warps


def large_tiles(n: int, k: int, m: int, glu: bool, head: bool, wide: bool, elem: int
                ) -> tuple[int, int, int, int, int] | None:
    """`dot_tiles`' tiles of a decoder layer's projection of an [n, k] weight (n: the gate's
    columns with `glu`; an LM head's with LARGE_HEADS) in a launch of m rows where it takes them
    (`LARGE_WEIGHT`, 16-bit, `wide`: PREFILL_TILES' devices), else None; ValueError: bad setting."""
    if type(LARGE_WEIGHT) not in (int, type(None)) or (LARGE_WEIGHT or 0) < 0 \
            or type(LARGE_HEADS) is not bool:
        raise ValueError(f"LARGE_WEIGHT {LARGE_WEIGHT!r}: None or an int >= 0; LARGE_HEADS: a bool")
    if LARGE_WEIGHT is None:
        return None
    cols = 2 * n if glu else n  # [gate | up]'s both halves
    if (is_head(n, k, head) and not LARGE_HEADS) or not wide or elem != 2 \
            or cols * k <= LARGE_WEIGHT:
        return None
    return next(t for rows, least, t in valid_large_tiles(LARGE_TILES)
                if (rows is None or m <= rows) and cols >= least)


def norm_chunk() -> int:
    """NORM_K validated (0 where None)."""
    if NORM_K is None:
        return 0
    if type(NORM_K) is not int or not tile_width(NORM_K):
        raise ValueError(f"NORM_K must be None or a power of two >= 16, not {NORM_K!r}")
    return NORM_K


def invariant_splits(n: int, k: int, head: bool = False) -> int:
    """K-splits asked of the deterministic projection of an [n, k] weight, from the shape and
    `LAYER_SPLITS` alone: the decoder layer's projections LAYER_SPLITS, an LM head (`head`, or
    at least VOCAB_RATIO x k rows) none (`prologue_linear` takes fewer where K has fewer
    tiles)."""
    return 1 if is_head(n, k, head) else layer_splits()


def layer_splits() -> int:
    """LAYER_SPLITS validated (a positive int)."""
    if type(LAYER_SPLITS) is not int or LAYER_SPLITS < 1:
        raise ValueError(f"LAYER_SPLITS must be a positive int, not {LAYER_SPLITS!r}")
    return LAYER_SPLITS


def is_head(n: int, k: int, head: bool = False) -> bool:
    """Whether an [n, k] weight is an LM head's: `head`, or at least VOCAB_RATIO x k rows."""
    return head or n >= VOCAB_RATIO * k


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu: bool = False,
                     glu: bool = False, head: bool = False):
    """What `prologue_linear` computes with the same arguments and returns (`linear(rmsnorm(x +
    residual))`, `linear(silu_mul(x))` or `linear(x)`), each row's bits the same at any row
    count: the norm in the projection's prologue, SiLU-and-mul as its own kernel before it,
    the projection through `invariant_tiles` (of x's row count) and `invariant_splits`. glu:
    weight is [gate | up] and the result is `silu_mul` of the projection, in its epilogue.
    head: the weight is an LM head's. Where `norm_apart`, the norm runs as its own launch;
    where `large_tiles`, so do the norm and SiLU-and-mul, and the projection takes `dot_tiles`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if silu:
        x = silu_mul(x)
    n, k = weight.shape
    n = n // 2 if glu else n
    m, elem, wide = x.shape[0], x.element_size(), prefill_suits(x.device)
    big = large_tiles(n, k, m, glu, head, wide, elem)
    if big is not None:  # the norm and SiLU-and-mul a row a program, then pipelined tiles
        assert (residual is None or norm_weight is not None) and not (glu and bias is not None)
        a = add_rmsnorm(x, norm_weight, eps, residual) if norm_weight is not None else x
        x, res = (a, None) if residual is None else a
        y = dot_tiles(x, weight, bias, big)
        y = silu_mul(y) if glu else y
        return y if res is None else (y, res)
    if norm_weight is not None and norm_apart(n, k, m, head, wide, elem):
        # the norm in the tiles a row alone takes, then the projection of its output
        a = prologue_norm(x, norm_weight, eps, residual,
                          cached_tiles(n, k, 1, glu, True, head, wide, elem), norm_chunk())
        normed = a[0] if residual is not None else a
        plain = glu and PREFILL_NORM_APART == "plain"  # [gate | up] plain, then silu_mul
        if plain:
            n, glu = 2 * n, False
        y = prologue_linear(normed, weight, bias, glu=glu,
                            tiles=cached_tiles(n, k, m, glu, False, head, wide, elem),
                            splits=invariant_splits(n, k, head))
        y = silu_mul(y) if plain else y
        return y if residual is None else (y, a[1])
    return prologue_linear(x, weight, bias, norm_weight=norm_weight, eps=eps,
                           residual=residual, glu=glu,
                           tiles=cached_tiles(n, k, m, glu, norm_weight is not None, head, wide,
                                              elem),
                           splits=invariant_splits(n, k, head),
                           norm_k=norm_chunk() if norm_weight is not None else 0)


def norm_apart(n: int, k: int, m: int, head: bool, prefill: bool, elem: int) -> bool:
    """Whether a norm projection of an [n, k] weight in a launch of m rows runs its norm apart
    (PREFILL_NORM_APART): a decoder layer's, where PREFILL_TILES apply (`invariant_tiles`)."""
    if type(PREFILL_NORM_APART) is not bool and PREFILL_NORM_APART != "plain":
        raise ValueError(f"PREFILL_NORM_APART must be True, False or 'plain', not "
                         f"{PREFILL_NORM_APART!r}")
    return (PREFILL_NORM_APART and type(PREFILL_ROWS) is int and prefill and elem == 2
            and not is_head(n, k, head) and m >= PREFILL_ROWS)  # else `invariant_tiles` checks


# What `cached_tiles` keys on: the upper-case settings, the dict ones (tables) by their items.
_TABLES = tuple(k for k, v in globals().items() if k.isupper() and isinstance(v, dict))
_SETTINGS = itemgetter(*(k for k in globals() if k.isupper() and k not in _TABLES))
