"""Deterministic split-K for `prologue_linear` (opt-in, `invariant.LAYER_SPLITS`): a projection's
K tiles are cut into S contiguous ranges fixed by the shape, one program per (row block,
column block, range), each accumulating its range's tiles in the usual order into an fp32
partial tile. The partials are summed in range order 0, 1, .., S-1 whichever program finishes
first, so a row's bits depend on its own inputs and the shape alone, never on the row count or
on timing.

The fold runs in the same launch: every program writes its partial to a workspace and counts
itself done on its tile's counter; the program that counts last reads the S partials in index
order and goes on to the epilogue, then puts the counter back to 0 for the next launch (or
graph replay). A second fold launch would add a launch to each of a decode layer's four
projections, which are latency-bound chains at few rows; the interpreter runs the programs one
after another, so the counter elects a folder there as well.

A device's split launches share its counters: launches in one stream never overlap on them
(with programmatic dependent launch, a kernel touches them only after `gdc_wait`, when the
kernel before it has finished), launches on two streams at once would."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import cdiv, triton, triton_available

# Counters per (device, size class): a CUDA graph keeps the address it captured, so a buffer,
# once made, lives as long as the process and is never replaced.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
MIN_COUNTERS = 256  # smallest size class: every decode batch's tiles of a small model

if triton_available():
    import triton.language as tl

    @triton.jit
    def fold_splits(WS, CNT, acc, acc2, tile, pid_s, SPLITS: tl.constexpr, GLU: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(acc, acc2, mine): this program's partial tiles (acc2: GLU's up columns) written to
        WS[tile, pid_s]; mine ([BLOCK_M], all alike): whether it finished the tile last, in
        which case acc and acc2 are the sums of the tile's SPLITS partials in split order,
        and CNT[tile] is 0 again."""
        NACC: tl.constexpr = 2 if GLU else 1
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        r = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        base = WS + tile.to(tl.int64) * (SPLITS * NACC * TILE)
        tl.store(base + pid_s * (NACC * TILE) + r, acc)
        if GLU:
            tl.store(base + pid_s * (NACC * TILE) + TILE + r, acc2)
        tl.debug_barrier()  # all of the program's partial stored before it counts itself done
        done = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        # Masks as blocks compared with the count (the interpreter cannot mask with a scalar
        # bool and a block together); the other programs load nothing.
        ok = tl.full([BLOCK_M, BLOCK_N], SPLITS - 1, tl.int32) == done
        for s in tl.static_range(SPLITS):  # in split order, whichever program folds
            p = tl.load(base + s * (NACC * TILE) + r, mask=ok, other=0.0, cache_modifier=".cg")
            if GLU:
                p2 = tl.load(base + s * (NACC * TILE) + TILE + r, mask=ok, other=0.0,
                             cache_modifier=".cg")
            if s == 0:
                acc = p
                if GLU:
                    acc2 = p2
            else:
                acc += p
                if GLU:
                    acc2 += p2
        tl.atomic_xchg(CNT + tile, 0, mask=done == SPLITS - 1, sem="relaxed", scope="gpu")
        return acc, acc2, tl.full([BLOCK_M], SPLITS - 1, tl.int32) == done


def split_plan(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(S, columns per split) of a K of k in tiles of block_k asked to split `splits` ways:
    ranges of whole tiles, as even as they go, and no empty range (S <= splits)."""
    tiles = cdiv(k, block_k)
    per = cdiv(tiles, max(1, splits))
    return cdiv(tiles, per), per * block_k


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for `tiles` output tiles on `device`, from a buffer that lives as
    long as the process (kernels leave it zeroed). Made outside CUDA graph capture only: a
    buffer zeroed inside a capture would hold zeros only on replay."""
    size = max(MIN_COUNTERS, 1 << (tiles - 1).bit_length())
    key = (device, size)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters for {tiles} tiles first made inside a CUDA "
                               "graph capture: run the shape once before capturing it")
        buf = _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def workspace(x: torch.Tensor, tiles: int, splits: int, glu: bool, block_m: int,
              block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counters) of a split launch over `tiles` output tiles: fp32 partial tiles
    (two per split with glu) from the caching allocator, and the device's counters."""
    ws = torch.empty(tiles * splits * (2 if glu else 1) * block_m * block_n,
                     dtype=torch.float32, device=x.device)
    return ws, counters(x.device, tiles)
