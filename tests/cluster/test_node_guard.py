"""A node's guard of its transport: dropped messages counted in its metrics, a receive loop
that died ends the process (Ray then restarts the actor)."""

from __future__ import annotations

import asyncio

from engine.metrics import Metrics
from node_common import node


class Transport:
    healthy, dropped_messages, failure = True, 0, None


class Node(node.Liveness):
    def __init__(self):
        self.transport, self.metrics = Transport(), Metrics("decode")


def _dropped(m: Metrics) -> float:
    return m.registry.get_sample_value("tandem_kv_dropped_messages_total", {"role": "decode"})


def test_the_guard_counts_drops_and_ends_the_process_when_a_loop_died(monkeypatch):
    exits = []
    monkeypatch.setattr(node, "GUARD_S", 0.01)
    monkeypatch.setattr(node.os, "_exit", exits.append)

    async def go():
        n = Node()
        n.guard_transport()
        n.transport.dropped_messages = 3
        await asyncio.sleep(0.1)
        assert _dropped(n.metrics) == 3 and exits == []  # alive: counted, no exit
        n.transport.dropped_messages = 5
        n.transport.healthy, n.transport.failure = False, "serve loop died"
        await asyncio.sleep(0.1)
        n._guard.cancel()
        assert _dropped(n.metrics) == 5 and exits and exits[0] == 70

    asyncio.run(go())
