"""Config parsing for the Llama family and logits/greedy parity with transformers on tiny
random models of each supported flavour."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, UnsupportedModelError

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

FLAVOURS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-bias-llama3rope": (LlamaConfig, LlamaForCausalLM,
                              {"attention_bias": True, "mlp_bias": True,
                               "rope_parameters": LLAMA3_ROPE}),
    "llama-tied-linear-rope": (LlamaConfig, LlamaForCausalLM,
                               {"tie_word_embeddings": True,
                                "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                    "factor": 2.0}}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def _build(name):
    torch.manual_seed(0)
    cfg_cls, model_cls, extra = FLAVOURS[name]
    hf_cfg = cfg_cls(**SHAPE, **extra)
    hf = model_cls(hf_cfg).eval()
    with torch.no_grad():  # random biases, so a missing bias would show
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)
    eng = Engine(EngineConfig(model=ModelConfig.from_hf(hf_cfg), num_blocks=128, block_size=8),
                 hf.state_dict())
    return hf, eng


@pytest.mark.parametrize("name", sorted(FLAVOURS))
def test_greedy_matches_transformers(name):
    hf, eng = _build(name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (3, 17, 40)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref


@pytest.mark.parametrize("name", ["llama-bias-llama3rope", "qwen2"])
def test_prefill_logits_match_transformers(name):
    hf, eng = _build(name)
    ids = list(range(10, 60))
    seq_id = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    batch = eng.scheduler.schedule()
    out = eng.runner.forward(batch, [len(ids) - 1])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(out.logits[0], ref, atol=1e-4, rtol=1e-4)
    eng.abort(seq_id)


def test_config_fields_from_hf():
    cfg = ModelConfig.from_hf(Qwen2Config(**SHAPE))
    assert cfg.qkv_bias and not cfg.o_bias and cfg.head_dim == 16 and cfg.num_kv_heads == 2
    cfg = ModelConfig.from_hf(LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE))
    assert cfg.rope.type == "llama3" and cfg.rope.factor == 8.0 and cfg.rope.theta == 500000.0
    cfg = ModelConfig.from_hf(MistralConfig(**SHAPE, sliding_window=128))
    assert cfg.max_position == 128  # context capped at the window: plain causal inside it


def test_unsupported_models_are_refused_clearly():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf(LlamaConfig(**SHAPE, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="activation"):
        ModelConfig.from_hf(LlamaConfig(**SHAPE, hidden_act="gelu"))


def test_engine_config_validation():
    m = ModelConfig.from_hf(LlamaConfig(**SHAPE))
    with pytest.raises(ValueError):
        EngineConfig(model=m, block_size=12)
    with pytest.raises(ValueError):
        EngineConfig(model=m, max_model_len=10_000)
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(model=m, admission_delay_steps=-1)
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(model=m, admission_share=0)
    assert EngineConfig(model=m).max_model_len == 256


def test_safetensors_folder_loads(tmp_path):
    from safetensors.torch import save_file

    hf, eng = _build("qwen2")
    hf.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    loaded = Engine.from_pretrained(str(tmp_path), num_blocks=64, block_size=8)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = eng.generate([[5, 6, 7]], sp)[0].token_ids
    assert loaded.generate([[5, 6, 7]], sp)[0].token_ids == want
