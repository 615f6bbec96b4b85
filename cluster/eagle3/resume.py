"""Resuming `tandem train-eagle3` across runs (`--resume`): the self-distilled records are
written a chunk of prompts at a time, so a run cut short keeps the chunks it finished, and the
training state (head, optimizer, schedule, step, history) is saved regularly, so the same
command run again continues the same schedule from the last save."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import torch

from cluster.eagle3.records import Record, SavedFileError, pack, read_saved, unpack

CHUNK = 1024  # prompts self-distilled, then written, at a time


def _save(obj, path: str) -> None:
    """torch.save through a temporary file: a process killed mid-write leaves no torn file."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def distill_chunks(folder: str, part: str, key: dict, prompts: list,
                   distil: Callable[[list], list[Record]], stop: Callable[[], bool] | None = None,
                   chunk: int | None = None) -> list[Record] | None:
    """`distil(prompts)` a chunk at a time, each chunk's records written to
    folder/{part}-NNNNN.pt as it finishes; chunks already there (made from the same `key` and
    prompts) are loaded instead. None where `stop()`, asked once a chunk is done, ended it
    before the last chunk."""
    chunk = chunk or CHUNK
    os.makedirs(folder, exist_ok=True)
    out: list[Record] = []
    made = False  # a run distils at least one chunk before `stop()` may end it: progress
    for n, i in enumerate(range(0, len(prompts), chunk)):
        ps = prompts[i : i + chunk]
        path = os.path.join(folder, f"{part}-{n:05d}.pt")
        digest = hashlib.sha1(json.dumps([key, ps], sort_keys=True).encode()).hexdigest()
        if os.path.exists(path):
            got = read_saved(path, "digest", "records")
            if got["digest"] != digest:
                raise SavedFileError(f"{path} holds records of other prompts or settings: "
                                     "resume with the same arguments, or use another --out")
            out += unpack(got["records"])
            continue
        if stop is not None and made and stop():
            return None
        recs = distil(ps)
        _save({"digest": digest, "records": pack(recs)}, path)
        out += recs
        made = True
    return out


def save_state(path: str, key: dict, state: dict) -> None:
    """The training state (`loop.train`'s `save_state` argument) with the settings it
    belongs to."""
    _save({**state, "key": key}, path)


def load_state(path: str, key: dict) -> dict | None:
    """`save_state`'s state (None where there is no file); refuses one of other settings."""
    if not os.path.exists(path):
        return None
    state = read_saved(path, "key", "head", "opt", "sched", "step", "plan", "history",
                       "seconds")
    if state.pop("key") != key:
        raise SavedFileError(f"{path} was saved by a run of other settings: resume with the "
                             "same arguments, or use another --out")
    return state
