"""No cold start through the Python API: the first `Engine.generate` prepares an engine that
has graphs to capture (once), `prepare_to_serve` is idempotent, and what start-up took and
what compiled after it reach the metrics (`tandem_ready_seconds`,
`tandem_jit_compiles_after_ready_total`)."""

from __future__ import annotations

import gc
import logging
import time

import pytest

from engine import SamplingParams, jit_watch, warmup
from engine.collector import unfreeze
from engine.metrics import Metrics
from tests.helpers import tiny_engine

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def watch(monkeypatch):
    """A fresh ready mark and compile count, as if the process had just started."""
    monkeypatch.setattr(jit_watch, "_warn_from", None)
    monkeypatch.setattr(jit_watch, "_after_ready", 0)
    monkeypatch.setattr(jit_watch, "_events", [])


def capture_counter(eng, monkeypatch) -> list[bool]:
    """Stand in for `capture_graphs` (no CUDA here): records each call, reports 3 graphs."""
    calls = []

    def capture(batch_sizes=None, progress=False, long_context=None):
        calls.append(progress)
        return 3

    monkeypatch.setattr(eng, "capture_graphs", capture)
    return calls


def test_the_first_generate_prepares_an_engine_with_graphs_once(watch, monkeypatch, caplog):
    """Graphs captured and compiles watched before the first batch; the collector is left
    alone (a script that drops the engine must get its memory back)."""
    eng = tiny_engine(0)
    calls = capture_counter(eng, monkeypatch)
    monkeypatch.setattr(warmup, "pending_graphs", lambda e, sizes=None: [("set", (1, 1, False))])
    frozen = gc.get_freeze_count()
    with caplog.at_level(logging.INFO, logger="engine.warmup"):
        first = eng.generate([[1, 2, 3]], PARAMS)
        assert calls == [False] and eng.ready is not None and jit_watch._warn_from is not None
        assert gc.get_freeze_count() == frozen
        ready = eng.ready
        second = eng.generate([[1, 2, 3]], PARAMS)
    assert calls == [False] and eng.ready is ready  # the second call prepared nothing
    assert first[0].token_ids == second[0].token_ids
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.warmup"]
    assert len(lines) == 1 and "3 CUDA graphs" in lines[0] and "first use" in lines[0]


def test_on_the_cpu_the_first_generate_only_marks_the_engine_ready(watch):
    """No graphs to capture: no collector freeze, but the JIT watch and the ready time are
    set, once."""
    eng = tiny_engine(0)
    frozen = gc.get_freeze_count()
    assert warmup.pending_graphs(eng) == [] and eng.ready is None
    eng.generate([[5, 6]], PARAMS)
    ready, mark = eng.ready, jit_watch._warn_from
    assert ready is not None and ready.graphs == 0 and mark is not None
    assert gc.get_freeze_count() == frozen
    eng.generate([[5, 6]], PARAMS)
    assert eng.ready is ready and jit_watch._warn_from == mark


def test_prepare_to_serve_is_idempotent(watch, monkeypatch):
    eng = tiny_engine(0)
    calls = capture_counter(eng, monkeypatch)
    try:
        assert eng.prepare_to_serve(progress=True) == 3
        ready = eng.ready
        assert eng.prepare_to_serve(progress=True) == 0 and calls == [True]
        assert gc.get_freeze_count() > 0
        eng.generate([[1, 2]], PARAMS)  # already prepared: generate prepares nothing either
    finally:
        unfreeze()
    assert calls == [True] and eng.ready is ready


def test_prepare_to_serve_runs_one_request_through_an_idle_engine(watch, monkeypatch):
    """The warm-up request: one short greedy request stepped to its end before ready (its
    blocks free after, nothing of it in a later step's outputs); an engine that already
    holds requests is not stepped for it, and a generate preparing itself runs none."""
    steps = []
    for busy in (False, True):
        eng = tiny_engine(0)
        real = eng.step
        monkeypatch.setattr(eng, "step", lambda real=real: steps.append(1) or real())
        rid = eng.add_request([5, 6, 7], PARAMS) if busy else None
        try:
            eng.prepare_to_serve()
        finally:
            unfreeze()
        if busy:  # untouched: its request still waits for the caller's steps
            assert steps == [] and eng.has_unfinished() and rid in eng.seqs
            while eng.has_unfinished():
                eng.step()
        else:
            assert len(steps) > 1 and not eng.has_unfinished()
            steps.clear()
        eng.blocks.check_all_free()
    fresh = tiny_engine(0)
    ran = []
    monkeypatch.setattr(warmup, "warm_request", lambda e: ran.append(e))
    fresh.generate([[5, 6]], PARAMS)
    assert ran == [] and fresh.ready is not None


def test_on_cuda_the_warm_up_prompt_is_one_whole_prefill_chunk():
    """A chunk past the captured prefill graphs runs eagerly with kernel variants of its own,
    so the warm-up prompt on CUDA is one whole chunk, within the context limit (less the
    output and the drafts' lookahead) and half the free KV blocks; never below the short
    prompt, which is all the CPU runs."""
    from types import SimpleNamespace as NS

    from engine.config import SpecConfig

    def eng(device="cuda:0", free=1000, spec=None, max_len=8192):
        cfg = NS(device=device, on_cuda=device.startswith("cuda"), block_size=16, spec=spec,
                 max_num_batched_tokens=2048, max_model_len=max_len)
        return NS(config=cfg, blocks=NS(num_free=free))

    short, out = warmup.WARM_PROMPT_TOKENS, warmup.WARM_OUTPUT_TOKENS
    assert warmup.warm_prompt_tokens(eng("cpu")) == short
    assert warmup.warm_prompt_tokens(eng()) == 2048
    assert warmup.warm_prompt_tokens(eng(spec=SpecConfig(num_tokens=5), max_len=1000)) == \
        1000 - out - 6
    assert warmup.warm_prompt_tokens(eng(free=41)) == 20 * 16 - out
    assert warmup.warm_prompt_tokens(eng(free=2)) == short


def test_the_warm_up_request_teaches_dynamic_k_nothing(watch):
    """Dynamic K starts the first real request as a fresh engine would: the warm-up's steps
    (first calls, mispriced) leave no step costs or verdicts behind, and the graph levels
    the runner set on the policy stay."""
    from dataclasses import replace

    from engine import Engine
    from engine.config import SpecConfig
    from engine.testing import random_head

    base = tiny_engine(0)
    cfg = replace(base.config, spec=SpecConfig(num_tokens=3))
    eng = Engine(cfg, weights_of=base, draft_head=random_head(base))
    pol = eng.spec.policy
    pol.levels = levels = ((1, 2, 4), (1, 3))
    steps = []
    real = eng.step
    eng.step = lambda: steps.append(pol.costs.knows_plain(1) or bool(pol.costs._plain)) or real()
    try:
        eng.prepare_to_serve()
    finally:
        unfreeze()
    assert any(steps) and eng.spec.stats.verify_steps > 0  # it ran, drafting, and learned
    assert eng.spec.policy is pol and pol.levels == levels
    assert not pol.costs.knows_plain(1) and not pol.costs._plain and not pol.batch_why


def ready_seconds(m: Metrics) -> float | None:
    return m.registry.get_sample_value("tandem_ready_seconds", {"role": m.role})


def test_time_to_ready_is_measured_from_the_build_and_exported(watch):
    started = time.perf_counter()
    eng = tiny_engine(0)
    m = Metrics("decode")
    m.watch_engine(eng)
    assert ready_seconds(m) is None  # not ready yet: no gauge
    try:
        eng.prepare_to_serve(started=started)
    finally:
        unfreeze()
    r = eng.ready
    assert r.load > 0 and r.total >= r.load + r.graphs
    assert ready_seconds(m) == r.total > 0
    text = str(r)
    assert text.startswith("ready in ") and "(load " in text and ", graphs " in text
    assert "tandem_ready_seconds" not in Metrics("router").exposition().decode()  # no engine


@pytest.fixture
def hooks(watch, monkeypatch):
    """Triton's JIT hooks with jit_watch's installed on them (called as Triton calls them)."""
    pytest.importorskip("triton")
    from triton import knobs

    rt = knobs.runtime
    monkeypatch.setattr(rt, "jit_cache_hook", None)
    monkeypatch.setattr(rt, "jit_post_compile_hook", None)
    monkeypatch.setattr(jit_watch, "_installed", False)
    assert jit_watch.install()
    return rt


def compile_(rt, name: str) -> None:
    from types import SimpleNamespace

    kw = dict(key="k", repr=name, fn=SimpleNamespace(name=name), compile={},
              is_manual_warmup=False, already_compiled=False)
    rt.jit_cache_hook(**kw)
    rt.jit_post_compile_hook(**kw)


def test_compiles_after_ready_are_counted_and_exported(hooks, caplog):
    m = Metrics("prefill")
    m.watch_engine(tiny_engine(0))
    count = lambda: m.registry.get_sample_value("tandem_jit_compiles_after_ready_total",
                                                {"role": "prefill"})
    compile_(hooks, "_at_start_up")
    assert jit_watch.after_ready() == 0 and count() == 0
    jit_watch.warn_after()
    with caplog.at_level(logging.WARNING, logger="engine.jit_watch"):
        compile_(hooks, "_while_serving")
    assert jit_watch.after_ready() == 1 and count() == 1
    assert ["_while_serving" in r.getMessage() for r in caplog.records] == [True]
    # Another engine of the process preparing: its compiles are start-up, not stalls.
    with jit_watch.starting_up():
        compile_(hooks, "_second_engine")
    assert jit_watch.after_ready() == 1 and jit_watch._warn_from is not None
    compile_(hooks, "_late")
    assert count() == 2


def test_an_error_while_starting_up_keeps_the_old_ready_mark(watch):
    jit_watch.warn_after(now=5.0)
    with pytest.raises(RuntimeError), jit_watch.starting_up():
        assert jit_watch._warn_from is None
        raise RuntimeError("capture failed")
    assert jit_watch._warn_from == 5.0
