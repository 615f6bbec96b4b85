"""The head's "training-time test" unroll: at step j it consumes its own hidden state from
step j-1 (and the true next token), attending to the true-feature keys before it plus its own
chain, the pattern it meets when drafting. Its losses against the target's next-token law, and
teacher-forced accuracy per step on held-out records."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.eagle3.records import Record
from engine.spec.eagle3 import Eagle3Head


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


# Attention scores a batch may hold per record of its batch size: a batch of records longer
# than 1024 positions holds fewer of them (each unroll step keeps a [B, H, L, L] score tensor).
PAIRS_PER_RECORD = 1024 * 1024


def plan_batches(lengths: list[int], batch_size: int, by_length: bool = True
                 ) -> list[list[int]]:
    """Indices of records in batches of at most `batch_size` and at most batch_size *
    PAIRS_PER_RECORD score pairs (B * L * L, L the batch's longest); `by_length`: sorted by
    length first (stable), else in their order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if by_length \
        else range(len(lengths))
    out: list[list[int]] = []
    longest = 0
    for i in order:
        L = max(longest, lengths[i])
        if not out or len(out[-1]) == batch_size or \
                (len(out[-1]) + 1) * L * L > batch_size * PAIRS_PER_RECORD:
            out.append([])
            L = lengths[i]
        out[-1].append(i)
        longest = L
    return out


def batch(records: list[Record], device: str, dtype: torch.dtype):
    """Records padded into one batch: aux [B, L, 3h], hidden [B, L, h], next ids [B, L] and
    which positions predict a response token."""
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


def step_losses(head: Eagle3Head, target, aux, hid, nxt, valid, unroll: int,
                hits: list | None = None):
    """Soft cross-entropy against the target per unroll step, and top-1 agreement. `hits`:
    a list that gets, per step j, whether the draft at each root t ([B, L - j - 1]) equals the
    target's token at t + j + 1 (where both positions predict response tokens)."""
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
        hit = (pred == t_top[:, j + 1 :]) & m
        if hits is not None:
            hits.append(hit)
        # a tensor, not a float: reading it back would wait for the GPU every unroll step
        accs.append(hit.sum() / m.sum().clamp(min=1))
    return losses, accs


@dataclass
class Evaluation:
    acc_per_step: list[float]  # top-1 agreement per unroll step (a record's mean, averaged)
    # Tokens per target forward of a chain of `unroll` drafts, measured: 1 + the mean, over
    # roots whose every step lies in their record, of the hits in a row from step 1.
    tokens_per_forward: float

    def entry(self) -> dict:
        """The log entry's evaluation fields. eval_expected_acceptance multiplies the
        per-step rates as if independent; hits cluster, so the measured value reads higher."""
        return {"eval_acc_per_step": [round(a, 4) for a in self.acc_per_step],
                "eval_expected_acceptance": round(expected_acceptance(self.acc_per_step), 3),
                "eval_tokens_per_forward": round(self.tokens_per_forward, 3)}


def evaluate(head, target, records, unroll, device, dtype, batch_size=16) -> Evaluation:
    """Teacher-forced top-1 agreement with the target per unroll step on held-out records, and
    the chain's tokens per forward (`Evaluation`)."""
    head.eval()
    tot = [0.0] * unroll
    n, runs, roots = 0, 0.0, 0.0
    with torch.no_grad():
        for idx in plan_batches([len(r.ids) for r in records], batch_size, by_length=False):
            chunk = [records[i] for i in idx]
            aux, hid, nxt, valid = batch(chunk, device, dtype)
            hits: list[torch.Tensor] = []
            _, accs = step_losses(head, target, aux, hid, nxt, valid, unroll, hits)
            for j, a in enumerate(torch.stack(accs).tolist()):
                tot[j] += a * len(chunk)
            n += len(chunk)
            got = chain_runs(hits, valid, unroll)
            if got is not None:
                runs, roots = runs + got[0], roots + got[1]
    head.train()
    return Evaluation([t / max(n, 1) for t in tot], 1.0 + runs / max(roots, 1.0))


def chain_runs(hits: list[torch.Tensor], valid: torch.Tensor, unroll: int
               ) -> tuple[float, float] | None:
    """(hits in a row from step 1, summed over roots; roots): the roots t whose steps all lie
    among positions predicting response tokens (t and t + unroll valid). None: no such root
    (records shorter than the unroll)."""
    L = valid.shape[1]
    if len(hits) < unroll or L <= unroll:
        return None
    n = L - unroll
    h = torch.stack([x[:, :n] for x in hits]).long()  # [unroll, B, n]
    ok = valid[:, :n] & valid[:, unroll:]
    run = h.cumprod(0).sum(0)
    return float((run * ok).sum()), float(ok.sum())


def expected_acceptance(accs: list[float]) -> float:
    """Tokens per target forward if step j passes with conditional probability accs[j]."""
    out, run = 1.0, 1.0
    for a in accs:
        run *= a
        out += run
    return out
