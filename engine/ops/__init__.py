"""Triton kernels of the fast path, by family:

- `elementwise`: residual-add + RMSNorm, dual norms, rotary (+ KV store), SiLU-and-mul;
- `prologue`: a small model's projection with its norm or SiLU in one launch;
- `gemv`: large projections at few rows (GEMV, 16-row tensor-core blocks);
- `tuning`: which of those a weight shape takes on the GPU at hand;
- `argmax`: row argmax, and argmax keys folded into a GEMV;
- `invariant`: the deterministic mode's projections, each row's bits the same at any row count.

Callers use `from engine import ops` and `ops.<name>`; the names below are the interface.
"""

from engine.attention.triton_backend import triton_available
from engine.ops.argmax import (
    ARGMAX_SPLIT,
    FUSED_ARGMAX,
    KEY_EMPTY,
    Keyed,
    argmax_rows,
    decode_keys,
)
from engine.ops.elementwise import add_rmsnorm, dual_rmsnorm, rope_, rope_store_, silu_mul
from engine.ops.gemv import (
    LARGE_LINEAR,
    dot_rows,
    gemv_rows,
    gemv_silu,
    gemv_silu_suits,
    gemv_suits,
    large_key,
    large_suits,
    linear,
)
from engine.ops.invariant import invariant_linear, invariant_tiles
from engine.ops.prologue import (
    CALIBRATE_MAX_ROWS,
    LINEAR_MAX_ROWS,
    LINEAR_MAX_WEIGHT,
    LOGITS_DOT_TILES,
    linear_tiles,
    prologue_linear,
    prologue_suits,
)
from engine.ops.tuning import tune_gemv_silu, tune_large_linear

__all__ = [
    "ARGMAX_SPLIT", "CALIBRATE_MAX_ROWS", "FUSED_ARGMAX", "KEY_EMPTY", "LARGE_LINEAR",
    "LINEAR_MAX_ROWS", "LINEAR_MAX_WEIGHT", "LOGITS_DOT_TILES", "Keyed", "add_rmsnorm",
    "argmax_rows", "decode_keys", "dot_rows", "dual_rmsnorm", "gemv_rows", "gemv_silu",
    "gemv_silu_suits", "gemv_suits", "invariant_linear", "invariant_tiles", "large_key",
    "large_suits", "linear", "linear_tiles", "prologue_linear", "prologue_suits", "rope_",
    "rope_store_", "silu_mul", "triton_available", "tune_gemv_silu", "tune_large_linear",
]
