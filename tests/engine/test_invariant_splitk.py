"""The deterministic projections' opt-in split-K (`invariant.LAYER_SPLITS`, `ops.splitk`): with K
cut into 2 or 4 ranges, a row computed alone equals the row among 64 bit for bit (plain, norm
prologue with and without a residual, gate_up's SiLU-and-mul epilogue), results match torch,
repeated launches and any order of the splits' programs give the same bits, and one split is
the unsplit kernel itself. fp32 and fp16 under Triton's interpreter on the CPU; then greedy
tokens through the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.attention import triton_available
from engine.ops import invariant, splitk

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
PICKS = (0, 37, 63)  # rows compared alone: first row block, a middle one, the last row
# SmolLM2-135M's K (hidden 576: 4.5 tiles of 128, intermediate 1536: 12) in one partly
# masked column tile, and K=96 in 32-column tiles: two column tiles, fewer K tiles than
# splits, K not a multiple of the splits. The interpreter's dot adds each tile's product to
# the sum, so a split changes the bits only where a split after the first holds two tiles or
# more: so do all but K=96's.
SHAPES = [(24, 576, None), (24, 1536, None), (40, 96, (32, 32, 4))]
SHAPE_IDS = ["k576", "k1536", "k96-bk32"]


def _rnd(g, dtype):
    return lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)


def _tol(dtype) -> dict:
    tol = {torch.float32: 1e-4, torch.float16: 2e-2}.get(dtype, 6e-2)
    return dict(atol=tol, rtol=tol)


@pytest.fixture
def splits(monkeypatch):
    """Sets `LAYER_SPLITS` (and `LAYER_TILES`) for one test."""

    def set_(s: int, tiles=None):
        monkeypatch.setattr(invariant, "LAYER_SPLITS", s)
        if tiles is not None:
            monkeypatch.setattr(invariant, "LAYER_TILES", tiles)

    return set_


def _parts(out):
    return out if isinstance(out, tuple) else (out,)


def _alone_equals_among_64(fn, rows, again: bool = False) -> tuple:
    """fn(rows) over 64 rows, each of PICKS equal alone bit for bit, every counter back to 0
    after each launch; again: the same bits from a second launch. Returns fn(rows)."""
    out = fn(rows)
    for i in PICKS:
        for a, b in zip(_parts(out), _parts(fn(rows[i:i + 1]))):
            assert torch.equal(a[i], b[0]), i
    for a, b in zip(_parts(out), _parts(fn(rows) if again else out)):
        assert torch.equal(a, b)
    assert all(not c.any() for c in splitk._COUNTERS.values())
    return _parts(out)


def test_split_plan_comes_from_the_shape(splits):
    """Ranges of whole tiles, none empty; K of one tile is not split; an LM head never is."""
    assert splitk.split_plan(576, 128, 4) == (3, 256)  # 5 tiles: 2 + 2 + 1
    assert splitk.split_plan(1536, 128, 4) == (4, 384)
    assert splitk.split_plan(96, 128, 4) == (1, 128)
    assert splitk.split_plan(96, 32, 4) == (3, 32)
    assert splitk.split_plan(384, 128, 2) == (2, 256)
    assert splitk.split_plan(576, 128, 1) == (1, 640)
    assert invariant.invariant_splits(576, 1536) == invariant.LAYER_SPLITS == 1
    splits(4)
    assert invariant.invariant_splits(576, 1536) == 4
    assert invariant.invariant_splits(49152, 576) == 1


@pytest.mark.parametrize("s", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,tiles", SHAPES, ids=SHAPE_IDS)
def test_split_rows_do_not_depend_on_the_launch(splits, s, dtype, n, k, tiles):
    """Plain with a bias (launched twice: the same bits), norm of x + residual, norm alone:
    alone = among 64, and torch's result to rounding."""
    splits(s, tiles)
    g = torch.Generator().manual_seed(n + k + s)
    rnd = _rnd(g, dtype)
    w, b, nw = rnd(n, k) / 7, rnd(n), rnd(k)
    xr = rnd(64, 2 * k).view(64, 2, k)  # [x | residual] per row
    x = xr[:, 0].float()
    wf, bf, nwf = w.float(), b.float(), nw.float()
    assert splitk.split_plan(k, invariant.invariant_tiles(n, k, 1)[2], s)[0] > 1

    (y,) = _alone_equals_among_64(lambda t: ops.invariant_linear(t[:, 0], w, b), xr, True)
    torch.testing.assert_close(y.float(), F.linear(x, wf, bf), **_tol(dtype))
    y, res = _alone_equals_among_64(lambda t: ops.invariant_linear(
        t[:, 0], w, norm_weight=nw, eps=1e-5, residual=t[:, 1]), xr)
    assert torch.equal(res, (xr[:, 0].float() + xr[:, 1].float()).to(dtype))
    want = F.linear(F.rms_norm(res.float(), (k,), nwf, 1e-5), wf)
    torch.testing.assert_close(y.float(), want, **_tol(dtype))
    (y,) = _alone_equals_among_64(lambda t: ops.invariant_linear(
        t[:, 0], w, norm_weight=nw, eps=1e-5), xr)
    torch.testing.assert_close(y.float(), F.linear(F.rms_norm(x, (k,), nwf, 1e-5), wf),
                               **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [2, 4])
def test_split_gate_up_epilogue(splits, s, dtype):
    """gate_up (K 576) with the norm prologue and SiLU-and-mul epilogue over split partials:
    alone = among 64, repeatable, torch's silu(gate) * up to rounding, x + r exactly."""
    splits(s)
    n, k = 48, 576
    g = torch.Generator().manual_seed(s)
    rnd = _rnd(g, dtype)
    w, nw = rnd(2 * n, k) / 7, rnd(k)
    xr = rnd(64, 2 * k).view(64, 2, k)
    act, res = _alone_equals_among_64(lambda t: ops.invariant_linear(
        t[:, 0], w, norm_weight=nw, eps=1e-5, residual=t[:, 1], glu=True), xr, True)
    assert act.shape == (64, n)
    assert torch.equal(res, (xr[:, 0].float() + xr[:, 1].float()).to(dtype))
    gu = F.linear(F.rms_norm(res.float(), (k,), nw.float(), 1e-5), w.float())
    torch.testing.assert_close(act.float(), F.silu(gu[:, :n]) * gu[:, n:], **_tol(dtype))


def test_one_split_is_the_unsplit_kernel(splits, monkeypatch):
    """LAYER_SPLITS 1 launches no workspace and equals `prologue_linear` without splits; a K
    of one tile asked for 4 splits is not split either, so its bits are the unsplit ones.
    Control: 2 splits of K 512 ((t0 + t1) + (t2 + t3) over its 128-column tiles) sum in
    another fp32 order than one ((t0 + t1) + t2) + t3, so some bits part."""
    g = torch.Generator().manual_seed(3)
    rnd = _rnd(g, torch.float32)
    w, nw, x, r = rnd(36, 512) / 7, rnd(512), rnd(64, 512), rnd(64, 512)
    tiles = invariant.invariant_tiles(36, 512, 1)
    kw = dict(norm_weight=nw, eps=1e-5, residual=r)
    with monkeypatch.context() as m:
        m.setattr(splitk, "workspace", lambda *a: pytest.fail("split at LAYER_SPLITS 1"))
        one = ops.invariant_linear(x, w, **kw)
        for a, b in zip(one, ops.prologue_linear(x, w, tiles=tiles, **kw)):
            assert torch.equal(a, b)
    splits(2)
    two = ops.invariant_linear(x, w, **kw)
    assert torch.equal(one[1], two[1]) and not torch.equal(one[0], two[0])
    torch.testing.assert_close(one[0], two[0], atol=1e-5, rtol=1e-5)
    splits(4)
    w96, x96, tiles96 = rnd(40, 96), x[:, :96], invariant.invariant_tiles(40, 96, 1)
    assert splitk.split_plan(96, tiles96[2], 4)[0] == 1
    assert torch.equal(ops.invariant_linear(x96, w96), ops.prologue_linear(x96, w96, tiles=tiles96))


@pytest.mark.skipif(DEV == "cuda", reason="the interpreter's program order")
def test_any_program_may_fold(splits, monkeypatch):
    """The interpreter runs a tile's splits in index order, so the last split folds; with the
    splits run in reverse (the first split folds) the bits are the same: the partials are
    summed in split order, not in the order they arrive."""
    from triton.runtime import interpreter

    splits(4)
    g = torch.Generator().manual_seed(4)
    rnd = _rnd(g, torch.float32)
    w, nw, x = rnd(2 * 36, 576) / 7, rnd(576), rnd(20, 576)

    def glu():
        return ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, glu=True)

    forward = glu()
    builder = interpreter.interpreter_builder
    real = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx",
                        lambda i, j, s: real(i, j, builder.grid_dim[2] - 1 - s))
    assert torch.equal(glu(), forward)
    assert all(not c.any() for c in splitk._COUNTERS.values())


@pytest.mark.skipif(DEV == "cuda", reason="the CPU engine; GPU runs take the GPU tests")
def test_engine_greedy_alone_equals_batched(monkeypatch):
    """Through the engine (fp32, the fused deterministic forward under the interpreter), with
    4 splits of 16-column K tiles: down_proj (K 128) in ranges of 2 tiles, the other
    projections (K 64) of one tile each. Each prompt's greedy tokens and cached KV bits alone
    equal those it gets in a batch of three (the second layer's KV depends on the first's
    down_proj, so a row-count-dependent split fails this)."""
    from engine import Engine, SamplingParams
    from engine.testing import tiny_engine
    from tests.engine.test_deterministic_engine import assert_same, kv_of

    monkeypatch.setattr(invariant, "LAYER_SPLITS", 4)
    monkeypatch.setattr(invariant, "LAYER_TILES", (64, 16, 4))
    splits_run = set()
    real = splitk.workspace
    monkeypatch.setattr(splitk, "workspace", lambda *a: splits_run.add(a[2]) or real(*a))
    # A vocabulary of 128 and an MLP of 128: gate_up and the LM head two column tiles each
    # (every program is 16 interpreted rows per K tile).
    base = tiny_engine(0, deterministic=True, attention_backend="triton", num_layers=2,
                       max_num_batched_tokens=64, intermediate_size=128, vocab_size=128)
    assert base.model.fused and base.model.deterministic
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(ps):  # a fresh engine on base's weights: no prefix-cache hit from another run
        eng = Engine(base.config, weights_of=base)
        toks = [c.token_ids for c in eng.generate(ps, greedy)]
        return toks, [kv_of(eng, p + t) for p, t in zip(ps, toks)]

    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], [43, 38, 32]]
    lone = [run([p]) for p in prompts]
    assert_same(run(prompts), ([t for (t,), _ in lone], [kv for _, (kv,) in lone]))
    assert splits_run == {4}


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs")
def test_split_under_cuda_graph_replay(splits):
    """gate_up of SmolLM2's shape at 4 splits, captured after a warm-up and replayed on new
    inputs: each replay equals an eager launch bit for bit, and every counter is 0 after
    (the fold resets it inside the graph)."""
    splits(4)
    g = torch.Generator().manual_seed(6)
    rnd = _rnd(g, torch.bfloat16)
    w, nw, x, r = rnd(2 * 1536, 576) / 7, rnd(576), rnd(64, 576), rnd(64, 576)

    def gate_up():
        return ops.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, glu=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gate_up()  # compiles the kernel and makes the counters outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gate_up()
    for _ in range(50):
        x.copy_(rnd(64, 576))
        r.copy_(rnd(64, 576))
        graph.replay()
        want = gate_up()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    torch.cuda.synchronize()
    assert all(not c.any() for c in splitk._COUNTERS.values())
