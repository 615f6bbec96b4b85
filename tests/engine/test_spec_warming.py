"""A speculative engine warming (engine/warming.py): while its speculative graphs are pending
it decodes plainly (no drafts, no head work, output as without speculation); the pending
graphs are captured after a generate (its share, `plan`), in prepare_to_serve, or mid-call
once the plain work would have paid for them all, when speculation starts at once and the
requests holding KV the head skipped finish without drafts; with nothing pending, warming
ends where no request holds such KV. Off
CUDA nothing warms by itself: these tests force it with graph sets that stand in for the
speculative ones; tests/engine/test_gpu_engine.py checks the real path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import Engine, SamplingParams, jit_watch, warming, warmup
from engine.attention import triton_available
from engine.collector import unfreeze
from engine.config import SpecConfig
from engine.testing import random_head, tiny_engine
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 50 for j in range(5 + 3 * i)] * 2 for i in range(3)]


class StandIn:
    """Stands in for a speculative graph set: its captures are free and recorded."""

    buckets = (1, 2, 4, 8)

    def __init__(self):
        self.graphs: dict = {}
        self.order: list[int] = []

    def capture(self, b: int, q: int, long: bool = False) -> None:
        self.graphs[(b, q, long)] = None
        self.order.append(b)

    def keys(self) -> list:
        return [(self, (b, 2, False)) for b in reversed(self.buckets)]


@pytest.fixture(autouse=True)
def watch(monkeypatch):
    """A fresh JIT ready mark: the captures here run as start-up work, which sets it."""
    monkeypatch.setattr(jit_watch, "_warn_from", None)


@pytest.fixture(scope="module")
def base():
    """Three query heads on one KV head: the Triton case's interpreted attention and rotary
    launches run a program per KV head and per token's heads."""
    return tiny_engine(0, max_num_batched_tokens=64, num_heads=3, num_kv_heads=1)


@pytest.fixture(scope="module")
def ref(base):
    """The outputs of the engine without speculation."""
    return [c.token_ids for c in base.generate(PROMPTS, SP)]


def spec_engine(base: Engine, **kw) -> Engine:
    cfg = replace(base.config, spec=SpecConfig(num_tokens=3, dynamic=False), **kw)
    return Engine(cfg, weights_of=base, draft_head=random_head(base))


def head_calls(eng: Engine, monkeypatch) -> list[str]:
    """Every call that drafts or runs the head, by name."""
    calls = []
    spec = eng.spec
    for obj, name in ((spec, "propose"), (spec, "draft_from_hidden"),
                      (spec.drafter, "draft"), (spec.drafter, "chain")):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, real=real, name=name, **kw:
                            calls.append(name) or real(*a, **kw))
    return calls


def warm(eng: Engine, per_graph: float = 1e-9) -> StandIn:
    """Force `eng` into warming with a stand-in set's four graphs pending, captures measured
    at `per_graph` seconds each (default: next to free, so the first step's plain work pays
    for them all and the second step captures them; 1e3: none is ever worth capturing)."""
    s = StandIn()
    warming.begin(eng, s.keys())
    assert eng.warming is not None and len(eng.warming.pending) == 4
    cheap(eng, per_graph)
    return s


def cheap(eng: Engine, per_graph: float = 1e-9) -> None:
    """Price a warming engine's captures at `per_graph` seconds each from now on."""
    eng.warming.seconds, eng.warming.graphs = per_graph, 1


def verifies(completions) -> int:
    return sum(c.verify_steps for c in completions)


def test_a_warming_engine_decodes_plainly_then_speculates(base, ref, monkeypatch):
    """No draft and no head call while warming, output as without speculation; once the
    captures are worth it (here: made cheap), the next call's first step captures what is
    pending and the whole call speculates, with the same output."""
    eng = spec_engine(base)
    s = warm(eng, per_graph=1e3)
    assert eng.runner.plain_only  # short prefill chunks keep off the verify graphs
    calls = head_calls(eng, monkeypatch)
    first = eng.generate(PROMPTS, SP)
    assert calls == [] and verifies(first) == 0 and eng.spec.stats.verify_steps == 0
    assert [c.token_ids for c in first] == ref
    assert eng.warming is not None and s.order == []
    cheap(eng)
    second = eng.generate(PROMPTS, SP)
    assert eng.warming is None and sorted(s.order) == [1, 2, 4, 8]
    assert not eng.runner.plain_only
    assert [c.token_ids for c in second] == ref
    assert "propose" in calls and all(c.verify_steps for c in second)
    assert [c.token_ids for c in spec_engine(base).generate(PROMPTS, SP)] == ref
    eng.blocks.check_all_free()


def test_speculation_starts_mid_call_once_the_plain_work_pays_for_the_graphs(base, ref):
    """Cheap captures: the first step's plain work pays for them, so the second step captures
    them all and speculates. The request running since warming (its KV has positions the head
    skipped) finishes without drafts; one arriving after drafts; both as without
    speculation."""
    eng = spec_engine(base)
    s = warm(eng)
    old = eng.seqs[eng.add_request(PROMPTS[2], replace(SP, max_tokens=40))]
    eng.step()
    assert eng.warming is not None and old.block_table and s.order == []
    eng.step()
    assert eng.warming is None and sorted(s.order) == [1, 2, 4, 8] and old.max_draft == 0
    new = eng.seqs[eng.add_request(PROMPTS[0], SP)]
    while eng.has_unfinished():
        eng.step()
    assert old.num_verify_steps == 0 and old.output_ids[: len(ref[2])] == ref[2]
    assert new.num_verify_steps > 0 and new.output_ids == ref[0]
    eng.blocks.check_all_free()


def test_no_cost_model_step_while_warming(base, monkeypatch):
    """Plain steps while warming are not fed to dynamic K's cost model."""
    import engine.step as step

    eng = spec_engine(base)
    warm(eng, per_graph=1e3)  # nothing gets captured: the engine keeps warming
    timed = []
    monkeypatch.setattr(step, "time_step", lambda *a, **kw: timed.append(1))
    eng.generate(PROMPTS[:1], SP)
    assert eng.warming is not None and timed == []
    eng.warming = None  # the negative control: speculating, its steps are timed
    eng.generate(PROMPTS[:1], SP)
    assert timed


def test_warming_does_not_end_while_a_request_holds_kv(base, ref, monkeypatch):
    """A request stepped while warming has positions the head never saw: a generate ending
    beside it captures nothing and keeps warming; the next one ending idle ends it."""
    eng = spec_engine(base)
    s = warm(eng, per_graph=1e3)
    calls = head_calls(eng, monkeypatch)
    long = replace(SP, max_tokens=40)
    rid = eng.add_request(PROMPTS[2], long)
    for _ in range(3):
        eng.step()
    eng.generate(PROMPTS[:1], replace(SP, max_tokens=2))
    assert eng.warming is not None and s.order == [] and rid in eng.seqs
    seq = eng.seqs[rid]
    while eng.has_unfinished():
        eng.step()
    assert eng.warming is not None and calls == [] and seq.num_verify_steps == 0
    assert seq.output_ids[: len(ref[2])] == ref[2]
    eng.warming.pending = []  # all captured (as by prepare_to_serve beside the request)
    eng.step()  # no request holds KV: speculation from this step on
    assert eng.warming is None


def test_prepare_to_serve_ends_warming_on_an_idle_engine_only(base):
    """`prepare_to_serve` captures every pending graph; an engine holding a request keeps
    warming until its first step with none holding KV."""
    for busy in (False, True):
        eng = spec_engine(base)
        s = warm(eng, per_graph=1e3)
        eng.generate(PROMPTS[:1], SP)  # too short to capture any
        assert s.order == [] and eng.warming is not None
        if busy:
            eng.add_request(PROMPTS[1], SP)
            eng.step()
        try:
            eng.prepare_to_serve()
        finally:
            unfreeze()
        assert len(s.order) == 4 and (eng.warming is not None) == busy
        while eng.has_unfinished():
            eng.step()
        eng.step()  # the next step, with no request holding KV, speculates
        assert eng.warming is None
        out = eng.generate(PROMPTS, SP)
        assert verifies(out) > 0


def test_a_call_captures_its_share_and_the_buckets_it_ran_first(base, monkeypatch):
    """Where the plan allows one graph, the bucket the call's batches ran (3 sequences:
    bucket 4) goes first; the rest stay pending, and so does warming."""
    eng = spec_engine(base)
    s = warm(eng, per_graph=1e-9)
    monkeypatch.setattr(warming, "plan", lambda wall, per_graph, pending, credit: 1)
    eng.generate(PROMPTS, SP)
    assert s.order == [4] and eng.warming is not None
    assert [k[0] for _, k in eng.warming.pending] == [8, 2, 1]


def test_the_capture_plan():
    """All pending graphs where the call's plain work would have paid for them at
    EXPECTED_GAIN, else WARM_SHARE of its time plus what earlier calls left (or overspent)."""
    gain = 1 - 1 / warming.EXPECTED_GAIN
    assert warming.WARM_SHARE == 0.02 and warming.EXPECTED_GAIN > 1
    # 678 graphs at 35 ms: 23.7 s, paid for by 100 s of plain decoding at gain 1.5.
    assert warming.plan(100.0, 0.035, 678) == 678
    assert 678 * 0.035 < 100.0 * gain
    assert warming.plan(10.0, 0.05, 678) == 4  # 2% of 10 s: four graphs of 50 ms
    assert warming.plan(10.0, 0.05, 678, credit=0.52) == 14  # plus 0.52 s earned before
    assert warming.plan(10.0, 0.05, 678, credit=-0.5) == 0  # repaying an overrun
    assert warming.plan(10.0, 0.05, 3) == 3  # few enough to pay for themselves
    assert warming.plan(10.0, 0.05, 0) == 0
    assert warming.plan(0.0, 0.0, 5) == 0  # no work, no measured cost: nothing


def test_warming_ends_with_the_prefix_cache_dropped(base):
    """Blocks cached while warming hold no head KV: leaving warming forgets them, so a
    request after it prefills (and the head steps over) its whole prompt."""
    eng = spec_engine(base, enable_prefix_caching=True)
    warm(eng, per_graph=1e3)
    eng.generate(PROMPTS[2:], SP)
    assert eng.warming is not None and eng.blocks.by_hash
    cheap(eng)
    again = eng.generate(PROMPTS[2:], SP)[0]
    assert eng.warming is None
    assert again.cached_tokens == 0 and eng.generate(PROMPTS[2:], SP)[0].cached_tokens


def test_a_larger_generate_captures_its_plain_graphs_and_pends_the_rest(base):
    """While warming, a larger call's new buckets: their plain decoding graphs before its first
    step, their speculative ones added to the pending work."""
    eng = spec_engine(base)
    plain, spec = StandIn(), StandIn()
    eng.runner.graphs = plain  # the target's decode graphs: one query is plain decoding
    try:
        keys = [(plain, (b, q, False)) for b in (2, 1) for q in (2, 1)] + spec.keys()[2:]
        warming.begin(eng, keys)
        assert plain.order == [2, 1] and set(plain.graphs) == {(2, 1, False), (1, 1, False)}
        keys = [(plain, (b, q, False)) for b in (4, 2, 1) for q in (2, 1)] + spec.keys()[1:]
        warming.begin(eng, keys)  # what `prepare_on_first_use` does for a larger call
        assert plain.order == [2, 1, 4]
        assert {(id(g), k) for g, k in eng.warming.pending} == \
            {(id(g), k) for g, k in keys if g is spec or k[1] == 2}
    finally:
        eng.runner.graphs = None
        eng.warming = None


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the static-bucket path run eagerly on "
                    "the CPU; on a GPU tests/engine/test_gpu_engine.py")
def test_warming_steps_replay_the_decode_graphs_that_return_the_heads_inputs(base, ref):
    """Through the static-bucket (graph) path, run eagerly: while warming, greedy decodes run
    as `PlainSteps` over the target's graphs (which also return the head's layer inputs),
    none through the fused speculative step; after, the fused step; output unchanged."""
    eng = spec_engine(base, attention_backend="triton")
    k = eng.config.spec.num_tokens
    eng.runner.enable_graphs(8, range(1, k + 2), eng.spec.aux_layers)
    eng.spec.enable_graphs(8)
    keys = warmup.pending_graphs(eng, range(1, 4), long_context=False)
    warming.begin(eng, keys)
    assert all(k[1] == 1 for k in eng.runner.graphs.graphs) and eng.warming.pending
    assert not eng.spec.graphs.graphs
    cheap(eng, per_graph=1e3)
    # Half the tokens (each interpreted step runs every kernel): greedy, so ref's first half.
    sp, want = replace(SP, max_tokens=6), [r[:6] for r in ref]
    assert [c.token_ids for c in eng.generate(PROMPTS, sp)] == want
    assert eng.plain.fused_runs > 0 and eng.spec.fused_runs == 0
    cheap(eng)  # worth capturing now: the next call's first step does
    out = eng.generate(PROMPTS, sp)
    assert eng.warming is None
    assert [c.token_ids for c in out] == want and eng.spec.fused_runs > 0 and verifies(out) > 0
    eng.blocks.check_all_free()
