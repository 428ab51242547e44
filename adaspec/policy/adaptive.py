"""The adaptive policy: which arm drafts next and how long, from each arm's measured acceptance
and cost; entropy and commit-EMA gates with an AR floor and growing-backoff re-probes; and the
plain-step time (t_ar) the commit gate is calibrated against."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from ..settings import Settings
from . import draft_length, gates, tree_size
from .plan import UNLIMITED, Plan
from .stats import StepStats


@dataclass(frozen=True)
class PolicyConfig:
    entropy: gates.EntropyConfig | None = field(default_factory=gates.EntropyConfig)
    commit: gates.CommitConfig | None = field(default_factory=gates.CommitConfig)
    probe: gates.ProbeConfig = field(default_factory=gates.ProbeConfig)
    t_ar_refresh: float = 1.0
    t_ar_refresh_min: int = 512  # ... and by at least this many tokens
    # None: no length cap from the policy (the drafter proposes what it likes)
    length: draft_length.LengthConfig | None = field(default_factory=draft_length.LengthConfig)
    lift: bool = True  # a strong candidate may end a floor early
    # a draft whose measured cost per token is at most this fraction of a plain step is free:
    # it is peeked at while floored (a strong one lifts the floor) and never held back
    free_cost: float = 0.01
    tree: tree_size.TreeSizeConfig = field(default_factory=tree_size.TreeSizeConfig)

    @classmethod
    def from_settings(cls, s: Settings) -> PolicyConfig:
        entropy = gates.EntropyConfig(
            s.gate_ar_p1, s.gate_tie_p1, s.gate_entropy_sustain, s.gate_ema_weight
        )
        commit = gates.CommitConfig(
            s.gate_margin,
            s.gate_commit_sustain,
            s.gate_warmup,
            s.gate_commit_ema_weight,
            s.gate_min_t_ar_ms / 1000,
        )
        probe = gates.ProbeConfig(s.probe_backoff, s.probe_growth, s.probe_max_backoff, s.probe_len)
        w = dict(weight=s.draft_ema_weight, slow_weight=s.arm_hold_ema_weight)
        length = draft_length.LengthConfig(s.draft_min, s.draft_max, **w)
        if not s.draft_adaptive:
            length = draft_length.LengthConfig(s.draft_max, s.draft_max, **w)
        return cls(
            entropy if s.gate in ("both", "entropy") else None,
            commit if s.gate in ("both", "commit") else None,
            probe,
            s.gate_t_ar_refresh,
            s.gate_t_ar_refresh_min,
            length,
            s.probe_lift,
            tree=tree_size.TreeSizeConfig(s.tree_cap, auto=s.tree_nodes == "auto"),
        )


@dataclass
class ArClock:
    """The plain-step time and the context length it was measured at. t_ar is the median of
    the latest three plain steps; once a step inside a pipelined burst was seen (greedy
    decoding), of those only: a floor decodes in such bursts, where a step's graph is built
    while the one before computes, so a lone plain step reads ~25% slower than a floor runs."""

    t_ar: float = math.nan
    context: int = 0
    plain_seen: int = 0
    recent: tuple[float, ...] = ()
    overlapped: bool = False  # t_ar comes from steps inside pipelined bursts

    def observe(self, step: StepStats) -> None:
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

    def stale(self, context: int, refresh: float, at_least: int) -> bool:
        """No t_ar yet, or the context grew by more than `refresh` of the one t_ar was measured
        at and by more than `at_least` tokens."""
        if math.isnan(self.t_ar):
            return True
        return context > max(self.context * (1 + refresh), self.context + at_least)


class GatedPolicy:
    """SpecPolicy over any number of arms. Each step: speculate unless a gate floored us (then
    decode plainly and re-probe after a growing backoff); ask the arms in the user's order,
    skipping an arm a later one is expected to beat and a costly arm plain steps are expected
    to beat (held back on the floor's backoff-and-probe schedule);
    each arm drafts the length with the most expected tokens per second.
    A gate only decides whether to draft; it never changes which token is emitted."""

    MEASURE_BURST = 4  # plain steps that (re)measure t_ar: the middle two are pipelined

    def __init__(self, cfg: PolicyConfig | None = None):
        self.cfg = cfg or PolicyConfig()
        self.needs_p1 = self.cfg.entropy is not None
        self.floor = gates.FloorState()
        self.clock = ArClock()
        self.context = 0
        self.measure_steps = self.measure_left = 0
        self.lifts = 0
        self.names: list[str] = []
        # per arm: acceptance by position and costs (plain steps teach every arm the verify
        # cost of drafting nothing), and the floor that holds a losing arm back
        self.length: list[draft_length.LengthState] = []
        self.held: list[gates.FloorState] = []
        # per arm: tokens per second by tree node budget; the budget planned for the step
        self.trees: list[tree_size.TreeSizeState] = []
        self.tree_planned, self.tree_arm = 0, -1
        self._reset_gates()

    def start(self, arms: Sequence[str]) -> None:
        """A generation begins. Gates, floors and counters start afresh; what was measured of
        the arms (acceptance by position, draft and verify costs, tree rates) and the plain-step
        time are kept when the arms are the same, so a policy reused for the next turn of a
        conversation (a PromptCache keeps its policy) starts from them instead of from priors."""
        if list(arms) != self.names:
            self.names = list(arms)
            self.length = [draft_length.LengthState() for _ in arms]
            self.trees = [tree_size.TreeSizeState() for _ in arms]
        self.held = [gates.FloorState() for _ in arms]
        self.floor = gates.FloorState()
        # the first plain step runs cold; this generation may not pipeline (sampling)
        self.clock = replace(self.clock, plain_seen=0, overlapped=False)
        self.measure_steps = self.lifts = self.measure_left = 0
        self._reset_gates()

    def _reset_gates(self) -> None:
        self.entropy = gates.EntropyState()
        self.commit = gates.CommitState()

    def _measuring(self) -> bool:
        """The next step must be plain, to (re)measure t_ar at this context."""
        cfg = self.cfg
        return cfg.commit is not None and self.clock.stale(
            self.context, cfg.t_ar_refresh, cfg.t_ar_refresh_min
        )

    def plan(self) -> Plan:
        n = len(self.names)
        if n == 0:
            return Plan((), UNLIMITED)
        if self.floor.floored:
            peek = self._free_arms() if self.cfg.lift and gates.can_lift(self.floor) else ()
            return Plan((), self.floor.ar_left - 1, peek)
        if self.measure_left > 0 or self._measuring():
            # a pipelined burst: its inner steps time plain decoding as a floor runs it
            self.measure_left = (self.measure_left or self.MEASURE_BURST) - 1
            self.measure_steps += 1
            return Plan((), self.measure_left)
        if self.cfg.length is None:
            return Plan(tuple((a, UNLIMITED) for a in range(n)), tree_nodes=self._tree_nodes(0))
        order = [a for a in range(n) if not self.held[a].floored]
        if not order:  # every arm held back: plain until the first one's probe, pipelined
            return Plan((), min(h.ar_left for h in self.held) - 1)
        order = [a for i, a in enumerate(order) if not self._outranked(a, order[i + 1 :])]
        return Plan(
            tuple((a, draft_length.choose_k(self.cfg.length, self.length[a])) for a in order),
            tree_nodes=self._tree_nodes(order[0] if order else None),
        )

    def gains(self, arm: int, k: int) -> tuple[float, ...]:
        """gains[j]: P(draft tokens 0..j of `arm` are all accepted), the expected tokens the
        (j+1)-th drafted token adds (draft_length.expected_tokens term by term)."""
        cfg = self.cfg.length or draft_length.LengthConfig()
        accept = self.length[arm].accept if arm < len(self.length) else ()
        out, run = [], 1.0
        for j in range(k):
            run *= accept[j] if j < len(accept) else accept[-1] if accept else cfg.prior_accept
            out.append(run)
        return tuple(out)

    def _tree_nodes(self, arm: int | None) -> int:
        """The node budget for a tree drafted by `arm` (the plan's first)."""
        self.tree_planned = 0 if arm is None else tree_size.choose(self.cfg.tree, self.trees[arm])
        self.tree_arm = -1 if arm is None else arm
        return self.tree_planned

    def _free(self, a: int) -> bool:
        """Arm a's drafts cost next to nothing (unmeasured counts as free: a peek measures it)."""
        cost, t_ar = self.length[a].draft_cost, self.clock.t_ar
        if math.isnan(cost):
            return True
        return not math.isnan(t_ar) and cost <= self.cfg.free_cost * t_ar

    def _free_arms(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.names)) if self._free(a))

    def _outranked(self, a: int, later: list[int]) -> bool:
        """A later arm, judged like a, is expected to commit more tokens per second (e.g. PLD's
        short matches in new text, before a model drafter). Every explore_every-th step of
        that arm a is asked anyway, so the comparison stays fresh."""
        cfg, mine = self.cfg.length, self.length[a]
        if cfg is None or not mine.accept:
            return False
        rate = draft_length.best_rate(cfg, mine)
        for b in later:
            other = self.length[b]
            if math.isnan(other.draft_cost) or not other.accept:
                continue
            if cfg.explore_every and other.steps % cfg.explore_every == 0:
                continue
            theirs = draft_length.best_rate(cfg, other)
            if rate is not None and theirs is not None and rate < theirs:
                return True
        return False

    def _loses_to_plain(self, a: int) -> bool:
        """Costly arm a, judged, is expected to commit fewer tokens per second than a plain
        step (times the commit margin). Its estimate (acceptance by position, measured costs)
        sees a mix of rare wins and steady losses that the commit gate's streak misses."""
        cfg, commit = self.cfg.length, self.cfg.commit
        if cfg is None or commit is None or math.isnan(self.clock.t_ar):
            return False
        if not self.length[a].accept or self._free(a):
            return False
        rate = draft_length.best_rate(cfg, self.length[a], slow=True)
        return rate is not None and rate * self.clock.t_ar < commit.margin

    def lift(self) -> bool:
        if not (self.cfg.lift and gates.can_lift(self.floor)):
            return False
        self.floor = gates.on_lift(self.floor)
        self.lifts += 1
        return True

    def observe_peek(self, arm: int, drafted: int, seconds: float) -> None:
        if self.cfg.length is not None:
            self.length[arm] = draft_length.observe_draft_cost(
                self.cfg.length, self.length[arm], drafted, seconds
            )

    def observe(self, step: StepStats) -> None:
        self.context = step.context
        self.clock.observe(step)
        arm = step.arm if step.speculative else None
        if self.cfg.length is not None and step.nodes == 0:  # a tree's cost is not a chain's
            for a in range(len(self.names)):
                if arm is None or arm == a:
                    self.length[a] = self._learn(self.cfg.length, self.length[a], step)
        if arm is not None and arm == self.tree_arm:
            self.trees[arm] = tree_size.observe(
                self.cfg.tree, self.trees[arm], self.tree_planned, step.committed, step.judged_s
            )
        # a draft made as a held arm's probe is judged by that arm's floor alone: a losing
        # probe must not floor the other arms with it
        held_probe = arm is not None and self.held[arm].probing
        ratio = self._ratio(step) if arm is not None else None
        for a in range(len(self.names)):
            if a != arm:
                self.held[a] = gates.on_plain_step(self.held[a])
            elif self._held_lost(a, ratio):
                self.held[a] = gates.on_floor(self.cfg.probe, self.held[a])
            else:
                self._held_step(a, ratio)
        if not step.speculative:
            self.floor = gates.on_plain_step(self.floor)
        elif not held_probe:
            self._gate(step)

    def _ratio(self, step: StepStats) -> float | None:
        """The step's commit ratio (None without a commit gate or a plain-step time)."""
        commit, t_ar = self.cfg.commit, self.clock.t_ar
        if commit is None or math.isnan(t_ar):
            return None
        return gates.commit_ratio(step.committed, step.judged_s, t_ar, commit.min_t_ar)

    def _held_lost(self, a: int, ratio: float | None) -> bool:
        """Arm a drafted this step (commit ratio `ratio`): whether it is held back (again). On
        probe, by the probe's own steps; else by its estimate (`_loses_to_plain`)."""
        commit, held = self.cfg.commit, self.held[a]
        if not held.probing or commit is None or ratio is None:
            return self._loses_to_plain(a)
        return gates.held_probe_lost(commit, self.cfg.probe, held, ratio)

    def _held_step(self, a: int, ratio: float | None) -> None:
        """Arm a's step passed; a won probe replaces the arm's slow acceptance estimate, which
        the plain steps before it left stale, by the fast one the probe's steps taught."""
        held = self.held[a]
        self.held[a] = gates.on_spec_step(self.cfg.probe, held, ratio or 0.0)
        if held.probing and not self.held[a].probing:
            self.length[a] = replace(self.length[a], slow=self.length[a].accept)

    def _probe_lost(self, floor: gates.FloorState, step: StepStats) -> bool:
        """Step is the first of a probe (of the shared floor or of one held arm's) and does not
        break even: the probe is lost at once, whatever the longer estimates say."""
        commit, t_ar = self.cfg.commit, self.clock.t_ar
        if commit is None or math.isnan(t_ar) or not floor.probing or floor.probe_steps > 0:
            return False
        return gates.probe_lost(commit, step.committed, step.judged_s, t_ar)

    def _gate(self, step: StepStats) -> None:
        """Feed a speculative step to the gates; floor if one fires."""
        fire = False
        if self.cfg.entropy is not None and step.p1 is not None:
            self.entropy, f = gates.entropy_step(self.cfg.entropy, self.entropy, step.p1)
            fire |= f
        if self.cfg.commit is not None and not math.isnan(self.clock.t_ar):
            fire |= self._probe_lost(self.floor, step)
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
            "arm_floors": {n: h.floors for n, h in zip(self.names, self.held)},
            "tree_nodes": {
                n: tree_size.choose(self.cfg.tree, t) for n, t in zip(self.names, self.trees)
            },
            "t_ar_ms": round(self.clock.t_ar * 1e3, 3),
            "config": asdict(self.cfg),
        }
