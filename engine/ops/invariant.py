"""Row-invariant projections of the deterministic mode (`EngineConfig.deterministic`): every
projection, at any row count, is one `prologue_linear` launch with tensor-core tiles chosen
from the weight's shape alone, so each row is reduced by the same kernel in the same K order
with fp32 accumulation whether it is alone, in a verify step or in a prefill chunk.

Rows of a tile do not mix: a row past the count is masked to zeros, and a tile's MMA
computes each output row from its own inputs. No split-K, no choice by row count, no choice
by timing (a restarted process must pick the same tiles)."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import next_pow2
from engine.ops.prologue import LOGITS_DOT_TILES, prologue_linear

BLOCK_M = 16  # rows of every tile: the smallest tensor-core block, so one row wastes least
# (BLOCK_N, BLOCK_K, warps) by the weight's shape [N, K] (`invariant_tiles`).
NARROW_TILES = (16, 128, 2)  # a projection no wider than long: more programs per column
WIDE_TILES = (32, 128, 4)  # wider than long (qkv, gate_up)
# The LM head (N at least VOCAB_RATIO times K): its 16-row tiles, as the default mode's
# one-row LM head takes them.
VOCAB_RATIO = 16


def invariant_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the deterministic projection of an [n, k] weight,
    from the shape alone."""
    if n >= VOCAB_RATIO * k:
        bn, bk, warps = LOGITS_DOT_TILES
    elif n > k:
        bn, bk, warps = WIDE_TILES
    else:
        bn, bk, warps = NARROW_TILES
    return BLOCK_M, bn, min(bk, next_pow2(k, 16)), warps


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     **prologue):
    """`prologue_linear(x, weight, bias, **prologue)` (a norm or SiLU-and-mul folded in, as
    there) through `invariant_tiles`: each row's bits the same at any row count."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return prologue_linear(x, weight, bias, tiles=invariant_tiles(*weight.shape), **prologue)
