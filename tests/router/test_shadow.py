"""The drift check (`router.shadow`): sampled greedy requests that speculated run again without
speculation off the request path; equal outputs count as matches, a different one is counted
and logged, and requests it cannot check are left alone."""

from __future__ import annotations

import asyncio
import logging
import time

from engine import SamplingParams
from engine.config import SpecConfig
from engine.metrics import Metrics
from engine.testing import tiny_engine
from router.backends import LocalBackend
from router.shadow import ShadowCheck
from tandem_client import Client
from tests.router.test_server import Served

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5, 9], [7, 7, 7, 8, 7, 7, 7]]


def _speculating():
    return tiny_engine(0, max_position=128, spec=SpecConfig(method="ngram", num_tokens=3))


def test_every_sampled_greedy_request_matches_its_plain_rerun():
    m = Metrics("router")
    s = Served(_speculating(), metrics=m, shadow_sample=1.0)
    try:
        with Client(s.target, retries=0) as c:
            for ids in PROMPTS:
                c.complete(token_ids=ids, temperature=0, max_tokens=12, ignore_eos=True)
                asyncio.run_coroutine_threadsafe(s.service.shadow.wait(), s.loop).result(60)
            # not checkable: sampled, or speculation turned off for the request
            c.complete(token_ids=PROMPTS[0], temperature=0.8, seed=1, max_tokens=6)
            c.complete(token_ids=PROMPTS[0], temperature=0, max_tokens=6, speculation="none")
        asyncio.run_coroutine_threadsafe(s.service.shadow.wait(), s.loop).result(60)
        assert s.service.shadow.counts == {"match": 3, "mismatch": 0, "skipped": 0,
                                           "failed": 0}
        text = m.exposition().decode()
        assert 'tandem_shadow_checks_total{outcome="match",role="router"} 3.0' in text
        s.engine.blocks.check_all_free()
    finally:
        s.close()


class Drifting(LocalBackend):
    """A backend whose runs without drafts end in another token: what drift looks like."""

    def generate(self, rid, ids, params, spec_cap=None, resume=None):
        inner = super().generate(rid, ids, params, spec_cap, resume=resume)
        if spec_cap != 0:
            return inner

        async def changed():
            async for out in inner:
                if out.finished:
                    out.token_ids = [*out.token_ids[:-1], out.token_ids[-1] + 1]
                yield out
        return changed()


def test_a_different_output_is_counted_and_logged(caplog):
    engine = _speculating()
    s = Served(engine, backend=Drifting(engine), shadow_sample=1.0)
    try:
        with caplog.at_level(logging.WARNING, "tandem.router"), Client(s.target) as c:
            c.complete(token_ids=PROMPTS[1], temperature=0, max_tokens=10, ignore_eos=True)
            asyncio.run_coroutine_threadsafe(s.service.shadow.wait(), s.loop).result(60)
        assert s.service.shadow.counts["mismatch"] == 1
        assert any("drift: request" in r.message and "differs from token 9" in r.message
                   for r in caplog.records), caplog.text
    finally:
        s.close()


def test_nothing_is_checked_without_speculation_or_when_off():
    plain = ShadowCheck(LocalBackend(tiny_engine(0)), 1.0)
    assert not plain.wants(SamplingParams(temperature=0), None, False)
    off = ShadowCheck(LocalBackend(_speculating()), 0.0)
    assert not off.wants(SamplingParams(temperature=0), None, False)
    on = ShadowCheck(LocalBackend(_speculating()), 0.5)
    assert on.wants(SamplingParams(temperature=0), None, False)
    assert not on.wants(SamplingParams(temperature=0), None, True)  # a continued stream
    assert not on.wants(SamplingParams(temperature=0), 0, False)  # drafts off for it
    for b in (plain, off, on):
        b.backend.close()


def test_a_colocated_router_exports_its_engines_steps_and_speculation():
    """`LocalBackend.watch`: one process, so the router's endpoint carries the engine's step and
    speculation counters as well as its gauges (they stayed at zero when only the gauges were
    watched)."""
    engine = _speculating()
    backend, m = LocalBackend(engine), Metrics("router")
    backend.watch(m)
    s = Served(engine, backend=backend, metrics=m)
    try:
        with Client(s.target, retries=0) as c:
            c.complete(token_ids=PROMPTS[1], temperature=0, max_tokens=12, ignore_eos=True)

        def total(text, name):
            return sum(float(ln.split()[-1]) for ln in text.splitlines()
                       if ln.startswith(name + "{"))

        # The loop thread records a step after sending its outputs: the last step's counts
        # may land just after the client has its answer.
        deadline = time.monotonic() + 30
        text = m.exposition().decode()
        while total(text, "tandem_engine_steps_total") < engine.stats.steps \
                and time.monotonic() < deadline:
            time.sleep(0.01)
            text = m.exposition().decode()
        steps = total(text, "tandem_engine_steps_total")
        drafted = total(text, "tandem_spec_drafted_tokens_total")
        assert steps == engine.stats.steps >= 1 and drafted >= 1, text
    finally:
        s.close()
