"""A request inside the engine: its tokens, KV block table, sampling parameters and progress."""

from __future__ import annotations

import enum
import functools
import itertools
import math
import numbers
import operator
from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature=0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        fix = functools.partial(object.__setattr__, self)
        for name in ("temperature", "top_p"):
            fix(name, _number(name, getattr(self, name)))
        for name in ("top_k", "max_tokens", "seed"):
            if name != "seed" or self.seed is not None:
                fix(name, integer(name, getattr(self, name)))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        fix("stop", tuple(_items("stop", stop)))
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop holds {_first_not(self.stop, str)!r}: stop "
                                      "strings are str")
        fix("stop_token_ids", tuple(integer("stop_token_ids", t)
                                    for t in _items("stop_token_ids", self.stop_token_ids)))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be > 0, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _scalar(value):
    """A 0-d tensor or array as its Python value; anything else as is."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def _number(name: str, value) -> float:
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number, got {value!r:.40}")
    return float(value)


def integer(name: str, value) -> int:
    """value as an int: ints and integer scalars (numpy, 0-d tensors), never bools, floats or
    strings (InvalidRequestError naming `name`)."""
    value = _scalar(value)
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise InvalidRequestError(f"{name} must be an integer, got {value!r:.40}")


def _items(name: str, value) -> tuple:
    """A sequence field's items (None: none)."""
    if value is None:
        return ()
    try:
        return tuple(value)
    except TypeError:
        raise InvalidRequestError(f"{name} must be a list, got {value!r:.40}") from None


def _first_not(values, kind):
    return next(v for v in values if not isinstance(v, kind))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """Prompt plus generated tokens; `num_computed` of them have KV in the cache."""

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None):
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full, computed blocks
        self.num_computed = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.finish_reason: str | None = None
        self.text = ""  # detokenized output, cut before a stop string
        self.num_emitted_chars = 0  # how much of text has been streamed out
        self.arrival_step = 0
        self.draft: list[int] = []  # proposed tokens the next forward verifies
        self.draft_q = None  # their draft distributions [K, vocab] when sampled, else None
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verify_steps = 0
        self.accept_rate: float | None = None  # per-draft-token acceptance estimate
        self.accept_counts: tuple[float, float] | None = None  # its decayed (accepted, tried)
        # Decayed (tried, accepted) counts per draft depth (KPolicy with accept_model "runs").
        self.accept_runs: tuple[list[float], list[float]] | None = None
        self.idle_steps = 0  # decode steps spent at K=0
        self.max_draft: int | None = None  # per-request cap on drafts per step
        # EAGLE-3 head's hidden state at the last computed position (prefill role only): the
        # state drafting continues from, shipped with a hand-off.
        self.draft_hidden = None
        self.hold = False  # prefill role: stop after the first token, keep the KV blocks

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """len(output_ids), without copying them (checked for every token emitted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    def length_limit(self, max_model_len: int) -> int:
        """The length at which the request stops for length: max_tokens after its prompt,
        or the model's length, whichever comes first."""
        return min(self.num_prompt_tokens + self.params.max_tokens, max_model_len)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet in the cache (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    def greedy_decode(self, n: int) -> bool:
        """A batch entry of `n` tokens is a greedy decode of the pending token and this
        sequence's drafts: not a prefill chunk, not sampled, not a prefill-side request about
        to be handed off. One-graph decode steps (fused and plain) run only these."""
        return (self.params.greedy and not self.hold and self.num_computed == len(self) - 1
                and n == 1 + len(self.draft))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
