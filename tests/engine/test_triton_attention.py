"""The Triton backend against the torch reference: prefill, prefix-cached chunks, decode and
verify in one mixed batch, GQA groups, fp32/fp16 under TRITON_INTERPRET on the CPU (bf16 and
real shapes on the GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttention, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _meta(cases, block_size, num_blocks, gen):
    """cases: (context_len, query_len) per sequence; blocks handed out in a random order."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts, lens = [], [], [0], []
    for ctx, qlen in cases:
        n = -(-ctx // block_size)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - qlen, ctx)]
        starts.append(starts[-1] + qlen)
        lens.append(ctx)
    width = max(map(len, tables))
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=DEV)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=t(slots, torch.int64), query_start=t(starts, torch.int32),
        seq_lens=t(lens, torch.int32),
        block_tables=t([tb + [0] * (width - len(tb)) for tb in tables], torch.int32),
        max_query_len=max(q for _, q in cases), max_seq_len=max(lens),
        query_start_cpu=starts, seq_lens_cpu=lens)


CASES = [(20, 20), (37, 7), (45, 1), (50, 6), (3, 3), (16, 1)]
# A tiny engine's model whose one-row projections are each at most 1.5 times as wide as long:
# they take 16-column GEMV programs (4 to 6 each, not up to 32), three query heads share one
# KV head (SmolLM2's group). Under the interpreter a launch costs per program.
NARROW = dict(num_heads=3, num_kv_heads=1, intermediate_size=44)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] +
                         ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(4, 2, 16, 4), (6, 2, 32, 8), (4, 4, 16, 16), (8, 1, 24, 4)])
def test_matches_torch_reference(dtype, heads, kv_heads, head_dim, block_size):
    from engine.attention import TritonAttention

    gen = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    num_blocks = 64
    meta = _meta(CASES, block_size, num_blocks, gen)
    total = int(meta.query_start_cpu[-1])
    # A filled cache (earlier context) plus this forward's new K/V.
    cache0 = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    cache0 = cache0.to(dtype).to(DEV)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype).to(DEV)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    ref_b = TorchAttention(heads, kv_heads, head_dim, block_size)
    tri_b = TritonAttention(heads, kv_heads, head_dim, block_size)
    c_ref, c_tri = cache0.clone(), cache0.clone()
    ref = ref_b.forward(q, k, v, c_ref, meta)
    out = tri_b.forward(q, k, v, c_tri, meta)
    assert torch.equal(c_ref, c_tri), "store_kv wrote different slots or values"
    assert out.isfinite().all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else []))
# SmolLM2's and Llama-8B's GQA groups (3 and 4); the latter at a quarter of its heads in the
# interpreter, where every (KV head, sequence) is a program.
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8) if DEV == "cuda" else (8, 2)])
def test_verify_rows_equal_decode_rows(dtype, heads, kv_heads):
    """A verify step's row for position p attends exactly as a one-token decode step at p
    does, bit for bit (one tile shape for both): what keeps greedy speculation identical to
    no speculation. Also beside another sequence in the batch. The rows straddle
    `long_context`: the first decode alone in the one pass, the verify split (past one
    split the two would reduce in different orders)."""
    from engine.attention import TritonAttention
    from engine.attention.triton_backend import long_context

    head_dim, bs, k1 = 64, 16, 6
    ctx = long_context(torch.device(DEV)) + 3
    nb = -(-ctx // bs) + 4
    gen = torch.Generator().manual_seed(heads)
    cache = torch.randn(2, nb, bs, kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    q = torch.randn(k1, heads, head_dim, generator=gen).to(dtype).to(DEV)
    other = torch.randn(1, heads, head_dim, generator=gen).to(dtype).to(DEV)
    table = torch.randperm(nb, generator=gen)[: -(-ctx // bs)].tolist()
    be = TritonAttention(heads, kv_heads, head_dim, bs)
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=DEV)  # noqa: E731

    def meta(lens, qlens):
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=t([-1] * starts[-1], torch.int64), query_start=t(starts),
            seq_lens=t(lens), block_tables=t([table] * len(lens)), max_query_len=max(qlens),
            max_seq_len=max(lens), query_start_cpu=starts, seq_lens_cpu=lens)

    verify = be.attend(q, cache, meta([ctx], [k1]))
    both = be.attend(torch.cat([other, q]), cache, meta([200, ctx], [1, k1]))[1:]
    for i in range(k1):
        one = be.attend(q[i:i + 1], cache, meta([ctx - k1 + i + 1], [1]))
        assert torch.equal(verify[i], one[0]), i
        assert torch.equal(both[i], one[0]), i


def test_negative_slot_skips_store():
    from engine.attention import TritonAttention

    b = TritonAttention(4, 2, 16, 4)
    cache = torch.zeros(2, 4, 4, 2, 16, device=DEV)
    k = torch.randn(3, 2, 16, device=DEV)
    meta = AttentionMetadata(slot_mapping=torch.tensor([5, -1, 2], device=DEV),
                             query_start=None, seq_lens=torch.zeros(1), block_tables=None,
                             max_query_len=3, max_seq_len=3)
    b.store_kv(k, -k, cache, meta)
    flat = cache.view(2, -1, 2, 16)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 2], -k[2])
    written = (flat[0].abs().sum((1, 2)) != 0).nonzero().flatten().tolist()
    assert written == [2, 5]


def test_engine_greedy_matches_torch_backend():
    """A tiny random Llama, fp32: the whole engine on the Triton backend emits exactly the
    torch backend's greedy tokens (chunked prefill, prefix hits, batched decode)."""
    from engine.sequence import SamplingParams
    from tests.helpers import tiny_engine

    ref = tiny_engine(num_blocks=64, max_num_batched_tokens=24, device=DEV,
                      attention_backend="torch", **NARROW)
    tri = ref.with_config(attention_backend="triton")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 40],
               [200, 3, 5], list(range(30, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = [c.token_ids for c in ref.generate(prompts, params)]
    b = [c.token_ids for c in tri.generate(prompts, params)]
    assert a == b


def test_static_bucket_path_matches_torch_backend():
    """The graph path's static buffers, padding to batch buckets (slot -1 rows), run eagerly on
    the CPU: same greedy tokens as the torch backend, with and without EAGLE-3-style drafting."""
    from engine.sequence import SamplingParams
    from tests.helpers import tiny_engine

    ref = tiny_engine(num_blocks=64, max_num_batched_tokens=24, device=DEV,
                      attention_backend="torch", **NARROW)
    tri = ref.with_config(attention_backend="triton")
    graphs = tri.runner.enable_graphs(8, (1,), ())
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200, 3, 5], list(range(30, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a = [c.token_ids for c in ref.generate(prompts, params)]
    b = [c.token_ids for c in tri.generate(prompts, params)]
    assert a == b
    assert (4, 1, False) in graphs.graphs  # three running sequences padded to the bucket of 4
    # The prompts' prefill chunks (11 + 3 tokens, then 15) replayed a padded prefill graph.
    assert any(q == 32 for _, q, _ in tri.runner.prefill_graphs.graphs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_round_like_the_reference(dtype):
    """add+RMSNorm, rotary and SiLU-and-mul kernels against the torch modules they replace:
    equal to fp32 rounding (the norm's sum runs in another order), and in fp16 up to one
    rounding step."""
    import torch.nn.functional as F

    from engine import ops
    from engine.config import RopeConfig
    from engine.layers import RMSNorm, Rotary

    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    x, r = rnd(7, 48), rnd(7, 48)
    norm = RMSNorm(48, 1e-5).to(dtype).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(rnd(48))
        y, s = ops.add_rmsnorm(x, norm.weight, 1e-5, r)
        torch.testing.assert_close(s, x + r, **tol)
        torch.testing.assert_close(y, norm(x + r), **tol)
        torch.testing.assert_close(ops.add_rmsnorm(x, norm.weight, 1e-5), norm(x), **tol)
    rot = Rotary(RopeConfig(theta=10000.0), 32, 64).to(DEV)
    q, pos = rnd(5, 3, 32), torch.tensor([0, 9, 3, 63, 17], device=DEV)
    (ref,) = rot(pos, q)
    torch.testing.assert_close(ops.rope_(q.clone(), pos, rot.cos, rot.sin), ref, **tol)
    gu = rnd(4, 2 * 40)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,k", [(1, 48), (3, 48), (8, 48), (17, 48), (5, 1100)])
def test_prologue_linear_equals_its_two_kernels(dtype, rows, k):
    """norm + projection, SiLU-and-mul + projection and a plain projection in one launch, each
    against the separate kernel followed by the GEMM: the residual sum exactly, the outputs to
    fp32 rounding (the GEMM's summation order), in fp16 up to one rounding step. K = 48 fits
    one weight tile (x + r read once); K = 1100 takes two, the second partly masked."""
    import torch.nn.functional as F

    from engine import ops

    g = torch.Generator().manual_seed(rows)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    n = 40
    x, r, w, b, nw = rnd(rows, k), rnd(rows, k), rnd(n, k) / 7, rnd(n), rnd(k)
    fp32 = 2e-6 * max(1, k // 48)  # a longer sum, more room for another summation order
    tol = dict(atol=fp32, rtol=fp32) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    gemm = lambda a, bias=None: F.linear(  # noqa: E731
        a.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    y, s = ops.prologue_linear(x, w, b, norm_weight=nw, eps=1e-5, residual=r)
    normed, summed = ops.add_rmsnorm(x, nw, 1e-5, r)
    assert torch.equal(s, summed)
    torch.testing.assert_close(y, gemm(normed, b), **tol)
    y = ops.prologue_linear(x, w, norm_weight=nw, eps=1e-5)
    torch.testing.assert_close(y, gemm(ops.add_rmsnorm(x, nw, 1e-5)), **tol)
    gu = rnd(rows, 2 * k)
    torch.testing.assert_close(ops.prologue_linear(gu, w, silu=True), gemm(ops.silu_mul(gu)),
                               **tol)
    torch.testing.assert_close(ops.prologue_linear(x, w, b), gemm(x, b), **tol)
    with pytest.raises(AssertionError):  # silu reads [gate | up]: twice the weight's K
        ops.prologue_linear(x, w, silu=True)


def test_gemv_tiles_do_not_depend_on_the_row_count():
    """A projection at least four times as wide as long takes 8-column, 1-warp GEMV programs,
    one 1.5-4 times as wide 4-column ones, one twice as long as wide 8-column ones, the rest
    16 columns, at every row count up to 8 (a verify row still rounds as the one-row step
    does)."""
    from engine import ops
    from engine.ops.prologue import GEMV_WARPS

    tiles = {shape: {ops.linear_tiles(m, *shape) for m in range(1, 9)}
             for shape in [(3072, 576), (7168, 576), (960, 576), (864, 576), (576, 576),
                           (576, 1536), (960, 1152)]}
    assert tiles[(3072, 576)] == tiles[(7168, 576)] == {(1, 8, 1024, 1)}
    assert tiles[(960, 576)] == tiles[(864, 576)] == {(1, 4, 1024, 1)}
    assert tiles[(576, 576)] == tiles[(960, 1152)] == {(1, 16, 1024, GEMV_WARPS)}
    assert tiles[(576, 1536)] == {(1, 8, 1024, GEMV_WARPS)}


@pytest.mark.parametrize("n,bn", [(128, 8), (48, 4)], ids=["8col", "4col"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_one_warp_gemv_tiles_match_the_reference(m, n, bn):
    """The one-warp GEMV tiles of projections wider than long, with the norm prologue,
    against torch at 1..8 rows."""
    from engine import ops

    k = 32
    assert ops.linear_tiles(m, n, k) == (1, bn, 32, 1)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    ln = torch.rand(k, generator=g) + 0.5
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * ln) @ w.t()
    torch.testing.assert_close(ops.prologue_linear(x, w, norm_weight=ln, eps=1e-5), ref,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dot", [None, (32, 256, 4)], ids=["gemv", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prologue_linear_rows_are_batch_invariant(dtype, dot):
    """Up to 8 rows, a row's output must not depend on how many rows share the launch: bit
    for bit, alone or in a batch of 2-8 (what keeps a verify step's logits equal to the
    one-row decode step's, and greedy speculation token-identical in bf16); with one GEMV
    program per row or with the 16-row tensor-core blocks (`dot`)."""
    from engine import ops

    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    # The interpreter (CI) computes every row alike by construction: one small case there.
    n, k, ms = (96, 1100, range(2, 9)) if DEV == "cuda" else (16, 48, (3,))
    x, r, w, nw, gu = rnd(8, k), rnd(8, k), rnd(n, k) / 7, rnd(k), rnd(8, 2 * k)
    for m in ms:
        y, s = ops.prologue_linear(x[:m], w, norm_weight=nw, eps=1e-5, residual=r[:m], dot=dot)
        z = ops.prologue_linear(gu[:m], w, silu=True, dot=dot)
        p = ops.prologue_linear(x[:m], w, dot=dot)
        for i in range(m):
            y1, s1 = ops.prologue_linear(x[i:i + 1], w, norm_weight=nw, eps=1e-5,
                                         residual=r[i:i + 1], dot=dot)
            assert torch.equal(y[i], y1[0]) and torch.equal(s[i], s1[0]), (m, i)
            assert torch.equal(z[i], ops.prologue_linear(gu[i:i + 1], w, silu=True, dot=dot)[0])
            assert torch.equal(p[i], ops.prologue_linear(x[i:i + 1], w, dot=dot)[0])
    assert len({ops.linear_tiles(m, n, k, dot) for m in range(1, 9)}) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_equals_the_gemm_and_rows_are_batch_invariant(dtype):
    """`ops.gemv_rows` (large projections at up to 8 rows): the GEMM's result to rounding,
    the bias included, K past one tile and partly masked; and each row bit for bit the same
    alone or beside 1-7 others, as a verify step's rows must be to equal the decode step's.
    On the GPU at one of Llama-8B's shapes with the engine's tiles."""
    import torch.nn.functional as F

    from engine import ops

    g = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    cuda = DEV == "cuda"
    n, k, tiles = (4096, 4096, None) if cuda else (37, 300, (4, 128, 4))
    w, b, x = rnd(n, k) / 30, rnd(n), rnd(8, k)
    ref = F.linear(x.float(), w.float(), b.float())
    y = ops.gemv_rows(x, w, b, tiles=tiles)
    tol = 2e-5 if dtype == torch.float32 and not cuda else 2e-2
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)
    for m in range(1, 8) if cuda else (1, 3):
        ym = ops.gemv_rows(x[:m], w, b, tiles=tiles)
        assert torch.equal(ym, y[:m]), m
    with pytest.raises(AssertionError):
        ops.gemv_rows(rnd(9, k), w, tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_silu_equals_the_gemv_then_silu_mul(dtype):
    """`ops.gemv_silu` (one row of a large model's gate_up with SiLU-and-mul in the epilogue)
    gives exactly what the GEMV followed by `silu_mul` gives."""
    from engine import ops

    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    n, k, tiles = (2 * 14336, 4096, None) if DEV == "cuda" else (2 * 37, 300, (4, 128, 4))
    w, x = rnd(n, k) / 30, rnd(1, k)
    assert torch.equal(ops.gemv_silu(x, w, tiles), ops.silu_mul(ops.gemv_rows(x, w, tiles=tiles)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16 if DEV == "cpu" else
                                   torch.bfloat16])
def test_dot_rows_equals_the_gemm_and_rows_are_batch_invariant(dtype):
    """`ops.dot_rows` (large projections at 2-16 rows): one 16-row tensor-core block per
    program; the GEMM's result to rounding (bias included, K divisible by the tile or not),
    each row bit for bit the same alone or beside others. (The interpreter's bf16 tl.dot
    returns garbage on the CPU: fp16 there, bf16 on the GPU.)"""
    import torch.nn.functional as F

    from engine import ops

    g = torch.Generator().manual_seed(6)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    cuda = DEV == "cuda"
    shapes = [(4096, 4096, None), (1000, 1100, None)] if cuda else [(40, 256, (16, 128, 3, 4)),
                                                                    (37, 300, (16, 128, 3, 4))]
    for n, k, tiles in shapes:
        w, b, x = rnd(n, k) / 30, rnd(n), rnd(16, k)
        ref = F.linear(x.float(), w.float(), b.float())
        y = ops.dot_rows(x, w, b, tiles=tiles)
        tol = 2e-5 if dtype == torch.float32 and not cuda else 3e-2
        torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)
        for m in (1, 2, 6, 9) if cuda else (1, 6):
            assert torch.equal(ops.dot_rows(x[:m], w, b, tiles=tiles), y[:m]), (n, m)


def test_large_projections_take_our_kernels_on_a_gpu_only(monkeypatch):
    """`ops.linear` sends projections of more than LINEAR_MAX_WEIGHT elements in half
    precision on a GPU to `gemv_rows` at one row and to `dot_rows` at up to DOT_ROWS_MAX rows
    as `LARGE_LINEAR` chose for the shape (None: cuBLAS); the rest to F.linear."""
    from engine import ops
    from engine.ops import gemv

    big = torch.empty(ops.LINEAR_MAX_WEIGHT // 512 + 1, 512, dtype=torch.bfloat16)
    small = torch.empty(64, 512, dtype=torch.bfloat16)
    assert not ops.large_suits(big) and not ops.gemv_suits(1, big)  # on the CPU
    if not torch.cuda.is_available():
        return
    big, small = big.cuda().normal_(), small.cuda()
    assert ops.gemv_suits(1, big) and not ops.gemv_suits(2, big)
    assert not ops.gemv_suits(1, small) and not ops.large_suits(big.float())
    calls = []
    monkeypatch.setattr(gemv, "gemv_rows", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(gemv, "dot_rows", lambda *a, **k: calls.append("dot"))
    monkeypatch.setattr(gemv, "LARGE_LINEAR", {})
    x = torch.ones(17, 512, dtype=torch.bfloat16, device="cuda")
    ops.linear(x[:1], big), ops.linear(x[:4], big), ops.linear(x, big)
    assert calls == ["gemv"]  # defaults: the GEMV at one row, cuBLAS above
    gemv.LARGE_LINEAR[ops.large_key(big)] = {"one": None, "rows": (32, 256, 5, 4)}
    ops.linear(x[:1], big), ops.linear(x[:4], big), ops.linear(x[:16], big), ops.linear(x, big)
    assert calls == ["gemv", "dot", "dot"]


@pytest.mark.parametrize("rows", [1, 6, 12])
def test_prologue_forward_equals_the_fused_forward(rows):
    """The forward with norms folded into the projections (every row count up to 8 allowed
    here) against the fused forward without them, aux taps included; above that both take
    the separate kernels."""
    from engine import ops
    from engine.graphs import pack
    from tests.helpers import tiny_engine

    eng = tiny_engine(num_blocks=64, device=DEV, attention_backend="triton", **NARROW)
    assert eng.model.prologue_linears
    if DEV == "cpu":  # a GPU calibrates its own set when the engine captures its graphs
        assert eng.model.prologue_rows == frozenset(range(1, ops.LINEAR_MAX_ROWS + 1))
    eng.model.prologue_rows = frozenset(range(1, 9))
    ids = [(7 * i + 3) % 100 for i in range(rows)]
    inp = pack(ids, list(range(rows)), [list(range(30))], [rows], 4)
    calls = []
    real = ops.prologue_linear
    ops.prologue_linear = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        a = eng.runner.forward_packed(inp, [rows - 1], aux_layers=(0, 1))
        n_forward = len(calls)
        logits = a.logits  # one picked row: on a GPU the LM head takes the GEMV too
    finally:
        ops.prologue_linear = real
    assert n_forward == (4 * eng.config.model.num_layers if rows <= 8 else 0)
    assert len(calls) == n_forward + (DEV == "cuda")
    eng.model.prologue_linears = False
    b = eng.runner.forward_packed(inp, [rows - 1], aux_layers=(0, 1))
    torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, b.logits, atol=1e-4, rtol=1e-4)
    for x, y in zip(a.aux, b.aux):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_logits_of_a_batch_of_sequences_are_its_rows_logits():
    """A trainer's [batch, length, hidden] takes the LM head row by row: a leading dimension
    whose size is a prologue row count is not read as rows (on a GPU that tripped the
    prologue GEMV's shape check)."""
    from tests.helpers import tiny_engine

    eng = tiny_engine(num_blocks=64, device=DEV, attention_backend="triton")
    eng.model.prologue_rows = frozenset(range(1, 65))
    h = torch.randn(4, 9, eng.config.model.hidden_size, device=DEV)
    got = eng.model.logits(h)
    assert got.shape == (4, 9, eng.config.model.vocab_size)
    torch.testing.assert_close(got[2], eng.model.logits(h[2]), atol=1e-5, rtol=1e-5)


def test_fused_model_matches_reference_logits():
    """The whole fused forward (triton backend) against the reference model, fp32: the aux
    taps too, which the EAGLE-3 head reads."""
    from tests.helpers import tiny_engine

    ref = tiny_engine(num_blocks=64, device=DEV, attention_backend="torch")
    tri = ref.with_config(attention_backend="triton")
    assert tri.model.fused and not ref.model.fused
    ids = list(range(3, 40))
    from engine.graphs import pack

    inp = pack(ids, list(range(len(ids))), [list(range(10))], [len(ids)], 4)
    a = ref.runner.forward_packed(inp, [len(ids) - 1], aux_layers=(0, 1))
    b = tri.runner.forward_packed(inp, [len(ids) - 1], aux_layers=(0, 1))
    torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    for x, y in zip(b.aux, a.aux):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_split_path_rounds_as_the_one_pass_path(dtype):
    """Across the split threshold: a verify step past `split_keys` (split-KV) gives the rows
    whose own context is within one split exactly what one-token decodes (one pass) give, and
    a split launch's result does not depend on how many programs share the splits."""
    from engine.attention import TritonAttention
    from engine.attention.triton_backend import SPLIT_KEYS

    heads, kv_heads = (9, 3) if DEV == "cuda" else (3, 1)  # SmolLM2's group of 3
    head_dim, bs, nb, k1 = 64, 16, 40, 6
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, nb, bs, kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    q = torch.randn(k1, heads, head_dim, generator=gen).to(dtype).to(DEV)
    be = TritonAttention(heads, kv_heads, head_dim, bs, split_keys=SPLIT_KEYS)  # CUDA's
    ctx = SPLIT_KEYS + 2  # the last two rows see past one split, the first four do not
    table = torch.randperm(nb, generator=gen)[: -(-ctx // bs)].tolist()
    dev = torch.device(DEV)

    def meta(lens, qlens, width=None):
        width = width or len(table)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=DEV)  # noqa: E731
        tab = (table + [0] * width)[:width]
        return AttentionMetadata(
            slot_mapping=t([-1] * starts[-1], torch.int64), query_start=t(starts),
            seq_lens=t(lens), block_tables=t([tab] * len(lens)), max_query_len=max(qlens),
            max_seq_len=max(lens), query_start_cpu=starts, seq_lens_cpu=lens)

    assert be.use_split(meta([ctx], [k1]), dev) > 1
    verify = be.attend(q, cache, meta([ctx], [k1]))
    for i in range(k1):
        m = meta([ctx - k1 + i + 1], [1])
        assert (be.use_split(m, dev) > 0) == (i >= k1 - 2)
        assert torch.equal(verify[i], be.attend(q[i:i + 1], cache, m)[0]), i
    wide = meta([ctx], [k1], width=4 * len(table))  # 8+ splits of capacity
    outs = []
    for programs in (1, 3, 8):
        be.split_programs = lambda splits, n, device, p=programs: p
        outs.append(be.attend(q, cache, wide))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], verify)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_keys, cases", [
    (16, [(45, 1)]), (16, [(50, 6), (7, 1)]), (16, [(130, 3)]),
    (48, [(50, 6), (7, 1)]), (48, [(130, 3)])])
def test_split_kv_matches_torch_reference(dtype, split_keys, cases):
    """The split-KV (flash-decoding) path for few sequences: partials per split (16 keys, or
    48: three 16-key steps, a split size no power of two), combined in split order; decode and
    verify rows alike."""
    from engine.attention import TritonAttention

    heads, kv_heads, head_dim, block_size = 6, 2, 32, 4
    gen = torch.Generator().manual_seed(len(cases) + cases[0][0])
    meta = _meta(cases, block_size, 64, gen)
    tri_b = TritonAttention(heads, kv_heads, head_dim, block_size, split_keys=split_keys)
    meta.max_seq_len = 4096  # as a graph bucket captured for long contexts says
    assert tri_b.use_split(meta, torch.device(DEV)) > 1
    total = int(meta.query_start_cpu[-1])
    cache = torch.randn(2, 64, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype).to(DEV)
    ref = TorchAttention(heads, kv_heads, head_dim, block_size).attend(q, cache, meta)
    out = tri_b.attend(q, cache, meta)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-3), f"relative error {err:.2e}"


@pytest.mark.parametrize("heads_per_program", [None, 1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_equals_rope_then_store(dtype, heads_per_program, monkeypatch):
    """The fused rotary + KV store launch: q and k rotated in place exactly as `rope_`, k and
    v in the cache exactly as the backend's `store_kv` puts them, slot -1 rows skipped; the
    same bits whatever number of heads one program takes (8 leaves the last program with
    4 of the 12 heads)."""
    from engine import ops
    from engine.attention import TritonAttention
    from engine.config import RopeConfig
    from engine.layers import Rotary
    from engine.ops import elementwise

    g = torch.Generator().manual_seed(5)
    nq, nkv, d, t = 6, 3, 16, 6
    qkv = torch.randn(t, nq + 2 * nkv, d, generator=g).to(dtype).to(DEV)
    pos = torch.tensor([0, 5, 9, 2, 31, 7], device=DEV)
    slots = torch.tensor([3, 12, -1, 0, 9, -1], device=DEV)
    rot = Rotary(RopeConfig(theta=10000.0), d, 64).to(DEV)
    ref_heads = qkv.clone()
    ops.rope_(ref_heads[:, : nq + nkv], pos, rot.cos, rot.sin)
    ref_cache = torch.zeros(2, 4, 4, nkv, d, dtype=dtype, device=DEV)
    meta = AttentionMetadata(slot_mapping=slots, query_start=None, seq_lens=None,
                             block_tables=None, max_query_len=1, max_seq_len=1)
    TritonAttention(nq, nkv, d, 4).store_kv(ref_heads[:, nq : nq + nkv],
                                           ref_heads[:, nq + nkv :], ref_cache, meta)
    if heads_per_program is not None:
        monkeypatch.setattr(elementwise, "_rope_heads", lambda *_: heads_per_program)
    rotated = ops.rope_(qkv.clone()[:, : nq + nkv], pos, rot.cos, rot.sin)
    assert torch.equal(rotated, ref_heads[:, : nq + nkv])
    heads, cache = qkv.clone(), torch.zeros_like(ref_cache)
    ops.rope_store_(heads, nq, nkv, pos, rot.cos, rot.sin, cache, slots)
    assert torch.equal(heads, ref_heads) and not torch.equal(heads, qkv)
    assert torch.equal(cache, ref_cache) and cache.abs().sum() > 0
    assert cache.view(2, 16, nkv, d)[:, [1, 2]].abs().sum() == 0  # slots no row names


def test_engines_sharing_weights_share_the_prologue_calibration():
    """Calibration runs once per set of weights on a GPU (none on the CPU); an engine built
    on another's weights decodes with the same row counts through the prologue linears."""
    from tests.helpers import tiny_engine

    eng = tiny_engine(num_blocks=64, device=DEV, attention_backend="triton")
    if DEV == "cpu":
        assert eng.model.calibrate_prologue_rows() is None
    eng.model.prologue_calibration = {1: (2.0, 4.0), 2: (5.0, 4.0), 3: (3.0, 4.0)}
    eng.model.prologue_rows = frozenset({1, 3})
    other = eng.with_config(num_blocks=32)
    assert other.model is not eng.model
    assert other.model.prologue_rows == {1, 3}
    assert other.model.prologue_calibration == eng.model.prologue_calibration
    torch_ref = eng.with_config(attention_backend="torch")  # no prologue linears there
    assert not torch_ref.model.prologue_linears and torch_ref.model.prologue_calibration is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dual_rmsnorm_is_two_norms_side_by_side(dtype):
    """The EAGLE-3 layer's input: [norm(a) | norm(b)] in one launch, each half bit-equal to
    `add_rmsnorm` of its input, from strided inputs too."""
    from engine import ops

    g = torch.Generator().manual_seed(3)
    t, n = 5, 48
    a = torch.randn(t, n, generator=g).to(dtype).to(DEV)
    b = torch.randn(t, 2 * n, generator=g).to(dtype).to(DEV)[:, :n]  # row stride 2n
    wa, wb = (torch.randn(n, generator=g).to(dtype).to(DEV) for _ in range(2))
    y = ops.dual_rmsnorm(a, wa, b, wb, 1e-5)
    ref = torch.cat([ops.add_rmsnorm(a, wa, 1e-5), ops.add_rmsnorm(b.contiguous(), wb, 1e-5)],
                    dim=-1)
    assert y.shape == (t, 2 * n) and torch.equal(y, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dual_rmsnorm_looks_up_embedding_rows(dtype):
    """With token ids the first half reads the embedding table's rows inside the launch:
    bit-equal to the norms of `table[ids]` (repeated ids too); an id outside the table is
    clamped into it rather than read past its end."""
    from engine import ops

    g = torch.Generator().manual_seed(4)
    vocab, t, n = 50, 6, 48
    table = torch.randn(vocab, n, generator=g).to(dtype).to(DEV)
    b = torch.randn(t, n, generator=g).to(dtype).to(DEV)
    wa, wb = (torch.randn(n, generator=g).to(dtype).to(DEV) for _ in range(2))
    ids = torch.tensor([3, 49, 0, 3, 17, 8], device=DEV)
    y = ops.dual_rmsnorm(table, wa, b, wb, 1e-5, ids=ids)
    assert torch.equal(y, ops.dual_rmsnorm(table[ids], wa, b, wb, 1e-5))
    assert not torch.equal(y, ops.dual_rmsnorm(table[(ids + 1) % vocab], wa, b, wb, 1e-5))
    wild = ops.dual_rmsnorm(table, wa, b, wb, 1e-5, ids=torch.tensor([-4, 50, 1, 2, 3, 99],
                                                                      device=DEV))
    assert torch.equal(wild, ops.dual_rmsnorm(table[torch.tensor([0, 49, 1, 2, 3, 49],
                                                                 device=DEV)], wa, b, wb, 1e-5))


@pytest.mark.parametrize("vocab", [37, 4096, 5000, 9000])
def test_argmax_rows_takes_the_first_maximum_and_maps_ids(vocab, monkeypatch):
    """Row argmax: torch.argmax's index (the first of tied maxima, also when the tie spans
    two blocks or two chunks of the row), plus the id map's offset when given. 9000 values
    take the two-launch split (chunks, then the first chunk holding the maximum)."""
    from engine import ops
    from engine.ops import argmax

    split = []
    real = argmax._argmax_split
    monkeypatch.setattr(argmax, "_argmax_split", lambda *a: split.append(1) or real(*a))

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).to(torch.bfloat16)
    x[1, 3] = x[1, vocab - 1] = 9.0  # a tie: the first wins
    x[2, vocab // 2] = x[2, vocab // 3] = 9.0
    x[3] = -2.0  # every value equal
    x[4, vocab // 2:] = float("nan")  # NaN wins (a padding row of garbage stays in range)
    x[5] = float("nan")
    x = x.to(DEV)
    off = torch.randint(0, 1000, (vocab,), generator=g).to(DEV)
    want = x.float().argmax(dim=-1)
    assert want[1] == 3 and want[2] == vocab // 3 and want[3] == 0
    assert want[4] == vocab // 2 and want[5] == 0
    assert torch.equal(ops.argmax_rows(x), want)
    assert len(split) == (vocab > ops.ARGMAX_SPLIT)
    assert torch.equal(ops.argmax_rows(x, off), want + off[want])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 3 programs, the last partly masked; and the draft head's vocabulary on the GPU
@pytest.mark.parametrize("vocab", [37] + ([7168] if DEV == "cuda" else []))
def test_prologue_linear_keys_hold_each_rows_first_maximum(vocab, dtype):
    """`prologue_linear(keys=)` (the argmax folded into a GEMV, programs of 16 columns
    meeting in an atomic max): `decode_keys` gives what `argmax_rows` finds in the logits
    the same launch would write, ties (inside one program and across two) going to the
    first column and NaN counting as largest; with the id map's offsets too, and with the
    norm and residual prologue of a draft head's LM head (its sum still written)."""
    from engine import ops

    g = torch.Generator().manual_seed(vocab)
    want = torch.randn(6, vocab, generator=g)
    want[1, 3] = want[1, vocab - 1] = 9.0  # a tie across programs
    want[2, vocab // 2] = want[2, vocab // 2 + 1] = 9.0  # inside one program
    want[3] = -2.0  # every value equal
    want[4] = 0.0
    want[4, vocab - 2] = -0.0  # equal zeros: the first
    # row i of x picks column i of w: the logits of row i are exactly want[i]
    x = torch.eye(6, 8).to(dtype).to(DEV)
    w = torch.zeros(vocab, 8)
    w[:, :6] = want.T
    w = w.to(dtype).to(DEV)
    off = torch.randint(0, 1000, (vocab,), generator=g).to(DEV)

    def keyed(*a, **kw):
        keys = torch.full((a[0].shape[0],), ops.KEY_EMPTY, dtype=torch.int64, device=DEV)
        out = ops.prologue_linear(*a, keys=keys, **kw)
        return out if isinstance(out, tuple) else (out,)

    (keys,) = keyed(x, w)
    ref = ops.argmax_rows(ops.prologue_linear(x, w))
    assert ref[1] == 3 and ref[2] == vocab // 2 and ref[3] == 0 and ref[4] == 0
    assert torch.equal(ops.decode_keys(keys), ref)
    assert torch.equal(ops.decode_keys(keys, off), ref + off[ref])
    for lo, first in ((vocab // 2, vocab // 2), (0, 0)):  # NaN from the middle on; all NaN
        nan = torch.zeros(vocab, 8)
        nan[lo:, 0] = float("nan")
        (keys,) = keyed(x[:1], nan.to(dtype).to(DEV))
        assert ops.decode_keys(keys).tolist() == [first]
    r, nw = torch.randn(6, 8, generator=g).to(dtype).to(DEV), torch.rand(8).to(dtype).to(DEV)
    y, s = ops.prologue_linear(x, w, norm_weight=nw, eps=1e-5, residual=r)
    keys, s2 = keyed(x, w, norm_weight=nw, eps=1e-5, residual=r)
    assert torch.equal(ops.decode_keys(keys, off), ops.argmax_rows(y, off))
    assert torch.equal(s, s2)


def test_tuning_keeps_the_default_kernel_unless_another_wins_by_the_margin():
    """`ops.tune_large_linear` / `tune_gemv_silu` replace the one-row default only for a
    candidate at least TUNE_MARGIN faster alone (smaller lone wins lost inside a forward)."""
    from engine.ops import tuning

    near = 1 / tuning.TUNE_MARGIN + 0.01  # a win just short of the margin
    assert tuning._beats({"d": 10.0, "x": 10.0 * near, "y": 12.0}, "d") == "d"
    assert tuning._beats({"d": 10.0, "x": 10.0 / tuning.TUNE_MARGIN - 0.01}, "d") == "x"
    assert tuning._beats({"d": 10.0, "x": 11.0}, "d") == "d"
    # Several rows: the fastest dot tile, unless cuBLAS wins by the margin.
    assert tuning._rows_choice({"cublas": 55.3, (32, 256): 60.0, (64, 256): 56.4}) == (64, 256)
    assert tuning._rows_choice({"cublas": 50.0, (32, 256): 60.0, (64, 256): 56.4}) == "cublas"
    assert tuning._rows_choice({"cublas": 20.0, (32, 256): 15.2, (64, 256): 16.0}) == (32, 256)
    assert tuning._rows_choice({"cublas": 20.0}) == "cublas"


def test_the_split_path_starts_where_one_split_ends():
    """A context that takes either kernel fits in one split, so it reduces in the same order on
    both and a verify row rounds as its decode row: the default mode's and a draft head's split
    path start exactly one split in, on CUDA and off it."""
    from engine.attention import TritonAttention
    from engine.attention import triton_backend as tb

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for be in (TritonAttention(9, 3, 64, 16), TritonAttention(9, 3, 64, 16, split_keys=32),
               TritonAttention(9, 3, 64, 16, **tb.draft_attention(cuda))):
        for dev in (cuda, cpu):
            assert be.long_from(dev) == be.keys_per_split(dev)
    assert tb.long_context(cuda) == tb.SPLIT_KEYS
    assert tb.long_context(cpu) == tb.INTERPRETER_SPLIT_KEYS
