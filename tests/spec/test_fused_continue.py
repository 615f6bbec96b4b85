"""The fused step's device bookkeeping (engine/spec/fused_kernels.py): the one-launch Triton
kernels write exactly what the torch ops of `continuation`, `chain_positions` and `accept`
write, for every draft count, with and without a row selection (requests that finished
dropping out)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.attention import triton_available
from engine.spec.fused import continuation
from engine.spec.fused_kernels import FusedOut, continue_inputs

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
# The kernel's tensors: on the GPU where there is one (compiled), else the CPU (interpreter).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def buffers(rows: int, seqs: int, max_blocks: int):
    meta = SimpleNamespace(block_tables=torch.zeros(seqs, max_blocks, dtype=torch.int32),
                           slot_mapping=torch.full((rows,), 7, dtype=torch.int64),
                           seq_lens=torch.zeros(seqs, dtype=torch.int32))
    return torch.full((rows,), 9, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), meta


@pytest.mark.parametrize("pq,q,with_drafts,keep", [
    (1, 1, False, None),  # K=0 after K=0
    (4, 1, True, None),  # back to K=0 after drafting
    (1, 4, True, None),  # drafting after K=0
    (4, 8, True, [0, 2, 3]),  # deeper, two of five rows dropped
    (8, 4, True, [4, 1]),  # shallower, reordered subset
])
def test_kernel_writes_what_the_torch_continuation_writes(pq, q, with_drafts, keep):
    g = torch.Generator().manual_seed(pq * 10 + q)
    pb, bs, max_blocks, width = 5, 4, 12, 7
    rows = list(range(pb)) if keep is None else keep
    b = len(rows)
    grid = torch.randint(0, 1000, (pb * pq + 3,), generator=g)
    nacc = torch.randint(0, pq, (pb + 2,), generator=g)
    drafts = torch.randint(0, 1000, (pb + 2, width), generator=g) if with_drafts else None
    out = FusedOut(grid, nacc, drafts)
    prev = SimpleNamespace(q=pq, seqs=[None] * pb, out=out)
    computed = torch.randint(0, 20, (b,), generator=g)
    kc = torch.randint(0, q, (b,), generator=g)
    state = torch.cat([computed, kc])
    sel = None if keep is None else torch.tensor(keep)
    tables = torch.randint(1, 100, (b, max_blocks), generator=g, dtype=torch.int32)
    got, want = buffers(b * q + 2, b + 1, max_blocks), buffers(b * q + 2, b + 1, max_blocks)
    for _, _, meta in (got, want):
        meta.block_tables[:b] = tables
    continuation(prev, state, b, q, bs, sel)(*want)  # CPU tensors: the torch ops
    meta = SimpleNamespace(**{k: v.to(DEV) for k, v in vars(got[2]).items()})
    ids, pos = got[0].to(DEV), got[1].to(DEV)
    dev_out = FusedOut(*(None if x is None else x.to(DEV) for x in out))
    continue_inputs(dev_out, pq, pb, None if sel is None else sel.to(DEV), state.to(DEV), b, q,
                    bs, ids, pos, meta)
    got = (ids.cpu(), pos.cpu(), SimpleNamespace(**{k: v.cpu() for k, v in vars(meta).items()}))
    for x, y in zip(got[:2], want[:2]):
        assert torch.equal(x, y)
    assert torch.equal(got[2].slot_mapping, want[2].slot_mapping)
    assert torch.equal(got[2].seq_lens, want[2].seq_lens)
    real = (want[2].slot_mapping[: b * q] >= 0).view(b, q).sum(dim=1)
    assert torch.equal(real, kc + 1)


def test_chain_positions_kernel_equals_the_torch_ops():
    """A chained draft step's positions, KV slots and context lengths: the one-launch kernel
    gives what the torch ops give, for rows whose k ends before, at and after step s, padded
    rows (no queries), a position past the table's last column, and a strided k."""
    from engine.spec.fused_kernels import chain_positions

    kq = torch.tensor([[3, 9], [1, 9], [5, 9], [0, 9], [4, 9]])  # k per row: column 0
    k = kq[:, 0]
    start = torch.tensor([10, 4, 30, 0, 7])
    has_q = torch.tensor([True, True, True, False, True])
    tables = torch.tensor([[5, 6, 7], [8, 9, 1], [2, 3, 4], [0, 0, 0], [11, 12, 13]])
    for s in (1, 2, 3, 4):
        want = chain_positions(k, start, has_q, tables, 4, s, kernel=False)
        got = chain_positions(k, start, has_q, tables, 4, s, kernel=True)
        for w, g in zip(want, got):
            assert torch.equal(w, g), (s, want, got)
    p, slots, lens = chain_positions(k, start, has_q, tables, 4, 2, kernel=True)
    assert p.tolist() == [11, 0, 31, 0, 8] and lens.tolist() == [12, 1, 32, 0, 9]
    assert slots.tolist() == [7 * 4 + 3, -1, 4 * 4 + 3, -1, 13 * 4 + 0]
    # Every step of a chain in one launch (a program per step): row i is step s + i.
    for kernel in (True, False):
        every = chain_positions(k, start, has_q, tables, 4, 1, kernel=kernel, steps=4)
        assert all(x.shape == (4, 5) for x in every)
        for i, s in enumerate((1, 2, 3, 4)):
            for w, g in zip(chain_positions(k, start, has_q, tables, 4, s, kernel=False),
                            every):
                assert torch.equal(w, g[i]), (s, kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_launched_past_the_jit_writes_the_same():
    """On the GPU, launches after a variant's first skip Triton's binding (`FastLaunch`) and
    still write what the torch ops write, step after step with new values."""
    from engine.attention.triton_backend import FastLaunch
    from engine.spec import fused_kernels

    dev, pq, q, pb, bs, max_blocks = "cuda", 4, 4, 6, 16, 9
    fast = getattr(fused_kernels._continue_launch, "fast", 0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        out = FusedOut(torch.randint(0, 1000, (pb * pq,), generator=g),
                       torch.randint(0, pq, (pb,), generator=g),
                       torch.randint(0, 1000, (pb, q - 1), generator=g))
        state = torch.cat([torch.randint(0, 40, (pb,), generator=g),
                           torch.randint(0, q, (pb,), generator=g)])
        tables = torch.randint(1, 500, (pb, max_blocks), generator=g)
        want = (torch.zeros(pb * q, dtype=torch.int64), torch.zeros(pb * q, dtype=torch.int64),
                SimpleNamespace(block_tables=tables, slot_mapping=torch.zeros(pb * q).long(),
                                seq_lens=torch.zeros(pb).long()))
        got = tuple(x.to(dev) for x in want[:2]) + (SimpleNamespace(
            block_tables=tables.to(dev), slot_mapping=want[2].slot_mapping.to(dev),
            seq_lens=want[2].seq_lens.to(dev)),)
        prev = SimpleNamespace(q=pq, seqs=[None] * pb, out=out)
        continuation(prev, state, pb, q, bs)(*want)
        continue_inputs(FusedOut(*(x.to(dev) for x in out)), pq, pb, None, state.to(dev), pb,
                        q, bs, *got)
        torch.cuda.synchronize()
        for x, y in ((got[0], want[0]), (got[1], want[1]),
                     (got[2].slot_mapping, want[2].slot_mapping),
                     (got[2].seq_lens, want[2].seq_lens)):
            assert torch.equal(x.cpu(), y)
    if isinstance(fused_kernels._continue_launch, FastLaunch):  # (else: the JIT's launch)
        assert fused_kernels._continue_launch.fast >= fast + 2


@pytest.mark.parametrize("b,q", [(1, 1), (3, 1), (1, 8), (5, 4), (13, 6), (64, 8)])
def test_accept_kernel_equals_the_torch_ops(b, q):
    """The verify's bookkeeping in one launch (`accept`) writes what the torch ops it
    replaces write: accepted counts (none, some, all), the head's KV slots (rows past the
    last accepted and rows that store nothing at -1), chain start, the target's token after
    the accepted drafts, its row, live sequences (a padded bucket's empty ones too) and the
    chain's query starts."""
    from engine.spec.fused_kernels import accept

    g = torch.Generator().manual_seed(b * 100 + q)
    am = torch.randint(0, 6, (b * q,), generator=g)
    ids = torch.randint(0, 6, (b * q,), generator=g)
    grid, ids2 = am.view(b, q), ids.view(b, q)
    want = torch.randint(0, q, (b,), generator=g)  # accepted drafts to plant per sequence
    for i in range(b):
        ids2[i, 1: want[i] + 1] = grid[i, : want[i]]
    slots = torch.randint(0, 1000, (b * q,), generator=g)
    lens = torch.randint(1, 50, (b,), generator=g).to(torch.int32)
    if b > 2:
        slots.view(b, q)[-1] = -1  # a padded sequence of the bucket: no KV, no queries
        lens[-1] = 0
        if q > 2:
            slots.view(b, q)[0, q // 2:] = -1  # padding rows after the real ones
    pos = torch.randint(0, 100, (b * q,), generator=g)
    ref = accept(am, ids, slots, pos, lens, b, q, kernel=False)
    got = accept(am, ids, slots, pos, lens, b, q, kernel=True)
    for r, x in zip(ref, got):
        assert r.dtype == x.dtype and torch.equal(r, x)
    nacc = ref[0]
    if q > 1:  # what was planted, where the rows store KV; some sequences accept something
        assert nacc.max() > 0 and (nacc < q).all()
    assert torch.equal(ref[6], torch.arange(b + 1))
