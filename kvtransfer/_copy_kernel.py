"""The Triton kernel behind `staging.copy_blocks` (imported only where Triton runs)."""

import triton
import triton.language as tl


@triton.jit
def copy_blocks_kernel(kv, packed, ids, n, e, kv_s0, kv_s1, p_s0, p_s1,
                       GATHER: tl.constexpr, TILE: tl.constexpr):
    """Program (r * n + j, t): elements [t*TILE, (t+1)*TILE) of row r of block ids[j]."""
    pid = tl.program_id(0)
    r = pid // n
    j = pid % n
    blk = tl.load(ids + j)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < e
    kv_ptr = kv + r.to(tl.int64) * kv_s0 + blk.to(tl.int64) * kv_s1 + offs
    p_ptr = packed + r.to(tl.int64) * p_s0 + j.to(tl.int64) * p_s1 + offs
    if GATHER:
        tl.store(p_ptr, tl.load(kv_ptr, mask=mask), mask=mask)
    else:
        tl.store(kv_ptr, tl.load(p_ptr, mask=mask), mask=mask)
