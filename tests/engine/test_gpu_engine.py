"""GPU-only: the Triton backend with CUDA graphs against eager and against the torch backend,
on a SmolLM2-shaped random model with the shipped EAGLE-3 head (no checkpoint needed)."""

from __future__ import annotations

import pytest
import torch

from engine.testing import smol_shape

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def random_smol():
    from engine import Engine, EngineConfig

    torch.manual_seed(0)
    eng = Engine(EngineConfig(model=smol_shape(), dtype=torch.float32, device="cuda",
                              num_blocks=2048, attention_backend="torch", cuda_graphs=False))
    with torch.no_grad():
        for p in eng.model.parameters():
            p.normal_(0, 0.05)
    return eng


PROMPTS = [list(range(100 + 7 * i, 140 + 11 * i)) for i in range(6)]


def _greedy(eng, n=24):
    from engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [c.token_ids for c in eng.generate(PROMPTS, sp)]


def test_graphs_equal_eager_and_torch_backend(random_smol):
    ref = _greedy(random_smol)
    eager = _greedy(random_smol.with_config(attention_backend="triton", cuda_graphs=False))
    graphs = random_smol.with_config(attention_backend="triton", cuda_graphs=True)
    assert graphs.runner.graphs is not None
    out = _greedy(graphs)
    assert eager == ref
    assert out == ref
    assert graphs.runner.graphs.graphs, "no graph was replayed"
    assert graphs.plain.overlapped_runs > 0  # decode steps launched before the last was read


def test_precaptured_long_context_graphs_equal_torch_backend(random_smol):
    """Contexts past `long_context` on CUDA (one split) decode through the captured
    split-KV graphs. Captured all at once, up front, as nodes do: a graph must not keep reading
    per-forward state that its warm-up made outside it (freed with that forward's metadata
    and soon reused: an illegal address, or other tensors' bytes), so every output must
    equal the torch backend's."""
    from engine import SamplingParams
    from engine.attention.triton_backend import long_context

    start = long_context(torch.device("cuda"))
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(start - 8 + 40 * i)]
               for i in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [c.token_ids for c in random_smol.generate(prompts, sp)]
    graphs = random_smol.with_config(attention_backend="triton", cuda_graphs=True)
    assert graphs.capture_graphs(list(range(1, 9)), long_context=True) > 0
    # Small tensors of huge row-to-sequence indices, where freed ones would be handed out.
    junk = [torch.full((8 * (1 + i % 8),), 10**9, dtype=torch.int64, device="cuda")
            for i in range(4096)]
    out = [c.token_ids for c in graphs.generate(prompts, sp)]
    del junk
    assert any(long for (_, _, long) in graphs.runner.graphs.graphs)
    assert out == ref


def test_single_stream_prologue_linears_with_pdl_equal_torch_backend(random_smol):
    """One stream decodes through the prologue linears (norms and SiLU folded into the
    projections, every launch of a layer Triton, with programmatic dependent launch on a
    Hopper GPU) inside CUDA graphs: the same greedy tokens as the torch backend, fp32."""
    from engine import SamplingParams, ops
    from engine.attention.triton_backend import pdl_supported

    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = random_smol.generate([PROMPTS[0]], sp)[0].token_ids
    eng = random_smol.with_config(attention_backend="triton", cuda_graphs=True)
    # Calibrated at graph set-up: one row measured 2x faster per projection on the H200.
    timings = eng.model.prologue_calibration
    assert sorted(timings) == list(range(1, ops.CALIBRATE_MAX_ROWS + 1))
    assert all(pro > 0 and sep > 0 for pro, sep in timings.values())
    assert eng.model.prologue_rows == {m for m, (pro, sep) in timings.items() if pro < sep}
    assert 1 in eng.model.prologue_rows
    calls = []
    real = ops.prologue_linear
    ops.prologue_linear = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    try:
        out = eng.generate([PROMPTS[0]], sp)[0].token_ids
    finally:
        ops.prologue_linear = real
    assert out == ref
    assert calls and set(calls) == {1}  # captured into the batch-1 decode graph
    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_supported(torch.device("cuda"))


def test_spec_with_graphs_is_lossless_fp32(random_smol):
    from engine.config import SpecConfig

    ref = _greedy(random_smol)
    spec = random_smol.with_config(attention_backend="triton", cuda_graphs=True,
                                   spec=SpecConfig(num_tokens=4, dynamic=False))
    # Every bucket `_greedy` steps: an engine missing one warms (decodes plainly) at first.
    assert spec.capture_graphs(range(1, len(PROMPTS) + 1)) > 0
    assert _greedy(spec) == ref
    assert spec.spec.chain_graphs and any(g.graphs for g in spec.spec.chain_graphs.values())
    assert spec.spec.fused_runs > 0  # pure decode steps ran as one fused graph


def test_fused_step_is_lossless_with_dynamic_k_fp32(random_smol):
    from engine.config import SpecConfig

    ref = _greedy(random_smol)
    spec = random_smol.with_config(attention_backend="triton", cuda_graphs=True,
                                   spec=SpecConfig(num_tokens=6, dynamic=True))
    assert spec.capture_graphs(range(1, len(PROMPTS) + 1)) > 0
    pol = spec.spec.policy
    pol.costs.trace = []
    assert _greedy(spec) == ref
    assert spec.spec.fused_runs > 0 and spec.spec.overlapped_runs > 0
    spec.blocks.check_all_free()
    # A fused step at a drafting level no K runs alone (`paid`) verified one K's drafts and
    # proposed another's: the cost model is told it switched K, and keeps it out of the fit.
    pure = {pol.paid(k) for k in range(7)}
    drafting = [row for row in pol.costs.trace if row[1]]
    assert drafting and any(row[1] not in pure for row in drafting)
    assert all(row[4].endswith("switch") for row in drafting if row[1] not in pure)


def _staggered(eng, prompts, params, every=3) -> list[list[int]]:
    """Requests arriving one by one, one every `every` engine steps, while the others
    decode; their output tokens, in arrival order."""
    pending, seqs, n = list(zip(prompts, params)), [], 0
    while pending or eng.has_unfinished():
        if pending and n % every == 0:
            p, sp = pending.pop(0)
            seqs.append(eng.seqs[eng.add_request(p, sp)])
        eng.step()
        n += 1
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("spec", [None, (4, False), (6, True)], ids=["plain", "k4", "dynamic"])
def test_arrivals_prefilled_beside_the_step_in_flight_are_lossless(random_smol, spec):
    """Arrivals are prefilled beside the decode step in flight (launched before its
    continuation, never through the decode graphs whose outputs the continuation reads) and
    join the step after it with host-packed rows: without speculation, at a fixed K (those
    rows beside rows continued on the device) and with dynamic K. Output equals the
    torch backend's; the last request repeats the first prompt (a prefix-cache hit)."""
    from engine import SamplingParams
    from engine.config import SpecConfig

    prompts = PROMPTS + [PROMPTS[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = [c.token_ids for c in random_smol.generate(prompts, params)]
    kw = {} if spec is None else {"spec": SpecConfig(num_tokens=spec[0], dynamic=spec[1])}
    eng = random_smol.with_config(attention_backend="triton", cuda_graphs=True,
                                  admission_delay_steps=0, enable_prefix_caching=True, **kw)
    # Captured up front as a server does: the fused graphs last, so their outputs may sit
    # in memory the head's prefill graphs use as scratch (what `protect` guards against;
    # not seen to happen here: this test passes without it too).
    assert eng.capture_graphs(range(1, len(prompts) + 1)) > 0
    assert _staggered(eng, prompts, params) == ref
    assert eng.admitted_in_flight >= 3 and eng.pipe.joined_runs > 0
    assert eng.overlap.inflight is None and not eng.overlap.deferred
    eng.blocks.check_all_free()


def test_continuations_compile_nothing_after_capture(random_smol):
    """The one-launch continuation kernel is compiled for every variant at capture: steps of
    changing batch size, K and rows (requests finishing apart drop out of the next launch)
    compile nothing more, and output stays lossless."""
    from engine import SamplingParams
    from engine.config import SpecConfig
    from engine.spec.fused_kernels import compiled_continuations

    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    ref = [c.token_ids for c in random_smol.generate(PROMPTS, params)]
    spec = random_smol.with_config(attention_backend="triton", cuda_graphs=True,
                                   spec=SpecConfig(num_tokens=4, dynamic=False))
    spec.capture_graphs(range(1, len(PROMPTS) + 1))
    warmed = compiled_continuations()
    assert warmed > 0
    assert [c.token_ids for c in spec.generate(PROMPTS, params)] == ref
    assert spec.spec.compacted_runs > 0 and spec.spec.overlapped_runs > 0
    assert compiled_continuations() == warmed
    spec.blocks.check_all_free()


def test_graph_drafts_equal_eager_drafts(random_smol):
    """Step two engines in lockstep (graphs on / off) and compare every draft: a graph output
    overwritten by a later replay (or a bucket change mid-chain) would show up here, even
    though verification keeps the output itself lossless."""
    from engine import SamplingParams
    from engine.config import SpecConfig

    spec = SpecConfig(num_tokens=4, dynamic=False, fused_step=False)  # the step-by-step graphs
    a = random_smol.with_config(attention_backend="triton", cuda_graphs=True, spec=spec)
    b = random_smol.with_config(attention_backend="triton", cuda_graphs=False, spec=spec,
                                num_blocks=a.num_blocks)
    for eng in (a, b):
        for i, p in enumerate(PROMPTS):
            n = 8 + 5 * i  # different lengths: sequences drop out and the buckets shrink
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            request_id=f"r{i}")
    compared = 0
    while a.has_unfinished():
        a.step()
        b.step()
        for rid, s in a.seqs.items():
            assert s.draft == b.seqs[rid].draft, f"{rid} at {len(s.token_ids)}"
            compared += bool(s.draft)
    assert compared > 20 and not b.has_unfinished()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_engines_on_two_gpus_in_one_process_capture_on_their_own_device():
    """A second engine on cuda:1 captures after one on cuda:0 has (the colocated-then-
    disaggregated order of figure 5): its graphs must be captured on a cuda:1 stream, and it
    decodes exactly what the cuda:0 engine does."""
    from engine import Engine, EngineConfig, SamplingParams

    cfg = EngineConfig(model=smol_shape(num_layers=4), dtype=torch.float32, device="cuda:0",
                       num_blocks=256, attention_backend="triton")
    torch.manual_seed(1)
    a = Engine(cfg)
    with torch.no_grad():
        for p in a.model.parameters():
            p.normal_(0, 0.05)
    from dataclasses import replace

    b = Engine(replace(cfg, device="cuda:1"))
    b.model.load_state_dict(a.model.state_dict())
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert a.capture_graphs([1, 2]) > 0
    outs_a = [c.token_ids for c in a.generate(PROMPTS[:2], sp)]
    assert b.capture_graphs([1, 2]) > 0
    outs_b = [c.token_ids for c in b.generate(PROMPTS[:2], sp)]
    assert outs_a == outs_b
    assert all(g is not None for g, _ in b.runner.graphs.graphs.values())


def test_large_projections_are_tuned_at_graph_set_up_and_serve():
    """A model with projections too large for the prologue linears: graph set-up times our
    GEMV and tensor-core tiles against cuBLAS per weight shape (`tune_large_linears`), each
    choice is recorded with its timings, and the engine then generates with the graphs
    (every block back afterwards)."""
    from engine import Engine, EngineConfig, SamplingParams, ops

    torch.manual_seed(0)
    cfg = smol_shape(hidden_size=1024, intermediate_size=8192, num_layers=4, num_heads=16,
                     num_kv_heads=4, vocab_size=8192, tie_word_embeddings=False)
    eng = Engine(EngineConfig(model=cfg, dtype=torch.bfloat16, device="cuda", num_blocks=256,
                              attention_backend="triton", cuda_graphs=True))
    with torch.no_grad():
        for p in eng.model.parameters():
            p.normal_(0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    eng.runner.enable_graphs(4, (1,), ())
    tuned = eng.model.large_linear_tuning
    assert tuned is not None and set(tuned) == {"gate_up", "down", "lm_head"}
    for name, t in tuned.items():
        assert "cublas" in t["one_us"] and "cublas" in t["rows_us"], name
    if tuned["gate_up"]["one"] is not None:  # then gate_up + SiLU was timed both ways too
        assert "gemv+silu_mul" in tuned["gate_up"]["silu_us"]
        assert ops.LARGE_LINEAR[ops.large_key(eng.model.lm_head.weight)]["one"] == \
            tuned["lm_head"]["one"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = eng.generate(PROMPTS[:3], sp)
    assert [len(o.token_ids) for o in outs] == [12] * 3
    eng.blocks.check_all_free()


def test_context_drafts_on_the_device_equal_the_host_path(random_smol):
    """`SpecConfig.context_drafts`: the fused step's graphs look drafts up in the token store
    (Triton) and the step-by-step path on the host (`NgramDrafter`); in lockstep every draft
    is the same, some come from the context, and output equals plain decoding."""
    from dataclasses import replace

    from engine import SamplingParams
    from engine.config import SpecConfig
    from engine.spec.ngram import ngram_search

    prompts = [p[:12] * 3 for p in PROMPTS]  # suffixes with earlier copies
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = [c.token_ids for c in random_smol.generate(prompts, params)]
    spec = SpecConfig(num_tokens=4, dynamic=False, context_drafts=True)
    a = random_smol.with_config(attention_backend="triton", cuda_graphs=True, spec=spec)
    b = random_smol.with_config(attention_backend="triton", cuda_graphs=True,
                                spec=replace(spec, fused_step=False),
                                num_blocks=a.num_blocks)
    assert a.token_store is not None and a.spec.fused is not None and b.spec.fused is None
    rids = [[e.add_request(p, sp) for e in (a, b)] for p, sp in zip(prompts, params)]
    seqs = [(a.seqs[x], b.seqs[y]) for x, y in rids]
    compared = from_context = 0
    while a.has_unfinished() or b.has_unfinished():
        a.step()
        b.step()
        for x, y in seqs:
            if x.token_ids != y.token_ids or len(x.draft) != len(y.draft):
                # The fused path chooses K a step ahead, so near max_tokens its caps may
                # differ; the drafts both made must still agree.
                continue
            assert x.draft == y.draft, f"at {len(x.token_ids)}"
            compared += bool(x.draft)
            from_context += bool(x.draft) and bool(ngram_search(x.token_ids, len(x.draft), 4, 3))
    assert a.spec.fused_runs > 0 and a.spec.overlapped_runs > 0
    assert compared > 20 and from_context > 5
    assert [x.output_ids for x, _ in seqs] == ref
    assert [y.output_ids for _, y in seqs] == ref
    a.blocks.check_all_free()


def test_generate_captures_the_buckets_of_its_batches_before_stepping(random_smol):
    """An unprepared engine's first call of one prompt captures the batch-1 graphs only; a
    call of six captures the buckets up to six, all before its first step; tokens as eager."""
    import engine.warmup as warmup
    from engine import SamplingParams
    from engine.graphs import GraphSet

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = [c.token_ids for c in random_smol.generate(PROMPTS, sp)]
    eng = random_smol.with_config(attention_backend="triton", cuda_graphs=True)
    in_steps = []
    real = eng.step

    def step():
        before = GraphSet.captures
        out = real()
        in_steps.append(GraphSet.captures - before)
        return out

    eng.step = step
    assert eng.generate([PROMPTS[0]], sp)[0].token_ids == ref[0]
    assert eng.prepared_for == 1 and not warmup.pending_graphs(eng, [1])
    assert warmup.pending_graphs(eng)  # the larger buckets wait for a larger call
    assert [c.token_ids for c in eng.generate(PROMPTS, sp)] == ref
    assert eng.prepared_for == len(PROMPTS)
    assert not warmup.pending_graphs(eng, range(1, len(PROMPTS) + 1))
    assert in_steps and not any(in_steps)


def test_a_speculative_engine_warms_through_its_first_generate(random_smol):
    """An unprepared EAGLE-3 engine's first call captures no speculative graph before its
    first step (the target's decode graphs at one query and its prefill graphs only), none
    inside a step, and makes no draft; `prepare_to_serve` captures everything pending, and
    the next call speculates. Tokens as without speculation throughout."""
    import engine.warmup as warmup
    from engine import SamplingParams
    from engine.collector import unfreeze
    from engine.config import SpecConfig
    from engine.graphs import GraphSet

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = [c.token_ids for c in random_smol.generate(PROMPTS, sp)]
    eng = random_smol.with_config(attention_backend="triton", cuda_graphs=True,
                                  spec=SpecConfig(num_tokens=4, dynamic=False))
    target = (eng.runner.graphs, eng.runner.prefill_graphs)
    spec_sets = [g for g in {id(g): g for g, _ in warmup.pending_graphs(eng)}.values()
                 if not any(g is t for t in target)]
    assert spec_sets and eng.spec.fused is not None
    in_steps, before_first = [], []
    real = eng.step

    def step():
        if not before_first:  # what the first step finds captured
            before_first.append((sum(len(g.graphs) for g in spec_sets),
                                 {q for _, q, _ in eng.runner.graphs.graphs}))
        n = GraphSet.captures
        out = real()
        in_steps.append(GraphSet.captures - n)
        return out

    eng.step = step
    first = eng.generate(PROMPTS, sp)
    assert before_first == [(0, {1})] and eng.runner.prefill_graphs.graphs
    assert [c.token_ids for c in first] == ref
    assert sum(c.verify_steps for c in first) == 0 and eng.spec.stats.verify_steps == 0
    assert eng.spec.fused_runs == 0 and eng.plain.fused_runs > 0
    # A short call earns a small share of the ~700 speculative graphs' capture time.
    assert eng.warming is not None and eng.warming.pending
    sizes = range(1, len(PROMPTS) + 1)  # (all buckets: the same, ten times the graphs)
    try:
        eng.prepare_to_serve(batch_sizes=sizes)
    finally:
        unfreeze()
    assert eng.warming is None and not warmup.pending_graphs(eng, sizes)
    second = eng.generate(PROMPTS, sp)
    assert [c.token_ids for c in second] == ref
    assert sum(c.verify_steps for c in second) > 0 and eng.spec.fused_runs > 0
    assert in_steps and not any(in_steps)
    eng.blocks.check_all_free()


@pytest.mark.parametrize("spec", [None, (4, False)], ids=["plain", "k4"])
def test_streams_keep_their_output_when_an_abort_drains_the_step_in_flight(random_smol, spec):
    """On CUDA a decode step launches before the last is read, so an abort drains the step in
    flight and holds its outputs for the next step: a stream beside the aborted request still
    gets every token (equal to the torch backend's), the aborted stream ends with a last
    output, and no block stays in use."""
    from engine import SamplingParams
    from engine.config import SpecConfig

    g = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = random_smol.generate(PROMPTS[0], g)[0].token_ids
    kw = {} if spec is None else {"spec": SpecConfig(num_tokens=spec[0], dynamic=spec[1])}
    eng = random_smol.with_config(attention_backend="triton", cuda_graphs=True, **kw)
    assert eng.capture_graphs(range(1, 3)) > 0
    other = eng.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=200,
                                                       ignore_eos=True))
    got, outs, drained = [], [], None
    for out in eng.stream(PROMPTS[0], g):
        outs.append(out)
        got += out.token_ids
        if len(got) >= 5 and drained is None:
            eng.abort(other)
            drained = [o.request_id for o in eng._carry]  # the step in flight's outputs
    assert outs[0].request_id in drained  # the path under test ran
    assert got == want and outs[-1].finished and outs[-1].finish_reason == "length"
    assert eng.overlap.inflight is None
    outs = []
    for out in eng.stream(PROMPTS[2], g):
        outs.append(out)
        if len(outs) == 3:
            eng.abort(out.request_id)
        assert len(outs) < 30, "the stream went on after its abort"
    assert outs[-1].finished and outs[-1].finish_reason == "cancelled"
    assert not eng.seqs
    eng.blocks.check_all_free()
