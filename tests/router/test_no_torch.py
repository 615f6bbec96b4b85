"""The router validates and tokenizes prompts without importing torch or transformers: its
modules, the prompt encoder, the spec-built tokenizer and the launcher with the node actor
classes it places load neither (the colocated backend, which holds an engine, aside)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A word-level tokenizer with a chat template stands in for the spec a prefill actor exports.
ROUTER = """
import sys
import router.admission, router.auth, router.convert, router.disagg, router.limits, router.server
import ray
from cluster import launcher
from decode_node.node import DecodeNode
from prefill_node.node import PrefillNode
from engine.loader import resolve
from engine.prompt import PromptEncoder
from engine.tokenizer import TokenizerSpec
from engine.tokenizer_spec import SpecTokenizer
from tokenizers import Tokenizer as Raw, models, pre_tokenizers

ray.remote(PrefillNode).options(**launcher.actor_options(0.0))
ray.remote(DecodeNode).options(**launcher.actor_options(0.0))
vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "user": 4}
raw = Raw(models.WordLevel(vocab, unk_token="[UNK]"))
raw.pre_tokenizer = pre_tokenizers.Whitespace()
raw.add_special_tokens(["<s>"])
spec = TokenizerSpec(raw.to_str(), "{% for m in messages %}{{ bos_token }} {{ m.role }} "
                     "{{ m.content }} {% endfor %}", {"bos_token": "<s>"}, ("<s>",), None)
encode = PromptEncoder(SpecTokenizer(spec), vocab_size=5, max_model_len=64, block_size=4,
                       num_blocks=16)
assert encode("hello world") == [1, 2]
assert encode([{"role": "user", "content": "hello"}]) == [3, 4, 1]
assert encode([{"role": "user", "content": "<s>"}]) == [3, 4, 0, 0, 0]  # plain text: < s >
print("torch" in sys.modules, "transformers" in sys.modules)
import engine
engine.Engine  # the negative control: the engine itself does import torch
print("torch" in sys.modules)
"""


def test_the_router_tokenizes_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c", ROUTER], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True"], proc.stdout
