"""Test helpers: tiny random engines (from `engine.testing`) and the objective numerical-tie
rule."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from engine.testing import tiny_engine

__all__ = ["TIE_EPS", "background", "compare_with_ties", "one_thread", "tiny_engine"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: on a busy 2-core host a second intra-op thread only adds contention (up to
    100x slower). A module uses it by importing it (`from tests.helpers import one_thread`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

TIE_EPS = 1e-4


def compare_with_ties(ours: list[int], ref: list[int], ref_logits: torch.Tensor | None
                      ) -> tuple[bool, bool]:
    """(equal, tie): sequences equal; or they agree up to the first divergence and there the
    reference's top-2 logits differ by less than TIE_EPS (a numerical tie, judged objectively)."""
    if ours == ref:
        return True, False
    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if ref_logits is None or j >= ref_logits.shape[0]:
        return False, False
    top2 = torch.topk(ref_logits[j].float(), 2).values
    return False, bool(top2[0] - top2[1] < TIE_EPS)


def background(fn, *args, name: str = "background") -> Future:
    """fn(*args) started on a thread of its own (named `name`), which ends with it; its Future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)
