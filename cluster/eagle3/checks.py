"""`tandem train-eagle3`'s refusals that need no model: arguments out of range, paths that
cannot serve, folders that would lose another run's work. Each is one line, before anything
loads (the model, then minutes of self-distillation)."""

from __future__ import annotations

import json
import math
import os

from cluster.engine_args import missing_head, unusable_device


def refused(args) -> str | None:
    """Why the CLI's arguments are refused before anything loads (None: they are not)."""
    resuming = getattr(args, "resume", False)
    if args.data_only and not (args.records or resuming):
        return "--data-only needs --records FILE (or --resume) to write the records to"
    if args.lm_head_only and not args.init:
        return "--lm-head-only fits the LM head of an --init head"
    if getattr(args, "revocab", False) and not args.init:
        return "--revocab rebuilds the draft vocabulary of an --init head"
    if getattr(args, "stop_after", None) and not resuming:
        return "--stop-after needs --resume: a run it ends is continued by the next"
    if resuming and args.lm_head_only:
        return "--resume does not apply to --lm-head-only (a fit of minutes)"
    device = getattr(args, "device", None)
    return (bad_numbers(args) or bad_domains(args) or _bad_init(args) or _bad_paths(args)
            or (unusable_device(device) if device is not None else None))


def _bad_init(args) -> str | None:
    if not args.init:
        return None
    if why := missing_head(args.init):
        return f"--init: {why}"
    try:
        with open(os.path.join(args.init, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:  # (JSONDecodeError, UnicodeDecodeError)
        return f"--init {args.init}: config.json is not readable JSON ({e})"
    if not isinstance(config, dict):
        return f"--init {args.init}: config.json holds no JSON object"
    return None


def _bad_paths(args) -> str | None:
    """--out, --records and --model: a folder that can be written and holds no finished head
    (without --resume), a records file whose folder exists, a model that does."""
    out = getattr(args, "out", None)
    if out and os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out}: a file, not a folder"
    done = os.path.join(out or "", "training.json")
    if out and not getattr(args, "resume", False) and os.path.isfile(done):
        try:
            with open(done) as f:
                finished = not json.load(f).get("unfinished")
        except (OSError, ValueError, AttributeError):
            finished = True
        if finished:
            return (f"--out {out} holds a finished head (training.json): name another folder, "
                    "or delete it first")
    records = getattr(args, "records", None)
    if records and os.path.isdir(records):
        return f"--records {records}: a folder; name a file (written if it does not exist)"
    if records and not os.path.exists(records) and not os.path.isdir(
            os.path.dirname(os.path.abspath(records))):
        return f"--records {records}: its folder does not exist"
    if getattr(args, "model", None) is not None:
        from engine.loader import resolve

        try:
            resolve(args.model)
        except FileNotFoundError as e:
            return f"--model: {e}"
    return None


def bad_domains(args) -> str | None:
    """What is wrong with --domains, if anything (None: nothing, or no --domains)."""
    domains = getattr(args, "domains", None)
    if domains == "":
        return "--domains is empty: name domains like code,chat or leave the flag out"
    if not domains:
        return None
    if args.num_prompts or args.name_split or args.prompt_set != "base":
        return ("--domains chooses the prompts itself: drop --prompt-set, --name-split and "
                "--num-prompts (its general domain is the extended set, name split)")
    from cluster import prompt_sets

    try:
        prompt_sets.mix(domains)
    except ValueError as e:
        return f"--domains {domains}: {e}"
    return None


def bad_numbers(args) -> str | None:
    """What is wrong with the CLI's counts and rates, if anything (None: nothing)."""
    positive = {"--draft-vocab": "draft_vocab", "--max-tokens": "max_tokens",
                "--unroll": "unroll", "--epochs": "epochs", "--batch-size": "batch_size",
                "--log-every": "log_every", "--lr": "lr"}
    for flag, name in positive.items():
        v = getattr(args, name, None)
        if v is not None and not (v > 0 and math.isfinite(v)):
            return f"{flag} must be positive, got {v}"
    for flag, name in {"--max-seconds": "max_seconds", "--num-prompts": "num_prompts",
                       "--stop-after": "stop_after"}.items():
        v = getattr(args, name, None)
        if v is not None and not (v > 0 and math.isfinite(v)):
            return f"{flag} must be positive where given, got {v}"
    v = getattr(args, "k_eval", None)
    if v is not None and v < 1:
        return f"--k-eval must be at least 1, got {v}"
    v = getattr(args, "eval_prompts", None)
    if v is not None and v < 0:
        return f"--eval-prompts must be 0 or more, got {v}"
    v = getattr(args, "sampled", None)
    if v is not None and not (math.isfinite(v) and v >= 0):
        return f"--sampled must be a temperature >= 0, got {v}"
    return None
