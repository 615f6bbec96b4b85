"""Dynamic K: how many tokens to draft for a sequence, from its measured acceptance and the
batch size, down to 0 (plain decode) when speculation stops paying."""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable

import numpy as np

from engine.config import SpecConfig
from engine.sequence import Sequence

PROBE_EVERY = 8  # a sequence at K=0 drafts one token this often, to notice recovery
BATCH_PROBE_EVERY = 32  # a whole fused batch at K=0 drafts one token this often...
SMALL_BATCH = 8  # ...or, at this many sequences or fewer, every PROBE_EVERY steps
PLAIN_PROBE_EVERY = 64  # every this many steps, PROBE_LEN steps without drafts time a plain step
PROBE_LEN = 4  # steps a probe lasts: its first ones are transitions, the rest get timed
# Where drafting measured at least PROBE_RELAX_GAIN times plain decoding's tokens/s (the
# measured gain, `StepCosts.measured_gain`), plain probes come PROBE_RELAX times further
# apart: each probe step gives up most of a drafting step's tokens, and far from the
# break-even a fresher plain time changes no K. With the 7168-id head's answers, dynamic K
# at one stream replayed at the H200's step prices (`bench.draft_oracle.live_rule`, bf16
# / float32 answers, figure 1 and 12 other prompts) read +1.6 / +2.8 / +2.5 / +0.1% with
# 1.5 and 4 (no probes at all: +3.0 / +3.0 / +1.1 / +0.1%). The gain needs fresh plain
# samples (`StepCosts.STALE`): where they age out it reads None and probes tighten again.
PROBE_RELAX_GAIN = 1.5
PROBE_RELAX = 4
MARGIN = 1.02  # a deeper K must beat the best shallower one by this factor
# A fused batch leaves K=0 only for a predicted win of this factor: at 64 streams on the H200
# a batch drafting on marginal predicted wins (K=1 at c ~ 0.5) ran 0.83x no-spec where one
# held at K=0 ran 0.94x. Switching regimes costs what the 1 + f + K*c model does not price
# (relaunches from host-packed inputs, the continuation's device-side rebuild of inputs).
BATCH_START_MARGIN = 1.10
MIN_DRAFTS = 1.0  # a step prices drafts only if it carried this many per sequence on average
# Measured drafting tokens/s must reach this multiple of measured plain tokens/s at the batch's
# bucket, or the batch decodes plainly whatever the step-cost model predicts (draft probes still
# draft, so the comparison stays current). The model misses what drafting costs beyond a
# steady step's time; on the H200 it kept a single stream drafting at 0.83x no-spec.
GAIN_FLOOR = 1.0
# ...and the other way: where steady drafting steps measured at least this multiple of plain
# steps' tokens/s at the batch's bucket, a fused batch the model would put at K=0 keeps
# drafting, at the model's best K above 0. Figure 3 on the H200 (e638a0c): at 64 streams
# drafting measured 1.27x plain, yet the model (its price per draft read 0.42 of a step, four
# times the device's, the step's host work growing with the tokens it emits) held 315 of 600
# steady steps at K=0 and ran 1.13x no-spec where fixed K=5 ran 1.29x; at one stream
# (measured 1.78x) 230 of 523, 1.005x against 1.13x. (With drafts priced per draft alone
# the model's best K above 0 was K=1, and at one stream that pick held the stream at K=1,
# acceptance length 1.75, 0.80x no-spec: figure 3 at 4cba156; the fixed part StepCosts
# now measures is what prices deep K right.)
WIN_FLOOR = 1.10
# A losing verdict (GAIN_FLOOR) reads only drafting steps of the last this many: it holds a
# batch at K=0, where drafting is timed by draft probes alone, so older steps would keep it
# there long after the stretch of text that drafted badly (on the H200 one stream held K=0
# for 259 of ~580 steady steps and ran 1.08x no-spec where the next process, the same code,
# held 88 and ran 1.25x). A winning verdict keeps its batch drafting, which renews its own
# samples, so it reads the whole STALE window. `StepCosts.STALE` restores the old rule.
LOSING_FRESH = 64
# Whether drafting steps that switch K (they verify one K's drafts and propose another's) are
# points of the cost fit. They are not: at one stream on the H200 the step after a retry
# verified 1 draft and proposed 2 and took 2.2-2.9 plain steps, and at the line's shallow end
# those made its slope <= 0, so all of drafting read as a fixed ~1.0 plain step and only K=7
# at high acceptance beat K=0 (`bench.trace_replay` on fig3_c374fcc_a). True restores that.
FIT_SWITCHES = False
SWITCH_MARK = " switch"  # appended to a trace row's `how` where the step switched K


def switched(how: str) -> bool:
    """Whether a `StepCosts.trace` row's `how` marks a step that switched K."""
    return how.endswith(SWITCH_MARK)

ACCEPT_DECAY = 0.7  # per verify, of a sequence's accepted and tried draft counts
# accept_model "runs": per-depth counts decay by this factor a verify (about the last ten
# verifies count), and a depth's acceptance is shrunk toward the sequence's rate with this
# many pseudo-trials, so a depth tried once or never reads about as the geometric model.
RUNS_DECAY = 0.9
RUNS_PRIOR = 2.0


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


class StepCosts:
    """Measured step times per batch-size bucket (powers of two): a plain step's seconds, and
    what drafting adds to it, relative to it: a fixed part (`fixed`: what any drafting step
    pays, the head's launches and the host's extra work) and a price per draft per sequence
    (`per_draft`). Measured, because the real overhead of speculating depends on the
    machine and model far more than a configured guess can. The plain time is the lower
    quartile of its last WINDOW samples (`_low`); drafting steps are kept per level (drafts
    per sequence, as the fused step's padded graphs run them), the median of each level's
    last LEVEL_WINDOW samples one point, and the two parts are the line through those
    points (`_fit_line`), so one stalled step (a graph captured, a kernel compiled, the
    host descheduled) cannot skew K.

    Why two parts: on the H200 at one stream (figure 3's burst runs) every drafting step
    took ~1.0 ms whatever its K (1..7) where a plain step took 0.55 ms: most of what
    drafting cost did not grow with K. A price per draft alone,
    read from K=1 steps, came to 0.9 of a step per draft and priced K=7 at 7.3 steps, so
    the model held K=0 or 1 (acceptance length 1.75) where fixed K=5 ran 1.43x no-spec.

    Only steps in a steady regime are timed: a step whose previous timed step was of the other
    kind (plain after drafting, or drafting after plain) is a transition. Its step time holds
    work neither regime pays once settled (a relaunch from host-packed inputs instead of a
    continuation that only copies token ids), and with overlapped steps it also holds the
    launch of the next one. Timing transitions as plain steps once made a plain step at 64
    streams read 3.97 ms (a decode without speculation took 1.42 ms), and every draft look
    cheap."""

    WINDOW = 15
    LEVEL_WINDOW = 8  # drafting steps kept per level (drafts per sequence)
    # A sample this many recorded steps old no longer counts: the costs follow the load (at
    # one stream figure 3's burst steps ran ~1.0 ms where its steady ones ran 0.65), and a
    # measurement from a stretch of text the head drafted badly must not hold a bucket at
    # K=0 after it (on the H200 one stream ran 360 of 570 steady steps at K=0 on a
    # drafting rate read 100 steps into the run, 0.85x no-spec). A bucket whose drafting
    # was not timed that long prices drafts by the configured guess again.
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
        # RATE_WINDOW steady steps (per sequence: a bucket spans batch sizes, and in a burst's
        # tail the plain probes ran at the larger ones, the drafting steps at the smaller)
        self._rates: dict[tuple[int, bool], deque] = {}
        # (bucket, drafts per sequence) -> the same for steady drafting steps of each level
        self._level_rates: dict[tuple[int, float], deque] = {}
        self._last: tuple[int, bool] | None = None  # (bucket, plain?) of the last step seen
        # When a list: every step offered to the model, (batch size, drafts per sequence,
        # seconds, tokens, how the step ran, timed?) - for benchmarks reading what it saw.
        self.trace: list | None = None

    def record(self, batch_size: int, drafts_per_seq: float, seconds: float,
               tokens: int | None = None, how: str = "", switch: bool = False) -> None:
        """One pure decode step: `drafts_per_seq` drafts verified and proposed per sequence
        on average (0: a plain step), `tokens` emitted. Draft steps are kept raw and priced
        against the current plain time, so those seen before the first plain step count
        too. `switch`: a drafting step whose K differs from the one before (a fused step
        verifying one K's drafts and proposing another's): it counts toward the measured
        tokens/s but is no point of the cost fit (`FIT_SWITCHES`)."""
        b = _bucket(batch_size)
        self._n += 1
        # (With a few drafts spread over many sequences, timing noise divided by a small
        # count would pass for the price of a draft: such steps are neither kind.)
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
            if FIT_SWITCHES or not switch:
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
    lumpiness of its own (one token per sequence), so its spread is disturbance only, and
    at 64 streams under steady arrivals the few plain steps a probe times often follow an
    admission: their median read 1.70 ms on the H200 where a steady K=0 engine's read 1.12.
    Read high, it made every draft look cheap (the price of a draft is a drafting step's
    time over the plain one); read low, drafting only looks dearer."""
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


STALL = 3.0  # a step this many times the window's median time is a stall, not a rate sample


def _rate(samples) -> float:
    """Tokens per second over (tokens, seconds) samples: total tokens over total time, the
    stalls left out. Not the median of per-step rates: a drafting step's tokens are lumpy
    (at one stream and acceptance ~0.5, most steps emit one token and some several), so
    the median step's rate can sit far below the rate the steps deliver together, and
    once read as a loss it held a stream at K=0 for a whole run (0.92x no-spec on the
    H200 where the same engine drafting ran 1.17x)."""
    cap = STALL * statistics.median(sec for _, sec in samples)
    kept = [(tok, sec) for tok, sec in samples if sec <= cap]
    return sum(tok for tok, _ in kept) / sum(sec for _, sec in kept)


class KPolicy:
    """Maximizes expected tokens per unit of step cost.

    With per-token acceptance a, K drafts emit (1 - a^(K+1)) / (1 - a) tokens per target
    forward; the step costs 1 + f + K * c relative to a plain decode step (f: what any
    drafting step adds, c: the price of a draft). Both are measured (`StepCosts`: every
    PLAIN_PROBE_EVERY steps PROBE_LEN steps run without drafts to time a plain step at the
    current batch size); until then f is 0 and c SpecConfig's verify + draft cost, the
    verify part growing with the batch (the forward leaves the memory-bound regime).
    Above the model sits a measured check: where steady drafting steps emitted fewer tokens
    per second than steady plain steps at the same batch-size bucket (`GAIN_FLOOR`), the
    batch decodes plainly; where they emitted WIN_FLOOR times as many, a batch the model
    would put at K=0 drafts at the model's best K above 0 (the step's host work grows with
    the tokens it emits, which the measured price of a draft takes for the device's).

    A fused batch step runs graphs captured at padded sizes (`levels`: verify rows and draft
    chain steps), so K is priced by what it runs (`paid`): with levels 1, 2, 4, 8 and 0, 1,
    2, 4, 7, K=5 runs the K=7 chain and verifies 8 rows.
    """

    def __init__(self, spec: SpecConfig, prior: float = 0.6, batch_knee: int = 16):
        self.spec, self.prior, self.knee = spec, prior, batch_knee
        self.costs = StepCosts()
        self.plain_probe = False
        self.draft_probe = False
        self.batch_idle = 0  # fused steps in a row at K=0 (choose_batch)
        self.batch_k: int | None = None  # the last fused step's K (choose_batch)
        self.batch_ks: Counter = Counter()  # K of each fused step chosen (choose_batch)
        # why each fused step got its K: "probe" (a plain probe), "model" / "model_k0" (the
        # step-cost model's pick: drafts / none), "losing" (drafting measured slower than
        # plain), "winning" (measured faster where the model said K=0), "retry" (a batch
        # at K=0 drafting one token)
        self.batch_why: Counter = Counter()
        # When a list: (K, why) of every fused step's pick in order (for benchmarks)
        self.picks: list | None = None
        # (query levels, draft levels) of the fused step's graphs, set by its runner; where
        # they depend on the batch size (`SpecConfig.dense_levels_min_batch`), `levels_at`
        # gives them for a batch (and `levels` are the smallest batches')
        self.levels: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.levels_at: Callable[[int], tuple[tuple[int, ...], tuple[int, ...]]] | None = None
        self._paid: dict[tuple, np.ndarray] = {}  # `_paid_costs`

    def begin_propose(self, step: int, batch_size: int) -> None:
        """Called before a step's drafts are chosen: decides whether this is a plain probe
        (no drafts for anyone, so that the next step is a plain one and gets timed) or a
        draft probe (K from the configured costs, so that drafting keeps being priced even
        where the measured costs have switched it off)."""
        self.plain_probe = self.draft_probe = False
        if not self.spec.dynamic or self.spec.num_tokens == 0:
            return
        known = self.costs.knows_plain(batch_size)
        every = PLAIN_PROBE_EVERY if known else 4 * PROBE_LEN
        if not self._probing(step, every):
            return
        if known and PROBE_RELAX > 1:
            # (Read only where the unrelaxed schedule probes: the relaxed one's probes are a
            # subset of those steps, and the gain costs host time every step at 64 streams.)
            gain = self.costs.measured_gain(batch_size)
            if gain is not None and gain >= PROBE_RELAX_GAIN:
                every *= PROBE_RELAX
        self._probing(step, every)

    def _probing(self, step: int, every: int) -> bool:
        """Set this step's probe flags for probes every `every` steps; whether either is."""
        self.plain_probe = step % every < PROBE_LEN
        self.draft_probe = every // 2 <= step % every < every // 2 + PROBE_LEN
        return self.plain_probe or self.draft_probe

    def choose(self, seq: Sequence, batch_size: int) -> int:
        kmax = self.spec.num_tokens
        if not self.spec.dynamic or kmax == 0:
            return kmax
        # A seeded sampled request's draws depend on its K: keep its K a function of its own
        # acceptance and the batch size, never of wall-clock timings, so it replays exactly.
        seeded = not seq.params.greedy and seq.params.seed is not None
        if self.plain_probe and not seeded:
            return 0
        kmax = self._kmax(batch_size)
        fixed, per = self._cost(batch_size, seeded)
        best_k = self._best_k([self._tokens(seq)], per, kmax=kmax, fixed=fixed)
        if best_k and not seeded and self._losing(batch_size):
            best_k = 0
        if best_k and not seeded and self._batch_plain(batch_size):
            return 0
        if best_k == 0:
            seq.idle_steps += 1
            if seq.idle_steps % PROBE_EVERY == 0 and kmax:
                return 1
        return best_k

    def choose_batch(self, seqs: list[Sequence], batch_size: int) -> int:
        """One K for a whole fused step (greedy decodes only). Its rows form a [B, K+1]
        grid and its draft chain runs K steps for everyone, so a sequence drafting fewer
        than the batch's K saves nothing; per-sequence choices would instead make the whole
        batch pay for whichever sequence drafts most (a K=0 sequence probing every
        PROBE_EVERY steps, at 64 streams, makes nearly every step a drafting one). So K
        maximizes the batch's expected tokens per unit of step cost, and a batch at K=0
        probes together, every BATCH_PROBE_EVERY steps (PROBE_EVERY at SMALL_BATCH
        sequences or fewer, where a probe costs little)."""
        k = self._choose_batch(seqs, batch_size)
        self.batch_ks[k] += 1
        self.batch_k = k
        return k

    def _batch_plain(self, batch_size: int) -> bool:
        """A sequence joining a batch whose fused steps decode plainly (a new arrival's
        prefill proposing): its drafts would make the next fused step verify K+1 rows for
        every sequence (one grid), so it drafts only when the batch does. Draft probes
        excepted."""
        return batch_size > 1 and self.batch_k == 0 and not self.draft_probe

    def _choose_batch(self, seqs: list[Sequence], batch_size: int) -> int:
        kmax = self.spec.num_tokens
        if not self.spec.dynamic or kmax == 0:
            return kmax
        if self.plain_probe:
            self.batch_why["probe"] += 1
            if self.picks is not None:
                self.picks.append((0, "probe"))
            return 0
        kmax = self._kmax(batch_size, padded=True)
        if self.spec.batch_k is not None:  # one K for every fused batch (SpecConfig)
            best_k, why = min(self.spec.batch_k, kmax), "fixed"
            if best_k and self._losing(batch_size):
                best_k, why = 0, "losing"
            return self._picked(best_k, why, batch_size, kmax)
        rates, (fixed, per) = self._batch_tokens(seqs), self._cost(batch_size, False)
        best_k = self._best_k(rates, per, BATCH_START_MARGIN, kmax, padded=True, fixed=fixed,
                              batch_size=batch_size)
        why = "model"
        if best_k and self._losing(batch_size):
            best_k, why = 0, "losing"
        elif best_k == 0 and kmax and self._winning(batch_size):
            # the model's best K that drafts (K=1 where every deeper one prices worse), or
            # the K of the level that measured best (SpecConfig.win_pick: at 2 streams on
            # the H200 the model's K=1 took 95-111 of ~236 burst steps, and those steps
            # emitted 3.4 tokens/ms against 4.1-4.2 for levels 3.5-7, bench/README.md)
            best_k = (self.spec.win_pick == "measured" and
                      self._measured_k(batch_size, kmax)) or \
                self._best_k(rates, per, 0.0, kmax, True, fixed, batch_size)
            why = "winning"
        return self._picked(best_k, why, batch_size, kmax)

    def _picked(self, best_k: int, why: str, batch_size: int, kmax: int) -> int:
        """A fused batch's K as chosen, after the retry a batch held at K=0 makes now and
        then; counted by reason."""
        if best_k == 0:
            # (Rarer than a lone sequence's probe: a batch probe breaks the host-packed K=0
            # continuation for every stream, twice.)
            self.batch_idle += 1
            every = PROBE_EVERY if batch_size <= SMALL_BATCH else BATCH_PROBE_EVERY
            if self.batch_idle % every == 0 and kmax:
                best_k, why = 1, "retry"
        why = "model_k0" if why == "model" and not best_k else why
        self.batch_why[why] += 1
        if self.picks is not None:
            self.picks.append((best_k, why))
        return best_k

    def _measured_k(self, batch_size: int, kmax: int) -> int | None:
        """The deepest K up to kmax that the fused step runs at the level that measured the
        most tokens per second at this batch size (`StepCosts.best_level`; K's level is
        `paid(K)`); None without a measured level or a K at or below it."""
        level = self.costs.best_level(batch_size)
        if level is None:
            return None
        fits = [k for k in range(1, kmax + 1)
                if self.paid(k, batch_size=batch_size) <= level + 1e-9]
        return fits[-1] if fits else None

    def _kmax(self, batch_size: int, padded: bool = False) -> int:
        """The deepest K dynamic K may take at this batch size: batch * (K + 1) verified
        tokens within SpecConfig.verify_token_budget (`padded`: batch * the verify rows the
        fused step's graph for K runs)."""
        budget, kmax = self.spec.verify_token_budget, self.spec.num_tokens
        if not budget:
            return kmax
        rows = budget // max(batch_size, 1)
        levels = self._levels(batch_size)
        if padded and levels is not None:
            fits = [q - 1 for q in levels[0] if q <= rows]
            return min(kmax, fits[-1]) if fits else 0
        return max(0, min(kmax, rows - 1))

    def _gain(self, batch_size: int, fresh: int | None = None) -> float | None:
        """Drafting's measured tokens/s over plain decoding's at this batch size, for the
        measured overrides of the model; None until both were timed, and in draft probes
        (which keep drafting at the configured costs, so that the measurement stays
        current). `fresh`: drafting steps of the last this many only."""
        return None if self.draft_probe else self.costs.measured_gain(batch_size, fresh)

    def _winning(self, batch_size: int) -> bool:
        """Drafting measured at least WIN_FLOOR times plain decoding's tokens/s."""
        gain = self._gain(batch_size)
        return gain is not None and gain >= WIN_FLOOR

    def _losing(self, batch_size: int) -> bool:
        """Drafting measured slower than plain decoding, lately (`LOSING_FRESH`)."""
        gain = self._gain(batch_size, LOSING_FRESH)
        return gain is not None and gain < GAIN_FLOOR

    def _rate(self, seq: Sequence) -> float:
        return min(seq.accept_rate if seq.accept_rate is not None else self.prior, 0.999)

    def _cost(self, batch_size: int, seeded: bool) -> tuple[float, float]:
        """What drafting adds to a plain step, relative to it: (a fixed part, the cost of
        one draft per sequence); measured (`StepCosts`) or the configured guess (no fixed
        part)."""
        per_token = None if seeded or self.draft_probe else self.costs.per_token(batch_size)
        if per_token is None:
            per_token = self.spec.verify_token_cost * max(1.0, batch_size / self.knee)
            return 0.0, per_token + self.spec.draft_step_cost
        return self.costs.fixed_cost(batch_size), per_token

    def _levels(self, batch_size: int | None):
        """The fused step's (query levels, draft levels) at this batch size (None: `levels`)."""
        if self.levels_at is not None and batch_size is not None:
            return self.levels_at(batch_size)
        return self.levels

    def paid(self, k: int, kn: int | None = None, batch_size: int | None = None) -> float:
        """Drafts per sequence a fused step of batch_size sequences verifying k drafts and
        drafting kn more (default k) pays for: the mean of its padded verify rows beyond the
        pending token and its padded chain, as `StepCosts.record` is given them. The plain
        mean without levels."""
        kn = k if kn is None else kn
        levels = self._levels(batch_size)
        if levels is None:
            return (k + kn) / 2
        qs, ds = levels
        q = next((x for x in qs if x > k), k + 1)
        d = next((x for x in ds if x >= kn), kn)
        return (q - 1 + d) / 2

    def _paid_costs(self, kmax: int, batch_size: int | None = None) -> np.ndarray:
        """`paid` of K = 1..kmax, kept per (levels, kmax): `_best_k` prices every fused step's
        candidates by them."""
        key = (self._levels(batch_size), kmax)
        if key not in self._paid:
            self._paid[key] = np.array([self.paid(k, batch_size=batch_size)
                                        for k in range(1, kmax + 1)], dtype=np.float64)
        return self._paid[key]

    def _best_k(self, rates: list, per_token: float, start: float = MARGIN,
                kmax: int | None = None, padded: bool = False, fixed: float = 0.0,
                batch_size: int | None = None) -> int:
        """argmax over K of the sequences' expected tokens per forward, over the step's cost
        1 + fixed + K c (fixed: what any drafting step adds; c: a draft's price): for a
        rate a, (1 - a^(K+1)) / (1 - a); a sequence given as an array (`_tokens`) brings
        its own per-K expectation. Drafting at all must beat plain decoding by `start`,
        each deeper K the best shallower one by MARGIN (no speculating for a rounding-error
        win); K at most kmax (default: SpecConfig.num_tokens); `padded`: K priced by the
        fused graphs' padded sizes at batch_size (`paid`)."""
        kmax = self.spec.num_tokens if kmax is None else kmax
        if kmax == 0:
            return 0
        k = np.arange(1, kmax + 1, dtype=np.float64)
        total = np.zeros(kmax)
        runs = self.spec.accept_model == "runs"  # else every rate is a float (`_tokens`)
        geo = [a for a in rates if not isinstance(a, np.ndarray)] if runs else rates
        if geo:
            a = np.asarray(geo, dtype=np.float64)[None, :]
            total += ((1 - a ** (k[:, None] + 1)) / (1 - a)).sum(axis=1)
        for curve in rates if runs else ():
            if isinstance(curve, np.ndarray):
                total += curve[:kmax]
        cost = self._paid_costs(kmax, batch_size) if padded else k
        gains = total / (1 + fixed + cost * per_token)
        best_k, best, need = 0, float(len(rates)), start
        for i, gain in enumerate(gains.tolist()):
            # (Padded, a K priced as the next K is, is never worth less than it: only the
            # deepest K of each price is a candidate.)
            if padded and i + 1 < kmax and cost[i] == cost[i + 1]:
                continue
            if gain > best * need:
                best_k, best, need = i + 1, gain, MARGIN
        return best_k

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Fold one verify result into the sequence's acceptance estimate (and, with
        accept_model "runs", into its per-depth counts: depths 1..accepted were tried and
        accepted, depth accepted + 1 tried and rejected when it was drafted)."""
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        # Accepted drafts over drafts tried, each sum decayed by ACCEPT_DECAY a verify: the
        # per-token rate's estimate. Not a running mean of each verify's ratio, which reads
        # low wherever K > 1 (a verify that rejects at depth 1 counts as a rate of 0 however
        # many drafts it carried; at a = 0.62 and K = 3 that mean is 0.45) and so held
        # batches at K=0 that drafting would have sped up.
        acc, tried = seq.accept_counts or (0.0, 0.0)
        acc, tried = ACCEPT_DECAY * acc + accepted, ACCEPT_DECAY * tried + trials
        seq.accept_counts = (acc, tried)
        seq.accept_rate = acc / tried
        if self.spec.accept_model != "runs":
            return
        if seq.accept_runs is None:
            seq.accept_runs = ([0.0] * self.spec.num_tokens, [0.0] * self.spec.num_tokens)
        tried, passed = seq.accept_runs
        for j in range(len(tried)):
            tried[j] *= RUNS_DECAY
            passed[j] *= RUNS_DECAY
        for j in range(min(trials, len(tried))):
            tried[j] += 1.0
        for j in range(min(accepted, len(passed))):
            passed[j] += 1.0

    def _batch_tokens(self, seqs: list[Sequence]) -> list:
        """`_tokens` of every sequence of a fused batch (the geometric model's rates read in
        one pass: at 64 streams this runs every step, on the host's critical path)."""
        if self.spec.accept_model == "runs":
            return [self._tokens(s) for s in seqs]
        prior = self.prior
        return [min(prior if a is None else a, 0.999) for a in [s.accept_rate for s in seqs]]

    def _tokens(self, seq: Sequence) -> np.ndarray | float:
        """What `_best_k` prices a sequence by: its acceptance rate (geometric), or with
        accept_model "runs" its expected tokens per target forward at K = 1..num_tokens,
        1 + sum over depths i <= K of the chance that drafts 1..i are all accepted."""
        a = self._rate(seq)
        if self.spec.accept_model != "runs" or seq.accept_runs is None:
            return a
        tried, passed = seq.accept_runs
        r = [min((p + RUNS_PRIOR * a) / (t + RUNS_PRIOR), 0.999) for t, p in zip(tried, passed)]
        return 1.0 + np.cumsum(np.cumprod(r))
