"""Shared pieces: a tiny block layout, random KV tensors, and one event loop for ucxx.

ucxx (thread progress) delivers completions to the loop that first used it, so every UCX test
of the session runs on one `LoopThread`, exactly as a synchronous engine would drive it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import torch

from kvtransfer import BlockLayout, LocalTransport, LoopThread, Transport


def tiny_layout(dtype: str = "float32", **changes: Any) -> BlockLayout:
    """3 KV layers (2 target + 1 draft), block 16, 2 KV heads, head_dim 8."""
    fields = dict(model="tiny", dtype=dtype, block_size=16, num_layers=3, num_kv_heads=2,
                  head_dim=8, num_draft_layers=1)
    return BlockLayout(**{**fields, **changes})


def random_kv(layout: BlockLayout, num_blocks: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.kv_shape(num_blocks), generator=g).to(layout.torch_dtype)


def sample_extras() -> dict[str, torch.Tensor]:
    """The kind of per-request payload decode needs: drafted tokens, a fused hidden state."""
    return {"draft_tokens": torch.tensor([5, 17, 2, 99], dtype=torch.int64),
            "hidden": torch.randn(1, 24),
            "hidden_bf16": torch.randn(3).to(torch.bfloat16),
            "accepted": torch.tensor(True),
            "empty": torch.empty(0, 4)}


def run_then_stop(loop, coro: Coroutine[Any, Any, Any], receiver: tuple, layout: BlockLayout,
                  timeout: float = 60) -> tuple[Any, torch.Tensor | None]:
    """Run `coro` on the UCX loop, then stop the receiver process (`kvtransfer.bench`'s
    (process, pipe) of `spawn_receiver`) whatever happened: (its result, the receiver's kv
    when it was asked to return it)."""
    from kvtransfer.bench import stop_receiver

    try:
        out = loop.run(coro, timeout=timeout)
    finally:
        dst = stop_receiver(*receiver, layout)
    return out, dst


@pytest.fixture(scope="session")
def ucx_loop() -> Iterator[LoopThread]:
    pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed: UCX transport untested")
    loop = LoopThread("kvtransfer-test-loop")
    yield loop
    loop.close()


Run = Callable[[Coroutine[Any, Any, Any]], Any]
Factory = Callable[..., Transport]


@pytest.fixture(params=["local", "ucx-worker", "ucx-listener"])
def transport_kind(request: pytest.FixtureRequest) -> tuple[Factory, Run]:
    """(make a transport, run a coroutine) for each implementation of the contract."""
    if request.param == "local":
        return LocalTransport, lambda coro: asyncio.run(coro)
    loop = request.getfixturevalue("ucx_loop")
    from kvtransfer.ucx import UcxTransport

    mode = request.param.removeprefix("ucx-")

    def make(*args: Any, **kwargs: Any) -> Transport:
        return UcxTransport(*args, mode=mode, timeout=20.0, **kwargs)

    return make, lambda coro: loop.run(coro, timeout=60)
