"""`tandem train-eagle3`: self-distil an EAGLE-3 head for a target with the engine itself.

1. The target answers a prompt set greedily; hidden states and aux taps are captured from
   the same forwards (`cluster/eagle3/records.py`).
2. The draft vocabulary is the responses' most frequent next tokens.
3. The head trains with the multi-step "training-time test" unroll (`cluster/eagle3/ttt.py`).
4. Held-out prompts give per-step accuracy during training and engine acceptance at the end;
   the head is written in the public layout (`engine/spec/head_io.py`).

The prompts: the general set (`--prompt-set`), or a mix of domains (`--domains`, from
`cluster.prompt_sets.domains()`: code completion, multi-turn chat, JSON, summarization of long
inputs, math, general), each evaluated on its own held-out side. A run that must fit calls of
limited time takes `--resume --stop-after SECONDS`: it keeps its records a chunk at a time and
its training state in --out, and ends with exit status 3 until done (each run finishes at
least one chunk or step first, so a short limit still gets on); the same command run again
goes on where the last one stopped, on the same schedule:

    until tandem train-eagle3 --domains code,chat,json,summarize,math,general:3000 \
        --ignore-eos --out runs/head --resume --stop-after 420; do [ $? = 3 ] || break; done
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import replace

import torch

from cluster.eagle3 import resume
from cluster.eagle3.checks import refused
from cluster.eagle3.loop import head_backend, train
from cluster.eagle3.records import (
    SavedFileError,
    draft_vocab,
    load_records,
    save_records,
    self_distill,
)
from cluster.eagle3.ttt import evaluate
from cluster.eagle3.vocab import extend_vocab, fit_lm_head, revise_vocab
from cluster.subcommands import one_line
from engine import Engine, EngineConfig, SamplingParams, jit_watch, ops
from engine.config import SpecConfig
from engine.spec.eagle3 import Eagle3Config, Eagle3Head
from engine.spec.head_io import load_head, save_head

DISTIL_SEQS = 256  # answers self-distilled side by side
DISTIL_SEQ_TOKENS = 1280  # a prompt and its answer, at most, in the KV pool of self-distillation
UNFINISHED = 3  # exit status of a run --stop-after ended: the same command goes on from there


def run(args) -> int:
    """The CLI entry: self-distil (or load the records), train, evaluate, save."""
    bad = refused(args)
    if bad:  # before the model loads and the target answers for minutes
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    stop = _stopper(args)
    torch.manual_seed(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # On a GPU a KV pool for DISTIL_SEQS answers of up to DISTIL_SEQ_TOKENS, not 85% of the
    # GPU: the training that follows keeps the records on the device.
    pool = DISTIL_SEQS * -(-DISTIL_SEQ_TOKENS // EngineConfig.block_size)
    try:
        engine = Engine.from_pretrained(args.model, device=device, dtype=torch.float32,
                                        enable_prefix_caching=False, max_num_seqs=DISTIL_SEQS,
                                        max_num_batched_tokens=8192,
                                        num_blocks=pool if device.startswith("cuda") else None)
    except Exception as e:  # noqa: BLE001 - not a model the engine reads (format, header, size)
        print(f"error: --model {args.model or '(embedded)'}: {one_line(e)}", file=sys.stderr)
        return 2
    train_p, eval_p, held = _prompts(args)
    m = engine.config.model
    if args.draft_vocab > m.vocab_size:  # before the target answers for minutes
        print(f"error: --draft-vocab {args.draft_vocab}: the model has {m.vocab_size} ids",
              file=sys.stderr)
        return 2
    try:  # a head of another shape or layout: refused before the target answers for minutes
        init = load_head(args.init, m, head_backend(engine.config.block_size),
                         device=device) if args.init else None
    except Exception as e:  # noqa: BLE001 - missing weights, a config of another target, ...
        print(f"error: --init {args.init}: {one_line(e)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    key = _records_key(args, engine, train_p, eval_p)
    try:  # a saved state or records file that cannot be used: refused before any distilling
        resumed = _resumed(args, key)
        got = _records(args, engine, train_p, eval_p, device, key, stop)
    except SavedFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if got is None:
        return _unfinished("self-distillation")
    tr, ev = got
    t_data = time.perf_counter() - t0
    if args.data_only:
        print(f"records: {len(tr)} + {len(ev)} in {t_data:.1f} s -> "
              f"{args.records or os.path.join(args.out, 'records')}")
        return 0
    engine = _weights_only(engine)  # self-distillation's KV pool and graphs go back
    init, added = _grown(args, init, tr)
    vocab_ids = init.draft_to_target.cpu() if init is not None else \
        draft_vocab(tr, args.draft_vocab, m.vocab_size)
    if len(vocab_ids) * m.hidden_size > ops.LINEAR_MAX_WEIGHT:
        print(f"note: a draft LM head of {len(vocab_ids)} x {m.hidden_size} is larger than "
              f"the fused GEMV takes (ops.LINEAR_MAX_WEIGHT = {ops.LINEAR_MAX_WEIGHT}): "
              "drafting will run it through torch's linear, a launch or more a draft")
    recipe = _recipe(args, m.name, device, train_p, eval_p, tr, len(vocab_ids), t_data)
    if args.lm_head_only:
        head = init.to(torch.float32)
        info = fit_lm_head(head, engine.model, tr, unroll=min(args.unroll, 3),
                           epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                           train_ids=added)
        info.update(evaluate(head, engine.model, ev, args.unroll, device,
                             torch.float32).entry())
        head = head.eval()
    else:
        def checkpoint(h, entry):  # the head so far, marked unfinished, replaced at the end
            save_head(h, args.out, dtype=torch.bfloat16, target=m)
            _write(args.out, {**recipe, "unfinished": True, "checkpoint": entry})

        head, info = train(engine, tr, ev, vocab_ids, unroll=args.unroll, epochs=args.epochs,
                           lr=args.lr, batch_size=args.batch_size, log_every=args.log_every,
                           init=init, max_seconds=args.max_seconds, checkpoint=checkpoint,
                           stop=stop, **resumed)
        if info["stopped"]:
            save_head(head, args.out, dtype=torch.bfloat16, target=m)
            _write(args.out, {**recipe, **info, "unfinished": True})
            return _unfinished(f"training at step {info['steps']} of {info['steps_asked']}")
    recipe.update(info)
    save_head(head, args.out, dtype=torch.bfloat16, target=m)
    _write(args.out, recipe)  # the head is safe before the (slower) acceptance runs
    # The records, the optimizer and any resumed state go back to the device: on an 80 GB GPU
    # the acceptance engines' first launches otherwise ran out of memory.
    held_gb = _device_gb(device)
    del tr, ev, got, init, resumed
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        print(f"device memory: {held_gb:.1f} GB reserved while training; for the held-out "
              f"acceptance runs {_device_gb(device):.1f} GB reserved, "
              f"{torch.cuda.mem_get_info(device)[0] / 1e9:.1f} GB free")
    ks = sorted({1, 3, args.k_eval})
    sets = {d: ps[: args.eval_prompts] for d, ps in (held or {None: eval_p}).items()}
    with jit_watch.starting_up():  # eager engines of their own: their compiles stall nobody
        accept = {d: [engine_acceptance(engine, head, ps, k, args.max_tokens) for k in ks]
                  if ps else None for d, ps in sets.items()}  # None: no prompt to measure on
    if not any(sets.values()):
        print("held-out engine acceptance: not measured (no held-out prompts)")
    recipe["held_out_engine_acceptance"] = accept if held else accept[None]
    _write(args.out, recipe)
    print(json.dumps({"held_out_engine_acceptance": recipe["held_out_engine_acceptance"]},
                     indent=2))
    return 0


def _prompts(args) -> tuple[list, list, dict | None]:
    """(training prompts, held-out prompts, {domain: held-out prompts} or None): the domain
    mix of --domains, else the general set."""
    from cluster import prompt_sets

    if getattr(args, "domains", None):
        train_p, held = prompt_sets.mix(args.domains, seed=args.seed)
        return train_p, [msgs for ps in held.values() for msgs in ps], held
    train_p, eval_p = prompt_sets.build(args.num_prompts, seed=args.seed,
                                        extended=args.prompt_set == "extended",
                                        name_split=args.name_split)
    return train_p, eval_p, None


def _stopper(args):
    """--stop-after's `stop()`: true once this run has taken that long (None: no limit)."""
    limit = getattr(args, "stop_after", None)
    if not limit:
        return None
    end = time.monotonic() + limit
    return lambda: time.monotonic() >= end


def _resumed(args, key: dict) -> dict:
    """With --resume: train()'s state saved in --out by an earlier run of these settings (if
    any) and the callback that saves it there."""
    if not getattr(args, "resume", False):
        return {}
    path = os.path.join(args.out, "resume.pt")
    key = {"records": key, **{k: getattr(args, k, None) for k in (
        "init", "draft_vocab", "revocab", "unroll", "epochs", "lr", "batch_size", "max_seconds",
        "log_every")}}
    state = resume.load_state(path, key)
    if state is not None:
        print(f"resuming training at step {state['step']} of {state['plan']}")
    return {"state": state, "save_state": lambda st: resume.save_state(path, key, st)}


def _unfinished(what: str) -> int:
    print(f"stopped in {what} (--stop-after): run the same command again to go on")
    return UNFINISHED


def _records_key(args, engine: Engine, train_p: list, eval_p: list) -> dict:
    """What records are made from: records of another key hold other answers."""
    key = {"target": engine.config.model.name, "prompt_set": args.prompt_set,
           "num_prompts": args.num_prompts, "seed": args.seed, "max_tokens": args.max_tokens,
           "prompts": [len(train_p), len(eval_p)]}
    if getattr(args, "domains", None):
        key["domains"] = args.domains
    if args.name_split:  # records made without it hold other prompts
        key["name_split"] = True
    if args.ignore_eos:  # records made without it stop at the answers' ends
        key["ignore_eos"] = True
    if args.sampled:  # records made without it hold greedy answers only
        key["sampled"] = args.sampled
    return key


def _records(args, engine: Engine, train_p: list, eval_p: list, device: str, key: dict,
             stop=None):
    """The training and held-out records: loaded from --records where that file exists (and
    was made from the same `key`), else self-distilled (and written there when --records is
    given). With --resume each part is self-distilled a chunk at a time into --out/records,
    where a later run finds the chunks done; None where `stop()` ended it first."""
    if args.records and os.path.exists(args.records):
        tr, ev = load_records(args.records, key)
        print(f"records: {len(tr)} + {len(ev)} from {args.records}")
        return tr, ev
    layers = Eagle3Config.for_target(engine.config.model, 1).aux_layer_ids
    store = torch.bfloat16 if device == "cuda" else torch.float32

    def distil(desc: str, **kw):
        return lambda ps: self_distill(engine, ps, args.max_tokens, layers, store, desc=desc,
                                       ignore_eos=args.ignore_eos, **kw)

    parts = [("train", train_p, distil("self-distil"))]
    if args.sampled:  # each training prompt once more, its answer sampled
        parts.append(("sampled", train_p, distil("self-distil, sampled",
                                                 temperature=args.sampled, seed=args.seed)))
    parts.append(("eval", eval_p, distil("held-out")))
    if getattr(args, "resume", False):
        folder = os.path.join(args.out, "records")
        got = []
        for part, ps, fn in parts:
            got.append(resume.distill_chunks(folder, part, key, ps, fn, stop))
            if got[-1] is None:  # stopped: the next part waits for the next run
                return None
    else:
        got = [fn(ps) for _, ps, fn in parts]
    tr, ev = [r for g in got[:-1] for r in g], got[-1]
    if args.records:
        save_records(args.records, key, tr, ev)
    return tr, ev


def _grown(args, init, tr):
    """The --init head (None without one), its draft vocabulary grown to --draft-vocab ids
    where that is larger (with --revocab: rebuilt from these records' answers), and the
    target ids that added (None where the vocabulary stayed as it was)."""
    if init is None:
        return None, None
    revise = getattr(args, "revocab", False)
    if args.draft_vocab <= init.cfg.draft_vocab_size and not revise:
        return init, None
    before = init.draft_to_target.cpu()
    init = (revise_vocab if revise else extend_vocab)(init, tr, args.draft_vocab)
    after = init.draft_to_target.cpu()
    added = after[~torch.isin(after, before)]
    print(f"draft vocabulary {len(before)} -> {len(after)} ids, {len(added)} new")
    return init, added


def _recipe(args, target: str, device: str, train_p, eval_p, tr, vocab_size: int,
            t_data: float) -> dict:
    """What training.json records of how the head was made."""
    return {
        "command": "tandem " + " ".join(args.argv), "target": target, "device": device,
        "prompts": {"train": len(train_p), "held_out": len(eval_p),
                    "set": "domains" if getattr(args, "domains", None) else args.prompt_set,
                    "name_split": args.name_split,
                    "source": "assets/prompt_sets.json.gz (cluster/prompt_sets.py: stdlib "
                              "docs + templated chat/code/JSON)"},
        **({"domains": args.domains, "domains_source": "assets/prompt_domains.json.gz "
            "(cluster/prompt_domains.py) + the general set"}
           if getattr(args, "domains", None) else {}),
        "init": args.init, "records": args.records,
        "responses": f"target greedy, max {args.max_tokens} tokens"
                     + (f", and once more sampled at temperature {args.sampled}"
                        if args.sampled else "")
                     + (", EOS ignored" if args.ignore_eos else ""),
        "train_tokens": int(sum(len(r.ids) - r.prompt_len for r in tr)),
        "draft_vocab_size": vocab_size, "lm_head_only": args.lm_head_only,
        "unroll": args.unroll, "epochs": args.epochs,
        "lr": args.lr, "batch_size": args.batch_size, "data_seconds": round(t_data, 1),
        "date": time.strftime("%Y-%m-%d"),
    }


def engine_acceptance(engine: Engine, head: Eagle3Head, prompts: list, k: int,
                      max_tokens: int) -> dict:
    """Greedy speculative decoding on `prompts`: acceptance length and per-position rates of
    the head's own drafts (context drafts off: copies from the context are not the head's).
    The engine gets the KV blocks every prompt's answer can fill at once, and no more, and
    replays no graphs: on CUDA a fresh engine's `generate` would otherwise decode plainly while
    its speculative graphs wait (`engine/warming.py`), and report no verify step at all."""
    ids = [engine.encode_prompt(p if isinstance(p, list) else [{"role": "user", "content": p}])
           for p in prompts]
    bs = engine.config.block_size
    blocks = sum(-(-(len(i) + max_tokens + k + 1) // bs) for i in ids)
    spec = Engine(replace(engine.config, spec=SpecConfig(num_tokens=k, dynamic=False,
                                                       context_drafts=False),
                          num_blocks=blocks + 8, cuda_graphs=False),
                  weights_of=engine, draft_head=head)
    t0 = time.perf_counter()
    spec.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    st = spec.spec.stats
    return {"k": k, "acceptance_length": round(st.acceptance_length, 3),
            "accept_rate_per_pos": [round(a / max(d, 1), 4) for a, d in
                                    zip(st.accepted_per_pos, st.drafted_per_pos)],
            "verify_steps": st.verify_steps, "kv_blocks": blocks + 8,
            "seconds": round(time.perf_counter() - t0, 2)}


def _weights_only(engine: Engine) -> Engine:
    """An engine on `engine`'s weights with a few KV blocks and no graphs, for training and
    the acceptance runs: self-distillation's pool (DISTIL_SEQS answers) and captured graphs
    are freed with `engine`."""
    return Engine(replace(engine.config, num_blocks=8, cuda_graphs=False), weights_of=engine)


def _device_gb(device: str) -> float:
    """GB the allocator holds on a CUDA device (0 elsewhere)."""
    return torch.cuda.memory_reserved(device) / 1e9 if device.startswith("cuda") else 0.0


def _write(folder: str, recipe: dict) -> None:
    with open(f"{folder}/training.json", "w") as f:
        json.dump(recipe, f, indent=2)


def add_parser(sub, help_: str) -> None:
    """Register `tandem train-eagle3` on the CLI's subparsers (`help_`: its one-line help)."""
    import argparse

    p = sub.add_parser("train-eagle3", help=help_, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output folder (public EAGLE-3 layout)")
    p.add_argument("--device", default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="cap the prompt set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--revocab", action="store_true",
                   help="with --init: the draft vocabulary becomes the --draft-vocab most "
                        "frequent tokens of these answers (rows of the tokens kept carry over, "
                        "new ones start at zero), not the --init head's grown")
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
    p.add_argument("--domains", default=None, metavar="MIX",
                   help="train on a mix of prompt domains instead (cluster/prompt_sets.py "
                        "domains(): code, chat, json, summarize, math, general), e.g. "
                        "code,chat,json,summarize,math,general:3000: a domain alone takes all "
                        "its training prompts, domain:N its first N; every named domain's "
                        "held-out prompts evaluate, engine acceptance is reported per domain; "
                        "its general domain is the extended set, name split")
    p.add_argument("--resume", action="store_true",
                   help="keep the run's state in --out and go on from it: records "
                        "self-distilled a chunk at a time into --out/records, the training "
                        "state in --out/resume.pt (every few minutes); the first run takes it "
                        "too, and later runs need the same arguments")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="with --resume: end this run after about this long, its state saved, "
                        f"with exit status {UNFINISHED}; the same command again goes on (leave "
                        "room for loading the model and the final evaluation)")
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
