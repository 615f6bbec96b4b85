"""`DisaggBackend` when a decode actor has no KV room yet: requests wait in arrival order and
complete, instead of being refused (stand-in actors from test_disagg_resume; the real cluster:
tests/cluster_e2e/test_disaggregated.py)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from engine import ResourceExhaustedError  # noqa: E402
from engine.output import RequestOutput  # noqa: E402
from tests.router.test_disagg_resume import Actor, backend  # noqa: E402


class SmallDecode(Actor):
    """A decode actor with KV room for `room` tokens; a request's room comes back when its
    stream ends or it is cancelled."""

    def __init__(self, room: int):
        super().__init__("d")
        self.room, self.held, self.started = room, {}, []

    async def _reserve(self, rid, n):
        if n > self.room:
            raise ResourceExhaustedError(f"no room for {n} tokens")
        self.room -= n
        self.held[rid] = n
        return list(range(n))

    async def _generate(self, handoff):
        rid = handoff["rid"]
        self.started.append(rid)
        for i in range(3):
            await asyncio.sleep(0.05)
            yield RequestOutput(rid, [i], "x", finished=i == 2)
        self.room += self.held.pop(rid)

    async def _cancel(self, rid):
        self.room += self.held.pop(rid, 0)


async def _one(b, rid, n):
    return [o async for o in b.generate(rid, [1] * n, params=None)]


def test_requests_wait_for_kv_room_in_arrival_order_and_complete():
    async def go():
        d = SmallDecode(room=10)
        b = backend([Actor("p")], [d])
        tasks = []
        for i, n in enumerate((8, 6, 2, 9)):  # only one fits at a time but the 2
            tasks.append(asyncio.ensure_future(_one(b, f"r{i}", n)))
            await asyncio.sleep(0.01)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(o[-1].finished for o in outs)
        # r2 fits beside r0 but arrived after r1, which waits: it waits too (first in,
        # first out), then runs beside r1.
        assert d.started == ["r0", "r1", "r2", "r3"] and d.room == 10
        assert b.kv_waiting == 0

    asyncio.run(go())


def test_a_wait_past_its_limit_is_resource_exhausted_and_leaves_the_queue():
    async def go():
        d = SmallDecode(room=10)
        b = backend([Actor("p")], [d], kv_wait_s=0.3)
        d.room = 0  # held by something that never ends
        with pytest.raises(ResourceExhaustedError, match="waited 0.3 s"):
            await _one(b, "late", 4)
        assert b.kv_waiting == 0 and d.held == {}

    asyncio.run(go())


def test_a_waiter_that_leaves_lets_the_next_one_in():
    async def go():
        d = SmallDecode(room=10)
        b = backend([Actor("p")], [d])
        first = asyncio.ensure_future(_one(b, "a", 9))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(_one(b, "b", 9))
        await asyncio.sleep(0.01)
        after = asyncio.ensure_future(_one(b, "c", 9))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.wait_for(asyncio.gather(first, after), 30)
        assert d.started == ["a", "c"] and d.room == 10 and b.kv_waiting == 0

    asyncio.run(go())
