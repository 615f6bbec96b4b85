"""What the engine hands back: per-step outputs, finished completions, counters, and the
stop-string rules that decide how much text may be streamed."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens accepted so far
    handoff: bool = False  # prefill role: first token out, KV held for the decode side


@dataclass
class Completion:
    """A finished request as `generate()` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


def cut_at_stop(seq: Sequence) -> bool:
    """Truncate seq.text before the first stop string in it; True if one was found."""
    stops = seq.params.stop
    start = max(0, seq.num_emitted_chars - max(map(len, stops)) + 1)
    hits = [i for s in stops if (i := seq.text.find(s, start)) >= 0]
    if hits:
        seq.text = seq.text[: min(hits)]
    return bool(hits)


def stop_prefix_len(seq: Sequence) -> int:
    """Length of the longest tail of seq.text that begins some stop string."""
    text, best = seq.text, 0
    for s in seq.params.stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
