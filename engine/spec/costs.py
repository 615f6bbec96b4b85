"""Step-cost measurement for dynamic K: what a plain decode step costs at each batch-size
bucket, what drafting adds to it, and the tokens per second each kind of step delivers. The
K policy (engine/spec/policy.py) decides from these numbers."""

from __future__ import annotations

import statistics
from collections import deque

# A step prices drafts only if it carried this many per sequence on average: a few drafts
# spread over many sequences would pass timing noise off as the price of a draft.
MIN_DRAFTS = 1.0
# A step this many times its window's median time is a stall (a graph captured, a kernel
# compiled, the host descheduled), not a rate sample.
STALL = 3.0
SWITCH_MARK = " switch"  # appended to a trace row's `how` where the step switched K


def switched(how: str) -> bool:
    """Whether a `StepCosts.trace` row's `how` marks a step that switched K."""
    return how.endswith(SWITCH_MARK)


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


class StepCosts:
    """Measured step times per batch-size bucket (powers of two): a plain step's seconds, and what
    drafting adds relative to it as a fixed part (`fixed`) plus a price per draft per sequence
    (`per_draft`), measured because the overhead depends on machine and model. The parts come from
    a line fitted through per-level medians (`_fit_line`), so one stalled step cannot skew K; steps
    right after a switch between plain and drafting are not timed."""

    WINDOW = 15  # plain steps kept per bucket
    LEVEL_WINDOW = 8  # drafting steps kept per level (drafts per sequence)
    # A sample this many recorded steps old no longer counts: the costs follow the load, and
    # a stretch of text the head drafted badly must not hold a bucket at K=0 long after it.
    # A bucket whose drafting was not timed that long prices drafts by the configured guess.
    STALE = 256
    # Steps behind the measured tokens/s of each kind: a drafting step emits 1..K+1 tokens
    # per sequence, so its rate needs more samples than its time does.
    RATE_WINDOW = 32
    MIN_RATE_SAMPLES = 2  # fresh steps of each kind before a measured gain is read

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}
        self.per_draft: dict[int, float] = {}
        self.fixed: dict[int, float] = {}
        self._plain: dict[int, deque] = {}
        # bucket -> drafts per sequence -> (record number, seconds) of steady drafting steps
        self._drafted: dict[int, dict[float, deque]] = {}
        self._drafted_at: dict[int, int] = {}  # bucket -> record number of its last one
        self._fit_at: dict[int, int] = {}  # bucket -> record number `_fit` last ran at
        # (bucket, drafting steps' age limit) -> (record number, `measured_gain`)
        self._gains: dict[tuple[int, int], tuple] = {}
        self._n = 0  # steps recorded
        # (bucket, plain?) -> (record number, tokens per sequence, seconds) of the last
        # RATE_WINDOW steady steps (per sequence: a bucket spans batch sizes)
        self._rates: dict[tuple[int, bool], deque] = {}
        # (bucket, drafts per sequence) -> the same for steady drafting steps of each level
        self._level_rates: dict[tuple[int, float], deque] = {}
        self._last: tuple[int, bool] | None = None  # (bucket, plain?) of the last step seen
        # When a list: every step offered to the model, (batch size, drafts per sequence,
        # milliseconds, tokens, how the step ran, timed?), for benchmarks reading what it saw.
        self.trace: list | None = None

    def record(self, batch_size: int, drafts_per_seq: float, seconds: float,
               tokens: int | None = None, how: str = "", switch: bool = False) -> None:
        """One pure decode step: `drafts_per_seq` drafts per sequence on average (0: a plain step),
        `tokens` emitted. Draft steps are priced against the current plain time. `switch`: a step
        whose K differs from the one before; it counts toward tokens/s but is no point of the cost
        fit, whose shallow end it would bend."""
        b = _bucket(batch_size)
        self._n += 1
        kind = (b, drafts_per_seq == 0) if drafts_per_seq == 0 or drafts_per_seq >= MIN_DRAFTS \
            else None
        steady, self._last = kind is not None and kind == self._last, kind
        if self.trace is not None:
            self.trace.append((batch_size, round(drafts_per_seq, 3), round(seconds * 1e3, 4),
                               tokens, how + SWITCH_MARK if switch else how, steady))
        if not steady:
            return
        if tokens is not None and seconds > 0:
            sample = (self._n, tokens / batch_size, seconds)
            _window(self._rates, kind, sample, self.RATE_WINDOW)
            if drafts_per_seq:
                _window(self._level_rates, (b, drafts_per_seq), sample, self.RATE_WINDOW)
        if drafts_per_seq == 0:
            self.plain[b] = _low(_window(self._plain, b, seconds))
        else:
            if not switch:
                _window(self._drafted.setdefault(b, {}), drafts_per_seq, (self._n, seconds),
                        self.LEVEL_WINDOW)
            self._drafted_at[b] = self._n

    def _fit(self, b: int) -> None:
        """`fixed` and `per_draft` at bucket b from its fresh drafting levels; run when read
        (a fixed-K engine, which records steps but never reads them, pays nothing), at most
        once per recorded step."""
        if self._fit_at.get(b) == self._n:
            return
        self._fit_at[b] = self._n
        if b not in self.plain or not self._drafted.get(b):
            return
        p = self.plain[b]
        points = [(d, statistics.median(t for _, t in w) / p - 1.0, len(w))
                  for d, w in self._drafted[b].items() if self._n - w[-1][0] <= self.STALE]
        if points:
            self.fixed[b], self.per_draft[b] = _fit_line(points)

    def untimed(self, batch_size: int, seconds: float, how: str) -> None:
        """A step the model does not price (a prefill beside it, entries that did not verify
        and draft), seen only by the trace."""
        if self.trace is not None:
            self.trace.append((batch_size, None, round(seconds * 1e3, 4), None, how, False))

    def _stale(self, b: int) -> bool:
        return b in self._drafted_at and self._n - self._drafted_at[b] > self.STALE

    def per_token(self, batch_size: int) -> float | None:
        """The measured price of a draft per sequence at this batch size's bucket; None
        until timed, or where drafting was not timed for STALE steps."""
        b = _bucket(batch_size)
        self._fit(b)
        return None if self._stale(b) else self.per_draft.get(b)

    def fixed_cost(self, batch_size: int) -> float:
        b = _bucket(batch_size)
        self._fit(b)
        return 0.0 if self._stale(b) else self.fixed.get(b, 0.0)

    def fitted(self) -> StepCosts:
        """Every bucket's `fixed` and `per_draft` brought up to date (for reports)."""
        for b in list(self._drafted):
            self._fit(b)
        return self

    def measured_gain(self, batch_size: int, fresh: int | None = None) -> float | None:
        """Tokens/s per sequence of steady drafting steps over that of steady plain steps at
        this batch size's bucket (`_rate`), from steps of the last STALE (drafting steps: of
        the last `fresh`, if given); None until both kinds have MIN_RATE_SAMPLES there. Read
        at most once per recorded step, bucket and `fresh` (a fused step's K asks it twice:
        losing, then winning)."""
        b = _bucket(batch_size)
        ages = (self.STALE if fresh is None else min(fresh, self.STALE), self.STALE)
        hit = self._gains.get((b, ages[0]))
        if hit is not None and hit[0] == self._n:
            return hit[1]
        gain = None
        rates = []
        for plain in (False, True):
            age = ages[plain]
            recent = [(tok, sec) for n, tok, sec in self._rates.get((b, plain), ())
                      if self._n - n <= age]
            if len(recent) < self.MIN_RATE_SAMPLES:
                break
            rates.append(_rate(recent))
        else:
            gain = rates[0] / rates[1]
        self._gains[(b, ages[0])] = (self._n, gain)
        return gain

    def best_level(self, batch_size: int) -> float | None:
        """The drafting level (drafts per sequence) whose steady steps of the last STALE at
        this batch size's bucket emitted the most tokens per second per sequence (`_rate`),
        among levels with MIN_RATE_SAMPLES such steps; None without any."""
        b = _bucket(batch_size)
        best, level = None, None
        for (lb, lvl), w in self._level_rates.items():
            if lb != b:
                continue
            recent = [(tok, sec) for n, tok, sec in w if self._n - n <= self.STALE]
            if len(recent) >= self.MIN_RATE_SAMPLES:
                r = _rate(recent)
                if best is None or r > best:
                    best, level = r, lvl
        return level

    def knows_plain(self, batch_size: int) -> bool:
        return _bucket(batch_size) in self.plain


def _low(xs) -> float:
    """The lower quartile: what a plain step costs undisturbed. A plain step's time has no
    lumpiness of its own (one token per sequence), so its spread is disturbance only (the
    few plain steps a probe times often follow an admission). Read high, it would make
    every draft look cheap; read low, drafting only looks dearer."""
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 4]


def _fit_line(points: list[tuple[float, float, int]]) -> tuple[float, float]:
    """(fixed, per draft) >= 0 of the line through (drafts per sequence, relative extra step
    time, samples) points by least squares, each point weighted by its samples. One level
    alone cannot split the two: its whole extra time is priced per draft (the dearer
    reading for deeper K; draft probes at other K add the levels that split it)."""
    if len({d for d, _, _ in points}) == 1:
        d, y, _ = points[0]
        return 0.0, max(y, 0.0) / d
    w = sum(n for _, _, n in points)
    md = sum(n * d for d, _, n in points) / w
    my = sum(n * y for _, y, n in points) / w
    slope = (sum(n * (d - md) * (y - my) for d, y, n in points)
             / sum(n * (d - md) ** 2 for d, _, n in points))
    if slope <= 0:
        return max(my, 0.0), 0.0
    if my - slope * md < 0:  # through the origin instead
        return 0.0, max(sum(n * d * y for d, y, n in points)
                        / sum(n * d * d for d, _, n in points), 0.0)
    return my - slope * md, slope


def _window(windows: dict, b, x, size: int = StepCosts.WINDOW) -> deque:
    """Add a sample to key b's window (the last `size` samples); returns the window."""
    w = windows.setdefault(b, deque(maxlen=size))
    w.append(x)
    return w


def _rate(samples) -> float:
    """Tokens per second over (tokens, seconds) samples: total tokens over total time, the
    stalls left out. Not the median of per-step rates: a drafting step's tokens are lumpy
    (most steps emit one token and some several), so the median step's rate can sit far
    below the rate the steps deliver together."""
    cap = STALL * statistics.median(sec for _, sec in samples)
    kept = [(tok, sec) for tok, sec in samples if sec <= cap]
    return sum(tok for tok, _ in kept) / sum(sec for _, sec in kept)
