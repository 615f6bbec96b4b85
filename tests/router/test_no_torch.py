"""The router validates and tokenizes prompts without importing torch: its modules, the prompt
encoder and the tokenizer load none (the colocated backend, which holds an engine, aside)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A word-level tokenizer with a chat template stands in for a checkpoint's: transformers' own
# loaders (AutoTokenizer, the GGUF reader) import torch whenever it is installed.
ROUTER = """
import sys
import router.admission, router.auth, router.convert, router.disagg, router.limits, router.server
from engine.loader import resolve
from engine.prompt import PromptEncoder
from engine.tokenizer import Tokenizer
from tokenizers import Tokenizer as Raw, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "user": 4}
raw = Raw(models.WordLevel(vocab, unk_token="[UNK]"))
raw.pre_tokenizer = pre_tokenizers.Whitespace()
hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]",
                             additional_special_tokens=["<s>"])
hf.chat_template = "{% for m in messages %}<s> {{ m.role }} {{ m.content }} {% endfor %}"
encode = PromptEncoder(Tokenizer(hf), vocab_size=5, max_model_len=64, block_size=4,
                       num_blocks=16)
assert encode("hello world") == [1, 2]
assert encode([{"role": "user", "content": "hello"}]) == [3, 4, 1]
print("torch" in sys.modules)
import engine
engine.Engine  # the negative control: the engine itself does import torch
print("torch" in sys.modules)
"""


def test_the_router_tokenizes_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c", ROUTER], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"], proc.stdout
