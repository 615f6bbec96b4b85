"""What the engine hands back: per-step outputs, finished completions, counters, and the
stop rules that decide where a request ends and how much of its text may be streamed."""

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
    """Counters over the engine's life."""

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


def cut(tokens: list[int], eos, stop_ids: tuple[int, ...], room: int, hold: bool
        ) -> tuple[list[int], str | None]:
    """The tokens a request without stop strings keeps of `tokens`, and why it stops: at the first
    stop id ("stop", id kept), at the token filling its `room` before the length limit ("length";
    a stop id there wins), or after the first token when held for a hand-off ("handoff"). One
    pass doing what `emit_each` does token by token."""
    n = len(tokens)
    if not n:
        return tokens, None
    end, reason = n, None
    if (eos and not eos.isdisjoint(tokens)) or (stop_ids and not set(stop_ids).isdisjoint(tokens)):
        end = next(j for j, t in enumerate(tokens) if t in eos or t in stop_ids) + 1
        reason = "stop"
    at = max(room, 1)  # the token that reaches the limit (the first one if already there)
    if at < end:
        end, reason = at, "length"
    elif at == end and reason is None:
        reason = "length"
    if hold and not (reason and end == 1):
        end, reason = 1, "handoff"
    return (tokens if end == n else tokens[:end]), reason


def emit_each(seq: Sequence, tokens: list[int], detok, eos, limit: int
              ) -> tuple[list[int], str | None]:
    """Append `tokens` to a request with stop strings one at a time until one stops it; returns
    those appended and why it stopped. With a detokenizer the text grows token by token, since
    a stop string may end the request mid-way."""
    p, ids = seq.params, seq.token_ids
    emitted, reason = [], None
    for tok in tokens:
        ids.append(tok)
        emitted.append(tok)
        if detok is not None:
            seq.text += detok.step(ids)
        if tok in eos or tok in p.stop_token_ids:
            reason = "stop"
        elif len(ids) >= limit:
            reason = "length"
        if cut_at_stop(seq):
            reason = "stop"
        if reason:
            break
        if seq.hold:
            reason = "handoff"
            break
    return emitted, reason
