"""A trained head's draft vocabulary grown from the records, and its LM head refitted on the
frozen body (cheap enough for a CPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cluster.eagle3.records import Record, most_frequent, response_counts
from cluster.eagle3.ttt import ttt_forward
from engine.spec.eagle3 import Eagle3Head


def extend_vocab(head: Eagle3Head, records: list[Record], size: int) -> Eagle3Head:
    """A copy of `head` whose draft vocabulary adds the most frequent response tokens of
    `records` it lacks, up to `size` ids in all (ties: lower id). Existing rows are kept; new
    rows start at zero, to be learnt, since the target's LM head rows would wrongly win the
    argmax on the trained head's outputs."""
    old = head.draft_to_target.cpu()
    counts = response_counts(records, head.cfg.vocab_size)
    counts[old] = -1
    new = most_frequent(counts, min(max(size - len(old), 0), int((counts > 0).sum())))
    return with_vocab(head, torch.cat([old, new]))


def revise_vocab(head: Eagle3Head, records: list[Record], size: int) -> Eagle3Head:
    """A copy of `head` whose draft vocabulary is the `size` most frequent response tokens of
    `records` (ties: lower id): for a head trained on other answers, whose vocabulary lacks
    the new data's frequent tokens while holding tokens it seldom uses. Rows of the tokens it
    keeps are kept, the others start at zero (as `extend_vocab`'s)."""
    return with_vocab(head, most_frequent(response_counts(records, head.cfg.vocab_size), size))


def with_vocab(head: Eagle3Head, ids: torch.Tensor) -> Eagle3Head:
    """A copy of `head` drafting target ids `ids` (any order; stored sorted): the trained
    rows of the ids it had, zero rows for the others; the body as it was."""
    old = head.draft_to_target.cpu()
    ids = ids.cpu().unique()  # sorted
    dev = head.lm_head.weight.device
    at = torch.full((head.cfg.vocab_size,), -1, dtype=torch.int64)
    at[old] = torch.arange(len(old))
    src = at[ids]
    rows = torch.zeros(len(ids), head.lm_head.weight.shape[1], device=dev)
    kept = src >= 0
    rows[kept.to(dev)] = head.lm_head.weight.detach().float()[src[kept].to(dev)]
    cfg = replace(head.cfg, draft_vocab_size=len(ids))
    with torch.device(dev):
        out = Eagle3Head(cfg, head.midlayer.self_attn.backend)
    body = {k: v for k, v in head.state_dict().items()
            if not k.startswith(("lm_head.", "d2t", "t2d"))}
    missing, _ = out.load_state_dict(body, strict=False)
    assert set(missing) <= {"lm_head.weight", "d2t", "t2d"}, missing
    with torch.no_grad():
        out.lm_head.weight.copy_(rows.to(out.lm_head.weight.dtype))
    out.set_vocab(ids.to(dev))
    return out.to(head.lm_head.weight.dtype).eval()


def fit_lm_head(head: Eagle3Head, target, records: list[Record], *, unroll: int = 3,
                epochs: int = 2, lr: float = 1e-3, batch_size: int = 4096,
                train_ids: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Fit the head's LM head on its frozen body: the teacher-forced chain outputs (steps
    0..unroll-1) against the target's tokens, cross-entropy over the draft vocabulary (tokens
    outside it left out). `train_ids`: only these target ids' rows move; None: every row. Cheap
    enough for a CPU."""
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
