"""How many draft tokens each of several sequences sharing one verify forward may feed: the
batch's expected tokens per second, sum of (1 + accepted) over the forward's cost at its
total rows, decides (a draft that pays alone may not pay beside seven others)."""

from __future__ import annotations

from collections.abc import Sequence

from .draft_length import measured_cost, observe_cost


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


# a batched forward's cost by its rows before it is measured: 1 + ROW_SLOPE per row (a forward
# of 4 rows cost ~1.18x one on the routed kernel); ROW_WEIGHT: the EMA weight of a measurement
ROW_SLOPE, ROW_WEIGHT = 0.06, 0.2


def observe_rows(cost: tuple[float, ...], rows: int, seconds: float) -> tuple[float, ...]:
    """`cost` (seconds of a forward by its rows: draft_length.observe_cost's estimate) after a
    forward of `rows` rows took `seconds`."""
    return observe_cost(cost, rows, seconds, ROW_WEIGHT)


def row_curve(cost: tuple[float, ...], max_rows: int) -> list[float]:
    """cost[m] for m in 0..max_rows (cost[0] unused): measured counts as measured, the rest from
    the nearest ones (measured_cost), ROW_SLOPE per row beyond; 1 + ROW_SLOPE * m before any
    measurement."""
    out = [1.0]
    for m in range(1, max_rows + 1):
        c = measured_cost(cost, m, ROW_SLOPE)
        out.append(1.0 + ROW_SLOPE * m if c is None else c)
    return out
