"""How many nodes a draft tree may hold: tokens per second measured per node budget (a chain,
budget 0, among them), which folds in both what a tree of that size costs to verify and how
much more of it is accepted; the best budget is used and the others are re-tried now and then."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TreeSizeConfig:
    cap: int = 0  # largest node budget (0: chains only)
    auto: bool = False  # False: every step may use `cap`; True: measure and choose
    tries: int = 4  # speculative steps each budget gets before budgets are compared
    explore: int = 32  # steps on the best budget before the runner-up is tried again
    weight: float = 0.1  # EMA weight of a step's tokens and seconds, once tried

    def budgets(self) -> tuple[int, ...]:
        """What `auto` chooses among: a chain, half the cap, the cap."""
        if self.cap <= 1:
            return (0,)
        return tuple(sorted({0, max(2, self.cap // 2), self.cap}))


@dataclass(frozen=True)
class TreeSizeState:
    tokens: tuple[float, ...] = ()  # per budget: EMA of tokens committed per step
    seconds: tuple[float, ...] = ()  # per budget: EMA of the step's time
    seen: tuple[int, ...] = ()  # per budget: speculative steps observed
    since: int = 0  # steps on the best budget since another one was tried


def _ranked(cfg: TreeSizeConfig, s: TreeSizeState) -> list[int]:
    """Budget indices, best rate first (untried ones count as 0)."""
    rate = [t / x if x > 0 else 0.0 for t, x in zip(s.tokens, s.seconds)]
    return sorted(range(len(rate)), key=lambda i: -rate[i])


def choose(cfg: TreeSizeConfig, s: TreeSizeState) -> int:
    """The node budget of the next speculative step."""
    if not cfg.auto:
        return cfg.cap
    budgets = cfg.budgets()
    if len(budgets) == 1:
        return 0
    seen = s.seen or (0,) * len(budgets)
    for i, n in enumerate(seen):
        if n < cfg.tries:
            return budgets[i]
    ranked = _ranked(cfg, s)
    return budgets[ranked[1] if s.since >= cfg.explore else ranked[0]]


def observe(
    cfg: TreeSizeConfig, s: TreeSizeState, budget: int, committed: int, seconds: float
) -> TreeSizeState:
    """A speculative step planned with `budget` committed `committed` tokens in `seconds`."""
    budgets = cfg.budgets()
    if not cfg.auto or budget not in budgets:
        return s
    n = len(budgets)
    tokens, secs, seen = (
        list(s.tokens or [0.0] * n),
        list(s.seconds or [0.0] * n),
        list(s.seen or [0] * n),
    )
    i = budgets.index(budget)
    seen[i] += 1
    w = max(cfg.weight, 1.0 / seen[i])  # a plain mean over the first steps
    tokens[i] += w * (committed - tokens[i])
    secs[i] += w * (seconds - secs[i])
    best = _ranked(cfg, replace(s, tokens=tuple(tokens), seconds=tuple(secs)))[0]
    since = s.since + 1 if i == best else 0
    return TreeSizeState(tuple(tokens), tuple(secs), tuple(seen), since)
