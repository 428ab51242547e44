"""Accounting: what each step did and what the whole generation did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# an arm that drafted in at least this many steps of a generation, none accepted, is reported
NEVER_ACCEPTED_STEPS = 16


def arm_labels(names: Sequence[str]) -> list[str]:
    """The arms' names as stats key them: a name given twice gets its index (`pld#2`)."""
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One controller step, built by keyword. drafted = k proposed by `arm` (None: a plain
    step), accepted <= k, committed = tokens it emitted (accepted + 1, fewer if EOS or
    max_tokens cut it); times in seconds."""

    committed: int
    verify_s: float
    drafted: int = 0
    accepted: int = 0
    arm: int | None = None  # index of the arm whose draft was verified
    draft_s: float = 0.0
    rollback_s: float = 0.0
    context: int = 0  # committed sequence length after the step
    p1: float | None = None  # target's top-1 probability at the newest position, if computed
    floored: bool = False  # the policy floored: a gate fired, or every arm is held back
    measuring: bool = False  # a plain step the policy took to time plain decoding
    setup_s: float = 0.0  # one-time drafter work inside draft_s (Draft.setup_s)
    nodes: int = 0  # nodes of a verified draft tree (drafted = its depth); 0 for a chain
    # a plain step whose forward the step before queued (pipelined, as mlx-lm decodes): a run
    # of them times plain decoding as a floor runs it
    queued: bool = False

    @property
    def speculative(self) -> bool:
        return self.drafted > 0

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.rollback_s

    @property
    def judged_s(self) -> float:
        """The step's time as a cost of speculating: without one-time drafter work."""
        return self.total_s - self.setup_s


@dataclass
class GenerationStats:
    """Cumulative over a generation; tau counts the bonus token, over speculative steps only."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt positions a reused prompt cache already held
    prefill_s: float = 0.0
    steps: int = 0
    spec_steps: int = 0
    floored_steps: int = 0  # plain steps because the policy floored
    measure_steps: int = 0  # plain steps that timed plain decoding (the commit gate's yardstick)
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    spec_committed: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    setup_s: float = 0.0  # part of draft_s: one-time drafter work (e.g. catch-up after floors)
    # accepted_at[i]: speculative steps whose draft position i was accepted
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    policy: dict = field(default_factory=dict)  # the policy's own counters (floors, probes)
    arm_names: list[str] = field(default_factory=list)
    # by_arm[name]: speculative steps, drafted, accepted and committed tokens of that arm
    by_arm: dict[str, dict[str, int]] = field(default_factory=dict)

    # trees: steps that verified one and their nodes; why drafts are chains ("" = trees on);
    # tree drafts turned into their best chain, by reason
    tree_steps: int = 0
    tree_nodes: int = 0
    chains_only: str = ""
    chained: dict[str, int] = field(default_factory=dict)

    def count_chained(self, reason: str) -> None:
        self.chained[reason] = self.chained.get(reason, 0) + 1

    def record(self, s: StepStats) -> None:
        self.steps += 1
        self.committed += s.committed
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.rollback_s += s.rollback_s
        self.setup_s += s.setup_s
        self.floored_steps += s.floored
        self.measure_steps += s.measuring
        if not s.speculative:
            return
        self.spec_steps += 1
        self.spec_committed += s.committed
        self.tree_steps += s.nodes > 0
        self.tree_nodes += s.nodes
        if s.arm is not None and s.arm < len(self.arm_names):
            row = self.by_arm.setdefault(
                self.arm_names[s.arm], {"steps": 0, "drafted": 0, "accepted": 0, "committed": 0}
            )
            row["steps"] += 1
            row["drafted"] += s.drafted
            row["accepted"] += s.accepted
            row["committed"] += s.committed
        self.drafted += s.drafted
        self.accepted += s.accepted
        grow = max(s.drafted - len(self.drafted_at), 0)
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for i in range(s.drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < s.accepted

    @property
    def tau(self) -> float:
        """Mean tokens committed per speculative verify step (bonus included); 0 if none."""
        return self.spec_committed / self.spec_steps if self.spec_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def floored_fraction(self) -> float:
        """Share of steps the policy decoded plainly because it floored (a gate fired, or every
        arm was held back); plain steps that timed plain decoding are `measure_steps`."""
        return self.floored_steps / self.steps if self.steps else 0.0

    @property
    def plain_fraction(self) -> float:
        """Share of steps with no draft: floored, or the drafter had nothing to propose."""
        return 1.0 - self.spec_steps / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def warnings(self) -> list[str]:
        """What the user should know: arms that kept drafting and were never accepted."""
        return [
            f"arm {name!r} drafted {r['drafted']} tokens in {r['steps']} steps and none was "
            "accepted (a drafter for another tokenizer or model looks like this)"
            for name, r in self.by_arm.items()
            if r["steps"] >= NEVER_ACCEPTED_STEPS and r["accepted"] == 0
        ]

    def arm_rows(self) -> dict[str, dict[str, int]]:
        """Every arm's speculative steps, drafted, accepted and committed tokens, and (from the
        policy) how often it was held back and how many steps it sat out held."""
        holds = self.policy.get("arm_floors", {})
        held_steps = self.policy.get("arm_held_steps", {})
        rows = {}
        for name in self.arm_names or list(self.by_arm):
            row = dict(self.by_arm.get(name, {"steps": 0, "drafted": 0, "accepted": 0}))
            row.setdefault("committed", 0)
            row["held"], row["held_steps"] = holds.get(name, 0), held_steps.get(name, 0)
            rows[name] = row
        return rows

    def summary(self) -> dict:
        """Counts and times of this generation as a flat dict (`describe` renders it)."""
        return {
            "steps": self.steps,
            "spec_steps": self.spec_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "floored_fraction": round(self.floored_fraction, 4),
            "floored_steps": self.floored_steps,
            "measure_steps": self.measure_steps,
            "plain_fraction": round(self.plain_fraction, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "rollback_s": round(self.rollback_s, 6),
            "setup_s": round(self.setup_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "cached_tokens": self.cached_tokens,
            "by_arm": self.arm_rows(),
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "chains_only": self.chains_only,
            "chained": dict(self.chained),
            "warnings": self.warnings,
            **{k: v for k, v in self.policy.items() if k != "config"},
        }

    def describe(self) -> str:
        return describe(self.summary())

    __str__ = describe  # print(stats): the lines a person reads


def arm_lines(summary: dict) -> list[str]:
    """One line per arm of a `summary()`: drafted, accepted, tau, share of steps, held back."""
    steps = max(summary.get("steps", 0), 1)
    lines = []
    for name, r in summary.get("by_arm", {}).items():
        n, d, a = r["steps"], r["drafted"], r["accepted"]
        tau = r.get("committed", 0) / n if n else 0.0
        lines.append(
            f"arm {name}: drafted {d} tokens in {n} steps ({n / steps:.0%} of steps), accepted "
            f"{a} ({a / d if d else 0:.0%}), tau {tau:.2f}, held back {r.get('held', 0)} times "
            f"({r.get('held_steps', 0)} steps)"
        )
    return lines


def describe(summary: dict) -> str:
    """A `summary()` as lines a person reads: steps and why the plain ones were plain, tokens
    and acceptance, the policy's decisions, each arm, times, warnings."""
    g = summary.get
    steps, spec = g("steps", 0), g("spec_steps", 0)
    floored, measure = g("floored_steps", 0), g("measure_steps", 0)
    by_pos = " ".join(f"{a:.2f}" for a in g("acceptance_by_position", []))
    lines = [
        f"steps {steps}: {spec} drafted, {steps - spec} plain (floored {floored}, timing plain "
        f"steps {measure}, no draft {steps - spec - floored - measure})",
        f"tokens {g('committed', 0)}: tau {g('tau', 0):.2f} per drafted step; accepted "
        f"{g('accepted', 0)} of {g('drafted', 0)} drafted ({g('acceptance_rate', 0):.0%}); by "
        f"position {by_pos or '-'}",
    ]
    if "floors" in summary:
        lines.append(
            f"policy: floors {g('floors')} (probes won {g('probes_won')}, lost "
            f"{g('probes_lost')}), lifts {g('lifts')}, plain step {g('t_ar_ms')} ms"
        )
    lines += arm_lines(summary)
    cached = f" ({g('cached_tokens')} prompt tokens cached)" if g("cached_tokens") else ""
    lines.append(
        f"seconds: prefill {g('prefill_s', 0):.3f}{cached}, draft {g('draft_s', 0):.3f}, "
        f"verify {g('verify_s', 0):.3f}, rollback {g('rollback_s', 0):.3f}"
    )
    return "\n".join(lines + [f"warning: {w}" for w in g("warnings", [])])
