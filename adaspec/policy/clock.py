"""The plain-step clock: how long one plain step takes at the current context (t_ar), the
yardstick of the commit gate and of arm holds, and the bursts of plain steps that (re)measure it
when it is missing or the context has grown."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..loop.stats import StepStats


@dataclass(frozen=True)
class ClockConfig:
    # re-measure when the context grew by this fraction of the one t_ar was measured at ...
    refresh: float = 1.0
    refresh_min: int = 512  # ... and by at least this many tokens
    burst: int = 4  # plain steps that (re)measure t_ar: all but the first are queued


@dataclass
class ArClock:
    """The plain-step time and the context length it was measured at.

    Greedy decoding runs plain steps in runs, as a floor decodes them and as mlx-lm does: a
    synchronous head whose forward is read at once, then steps each queued by the step before
    (StepStats.queued), whose graphs are built while the forward before computes. mlx lets
    only so many graph nodes wait on its stream, so queuing the next forward waits for most of
    the current one: single steps of a run read unevenly (the head long, the last step short).
    t_ar is the mean over the latest run of at least three steps (head included); lone plain
    steps (no run: a drafter had nothing to propose, or sampling, which never queues) count
    only until a run was seen, as the median of the latest three. The first plain step of a
    generation runs cold and is left out.

    With a config, `measure` asks for bursts of plain steps while t_ar is missing or stale;
    without one (nothing reads t_ar, as under ADASPEC_GATE=off) it never asks."""

    cfg: ClockConfig | None = None
    t_ar: float = math.nan
    context: int = 0
    plain_seen: int = 0
    recent: tuple[float, ...] = ()  # the latest lone plain steps' times
    from_runs: bool = False  # t_ar comes from a run (not from lone steps)
    run: tuple[int, float] = (0, 0.0)  # the current run of plain steps: (steps, seconds)
    now: int = 0  # the newest step's context
    measure_left: int = 0  # plain steps left in the current burst

    def start(self) -> None:
        """A generation begins: t_ar is kept, but its first plain step runs cold and it may
        not pipeline (sampling)."""
        self.plain_seen, self.from_runs, self.measure_left = 0, False, 0
        self.run = (0, 0.0)

    def observe(self, step: StepStats) -> None:
        self.now = step.context
        if step.speculative:
            self.run = (0, 0.0)
            return
        self.plain_seen += 1
        if self.plain_seen == 1:  # the first plain step of a generation runs cold
            return
        n, s = self.run if step.queued else (0, 0.0)  # a step not queued heads a new run
        self.run = (n + 1, s + step.total_s)
        if n + 1 >= 3:
            self.from_runs = True
            self.t_ar, self.context = self.run[1] / self.run[0], step.context
        elif not self.from_runs and not step.queued:
            self.recent = (*self.recent[-2:], step.total_s)
            self.t_ar, self.context = statistics.median(self.recent), step.context

    def stale(self, context: int, refresh: float, at_least: int) -> bool:
        """No t_ar yet, or the context grew by more than `refresh` of the one t_ar was measured
        at and by more than `at_least` tokens."""
        if math.isnan(self.t_ar):
            return True
        return context > max(self.context * (1 + refresh), self.context + at_least)

    def measure(self) -> int | None:
        """If this step must be plain to (re)measure t_ar: the plain steps certain after it
        (the step counts as begun); else None."""
        cfg = self.cfg
        if cfg is None:
            return None
        if self.measure_left > 0 or self.stale(self.now, cfg.refresh, cfg.refresh_min):
            self.measure_left = (self.measure_left or cfg.burst) - 1
            return self.measure_left
        return None
