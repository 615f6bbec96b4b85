"""Stop conditions: EOS, stop token ids, stop strings, max tokens."""

from __future__ import annotations

from engine import SamplingParams


def test_stop_string_truncates_text(smol_engine, chat_ids):
    prompt = chat_ids[2]
    free = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    words = free.text.split()
    assert len(words) > 3
    stop = words[2]
    cut = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                        stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert len(cut.token_ids) < len(free.token_ids)


def test_stop_token_ids_and_max_tokens(smol_engine, chat_ids):
    prompt = chat_ids[0]
    free = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    t = free.token_ids[5]
    out = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                        stop_token_ids=(t,)))[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(t) + 1]
    assert out.finish_reason == "stop"
    short = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"


def test_eos_ends_generation(smol_engine, chat_ids):
    out = smol_engine.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    ignored = smol_engine.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=40,
                                                                 ignore_eos=True))[0]
    assert len(ignored.token_ids) == 40


def test_stop_string_split_across_tokens_is_never_streamed(smol_engine, chat_ids):
    prompt = chat_ids[2]
    free = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    tok = smol_engine.tokenizer
    # A stop string made of the tail of one token and the head of the next.
    pieces = [tok.decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]
    i = next(i for i in range(3, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) > len(pieces[i]))
    stop = pieces[i][-1] + pieces[i + 1][len(pieces[i])]
    start = free.text.index(stop)
    deltas = list(smol_engine.stream(prompt, SamplingParams(temperature=0, max_tokens=40,
                                                            stop=(stop,))))
    streamed = "".join(d.text for d in deltas)
    assert streamed == free.text[:start]
    assert deltas[-1].finish_reason == "stop"


def test_fast_decode_equals_transformers_decode(smol_engine, chat_ids):
    """The per-token decode path calls the fast tokenizer directly; it must produce exactly
    what transformers' decode does (special tokens dropped, unicode, spacing)."""
    tok = smol_engine.tokenizer
    assert tok._fast_decode is not None
    samples = [chat_ids[0], tok.encode("naïve café — 東京 🙂  two  spaces , tabs\tend"),
               list(range(0, 400, 7))]
    for ids in samples:
        for n in range(1, len(ids) + 1, 3):
            assert tok.decode(ids[:n]) == tok.hf.decode(ids[:n], skip_special_tokens=True)


def test_fast_decode_is_refused_when_transformers_cleans_up(smol_engine):
    """A tokenizer whose decode post-processes text (clean-up of spaces before punctuation)
    keeps transformers' decode: the shortcut would change the streamed text."""
    from engine.loader import Tokenizer

    hf = smol_engine.tokenizer.hf

    class CleaningUp:
        backend_tokenizer = hf.backend_tokenizer

        def encode(self, *a, **k):
            return hf.encode(*a, **k)

        def decode(self, ids, **k):
            return hf.decode(ids, **k).replace(" ,", ",").replace(" !", "!")

    assert Tokenizer(CleaningUp())._fast_decode is None
    assert Tokenizer(hf)._fast_decode is not None


def _cut_by_token(tokens, eos, stop_ids, length, limit, hold):
    """The rule token by token, as `output.emit_each` applies it (no stop strings)."""
    kept, reason = [], None
    for tok in tokens:
        kept.append(tok)
        length += 1
        if tok in eos or tok in stop_ids:
            reason = "stop"
        elif length >= limit:
            reason = "length"
        if reason:
            break
        if hold:
            reason = "handoff"
            break
    return kept, reason


def test_cut_matches_the_token_by_token_rule():
    """`cut` (what `Postprocessor.emit` does for requests without stop strings, in one pass)
    keeps the same tokens and gives the same reason as the token-by-token rule: stop ids, EOS,
    the length limit, a stop id on the limit's token, a held request, a limit already
    reached."""
    import random

    from engine.output import cut

    rng = random.Random(0)
    seen = set()
    for _ in range(5000):
        tokens = [rng.randrange(8) for _ in range(rng.randrange(0, 9))]
        eos = rng.choice([(), {7}, {6, 7}])
        stop_ids = rng.choice([(), (5,), (3, 5)])
        length, limit = rng.randrange(0, 12), rng.randrange(1, 14)
        hold = rng.random() < 0.2
        want = _cut_by_token(tokens, eos, stop_ids, length, limit, hold)
        got = cut(tokens, eos, stop_ids, limit - length, hold)
        assert (list(got[0]), got[1]) == want, (tokens, eos, stop_ids, length, limit, hold)
        seen.add(want[1])
    assert seen == {None, "stop", "length", "handoff"}
