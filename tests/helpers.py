"""Test helpers: tiny random engines and the objective numerical-tie rule."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig
from engine.config import tiny_config

TIE_EPS = 1e-4


def tiny_engine(seed: int = 0, **cfg) -> Engine:
    """A 2-layer random Llama with small blocks, so tests cross block boundaries often."""
    model_kw = {k: cfg.pop(k) for k in list(cfg) if k in (
        "vocab_size", "num_layers", "tie_word_embeddings", "max_position", "hidden_size",
        "intermediate_size", "num_heads", "num_kv_heads")}
    cfg.setdefault("num_blocks", 256)
    cfg.setdefault("block_size", 4)
    eng = Engine(EngineConfig(model=tiny_config(**model_kw), **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in eng.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return eng


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
