"""How many draft tokens each of several sequences sharing one verify forward may feed: the
batch's expected tokens per second, sum of (1 + accepted) over the forward's cost at its
total rows, decides (a draft that pays alone may not pay beside seven others)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .draft_length import measured_cost


def split(gains: Sequence[Sequence[float]], cost: Sequence[float], max_rows: int) -> list[int]:
    """Draft lengths k[i] <= len(gains[i]) for sequences that each feed one row (their newest
    token) plus k[i] draft tokens. gains[i][j]: the expected tokens request i's draft token j
    adds (P(tokens 0..j accepted), non-increasing in j). cost[m]: seconds of a forward of m
    rows (index 0 unused). Tokens are added best gain first; of those prefixes, the one with
    the most expected tokens per second, within max_rows rows, is kept."""
    n = len(gains)
    if n == 0:
        return []
    order = sorted(
        ((g, i, j) for i, gs in enumerate(gains) for j, g in enumerate(gs)),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    rows = min(max_rows, len(cost) - 1)
    best, best_rate, tokens = 0, n / cost[n], float(n)
    for m, (g, _, _) in enumerate(order[: max(rows - n, 0)], start=1):
        tokens += g
        rate = tokens / cost[n + m]
        if rate > best_rate:
            best, best_rate = m, rate
    k = [0] * n
    for _, i, _ in order[:best]:
        k[i] += 1
    return k


@dataclass
class RowCost:
    """Seconds of a forward by its number of token rows: an EMA per row count measured, the
    rest from the nearest measured counts (measured_cost), `prior_slope` per row beyond."""

    max_rows: int
    prior_slope: float = 0.06  # a forward of 4 rows cost ~1.18x one on the routed kernel
    weight: float = 0.2
    seen: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seen = [math.nan] * (self.max_rows + 1)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seen[rows]
        self.seen[rows] = seconds if math.isnan(old) else old + self.weight * (seconds - old)

    def curve(self) -> list[float]:
        """cost[m] for m in 0..max_rows (cost[0] unused); 1 + slope * m before any measurement."""
        seen = tuple(self.seen)
        out = [1.0]
        for m in range(1, self.max_rows + 1):
            c = measured_cost(seen, m, self.prior_slope)
            out.append(1.0 + self.prior_slope * m if c is None else c)
        return out
