"""Greedy output equals HF transformers `generate` token for token (the engine's oracle)."""

from __future__ import annotations

import torch

from engine import SamplingParams
from tests.helpers import compare_with_ties

NEW_TOKENS = 64


def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy for exactly n tokens (EOS does not stop it) and its logits at each step."""
    saved = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None
    try:
        # An explicit mask: the prompt holds <|im_end|> (id 2), which HF would take for padding.
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, pad_token_id=2)
    finally:
        hf.generation_config.eos_token_id = saved
    toks = out.sequences[0, len(ids):].tolist()
    return toks, torch.cat(out.logits, dim=0)


def test_greedy_matches_hf_generate_token_for_token(smol_engine, hf_smol, chat_ids):
    prompts = chat_ids[:8]
    # EOS does not stop either side: every prompt compares all 64 tokens.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = smol_engine.generate(prompts, params)  # one continuous batch
    ties, compared = 0, 0
    for ids, got in zip(prompts, ours):
        ref, logits = hf_greedy(hf_smol, ids, NEW_TOKENS)
        equal, tie = compare_with_ties(got.token_ids, ref, logits)
        assert equal or tie, f"diverged from HF without a tie:\n ours {got.token_ids}\n ref  {ref}"
        ties += tie
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
