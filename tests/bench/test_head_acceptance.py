"""bench/head_acceptance.py: which held-out prompts count as unseen by a head's training
prompts, and the acceptance it measures (the trainer's `engine_acceptance`) on a tiny model
(the real runs are not in CI)."""

from __future__ import annotations

import pytest

from bench.head_acceptance import training_prompts
from cluster import prompt_sets


def test_mentions_are_names_and_quoted_documentation():
    assert prompt_sets.mentions("What are common mistakes when using `os.path.join`?") == \
        {"os.path.join"}
    assert prompt_sets.mentions("Write a Python function that uses `json.dumps`. The docs "
                                "say: Serialize obj to a JSON formatted str.") == \
        {"json.dumps", "Serialize obj to a JSON formatted str."}
    assert prompt_sets.mentions("Summarize this Python documentation in plain words:\n\n"
                                "Return the sum.\n\nMore text.") == {"Return the sum."}
    assert prompt_sets.mentions("Explain black holes in simple terms.") == set()


def test_unseen_leaves_out_what_training_mentions():
    held = ["Explain what `a.f` does in Python and show a short example.",
            "What are common mistakes when using `b.g`?",
            "Summarize this Python documentation in plain words:\n\nDo the thing.",
            "Explain black holes in simple terms."]
    train = ["Write a Python function that uses `a.f`. The docs say: Do the thing."]
    assert prompt_sets.unseen(held, train) == [held[1]]  # templated prompts never count
    assert prompt_sets.unseen(held) == held[:3]
    # the real sets: the base set's training prompts leave some held-out names unseen, and
    # adding training prompts can only take more away
    _, base_held = prompt_sets.build()
    base = prompt_sets.unseen(base_held, training_prompts("base"))
    both = prompt_sets.unseen(base_held, training_prompts("base"),
                              training_prompts("extended:3500"))
    assert 0 < len(both) < len(base) and set(both) <= set(base)
    # a name-split set leaves every held-out documentation prompt unseen
    split = training_prompts("extended+name-split")
    assert set(split) < set(training_prompts("extended"))
    assert prompt_sets.unseen(base_held, split) == [p for p in base_held
                                                    if prompt_sets.mentions(p)]


def test_training_prompts_refuses_an_unknown_set():
    assert len(training_prompts("base")) > 2000
    with pytest.raises(SystemExit, match="unknown prompt set"):
        training_prompts("wiki")
    with pytest.raises(SystemExit, match="unknown option"):
        training_prompts("base+name")


def test_acceptance_of_a_head_on_a_tiny_model():
    from cluster.train_eagle3 import engine_acceptance
    from tests.helpers import tiny_engine
    from tests.spec.test_eagle3 import random_head
    from tests.spec.test_trainer import _Tok

    base = tiny_engine(0)
    base.tokenizer = _Tok()
    got = engine_acceptance(base, random_head(base), ["a prompt", "another one"], 3, 12)
    assert 1.0 <= got["acceptance_length"] <= 4.0 and got["verify_steps"] > 0
    # KV blocks for both answers at once (prompt + 12 tokens + 3 drafts + 1 each), no more
    bs = base.config.block_size
    need = sum(-(-(len(base.encode_prompt([{"role": "user", "content": p}])) + 16) // bs)
               for p in ("a prompt", "another one"))
    assert got["kv_blocks"] == need + 8
    assert len(got["accept_rate_per_pos"]) == 3
