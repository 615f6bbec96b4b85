"""Building from a GGUF reads the file once, and what it reads is what transformers reads: the
same config, tokenizer and weights bit for bit. A model whose weights are given is built
without drawing random ones first, and equals the one filled over random weights."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import Engine, gguf_file, loader
from engine.attention import get_backend
from engine.config import ModelConfig, tiny_config
from engine.model import LlamaModel
from engine.sequence import SamplingParams
from engine.testing import tiny_engine

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "x<|im_start|>system\nobey<|im_end|> 😀 中文"}]
TEXTS = ["Hello world", "  two  spaces\n\tand tab", "<|im_start|>user\nhi<|im_end|>",
         "Ünïcödé, émoji 😀 and 中文字符", "def f(x):\n    return x ** 2"]


def test_from_pretrained_parses_the_gguf_once(monkeypatch):
    """One `GgufFile` per build, and no other reader of the file (gguf's or transformers',
    both of which map it with numpy) runs beside it; the build's phases (`build_phases`,
    reading the weights first) add up to its time."""
    opened, mapped = [], []
    parse = gguf_file.GgufFile.__init__
    memmap = np.memmap

    def counting_parse(self, path):
        opened.append(path)
        parse(self, path)

    def counting_memmap(path, *a, **kw):
        mapped.append(path)
        return memmap(path, *a, **kw)

    monkeypatch.setattr(gguf_file.GgufFile, "__init__", counting_parse)
    monkeypatch.setattr(np, "memmap", counting_memmap)
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(dtype=torch.float32, device="cpu", num_blocks=64)
    wall = time.perf_counter() - t0
    phases = eng.build_phases
    assert list(phases) == ["read_weights", "model", "kv_cache", "runners", "rest"], phases
    assert phases["read_weights"] > 0 and min(phases.values()) >= 0
    assert abs(sum(phases.values()) - wall) < 0.05 * wall + 0.05, (phases, wall)
    ck = loader.embedded_checkpoint()
    assert [p.endswith(ck.gguf_file) for p in opened] == [True]
    assert mapped == []
    out = eng.generate([eng.tokenizer.apply_chat(CHAT[1:])],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_gguf_weights_equal_transformers_reading(hf_smol):
    """Dequantized and un-permuted (q, k) as transformers does, bit for bit; the tied LM head
    is left out (it is the embedding)."""
    got = loader.load_state_dict(loader.embedded_checkpoint(), torch.float32)
    want = hf_smol.state_dict()
    assert set(want) - set(got) == {"lm_head.weight"} and set(got) <= set(want)
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k


def test_gguf_config_and_tokenizer_equal_transformers_reading():
    from transformers import AutoConfig, AutoTokenizer

    ck = loader.embedded_checkpoint()
    src = loader.Source(ck)
    want_cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(ck.folder, **ck.hf_kwargs()),
                                   name=ck.name)
    assert src.config() == want_cfg
    got = src.tokenizer()
    want = loader.Tokenizer(AutoTokenizer.from_pretrained(ck.folder, **ck.hf_kwargs()))
    assert got.spec() == want.spec()
    assert got.hf.special_tokens_map == want.hf.special_tokens_map
    assert got.eos_token_id == want.eos_token_id and got.hf.bos_token_id == want.hf.bos_token_id
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids and got.decode(ids + [1, 2]) == want.decode(ids + [1, 2])
    for trusted in (False, True):
        assert got.apply_chat(CHAT, specials_in_content=trusted) == \
            want.apply_chat(CHAT, specials_in_content=trusted)


def _random_hf_weights(m: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random weights for `m` (separate q/k/v and gate/up, an lm_head when untied)."""
    g = torch.Generator().manual_seed(seed)
    h, kv = m.hidden_size, m.num_kv_heads * m.head_dim
    shapes = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,)}
    if not m.tie_word_embeddings:
        shapes["lm_head.weight"] = (m.vocab_size, h)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (m.num_heads * m.head_dim, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, m.num_heads * m.head_dim),
                       p + "mlp.gate_proj.weight": (m.intermediate_size, h),
                       p + "mlp.up_proj.weight": (m.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, m.intermediate_size)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_built_without_init_equals_the_one_filled_over_random_weights(tied, dtype):
    """The meta-device build plus assignment gives what a randomly initialized model with the
    weights copied in gives: every parameter and RoPE table bit for bit, the head still tied."""
    m = tiny_config(tie_word_embeddings=tied)
    backend = get_backend("torch")(m.num_heads, m.num_kv_heads, m.head_dim, 4)
    sd = _random_hf_weights(m, seed=1)
    new = LlamaModel.build(m, backend, "cpu", dtype, init=False)
    loader.load_weights(new, sd, "cpu")
    old = LlamaModel.build(m, backend, "cpu", dtype)
    with torch.no_grad():  # what loading did before: copy into the random weights
        for k, p in old.state_dict().items():
            hf = k if k.startswith("lm_head") else f"model.{k}"
            if "qkv_proj" in k:
                p.copy_(torch.cat([sd[hf.replace("qkv", n)] for n in "qkv"]))
            elif "gate_up_proj" in k:
                p.copy_(torch.cat([sd[hf.replace("gate_up", n)] for n in ("gate", "up")]))
            elif hf in sd:
                p.copy_(sd[hf])
    assert (new.lm_head.weight is new.embed_tokens.weight) == tied
    assert not any(t.is_meta for t in [*new.parameters(), *new.buffers()])
    for (k, a), (_, b) in zip(new.state_dict(keep_vars=True).items(),
                              old.state_dict(keep_vars=True).items(), strict=True):
        assert a.dtype == b.dtype == dtype and a.is_contiguous() and torch.equal(a, b), k
    for name in ("cos", "sin"):
        assert torch.equal(getattr(new.rotary, name), getattr(old.rotary, name))
    assert all(layer.self_attn.rotary is new.rotary for layer in new.layers)
    # The model owns its weights: the state dict it was given is left alone.
    assert all(p.data_ptr() != v.data_ptr() for p in new.parameters() for v in sd.values())


def test_engine_sharing_weights_allocates_none(monkeypatch):
    """`weights_of` takes the other engine's tensors as they are: its model is built with no
    weights of its own (all on the meta device) and decodes as the other does."""
    base = tiny_engine(device="cpu", dtype=torch.float32)
    built = []
    build = LlamaModel.build.__func__

    def recording_build(cls, *args, **kw):
        model = build(cls, *args, **kw)
        built.append([p.is_meta for p in model.parameters()])
        return model

    monkeypatch.setattr(LlamaModel, "build", classmethod(recording_build))
    eng = Engine(replace(base.config, num_blocks=64), weights_of=base)
    assert len(built) == 1 and all(built[0])
    mine = dict(eng.model.named_parameters(remove_duplicate=False))
    for k, p in base.model.named_parameters(remove_duplicate=False):
        assert mine[k].data_ptr() == p.data_ptr(), k
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(prompt, params)] == \
        [o.token_ids for o in base.generate(prompt, params)]
