"""Colocated backend: one engine stepping on its own thread, requests in, outputs out to each
caller's asyncio queue. The baseline every disaggregated figure is compared against."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

from engine import Engine, SamplingParams
from engine.output import RequestOutput


class EngineLoop:
    """Owns the engine: only this thread calls into it after start()."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.subs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.on_step = None  # optional callback(engine) after every step (metrics)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("noop",))
        self._thread.join(timeout=10)

    async def generate(self, rid: str, ids: list[int], params: SamplingParams,
                       spec_cap: int | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; closing the iterator early
        cancels the request and frees its blocks."""
        q: asyncio.Queue = asyncio.Queue()
        self.subs[rid] = (asyncio.get_running_loop(), q)
        self.inbox.put(("add", rid, ids, params, spec_cap))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.subs.pop(rid, None)
            if not finished:
                self.inbox.put(("abort", rid))

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_unfinished())
            if not eng.has_unfinished():
                continue
            for out in eng.step():
                self._send(out.request_id, out)
            if self.on_step is not None:
                self.on_step(eng)

    def _drain(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if msg[0] == "add":
                _, rid, ids, params, cap = msg
                try:
                    self.engine.add_request(ids, params, request_id=rid, max_draft=cap)
                except Exception as e:  # reaches the caller as its error, never kills the loop
                    self._send(rid, e)
            elif msg[0] == "abort":
                self.engine.abort(msg[1])
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _send(self, rid: str, item) -> None:
        sub = self.subs.get(rid)
        if sub is not None:
            loop, q = sub
            loop.call_soon_threadsafe(q.put_nowait, item)
