"""The engine thread's output streams: a consumer that falls behind gets what piled up merged
into one output, with the same tokens, text and finish as one output per step. An engine made
by the loop is made on its thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

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


def test_make_builds_the_engine_on_the_loop_thread_and_serves_from_it():
    made_on = []

    def make():
        made_on.append(threading.get_ident())
        return tiny_engine(0)

    loop = EngineLoop(make=make)
    loop.start()  # returns once made
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run():
        return [t async for out in loop.generate("m", [5, 9, 2, 7], params)
                for t in out.token_ids]

    try:
        assert made_on == [loop._thread.ident] != [threading.get_ident()]
        tokens = asyncio.run(run())
    finally:
        loop.stop()
    assert tokens == tiny_engine(0).generate([[5, 9, 2, 7]], params)[0].token_ids


def test_make_errors_reach_start_and_the_arguments_are_one_or_the_other():
    def make():
        raise RuntimeError("no weights here")

    loop = EngineLoop(make=make)
    with pytest.raises(RuntimeError, match="no weights here"):
        loop.start()
    loop._thread.join(timeout=10)
    assert not loop._thread.is_alive() and loop._stop.is_set()  # no loop without an engine
    with pytest.raises(ValueError, match="one of them"):
        EngineLoop()
    with pytest.raises(ValueError, match="one of them"):
        EngineLoop(tiny_engine(0), make=make)
