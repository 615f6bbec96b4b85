"""Self-distillation: the target answers a prompt set through the engine, and every computed
position's final hidden state and aux taps are captured from the forwards that produce the
tokens. Also the draft vocabulary (the responses' most frequent tokens) and a records file,
so that training can run apart from the generation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import Engine, SamplingParams


@dataclass
class Record:
    ids: torch.Tensor  # prompt + response token ids [n]
    prompt_len: int
    aux: torch.Tensor  # [n-1, 3h] taps at positions 0..n-2
    hidden: torch.Tensor  # [n-1, h] final normed hidden states


def on_device(r: Record, device) -> Record:
    """The record with its tensors on `device`."""
    return Record(r.ids.to(device), r.prompt_len, r.aux.to(device), r.hidden.to(device))


def self_distill(engine: Engine, prompts: list, max_tokens: int, layers: tuple[int, ...],
                 store_dtype: torch.dtype, desc: str = "self-distil",
                 ignore_eos: bool = False, temperature: float = 0.0,
                 seed: int | None = None) -> list[Record]:
    """Generate answers with the target to `prompts` (user messages or chat-message lists) and
    capture the features of every position (`ignore_eos`: run every answer to max_tokens).
    temperature > 0: answers sampled (seeded by `seed`) for other contexts; the head still
    learns the target's next-token law from the hidden states."""
    if engine.config.enable_prefix_caching:
        raise ValueError("self-distillation needs every position computed: build the engine "
                         "with enable_prefix_caching=False")
    caps: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def capture(seq, lo, hidden, aux):  # the engine cast them, a step at a time
        if len(hidden):
            caps.setdefault(seq.request_id, {})[lo] = (aux, hidden)

    engine.set_tap(capture, layers, store_dtype)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            ignore_eos=ignore_eos, seed=seed if temperature > 0 else None)
    msgs = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
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
        engine.set_tap(None)
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


def pack(records: list[Record]) -> list[dict]:
    """Records as plain dicts of tensors, for `torch.save` (`unpack` reads them back)."""
    return [{"ids": r.ids, "prompt_len": r.prompt_len, "aux": r.aux, "hidden": r.hidden}
            for r in records]


def unpack(packed: list[dict]) -> list[Record]:
    return [Record(**r) for r in packed]


def save_records(path: str, key: dict, train_records: list[Record],
                 eval_records: list[Record]) -> None:
    """Self-distilled records to a file, with what they were made from (`key`), so that
    training can run apart from the generation (another process, another device call)."""
    torch.save({"key": key, "train": pack(train_records), "eval": pack(eval_records)}, path)


class SavedFileError(ValueError):
    """A records or training-state file that cannot be used: unreadable, not one this tool
    wrote, or made from other prompts or settings."""


def read_saved(path: str, *fields: str, redo: str = "or use another --out") -> dict:
    """A file `save_records` or `--resume` wrote, loaded; SavedFileError where it is torn,
    empty or another program's (a dict holding `fields` is what they write)."""
    try:
        got = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError (zip), EOFError, OSError, ...
        why = f"{e.strerror}" if isinstance(e, OSError) and e.strerror else "torn, or not " \
            f"a file torch wrote: {type(e).__name__}"  # torch's own text runs to a page
        raise SavedFileError(f"{path} cannot be read ({why}): delete it to make it again, "
                             f"{redo}") from None
    if not isinstance(got, dict) or any(f not in got for f in fields):
        raise SavedFileError(f"{path} is not a file train-eagle3 wrote: delete it to make it "
                             f"again, {redo}")
    return got


def load_records(path: str, key: dict) -> tuple[list[Record], list[Record]]:
    """`save_records`' records; refuses a file made from other prompts, model or length."""
    got = read_saved(path, "key", "train", "eval", redo="or name another --records file")
    if got["key"] != key:
        raise SavedFileError(f"{path} holds records of {got['key']}, not {key}")
    return unpack(got["train"]), unpack(got["eval"])
