"""The adaptive policy, composed of parts: gates that floor when speculating stops paying (an AR
floor with growing-backoff re-probes), the plain-step clock they and the arm holds are judged
against, the arm scheduler (ranking, holds) and the arms' estimates (draft length, tree size)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..loop.plan import MEASURE, NO_ARMS, UNLIMITED, Plan
from ..loop.stats import StepStats, arm_labels
from ..settings import Settings
from . import draft_length, gates, tree_size
from . import floor as fl
from .arm_choice import ArmScheduler, HoldConfig
from .clock import ArClock, ClockConfig
from .estimates import ArmEstimates


@dataclass(frozen=True)
class PolicyConfig:
    """gates: the active gates' settings (each `make()`s its gate); clock: measurement bursts
    of the plain-step time (None: t_ar only from plain steps that happen anyway); holds: arm
    holds (None: no arm is held back); length: the draft-length rule (None: no length cap)."""

    gates: tuple[gates.GateConfig, ...] = (gates.CommitConfig(),)
    probe: fl.ProbeConfig = field(default_factory=fl.ProbeConfig)
    clock: ClockConfig | None = field(default_factory=ClockConfig)
    holds: HoldConfig | None = field(default_factory=HoldConfig)
    length: draft_length.LengthConfig | None = field(default_factory=draft_length.LengthConfig)
    lift: bool = True  # a strong candidate may end a floor early
    # a draft whose measured cost per token is at most this fraction of a plain step is free:
    # it is peeked at while floored (a strong one lifts the floor) and never held back
    free_cost: float = 0.01
    tree: tree_size.TreeSizeConfig = field(default_factory=tree_size.TreeSizeConfig)

    @classmethod
    def from_settings(cls, s: Settings) -> PolicyConfig:
        """ADASPEC_GATE lists the gates; `off` also turns off what only serves them (the arm
        holds and the clock's measurement bursts): every step then asks the arms."""
        length = draft_length.LengthConfig(
            s.draft_min if s.draft_adaptive else s.draft_max,
            s.draft_max,
            weight=s.draft_ema_weight,
            slow_weight=s.arm_hold_ema_weight,
        )
        off = s.gate == "off"
        return cls(
            gates=gates.configs(s),
            probe=fl.ProbeConfig(s.probe_backoff, s.probe_growth, s.probe_max_backoff, s.probe_len),
            clock=None if off else ClockConfig(s.gate_t_ar_refresh, s.gate_t_ar_refresh_min),
            holds=None if off else HoldConfig(s.gate_margin, s.gate_min_t_ar_ms / 1000),
            length=length,
            lift=s.probe_lift,
            tree=tree_size.TreeSizeConfig(s.tree_cap, auto=s.tree_nodes == "auto"),
        )


class GatedPolicy:
    """SpecPolicy over any number of arms. Each step: speculate unless a gate floored us (then
    decode plainly and re-probe after a growing backoff) or the clock must time plain steps;
    ask the arms the scheduler picks, in the user's order, each for the length its estimates
    chooses. A gate only decides whether to draft; it never changes which token is emitted."""

    def __init__(self, cfg: PolicyConfig | None = None):
        self.cfg = cfg or PolicyConfig()
        self.gates: list[gates.Gate] = [g.make() for g in self.cfg.gates]
        self.needs_p1 = any(g.needs_p1 for g in self.gates)
        self.floor = fl.FloorState()
        self.clock = ArClock(self.cfg.clock)
        self.estimates = ArmEstimates(self.cfg.length, self.cfg.tree)
        self.arms = ArmScheduler(self.estimates, self.cfg.holds, self.cfg.probe, self.cfg.free_cost)
        self.lifts = 0
        self.names: list[str] = []
        self._config = asdict(self.cfg)  # the config is frozen: summary() reports it per step

    def adopt(self, other: GatedPolicy) -> None:
        """Start from what `other` measured (the plain-step time, the arms' estimates and their
        names), copied: a policy for the next independent generation on the same target and
        drafter, as a reused policy would (`start` keeps them when the arms are the same)."""
        self.clock = copy.deepcopy(other.clock)
        self.estimates = copy.deepcopy(other.estimates)
        self.arms = ArmScheduler(self.estimates, self.cfg.holds, self.cfg.probe, self.cfg.free_cost)
        self.names = list(other.names)

    def start(self, arms: Sequence[str]) -> None:
        """A generation begins. Gates, floors and counters start afresh; what was measured of
        the arms (acceptance by position, draft and verify costs, tree rates) and the plain-step
        time are kept when the arms are the same, so a policy reused for the next turn of a
        conversation (a PromptCache keeps its policy) starts from them instead of from priors."""
        self.estimates.start(len(arms), list(arms) == self.names)
        self.names = list(arms)
        self.arms.start(len(arms))
        self.floor = fl.FloorState()
        self.clock.start()
        self.lifts = 0
        self._reset_gates()

    def _reset_gates(self) -> None:
        for g in self.gates:
            g.reset()

    def plan(self) -> Plan:
        n = len(self.names)
        if n == 0:
            return Plan((), UNLIMITED, plain_reason=NO_ARMS)
        if self.floor.floored:
            lift = self.cfg.lift and fl.can_lift(self.floor)
            peek = self.arms.free_arms(self.clock.t_ar) if lift else ()
            return Plan((), self.floor.ar_left - 1, peek)
        ahead = self.clock.measure()
        if ahead is not None:  # a pipelined burst: its inner steps time plain decoding
            return Plan((), ahead, plain_reason=MEASURE)
        if self.cfg.length is None:
            return Plan(
                tuple((a, UNLIMITED) for a in range(n)), tree_nodes=self.estimates.tree_nodes(0)
            )
        order = self.arms.order()
        if not order:  # every arm held back: plain until the first one's probe, pipelined
            return Plan((), self.arms.plain_ahead())
        return Plan(
            tuple((a, self.estimates.choose_k(a)) for a in order),
            tree_nodes=self.estimates.tree_nodes(order[0]),
        )

    def gains(self, arm: int, k: int) -> tuple[float, ...]:
        """gains[j]: P(draft tokens 0..j of `arm` are all accepted), the expected tokens its
        (j+1)-th drafted token adds (for a batch's budget, serve/batch.py)."""
        return self.estimates.gains(arm, k)

    def lift(self) -> bool:
        if not (self.cfg.lift and fl.can_lift(self.floor)):
            return False
        self.floor = fl.on_lift(self.floor)
        self.lifts += 1
        return True

    def observe_peek(self, arm: int, drafted: int, seconds: float) -> None:
        self.estimates.observe_peek(arm, drafted, seconds)

    def observe(self, step: StepStats) -> None:
        self.clock.observe(step)
        self.estimates.observe(step)
        # a draft made as a held arm's probe is judged by that arm's hold alone
        held_probe = self.arms.is_probing(step.arm if step.speculative else None)
        self.arms.observe(step, self.clock.t_ar)
        if not step.speculative:
            self.floor = fl.on_plain_step(self.floor)
        elif not held_probe:
            self._gate(step)

    def _gate(self, step: StepStats) -> None:
        """Feed a speculative step to every gate; floor if one fires."""
        probe_start = self.floor.probing and self.floor.probe_steps == 0
        seen = gates.GateInput(step, self.clock.t_ar, probe_start)
        fire = False
        for g in self.gates:
            fire |= g.observe(seen)
        if fire:
            self.floor = fl.on_floor(self.cfg.probe, self.floor)
            self._reset_gates()
        else:
            self.floor = fl.on_spec_step(self.cfg.probe, self.floor)

    def summary(self) -> dict:
        f, names = self.floor, arm_labels(self.names)
        return {
            "floors": f.floors,
            "probes_won": f.probes_won,
            "probes_lost": f.probes_lost,
            "lifts": self.lifts,
            "arm_floors": {n: h.floors for n, h in zip(names, self.arms.held)},
            "arm_held_steps": dict(zip(names, self.arms.held_steps)),
            "tree_budgets": dict(zip(names, self.estimates.budgets())),
            "t_ar_ms": round(self.clock.t_ar * 1e3, 3),
            "config": self._config,
        }
