"""The engine thread's output streams: a consumer that falls behind gets what piled up merged
into one output, with the same tokens, text and finish as one output per step."""

from __future__ import annotations

import asyncio

from engine.loop import EngineLoop, merge_outputs
from engine.output import RequestOutput
from engine.sequence import SamplingParams
from tests.helpers import tiny_engine


def test_merge_outputs_keeps_order_and_takes_the_latest_state():
    a = RequestOutput("r", [1, 2], "ab", completion_tokens=2, accepted_tokens=1)
    b = RequestOutput("r", [3], "c", finished=True, finish_reason="stop", completion_tokens=3,
                      accepted_tokens=1)
    m = merge_outputs(a, b)
    assert (m.token_ids, m.text, m.finished, m.finish_reason) == ([1, 2, 3], "abc", True, "stop")
    assert (m.completion_tokens, m.accepted_tokens) == (3, 1)
    assert a.token_ids == [1, 2]  # inputs untouched


def test_a_lagging_consumer_gets_merged_outputs_with_the_same_tokens():
    eng = tiny_engine(0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [5, 9, 2, 7]
    want = eng.generate([prompt], params)[0].token_ids
    loop = EngineLoop(eng)
    loop.start()

    async def consume(lag: float):
        outs = []
        async for out in loop.generate(f"r{lag}", prompt, params):
            outs.append(out)
            await asyncio.sleep(lag)
        return outs

    try:
        fast = asyncio.run(consume(0.0))
        slow = asyncio.run(consume(0.05))
    finally:
        loop.stop()
    for outs in (fast, slow):
        assert [t for o in outs for t in o.token_ids] == want
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].completion_tokens == len(want)
    assert len(slow) < len(want) // 2  # 40 steps, a consumer at 20 reads a second: merged
    assert any(len(o.token_ids) > 1 for o in slow)
