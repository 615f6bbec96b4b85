"""Disaggregated backend: prefill on one actor, KV over UCX, decode on another, tokens
streamed back. Routing: prefix-cache affinity for prefill, least loaded decode.

When an actor dies mid-request, the stream moves to live (or restarted) actors: the tokens
already streamed become the new prompt's tail, marked as output (`Engine.add_request(resume=
...)`), so the client sees a pause, not an error. A request whose decode actor lacks KV room
waits in arrival order for at most `kv_wait_s` instead of being refused."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError

from engine import ResourceExhaustedError
from engine.block_manager import block_hash
from engine.prompt import PromptEncoder

log = logging.getLogger("tandem.router")
PROBE_TIMEOUT_S = 5.0  # a live actor answers `ping` at once, whatever its engine is doing
REVIVE_TIMEOUT_S = 300.0  # how long a moved stream waits for Ray to restart a role's last actor
REVIVE_POLL_S = 0.5  # between pings of a restarting actor (it refuses calls until it is back)
KV_RETRY_S = 0.25  # a KV wait tries again this often even when no request ended here


class DisaggBackend:
    """Orchestrates one request across a prefill actor and a decode actor (Ray handles).
    `resume_attempts`: how many times one stream may move after a worker died (0: never);
    `kv_wait_s`: how long a request waits for KV room on its decode actor."""

    def __init__(self, prefills: list, decodes: list, encoder: PromptEncoder, info: dict,
                 resume_attempts: int = 3, kv_wait_s: float = 120.0):
        self.prefills, self.decodes, self.encoder, self._info = prefills, decodes, encoder, info
        self.resume_attempts, self.kv_wait_s = resume_attempts, kv_wait_s
        self._kv_queues: dict[int, deque] = {}  # decode actor -> requests waiting for KV room
        self._kv_freed: dict[int, asyncio.Event] = {}  # set (and replaced) when room may be free
        self.load = {id(d): 0 for d in decodes}
        self._rr = itertools.count()
        self._addr: dict[int, dict] = {}
        # Actors found dead -> an event set once they are back (they leave this map) or are
        # gone for good (no restarts left: they stay, so waiters wake and calls fail fast).
        self._down: dict[int, asyncio.Event] = {}
        self._watches: dict[int, asyncio.Future] = {}  # decode actor -> its pending `watch`
        self.resumes = 0  # streams moved off a worker that died
        self.metrics = None  # the router's Metrics, for tandem_stream_resumes_total

    def encode(self, prompt) -> list[int]:
        return self.encoder(prompt)

    @property
    def kv_waiting(self) -> int:
        """Requests waiting for KV room on a decode actor."""
        return sum(len(q) for q in self._kv_queues.values())

    def info(self) -> dict:
        return self._info

    def pick_prefill(self, ids: list[int]):
        """Same first block → same prefill actor, so its prefix cache serves the repeat."""
        pool = self._live(self.prefills)
        bs = self.encoder.block_size
        if len(ids) <= bs:
            return pool[next(self._rr) % len(pool)]
        key = int.from_bytes(block_hash(b"", ids[:bs])[:4], "little")
        return pool[key % len(pool)]

    def pick_decode(self):
        return min(self._live(self.decodes), key=lambda d: self.load[id(d)])

    def _live(self, actors: list) -> list:
        """The actors not found dead; all of them when none is left (calls then wait for Ray
        to restart one)."""
        return [a for a in actors if id(a) not in self._down] or actors

    async def generate(self, rid: str, ids: list[int], params, spec_cap=None,
                       resume: tuple[int, int] | None = None) -> AsyncIterator:
        """`resume=(n, chars)`: the last n ids are output a broken call already streamed,
        with the first `chars` characters of their text (a client's continuation)."""
        made: list[int] = []  # tokens streamed so far, across attempts (and calls)
        chars = 0  # characters of text streamed so far
        if resume is not None:
            n, chars = resume
            ids, made = ids[:len(ids) - n], ids[len(ids) - n:]
        accepted = 0  # draft tokens accepted by the attempts before this one
        cached = 0  # prompt tokens the first attempt found in the prefix cache
        for attempt in itertools.count():
            arid = rid if attempt == 0 else f"{rid}#{attempt}"  # the old one may linger
            resume = (len(made), chars) if made else None
            if attempt:  # a role whose every actor died waits for Ray to restart one
                await self._some_alive(self.prefills)
                await self._some_alive(self.decodes)
            p, d = self.pick_prefill(ids), self.pick_decode()
            last = None
            try:
                async for out in self._attempt(arid, ids + made, params, spec_cap, p, d, resume):
                    made += out.token_ids
                    chars += len(out.text)
                    last = out
                    if not attempt:
                        cached = max(cached, out.cached_tokens)
                    else:
                        out = dataclasses.replace(out, request_id=rid, cached_tokens=cached,
                                                  accepted_tokens=accepted + out.accepted_tokens)
                    yield out
                return
            except Exception as e:
                if attempt >= self.resume_attempts or not await self._lost(p, d, e):
                    raise
                if last is not None:
                    accepted += last.accepted_tokens
                self.resumes += 1
                if self.metrics is not None:
                    self.metrics.resumes.inc()
                log.warning("request %s: a worker died (%s: %s); moving it with %d tokens "
                            "streamed", rid, type(e).__name__, e, len(made))

    async def _attempt(self, rid: str, ids: list[int], params, spec_cap, p, d,
                       resume: tuple[int, int] | None) -> AsyncIterator:
        """One try at a request on prefill actor `p` and decode actor `d`."""
        self.load[id(d)] += 1
        finished = False
        try:
            if id(d) not in self._addr:
                self._addr[id(d)] = await d.address.remote()
            dst = await self._reserve(d, rid, len(ids))
            steps = p.prefill.options(num_returns="streaming").remote(
                rid, ids, params, spec_cap, self._addr[id(d)], dst, resume)
            first = await (await steps.__anext__())
            yield first  # before the KV moves: TTFT is prefill time only
            if first.finished:  # done at its first token: no KV will come
                finished = True
                d.cancel.remote(rid)
                return
            # The decode actor may die while the KV moves: then the transfer would only fail
            # at its timeout. Its watch fails at once. The hand-off comes sealed and goes on
            # unread (it holds tensors: reading them would load torch here).
            handoff = await self._unless_dead(d, self._next(steps))
            async for ref in d.generate.options(num_returns="streaming").remote(handoff):
                out = await ref
                yield out
                finished = out.finished
        finally:
            self.load[id(d)] -= 1
            if not finished:  # cancelled or failed: free blocks on both sides
                asyncio.ensure_future(self._cancel(p, d, rid))
            else:
                self._room(d)

    async def _reserve(self, d, rid: str, n: int) -> list[int]:
        """Blocks on `d` for `n` tokens of KV; while it has no room, wait behind the requests
        that came first until one there ends (RESOURCE_EXHAUSTED after `kv_wait_s`)."""
        queue = self._kv_queues.setdefault(id(d), deque())
        if not queue:
            try:
                return await d.reserve.remote(rid, n)
            except ResourceExhaustedError:
                pass
        turn, t0 = object(), time.monotonic()
        queue.append(turn)
        try:
            while True:
                freed = self._kv_freed.setdefault(id(d), asyncio.Event())
                left = self.kv_wait_s - (time.monotonic() - t0)
                if left <= 0:
                    raise ResourceExhaustedError(f"waited {self.kv_wait_s:g} s for KV room on "
                                                 "a decode worker; retry later")
                wake = asyncio.ensure_future(freed.wait())
                try:
                    await asyncio.wait([wake], timeout=min(left, KV_RETRY_S))
                finally:
                    wake.cancel()
                if queue[0] is turn:
                    try:
                        dst = await d.reserve.remote(rid, n)
                        break
                    except ResourceExhaustedError:
                        pass
        finally:
            queue.remove(turn)
            self._room(d)  # the next in line may try now
        if self.metrics is not None:
            self.metrics.queue_seconds.observe(time.monotonic() - t0)
        return dst

    def _room(self, d) -> None:
        """Wake the requests waiting for KV room on `d`."""
        freed = self._kv_freed.pop(id(d), None)
        if freed is not None:
            freed.set()

    @staticmethod
    async def _next(steps):
        return await (await steps.__anext__())

    async def _unless_dead(self, actor, coro):
        """`coro`'s result, or RayActorError as soon as `actor` dies."""
        task = asyncio.ensure_future(coro)
        # Read by nobody when this request is cancelled meanwhile: its end is consumed here.
        task.add_done_callback(lambda f: f.cancelled() or f.exception())
        watch = self._watches.get(id(actor))
        if watch is None or watch.done():
            watch = self._watches[id(actor)] = asyncio.ensure_future(actor.watch.remote())
            # Its failure is read here, or by nobody when no request was waiting on it.
            watch.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the request went: so does the step it waited for
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            watch.result()  # raises: the actor died
        return task.result()

    async def _lost(self, p, d, error: Exception) -> bool:
        """Whether the attempt failed because one of its actors died or is restarting: the one the
        error names, and each that does not answer a ping in time, is marked down until it answers.
        The named one is not pinged (a restarting actor holds the ping), so the stream moves at
        once."""
        named = getattr(error, "actor_id", None)
        dead = [a for a in (p, d) if named is not None and _actor_hex(a) == named]
        rest = [a for a in (p, d) if a not in dead]
        down = dead + [a for a, alive in zip(rest, await asyncio.gather(
            *(self._alive(a) for a in rest))) if not alive]
        for a in down:
            if id(a) not in self._down:
                self._down[id(a)] = asyncio.Event()
                self._addr.pop(id(a), None)  # a restarted decode actor has a new address
                asyncio.ensure_future(self._back(a))
        return bool(down) or isinstance(error, RayActorError)

    async def _some_alive(self, actors: list) -> None:
        """Until one of `actors` is not marked down (at most `REVIVE_TIMEOUT_S`; then the
        calls go to them anyway, and fail if they are still gone)."""
        events = [self._down.get(id(a)) for a in actors]
        if all(events):
            waits = [asyncio.ensure_future(e.wait()) for e in events]
            await asyncio.wait(waits, timeout=REVIVE_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()

    async def serving(self) -> bool:
        """Whether some actor of each role answers a ping (not while a role's every actor is
        dead, restarting, or gone with its Ray node)."""
        async def any_alive(actors: list) -> bool:
            return any(await asyncio.gather(*(self._alive(a) for a in actors)))
        return all(await asyncio.gather(any_alive(self.prefills), any_alive(self.decodes)))

    @staticmethod
    async def _alive(actor) -> bool:
        try:
            await asyncio.wait_for(actor.ping.remote(), PROBE_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - dead, restarting, or Ray itself unreachable
            return False

    async def _back(self, actor) -> None:
        """Clear `actor`'s down mark once it answers again (Ray restarted it: until then it
        refuses calls as unavailable); a permanently dead one stays marked."""
        while True:
            try:
                await actor.ping.remote()
                break
            except ActorUnavailableError:  # restarting
                await asyncio.sleep(REVIVE_POLL_S)
            except RayActorError:
                log.error("a worker died for good (no restarts left): %s", actor)
                self._down[id(actor)].set()
                return
        self._down.pop(id(actor)).set()  # its old address went when it was marked down

    async def _cancel(self, p, d, rid: str) -> None:
        """Prefill first: once it returns no transfer can still land in the decode side's
        reserved blocks, so freeing them cannot corrupt a later request. A dead actor has
        nothing left to free."""
        for actor in (p, d):
            try:
                await actor.cancel.remote(rid)
            except RayActorError:
                pass
        self._room(d)


def _actor_hex(actor) -> str | None:
    """The id of a Ray actor handle as Ray's errors name it (hex)."""
    aid = getattr(actor, "_actor_id", None)
    return aid.hex() if aid is not None else None
