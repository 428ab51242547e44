"""Accounting: what each step did and what the whole generation did."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # a plain step inside a pipelined burst (its forward queued by the step before, and it
    # queued the next one's): its time is the per-token rate of plain decoding
    overlapped: bool = False

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

    def summary(self) -> dict:
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
            "by_arm": {k: dict(v) for k, v in self.by_arm.items()},
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "chains_only": self.chains_only,
            "chained": dict(self.chained),
            **{k: v for k, v in self.policy.items() if k != "config"},
        }
