"""`DisaggBackend` when workers die, on in-process stand-ins for the Ray actor handles (the
real thing: tests/cluster_e2e/test_disaggregated.py kills real actors). Which errors move a
stream, where it moves, and what the moved attempt is asked to do."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402

from engine import InvalidRequestError  # noqa: E402
from engine.output import RequestOutput  # noqa: E402
from router import disagg  # noqa: E402
from router.disagg import DisaggBackend  # noqa: E402


class Method:
    """`handle.method`: `.remote(...)` gives an awaitable (a ref), or with
    `options(num_returns="streaming")` an async iterator of refs."""

    def __init__(self, fn):
        self.fn, self.streaming = fn, False

    def options(self, **kw):
        m = Method(self.fn)
        m.streaming = kw.get("num_returns") == "streaming"
        return m

    def remote(self, *args):
        if self.streaming:
            return _Refs(self.fn(*args))
        return asyncio.ensure_future(self.fn(*args))


class _Refs:
    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.agen.__anext__()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(item)
        return fut


class Actor:
    """A node actor: `dead` makes every call fail as Ray's would (`gone`: for good)."""

    def __init__(self, name: str):
        self.name, self.dead, self.gone, self.calls = name, False, False, []
        for m in ("ping", "watch", "address", "reserve", "prefill", "generate", "cancel"):
            setattr(self, m, Method(getattr(self, "_" + m)))

    def _check(self):
        if self.gone:
            raise ActorDiedError()
        if self.dead:
            raise ActorUnavailableError("restarting", None)

    async def _ping(self):
        self._check()
        return True

    async def _watch(self):
        while True:
            self._check()
            await asyncio.sleep(0.01)

    async def _address(self):
        self._check()
        return {"actor": self.name}

    async def _reserve(self, rid, n):
        self._check()
        return list(range(n))

    async def _cancel(self, rid):
        self._check()

    async def _prefill(self, rid, ids, params, cap, address, dst, resume):
        self._check()
        self.calls.append(("prefill", rid, list(ids), resume))
        if ids == [666]:
            raise InvalidRequestError("bad prompt")
        yield RequestOutput(rid, [100 + len(ids)], f"<{len(ids)}>", prompt_tokens=len(ids))
        yield {"rid": rid, "n": len(ids)}  # the hand-off

    async def _generate(self, handoff):
        self._check()
        self.calls.append(("generate", handoff["rid"]))
        n = handoff["n"]
        for i in range(1, 4):
            if self.dead:
                raise ActorDiedError()
            await asyncio.sleep(0.01)
            yield RequestOutput(handoff["rid"], [100 + n + i], f"<{n + i}>",
                                finished=i == 3 and n >= 4, accepted_tokens=i)
        if n < 4:  # the first attempt dies here, once its outputs are out
            self.dead = True
            raise ActorDiedError()


def backend(prefills, decodes, **kw) -> DisaggBackend:
    class Enc:
        block_size = 16
    return DisaggBackend(prefills, decodes, Enc(), {}, **kw)


def run(b: DisaggBackend, ids, revive=None):
    async def go():
        if revive is not None:
            asyncio.get_running_loop().call_later(0.2, revive)
        return [o async for o in b.generate("r", ids, params=None)]
    return asyncio.run(go())


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(disagg, "PROBE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(disagg, "REVIVE_POLL_S", 0.02)


def test_a_stream_moves_to_the_restarted_decode_actor_and_goes_on():
    p, d = Actor("p"), Actor("d")
    b = backend([p], [d])

    def revive():
        d.dead = False
    outs = run(b, [1, 2, 3], revive)
    # 1 token from the prefill, 3 from the decode, then it died: 4 streamed; the moved
    # attempt prefills the prompt + those 4 with resume=(4 tokens, their characters).
    first_texts = "".join(o.text for o in outs[:4])
    assert p.calls[1] == ("prefill", "r#1", [1, 2, 3, 103, 104, 105, 106],
                          (4, len(first_texts)))
    assert [t for o in outs for t in o.token_ids] == [103, 104, 105, 106, 107, 108, 109, 110]
    assert outs[-1].finished and all(o.request_id == "r" for o in outs)
    # usage across the move: draft tokens accepted before it, and after
    assert outs[-1].accepted_tokens == 3 + 3
    assert b.resumes == 1 and not b._down


def test_a_stream_moves_to_another_live_decode_actor_at_once():
    p, d1, d2 = Actor("p"), Actor("d1"), Actor("d2")
    b = backend([p], [d1, d2])
    outs = run(b, [1, 2, 3])
    assert outs[-1].finished
    assert [c for c in d2.calls if c[0] == "generate"] == [("generate", "r#1")]
    assert id(d1) in b._down  # still restarting: no new request goes to it


def test_errors_that_are_not_a_death_are_not_retried():
    b = backend([Actor("p")], [Actor("d")])
    with pytest.raises(InvalidRequestError, match="bad prompt"):
        run(b, [666])
    assert b.resumes == 0


def test_no_moves_when_resumes_are_off_or_spent():
    b = backend([Actor("p")], [Actor("d")], resume_attempts=0)
    with pytest.raises(ActorDiedError):
        run(b, [1, 2, 3])


def test_an_actor_gone_for_good_stays_down_and_the_stream_fails_fast():
    p, d = Actor("p"), Actor("d")
    d.gone = True
    b = backend([p], [d])
    with pytest.raises(ActorDiedError):
        asyncio.run(asyncio.wait_for(_collect(b), 5))  # no 300 s wait for a revival
    assert id(d) in b._down and b._down[id(d)].is_set()


async def _collect(b):
    return [o async for o in b.generate("r", [1, 2, 3], params=None)]


def test_the_moved_output_keeps_the_first_attempts_cached_tokens():
    p, d = Actor("p"), Actor("d")
    b = backend([p], [d])
    real = p._prefill

    async def cached_prefill(rid, ids, *a):
        async for o in real(rid, ids, *a):
            yield dataclasses.replace(o, cached_tokens=2 if rid == "r" else 9) \
                if isinstance(o, RequestOutput) else o
    p.prefill = Method(cached_prefill)

    def revive():
        d.dead = False
    outs = run(b, [1, 2, 3], revive)
    assert [o.cached_tokens for o in outs][-4:] == [2, 2, 2, 2]


def test_a_clients_continuation_is_prefilled_as_output_and_moves_with_it():
    """A continuation (the server passes the prompt with the received tokens as its tail, and
    resume=(their count, their characters)): the first attempt is already a resumed one, and
    when its decode actor dies the move carries those tokens and the new ones together."""
    p, d = Actor("p"), Actor("d")
    b = backend([p], [d])

    async def go():
        asyncio.get_running_loop().call_later(0.2, lambda: setattr(d, "dead", False))
        return [o async for o in b.generate("r", [1, 50, 51], params=None, resume=(2, 7))]

    outs = asyncio.run(go())
    assert p.calls[0] == ("prefill", "r", [1, 50, 51], (2, 7))
    texts = "".join(o.text for o in outs[:4])
    assert p.calls[1] == ("prefill", "r#1", [1, 50, 51, 103, 104, 105, 106],
                          (6, 7 + len(texts)))
    assert outs[-1].finished and b.resumes == 1



class _Id:
    def __init__(self, name):
        self.name = name

    def hex(self):
        return self.name


@pytest.mark.parametrize("named", [True, False])
def test_the_actor_an_error_names_is_not_probed_and_the_stream_moves_at_once(monkeypatch,
                                                                             named):
    """Ray holds calls to a restarting actor until it is back: the decode actor the error
    names is marked down without a ping, so the stream moves to the live one at once (an
    error that names no actor waits for the ping's timeout: the control)."""
    monkeypatch.setattr(disagg, "PROBE_TIMEOUT_S", 1.0)
    p, d1, d2 = Actor("p"), Actor("d1"), Actor("d2")
    for a in (p, d1, d2):
        a._actor_id = _Id(a.name)
    real_generate, real_ping = d1._generate, d1._ping

    async def dies(handoff):
        async for out in real_generate(handoff):
            yield out
            d1.dead = True
            died = ActorDiedError()
            died.actor_id = "d1" if named else None
            raise died

    async def held_ping():  # as Ray holds a call to a restarting actor
        while d1.dead:
            await asyncio.sleep(0.01)
        return await real_ping()

    d1.generate, d1.ping = Method(dies), Method(held_ping)
    b = backend([p], [d1, d2])
    t0 = time.monotonic()
    outs = run(b, [1, 2, 3, 4])
    took = time.monotonic() - t0
    assert outs[-1].finished and id(d1) in b._down
    assert [c for c in d2.calls if c[0] == "generate"] == [("generate", "r#1")]
    assert took < 0.5 if named else took >= 1.0, took


def test_a_cancelled_request_cancels_the_prefill_step_it_waited_for():
    """The client goes while the router waits for the prefill's hand-off: that wait is
    cancelled too, not left to finish (or fail) unread."""

    async def scenario():
        started, ended = asyncio.Event(), []

        async def prefill_step():
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise

        class Decode:  # alive throughout: its watch never returns
            watch = Method(lambda: asyncio.sleep(3600))

        backend = object.__new__(DisaggBackend)
        backend._watches = {}
        waiting = asyncio.ensure_future(backend._unless_dead(Decode(), prefill_step()))
        await started.wait()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)
        backend._watches.popitem()[1].cancel()
        return list(ended)  # before asyncio.run cancels what is left

    assert asyncio.run(scenario()) == ["cancelled"]
