"""The plain-step clock: how long one plain step takes at the current context (t_ar), the
yardstick of the commit gate and of arm holds, and the bursts of plain steps that (re)measure it
when it is missing or the context has grown. A model's latest reading is shared by the clocks of
every generation on it in the process (`shared_for`), so only the first one pays for a burst."""

from __future__ import annotations

import math
import statistics
import weakref
from dataclasses import dataclass
from typing import Any

from .stats import StepStats


@dataclass(frozen=True)
class ClockConfig:
    # re-measure when the context grew by this fraction of the one t_ar was measured at ...
    refresh: float = 1.0
    refresh_min: int = 512  # ... and by at least this many tokens
    burst: int = 4  # plain steps that (re)measure t_ar: the middle two are pipelined


@dataclass
class PlainTime:
    """A model's plain-step time as last measured in this process, and the context it was
    measured at (nan: never)."""

    t_ar: float = math.nan
    context: int = 0


_SHARED: dict[int, tuple[weakref.ref, PlainTime]] = {}


def shared_for(model: Any) -> PlainTime:
    """The PlainTime every clock of a generation on `model` reads and writes (one per live
    model object; forgotten with it)."""
    key = id(model)
    held = _SHARED.get(key)
    if held is not None and held[0]() is model:
        return held[1]
    shared = PlainTime()
    try:
        ref = weakref.ref(model, lambda _: _SHARED.pop(key, None))
    except TypeError:  # no weak references to it: not shared
        return shared
    _SHARED[key] = (ref, shared)
    return shared


@dataclass
class ArClock:
    """The plain-step time and the context length it was measured at. t_ar is the median of
    the latest three plain steps; once a step inside a pipelined burst was seen (greedy
    decoding), of those only: a floor decodes in such bursts, where a step's graph is built
    while the one before computes, so a lone plain step reads ~25% slower than a floor runs.

    With a config, `measure` asks for bursts of plain steps while t_ar is missing or stale;
    without one (nothing reads t_ar, as under ADASPEC_GATE=off) it never asks. With `shared`,
    a generation that starts without t_ar takes the model's latest reading, and every new
    reading is written back."""

    cfg: ClockConfig | None = None
    shared: PlainTime | None = None
    t_ar: float = math.nan
    context: int = 0
    plain_seen: int = 0
    recent: tuple[float, ...] = ()
    overlapped: bool = False  # t_ar comes from steps inside pipelined bursts
    now: int = 0  # the newest step's context
    measure_left: int = 0  # plain steps left in the current burst

    def start(self) -> None:
        """A generation begins: t_ar is kept, but its first plain step runs cold and it may
        not pipeline (sampling)."""
        self.plain_seen, self.overlapped, self.measure_left = 0, False, 0
        sh = self.shared
        if sh is not None and math.isnan(self.t_ar) and not math.isnan(sh.t_ar):
            self.t_ar, self.context, self.recent = sh.t_ar, sh.context, ()

    def observe(self, step: StepStats) -> None:
        self.now = step.context
        if step.speculative:
            return
        self.plain_seen += 1
        if self.plain_seen == 1:  # the first plain step of a generation runs cold
            return
        if step.overlapped and not self.overlapped:
            self.overlapped, self.recent = True, ()
        elif self.overlapped and not step.overlapped:
            return
        self.recent = (*self.recent[-2:], step.total_s)
        self.t_ar, self.context = statistics.median(self.recent), step.context
        if self.shared is not None:
            self.shared.t_ar, self.shared.context = self.t_ar, self.context

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
