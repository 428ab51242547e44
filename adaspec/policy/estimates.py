"""How much each arm drafts: per arm, the draft-length rule's estimates (acceptance by position,
measured step and draft costs: draft_length.py) and the tree-size rule's tokens per second by
node budget (tree_size.py). The arm scheduler reads the same estimates to rank and hold arms."""

from __future__ import annotations

import math
from dataclasses import replace

from ..loop.plan import UNLIMITED
from ..loop.stats import StepStats
from . import draft_length, tree_size


class ArmEstimates:
    """Each arm's estimates, learnt from every step (plain steps teach every arm the verify
    cost of drafting nothing), and the length and tree budget they choose. length None: no
    length cap (the drafter proposes what it likes) and nothing learnt."""

    def __init__(
        self, length: draft_length.LengthConfig | None, tree: tree_size.TreeSizeConfig
    ) -> None:
        self.cfg, self.tree_cfg = length, tree
        self.length: list[draft_length.LengthState] = []
        self.trees: list[tree_size.TreeSizeState] = []
        self.tree_planned, self.tree_arm = 0, -1

    def start(self, n_arms: int, same_arms: bool) -> None:
        """A generation begins; what was measured is kept when the arms are the same."""
        if not same_arms:
            self.length = [draft_length.LengthState() for _ in range(n_arms)]
            self.trees = [tree_size.TreeSizeState() for _ in range(n_arms)]

    def choose_k(self, a: int) -> int:
        """The most tokens arm `a` may draft this step."""
        if self.cfg is None:
            return UNLIMITED
        return draft_length.choose_k(self.cfg, self.length[a])

    def tree_nodes(self, arm: int | None) -> int:
        """The node budget for a tree drafted by `arm` (the plan's first), remembered so the
        step's outcome is credited to it."""
        self.tree_planned = 0 if arm is None else tree_size.choose(self.tree_cfg, self.trees[arm])
        self.tree_arm = -1 if arm is None else arm
        return self.tree_planned

    def observe(self, step: StepStats) -> None:
        arm = step.arm if step.speculative else None
        if self.cfg is not None and step.nodes == 0:  # a tree's cost is not a chain's
            for a in range(len(self.length)):
                if arm is None or arm == a:
                    self.length[a] = _learn(self.cfg, self.length[a], step)
        if arm is not None and arm == self.tree_arm:
            self.trees[arm] = tree_size.observe(
                self.tree_cfg, self.trees[arm], self.tree_planned, step.committed, step.judged_s
            )

    def observe_peek(self, a: int, drafted: int, seconds: float) -> None:
        """A draft of arm `a` made but not verified: its cost per token."""
        if self.cfg is not None:
            self.length[a] = draft_length.observe_draft_cost(
                self.cfg, self.length[a], drafted, seconds
            )

    def gains(self, a: int, k: int) -> tuple[float, ...]:
        """gains[j]: P(draft tokens 0..j of arm a are all accepted), from its measured
        acceptance by position (the last position's for longer drafts; the prior unmeasured):
        draft_length.expected_tokens term by term."""
        cfg = self.cfg or draft_length.LengthConfig()
        accept = self.length[a].accept if a < len(self.length) else ()
        out, run = [], 1.0
        for j in range(k):
            run *= accept[j] if j < len(accept) else accept[-1] if accept else cfg.prior_accept
            out.append(run)
        return tuple(out)

    def judged(self, a: int) -> bool:
        """Some draft of arm `a` was judged (accepted or rejected at a position)."""
        return bool(self.length[a].accept)

    def timed(self, a: int) -> bool:
        """Arm `a`'s drafting time per token was measured."""
        return not math.isnan(self.length[a].draft_cost)

    def free(self, a: int, t_ar: float, free_cost: float) -> bool:
        """Arm a's drafts cost at most `free_cost` of a plain step per token (unmeasured
        counts as free: a peek measures it)."""
        cost = self.length[a].draft_cost
        if math.isnan(cost):
            return True
        return not math.isnan(t_ar) and cost <= free_cost * t_ar

    def exploring(self, a: int) -> bool:
        """Arm a's next step is an exploration step of the length rule."""
        every = self.cfg.explore_every if self.cfg else 0
        return bool(every) and self.length[a].steps % every == 0

    def rate(self, a: int, slow: bool = False) -> float | None:
        """Arm a's expected committed tokens per second at its best length (None: unknown).
        slow: from the slow acceptance EMAs (whether the arm pays at all)."""
        if self.cfg is None:
            return None
        return draft_length.best_rate(self.cfg, self.length[a], slow=slow)

    def trust_fast(self, a: int) -> None:
        """Replace arm a's slow acceptance estimate by its fast one (a won probe's)."""
        self.length[a] = replace(self.length[a], slow=self.length[a].accept)

    def budgets(self) -> list[int]:
        """Each arm's tree node budget as things stand."""
        return [tree_size.choose(self.tree_cfg, t) for t in self.trees]


def _learn(
    cfg: draft_length.LengthConfig, s: draft_length.LengthState, step: StepStats
) -> draft_length.LengthState:
    draft_s = step.draft_s - step.setup_s
    return draft_length.observe(cfg, s, step.drafted, step.accepted, step.judged_s, draft_s)
