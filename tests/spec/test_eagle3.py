"""EAGLE-3 head: public checkpoint layout, target checks, train/inference consistency, and
lossless greedy speculation on tiny random models."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import replace

import pytest
import torch

from cluster.eagle3.ttt import ttt_forward
from engine import Engine, SamplingParams
from engine.attention import TorchAttention
from engine.config import SpecConfig
from engine.spec.eagle3 import Eagle3Head, load_head, save_head
from engine.spec.runtime import Span
from engine.testing import random_head, tiny_engine
from engine.warmup import split_max_seqs


def spec_engine(base: Engine, head: Eagle3Head | None, **spec) -> Engine:
    cfg = replace(base.config, spec=SpecConfig(**spec))
    return Engine(cfg, weights_of=base, draft_head=head)


# Draft vocabulary of the heads whose steps run in Triton's interpreter, which costs per
# program: their LM head is a GEMV of 4 column programs at 64 ids, 32 at random_head's 128
# (same kernel, argmax fold included). These tests compare paths; any vocabulary does.
FAST_VOCAB = 64


def looping_setup(n: int, copies: int, max_tokens: int):
    """A tiny engine, a random head, n prompts each a short pattern repeated `copies` times,
    greedy params and the plain engine's outputs for them."""
    base = tiny_engine(0, max_num_batched_tokens=64)
    head = random_head(base, draft_vocab=FAST_VOCAB)
    prompts = [[(7 * i + j) % 50 for j in range(5 + 3 * i)] * copies for i in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return base, head, prompts, sp, [c.token_ids for c in base.generate(prompts, sp)]


def test_checkpoint_round_trip_is_exact(tmp_path):
    base = tiny_engine(0)
    head = random_head(base, norm_before_residual=True)
    save_head(head, str(tmp_path), dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):
        assert key in cfg
    assert "target_hidden_size" not in cfg  # the reference runtime would skip the embedding
    back = load_head(str(tmp_path), base.config.model,
                     lambda c: TorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, 4))
    assert back.cfg == head.cfg
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(back.draft_to_target, head.draft_to_target)


def test_with_config_loads_the_head_its_spec_names(tmp_path):
    """`Engine.with_config` shares the head only when the new spec names the same checkpoint:
    a spec naming another head folder gets that head (figure 1's head A/B compared the
    shipped head with itself when every derived engine took the first one's)."""
    base = tiny_engine(0)
    a, b = random_head(base, seed=1), random_head(base, seed=2)
    save_head(b, str(tmp_path), dtype=torch.float32)
    eng = spec_engine(base, a, num_tokens=3)

    def weights(e):
        return e.spec.head.fc.weight

    assert torch.equal(weights(eng), a.fc.weight)
    assert torch.equal(weights(eng.with_config(spec=SpecConfig(num_tokens=5))), a.fc.weight)
    other = eng.with_config(spec=SpecConfig(num_tokens=3, head=str(tmp_path)))
    assert torch.equal(weights(other), b.fc.weight)
    assert torch.equal(other.spec.head.draft_to_target, b.draft_to_target)
    assert torch.equal(weights(other.with_config(num_blocks=64)), b.fc.weight)


def test_public_layout_names(tmp_path):
    from safetensors.torch import load_file

    base = tiny_engine(0)
    save_head(random_head(base), str(tmp_path))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.mlp.gate_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names


def test_mismatched_target_is_refused(tmp_path):
    base = tiny_engine(0)
    save_head(random_head(base), str(tmp_path))
    other = tiny_engine(0, vocab_size=300).config.model
    with pytest.raises(ValueError, match="vocab size"):
        load_head(str(tmp_path), other, lambda c: None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["target_hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="target hidden size"):
        load_head(str(tmp_path), base.config.model, lambda c: None)


@pytest.mark.parametrize("nbr", [False, True])
def test_training_unroll_matches_paged_inference(nbr):
    """The trainer's dense unroll computes what the engine's paged head computes when the
    drafted tokens are the true ones: train and serve see the same function."""
    base = tiny_engine(1)
    head = random_head(base, seed=2, norm_before_residual=nbr)
    eng = spec_engine(base, head, method="eagle3", num_tokens=2, dynamic=False)
    ids = list(range(3, 30))
    caps = {}

    def capture(seq, lo, hidden, aux):
        caps[lo] = aux

    eng.set_tap(capture, head.cfg.aux_layer_ids)
    eng.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    aux = caps[0][None, :-1]  # [1, L, 3h]: positions 0..L-1, whose next token is known
    L = aux.shape[1]
    nxt = torch.tensor(ids[1:])[None]
    with torch.no_grad():
        outs = ttt_forward(head, base.model.embed_tokens, aux, nxt, unroll=3)
    # Paged: a fresh sequence holding the blocks; step 0 over all positions, then a chain.
    seq_id = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=5))
    seq = eng.seqs[seq_id]
    eng.blocks.grow(seq, len(ids) + 4)
    t = 10  # chain from position t, as if the request's last real position were t
    run = eng.spec.drafter  # the head step by step
    with torch.no_grad():
        out0 = run.forward([Span(seq, 0, L, 0, True)], [L], ids[1 : L + 1], list(range(L)),
                           head.fuse([aux[0, :, i * 64 : (i + 1) * 64] for i in range(3)]))
        assert torch.allclose(out0, outs[0][0], atol=1e-4)
        # Step 1 at position t+1 consumes out0[t] and the true token x_{t+2}.
        sp = Span(seq, 0, t + 1, 0, True)
        h1 = run.forward([sp], [1], [ids[t + 2]], [t + 1], out0[t : t + 1])
        assert torch.allclose(h1[0], outs[1][0, t], atol=1e-4)
        h2 = run.forward([sp], [1], [ids[t + 3]], [t + 2], h1)
        assert torch.allclose(h2[0], outs[2][0, t], atol=1e-4)
    eng.abort(seq_id)


@functools.cache
def plain_greedy(k: int):
    """A tiny engine, 8 repetitive prompts drawn with seed k and the plain engine's greedy
    outputs for them: the reference both drafters at that K are held to."""
    base = tiny_engine(0, max_num_batched_tokens=64)
    rng = random.Random(k)
    # Repetitive prompts, so n-gram drafts are often right and the accept path runs too.
    prompts = [[rng.randrange(20) for _ in range(rng.randrange(2, 40))] * 2 for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=30)
    return base, prompts, sp, [c.token_ids for c in base.generate(prompts, sp)]


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_is_lossless_tiny(method, k):
    base, prompts, sp, ref = plain_greedy(k)
    head = random_head(base) if method == "eagle3" else None
    eng = spec_engine(base, head, method=method, num_tokens=k, dynamic=False)
    got = [c.token_ids for c in eng.generate(prompts, sp)]
    assert got == ref
    st = eng.spec.stats
    assert st.verify_steps > 0 and st.drafted_per_pos[k - 1] > 0
    if method == "ngram":
        assert sum(st.accepted_per_pos) > 0
    eng.blocks.check_all_free()


def test_sampled_speculation_is_reproducible_and_frees_blocks():
    base = tiny_engine(0)
    eng = spec_engine(base, random_head(base), method="eagle3", num_tokens=3)
    sp = SamplingParams(temperature=0.9, top_k=30, seed=11, max_tokens=25)
    prompts = [[1, 2, 3, 4], [9] * 13]
    a = [c.token_ids for c in eng.generate(prompts, sp)]
    b = [c.token_ids for c in eng.generate(prompts, sp)]
    assert a == b and all(len(x) == 25 for x in a)
    eng.blocks.check_all_free()


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the static-bucket path run "
                              "eagerly on the CPU; on GPUs tests/engine/test_gpu_engine.py")


@CPU_ONLY
@pytest.mark.parametrize("dynamic", [False, True])
def test_fast_path_drafts_like_the_reference(dynamic, k=3):
    """Triton backend + fused head + the static-bucket (graph) path, run eagerly on the CPU:
    output equals plain decoding and every draft equals the reference path's drafts (same
    acceptance counts per position)."""
    base, head, prompts, sp, ref = looping_setup(2, 2, 10)
    # The head's drafts alone: with context drafts the copies get accepted and dynamic K,
    # priced from measured step times, may pick different K on the two paths (context
    # drafts have their own lockstep test in test_context_lookup.py).
    slow = spec_engine(base, head, num_tokens=k, dynamic=dynamic, context_drafts=False)
    # The step-by-step graph path (the fused step has its own test below).
    fast = Engine(replace(slow.config, attention_backend="triton",
                          spec=replace(slow.config.spec, fused_step=False)),
                  weights_of=base, draft_head=head)
    assert fast.model.fused and fast.spec.head.midlayer.fused
    fast.runner.enable_graphs(8, range(1, k + 2), fast.spec.aux_layers)
    fast.spec.enable_graphs(8)
    # Up front, as nodes do at start: buckets 2 and 4 (3 sequences) for every query count.
    from engine.runner import PREFILL_LENS

    # Decode/verify and head first steps per query count, one draft step, the chains, and
    # the prefill chunk lengths, for the buckets of 2 and 4.
    # (Prompt chunks: the target's and the head's prefill graphs.)
    per_bucket = (k + 1) * 2 + 1 + (k - 1) + 2 * len(PREFILL_LENS)
    assert fast.capture_graphs([2, 3], long_context=False) == 2 * per_bucket
    assert (4, k + 1, False) in fast.runner.graphs.graphs
    # Long-context (split-KV) variants on request (by default when max_model_len passes
    # `long_context`): the same keys again with the flag set, for the buckets few enough to
    # split (the CPU counts as 8 multiprocessors), nothing twice.
    split_max = split_max_seqs(fast)
    assert split_max == 7 // fast.config.model.num_kv_heads
    n = fast.capture_graphs([2, 3], long_context=True)
    assert n == per_bucket * sum(b <= split_max for b in (2, 4))
    assert ((4, k + 1, True) in fast.runner.graphs.graphs) == (4 <= split_max)
    assert ((2, k + 1, True) in fast.runner.graphs.graphs) == (2 <= split_max)
    assert fast.capture_graphs([2, 3], long_context=True) == 0
    assert [c.token_ids for c in slow.generate(prompts, sp)] == ref
    head_chunks, run = [], fast.spec.prefill_graphs.run  # the head over the prompt chunks
    fast.spec.prefill_graphs.run = lambda *a, **kw: head_chunks.append(1) or run(*a, **kw)
    assert [c.token_ids for c in fast.generate(prompts, sp)] == ref
    assert head_chunks
    assert fast.spec.stats.accepted_per_pos == slow.spec.stats.accepted_per_pos
    assert fast.spec.chain_graphs and fast.spec.first_graphs.graphs and fast.runner.graphs.graphs
    assert fast.spec.prefill_graphs.graphs
    fast.blocks.check_all_free()


def fast_engine(base: Engine, head: Eagle3Head, max_batch: int = 8, num_blocks=None,
                overlap: bool = True, admit_in_flight: bool = True, **spec) -> Engine:
    """Triton backend with the static-bucket (graph) path, run eagerly on the CPU."""
    cfg = replace(base.config, attention_backend="triton", spec=SpecConfig(**spec),
                  num_blocks=num_blocks or base.config.num_blocks, overlap=overlap,
                  admit_in_flight=admit_in_flight)
    eng = Engine(cfg, weights_of=base, draft_head=head)
    eng.runner.enable_graphs(max_batch, range(1, eng.config.spec.num_tokens + 2),
                             eng.spec.aux_layers)
    eng.spec.enable_graphs(max_batch)
    return eng


@CPU_ONLY
def test_fused_step_equals_the_step_by_step_path(k=3):
    """Verify + head + draft chain as one graph (engine/spec/fused.py): in lockstep with the
    step-by-step path, every step leaves the same tokens, KV progress and next drafts, for
    sequences whose drafts are accepted partly, fully or not at all."""
    base = tiny_engine(0, max_num_batched_tokens=64)
    head = random_head(base, draft_vocab=FAST_VOCAB)
    # Two sequences (a bucket of 2): the head below gets one's drafts accepted, not the other's.
    prompts = [[(7 * i + j) % 50 for j in range(5 + 3 * i)] * 2 for i in (0, 2)]
    sp = SamplingParams(temperature=0, max_tokens=200)
    # A random head is never right; one that always drafts the target's most frequent token
    # is right exactly when the target repeats it: drafts get accepted fully, partly, not.
    outs = [c.token_ids for c in base.generate(prompts, replace(sp, max_tokens=20))]
    top = max(set(sum(outs, [])), key=sum(outs, []).count)
    with torch.no_grad():
        head.d2t.copy_(top - torch.arange(head.d2t.numel()))
    # The step-by-step path on the reference backend (on the Triton backend's graph path it
    # equals the reference: test_fast_path_drafts_like_the_reference).
    step = spec_engine(base, head, num_tokens=k, dynamic=False)
    fused = fast_engine(base, head, num_tokens=k, dynamic=False, overlap=False)
    overlap = fast_engine(base, head, num_tokens=k, dynamic=False)
    assert step.spec.fused is None and fused.spec.fused is not None
    engines = (step, fused, overlap)
    ids = [[e.add_request(p, sp) for e in engines] for p in prompts]
    for _ in range(7):
        for e in engines:
            e.step()
        for rids in ids:
            x = step.seqs[rids[0]]
            for e, r in zip(engines[1:], rids[1:]):
                y = e.seqs[r]
                assert (x.token_ids, x.num_computed, x.draft) == (y.token_ids,
                                                                   y.num_computed, y.draft)
    assert fused.spec.fused_runs >= 5 and overlap.overlap.inflight is not None
    assert overlap.spec.fused_runs > fused.spec.fused_runs  # one step ahead
    for e in engines[1:]:
        assert e.spec.stats.accepted_per_pos == step.spec.stats.accepted_per_pos
    assert 0 < sum(fused.spec.stats.accepted_per_pos) < sum(fused.spec.stats.drafted_per_pos)
    before = {r: len(overlap.seqs[r].token_ids) for r in (rids[2] for rids in ids)}
    overlap.abort(ids[0][2])  # drains the step in flight: the others' tokens wait in a carry
    assert overlap.overlap.inflight is None and not overlap.overlap.deferred
    assert overlap.has_unfinished()
    carried = overlap.step()
    assert {o.request_id for o in carried} >= {rids[2] for rids in ids[1:]}
    assert all(len(overlap.seqs[rids[2]].token_ids) > before[rids[2]] for rids in ids[1:])
    for rids in ids:
        for e, r in zip(engines, rids):
            e.abort(r)  # the overlapped engine drains its step in flight first
    assert overlap.overlap.inflight is None and not overlap.overlap.deferred
    for e in engines:
        e.blocks.check_all_free()


def arriving_requests(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n short prompts (every prefill chunk runs padded under the interpreter) and greedy
    params, the second half to arrive mid-way. Four requests end apart, so some finish while
    others stay in the pipeline; six, their ends drawn at random, outgrow a small KV cache."""
    rng = random.Random(5)
    prompts = [[rng.randrange(30) for _ in range(rng.randrange(3, 16))] for _ in range(n)]
    ends = (16, 12, 5, 8) if n == 4 else [rng.randrange(4, 12) for _ in prompts]
    return prompts, [SamplingParams(temperature=0, max_tokens=m) for m in ends]


@CPU_ONLY
@pytest.mark.parametrize("dynamic,num_blocks,beside,n",
                         [(False, None, True, 4), (True, None, True, 4), (False, 12, False, 6)])
def test_fused_step_is_lossless_to_the_end(dynamic, num_blocks, beside, n, k=4):
    """Fused (and overlapped) steps through max_tokens and EOS-free ends, with new requests
    arriving mid-way (prefilled beside the step in flight and joining its continuation at
    their pending token, or, `beside` off, after a drain beside the fused decodes), and with a KV
    cache so small that requests are preempted: output equals plain decoding, blocks all
    come back."""
    base = tiny_engine(0, max_num_batched_tokens=64)
    head = random_head(base, draft_vocab=FAST_VOCAB)
    prompts, params = arriving_requests(n)
    ref = [c.token_ids for c in base.generate(prompts, params)]
    eng = fast_engine(base, head, num_tokens=k, dynamic=dynamic, num_blocks=num_blocks,
                      admit_in_flight=beside)
    split, plain_split = [], eng.stepper.split
    eng.stepper.split = lambda batch, dec: (split.append(len(dec)), plain_split(batch, dec))[1]
    beside_drafts, read_beside = [], eng.overlap.read_beside

    def read(batch, *a):  # drafts an arrival carries out of its prefill beside the step
        outs = read_beside(batch, *a)
        beside_drafts.extend(len(s.draft) for s in batch.seqs)
        return outs

    eng.overlap.read_beside = read
    first = n // 2
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts[:first], params[:first])]
    for _ in range(4):
        eng.step()
    rids += [eng.add_request(p, sp) for p, sp in zip(prompts[first:], params[first:])]
    seqs = {r: eng.seqs[r] for r in rids}
    overlapped = 0
    while eng.has_unfinished():
        eng.step()
        overlapped += eng.overlap.inflight is not None
    assert [seqs[r].output_ids for r in rids] == ref
    assert eng.spec.fused_runs > 0 and overlapped > 0
    # Requests finishing mid-pipeline drop out of the next launch instead of draining it.
    assert eng.spec.compacted_runs > 0
    # A random head is never right: dynamic K settles at 0, where continuations take the
    # positions the host knows (fixed K meets it only where max_tokens caps K).
    assert eng.spec.known_continuations > (5 if dynamic else 0)
    if beside:  # arrivals prefilled beside the step in flight, then joining the pipeline
        arrivals = len(rids) - first
        assert eng.admitted_in_flight >= arrivals and eng.spec.joined_runs > 0
        # ... at their pending token alone (drafting then would read drafts back, waiting
        # for the step launched after the one in flight); the fused steps draft for them.
        assert len(beside_drafts) >= arrivals and not any(beside_drafts)
        if not dynamic:
            assert all(seqs[r].num_drafted > 0 for r in rids[first:])
    else:  # arrivals prefilled beside fused decodes, in the same step, after a drain
        assert split and eng.admitted_in_flight == 0
    assert eng.overlap.inflight is None and not eng.overlap.deferred
    assert (eng.scheduler.num_preemptions > 0) == (num_blocks is not None)
    eng.blocks.check_all_free()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_head_store_kv_writes_what_a_full_step_writes(backend):
    """A fused step that drafts nothing only keeps the draft KV current (`store_kv`): the
    cache must hold exactly what the full head step stores, slot -1 rows skipped, with the
    plain and the fused-kernel (triton) layer alike."""
    from engine.attention import AttentionMetadata, get_backend, triton_available

    if backend == "triton" and not triton_available():
        pytest.skip("needs triton")
    base = tiny_engine(0)
    src = random_head(base)
    hc = src.cfg
    head = Eagle3Head(hc, get_backend(backend)(hc.num_heads, hc.num_kv_heads, hc.head_dim, 4))
    head.load_state_dict(src.state_dict())
    g = torch.Generator().manual_seed(1)
    t = 7
    emb = torch.randn(t, hc.hidden_size, generator=g)
    hid = torch.randn(t, hc.hidden_size, generator=g)
    pos = torch.arange(3, 3 + t)
    # (-1: rows that store nothing; only the triton backend, which fused steps use, has them)
    skip = -1 if backend == "triton" else 14
    slots = torch.tensor([9, 10, 11, skip, 12, 13, skip + 1])
    meta = AttentionMetadata(slot_mapping=slots, query_start=torch.tensor([0, t]),
                             seq_lens=torch.tensor([3 + t]), block_tables=torch.tensor([[2, 3, 4]]),
                             max_query_len=t, max_seq_len=3 + t, query_start_cpu=[0, t],
                             seq_lens_cpu=[3 + t])
    shape = (2, 8, 4, hc.num_kv_heads, hc.head_dim)
    full, only = torch.zeros(shape), torch.zeros(shape)
    with torch.inference_mode():
        head(emb, hid, pos, full, meta)
        head.store_kv(emb, hid, pos, only, meta)
    assert full.abs().sum() > 0
    assert torch.equal(full, only)
    assert full[:, 2, 0].abs().sum() == 0  # slot 8: no row wrote it


@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (3, torch.float32),
                                        (12, torch.float32), (3, torch.bfloat16)])
def test_chain_step_folds_lookup_and_residual_without_changing_a_number(rows, dtype):
    """`Eagle3Head.chain_step` (the fused graph's chained draft step: the embedding lookup
    inside the input norms, the last residual add inside the LM head's prologue) leaves the
    same hidden state, tokens and draft KV as `forward(table[t])` + `greedy_tokens`, at
    prologue-GEMV row counts (1, 3) and past them (12: the separate add)."""
    from engine import ops
    from engine.attention import AttentionMetadata, get_backend, triton_available

    if not triton_available():
        pytest.skip("needs triton")
    base = tiny_engine(0)
    src = random_head(base)
    hc = src.cfg
    head = Eagle3Head(hc, get_backend("triton")(hc.num_heads, hc.num_kv_heads, hc.head_dim, 4))
    head.load_state_dict(src.state_dict())
    head = head.to(dtype).eval()
    assert head.midlayer.fused and head.lm_prologue
    assert (rows in head.midlayer.prologue_rows) == (rows <= ops.LINEAR_MAX_ROWS)
    table = base.model.embed_tokens.weight.to(dtype)
    g = torch.Generator().manual_seed(rows)
    toks = torch.randint(0, table.shape[0], (rows,), generator=g)
    hid = torch.randn(rows, hc.hidden_size, generator=g).to(dtype)
    ctx = 6  # each row one sequence with 5 keys before its own
    pos = torch.full((rows,), ctx - 1)
    blocks = torch.arange(rows * 2).view(rows, 2)
    meta = AttentionMetadata(slot_mapping=blocks[:, 1] * 4 + (ctx - 1) % 4,
                             query_start=torch.arange(rows + 1), seq_lens=torch.full((rows,), ctx),
                             block_tables=blocks, max_query_len=1, max_seq_len=ctx)
    shape = (2, rows * 2, 4, hc.num_kv_heads, hc.head_dim)
    kv = torch.randn(shape, generator=g).to(dtype)
    kv0, kv_ref = kv.clone(), kv.clone()
    with torch.inference_mode():
        h_ref = head(table[toks], hid, pos, kv_ref, meta)
        t_ref = head.greedy_tokens(h_ref)
        h, t = head.chain_step(table, toks, hid, pos, kv, meta)
    assert torch.equal(h, h_ref) and torch.equal(t, t_ref) and torch.equal(kv, kv_ref)
    assert not torch.equal(kv, kv0)  # the step stored its draft KV
    # A step that only keeps the draft KV current (K=0) looks its rows up the same way.
    only, ref = kv0.clone(), kv0.clone()
    with torch.inference_mode():
        head.store_kv(table, hid, pos, only, meta, toks)
        head.store_kv(table[toks], hid, pos, ref, meta)
    assert torch.equal(only, ref) and torch.equal(only, kv)


@CPU_ONLY
def test_fused_argmax_leaves_the_fused_steps_unchanged(monkeypatch):
    """`ops.FUSED_ARGMAX` on and off, step for step (each chained draft's argmax folded into
    its LM head's GEMV, the tokens decoded by the next step's input norm): the same tokens,
    KV progress, drafts and acceptance, with the keys actually used."""
    from engine import ops

    base, head, prompts, sp, _ = looping_setup(3, 2, 14)
    prompts = prompts[::2]
    # The argmax folds into the LM head only where the chain runs one row (the GEMV's row
    # count): one request ends early, then the other (whose drafts get accepted) runs alone.
    sps = [replace(sp, max_tokens=4), sp]
    on = fast_engine(base, head, num_tokens=4, dynamic=False, overlap=False)
    off = fast_engine(base, head, num_tokens=4, dynamic=False, overlap=False)
    decoded = []
    real = ops.decode_keys
    monkeypatch.setattr(ops, "decode_keys", lambda *a, **kw: decoded.append(1) or real(*a, **kw))
    ids = [(on.add_request(p, s), off.add_request(p, s)) for p, s in zip(prompts, sps)]
    while on.has_unfinished() or off.has_unfinished():
        for eng, fused in ((on, True), (off, False)):
            monkeypatch.setattr(ops, "FUSED_ARGMAX", fused)
            before = len(decoded)
            eng.step()
            assert fused or len(decoded) == before
        for a, b in ids:
            if a in on.seqs and b in off.seqs:
                x, y = on.seqs[a], off.seqs[b]
                assert (x.token_ids, x.num_computed, x.draft) == (y.token_ids, y.num_computed,
                                                                   y.draft)
    assert decoded and on.spec.fused_runs > 0
    assert on.spec.stats.accepted_per_pos == off.spec.stats.accepted_per_pos
    assert sum(on.spec.stats.accepted_per_pos) > 0
    for e in (on, off):
        e.blocks.check_all_free()


@CPU_ONLY
def test_dense_levels_from_a_batch_size_are_lossless():
    """`SpecConfig.dense_levels_min_batch`: dense levels for fused batches of 3 or more
    sequences, the doubling ones below. Requests of different lengths finish one by one, so
    the batch crosses that size, and a step verifies drafts chosen at the other levels (here
    every fused batch drafts the deepest K its verify budget admits at its own levels: K=3 at
    4 sequences, K=5 at 3 (6 rows, a dense-only level), K=7 at 2 and 1); greedy output
    still equals plain decoding."""
    from engine.spec.fused import level_sets

    base = tiny_engine(0, max_num_batched_tokens=64)
    head = random_head(base, draft_vocab=FAST_VOCAB)
    prompts = [[(7 * i + j) % 50 for j in range(5 + 3 * i)] * 2 for i in range(4)]
    # Ends far enough apart that K reaches the batch's level before a request's end caps it
    # (6 tokens left at 3 sequences, 8 at 2), the last request alone for a few steps.
    sps = [SamplingParams(temperature=0, max_tokens=m) for m in (6, 12, 20, 22)]
    ref = [c.token_ids for c in base.generate(prompts, sps)]
    top = max(set(sum(ref, [])), key=sum(ref, []).count)
    with torch.no_grad():
        head.d2t.copy_(top - torch.arange(head.d2t.numel()))
    eng = fast_engine(base, head, num_tokens=7, dense_levels_from=4, dense_levels_min_batch=3,
                      verify_token_budget=18)
    f, pol = eng.spec.fused, eng.spec.policy
    assert (f.small, f.large) == level_sets(7, 4, 3)
    assert f.query_levels == (1, 2, 4, 6, 8) and f.draft_levels == (0, 1, 2, 4, 6, 7)
    assert f.levels_at(2) == ((1, 2, 4, 8), (0, 1, 2, 4, 7)) == pol.levels
    assert f.levels_at(3) == ((1, 2, 4, 6, 8), (0, 1, 2, 4, 6, 7))
    assert pol.levels_at == f.levels_at
    assert [pol._kmax(b, padded=True) for b in (4, 3, 2, 1)] == [3, 5, 7, 7]
    pol.choose_batch = lambda seqs, b: pol._kmax(b, padded=True)  # not the timed model's pick
    seen = []
    real = f.set_for
    f.set_for = lambda drafts, batch=None: seen.append((drafts, batch)) or real(drafts, batch)
    assert [c.token_ids for c in eng.generate(prompts, sps)] == ref
    assert eng.spec.fused_runs > 0
    assert (5, 3) in seen and (3, 4) in seen and (7, 2) in seen  # both sides of 3 ran
    eng.blocks.check_all_free()


@CPU_ONLY
def test_dense_levels_at_every_batch_size_by_default():
    """With `SpecConfig.dense_levels_from` = 4 and no `dense_levels_min_batch`, every fused
    batch takes the dense levels: graphs at 6 verify rows and 6 drafts too. (That fused steps
    at dense levels reproduce plain decoding, K capped near each request's end, is
    test_dense_levels_from_a_batch_size_are_lossless's run: the same K and levels, its batches
    of 3 or more on these dense ones, a head that is sometimes right.)"""
    base = tiny_engine(0, max_num_batched_tokens=64)
    eng = fast_engine(base, random_head(base), num_tokens=7, dynamic=False, dense_levels_from=4)
    f = eng.spec.fused
    assert f.query_levels == (1, 2, 4, 6, 8)
    assert f.draft_levels == (0, 1, 2, 4, 6, 7)
    assert all(f.levels_at(b) == (f.query_levels, f.draft_levels) for b in (1, 2, 3, 8))


def test_the_lm_head_bound_decides_its_gemv_path(monkeypatch):
    """`prologue.LM_HEAD_MAX_WEIGHT` alone decides whether a head's LM head takes the fused
    GEMV (argmax folded in): a draft vocabulary past it runs torch's linear unless the bound is
    raised (how a larger vocabulary is measured on that path)."""
    from engine.attention import TorchAttention
    from engine.ops import prologue

    hc = random_head(tiny_engine(0)).cfg
    size = hc.draft_vocab_size * hc.hidden_size

    def lm_prologue(bound: int) -> bool:
        monkeypatch.setattr(prologue, "LM_HEAD_MAX_WEIGHT", bound)
        return Eagle3Head(hc, TorchAttention(hc.num_heads, hc.num_kv_heads, hc.head_dim,
                                             4)).lm_prologue

    assert lm_prologue(size) and not lm_prologue(size - 1)
    assert prologue.LINEAR_MAX_WEIGHT // 576 == 7281  # SmolLM2's head: the default's reach
