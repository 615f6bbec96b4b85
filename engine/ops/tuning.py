"""Per weight shape, time our large-projection kernels (`engine.ops.gemv`) against cuBLAS on
the GPU at hand, at graph set-up, and record the choice in LARGE_LINEAR."""

from __future__ import annotations

import torch

from engine.ops.elementwise import silu_mul
from engine.ops.gemv import (
    DOT_ROWS_TILES,
    GEMV_TILES,
    LARGE_LINEAR,
    dot_rows,
    gemv_rows,
    gemv_silu,
    large_key,
)

# Candidates: GEMV tiles (BLOCK_N, BLOCK_K, warps) at one row, dot tiles (BLOCK_N, BLOCK_K,
# STAGES, warps) at DOT_TUNE_ROWS rows; cuBLAS is always one too.
GEMV_CANDIDATES = [GEMV_TILES, (4, 512, 4), (16, 512, 4), (8, 512, 8)]
DOT_CANDIDATES = [DOT_ROWS_TILES, (32, 128, 5, 4), (64, 256, 3, 4), (32, 512, 3, 4)]
DOT_TUNE_ROWS = 8
# A kernel replaces the default only when timed alone at least this much faster: a lone
# kernel's timing misses the overlap between kernels of a forward (programmatic launch),
# so small lone wins were lost in the forward.
TUNE_MARGIN = 1.05


def _rows_choice(rows: dict):
    """The fastest dot tile for several rows, unless cuBLAS beats it by TUNE_MARGIN (our
    kernel loads its first weight tiles while the kernel before it finishes, which cuBLAS
    cannot, so the lone timing undersells it)."""
    dots = [t for t in rows if t != "cublas"]
    return _beats(rows, min(dots, key=rows.get)) if dots else "cublas"


def _beats(times: dict, default):
    """The key of the fastest time, unless it beats `default`'s by less than TUNE_MARGIN."""
    best = min(times, key=times.get)
    return best if times[best] * TUNE_MARGIN <= times[default] else default


def _tuning(weights: list[torch.Tensor], rows: int, reps: int):
    """(x, us) for timing kernels on these weights: `rows` random rows in their dtype, and
    us(fn), GPU microseconds per call of fn(weight) in a CUDA graph that cycles through the
    weights (with several copies each call reads its weight from HBM, as a forward does)."""
    from engine.graphs import graph_time_us

    w0 = weights[0]
    gen = torch.Generator(device=w0.device).manual_seed(0)
    x = torch.randn(rows, w0.shape[1], device=w0.device, dtype=w0.dtype, generator=gen)
    n_reps = min(reps, len(weights)) if len(weights) > 1 else 2

    def us(fn):
        return round(graph_time_us(lambda i: fn(weights[i % len(weights)]), n_reps), 2)

    return x, us


def tune_gemv_silu(weights: list[torch.Tensor], reps: int = 8) -> dict:
    """For gate_up weights ([2N, K], already in LARGE_LINEAR with a one-row GEMV): time
    `gemv_silu` (each candidate GEMV tile with half its columns per half, so a program still
    reads as many weight rows) against the chosen GEMV followed by `silu_mul`, and record the
    faster in LARGE_LINEAR (key "silu": tiles, or None for the two launches)."""
    choice = LARGE_LINEAR[large_key(weights[0])]
    x, us = _tuning(weights, 1, reps)
    times = {"gemv+silu_mul": us(lambda w: silu_mul(gemv_rows(x, w, tiles=choice["one"])))}
    for bn, bk, warps in GEMV_CANDIDATES:
        t = (max(1, bn // 2), bk, warps)
        times[t] = us(lambda w, t=t: gemv_silu(x, w, tiles=t))
    best = _beats(times, "gemv+silu_mul")
    choice["silu"] = None if best == "gemv+silu_mul" else best
    return {"silu": choice["silu"], "silu_us": {str(t): v for t, v in times.items()}}


def tune_large_linear(weights: list[torch.Tensor], reps: int = 8) -> dict:
    """Choose, on this GPU, the kernel for one row (GEMV or cuBLAS) and for several rows (dot
    tiles or cuBLAS) of projections with these weights (several copies, so each timed call reads
    its weight from HBM as a forward does). Records it in LARGE_LINEAR and returns it with the
    timings (us)."""
    x, us = _tuning(weights, DOT_TUNE_ROWS, reps)
    one = {"cublas": us(lambda w: torch.nn.functional.linear(x[:1], w))}
    for t in GEMV_CANDIDATES:
        one[t] = us(lambda w, t=t: gemv_rows(x[:1], w, tiles=t))
    rows = {"cublas": us(lambda w: torch.nn.functional.linear(x, w))}
    for t in DOT_CANDIDATES:
        try:
            rows[t] = us(lambda w, t=t: dot_rows(x, w, tiles=t))
        except Exception:  # noqa: BLE001 - a tile this GPU cannot run (shared memory)
            continue
    best_one, best_rows = _beats(one, GEMV_TILES), _rows_choice(rows)
    choice = {"one": None if best_one == "cublas" else best_one,
              "rows": None if best_rows == "cublas" else best_rows}
    LARGE_LINEAR[large_key(weights[0])] = choice
    return {**choice, "one_us": {str(t): v for t, v in one.items()},
            "rows_us": {str(t): v for t, v in rows.items()}}
