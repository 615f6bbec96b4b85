"""Dynamic K: how many tokens to draft for a sequence or a fused batch, from its measured
acceptance and the step costs measured at its batch size (engine/spec/costs.py), down to 0
(plain decode) when speculation stops paying."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from engine.config import SpecConfig
from engine.sequence import Sequence
from engine.spec.collapse import CollapseWatch
from engine.spec.costs import StepCosts

__all__ = ["KPolicy", "fold_verify"]

# Probes: a policy that stopped drafting must still notice when drafting would pay again,
# and the plain step time it compares against must stay current.
PROBE_EVERY = 8  # a sequence at K=0 drafts one token this often, to notice recovery
BATCH_PROBE_EVERY = 32  # a whole fused batch at K=0 drafts one token this often...
SMALL_BATCH = 8  # ...or, at this many sequences or fewer, every PROBE_EVERY steps
PLAIN_PROBE_EVERY = 64  # every this many steps, PROBE_LEN steps without drafts time a plain step
PROBE_LEN = 4  # steps a probe lasts: its first ones are transitions, the rest get timed
# Where drafting measured at least PROBE_RELAX_GAIN times plain decoding's tokens/s, plain
# probes come PROBE_RELAX times further apart: each probe step gives up most of a drafting
# step's tokens, and far from the break-even a fresher plain time changes no K.
PROBE_RELAX_GAIN = 1.5
PROBE_RELAX = 4

# Margins: no switching K for a win within the model's error.
MARGIN = 1.02  # a deeper K must beat the best shallower one by this factor
# A fused batch leaves K=0 only for a predicted win of this factor: switching regimes costs
# what the 1 + f + K*c model does not price (relaunches from host-packed inputs).
BATCH_START_MARGIN = 1.10

# Measured overrides of the model, from tokens/s of steady steps of each kind at the batch's
# bucket (`StepCosts.measured_gain`).
# Below this gain the batch decodes plainly whatever the model predicts: the model misses
# what drafting costs beyond a steady step's time.
GAIN_FLOOR = 1.0
# At this gain or above, a fused batch the model would put at K=0 keeps drafting at the
# model's best K above 0: the measured price of a draft also holds host work that grows with
# the tokens a step emits, which the model takes for the device's.
WIN_FLOOR = 1.10
# A losing verdict reads only drafting steps of the last this many: it holds the batch at
# K=0, where only probes draft, so older steps would keep it there long after the text that
# drafted badly. A winning verdict renews its own samples and reads the whole STALE window.
LOSING_FRESH = 64

# Acceptance estimates.
ACCEPT_DECAY = 0.7  # per verify, of a sequence's accepted and tried draft counts
# accept_model "runs": per-depth counts decay by this factor a verify (about the last ten
# verifies count), and a depth's acceptance is shrunk toward the sequence's rate with this
# many pseudo-trials, so a depth tried once or never reads about as the geometric model.
RUNS_DECAY = 0.9
RUNS_PRIOR = 2.0


class KPolicy:
    """Maximizes expected tokens per unit of step cost.

    With per-token acceptance a, K drafts emit (1 - a^(K+1)) / (1 - a) tokens per target forward
    at a cost of 1 + f + K * c plain steps (f: fixed drafting overhead, c: price per draft), both
    measured (`StepCosts`) or, until then, f = 0 and c from SpecConfig. GAIN_FLOOR and WIN_FLOOR
    guard the model. A fused batch step prices K by the padded graph it runs (`paid`).
    """

    def __init__(self, spec: SpecConfig, prior: float = 0.6, batch_knee: int = 16):
        self.spec, self.prior, self.knee = spec, prior, batch_knee
        self.costs = StepCosts()
        self.watch = CollapseWatch(spec.collapse_below, spec.num_tokens)
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
        self.picks: list | None = None  # when a list: (K, why) of each fused step's pick
        # The fused step's (query levels, draft levels), set by its runner; per batch: levels_at
        self.levels: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.levels_at: Callable[[int], tuple[tuple[int, ...], tuple[int, ...]]] | None = None
        self._paid: dict[tuple, np.ndarray] = {}  # `_paid_costs`
        self._depths = spec.num_tokens if spec.accept_model == "runs" else 0  # `fold_verify`

    def forget(self) -> None:
        """Drop what steps taught (costs, verdicts, probes), keeping the runner's graph levels:
        a warm-up's first-call step times misprice drafting (`warmup.warm_request`)."""
        keep = self.levels, self.levels_at, self.picks
        self.__init__(self.spec, self.prior, self.knee)
        self.levels, self.levels_at, self.picks = keep

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
        # A seeded sampled request's draws depend on its K: keep its K a function of its own
        # acceptance and the batch size, never of wall-clock timings or of other traffic, so
        # it replays exactly.
        seeded = not seq.params.greedy and seq.params.seed is not None
        if kmax and not seeded and not self.watch.allows():
            return 0
        if not self.spec.dynamic or kmax == 0:
            return kmax
        if self.plain_probe and not seeded:
            return 0
        kmax = self._kmax(batch_size)
        fixed, per = self._cost(batch_size, seeded)
        tokens = [self._tokens(seq)]
        best_k = self._best_k(tokens, per, kmax=kmax, fixed=fixed)
        if best_k and not seeded and self._losing(batch_size):
            best_k = 0
        elif not best_k and kmax and not seeded and self._winning(batch_size):
            # measured faster than plain: the model's best K above 0 (`choose_batch` too)
            best_k = self._best_k(tokens, per, 0.0, kmax, fixed=fixed)
        if best_k and not seeded and self._batch_plain(batch_size):
            return 0
        if best_k == 0:
            seq.idle_steps += 1
            if seq.idle_steps % PROBE_EVERY == 0 and kmax:
                return 1
        return best_k

    def choose_batch(self, seqs: list[Sequence], batch_size: int) -> int:
        """One K for a whole fused step (greedy decodes only): its draft chain runs K steps for
        everyone, so per-sequence K saves nothing. K maximizes the batch's expected tokens per unit
        of step cost; a batch at K=0 probes together every BATCH_PROBE_EVERY steps (PROBE_EVERY at
        SMALL_BATCH sequences or fewer, where a probe costs little)."""
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
        if kmax and not self.watch.allows():  # acceptance collapsed: drafts off but probes
            self.batch_why["collapsed"] += 1
            return 0
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
            # the K of the level that measured best (SpecConfig.win_pick "measured")
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
        """argmax over K of the sequences' expected tokens per forward over the step cost 1 + fixed
        + K c; a sequence given as an array (`_tokens`) brings its own per-K expectation. Drafting
        must beat plain decoding by `start`, each deeper K the best shallower one by MARGIN; K at
        most kmax (default SpecConfig.num_tokens); `padded`: price K by the fused graphs' padded
        sizes at batch_size (`paid`)."""
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
        """Fold one verify result into the sequence's acceptance estimate (`fold_verify`) and
        the collapse watch (when it watches: this runs per sequence and step)."""
        fold_verify(seq, drafted, accepted, self._depths)
        if self.watch.below > 0:
            self.watch.record(drafted, accepted)

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


def fold_verify(seq: Sequence, drafted: int, accepted: int, depths: int = 0) -> None:
    """Fold one verify result into the sequence's acceptance estimate and, with `depths`
    (accept_model "runs": the draft depths kept), into its per-depth counts: depths
    1..accepted were tried and accepted, depth accepted + 1 tried and rejected when it was
    drafted."""
    if drafted == 0:
        return
    trials = accepted + (1 if accepted < drafted else 0)
    # Accepted drafts over drafts tried, each sum decayed by ACCEPT_DECAY a verify: the
    # per-token rate's estimate. Not a running mean of each verify's ratio, which reads low
    # wherever K > 1 (a verify that rejects at depth 1 counts as a rate of 0 however many
    # drafts it carried).
    acc, tried = seq.accept_counts or (0.0, 0.0)
    acc, tried = ACCEPT_DECAY * acc + accepted, ACCEPT_DECAY * tried + trials
    seq.accept_counts = (acc, tried)
    seq.accept_rate = acc / tried
    if not depths:
        return
    if seq.accept_runs is None:
        seq.accept_runs = ([0.0] * depths, [0.0] * depths)
    tried, passed = seq.accept_runs
    for j in range(len(tried)):
        tried[j] *= RUNS_DECAY
        passed[j] *= RUNS_DECAY
    for j in range(min(trials, len(tried))):
        tried[j] += 1.0
    for j in range(min(accepted, len(passed))):
        passed[j] += 1.0
