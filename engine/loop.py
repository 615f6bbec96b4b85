"""An engine on its own thread: requests in, outputs out to each caller's asyncio queue. Every
engine call goes through this thread. Colocated serving and both node kinds use it, and build
their engine on it too (`make`): a CPU engine's matrix products then all come from one thread.
GNU OpenMP gives each thread that runs a parallel region its own team of workers; with two
teams on the machine's cores (a build on the main thread, then steps on this one) the workers
sleep between products instead of spinning, and decode ran 1.5x slower."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable

from engine import Engine, SamplingParams
from engine.output import RequestOutput


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: a's tokens and text, then b's; the
    running counts and the finish state are b's."""
    return dataclasses.replace(b, token_ids=a.token_ids + b.token_ids, text=a.text + b.text)


class EngineLoop:
    """Owns the engine: only this thread calls into it after start()."""

    def __init__(self, engine: Engine | None = None, make: Callable[[], Engine] | None = None):
        """engine: one built already; or make: what builds it (and prepares it to serve), run
        on this loop's thread by `start`."""
        if (engine is None) == (make is None):
            raise ValueError("EngineLoop takes an engine or a make function, one of them")
        self.engine = engine
        self._make = make
        self._made: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.subs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.on_step = None  # optional callback(engine) after every step (metrics)

    def start(self) -> None:
        """Start the thread; with `make`, returns once the engine is made there (`engine`),
        raising what make raised."""
        self._thread.start()
        try:
            self._made.result()
        except BaseException:  # make failed, or the wait was interrupted: never serve after
            self._stop.set()
            raise

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("noop",))
        self._thread.join(timeout=10)

    async def generate(self, rid: str, ids: list[int] | None, params: SamplingParams | None,
                       spec_cap: int | None = None, hold: bool = False,
                       handoff=None, resume: tuple[int, int] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them, until it finishes (or, with
        hold=True, until its first token is out and its KV is held for a hand-off). `handoff`
        instead admits a request prefilled elsewhere; `resume` continues a moved one
        (`Engine.add_request`). Closing the iterator early cancels the request and frees its
        blocks."""
        q: asyncio.Queue = asyncio.Queue()
        self.subs[rid] = (asyncio.get_running_loop(), q)
        if handoff is not None:
            self.inbox.put(("call", lambda eng: eng.admit(handoff), None, rid))
        else:
            self.inbox.put(("add", rid, ids, params, spec_cap, hold, resume))
        done, pending = False, None
        try:
            while True:
                item, pending = (pending, None) if pending is not None else (await q.get(), None)
                if isinstance(item, BaseException):
                    raise item
                # A consumer that fell behind (a Ray stream, a slow client) gets what piled
                # up as one output: the same tokens and text, fewer messages to ship.
                while not (item.finished or item.handoff) and not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        pending = nxt
                        break
                    item = merge_outputs(item, nxt)
                yield item
                if item.finished or item.handoff:
                    done = True
                    return
        finally:
            self.subs.pop(rid, None)
            if not done:
                self.inbox.put(("abort", rid))

    async def call(self, fn: Callable):
        """Run fn(engine) on the engine thread; its result (or exception) comes back here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("call", fn, fut, None))
        return await asyncio.wrap_future(fut)

    def _main(self) -> None:
        if self._make is not None:
            try:
                self.engine = self._make()
            except BaseException as e:  # reaches `start`'s caller
                self._made.set_exception(e)
                return
        self._made.set_result(None)
        self._run()

    def _run(self) -> None:
        eng = self.engine
        # The engine's GPU is this thread's current device for everything it calls (a process
        # may see several GPUs: Triton launches and graph replays follow the current device).
        with eng.on_device():
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
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, cap, hold, resume = msg
            try:
                self.engine.add_request(ids, params, request_id=rid, hold=hold, max_draft=cap,
                                        resume=resume)
            except Exception as e:  # reaches the caller as its error, never kills the loop
                self._send(rid, e)
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "call":
            _, fn, fut, rid = msg
            try:
                result = fn(self.engine)
            except Exception as e:
                if fut is not None:
                    fut.set_exception(e)
                elif rid is not None:
                    self._send(rid, e)
                return
            if fut is not None:
                fut.set_result(result)

    def _send(self, rid: str, item) -> None:
        sub = self.subs.get(rid)
        if sub is not None:
            loop, q = sub
            loop.call_soon_threadsafe(q.put_nowait, item)
