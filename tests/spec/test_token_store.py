"""The token store's write kernel (engine/spec/lookup.py `store_tokens`): every row count and
slice offset writes what the torch path writes, through one compiled kernel variant."""

from __future__ import annotations

import pytest
import torch

from engine.spec.lookup import STORE_BLOCK, store_tokens, token_store

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Row counts below, at and past one program's block, odd and multiples of 16.
SIZES = (1, 7, 16, STORE_BLOCK, STORE_BLOCK + 1, 3 * STORE_BLOCK - 5)


def _rows(n: int, offset: int, g: torch.Generator):
    """n ids and slots (some -1: rows that store no KV), sliced at `offset` from larger
    tensors as a step's rows are."""
    ids = torch.randint(1, 50_000, (n + offset,), generator=g)[offset:]
    slots = torch.randperm(4 * n + 8, generator=g)[: n + offset][offset:]
    slots[torch.rand(n, generator=g) < 0.2] = -1
    return ids.to(DEV), slots.to(DEV)


@pytest.mark.parametrize("n", SIZES)
def test_the_kernel_writes_what_torch_writes(n):
    g = torch.Generator().manual_seed(n)
    for offset in (0, 3):
        ids, slots = _rows(n, offset, g)
        want, got = token_store(4 * n + 8, DEV), token_store(4 * n + 8, DEV)
        store_tokens(want, ids, slots, kernel=False)
        store_tokens(got, ids, slots, kernel=True)
        assert torch.equal(got[:-1], want[:-1])  # the spare element takes the slotless rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_row_count_and_offset_runs_one_compiled_variant():
    """Specialized on the row count or a slice's alignment, the kernel would compile anew
    mid-serving for a batch size it had not seen."""
    from engine import jit_watch

    if not jit_watch.install():
        pytest.skip("this Triton has no JIT hooks")
    g = torch.Generator().manual_seed(0)
    ids, slots = _rows(5, 0, g)
    store_tokens(token_store(32, DEV), ids, slots, kernel=True)  # compiled here, if at all
    torch.cuda.synchronize()
    mark = jit_watch.count()
    for n in SIZES:
        for offset in (0, 1, 3):
            ids, slots = _rows(n, offset, g)
            store_tokens(token_store(4 * n + 8, DEV), ids, slots, kernel=True)
    torch.cuda.synchronize()
    assert [c.name for c in jit_watch.since(mark)] == []


def test_only_context_drafting_engines_compile_the_store_kernel_ahead():
    """`Engine.from_pretrained` starts compiling the store kernel while the weights load for an
    EAGLE-3 engine with context drafts, on CUDA only (elsewhere nothing compiles ahead)."""
    from dataclasses import replace

    from engine.config import SpecConfig
    from engine.spec import lookup

    spec = SpecConfig()
    assert lookup.needs_token_store(spec)
    assert not lookup.needs_token_store(None)
    assert not lookup.needs_token_store(replace(spec, context_drafts=False))
    assert not lookup.needs_token_store(SpecConfig(method="ngram", num_tokens=3, dynamic=False))
    before = dict(lookup._compiling)
    lookup.compile_store_ahead("cpu")
    assert lookup._compiling == before
