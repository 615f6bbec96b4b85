"""Teacher-forced ceiling of a draft tree against today's chain, per prompt domain.

The shipped EAGLE-3 head is unrolled along the target's own greedy answers (the training-time
test of `cluster/eagle3/ttt.py`: at depth j > 1 it consumes its own hidden states and the true
tokens, which is what the node on the true path of any tree sees). Per depth j and k it counts
where the target's token is among the head's top-k draft tokens (mapped to target ids; a token
outside the draft vocabulary is a miss), marginally and jointly over depths 1..j from one root.
Tokens per target forward of a tree along the true path: 1 + sum_d P(hits at depths 1..d).

    .venv/bin/python bench/tree_ceiling.py --per-domain 14 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from cluster import prompt_sets
from cluster.eagle3.loop import head_backend
from cluster.eagle3.records import self_distill
from cluster.eagle3.ttt import batch, evaluate, expected_acceptance, ttt_forward
from engine import Engine
from engine.spec.eagle3 import Eagle3Config
from engine.spec.head_io import load_head

HEAD = "assets/eagle3-smollm2-135m-instruct"
KS = (1, 2, 3, 4)
DEPTH = 7


def record_counts(head, target, rec) -> dict:
    """One record's counts. marg[k, j] hits and marg_n[j] positions at depth j+1 (ttt's
    masks); joint[k, j]: roots whose depths 1..j+1 all hit in the top-k, first[k, j]: depth 1
    in the top-k and depths 2..j+1 top-1 hits (top-k then chain), over `roots` roots with all
    DEPTH depths inside the record."""
    aux, hid, nxt, valid = batch([rec], "cpu", torch.float32)
    L = aux.shape[1]
    with torch.no_grad():
        t_top = target.logits(hid).argmax(-1)[0]
        outs = ttt_forward(head, target.embed_tokens, aux, nxt, DEPTH)
        marg = torch.zeros(len(KS), DEPTH)
        marg_n = torch.zeros(DEPTH)
        roots = max(L - DEPTH, 0)
        hit = torch.zeros(len(KS), DEPTH, roots, dtype=torch.bool)
        ok = valid[0, :roots]  # roots that predict a response token
        for j, out in enumerate(outs):
            if j + 1 >= L:
                break
            top = head.logits(out[0, : L - j - 1]).topk(max(KS), -1).indices
            eq = head.draft_to_target[top] == t_top[j + 1 :, None]  # [positions, max k]
            m = valid[0, j + 1 :] & valid[0, : L - j - 1]
            marg_n[j] = m.sum()
            for i, k in enumerate(KS):
                h = eq[:, :k].any(-1)
                marg[i, j] = (h & m).sum()
                hit[i, j] = h[:roots]
        hit &= ok
        hit = hit.long()
        joint = hit.cumprod(1).sum(-1).float()
        first = (hit[:, :1] & hit[0, 1:].cumprod(0)[None]).sum(-1).float()
        first = torch.cat([joint[:, :1], first], 1)
    return {"marg": marg, "marg_n": marg_n, "joint": joint, "first": first,
            "roots": float(ok.sum())}


def summary(counts: list[dict]) -> dict:
    """Pooled rates and tokens per forward for a list of records' counts."""
    marg = sum(c["marg"] for c in counts) / sum(c["marg_n"] for c in counts).clamp(min=1)
    roots = max(sum(c["roots"] for c in counts), 1.0)
    joint = sum(c["joint"] for c in counts) / roots  # P(hits at depths 1..d)
    first = sum(c["first"] for c in counts) / roots
    cond = joint / torch.cat([torch.ones(len(KS), 1), joint[:, :-1]], 1).clamp(min=1e-9)
    r = lambda t: [round(float(x), 4) for x in t]  # noqa: E731
    out = {"positions": int(sum(c["marg_n"][0] for c in counts)), "roots": int(roots),
           "chain_ttt_expected_acceptance": {d: round(expected_acceptance(r(marg[0, :d])), 3)
                                             for d in (5, 7)}}
    for i, k in enumerate(KS):
        out[f"k{k}"] = {
            "marginal_per_depth": r(marg[i]), "conditional_per_depth": r(cond[i]),
            "tokens_per_forward": {d: round(1 + float(joint[i, :d].sum()), 3) for d in (5, 7)},
            "tree_nodes": {d: sum(k ** j for j in range(1, d + 1)) for d in (5, 7)},
            "topk_then_chain": {d: {"tokens_per_forward": round(1 + float(first[i, :d].sum()),
                                                                3), "nodes": k * d}
                                for d in (5, 7)}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-domain", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = args.out or f"bench/results/profile/tree_ceiling_{commit}.json"
    t0 = time.time()
    engine = Engine.from_pretrained(None, device="cpu", dtype=torch.float32,
                                    enable_prefix_caching=False, max_num_seqs=32,
                                    max_num_batched_tokens=8192)
    m = engine.config.model
    head = load_head(HEAD, m, head_backend(engine.config.block_size)).eval()
    layers = Eagle3Config.for_target(m, 1).aux_layer_ids
    # held-out sides only: what `tandem train-eagle3 --domains` evaluates on, never trains on
    held = {d: h[: args.per_domain] for d, (_, h) in prompt_sets.domains().items()}
    result, everything = {}, []
    for d, prompts in held.items():
        t1 = time.time()
        recs = self_distill(engine, prompts, args.max_tokens, layers, torch.float32,
                            desc=d, ignore_eos=args.ignore_eos)
        counts = [record_counts(head, engine.model, r) for r in recs]
        everything += counts
        res = summary(counts)
        # sanity: ttt.evaluate (one record a batch: a mean over records of top-1 agreement)
        ev = evaluate(head, engine.model, recs, DEPTH, "cpu", torch.float32, batch_size=1)
        mine = torch.stack([c["marg"][0] / c["marg_n"].clamp(min=1) for c in counts]).mean(0)
        res["sanity"] = {"ttt_evaluate_top1": [round(a, 4) for a in ev],
                         "same_records_record_mean_top1": [round(float(a), 4) for a in mine],
                         "ttt_expected_acceptance_d5": round(expected_acceptance(ev[:5]), 3),
                         "ttt_expected_acceptance_d7": round(expected_acceptance(ev), 3)}
        res["prompts"] = len(recs)
        res["answer_tokens"] = sum(len(r.ids) - r.prompt_len for r in recs)
        res["seconds"] = round(time.time() - t1, 1)
        result[d] = res
        k = {f"k{k}": res[f"k{k}"]["tokens_per_forward"][5] for k in KS}
        print(d, res["answer_tokens"], "tokens", k, res["sanity"]["ttt_expected_acceptance_d5"],
              f"{res['seconds']} s", flush=True)
    result["all"] = summary(everything)
    doc = {"name": "tree_ceiling", "command": " ".join([sys.executable.split("/")[-1],
                                                         *sys.argv]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit,
           "environment": {"python": platform.python_version(), "torch": torch.__version__,
                           "platform": platform.platform(), "cpu_threads": args.threads,
                           "cores": os.cpu_count(), "device": "cpu", "dtype": "float32"},
           "target": m.name, "head": HEAD, "draft_vocab": len(head.draft_to_target),
           "prompts": f"first {args.per_domain} held-out prompts per domain "
                      "(cluster/prompt_sets.py domains())",
           "answers": f"target greedy, max {args.max_tokens} tokens"
                      + (", EOS ignored" if args.ignore_eos else ", to EOS"),
           "depth": DEPTH, "ks": list(KS), "seconds": round(time.time() - t0, 1),
           "domains": result}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
