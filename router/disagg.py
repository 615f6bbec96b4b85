"""Disaggregated backend: prefill on one actor, KV over UCX, decode on another, tokens
streamed back. Routing: prefix-cache affinity for prefill, least loaded decode."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from engine.block_manager import block_hash
from engine.prompt import PromptEncoder


class DisaggBackend:
    """Orchestrates one request across a prefill actor and a decode actor (Ray handles)."""

    def __init__(self, prefills: list, decodes: list, encoder: PromptEncoder, info: dict):
        self.prefills, self.decodes, self.encoder, self._info = prefills, decodes, encoder, info
        self.load = {id(d): 0 for d in decodes}
        self._rr = itertools.count()
        self._addr: dict[int, dict] = {}

    def encode(self, prompt) -> list[int]:
        return self.encoder(prompt)

    def info(self) -> dict:
        return self._info

    def pick_prefill(self, ids: list[int]):
        """Same first block → same prefill actor, so its prefix cache serves the repeat."""
        bs = self.encoder.block_size
        if len(ids) <= bs:
            return self.prefills[next(self._rr) % len(self.prefills)]
        key = int.from_bytes(block_hash(b"", ids[:bs])[:4], "little")
        return self.prefills[key % len(self.prefills)]

    def pick_decode(self):
        return min(self.decodes, key=lambda d: self.load[id(d)])

    async def generate(self, rid: str, ids: list[int], params, spec_cap=None
                       ) -> AsyncIterator:
        p, d = self.pick_prefill(ids), self.pick_decode()
        self.load[id(d)] += 1
        finished = False
        try:
            if id(d) not in self._addr:
                self._addr[id(d)] = await d.address.remote()
            dst = await d.reserve.remote(rid, len(ids))
            steps = p.prefill.options(num_returns="streaming").remote(
                rid, ids, params, spec_cap, self._addr[id(d)], dst)
            first = await (await steps.__anext__())
            yield first  # before the KV moves: TTFT is prefill time only
            if first.finished:  # done at its first token: no KV will come
                finished = True
                d.cancel.remote(rid)
                return
            handoff = await (await steps.__anext__())
            async for ref in d.generate.options(num_returns="streaming").remote(handoff):
                out = await ref
                yield out
                finished = out.finished
        finally:
            self.load[id(d)] -= 1
            if not finished:  # cancelled or failed: free blocks on both sides
                asyncio.ensure_future(self._cancel(p, d, rid))

    @staticmethod
    async def _cancel(p, d, rid: str) -> None:
        """Prefill first: once it returns no transfer can still land in the decode side's
        reserved blocks, so freeing them cannot corrupt a later request."""
        try:
            await p.cancel.remote(rid)
        finally:
            await d.cancel.remote(rid)
