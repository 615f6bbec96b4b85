"""Teacher-forced: does the fused step's choice between context drafts and the head's pay, and
would another rule pay more? Per domain, along the target's own greedy answers (CPU fp32, the
shipped head): at each root, the run of hits in a row (up to K=5) of the head's chain and of
the context copy (`ngram.ngram_match` over the history, then `continue_copy`), and tokens per
forward 1 + mean run under: head only, context only where it matches, today's rule (context
where 3-4 tokens match, else the head), other rules, and the per-root best of the two (of
three with a branch through the head's second-best first draft: what verifying them all
would give).

    .venv/bin/python bench/context_choice.py --per-domain 14 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

from cluster import prompt_sets
from cluster.eagle3.loop import head_backend
from cluster.eagle3.records import self_distill
from cluster.eagle3.ttt import batch, ttt_forward
from engine import Engine
from engine.spec.eagle3 import Eagle3Config
from engine.spec.head_io import load_head
from engine.spec.ngram import continue_copy, ngram_match

HEAD = "assets/eagle3-smollm2-135m-instruct"
K = 5
TAUS = (0.3, 0.5, 0.7, 0.9)


def run_length(drafts: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        n += 1
    return n


def record_rows(head, target, rec) -> list[tuple]:
    """Per root i (the target's token at i + 1 just known, drafts for i + 2 ..): (head run,
    head's probability of its first draft, context match length, context run, run of the
    branch through the head's second-best first draft)."""
    aux, hid, nxt, valid = batch([rec], "cpu", torch.float32)
    L = aux.shape[1]
    ids = rec.ids.tolist()
    with torch.no_grad():
        t_top = target.logits(hid).argmax(-1)[0]
        outs = ttt_forward(head, target.embed_tokens, aux, nxt, K)
        tops, p1, second = [], None, None
        for j, out in enumerate(outs):
            logits = head.logits(out[0, : L - j - 1])
            tops.append(head.draft_to_target[logits.argmax(-1)])
            if j == 0:
                p1 = logits.softmax(-1).max(-1).values
                second = head.draft_to_target[logits.topk(2, -1).indices[:, 1]]
    rows = []
    for i in range(max(rec.prompt_len - 2, 0), L - K):
        if not valid[0, i + 1]:
            continue
        truth = [int(t_top[i + d]) for d in range(1, K + 1)]
        chain = [int(tops[d - 1][i]) for d in range(1, K + 1)]
        head_run = run_length(chain, truth)
        # top-2 at depth 1, then the chain: along the true path, the depth-2.. drafts after a
        # second-best hit are those the teacher-forced chain makes
        top2_run = 1 + run_length(chain[1:], truth[1:]) if int(second[i]) == truth[0] else 0
        hist = ids[: i + 2]
        n, end = ngram_match(hist, 4, 2)
        ctx_run = run_length(continue_copy(hist, end, K), truth) if n else 0
        rows.append((head_run, float(p1[i]), n, ctx_run, top2_run))
    return rows


def rules(rows: list[tuple]) -> dict:
    """Tokens per forward (1 + mean run) of each way to pick between the two."""
    if not rows:
        return {}
    mean = lambda xs: round(1 + sum(xs) / len(xs), 3)  # noqa: E731
    out = {
        "head_only": mean([h for h, *_ in rows]),
        "today_context_if_3_to_4_match": mean([c if n >= 3 else h for h, _, n, c, _ in rows]),
        "context_if_2_to_4_match": mean([c if n >= 2 else h for h, _, n, c, _ in rows]),
        "context_if_4_match": mean([c if n >= 4 else h for h, _, n, c, _ in rows]),
        "best_of_both": mean([max(h, c if n >= 2 else 0) for h, _, n, c, _ in rows]),
        "best_of_today_and_top2": mean([max(c if n >= 3 else h, t) for h, _, n, c, t in rows]),
        "best_of_head_context_top2": mean([max(h, c if n >= 2 else 0, t)
                                           for h, _, n, c, t in rows]),
    }
    for tau in TAUS:
        out[f"context_if_3_match_and_head_p1_below_{tau}"] = mean(
            [c if n >= 3 and p < tau else h for h, p, n, c, _ in rows])
    matched = [(h, c) for h, _, n, c, _ in rows if n >= 3]
    out["roots"] = len(rows)
    out["share_with_3_match"] = round(len(matched) / len(rows), 3)
    if matched:
        out["where_3_match_head_vs_context"] = [mean([h for h, _ in matched]),
                                                mean([c for _, c in matched])]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-domain", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true", help="answers run to --max-tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    tail = "_ignore_eos" if args.ignore_eos else ""
    out = args.out or f"bench/results/profile/context_choice_{commit}{tail}.json"
    t0 = time.time()
    engine = Engine.from_pretrained(None, device="cpu", dtype=torch.float32,
                                    enable_prefix_caching=False, max_num_seqs=32,
                                    max_num_batched_tokens=8192)
    m = engine.config.model
    head = load_head(HEAD, m, head_backend(engine.config.block_size)).eval()
    layers = Eagle3Config.for_target(m, 1).aux_layer_ids
    held = {d: h[: args.per_domain] for d, (_, h) in prompt_sets.domains().items()}
    result, everything = {}, []
    for d, prompts in held.items():
        recs = self_distill(engine, prompts, args.max_tokens, layers, torch.float32, desc=d,
                            ignore_eos=args.ignore_eos)
        rows = [r for rec in recs for r in record_rows(head, engine.model, rec)]
        everything += rows
        result[d] = rules(rows)
        print(d, json.dumps(result[d]), flush=True)
    result["all"] = rules(everything)
    print("all", json.dumps(result["all"]), flush=True)
    doc = {"name": "context_choice", "command": " ".join(["python", *sys.argv]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit,
           "environment": {"python": platform.python_version(), "torch": torch.__version__,
                           "platform": platform.platform(), "device": "cpu",
                           "dtype": "float32"},
           "head": HEAD, "k": K, "prompts": f"first {args.per_domain} held-out prompts per "
           "domain", "answers": f"target greedy, max {args.max_tokens} tokens"
           + (", EOS ignored" if args.ignore_eos else ", to EOS"),
           "seconds": round(time.time() - t0, 1), "domains": result}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
