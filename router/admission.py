"""Admission: requests beyond what runs at once wait their turn instead of being refused.

At most `max_running` run; up to `max_queued` more wait FIFO for at most `max_wait_s`; one
client holds at most `per_client` running or queued (0: no cap). RESOURCE_EXHAUSTED only when
the queue is full, the wait ran out, or the client is at its cap."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine import ResourceExhaustedError


class Admission:
    def __init__(self, max_running: int, max_queued: int = 1024, max_wait_s: float = 60.0,
                 per_client: int = 0):
        self.max_running, self.max_queued = max_running, max_queued
        self.max_wait_s, self.per_client = max_wait_s, per_client
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._clients: dict[str, int] = {}  # client -> requests running or queued

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def room(self) -> int:
        """The most requests one client can have running or queued at once."""
        most = self.max_running + self.max_queued
        return min(most, self.per_client) if self.per_client else most

    @asynccontextmanager
    async def slot(self, client: str = "") -> AsyncIterator[float]:
        """Hold a running slot for the body; yields the seconds spent waiting for it."""
        held = self._clients.get(client, 0)
        if self.per_client and held >= self.per_client:
            raise ResourceExhaustedError(f"this client has {held} requests in flight; the "
                                         f"limit is {self.per_client}")
        self._clients[client] = held + 1
        try:
            t0 = time.monotonic()
            await self._acquire()
            try:
                yield time.monotonic() - t0
            finally:
                self._release()
        finally:
            self._clients[client] -= 1
            if not self._clients[client]:
                del self._clients[client]

    async def _acquire(self) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise ResourceExhaustedError(f"the queue is full ({self.max_queued} requests "
                                         "waiting); retry later")
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await asyncio.wait({turn}, timeout=self.max_wait_s)
        except asyncio.CancelledError:  # the caller left: leave the queue, or pass the slot on
            self._leave(turn)
            raise
        if not turn.done():
            self._leave(turn)
            raise ResourceExhaustedError(f"waited {self.max_wait_s:g} s in the queue; retry "
                                         "later")

    def _leave(self, turn: asyncio.Future) -> None:
        if turn.done():
            self._release()
        else:
            self._waiters.remove(turn)
            turn.cancel()

    def _release(self) -> None:
        """Hand the slot to the longest waiter, or free it."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
