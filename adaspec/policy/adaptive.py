"""The adaptive policy: entropy and commit-EMA gates, AR floor with growing-backoff re-probes,
and the plain-step time (t_ar) the commit gate is calibrated against."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from ..settings import Settings
from . import draft_length, gates
from .stats import StepStats

UNLIMITED = 1 << 30


@dataclass(frozen=True)
class PolicyConfig:
    entropy: gates.EntropyConfig | None = field(default_factory=gates.EntropyConfig)
    commit: gates.CommitConfig | None = field(default_factory=gates.CommitConfig)
    probe: gates.ProbeConfig = field(default_factory=gates.ProbeConfig)
    t_ar_refresh: float = 0.25
    # None: no length cap from the policy (the drafter proposes what it likes)
    length: draft_length.LengthConfig | None = field(default_factory=draft_length.LengthConfig)
    lift: bool = True  # a strong candidate may end a floor early

    @classmethod
    def from_settings(cls, s: Settings) -> PolicyConfig:
        entropy = gates.EntropyConfig(
            s.gate_ar_p1, s.gate_tie_p1, s.gate_entropy_sustain, s.gate_ema_weight
        )
        commit = gates.CommitConfig(
            s.gate_margin,
            s.gate_commit_sustain,
            s.gate_warmup,
            s.gate_ema_weight,
            s.gate_min_t_ar_ms / 1000,
        )
        probe = gates.ProbeConfig(s.probe_backoff, s.probe_growth, s.probe_max_backoff, s.probe_len)
        length = draft_length.LengthConfig(s.draft_min, s.draft_max)
        if not s.draft_adaptive:
            length = draft_length.LengthConfig(s.draft_max, s.draft_max)
        return cls(
            entropy if s.gate in ("both", "entropy") else None,
            commit if s.gate in ("both", "commit") else None,
            probe,
            s.gate_t_ar_refresh,
            length,
            s.probe_lift,
        )


@dataclass
class ArClock:
    """The warm plain-step time and the context length it was measured at. t_ar is the median
    of the latest three plain steps: pipelined plain steps overlap (mlx runs part of a queued
    forward before returning), so the first and last step of a burst read long and short by
    most of a step."""

    t_ar: float = math.nan
    context: int = 0
    plain_seen: int = 0
    recent: tuple[float, ...] = ()

    def observe(self, step: StepStats) -> None:
        if step.speculative:
            return
        self.plain_seen += 1
        if self.plain_seen > 1:  # the first plain step of a generation runs cold
            self.recent = (*self.recent[-2:], step.total_s)
            self.t_ar, self.context = statistics.median(self.recent), step.context

    def stale(self, context: int, refresh: float) -> bool:
        return math.isnan(self.t_ar) or context > self.context * (1 + refresh) + 16


class GatedPolicy:
    """SpecPolicy: speculate unless a gate floored us; re-probe after a growing backoff.
    A gate only decides whether to draft; it never changes which token is emitted."""

    def __init__(self, cfg: PolicyConfig | None = None):
        self.cfg = cfg or PolicyConfig()
        self.needs_p1 = self.cfg.entropy is not None
        self.floor = gates.FloorState()
        self.clock = ArClock()
        self.context = 0
        self.measure_steps = 0
        self.lifts = 0
        # costly drafts (a model's forwards) and cheap ones (prompt-lookup copies) are priced
        # apart: their acceptance and drafting cost differ by far; plain steps teach both
        self.length = draft_length.LengthState()
        self.cheap_length = draft_length.LengthState()
        # a drafter with both kinds (auto): its costly drafts are held back, on the floor's
        # backoff-and-probe schedule, while plain steps are expected to beat them; cheap drafts
        # go on meanwhile
        self.costly_floor = gates.FloorState()
        self._reset_gates()

    def _reset_gates(self) -> None:
        self.entropy = gates.EntropyState()
        self.commit = gates.CommitState()

    def _measuring(self) -> bool:
        """The next step must be plain, to (re)measure t_ar at this context."""
        return self.cfg.commit is not None and self.clock.stale(self.context, self.cfg.t_ar_refresh)

    def max_draft(self) -> int:
        if self.floor.floored:
            return 0
        if self._measuring():
            self.measure_steps += 1
            return 0
        if self.cfg.length is None:
            return UNLIMITED
        if self.costly_floor.floored:
            return 0
        return draft_length.choose_k(self.cfg.length, self.length)

    def max_cheap_draft(self) -> int:
        if self.floor.floored or self._measuring():
            return 0
        if self.cfg.length is None:
            return UNLIMITED
        if self._cheap_loses(self.cfg.length):
            return 0  # the drafter's costly path is expected to commit more per second
        return draft_length.choose_k(self.cfg.length, self.cheap_length)

    def _costly_loses(self) -> bool:
        """Both kinds of draft were judged and a costly draft is expected to commit fewer
        tokens per second than a plain step (times the commit margin)."""
        cfg, commit = self.cfg.length, self.cfg.commit
        if (
            cfg is None
            or commit is None
            or math.isnan(self.clock.t_ar)
            or not self.cheap_length.accept
        ):
            return False
        rate = draft_length.best_rate(cfg, self.length)
        return rate is not None and rate * self.clock.t_ar < commit.margin

    def _cheap_loses(self, cfg: draft_length.LengthConfig) -> bool:
        """Both kinds of draft were judged and cheap drafts are expected to commit fewer tokens
        per second than costly ones (e.g. PLD's short matches in new text, inside `auto`).
        Every explore_every-th step they are allowed anyway, so the comparison stays fresh."""
        costly, cheap = self.length, self.cheap_length
        if math.isnan(costly.draft_cost) or not cheap.accept:
            return False
        if cfg.explore_every and costly.steps % cfg.explore_every == 0:
            return False
        rc, rk = draft_length.best_rate(cfg, cheap), draft_length.best_rate(cfg, costly)
        return rc is not None and rk is not None and rc < rk

    def plain_ahead(self) -> int:
        return self.floor.ar_left if self.floor.floored else 0

    def lift(self) -> bool:
        if not (self.cfg.lift and gates.can_lift(self.floor)):
            return False
        self.floor = gates.on_lift(self.floor)
        self.lifts += 1
        return True

    def observe(self, step: StepStats) -> None:
        self.context = step.context
        self.clock.observe(step)
        if self.cfg.length is not None:
            if step.drafted == 0 or not step.cheap:
                self.length = self._learn(self.cfg.length, self.length, step)
            if step.drafted == 0 or step.cheap:
                self.cheap_length = self._learn(self.cfg.length, self.cheap_length, step)
        # a costly draft made as the costly floor's probe is judged by that floor alone: a
        # losing probe must not floor the cheap drafts with it
        costly_probe = bool(step.drafted and not step.cheap and self.costly_floor.probing)
        if step.drafted and not step.cheap:
            if self._costly_loses():
                self.costly_floor = gates.on_floor(self.cfg.probe, self.costly_floor)
            else:
                self.costly_floor = gates.on_spec_step(self.cfg.probe, self.costly_floor)
        else:
            self.costly_floor = gates.on_plain_step(self.costly_floor)
        if not step.speculative:
            self.floor = gates.on_plain_step(self.floor)
            return
        if costly_probe:
            return
        fire = False
        if self.cfg.entropy is not None and step.p1 is not None:
            self.entropy, f = gates.entropy_step(self.cfg.entropy, self.entropy, step.p1)
            fire |= f
        if self.cfg.commit is not None and not math.isnan(self.clock.t_ar):
            if self.floor.probing and self.floor.probe_steps == 0:
                fire |= gates.probe_lost(
                    self.cfg.commit, step.committed, step.judged_s, self.clock.t_ar
                )
            self.commit, f = gates.commit_step(
                self.cfg.commit, self.commit, step.committed, step.judged_s, self.clock.t_ar
            )
            fire |= f
        if fire:
            self.floor = gates.on_floor(self.cfg.probe, self.floor)
            self._reset_gates()
        else:
            self.floor = gates.on_spec_step(self.cfg.probe, self.floor)

    @staticmethod
    def _learn(
        cfg: draft_length.LengthConfig, s: draft_length.LengthState, step: StepStats
    ) -> draft_length.LengthState:
        draft_s = step.draft_s - step.setup_s
        return draft_length.observe(cfg, s, step.drafted, step.accepted, step.judged_s, draft_s)

    def summary(self) -> dict:
        f = self.floor
        return {
            "floors": f.floors,
            "probes_won": f.probes_won,
            "probes_lost": f.probes_lost,
            "lifts": self.lifts,
            "measure_steps": self.measure_steps,
            "costly_floors": self.costly_floor.floors,
            "t_ar_ms": round(self.clock.t_ar * 1e3, 3),
            "config": asdict(self.cfg),
        }
