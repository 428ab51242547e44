"""Gates: each decides, from the speculative steps it has seen, whether speculating still pays,
and floors (the policy decodes plainly, then probes again) when it does not. A gate is an object
with one interface (`Gate`); its maths are pure state machines, state + observation in, (state,
floor?) out. No clocks here: the controller measures times and passes the numbers in (docs/gates.md;
lucebox's defaults). `ADASPEC_GATE` names the active gates from `REGISTRY`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .. import settings as settings_mod
from ..errors import SettingsError
from ..loop.stats import StepStats


@dataclass(frozen=True)
class GateInput:
    """What a gate sees of one speculative step."""

    step: StepStats
    t_ar: float  # seconds of a plain step at this context (nan: not measured yet)
    probe_start: bool  # the step is the first of a probe after a floor


class Gate(Protocol):
    """Sees every speculative step (`observe`; True = floor now) and starts afresh on `reset`
    (a new generation, and after any gate floors). needs_p1: whether it reads `step.p1` (the
    target's top-1 probability, one reduction per step)."""

    needs_p1: bool

    def observe(self, seen: GateInput) -> bool: ...

    def reset(self) -> None: ...


class GateConfig(Protocol):
    """A gate's settings; `make` builds the gate (fresh state)."""

    def make(self) -> Gate: ...


@dataclass(frozen=True)
class EntropyConfig:
    ar_p1: float = 0.90  # ema of top-1 prob below this counts as a low step
    tie_p1: float = 0.45  # a single step with top-1 prob below this floors at once
    sustain: int = 2
    weight: float = 0.5  # EMA weight of the newest observation

    def make(self) -> EntropyGate:
        return EntropyGate(self)


@dataclass(frozen=True)
class EntropyState:
    ema_p1: float = 1.0
    low_streak: int = 0
    spec_steps: int = 0


def entropy_step(cfg: EntropyConfig, s: EntropyState, p1: float) -> tuple[EntropyState, bool]:
    """Observe the target's top-1 probability after a speculative step; floor on a near-tie or
    a sustained low-confidence streak."""
    ema = (1 - cfg.weight) * s.ema_p1 + cfg.weight * p1
    low = s.low_streak + 1 if ema < cfg.ar_p1 else 0
    s = EntropyState(ema, low, s.spec_steps + 1)
    return s, p1 < cfg.tie_p1 or low >= cfg.sustain


@dataclass(frozen=True)
class CommitConfig:
    margin: float = 1.0  # speculation must commit at least margin x AR's tokens per second
    sustain: int = 3
    warmup: int = 2
    weight: float = 0.1  # the EMA the margin is held against: ~20 steps of memory
    min_t_ar: float = 0.5e-3  # seconds; guards a zero or absurdly small AR time
    # a second, fast EMA floors at once when it drops below half the margin (a drafter far
    # slower than plain decoding is not given the slow EMA's ~20 steps)
    fast_weight: float = 0.5

    def make(self) -> CommitGate:
        return CommitGate(self)


@dataclass(frozen=True)
class CommitState:
    ema: float = 2.0
    streak: int = 0
    steps: int = 0
    fast: float = 2.0


def commit_ratio(committed: int, step_s: float, t_ar: float, min_t_ar: float) -> float:
    """Tokens this step committed per AR-step-equivalent of wall time (1.0 = break-even)."""
    t_ar = max(t_ar, min_t_ar)
    return committed * t_ar / max(step_s, 1e-9)


def commit_step(
    cfg: CommitConfig, s: CommitState, committed: int, step_s: float, t_ar: float
) -> tuple[CommitState, bool]:
    """Observe one speculative step; floor after warm-up when the slow EMA of the commit ratio
    stays below the margin for `sustain` steps, or the fast one drops below half of it."""
    r = commit_ratio(committed, step_s, t_ar, cfg.min_t_ar)
    ema = (1 - cfg.weight) * s.ema + cfg.weight * r
    fast = (1 - cfg.fast_weight) * s.fast + cfg.fast_weight * r
    streak = s.streak + 1 if ema < cfg.margin else 0
    s = CommitState(ema, streak, s.steps + 1, fast)
    warm = s.steps >= cfg.warmup
    return s, warm and (streak >= cfg.sustain or min(ema, fast) < 0.5 * cfg.margin)


def probe_lost(cfg: CommitConfig, committed: int, step_s: float, t_ar: float) -> bool:
    """A probe is a test, not a fresh start: its first speculative step must break even
    (commit ratio >= margin) or the probe is lost at once, without a new warm-up."""
    return commit_ratio(committed, step_s, t_ar, cfg.min_t_ar) < cfg.margin


class EntropyGate:
    """Floors on the target's uncertainty (`entropy_step`), whatever speculating costs."""

    needs_p1 = True

    def __init__(self, cfg: EntropyConfig) -> None:
        self.cfg, self.state = cfg, EntropyState()

    def observe(self, seen: GateInput) -> bool:
        if seen.step.p1 is None:
            return False
        self.state, floor = entropy_step(self.cfg, self.state, seen.step.p1)
        return floor

    def reset(self) -> None:
        self.state = EntropyState()


class CommitGate:
    """Floors when speculating commits fewer tokens per second than plain steps (times the
    margin): `commit_step`, and a probe whose first step does not break even (`probe_lost`).
    Silent until a plain step was timed."""

    needs_p1 = False

    def __init__(self, cfg: CommitConfig) -> None:
        self.cfg, self.state = cfg, CommitState()

    def observe(self, seen: GateInput) -> bool:
        s, t_ar = seen.step, seen.t_ar
        if math.isnan(t_ar):
            return False
        lost = seen.probe_start and probe_lost(self.cfg, s.committed, s.judged_s, t_ar)
        self.state, floor = commit_step(self.cfg, self.state, s.committed, s.judged_s, t_ar)
        return lost or floor

    def reset(self) -> None:
        self.state = CommitState()


# name -> the gate's settings, read from Settings; ADASPEC_GATE lists names from here
REGISTRY: dict[str, Callable[[settings_mod.Settings], GateConfig]] = {}


def register_gate(name: str, config: Callable[[settings_mod.Settings], GateConfig]) -> None:
    """Make `name` a gate ADASPEC_GATE (and `from_env(gate=...)`) may list: `config(settings)`
    returns its settings, whose `make()` builds the gate. Register before the settings that
    name it are read."""
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", name) or name in ("off", "both"):
        raise SettingsError(
            f"gate name {name!r} is invalid; accepted: lower-case letters, digits, '-' and '_', "
            "starting with a letter, other than off and both"
        )
    REGISTRY[name] = config
    settings_mod.GATE_NAMES[name] = None


def configs(s: settings_mod.Settings) -> tuple[GateConfig, ...]:
    """The settings of the gates `s.gate` lists, in its order."""
    return tuple(REGISTRY[name](s) for name in s.gate_names)


register_gate(
    "commit",
    lambda s: CommitConfig(
        s.gate_margin,
        s.gate_commit_sustain,
        s.gate_warmup,
        s.gate_commit_ema_weight,
        s.gate_min_t_ar_ms / 1000,
    ),
)
register_gate(
    "entropy",
    lambda s: EntropyConfig(s.gate_ar_p1, s.gate_tie_p1, s.gate_entropy_sustain, s.gate_ema_weight),
)
