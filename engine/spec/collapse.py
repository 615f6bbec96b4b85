"""The acceptance-collapse detector: when drafts stop being accepted (shifted traffic, a head
trained for another target or template), speculation makes every stream slower. The watch
tracks acceptance by draft position over recent verifies; below break-even it turns speculation
off (K=0), logs it, and drafts again only in sparse probes until acceptance recovers. It is the
floor that also holds for a fixed K."""

from __future__ import annotations

import logging

log = logging.getLogger("tandem.engine")

DECAY = 0.98  # per verify: about the last fifty verifies count
MIN_VERIFIES = 32  # verifies (decayed) before it turns speculation off...
RECOVER_VERIFIES = 8  # ...and probe verifies before it turns it back on
PROBE_EVERY = 64  # while off, one choice of K in this many drafts (to see recovery)
RECOVER = 1.2  # back on only above break-even times this (no flapping at the edge)


class CollapseWatch:
    """Mean tokens per verify (1 + accepted drafts) against `below`, the break-even; 0: off.
    `collapsed` while speculation is off; `collapses` counts the times it went off."""

    def __init__(self, below: float, depths: int):
        self.below = below
        self.verifies = 0.0
        self.accepted = 0.0
        self.tried = [0.0] * depths  # per draft position: decayed drafts tried ...
        self.passed = [0.0] * depths  # ... and accepted
        self.collapsed = False
        self.collapses = 0
        self._choices = 0

    @property
    def length(self) -> float | None:
        """Mean tokens a verify emitted lately, or None while too few verifies count."""
        need = RECOVER_VERIFIES if self.collapsed else MIN_VERIFIES
        return 1.0 + self.accepted / self.verifies if self.verifies >= need else None

    def record(self, drafted: int, accepted: int) -> None:
        """One verify of `drafted` drafts of which the first `accepted` were accepted."""
        if drafted == 0 or self.below <= 0:
            return
        self.verifies = DECAY * self.verifies + 1.0
        self.accepted = DECAY * self.accepted + accepted
        for j in range(len(self.tried)):
            self.tried[j] *= DECAY
            self.passed[j] *= DECAY
            if j < drafted and j <= accepted:  # position j was tried: all before it passed
                self.tried[j] += 1.0
                self.passed[j] += j < accepted
        length = self.length
        if length is None:
            return
        if not self.collapsed and length < self.below:
            self.collapsed, self.collapses = True, self.collapses + 1
            log.warning("speculation off: %.2f tokens per verify over recent verifies, below "
                        "break-even %.2f (acceptance by draft position %s); probing for "
                        "recovery", length, self.below, self._by_position())
            self._reset()
        elif self.collapsed and length >= self.below * RECOVER:
            self.collapsed = False
            log.warning("speculation back on: %.2f tokens per verify in probes (break-even "
                        "%.2f)", length, self.below)

    def allows(self) -> bool:
        """Whether a choice of K may draft: always while on; one in PROBE_EVERY while off."""
        if not self.collapsed:
            return True
        self._choices += 1
        return self._choices % PROBE_EVERY == 0

    def _reset(self) -> None:
        """Forget the collapse's evidence: recovery is judged on probes alone."""
        self.verifies = self.accepted = 0.0
        self.tried = [0.0] * len(self.tried)
        self.passed = [0.0] * len(self.passed)

    def _by_position(self) -> str:
        rates = [p / t for t, p in zip(self.tried, self.passed) if t >= 1.0]
        return "[" + ", ".join(f"{r:.2f}" for r in rates) + "]"
