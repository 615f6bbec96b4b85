"""Row-invariant projections of the deterministic mode (`EngineConfig.deterministic`): at any
row count, each row of a projection is computed by the same kernel with the same tiles, chosen
from the weight's shape alone, in the same K order with fp32 accumulation, so its bits are the
same whether it is alone, in a verify step or in a prefill chunk. No choice by row count, no
choice by timing (a restarted process must pick the same tiles).

A projection is `prologue_linear` with 16-row tensor-core tiles: rows past the count are masked
to zeros and an MMA computes each output row from its own inputs, so the rows of a tile do not
mix. A norm before it is the kernel's prologue: each tile computes its rows' mean squares
over all of K in a fixed order, one row at a time, so a row's norm does not depend on the
tile's other rows either (a separate norm launch per projection cost a decode step more than
the norm itself). SiLU-and-mul is gate_up's epilogue (`glu`): each program computes matching
gate and up columns and combines them as `silu_mul` would (the tiles' SiLU prologue on
down_proj was slower); `silu=True` still runs `silu_mul` before the projection.

Split-K is opt-in (`LAYER_SPLITS`): the decoder layer's projections then cut K into ranges of
whole tiles fixed by the weight's shape, each range one program, the partial tiles summed in
range order (`engine.ops.splitk`). A row still rounds the same at any row count; the sums
differ from the unsplit ones in fp32 order only."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import next_pow2
from engine.ops.elementwise import silu_mul
from engine.ops.prologue import LOGITS_DOT_TILES, prologue_linear

BLOCK_M = 16  # rows of every tile: the smallest tensor-core block, so one row wastes least
VOCAB_RATIO = 16  # N / K from which a weight is an LM head: LOGITS_DOT_TILES
# (BLOCK_N, BLOCK_K, warps) of the decoder layer's projections.
LAYER_TILES = (32, 128, 4)
# K-splits of the decoder layer's projections (1: none; an A/B process sets it with
# `--set engine.ops.invariant.LAYER_SPLITS=4`). More programs for a projection of few column
# blocks and a long K, which at few rows is latency-bound walking K.
LAYER_SPLITS = 1


def invariant_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the deterministic projection of an [n, k] weight,
    from the shape alone."""
    bn, bk, warps = LOGITS_DOT_TILES if n >= VOCAB_RATIO * k else LAYER_TILES
    return BLOCK_M, bn, min(bk, next_pow2(k, 16)), warps


def invariant_splits(n: int, k: int) -> int:
    """K-splits asked of the deterministic projection of an [n, k] weight, from the shape and
    `LAYER_SPLITS` alone: the decoder layer's projections LAYER_SPLITS, an LM head none
    (`prologue_linear` takes fewer where K has fewer tiles)."""
    return 1 if n >= VOCAB_RATIO * k else LAYER_SPLITS


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu: bool = False,
                     glu: bool = False):
    """What `prologue_linear` computes with the same arguments and returns (`linear(rmsnorm(x +
    residual))`, `linear(silu_mul(x))` or `linear(x)`), each row's bits the same at any row
    count: the norm in the projection's prologue, SiLU-and-mul as its own kernel before it,
    the projection through `invariant_tiles` and `invariant_splits`. glu: weight is [gate |
    up] and the result is `silu_mul` of the projection, in its epilogue."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if silu:
        x = silu_mul(x)
    n, k = weight.shape
    n = n // 2 if glu else n
    return prologue_linear(x, weight, bias, norm_weight=norm_weight, eps=eps,
                           residual=residual, glu=glu, tiles=invariant_tiles(n, k),
                           splits=invariant_splits(n, k))
