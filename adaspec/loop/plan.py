"""What a policy hands the controller each step, the policy protocol, and two fixed policies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .stats import StepStats

UNLIMITED = 1 << 30
# why a plan is plain (Plan.plain_reason): the policy floored (a gate fired, or every arm is
# held back); it times plain steps (the plain-step clock); there is nothing to draft with
FLOOR, MEASURE, NO_ARMS = "floor", "measure", "no arms"


@dataclass(frozen=True)
class Plan:
    """The next step.

    arms: (arm index, most tokens it may draft) to ask in this order; the first non-empty draft
      is verified, and if every arm returns nothing the step is plain. () = a plain step.
    plain_ahead: how many steps after this one are certainly plain whatever happens (but a lift),
      so the controller may queue their forwards (as mlx-lm pipelines its decoding).
    peek: arms to ask before a plain step for a `strong` draft, which may lift the floor
      (arms whose drafts the policy measured as free; their drafts are otherwise not verified).
    tree_nodes: most nodes a draft tree may hold this step (within DecodeConfig.tree_nodes;
      0: chains only).
    plain_reason: why a plain plan is plain (FLOOR, MEASURE or NO_ARMS), for the stats.
    """

    arms: tuple[tuple[int, int], ...] = ()
    plain_ahead: int = 0
    peek: tuple[int, ...] = ()
    tree_nodes: int = UNLIMITED
    plain_reason: str = FLOOR

    @property
    def plain(self) -> bool:
        return not self.arms


class SpecPolicy(Protocol):
    """Decides, from past steps only, which arm drafts next and how many tokens (or none).
    needs_p1: whether `observe` wants StepStats.p1 (costs one reduction per step)."""

    needs_p1: bool

    def start(self, arms: Sequence[str]) -> None:
        """A generation begins with these arms (drafter names, in the user's order)."""
        ...

    def plan(self) -> Plan: ...

    def observe(self, step: StepStats) -> None: ...

    def observe_peek(self, arm: int, drafted: int, seconds: float) -> None:
        """A peek (Plan.peek) at `arm` proposed `drafted` tokens in `seconds`."""
        ...

    def lift(self) -> bool:
        """A strong candidate was seen while floored: end the floor now if allowed."""
        ...

    def gains(self, arm: int, k: int) -> tuple[float, ...]:
        """gains[j]: P(draft tokens 0..j of `arm` are all accepted), the expected tokens its
        (j+1)-th drafted token adds (a batch cuts drafts by them: policy/batch_budget.py)."""
        ...

    def summary(self) -> dict: ...


class AlwaysSpeculate:
    """Every step asks every arm, in order, for as many tokens as it likes."""

    needs_p1 = False

    def __init__(self) -> None:
        self.n_arms = 0

    def start(self, arms: Sequence[str]) -> None:
        self.n_arms = len(arms)

    def plan(self) -> Plan:
        return Plan(tuple((a, UNLIMITED) for a in range(self.n_arms)))

    def observe(self, step: StepStats) -> None:
        pass

    def observe_peek(self, arm: int, drafted: int, seconds: float) -> None:
        pass

    def lift(self) -> bool:
        return False

    def gains(self, arm: int, k: int) -> tuple[float, ...]:
        return (1.0,) * k  # nothing learnt: every drafted token is expected to count

    def summary(self) -> dict:
        return {}


class NeverSpeculate(AlwaysSpeculate):
    def plan(self) -> Plan:
        return Plan((), UNLIMITED, plain_reason=NO_ARMS)
