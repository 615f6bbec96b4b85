"""The host side of an eager forward's deterministic projections: the tiles remembered per
snapshot of the settings (`cached_tiles`), and launches past Triton's JIT (`BoundLaunch`)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import ops
from engine.attention import triton_available
from engine.attention.triton_backend import cdiv
from engine.ops import elementwise, invariant, prologue

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")

SHAPES = [(960, 576, False, True), (1536, 576, True, False), (576, 576, False, False),
          (49152, 576, False, False), (6144, 4096, False, True)]  # (n, k, glu, norm)


def _all_tiles(fn):
    return [fn(n, k, m, glu, norm, False, True, 2) for n, k, glu, norm in SHAPES
            for m in (1, 16, 17, 255, 256, 2048)]


def test_cached_tiles_follow_every_setting(monkeypatch):
    """Remembered tiles are `invariant_tiles`' own, and a changed setting (a plain one, an item
    of a table, a row table) gives that setting's tiles, not the remembered ones."""
    assert _all_tiles(invariant.cached_tiles) == _all_tiles(invariant.invariant_tiles)
    before = _all_tiles(invariant.cached_tiles)
    for name, value in (("PREFILL_ROWS", None), ("PREFILL_ROWS", 17), ("NORM_WARPS", None),
                        ("ROW_TILES", ((16, 16, 32), (4096, 32, 64))), ("HEAD_ROWS", None)):
        with monkeypatch.context() as mp:
            mp.setattr(invariant, name, value)
            got = _all_tiles(invariant.cached_tiles)
            assert got == _all_tiles(invariant.invariant_tiles), name
            assert got != before, f"{name}={value!r} changed no tiles: the case tests nothing"
    with monkeypatch.context() as mp:
        mp.setitem(invariant.PREFILL_TILES, "plain", (128, 64, 64, 8))
        got = _all_tiles(invariant.cached_tiles)
        assert got == _all_tiles(invariant.invariant_tiles) and got != before
    assert _all_tiles(invariant.cached_tiles) == before


def test_cached_tiles_still_refuse_a_malformed_setting(monkeypatch):
    """A malformed setting, hashable or not, or equal to a valid one remembered (256.0 and
    256), gets `invariant_tiles`' ValueError every call."""
    invariant.cached_tiles(960, 576, 2048, False, True, False, True, 2)  # remembered valid
    for name, value in (("PREFILL_ROWS", "256"), ("PREFILL_ROWS", 256.0),
                        ("ROW_TILES", [[4096, 16, 32]]), ("NORM_K", 24)):
        with monkeypatch.context() as mp:
            mp.setattr(invariant, name, value)
            for _ in range(2):
                with pytest.raises(ValueError, match=name):
                    invariant.cached_tiles(960, 576, 2048, False, True, False, True, 2)
    with monkeypatch.context() as mp:
        mp.setitem(invariant.PREFILL_TILES, "norm", [32, 128, None, 8])
        with pytest.raises(ValueError, match="PREFILL_TILES"):
            invariant.cached_tiles(960, 576, 2048, False, True, False, True, 2)


def test_cdiv_is_the_ceiling():
    for a in range(0, 300, 7):
        for b in (1, 3, 16, 128):
            assert cdiv(a, b) == math.ceil(a / b)


def _jit_only(monkeypatch):
    """Route prologue launches through Triton's JIT launch alone (the reference)."""
    monkeypatch.setattr(prologue, "_LINEAR", _Jit(prologue._prologue_linear_kernel))
    monkeypatch.setattr(prologue, "_NORM", _Jit(prologue._prologue_norm_kernel))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("apart", [False, True])
def test_bound_launches_write_what_the_jit_writes_gpu(monkeypatch, apart):
    """Past a variant's first launches, prologue launches skip the JIT (`BoundLaunch.fast`
    grows) and write the JIT's bits: aligned inputs, and a view whose row stride and start
    are off 16 bytes (another variant of Triton's specialization, which must not reuse the
    aligned one); with a launch hook set, the JIT launches."""
    from triton import knobs

    monkeypatch.setattr(invariant, "PREFILL_NORM_APART", apart)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    w = (torch.randn(960, 576, device=dev) * 0.04).to(bf)
    nw = (1 + 0.1 * torch.randn(576, device=dev)).to(bf)
    wide = torch.randn(2048, 583, device=dev).to(bf)
    cases = {"aligned": (torch.randn(2048, 576, device=dev).to(bf),
                         torch.randn(2048, 576, device=dev).to(bf)),
             "offset": (wide[:, 3:579], wide[:, 1:577])}

    def run():
        return {name: invariant.invariant_linear(x, w, norm_weight=nw, eps=1e-5, residual=r)
                for name, (x, r) in cases.items()}

    run(), run()  # each variant's first launches, through the JIT (the first makes its binder)
    before = prologue._LINEAR.fast
    got = [run() for _ in range(2)]
    torch.cuda.synchronize()
    if isinstance(prologue._LINEAR, prologue.BoundLaunch):
        assert prologue._LINEAR.fast >= before + 4
    with monkeypatch.context() as mp:
        _jit_only(mp)
        want = run()
    for g in got:
        for name in cases:
            for a, b in zip(g[name], want[name]):
                assert torch.equal(a, b), name
    assert not torch.equal(got[0]["aligned"][0], got[0]["offset"][0])
    fast = prologue._LINEAR.fast
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    run()
    assert prologue._LINEAR.fast == fast


class _Jit:
    """Launches through Triton's JIT alone: the reference a BoundLaunch must match."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn[grid]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bound_elementwise_launches_write_what_the_jit_writes_gpu(monkeypatch, dtype):
    """add_rmsnorm, silu_mul and rope_store_ past the JIT (their `fast` counts grow) write the
    JIT's bits."""
    dev, g = "cuda", torch.Generator(device="cuda").manual_seed(3)
    bound = {"_ADD_RMSNORM": elementwise._add_rmsnorm_kernel,
             "_SILU_MUL": elementwise._silu_mul_kernel,
             "_ROPE_STORE": elementwise._rope_store_kernel}
    x, r = (torch.randn(300, 576, device=dev, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(576, device=dev, generator=g)).to(dtype)
    gu = torch.randn(300, 3072, device=dev, generator=g).to(dtype)
    heads = torch.randn(40, 15, 64, device=dev, generator=g).to(dtype)
    cos, sin = (torch.rand(128, 64, device=dev, generator=g) for _ in range(2))
    pos = torch.randint(0, 128, (40,), device=dev, generator=g)
    slots = torch.randperm(64, device=dev, generator=g)[:40]

    def run():
        cache = torch.zeros(2, 16, 4, 3, 64, dtype=dtype, device=dev)
        h = ops.rope_store_(heads.clone(), 9, 3, pos, cos, sin, cache, slots)
        return (*ops.add_rmsnorm(x, w, 1e-5, r), ops.add_rmsnorm(x, w, 1e-5),
                ops.silu_mul(gu), h, cache)

    run(), run()  # each variant's first launches, through the JIT
    fast = {name: getattr(elementwise, name).fast for name in bound}
    got = run()
    for name in bound:
        assert getattr(elementwise, name).fast > fast[name], name
    with monkeypatch.context() as mp:
        for name, fn in bound.items():
            mp.setattr(elementwise, name, _Jit(fn))
        want = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
