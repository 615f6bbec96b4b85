"""`tandem train-eagle3`: self-distil an EAGLE-3 head for a target with the engine itself.

1. The target answers a prompt set (engine, greedy); every computed position's final hidden
   state and the three aux taps are captured from the same forwards that produce the tokens.
2. The draft vocabulary is the most frequent next tokens of the responses.
3. The head trains with the multi-step "training-time test" unroll: at step j it consumes its
   own hidden state from step j-1 (and the true next token), attending to the true-feature
   keys before it plus its own chain, exactly the pattern it meets when drafting.
4. Held-out prompts give teacher-forced accuracy per step as training goes, and real engine
   acceptance (greedy, speculative) at the end. The head is written in the public layout.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine import Engine, EngineConfig, SamplingParams, ops
from engine.spec.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head


@dataclass
class Record:
    ids: torch.Tensor  # prompt + response token ids [n]
    prompt_len: int
    aux: torch.Tensor  # [n-1, 3h] taps at positions 0..n-2
    hidden: torch.Tensor  # [n-1, h] final normed hidden states


def self_distill(engine: Engine, prompts: list[str], max_tokens: int, layers: tuple[int, ...],
                 store_dtype: torch.dtype, desc: str = "self-distil",
                 ignore_eos: bool = False, temperature: float = 0.0,
                 seed: int | None = None) -> list[Record]:
    """Generate answers with the target and capture the features of every position
    (`ignore_eos`: every answer runs to max_tokens, as figure 1's do). temperature > 0:
    answers sampled (seeded by `seed`) rather than greedy, other contexts for the same
    prompts; the head still learns the target's own next-token law at every position (from
    the captured hidden states), whichever token the answer went on with."""
    if engine.config.enable_prefix_caching:
        raise ValueError("self-distillation needs every position computed: build the engine "
                         "with enable_prefix_caching=False")
    caps: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def capture(seq, lo, hidden, aux):  # the engine cast them, a step at a time
        if len(hidden):
            caps.setdefault(seq.request_id, {})[lo] = (aux, hidden)

    engine.capture, engine.capture_layers = capture, layers
    engine.capture_dtype = store_dtype
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            ignore_eos=ignore_eos, seed=seed if temperature > 0 else None)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    records = []
    try:
        # All prompts queued at once: continuous batching refills a finished answer's slot,
        # where batches of a fixed set waited for their longest answer.
        for c in engine.generate(msgs, params, use_tqdm=desc):
            got = caps.pop(c.request_id)
            parts = [got[k] for k in sorted(got)]
            ids = torch.tensor(c.prompt_token_ids + c.token_ids)
            aux = torch.cat([a for a, _ in parts])[: len(ids) - 1]
            hid = torch.cat([h for _, h in parts])[: len(ids) - 1]
            records.append(Record(ids, len(c.prompt_token_ids), aux, hid))
    finally:
        engine.capture, engine.capture_layers, engine.capture_dtype = None, (), None
    return records


def response_counts(records: list[Record], vocab: int) -> torch.Tensor:
    """How often each target id occurs in the records' responses [vocab]."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for r in records:
        counts += torch.bincount(r.ids[r.prompt_len :], minlength=vocab)
    return counts


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` ids of the highest counts, most frequent first (ties: lower id)."""
    ranked = counts.float() + torch.arange(len(counts), 0, -1) * 1e-9  # deterministic ties
    return torch.topk(ranked, size).indices


def draft_vocab(records: list[Record], size: int, vocab: int) -> torch.Tensor:
    """Target ids of the `size` most frequent response tokens (ties: lower id), sorted."""
    return most_frequent(response_counts(records, vocab), size).sort().values


def ttt_forward(head: Eagle3Head, embed: torch.nn.Embedding, aux: torch.Tensor,
                next_ids: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The unrolled head on a padded batch. aux [B, L, 3h] and next_ids [B, L] (x_{t+1} for
    position t). Returns per step j the head output [B, L, h] at draft position t + j, whose
    input token is x_{t+j+1}; step j only reads next_ids[:, j:]."""
    layer = head.midlayer
    attn = layer.self_attn
    B, L, _ = aux.shape
    nh, nkv, d = attn.nh, attn.nkv, attn.hd
    rep = nh // nkv
    causal = torch.ones(L, L, dtype=torch.bool, device=aux.device).tril()
    hidden = head.fuse([aux])
    keys, vals, outs = [], [], []
    for j in range(unroll):
        tok = F.pad(next_ids[:, j:], (0, j))
        emb = embed(tok).to(hidden.dtype)
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        pos = torch.arange(j, L + j, device=aux.device).clamp(max=head.rotary.cos.shape[0] - 1)
        q = attn.q_proj(x).view(B, L, nh, d)
        k = attn.k_proj(x).view(B, L, nkv, d)
        v = attn.v_proj(x).view(B, L, nkv, d)
        q, k = (t.flatten(0, 1) for t in head.rotary(pos.repeat(B), q.flatten(0, 1),
                                                        k.flatten(0, 1)))
        q = q.view(B, L, nh, d).transpose(1, 2)  # [B, H, L, d]
        k = k.view(B, L, nkv, d).transpose(1, 2).repeat_interleave(rep, 1)
        v = v.transpose(1, 2).repeat_interleave(rep, 1)
        keys.append(k)
        vals.append(v)
        scale = attn.backend.scale
        s0 = (q @ keys[0].transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]
        p = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)
        o = p[..., :L] @ vals[0]
        for i, vv in enumerate(vals[1:]):
            o = o + p[..., L + i : L + i + 1] * vv
        o = attn.o_proj(o.transpose(1, 2).reshape(B, L, nh * d))
        h = residual + o
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(hidden)
    return outs


def _batch(records: list[Record], device: str, dtype: torch.dtype):
    L = max(len(r.ids) - 1 for r in records)
    B = len(records)
    aux = torch.zeros(B, L, records[0].aux.shape[1], dtype=dtype, device=device)
    hid = torch.zeros(B, L, records[0].hidden.shape[1], dtype=dtype, device=device)
    nxt = torch.zeros(B, L, dtype=torch.int64, device=device)
    valid = torch.zeros(B, L, dtype=torch.bool, device=device)  # position predicts a response
    for b, r in enumerate(records):
        n = len(r.ids) - 1
        aux[b, :n] = r.aux.to(device, dtype)
        hid[b, :n] = r.hidden.to(device, dtype)
        nxt[b, :n] = r.ids[1:].to(device)
        valid[b, max(r.prompt_len - 1, 0) : n] = True
    return aux, hid, nxt, valid


def step_losses(head: Eagle3Head, target, aux, hid, nxt, valid, unroll: int):
    """Soft cross-entropy against the target per unroll step, and top-1 agreement."""
    with torch.no_grad():
        p_t = target.logits(hid).softmax(-1)  # [B, L, V] the target's next-token law
        p_draft = p_t[..., head.draft_to_target]
        t_top = p_t.argmax(-1)
    outs = ttt_forward(head, target.embed_tokens, aux, nxt, unroll)
    losses, accs = [], []
    L = aux.shape[1]
    for j, out in enumerate(outs):
        # Step j at index t predicts the token after x_{t+j+1}: the target law at t+j+1.
        if j + 1 >= L:
            break
        o = out[:, : L - j - 1]
        tgt = p_draft[:, j + 1 :]
        m = valid[:, j + 1 :] & valid[:, : L - j - 1]
        logp = head.logits(o).log_softmax(-1)
        ce = -(tgt * logp).sum(-1)
        losses.append((ce * m).sum() / m.sum().clamp(min=1))
        pred = head.draft_to_target[logp.argmax(-1)]
        # a tensor, not a float: reading it back would wait for the GPU every unroll step
        accs.append(((pred == t_top[:, j + 1 :]) & m).sum() / m.sum().clamp(min=1))
    return losses, accs


def evaluate(head, target, records, unroll, device, dtype, batch_size=16) -> list[float]:
    """Teacher-forced top-1 agreement with the target per unroll step on held-out records."""
    head.eval()
    tot = [0.0] * unroll
    n = 0
    with torch.no_grad():
        for i in range(0, len(records), batch_size):
            chunk = records[i : i + batch_size]
            _, accs = step_losses(head, target, *_batch(chunk, device, dtype), unroll)
            for j, a in enumerate(torch.stack(accs).tolist()):
                tot[j] += a * len(chunk)
            n += len(chunk)
    head.train()
    return [t / max(n, 1) for t in tot]


def expected_acceptance(accs: list[float]) -> float:
    """Tokens per target forward if step j passes with conditional probability accs[j]."""
    out, run = 1.0, 1.0
    for a in accs:
        run *= a
        out += run
    return out


def extend_vocab(head: Eagle3Head, records: list[Record], size: int) -> Eagle3Head:
    """A copy of `head` whose draft vocabulary also holds the most frequent response tokens
    of `records` that it lacks, up to `size` ids in all (fewer where the records hold fewer
    distinct tokens; ties: lower id). Its own rows are kept; a new id's row starts at zero,
    to be learnt (by `fit_lm_head` or a continued training). Not the target's LM head row,
    as a fresh head's do: on the trained head's outputs those rows win the argmax where
    they should not (the shipped head's teacher-forced acceptance fell from 3.34 to 1.31
    on the H200's extended set with 3072 such rows, 3.9 to 2.2 on six CPU answers), where
    a zero logit wins only where every known one is below zero."""
    old = head.draft_to_target.cpu()
    counts = response_counts(records, head.cfg.vocab_size)
    counts[old] = -1
    new = most_frequent(counts, min(max(size - len(old), 0), int((counts > 0).sum())))
    ids = torch.cat([old, new])
    order = ids.argsort()
    dev = head.lm_head.weight.device
    rows = torch.cat([head.lm_head.weight.detach().float(),
                      torch.zeros(len(new), head.lm_head.weight.shape[1], device=dev)])
    cfg = replace(head.cfg, draft_vocab_size=len(ids))
    with torch.device(dev):
        out = Eagle3Head(cfg, head.midlayer.self_attn.backend)
    body = {k: v for k, v in head.state_dict().items()
            if not k.startswith(("lm_head.", "d2t", "t2d"))}
    missing, _ = out.load_state_dict(body, strict=False)
    assert set(missing) <= {"lm_head.weight", "d2t", "t2d"}, missing
    with torch.no_grad():
        out.lm_head.weight.copy_(rows[order.to(dev)].to(out.lm_head.weight.dtype))
    out.set_vocab(ids[order].to(dev))
    return out.to(head.lm_head.weight.dtype).eval()


def fit_lm_head(head: Eagle3Head, target, records: list[Record], *, unroll: int = 3,
                epochs: int = 2, lr: float = 1e-3, batch_size: int = 4096,
                train_ids: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Fit the head's LM head on its frozen body: the chain's outputs (teacher-forced, steps
    0..unroll-1, as `ttt_forward` runs them; the LM head does not feed the chain, so they
    are fixed) against the tokens the target produced there, cross-entropy over the draft
    vocabulary (positions whose token lies outside it are left out). `train_ids`: only the
    rows of these target ids move (the rest stay as trained); None: every row. Cheap
    enough for a CPU: one forward of the body per record, then a linear softmax fit."""
    dev = head.lm_head.weight.device
    d2 = torch.full((head.cfg.vocab_size,), -1, dtype=torch.int64)
    d2[head.draft_to_target.cpu()] = torch.arange(head.cfg.draft_vocab_size)
    feats, labels = [], []
    with torch.no_grad():
        for r in tqdm(records, desc="features", unit="answer"):
            n = len(r.ids) - 1
            outs = ttt_forward(head, target.embed_tokens, r.aux.to(dev, torch.float32)[None],
                               r.ids[1:].to(dev)[None], unroll)
            for j, o in enumerate(outs):
                t = torch.arange(max(r.prompt_len - 1, 0), n - j - 1)
                y = d2[r.ids[t + j + 2]]
                keep = y >= 0
                if keep.any():
                    feats.append(head.norm(o[0, t[keep].to(dev)]).to(torch.bfloat16))
                    labels.append(y[keep].to(dev))
    x_all, y_all = torch.cat(feats), torch.cat(labels)
    w = torch.nn.Parameter(head.lm_head.weight.detach().float().clone())
    frozen = None
    if train_ids is not None:
        frozen = ~torch.isin(head.draft_to_target, train_ids.to(dev))
    opt = torch.optim.Adam([w], lr=lr)
    g = torch.Generator().manual_seed(seed)
    history = []
    for ep in range(epochs):
        perm = torch.randperm(len(y_all), generator=g).to(dev)
        tot = hit = 0.0
        for i in tqdm(range(0, len(perm), batch_size), desc=f"fit lm_head {ep}", unit="batch"):
            idx = perm[i : i + batch_size]
            logits = x_all[idx].float() @ w.T
            loss = F.cross_entropy(logits, y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if frozen is not None:
                w.grad[frozen] = 0
            opt.step()
            tot += loss.item() * len(idx)
            hit += (logits.argmax(-1) == y_all[idx]).sum().item()
        history.append({"epoch": ep, "loss": round(tot / len(perm), 4),
                        "train_top1": round(hit / len(perm), 4)})
        tqdm.write(json.dumps(history[-1]))
    with torch.no_grad():
        head.lm_head.weight.copy_(w.to(head.lm_head.weight.dtype))
    return {"lm_head_fit": history, "fit_positions": len(y_all), "fit_unroll": unroll}


DISTIL_SEQS = 256  # answers self-distilled side by side
DISTIL_SEQ_TOKENS = 1280  # a prompt and its answer, at most, in the KV pool of self-distillation
PLAN_AFTER = 20  # steps timed before a time budget (`max_seconds`) plans the rest
POSTFIX_EVERY = 20  # steps between the progress bar's loss readings
# float32 matmul precision of training on a GPU: "high" lets them run as TF32 on the tensor
# cores (the records' features are bf16 already); "highest" keeps full fp32.
MATMUL_PRECISION = "high"


def _head_backend(block_size: int):
    """The attention backend a head trains with (`Eagle3Config` -> the torch reference)."""
    from engine.attention import TorchAttention

    return lambda c: TorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, block_size)


def train(engine: Engine, train_records, eval_records, vocab_ids, *, unroll=5, epochs=4,
          lr=1e-3, batch_size=16, log_every=50, aux_layers=None,
          init: Eagle3Head | None = None, max_seconds: float | None = None,
          checkpoint=None) -> tuple[Eagle3Head, dict]:
    """Train a head on the records (`init`: continue from this head, its draft vocabulary
    kept; vocab_ids is then ignored). `max_seconds`: fewer steps than `epochs` asks where
    they would not fit, planned from the pace of the first steps (held-out evaluations
    included) and again at every log; the learning-rate schedule ends with the plan.
    `checkpoint(head, entry)`: called after every logged held-out evaluation but the last,
    with the head as it stands and the log entry, so a run cut short still leaves a head."""
    cfg = engine.config
    on_gpu = str(cfg.device).startswith("cuda")
    if on_gpu:
        # The records on the device once (7.2 GB for 4763 answers of ~360 tokens), where each
        # batch copied its 32 answers' features from host memory; and TF32 matmuls.
        train_records = [on_device(r, cfg.device) for r in train_records]
        eval_records = [on_device(r, cfg.device) for r in eval_records]
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(MATMUL_PRECISION)
    try:
        return _train(engine, train_records, eval_records, vocab_ids, unroll=unroll,
                      epochs=epochs, lr=lr, batch_size=batch_size, log_every=log_every,
                      aux_layers=aux_layers, init=init, max_seconds=max_seconds,
                      checkpoint=checkpoint)
    finally:
        if on_gpu:
            torch.set_float32_matmul_precision(precision)


def on_device(r: Record, device) -> Record:
    """The record with its tensors on `device`."""
    return Record(r.ids.to(device), r.prompt_len, r.aux.to(device), r.hidden.to(device))


def _train(engine: Engine, train_records, eval_records, vocab_ids, *, unroll, epochs, lr,
           batch_size, log_every, aux_layers, init, max_seconds,
           checkpoint=None) -> tuple[Eagle3Head, dict]:
    target = engine.model
    cfg = engine.config
    if init is not None:
        head = init.to(cfg.device)
    else:
        hc = Eagle3Config.for_target(cfg.model, len(vocab_ids), aux_layers)
        with torch.device(cfg.device):
            head = Eagle3Head(hc, _head_backend(cfg.block_size)(hc))
        head.set_vocab(vocab_ids.to(cfg.device))
        with torch.no_grad():  # start the draft LM head from the target's rows
            head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids.to(cfg.device)])
            head.norm.weight.copy_(target.norm.weight)
    head = head.to(torch.float32).train()
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    order = sorted(range(len(train_records)), key=lambda i: len(train_records[i].ids))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    asked = epochs * len(batches)
    plan = [asked]  # steps to run: the schedule reads it as it changes
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (
        1 + math.cos(math.pi * min(s / max(plan[0], 1), 1.0))))
    history = []
    if init is not None:  # where the continued head starts, on these held-out records
        ev = evaluate(head, target, eval_records, unroll, cfg.device, torch.float32)
        history.append({"step": 0, "epoch": 0, "loss": None,
                        "eval_acc_per_step": [round(a, 4) for a in ev],
                        "eval_expected_acceptance": round(expected_acceptance(ev), 3)})
        tqdm.write(json.dumps(history[-1]))
    g = torch.Generator().manual_seed(0)
    bar = tqdm(total=asked, desc="train", unit="step")
    step = 0
    t0 = time.perf_counter()
    for ep in range(epochs):
        if step >= plan[0]:
            break
        for bi in torch.randperm(len(batches), generator=g).tolist():
            recs = [train_records[i] for i in batches[bi]]
            losses, accs = step_losses(head, target, *_batch(recs, cfg.device, torch.float32),
                                       unroll)
            loss = sum(0.8**j * lo for j, lo in enumerate(losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            if step % POSTFIX_EVERY == 0 or step == 1:  # each read waits for the GPU
                bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{accs[0].item():.2f}")
            if max_seconds and (step == PLAN_AFTER or step % log_every == 0):
                pace = (time.perf_counter() - t0) / step
                plan[0] = max(step, min(asked, int(max_seconds / pace)))
                bar.total = plan[0]
                bar.refresh()
            if step % log_every == 0 or step == plan[0]:
                ev = evaluate(head, target, eval_records, unroll, cfg.device, torch.float32)
                history.append({"step": step, "epoch": ep, "loss": round(loss.item(), 4),
                                "eval_acc_per_step": [round(a, 4) for a in ev],
                                "eval_expected_acceptance": round(expected_acceptance(ev), 3)})
                tqdm.write(json.dumps(history[-1]))
                if checkpoint is not None and step < plan[0]:
                    checkpoint(head, history[-1])
            if step >= plan[0]:
                break
    bar.close()
    return head.eval(), {"history": history, "steps": step, "steps_asked": asked,
                         "train_seconds": round(time.perf_counter() - t0, 1),
                         "matmul_precision": torch.get_float32_matmul_precision(),
                         "final_lr": sched.get_last_lr()[0]}


def engine_acceptance(engine: Engine, head: Eagle3Head, prompts: list[str], k: int,
                      max_tokens: int) -> dict:
    """Greedy speculative decoding on `prompts`: acceptance length and per-position rates of
    the head's own drafts (context drafts off: copies from the context are not the head's).
    The engine gets the KV blocks every prompt's answer can fill at once, and no more (a
    fixed 8192 was ~6 GB for SmolLM2 in fp32 on a CPU)."""
    from dataclasses import replace

    from engine.config import SpecConfig

    ids = [engine.encode_prompt([{"role": "user", "content": p}]) for p in prompts]
    bs = engine.config.block_size
    blocks = sum(-(-(len(i) + max_tokens + k + 1) // bs) for i in ids)
    spec = Engine(replace(engine.config, spec=SpecConfig(num_tokens=k, dynamic=False,
                                                       context_drafts=False),
                          num_blocks=blocks + 8),
                  weights_of=engine, draft_head=head)
    t0 = time.perf_counter()
    spec.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    st = spec.spec.stats
    return {"k": k, "acceptance_length": round(st.acceptance_length, 3),
            "accept_rate_per_pos": [round(a / max(d, 1), 4) for a, d in
                                    zip(st.accepted_per_pos, st.drafted_per_pos)],
            "verify_steps": st.verify_steps, "kv_blocks": blocks + 8,
            "seconds": round(time.perf_counter() - t0, 2)}


def save_records(path: str, key: dict, train_records: list[Record],
                 eval_records: list[Record]) -> None:
    """Self-distilled records to a file, with what they were made from (`key`), so that
    training can run apart from the generation (another process, another device call)."""
    def pack(rs):
        return [{"ids": r.ids, "prompt_len": r.prompt_len, "aux": r.aux, "hidden": r.hidden}
                for r in rs]
    torch.save({"key": key, "train": pack(train_records), "eval": pack(eval_records)}, path)


def load_records(path: str, key: dict) -> tuple[list[Record], list[Record]]:
    """`save_records`' records; refuses a file made from other prompts, model or length."""
    got = torch.load(path, map_location="cpu", weights_only=True)
    if got["key"] != key:
        raise ValueError(f"{path} holds records of {got['key']}, not {key}")
    return ([Record(**r) for r in got["train"]], [Record(**r) for r in got["eval"]])


def run(args) -> int:
    """The CLI entry: self-distil (or load the records), train, evaluate, save."""
    import os

    from cluster import prompt_sets

    if args.data_only and not args.records:
        print("error: --data-only needs --records FILE to write the records to")
        return 2
    if args.lm_head_only and not args.init:
        print("error: --lm-head-only fits the LM head of an --init head")
        return 2
    bad = _bad_numbers(args)
    if bad:  # before the model loads and the target answers for minutes
        print(f"error: {bad}")
        return 2
    if args.init and not os.path.isfile(os.path.join(args.init, "config.json")):
        print(f"error: --init {args.init}: no EAGLE-3 head there (config.json missing)")
        return 2
    torch.manual_seed(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # On a GPU a KV pool for DISTIL_SEQS answers of up to DISTIL_SEQ_TOKENS, not 85% of the
    # GPU: the training that follows keeps the records on the device (~10 GB for the
    # extended set).
    pool = DISTIL_SEQS * -(-DISTIL_SEQ_TOKENS // EngineConfig.block_size)
    engine = Engine.from_pretrained(args.model, device=device, dtype=torch.float32,
                                    enable_prefix_caching=False, max_num_seqs=DISTIL_SEQS,
                                    max_num_batched_tokens=8192,
                                    num_blocks=pool if device.startswith("cuda") else None)
    extended = args.prompt_set == "extended"
    train_p, eval_p = prompt_sets.build(args.num_prompts, seed=args.seed, extended=extended,
                                        name_split=args.name_split)
    m = engine.config.model
    layers = Eagle3Config.for_target(m, 1).aux_layer_ids
    t0 = time.perf_counter()
    store = torch.bfloat16 if device == "cuda" else torch.float32
    key = {"target": m.name, "prompt_set": args.prompt_set, "num_prompts": args.num_prompts,
           "seed": args.seed, "max_tokens": args.max_tokens, "prompts": [len(train_p),
                                                                       len(eval_p)]}
    if args.name_split:  # records made without it hold other prompts
        key["name_split"] = True
    if args.ignore_eos:  # records made without it stop at the answers' ends
        key["ignore_eos"] = True
    if args.sampled:  # records made without it hold greedy answers only
        key["sampled"] = args.sampled
    if args.records and os.path.exists(args.records):
        tr, ev = load_records(args.records, key)
        print(f"records: {len(tr)} + {len(ev)} from {args.records}")
    else:
        tr = self_distill(engine, train_p, args.max_tokens, layers, store,
                          ignore_eos=args.ignore_eos)
        if args.sampled:  # each training prompt once more, its answer sampled
            tr += self_distill(engine, train_p, args.max_tokens, layers, store,
                               desc="self-distil, sampled", ignore_eos=args.ignore_eos,
                               temperature=args.sampled, seed=args.seed)
        ev = self_distill(engine, eval_p, args.max_tokens, layers, store, desc="held-out",
                          ignore_eos=args.ignore_eos)
        if args.records:
            save_records(args.records, key, tr, ev)
    t_data = time.perf_counter() - t0
    if args.data_only:
        print(f"records: {len(tr)} + {len(ev)} in {t_data:.1f} s -> {args.records}")
        return 0
    init = None
    if args.init:
        init = load_head(args.init, m, _head_backend(engine.config.block_size), device=device)
    added = None
    if init is not None and args.draft_vocab > init.cfg.draft_vocab_size:
        before = init.draft_to_target.cpu()
        init = extend_vocab(init, tr, args.draft_vocab)
        after = init.draft_to_target.cpu()
        added = after[~torch.isin(after, before)]
        print(f"draft vocabulary {len(before)} -> {len(after)}")
    vocab_ids = init.draft_to_target.cpu() if init is not None else \
        draft_vocab(tr, args.draft_vocab, m.vocab_size)
    if len(vocab_ids) * m.hidden_size > ops.LINEAR_MAX_WEIGHT:
        print(f"note: a draft LM head of {len(vocab_ids)} x {m.hidden_size} is larger than "
              f"the fused GEMV takes (ops.LINEAR_MAX_WEIGHT = {ops.LINEAR_MAX_WEIGHT}): "
              "drafting will run it through torch's linear, a launch or more a draft")
    if args.lm_head_only:
        head = init.to(torch.float32)
        info = fit_lm_head(head, engine.model, tr, unroll=min(args.unroll, 3),
                           epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                           train_ids=added)
        ev_acc = evaluate(head, engine.model, ev, args.unroll, device, torch.float32)
        info["eval_acc_per_step"] = [round(a, 4) for a in ev_acc]
        info["eval_expected_acceptance"] = round(expected_acceptance(ev_acc), 3)
        head = head.eval()
    recipe = {
        "command": "tandem " + " ".join(args.argv), "target": m.name, "device": device,
        "prompts": {"train": len(train_p), "held_out": len(eval_p), "set": args.prompt_set,
                    "name_split": args.name_split,
                    "source": "assets/prompt_sets.json.gz (cluster/prompt_sets.py: stdlib "
                              "docs + templated chat/code/JSON)"},
        "init": args.init, "records": args.records,
        "responses": f"target greedy, max {args.max_tokens} tokens"
                     + (f", and once more sampled at temperature {args.sampled}"
                        if args.sampled else "")
                     + (", EOS ignored" if args.ignore_eos else ""),
        "train_tokens": int(sum(len(r.ids) - r.prompt_len for r in tr)),
        "draft_vocab_size": len(vocab_ids), "lm_head_only": args.lm_head_only,
        "unroll": args.unroll, "epochs": args.epochs,
        "lr": args.lr, "batch_size": args.batch_size, "data_seconds": round(t_data, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    if not args.lm_head_only:
        def checkpoint(h, entry):  # the head so far, marked unfinished, replaced at the end
            save_head(h, args.out, dtype=torch.bfloat16, target=m)
            _write(args.out, {**recipe, "unfinished": True, "checkpoint": entry})

        head, info = train(engine, tr, ev, vocab_ids, unroll=args.unroll, epochs=args.epochs,
                           lr=args.lr, batch_size=args.batch_size, log_every=args.log_every,
                           init=init, max_seconds=args.max_seconds, checkpoint=checkpoint)
    recipe.update(info)
    save_head(head, args.out, dtype=torch.bfloat16, target=m)
    _write(args.out, recipe)  # the head is safe before the (slower) acceptance runs
    acc = [engine_acceptance(engine, head, eval_p[: args.eval_prompts], k, args.max_tokens)
           for k in sorted({1, 3, args.k_eval})]
    recipe["held_out_engine_acceptance"] = acc
    _write(args.out, recipe)
    print(json.dumps({"held_out_engine_acceptance": acc}, indent=2))
    return 0


def _bad_numbers(args) -> str | None:
    """What is wrong with the CLI's counts and rates, if anything (None: nothing)."""
    positive = {"--draft-vocab": "draft_vocab", "--max-tokens": "max_tokens",
                "--unroll": "unroll", "--epochs": "epochs", "--batch-size": "batch_size",
                "--log-every": "log_every", "--lr": "lr"}
    for flag, name in positive.items():
        v = getattr(args, name, None)
        if v is not None and not v > 0:
            return f"{flag} must be positive, got {v}"
    for flag, name in {"--max-seconds": "max_seconds", "--num-prompts": "num_prompts"}.items():
        v = getattr(args, name, None)
        if v is not None and not v > 0:
            return f"{flag} must be positive where given, got {v}"
    v = getattr(args, "eval_prompts", None)
    if v is not None and v < 0:
        return f"--eval-prompts must be 0 or more, got {v}"
    v = getattr(args, "sampled", None)
    if v is not None and not (math.isfinite(v) and v >= 0):
        return f"--sampled must be a temperature >= 0, got {v}"
    return None


def _write(folder: str, recipe: dict) -> None:
    with open(f"{folder}/training.json", "w") as f:
        json.dump(recipe, f, indent=2)


def add_parser(sub) -> None:
    p = sub.add_parser("train-eagle3", help="self-distil and train an EAGLE-3 draft head")
    p.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output folder (public EAGLE-3 layout)")
    p.add_argument("--device", default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="cap the prompt set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--unroll", type=int, default=5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="train at most about this long: fewer steps than --epochs asks "
                        "where they would not fit (the schedule shortened to match)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--k-eval", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-set", choices=("base", "extended"), default="base",
                   help="extended: ~3.3x the training prompts (every documentation question, "
                        "more stdlib modules, every template with every filler)")
    p.add_argument("--name-split", action="store_true",
                   help="train on no prompt that shares a documented name with a held-out "
                        "prompt (this set's or the benchmarks'): held-out acceptance then "
                        "measures names the head never saw")
    p.add_argument("--ignore-eos", action="store_true",
                   help="self-distil every answer to --max-tokens, past the target's end of "
                        "turn (what benchmarks that ignore EOS, figure 1's, generate); the "
                        "part before EOS is the same answer as without it")
    p.add_argument("--sampled", type=float, default=0.0, metavar="T",
                   help="also self-distil every training prompt once more with its answer "
                        "sampled at temperature T (other contexts, the target's own "
                        "next-token law as the label still; held-out answers stay greedy); "
                        "twice the records and the time")
    p.add_argument("--records", default=None,
                   help="a file for the self-distilled records: loaded when it exists (and "
                        "was made from the same prompts, model and length), else written")
    p.add_argument("--data-only", action="store_true",
                   help="stop after writing --records (train in a later run)")
    p.add_argument("--init", default=None,
                   help="continue training from this head folder (its draft vocabulary, "
                        "grown to --draft-vocab ids where that is larger: the records' most "
                        "frequent tokens it lacks, its trained rows kept)")
    p.add_argument("--lm-head-only", action="store_true",
                   help="with --init: fit only the LM head on the head's frozen body "
                        "(the rows --draft-vocab added, or every row), a linear fit cheap "
                        "enough for a CPU; --epochs, --lr and --batch-size (use ~4096) apply")
    p.set_defaults(fn=run)
