"""`add_request(resume=...)`: a request moved off a worker that died continues where its
stream stopped: the same tokens, the same text (held-back text and stop strings included), the
same usage, as if it had never moved."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, SamplingParams


def stream(engine, prompt, params, resume=None, rid="r"):
    """Every output of one request, run alone to its end."""
    engine.add_request(prompt, params, request_id=rid, resume=resume)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def cut_after(outs, n):
    """(tokens, characters) streamed by the first outputs that hold at least n tokens."""
    tokens, chars = [], 0
    for o in outs:
        if len(tokens) >= n:
            break
        tokens += o.token_ids
        chars += len(o.text)
    return tokens, chars


@pytest.mark.parametrize("stop_at", [None, 0.6])
def test_a_resumed_request_continues_as_if_it_never_moved(smol_engine, chat_ids, stop_at):
    eng = smol_engine.with_config(enable_prefix_caching=False)
    prompt = chat_ids[2]
    free = stream(eng, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if stop_at is not None:  # a stop string well past the point the request moves at
        text = "".join(o.text for o in free)
        word = next(w for w in text[int(len(text) * stop_at):].split()
                    if text.index(w) > len(text) * stop_at)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(word,))
    whole = stream(eng, prompt, params)
    tokens, chars = cut_after(whole, 12)
    assert len(tokens) < sum(len(o.token_ids) for o in whole)  # it moves mid-way
    resumed = stream(eng, list(prompt) + tokens, params, resume=(len(tokens), chars), rid="m")
    assert tokens + [t for o in resumed for t in o.token_ids] == \
        [t for o in whole for t in o.token_ids]
    before = "".join(o.text for o in whole)
    assert before[:chars] + "".join(o.text for o in resumed) == before
    last, want = resumed[-1], whole[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == \
        (want.finish_reason, want.prompt_tokens, want.completion_tokens) == \
        (want.finish_reason, len(prompt), want.completion_tokens)
    if stop_at is not None:
        assert want.finish_reason == "stop"


def test_resume_refuses_what_cannot_be_a_resumed_request(smol_engine, chat_ids):
    prompt = list(chat_ids[0])
    for resume, match in (((0, 0), "output tokens"), ((len(prompt), 0), "output tokens"),
                          ((2, -1), "characters"), ((5, 0), "max_tokens")):
        with pytest.raises(InvalidRequestError, match=match):
            smol_engine.add_request(prompt, SamplingParams(max_tokens=5), resume=resume)
    # output past a stop (the end token, a stop id, a stop string) had finished
    eos = min(smol_engine.eos_ids)
    made = smol_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True))[0]
    for ids, params in [(prompt + [eos, 7], SamplingParams(max_tokens=9)),
                        (prompt + made.token_ids[:3], SamplingParams(
                            max_tokens=9, stop_token_ids=[made.token_ids[1]])),
                        (prompt + made.token_ids, SamplingParams(
                            max_tokens=9, stop=[made.text[1:4]]))]:
        with pytest.raises(InvalidRequestError, match="the stream it continues had finished"):
            smol_engine.add_request(ids, params, resume=(len(ids) - len(prompt), 0))
    assert not smol_engine.has_unfinished()
