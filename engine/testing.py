"""Tiny random models and heads for tests and benchmarks (random weights: timing and
equality checks only, never text quality)."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import torch

from engine import Engine, EngineConfig
from engine.attention import TorchAttention
from engine.config import ModelConfig, RopeConfig, tiny_config
from engine.spec.eagle3 import Eagle3Config, Eagle3Head

# The transformers fields `tiny_checkpoint` shrinks a real model's config to.
TINY_HF_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_MODEL_FIELDS = ("vocab_size", "num_layers", "tie_word_embeddings", "max_position",
                     "hidden_size", "intermediate_size", "num_heads", "num_kv_heads")


def tiny_engine(seed: int = 0, **cfg) -> Engine:
    """A 2-layer random Llama with small blocks, so tests cross block boundaries often.
    Keywords in `TINY_MODEL_FIELDS` shape the model; the rest go to `EngineConfig`."""
    model_kw = {k: cfg.pop(k) for k in list(cfg) if k in TINY_MODEL_FIELDS}
    cfg.setdefault("num_blocks", 256)
    cfg.setdefault("block_size", 4)
    eng = Engine(EngineConfig(model=tiny_config(**model_kw), **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in eng.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return eng


def random_head(engine: Engine, seed: int = 0, draft_vocab: int = 128,
                norm_before_residual: bool = False) -> Eagle3Head:
    """A random EAGLE-3 head for `engine`'s model: torch attention, a random draft vocabulary
    of `draft_vocab` ids."""
    m = engine.config.model
    hc = replace(Eagle3Config.for_target(m, draft_vocab, (0, 1, 1)),
                 norm_before_residual=norm_before_residual)
    head = Eagle3Head(hc, TorchAttention(hc.num_heads, hc.num_kv_heads, hc.head_dim,
                                         engine.config.block_size))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        head.set_vocab(torch.randperm(m.vocab_size, generator=g)[:draft_vocab])
    return head.eval()


def smol_shape(**kw) -> ModelConfig:
    """SmolLM2-135M-Instruct's shape (fields in `kw` replaced)."""
    base = dict(name="SmolLM2-135M-Instruct", model_type="llama", vocab_size=49152,
                hidden_size=576, intermediate_size=1536,
                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                rope=RopeConfig(theta=100000.0), max_position=8192, eos_token_ids=(),
                tie_word_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def llama8b_shape(max_position: int = 8192) -> ModelConfig:
    """Llama-3.1-8B's shape, for random-weight timing."""
    return ModelConfig(
        name="Llama-3.1-8B-shape (random weights)", model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position=8192),
        max_position=max_position, tie_word_embeddings=False, eos_token_ids=())


def tiny_checkpoint(folder: str, like: str) -> tuple[str, str]:
    """A tiny random Llama (`TINY_HF_SHAPE`) with the tokenizer and chat template of the
    safetensors folder `like`, and a random EAGLE-3 head for it, saved under `folder` where
    `Engine.from_pretrained` and `SpecConfig.head` read them: (model folder, head folder)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaForCausalLM

    from engine.spec.eagle3 import save_head

    model, head = os.path.join(folder, "tiny-random-llama"), os.path.join(folder, "head")
    cfg = AutoConfig.from_pretrained(like)
    for k, v in TINY_HF_SHAPE.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    cfg.save_pretrained(model)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(model, "model.safetensors"))
    for name in os.listdir(like):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(like, name), model)
    eng = Engine.from_pretrained(model, num_blocks=16)
    save_head(random_head(eng), head, dtype=torch.float32, target=eng.config.model)
    return model, head
