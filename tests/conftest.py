"""Shared fixtures: the real model loads once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (must be set before they are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three fruits that are red.",
    "Translate 'good morning, my friend' into Spanish.",
    "Explain what a hash table is to a ten-year-old.",
    'Give me a JSON object with keys "name" and "age" for a fictional person.',
    "Write a haiku about the ocean at night.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why do cats purr?",
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol_engine():
    """The embedded SmolLM2-135M-Instruct, fp32 on CPU, through the engine's own loader."""
    from engine import Engine

    return Engine.from_pretrained(None, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_smol():
    """The same checkpoint loaded by transformers alone: the oracle."""
    from transformers import AutoModelForCausalLM

    from engine.loader import embedded_checkpoint

    ck = embedded_checkpoint()
    m = AutoModelForCausalLM.from_pretrained(ck.folder, gguf_file=ck.gguf_file,
                                             dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def chat_ids(smol_engine):
    """Token ids of the chat prompts, rendered with the model's template."""
    return [smol_engine.tokenizer.apply_chat([{"role": "user", "content": p}])
            for p in CHAT_PROMPTS]
