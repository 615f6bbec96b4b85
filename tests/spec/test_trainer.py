"""The EAGLE-3 trainer end to end on a tiny random target: self-distil through the engine,
build the draft vocabulary, train a few steps, save in the public layout, load, serve."""

from __future__ import annotations

from dataclasses import replace

import torch

from cluster.train_eagle3 import draft_vocab, expected_acceptance, self_distill, train
from engine import Engine, SamplingParams
from engine.attention import TorchAttention
from engine.config import SpecConfig
from engine.spec.eagle3 import Eagle3Config, load_head, save_head
from tests.helpers import tiny_engine


class _Tok:
    """Just enough tokenizer for chat prompts on a 256-token random model."""

    eos_token_id = None

    def apply_chat(self, messages):
        return [ord(c) % 256 for c in messages[-1]["content"]][:24]

    def decode(self, ids):
        return ""


def test_trainer_runs_end_to_end_and_learns(tmp_path):
    torch.manual_seed(0)  # head init and batch order: independent of the tests run before
    eng = tiny_engine(0, max_num_seqs=32, enable_prefix_caching=False)
    eng.tokenizer = _Tok()
    layers = Eagle3Config.for_target(eng.config.model, 1).aux_layer_ids
    prompts = [f"prompt number {i} about {w}" for i, w in enumerate("abcdefghijklmnopqrst")]
    recs = self_distill(eng, prompts[:16], 24, layers, torch.float32)
    held = self_distill(eng, prompts[16:], 24, layers, torch.float32, desc="held-out")
    assert len(recs) == 16 and all(r.aux.shape == (len(r.ids) - 1, 3 * 64) for r in recs)
    assert eng.capture is None  # the tap is removed afterwards
    vocab = draft_vocab(recs, 64, 256)
    assert vocab.shape == (64,) and torch.equal(vocab, vocab.sort().values)
    head, info = train(eng, recs, held, vocab, unroll=3, epochs=8, lr=3e-3, batch_size=4,
                       log_every=16)
    hist = info["history"]
    assert hist and hist[-1]["loss"] < hist[0]["loss"]
    assert hist[-1]["eval_expected_acceptance"] > 1.0
    assert expected_acceptance([0.5, 0.5]) == 1.75
    save_head(head, str(tmp_path), dtype=torch.float32)
    back = load_head(str(tmp_path), eng.config.model,
                     lambda c: TorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, 4))
    spec = Engine(replace(eng.config, spec=SpecConfig(num_tokens=3, dynamic=False)),
                  weights_of=eng, draft_head=back)
    sp = SamplingParams(temperature=0, max_tokens=20)
    ids = [[5, 6, 7, 8, 9]]
    assert spec.generate(ids, sp)[0].token_ids == eng.generate(ids, sp)[0].token_ids
