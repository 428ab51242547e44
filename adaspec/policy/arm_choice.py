"""The arm scheduler: which arms are asked to draft, in the user's order. An arm a later one is
expected to beat gives way to it (ranking); a costly arm that plain steps are expected to beat
is held back on its own floor and comes back as probes judged on their own steps (holds)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..loop.stats import StepStats
from . import floor as fl
from .estimates import ArmEstimates
from .gates import commit_ratio


@dataclass(frozen=True)
class HoldConfig:
    margin: float = 1.0  # an arm must commit at least margin x a plain step's tokens per second
    min_t_ar: float = 0.5e-3  # seconds; guards a zero or absurdly small plain-step time


def held_probe_lost(margin: float, probe: fl.ProbeConfig, s: fl.FloorState, ratio: float) -> bool:
    """A held arm's probe is judged on its own steps (this one's commit ratio is `ratio`), not
    on the estimate that held the arm back, which the plain steps since did not refresh: lost
    when the mean ratio of its steps falls below half the margin, or below the margin at its
    last step."""
    mean = (s.probe_ratio + ratio) / (s.probe_steps + 1)
    last = s.probe_steps + 1 >= probe.probe_len
    return mean < margin * (1.0 if last else 0.5)


class ArmScheduler:
    """Ranks the arms and holds costly losers back. holds None: no arm is ever held (ranking
    still applies). It judges by the arms' estimates (estimates.py)."""

    def __init__(
        self,
        estimates: ArmEstimates,
        holds: HoldConfig | None,
        probe: fl.ProbeConfig,
        free_cost: float,
    ) -> None:
        self.estimates, self.holds, self.probe, self.free_cost = estimates, holds, probe, free_cost
        self.held: list[fl.FloorState] = []
        self.held_steps: list[int] = []  # per arm: steps it sat out, held back

    def start(self, n_arms: int) -> None:
        self.held = [fl.FloorState() for _ in range(n_arms)]
        self.held_steps = [0] * n_arms

    def order(self) -> list[int]:
        """The arms to ask this step, in order (none: every arm is held back)."""
        order = [a for a in range(len(self.held)) if not self.held[a].floored]
        for a in range(len(self.held)):
            self.held_steps[a] += self.held[a].floored
        return [a for i, a in enumerate(order) if not self._outranked(a, order[i + 1 :])]

    def plain_ahead(self) -> int:
        """Every arm held back: plain steps certain after this one (until the first probe)."""
        return min(h.ar_left for h in self.held) - 1

    def free_arms(self, t_ar: float) -> tuple[int, ...]:
        return tuple(
            a for a in range(len(self.held)) if self.estimates.free(a, t_ar, self.free_cost)
        )

    def _outranked(self, a: int, later: Sequence[int]) -> bool:
        """A later arm, judged like a, is expected to commit more tokens per second (e.g. PLD's
        short matches in new text, before a model drafter). On that arm's exploration steps a
        is asked anyway, so the comparison stays fresh."""
        est = self.estimates
        if not est.judged(a):
            return False
        rate = est.rate(a)
        for b in later:
            if not est.timed(b) or not est.judged(b) or est.exploring(b):
                continue
            theirs = est.rate(b)
            if rate is not None and theirs is not None and rate < theirs:
                return True
        return False

    def loses_to_plain(self, a: int, t_ar: float) -> bool:
        """Costly arm a, judged, is expected to commit fewer tokens per second than a plain
        step (times the margin). Its estimate (acceptance by position, measured costs) sees a
        mix of rare wins and steady losses that the commit gate's streak misses."""
        if self.holds is None or math.isnan(t_ar):
            return False
        if not self.estimates.judged(a) or self.estimates.free(a, t_ar, self.free_cost):
            return False
        rate = self.estimates.rate(a, slow=True)
        return rate is not None and rate * t_ar < self.holds.margin

    def is_probing(self, a: int | None) -> bool:
        """Arm a (None: no arm) is held and on probe: its steps are judged by its hold alone,
        so a losing probe does not floor the other arms with it."""
        return a is not None and self.held[a].probing

    def observe(self, step: StepStats, t_ar: float) -> None:
        """Every step: the drafting arm's hold judges it; the others' holds count a plain step."""
        arm = step.arm if step.speculative else None
        ratio = None
        if arm is not None and self.holds is not None and not math.isnan(t_ar):
            ratio = commit_ratio(step.committed, step.judged_s, t_ar, self.holds.min_t_ar)
        for a in range(len(self.held)):
            if a != arm:
                self.held[a] = fl.on_plain_step(self.held[a])
            elif self._lost(a, ratio, t_ar):
                self.held[a] = fl.on_floor(self.probe, self.held[a])
            else:
                was_probing = self.held[a].probing
                self.held[a] = fl.on_spec_step(self.probe, self.held[a], ratio or 0.0)
                # a won probe replaces the slow estimate, which the plain steps before it left
                # stale, by the fast one its steps taught
                if was_probing and not self.held[a].probing:
                    self.estimates.trust_fast(a)

    def _lost(self, a: int, ratio: float | None, t_ar: float) -> bool:
        """Arm a drafted this step (commit ratio `ratio`): whether it is held back (again). On
        probe, by the probe's own steps; else by its estimate (`loses_to_plain`)."""
        held = self.held[a]
        if not held.probing or self.holds is None or ratio is None:
            return self.loses_to_plain(a, t_ar)
        return held_probe_lost(self.holds.margin, self.probe, held, ratio)
