"""Greedy output equals HF transformers' greedy decoding token for token (the engine's oracle)."""

from __future__ import annotations

import torch

from engine import SamplingParams
from tests.helpers import TIE_EPS

NEW_TOKENS = 64


def hf_logits(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """HF's logits for each token of `out`, given the prompt and the tokens of `out` before
    it: one forward over both, where HF's `generate` would take one step per token. Greedy
    decoding is the argmax at each of these positions."""
    with torch.no_grad():
        ids = torch.tensor([prompt + out])
        # An explicit mask: the prompt holds <|im_end|> (id 2), which HF would take for padding.
        return hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 : -1]


def test_greedy_matches_hf_greedy_token_for_token(smol_engine, hf_smol, chat_ids):
    """Every generated token is HF's argmax after the same prefix, or that position is a
    numerical tie (HF's top-2 logits within TIE_EPS). Each position is judged on the engine's
    own prefix, so a tie does not end the comparison: every one of the 8 x 64 tokens counts."""
    prompts = chat_ids[:8]
    # EOS does not stop the engine: every prompt compares all 64 tokens.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = smol_engine.generate(prompts, params)  # one continuous batch
    ties, compared = 0, 0
    for ids, got in zip(prompts, ours):
        logits = hf_logits(hf_smol, ids, got.token_ids)
        ref = logits.argmax(-1).tolist()
        for j in (j for j, (a, b) in enumerate(zip(got.token_ids, ref)) if a != b):
            top2 = torch.topk(logits[j], 2).values
            assert top2[0] - top2[1] < TIE_EPS, (
                f"diverged from HF at token {j} without a tie:\n ours {got.token_ids}\n"
                f" HF's argmax {ref}")
            ties += 1
        compared += len(ref)
    print(f"\noracle: {len(prompts)} prompts, {compared} reference tokens, {ties} numerical ties")
    assert compared == 8 * NEW_TOKENS
    assert ties <= 1
    smol_engine.blocks.check_all_free()


def test_chat_template_and_streamed_text(smol_engine):
    tok = smol_engine.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "Say hello."}])
    assert "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n" in tok.hf.decode(ids)
    deltas = list(smol_engine.stream(ids, SamplingParams(temperature=0, max_tokens=24)))
    toks = [t for d in deltas for t in d.token_ids]
    # Text streamed in deltas equals decoding all generated tokens at once.
    assert "".join(d.text for d in deltas) == tok.decode(toks)
    assert deltas[-1].finished and deltas[-1].completion_tokens == len(toks)
