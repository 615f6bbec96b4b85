"""Deterministic mode's attention: a query row (a prompt's query at position p, all heads) is
bit-identical as a lone decode, inside a batch of 64 decodes, as any row of a K+1-token verify,
inside a whole or chunked prefill whose earlier keys are already in the cache, and beside a
prefill in one launch: the Triton backend under the interpreter in fp32/fp16 (and compiled in
bf16 on a GPU), the torch backend in fp32, and the default mode as negative control. Triton
splits the keys every 64 here (contexts of 1, below, at and past one split and of several
splits; lone decodes and verifies spread their splits over programs, batches and prefills fold
them in the tile's), and every `DETERMINISTIC_SPLIT_KEYS` in one test as the engine does. One
KV head for 3 query heads: the interpreter's time grows with the programs a launch runs."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttention, TritonAttention, triton_available
from engine.attention.triton_backend import DETERMINISTIC_SPLIT_KEYS, DETERMINISTIC_TILE
from tests.engine.test_triton_attention import DEV, _meta
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

HEADS, KV_HEADS, HEAD_DIM, BS, NUM_BLOCKS = 3, 1, 16, 16, 256
LENS = (300, 131, 40)  # prompt lengths: the first spans five 64-key steps
# (prompt, position) rows checked everywhere: contexts of 1, one split (64), one split and a
# key, four and five splits, three splits, below one split.
TARGETS = [(0, 0), (0, 63), (0, 64), (0, 200), (0, 299), (1, 130), (2, 5)]
# Keys per split in both modes; the default mode splits contexts past it for batches of few
# sequences, and so does the deterministic mode for lone decodes and verifies.
SPLIT_KEYS = 64


def _prompts(dtype) -> dict[str, list[torch.Tensor]]:
    """Per prompt, the queries, keys and values a forward computes at each position."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda n, h: torch.randn(n, h, HEAD_DIM, generator=g).to(dtype).to(DEV)  # noqa: E731
    return {"q": [rnd(n, HEADS) for n in LENS], "k": [rnd(n, KV_HEADS) for n in LENS],
            "v": [rnd(n, KV_HEADS) for n in LENS]}


def _launch(be, data, steps, seed: int = 0) -> dict[tuple[int, int], torch.Tensor]:
    """One forward of `steps`, (prompt, context, queries) per sequence, on blocks handed out
    at random: each sequence's keys before its queries are in the cache already (written by an
    earlier forward), its queries' own K/V go through `forward`. Output row per (prompt, pos)."""
    meta = _meta([(ctx, n) for _, ctx, n in steps], BS, NUM_BLOCKS,
                 torch.Generator().manual_seed(seed))
    dtype = data["q"][0].dtype
    # Slots no sequence owns hold NaN: a key read past a sequence's context would show.
    cache = torch.full((2, NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype,
                       device=DEV)
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    for i, (s, ctx, n) in enumerate(steps):
        pos = torch.arange(ctx - n, device=DEV)
        slots = meta.block_tables[i].long()[pos // BS] * BS + pos % BS
        flat[0, slots], flat[1, slots] = data["k"][s][: ctx - n], data["v"][s][: ctx - n]
    q, k, v = (torch.cat([data[x][s][ctx - n: ctx] for s, ctx, n in steps]) for x in "qkv")
    out = be.forward(q, k, v, cache, meta)
    keys = [(s, p) for s, ctx, n in steps for p in range(ctx - n, ctx)]
    return dict(zip(keys, out))


def _decodes(be, data, targets=TARGETS) -> dict[tuple[int, int], torch.Tensor]:
    """Each target row as a lone one-token decode."""
    return {t: _launch(be, data, [(t[0], t[1] + 1, 1)])[t] for t in targets}


def _decode_batch(be, data):
    """The targets among 57 short decoding sequences: a batch of 64, in shuffled order."""
    g = torch.Generator().manual_seed(1)
    fill = [(j % 3, int(torch.randint(0, 40, (1,), generator=g))) for j in range(57)]
    rows = [TARGETS[i] if i < len(TARGETS) else fill[i - len(TARGETS)]
            for i in torch.randperm(64, generator=g).tolist()]
    return _launch(be, data, [(s, p + 1, 1) for s, p in rows], seed=2)


def _verifies(be, data, k: int):
    """One verify step of k + 1 rows per target, all in one launch; target j sits at row
    (j + k) % (k + 1) of its step where the prompt allows."""
    steps = []
    for j, (s, p) in enumerate(TARGETS):
        r = min(p, max((j + k) % (k + 1), p + k + 1 - LENS[s]))
        steps.append((s, p - r + k + 1, k + 1))
    return _launch(be, data, steps, seed=10 + k)


def _prefills(be, data):
    """The whole prompts in one launch, then the prompts in chunks (a chunk's earlier keys
    in the cache), chunks of different prompts sharing a launch, then a whole prompt beside
    decodes of the targets of the others."""
    yield _launch(be, data, [(s, n, n) for s, n in enumerate(LENS)], seed=3)
    yield _launch(be, data, [(0, 96, 96), (2, 10, 7)], seed=4)
    yield _launch(be, data, [(0, 300, 108), (1, 131, 31)], seed=5)
    yield _launch(be, data, [(1, 131, 131)] + [(s, p + 1, 1) for s, p in TARGETS if s != 1],
                  seed=6)


def _backend(kind: str, deterministic: bool):
    if kind == "torch":
        return TorchAttention(HEADS, KV_HEADS, HEAD_DIM, BS, deterministic=deterministic)
    return TritonAttention(HEADS, KV_HEADS, HEAD_DIM, BS, split_keys=SPLIT_KEYS,
                           deterministic=deterministic)


def _mismatches(be, data, launches):
    """(launch, row) pairs whose row differs from the lone decode of that row, and every
    (launch kind, row) pair compared."""
    alone = _decodes(be, data)
    bad, seen = [], set()
    for name, rows in launches:
        for t in set(rows) & set(alone):
            if not torch.equal(rows[t], alone[t]):
                bad.append((name, t))
            seen.add((name.split()[0], t))
    return bad, seen


TRITON = [torch.float32, torch.float16] if triton_available() else []
CONFIGS = [("torch", torch.float32)] + [("triton", d) for d in TRITON]
if triton_available() and DEV == "cuda":  # bf16, marked so the GPU runs (`-m gpu`) take it
    TRITON.append(pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bf16"))
    CONFIGS.append(pytest.param("triton", torch.bfloat16, marks=pytest.mark.gpu,
                                id="triton-bf16"))


@pytest.mark.parametrize("kind,dtype", CONFIGS)
def test_a_row_rounds_alike_in_every_launch(kind, dtype):
    """Every target row equals its lone decode bit for bit in a 64-sequence decode batch,
    in K+1-row verifies (K = 1, 2, 7: two, three and eight rows), in whole and chunked
    prefills and beside one."""
    be, data = _backend(kind, True), _prompts(dtype)
    launches = [("batch of 64", _decode_batch(be, data))]
    launches += [(f"verify K={k}", _verifies(be, data, k)) for k in (1, 2, 7)]
    launches += [(f"prefill {i}", rows) for i, rows in enumerate(_prefills(be, data))]
    bad, seen = _mismatches(be, data, launches)
    assert not bad
    # Each target was compared in a batch, in verifies and in prefills.
    assert sorted(seen) == sorted((n, t) for n in ("batch", "verify", "prefill") for t in TARGETS)


@pytest.mark.parametrize("kind,dtype", CONFIGS)
def test_default_mode_rounds_a_row_by_its_launch(kind, dtype):
    """Negative control: in the default mode some row of a whole-prompt prefill differs from
    its lone decode (Triton: lone decodes past SPLIT_KEYS split the keys, a prefill never
    does; torch: a prompt's rows share one masked call)."""
    be, data = _backend(kind, False), _prompts(dtype)
    bad, _ = _mismatches(be, data, [("prefill", next(_prefills(be, data)))])
    assert bad


@pytest.mark.parametrize("dtype", TRITON)
def test_split_programs_change_no_row(dtype):
    """Decodes and a verify of few sequences, their splits spread over 1 program per tile
    (which folds them itself), 2, 3 or 5 (partials folded by a second kernel): every row
    bit-identical, and near the torch reference."""
    be, data = _backend("triton", True), _prompts(dtype)
    steps = [(0, 300, 4), (1, 131, 1), (2, 6, 1), (0, 65, 1)]
    outs = []
    for p in (1, 2, 3, 5):
        be.split_programs = lambda splits, n, device, p=p: min(p, splits)
        outs.append(_launch(be, data, steps))
    meta = _meta([(ctx, n) for _, ctx, n in steps], BS, NUM_BLOCKS, torch.Generator())
    assert be.use_split(meta, torch.device(DEV)) == 5  # five 64-key splits of capacity
    assert all(torch.equal(o[t], outs[0][t]) for o in outs[1:] for t in outs[0])
    ref = _launch(TorchAttention(HEADS, KV_HEADS, HEAD_DIM, BS), data, steps)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for t, row in outs[0].items():
        torch.testing.assert_close(row.float(), ref[t].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", TRITON)
def test_engine_split_size_rounds_a_row_alike(dtype):
    """With `DETERMINISTIC_SPLIT_KEYS`-key splits (S): rows at contexts 1, below S, S, S + 1
    and past 2S as lone decodes (past S, over split programs) equal the same rows of a whole
    prefill, of a chunked one and beside it among decodes."""
    be = TritonAttention(HEADS, KV_HEADS, HEAD_DIM, BS, split_keys=DETERMINISTIC_SPLIT_KEYS,
                         deterministic=True)
    data, s = _prompts(dtype), DETERMINISTIC_SPLIT_KEYS
    targets = [(0, 0), (0, s // 2), (0, s - 1), (0, s), (0, 299)]
    alone = _decodes(be, data, targets)
    launches = [[(0, 300, 300)], [(0, 300, 300 - s - 1), (2, 40, 40)],
                [(1, 131, 131)] + [(0, p + 1, 1) for _, p in targets]]
    for i, steps in enumerate(launches):
        rows = _launch(be, data, steps, seed=20 + i)
        both = set(rows) & set(targets)  # the chunk: the rows past S
        assert both and all(torch.equal(rows[t], alone[t]) for t in both), i


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_deterministic_split_is_fixed():
    """Deterministic mode's split size and tile are one on every device; a launch spreads
    splits over programs from the block table's width alone (static for a graph bucket)."""
    det = TritonAttention(HEADS, KV_HEADS, HEAD_DIM, BS, deterministic=True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert det.keys_per_split(cpu) == det.keys_per_split(cuda) == DETERMINISTIC_SPLIT_KEYS
    assert DETERMINISTIC_SPLIT_KEYS % DETERMINISTIC_TILE[1] == 0
    assert {det.tile_m(n) for n in (1, 2, 8, 300)} == {16}
    assert det.block_n(cpu) == det.block_n(cuda) == 64 and det.warps(DETERMINISTIC_TILE[0]) == 4
    lone = _meta([(1500, 1)], BS, NUM_BLOCKS, torch.Generator().manual_seed(0))
    splits = det.use_split(lone, cpu)
    assert splits == -(-lone.block_tables.shape[1] * BS // DETERMINISTIC_SPLIT_KEYS)
    lone.max_seq_len = 1025  # as a graph bucket captured for long contexts says
    assert det.use_split(lone, cpu) == splits and det.max_split_seqs(cpu) > 0
    with pytest.raises(ValueError, match="multiple"):
        TritonAttention(HEADS, KV_HEADS, HEAD_DIM, BS, split_keys=96, deterministic=True)
