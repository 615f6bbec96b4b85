"""The drift check: a sample of finished greedy requests that speculated is rerun without
speculation, off every caller's path, and the outputs compared token for token; a mismatch is
counted (`tandem_shadow_checks_total{outcome="mismatch"}`) and logged. In fp32 any mismatch is
a bug; in bf16 on a GPU near-ties can flip, so the rate measures that drift."""

from __future__ import annotations

import asyncio
import logging
import random

from router.limits import clip

log = logging.getLogger("tandem.router")
OUTCOMES = ("match", "mismatch", "skipped", "failed")


class ShadowCheck:
    """Re-runs a `sample` share (0..1) of eligible requests on `backend` with no drafts. At most
    one re-run is in flight; a request drawn while one runs is counted `skipped`."""

    def __init__(self, backend, sample: float, metrics=None, seed: int | None = None):
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"the shadow sample must be in 0..1, got {sample}")
        self.backend, self.sample, self.metrics = backend, sample, metrics
        self._rng = random.Random(seed)
        self._task: asyncio.Task | None = None
        self.counts = dict.fromkeys(OUTCOMES, 0)

    def wants(self, params, spec_cap: int | None, resumed: bool) -> bool:
        """Whether a request of these settings can be checked at all: greedy, speculating, and
        whole (a continued stream's first part was made elsewhere)."""
        return (self.sample > 0 and not resumed and spec_cap != 0
                and (params.temperature == 0 or params.top_k == 1)
                and self.backend.info()["speculation"] != "none")

    def offer(self, eid: str, ids: list[int], params, tokens: list[int]) -> None:
        """A finished request of `wants`' kind: its prompt ids, settings and streamed tokens."""
        if self._rng.random() >= self.sample:
            return
        if self._task is not None and not self._task.done():
            self._count("skipped")
            return
        self._task = asyncio.ensure_future(self._run(eid, list(ids), params, list(tokens)))

    async def _run(self, eid: str, ids: list[int], params, tokens: list[int]) -> None:
        got: list[int] = []
        try:
            async for out in self.backend.generate(f"{eid}.shadow", ids, params, 0):
                got += out.token_ids
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed check is counted, never raised
            log.info("drift check of %s failed: %s", clip(eid, 80), clip(str(e), 200))
            self._count("failed")
            return
        if got == tokens:
            self._count("match")
            return
        at = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b),
                  min(len(got), len(tokens)))
        log.warning("drift: request %s streamed %d tokens with speculation; without it the "
                    "output differs from token %d (%s vs %s)", clip(eid, 80), len(tokens), at,
                    tokens[at:at + 4], got[at:at + 4])
        self._count("mismatch")

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.metrics is not None:
            self.metrics.series(self.metrics.shadow_checks, outcome).inc()

    async def wait(self) -> None:
        """Until the re-run in flight (if any) ends."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
