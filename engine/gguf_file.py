"""A GGUF file read once: its metadata, tensor table and tensors, turned into what transformers
reads from it (the config's keys, the tokenizer's parts, HF-named weights), so a build parses the
file one time instead of once per config, tokenizer and weights."""

from __future__ import annotations

import mmap
import os
import re
import struct
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Metadata value types (the GGUF spec's numbering): fixed-size scalars by struct format; 8 is a
# string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9

# GGUF tensor names of a Llama-family layer -> the HF module they belong to.
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


class GgufFile:
    """One parse of a GGUF file: `meta` (every key, arrays read whole), `tensors` (name ->
    (torch-order shape, ggml type, file offset)) and the file mapped for reading tensor data."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise ValueError(f"{path} is not a GGUF file (shorter than its header)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, KeyError) as e:
            raise ValueError(f"{path}: a torn or malformed GGUF file ({e})") from None

    def _parse(self) -> None:
        path = self.path
        version, n_tensors, n_keys = struct.unpack_from("<IQQ", self._map, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        self._pos = 24
        self.meta = {}
        for _ in range(n_keys):
            key = self._string()
            self.meta[key] = self._value(self._read("I"))
        table = [(self._string(), self._table_entry()) for _ in range(n_tensors)]
        align = self.meta.get("general.alignment", 32)
        start = -(-self._pos // align) * align
        self.tensors = {name: (shape, kind, start + off) for name, (shape, kind, off) in table}

    @property
    def architecture(self) -> str:
        return self.meta["general.architecture"]

    def _read(self, fmt: str):
        (v,) = struct.unpack_from("<" + fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._read("Q")
        self._pos += n
        return self._map[self._pos - n : self._pos].decode("utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {kind}")
        item, n = self._read("I"), self._read("Q")
        if item in _SCALARS:  # read in one go
            fmt = f"<{n}{_SCALARS[item]}"
            out = list(struct.unpack_from(fmt, self._map, self._pos))
            self._pos += struct.calcsize(fmt)
            return out
        return [self._value(item) for _ in range(n)]

    def _table_entry(self) -> tuple[tuple[int, ...], int, int]:
        dims = [self._read("Q") for _ in range(self._read("I"))]
        kind, offset = self._read("I"), self._read("Q")
        return tuple(reversed(dims)), kind, offset  # ggml lists the fastest dimension first

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, in torch's dimension order."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

        shape, kind, offset = self.tensors[name]
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        row = shape[-1] // block * size
        n = int(np.prod(shape[:-1])) * row
        if offset + n > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} ends past the file's end (a torn "
                             "download?)")
        raw = np.frombuffer(self._map, np.uint8, n, offset)
        return dequantize(raw.reshape(*shape[:-1], row), qtype)


def hf_sections(g: GgufFile) -> dict[str, dict]:
    """The file's metadata sorted into transformers' `config`, `tokenizer` and
    `tokenizer_config` keys by transformers' own GGUF key table, as its GGUF loader sorts them."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch = g.architecture
    # llama.cpp files Mistral models under the llama architecture; transformers tells them by name.
    model_type = "mistral" if arch == "llama" and g.meta.get("general.name") == "mistral" else arch
    out: dict[str, dict] = {section: {} for section in GGUF_TO_TRANSFORMERS_MAPPING}
    out["config"]["tie_word_embeddings"] = "output.weight" not in g.tensors
    for key, value in g.meta.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, model_type)
        for section, renames in GGUF_TO_TRANSFORMERS_MAPPING.items():
            name = renames.get(prefix, {}).get(rest)
            if name is not None and name != -1:
                out[section][name] = value
    if "vocab_size" not in out["config"] and "tokens" in out["tokenizer"]:
        out["config"]["vocab_size"] = len(out["tokenizer"]["tokens"])
    return out


def hf_tokenizer(g: GgufFile, sections: dict[str, dict], folder: str):
    """transformers' fast tokenizer for the file (found in `folder`), built from its parsed
    vocabulary and merges with transformers' GGUF converter: special tokens named by the ids
    the file gives."""
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers 4
        from transformers.integrations.ggml import convert_gguf_tokenizer

    parts = sections["tokenizer"]
    kwargs = dict(sections["tokenizer_config"])
    if parts.get("tokenizer_type") == "llama":  # sentencepiece files that say nothing add BOS
        kwargs.setdefault("add_bos_token", True)
    for name in ("bos", "eos", "unk", "pad"):
        i = parts.get(f"{name}_token_id")
        kwargs[f"{name}_token"] = parts["tokens"][i] if i is not None else None
    backend, extra = convert_gguf_tokenizer(g.architecture, parts)
    kwargs.update(extra)  # what the converter names (transformers 4) wins, as in transformers
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=folder, **kwargs)


def hf_state_dict(g: GgufFile, sections: dict[str, dict], dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """HF-named tensors in `dtype`, dequantized. llama.cpp stores the llama architecture's q and
    k rows with each head's rotary pairs interleaved; they come back as HF's two halves."""
    import torch

    cfg = sections["config"]
    heads = {"attn_q": cfg.get("num_attention_heads"), "attn_k": cfg.get("num_key_value_heads")}
    if g.architecture != "llama" or None in heads.values():  # as transformers: left as stored
        heads = {}
    out = {}
    for name in g.tensors:
        hf = hf_name(name)
        if hf is None:
            continue
        w = g.array(name)
        n = heads.get(name.split(".")[-2])
        if n:
            w = w.reshape(n, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        out[hf] = torch.from_numpy(w if w.flags.writeable else w.copy()).to(dtype)
    return out


def hf_name(name: str) -> str | None:
    """The HF parameter a Llama-family GGUF tensor is; None for one transformers skips too
    (`rope_freqs`: the rotary frequencies, computed from the config instead)."""
    module, _, kind = name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{kind}"
    return f"{_TOP_NAMES[module]}.{kind}" if module in _TOP_NAMES else None
