"""What the router generates with. `LocalBackend`: one in-process engine (colocated mode)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine import Engine
from engine.loop import EngineLoop
from node_common.node import engine_info


class LocalBackend:
    """Colocated: tokenizes with the engine's tokenizer, generates on its engine thread.
    `engine` built already, or `make`, a function that builds it, run on that thread
    (`EngineLoop`: serving builds there)."""

    def __init__(self, engine: Engine | None = None, chat_special_tokens: bool = False,
                 make: Callable[[], Engine] | None = None):
        self.loop = EngineLoop(engine, make=make)
        self.loop.start()
        self.engine = self.loop.engine
        self.encoder = dataclasses.replace(self.engine.prompt_encoder(),
                                           chat_special_tokens=chat_special_tokens)

    def encode(self, prompt) -> list[int]:
        return self.encoder(prompt)

    def generate(self, rid, ids, params, spec_cap=None, resume=None):
        """`resume=(n, chars)`: the last n ids are output a broken call already streamed,
        with the first `chars` characters of their text (`Engine.add_request`)."""
        return self.loop.generate(rid, ids, params, spec_cap, resume=resume)

    def info(self) -> dict:
        return engine_info(self.engine)

    def watch(self, metrics) -> None:
        """Export the engine on `metrics` (an `engine.metrics.Metrics`, the router's in one
        process): its gauges at scrape time, its step and speculation counters after each
        step."""
        metrics.watch_engine(self.engine)
        self.loop.on_step = metrics.engine_step

    def close(self) -> None:
        self.loop.stop()
