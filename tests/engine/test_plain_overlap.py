"""Overlapped plain greedy decoding (engine/plain_steps.py): the next decode step is launched
before the host reads this one, its token ids copied on the device from this step's argmax.
Run on the CPU through the static-bucket (graph) path, eagerly: the output must equal the
regular path's token for token through arrivals, finishes, aborts, sampled neighbours and
preemption, and every KV block must come back."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine.attention import triton_available
from engine.sequence import SamplingParams
from tests.helpers import tiny_engine

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the static-bucket path run eagerly "
                       "on the CPU; on a GPU the same path replays CUDA graphs (gpu tests)"),
]


@pytest.fixture(scope="module")
def ref():
    """The reference engine (torch backend), whose weights the graph engines share. One
    layer: overlap pipelines whole forwards, so depth changes nothing it does, and each
    interpreted step runs half the kernels. Three query heads on one KV head and an MLP of 44:
    an interpreted launch costs per program, and each projection of a one-row step is then
    at most 1.5 times as wide as long, so it takes 16-column programs (4 to 6 of them)."""
    return tiny_engine(0, max_num_batched_tokens=64, attention_backend="torch", num_layers=1,
                       num_heads=3, num_kv_heads=1, intermediate_size=44)


def graph_engine(ref, num_blocks=None, **kw):
    """A Triton engine on ref's weights through the static-bucket path. Its prefill chunks are
    also padded to 8 or 16 tokens (the prompts here are 3-15 long): under the interpreter each
    padded row runs every kernel's program, and a chunk of four prompts padded to 32 tokens
    cost more than all the decode steps after it."""
    cfg = replace(ref.config, attention_backend="triton",
                  num_blocks=num_blocks or ref.config.num_blocks, **kw)
    from engine import Engine, runner

    eng = Engine(cfg, weights_of=ref)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(runner, "PREFILL_LENS", (8, 16) + runner.PREFILL_LENS)
        eng.runner.enable_graphs(8, (1,), ())
    return eng


def workload(n=6, seed=5):
    """n prompts of 3-15 tokens (short: every prefill chunk runs padded under the
    interpreter), greedy, 5-15 new tokens each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(200) for _ in range(rng.randrange(3, 16))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(5, 16), ignore_eos=True)
              for _ in prompts]
    return prompts, params


def test_overlapped_lockstep_with_the_regular_path(ref):
    """After every engine step, the overlapped engine's sequences hold exactly the tokens
    and KV progress of an engine that reads each step before the next."""
    prompts, params = workload(3)
    params = [replace(p, max_tokens=40) for p in params]
    on, off = graph_engine(ref), graph_engine(ref, overlap=False)
    ids = [[e.add_request(p, sp) for e in (on, off)] for p, sp in zip(prompts, params)]
    for _ in range(12):
        on.step()
        off.step()
        for a, b in ids:
            x, y = on.seqs[a], off.seqs[b]
            assert (x.token_ids, x.num_computed) == (y.token_ids, y.num_computed)
    assert on.plain.overlapped_runs >= 10 and on.overlap.inflight is not None
    assert off.plain.overlapped_runs == 0 and off.plain.fused_runs >= 10


@pytest.mark.parametrize("num_blocks", [None, 16])
def test_overlapped_decoding_is_exact_to_the_end(ref, num_blocks):
    """Requests of different lengths (finishes inside the pipeline), arrivals mid-way, a
    stop token, a sampled neighbour (regular forward beside the greedy ones' decode graph)
    and, with 16 blocks, a KV cache so small that requests are preempted: every greedy
    output equals the torch backend's, and all blocks come back."""
    prompts, params = workload()
    params[1] = replace(params[1], max_tokens=20)
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    stop_tok = expect[1][7]
    params[1] = replace(params[1], stop_token_ids=[stop_tok])
    expect[1] = expect[1][: expect[1].index(stop_tok) + 1]
    eng = graph_engine(ref, num_blocks=num_blocks)
    split, real_split = [], eng.stepper.split
    eng.stepper.split = lambda batch, dec: (split.append(len(dec)), real_split(batch, dec))[1]
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3])]
    seqs = {r: eng.seqs[r] for r in rids}
    for _ in range(4):
        eng.step()
    sampled = eng.add_request([5, 6, 7], SamplingParams(temperature=0.8, max_tokens=6,
                                                        seed=1, ignore_eos=True))
    rids += [eng.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:])]
    seqs.update({r: eng.seqs[r] for r in rids[3:] + [sampled]})
    overlapped = 0
    while eng.has_unfinished():
        eng.step()
        overlapped += eng.overlap.inflight is not None
    assert [seqs[r].output_ids for r in rids] == expect
    assert len(seqs[sampled].output_ids) == 6
    assert overlapped > 0 and eng.plain.overlapped_runs > 0
    # Arrivals' prefill chunks and the sampled request ran beside decode graphs of the
    # greedy ones, in the same steps (`Stepper.split`).
    assert split
    assert eng.overlap.inflight is None and not eng.overlap.deferred
    assert (eng.scheduler.num_preemptions > 0) == (num_blocks is not None)
    eng.blocks.check_all_free()


def test_a_request_that_finishes_in_flight_drops_out_without_a_drain(ref):
    """A stop token the host could not foresee ends a request while the next step is in
    flight: the step after continues the others from the device (no drain), the finished
    request's row is read and discarded, its blocks are freed once no step in flight writes
    into them, and every output stays exact."""
    prompts, params = workload(3)
    params = [replace(p, max_tokens=14) for p in params]
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    stop_tok = expect[0][6]
    params[0] = replace(params[0], stop_token_ids=[stop_tok])
    expect[0] = expect[0][: expect[0].index(stop_tok) + 1]
    eng = graph_engine(ref)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    seqs = {r: eng.seqs[r] for r in rids}
    while not seqs[rids[0]].finished:
        eng.step()
    # Finished while the step after was in flight: that step still holds its row and blocks.
    assert eng.overlap.inflight is not None and seqs[rids[0]] in eng.overlap.deferred
    free = eng.blocks.num_free
    eng.step()
    assert eng.overlap.inflight is not None and seqs[rids[0]] not in eng.overlap.inflight[0].seqs
    assert not eng.overlap.deferred and eng.blocks.num_free > free
    assert eng.plain.compacted_runs == 1
    while eng.has_unfinished():
        eng.step()
    assert [seqs[r].output_ids for r in rids] == expect
    eng.blocks.check_all_free()


def test_requests_reaching_max_tokens_leave_the_pipeline_without_a_drain(ref):
    """The step that emits a request's last token (its max_tokens) is known before it is
    read: the step launched after it leaves that request out, so the others keep decoding
    from the device, and only the last request's end drains the pipeline."""
    prompts, params = workload(3)
    params = [replace(p, max_tokens=n) for p, n in zip(params, (6, 10, 14))]
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    eng = graph_engine(ref)
    drains, drain = [], eng.overlap.drain
    eng.overlap.drain = lambda: (drains.append(eng.overlap.inflight is not None), drain())[1]
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    seqs = {r: eng.seqs[r] for r in rids}
    left_out = {}  # at the step a request finished: the step in flight leaves it out
    while eng.has_unfinished():
        eng.step()
        for r in rids[:2]:
            if seqs[r].finished and r not in left_out:
                left_out[r] = eng.overlap.inflight is not None and \
                    seqs[r] not in eng.overlap.inflight[0].seqs
    assert [seqs[r].output_ids for r in rids] == expect
    assert all(left_out.values()) and sum(drains) == 1  # in flight at the last's end only
    assert eng.plain.compacted_runs >= 2
    eng.blocks.check_all_free()


def test_abort_while_a_step_is_in_flight(ref):
    """An abort drains the step in flight: the others' tokens come with the next step(), the
    aborted request's blocks are free at once, and decoding goes on exactly."""
    prompts, params = workload(3)
    params = [replace(p, max_tokens=12) for p in params]
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    eng = graph_engine(ref)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    seqs = {r: eng.seqs[r] for r in rids}
    while eng.overlap.inflight is None:
        eng.step()
    before = {r: len(seqs[r].token_ids) for r in rids[1:]}
    assert eng.abort(rids[0])
    assert eng.overlap.inflight is None and not eng.overlap.deferred and eng.has_unfinished()
    carried = eng.step()
    assert {o.request_id for o in carried} >= set(rids[1:])
    assert all(len(seqs[r].token_ids) > before[r] for r in rids[1:])
    while eng.has_unfinished():
        eng.step()
    assert [seqs[r].output_ids for r in rids[1:]] == expect[1:]
    assert seqs[rids[0]].output_ids == expect[0][: len(seqs[rids[0]].output_ids)]
    eng.blocks.check_all_free()


def test_abort_of_a_request_prefilled_beside_the_step_in_flight(ref):
    """A request prefilled beside the step in flight, aborted before it joins the next one:
    its blocks come back, the pipeline goes on exactly for the others, and an arrival after
    it is prefilled beside and joins as usual."""
    prompts, params = workload(4)
    params = [replace(p, max_tokens=10) for p in params]
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    eng = graph_engine(ref, admission_delay_steps=0)
    seqs = [eng.seqs[eng.add_request(p, sp)] for p, sp in zip(prompts[:2], params[:2])]
    while eng.overlap.inflight is None:
        eng.step()
    gone = eng.seqs[eng.add_request(prompts[2], params[2])]
    eng.step()
    assert eng.admitted_in_flight == 1 and gone.num_computed > 0
    assert gone not in eng.overlap.inflight[0].seqs  # prefilled, to join the next continuation
    assert eng.abort(gone.request_id) and gone.finished and not gone.block_table
    while eng.overlap.inflight is None:  # the abort drained the pipeline; it starts again
        eng.step()
    late = eng.seqs[eng.add_request(prompts[3], params[3])]
    while eng.has_unfinished():
        eng.step()
    assert eng.admitted_in_flight == 2 and eng.plain.joined_runs >= 1
    assert [s.output_ids for s in seqs + [late]] == expect[:2] + expect[3:]
    eng.blocks.check_all_free()


def test_step_path_metric_counts_plain_overlapped_steps(ref):
    from engine.metrics import Metrics

    prompts, params = workload(2)
    eng = graph_engine(ref)
    m = Metrics("decode")
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
        m.engine_step(eng)
    text = m.exposition().decode()
    counts = {path: float(next(ln.split()[-1] for ln in text.splitlines()
                               if ln.startswith("tandem_engine_steps_total")
                               and f'path="{path}"' in ln))
              for path in ("overlapped", "fused", "regular")}
    assert counts["overlapped"] == eng.plain.overlapped_runs > 0
    assert counts["fused"] == eng.plain.fused_runs - eng.plain.overlapped_runs > 0
    assert counts["regular"] > 0  # the prefill steps


@pytest.mark.parametrize("num_blocks", [5, 9])  # scarce, and enough for most streams
def test_streams_crossing_a_block_boundary_together_never_overrun_the_cache(ref, num_blocks):
    """Four requests of equal length need a new block in the same step; with fewer free
    blocks than that, the overlapped continuation must drain (and the scheduler preempt)
    instead of taking blocks that are not there: same tokens, every block back."""
    # 3 prompt tokens + 8 new: the streams cross into their 2nd and 3rd blocks together.
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(4)]
    expect = [c.token_ids for c in ref.generate(prompts, [sp] * 4)]
    eng = graph_engine(ref, num_blocks=num_blocks)
    assert [c.token_ids for c in eng.generate(prompts, [sp] * 4)] == expect
    assert eng.scheduler.num_preemptions > 0 and eng.plain.overlapped_runs > 0
    assert eng.overlap.inflight is None and not eng.overlap.deferred
    eng.blocks.check_all_free()


def test_a_full_batch_keeps_overlapping_while_arrivals_wait(ref, delay=2):
    """Under overlap an arrival waits (the pipeline keeps running) until enough others wait
    or it has waited `admission_delay_steps` steps; with a full batch it waits without
    draining until a request finishes. Output stays exact and every block comes back."""
    prompts, params = workload(5)
    params = [replace(p, max_tokens=m) for p, m in zip(params, (12, 12, 12, 6, 8))]
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    eng = graph_engine(ref, admission_delay_steps=delay, admission_share=1, max_num_seqs=4)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
    seqs = [eng.seqs[r] for r in rids]
    while eng.overlap.inflight is None:
        eng.step()
    new = eng.add_request(prompts[4], params[4])
    t0, seq, runs = eng.stats.steps, eng.seqs[new], eng.plain.overlapped_runs
    waited = 0
    while seq.num_computed == 0:
        eng.step()
        waited += 1
    # A full batch (4 of max_num_seqs 4): the arrival waits for a finish (the 6-token
    # request), overlapped all the while; then it joins within `delay` steps.
    assert seqs[3].finished and waited >= 2 and eng.stats.steps - t0 == waited
    assert eng.plain.overlapped_runs - runs >= waited - 3  # no drain while the batch was full
    seqs.append(seq)
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == expect
    eng.blocks.check_all_free()


@pytest.mark.parametrize("beside", [True, False])
def test_an_arrival_waits_for_the_admission_delay_beside_a_running_batch(ref, beside, delay=3):
    """Room in the batch, one arrival, 3 running (admission_share 1: 3 must wait to be due
    at once): the pipeline keeps overlapping until the arrival has waited
    admission_delay_steps steps. Then it is prefilled beside the step in flight and joins
    the continuation after it, the pipeline never drained (`beside`); or, with
    admit_in_flight off, the pipeline drains and the step after admits it. Output stays
    exact either way."""
    prompts, params = workload(4)
    params = [replace(p, max_tokens=10) for p in params]
    expect = [c.token_ids for c in ref.generate(prompts, params)]
    eng = graph_engine(ref, admission_delay_steps=delay, admission_share=1,
                       admit_in_flight=beside)
    seqs = [eng.seqs[eng.add_request(p, sp)] for p, sp in zip(prompts[:3], params[:3])]
    while eng.overlap.inflight is None:
        eng.step()
    runs = eng.plain.overlapped_runs
    new = eng.seqs[eng.add_request(prompts[3], params[3])]
    n = 0
    while new.num_computed == 0:
        eng.step()
        n += 1
    # Due once `delay` steps have passed since it arrived: the step after that admits it.
    assert n == delay + 1
    if beside:  # every step overlapped; the arrival rides in the one in flight next
        assert eng.plain.overlapped_runs - runs == n and eng.admitted_in_flight == 1
        eng.step()
        assert eng.plain.joined_runs == 1 and new in eng.overlap.inflight[0].seqs
    else:  # `delay` steps overlapped, the last of them drained, the one after admits
        assert eng.plain.overlapped_runs - runs == delay and eng.admitted_in_flight == 0
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs + [new]] == expect
    eng.blocks.check_all_free()
