"""Adaptive draft length: pick k to maximize expected committed tokens per second, from the
observed acceptance at each draft position, the measured cost of steps that drafted k (drafting
included) and the measured draft cost per token, which prices lengths beyond the measured ones
(docs/gates.md, "Draft length").

Pure: state + observation in, state out; times are passed in by the controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LengthConfig:
    min_k: int = 1
    max_k: int = 16
    weight: float = 0.3  # EMA weight of the newest observation
    # weight of the slow acceptance EMAs behind `best_rate(..., slow=True)`: whether an arm pays
    # at all is judged on ~20 steps, while the length follows the text (a copy starts or ends)
    slow_weight: float = 0.1
    # acceptance assumed before any position was judged, and where the EMAs start: one accepted
    # draft must not read as certainty (it once sent a costly drafter from 3 to 16 tokens)
    prior_accept: float = 0.6
    # growth of the verify cost per token beyond the longest length measured, as a fraction of
    # that length's cost
    prior_slope: float = 0.08
    # every explore_every-th step drafts twice the best length, so a length priced by one bad
    # (cold, or contended) measurement is measured again; 0 = never
    explore_every: int = 8
    # a cost not refreshed for this many steps is replaced by the next measurement, not blended
    stale_after: int = 16


@dataclass(frozen=True)
class LengthState:
    accept: tuple[float, ...] = ()  # accept[i]: P(position i accepted | positions < i were)
    slow: tuple[float, ...] = ()  # the same, EMAs of weight slow_weight
    # cost[k]: EMA seconds of a step that drafted k, its drafting included (nan: unseen); a
    # drafter whose draft costs the same at every length (one DFlash block) is priced right
    cost: tuple[float, ...] = ()
    # EMA seconds of drafting per drafted token (nan: never timed): prices the tokens beyond
    # the longest measured length, and tells a free arm from a costly one
    draft_cost: float = math.nan
    steps: int = 0  # steps observed
    timed_at: tuple[int, ...] = ()  # timed_at[k]: the step cost[k] was last updated at


def expected_tokens(accept: tuple[float, ...], k: int, prior: float) -> float:
    """Tokens a step drafting k commits on average: 1 (bonus) + sum of P(first i accepted).
    Positions never reached yet are assumed to behave like the deepest one seen (or `prior`)."""
    total, run = 1.0, 1.0
    beyond = accept[-1] if accept else prior
    for i in range(k):
        run *= accept[i] if i < len(accept) else beyond
        total += run
    return total


def step_cost(
    cost: tuple[float, ...], k: int, prior_slope: float, draft_cost: float = 0.0
) -> float | None:
    """Seconds of a step drafting k, drafting included: `measured_cost`, with draft_cost
    added for each token beyond the longest measured length and taken off for each token short
    of the shortest one (outside the measured lengths drafting is priced per token)."""
    seen = _seen(cost)
    if not seen:
        return None
    rest = _measured(seen, cost, k, prior_slope)
    if math.isnan(draft_cost):
        return rest
    extra = max(k - seen[-1][0], 0) - max(seen[0][0] - k, 0)
    return max(rest + extra * draft_cost, 1e-9)


def measured_cost(cost: tuple[float, ...], k: int, prior_slope: float) -> float | None:
    """cost[k] if measured; between measured lengths, the straight line joining the nearest
    two; beyond the longest measured length K, cost[K] grown by prior_slope per extra token (the
    verify's growth; step_cost adds the drafting); below the shortest, its cost. None if nothing
    was measured. Optimistic beyond K on purpose: a verify's cost grows much slower than
    linearly on fast BLAS (a step, then flat, on MKL), and a length is measured as soon as it
    is tried."""
    seen = _seen(cost)
    return _measured(seen, cost, k, prior_slope) if seen else None


def observe_cost(
    cost: tuple[float, ...], size: int, seconds: float, weight: float, fresh: bool = False
) -> tuple[float, ...]:
    """A cost by size (cost[k]: EMA seconds of a step or forward of size k; nan: unseen) after
    one of size `size` took `seconds`. fresh: the measurement replaces the size's EMA (a stale
    one) instead of joining it. The one estimate of cost by size: a step's by its draft length
    here, a batched forward's by its rows (batch_budget.py)."""
    grown = cost + (math.nan,) * max(0, size + 1 - len(cost))
    new = _ema(math.nan if fresh else grown[size], seconds, weight)
    return grown[:size] + (new,) + grown[size + 1 :]


def _seen(cost: tuple[float, ...]) -> list[tuple[int, float]]:
    return [(i, c) for i, c in enumerate(cost) if not math.isnan(c)]


def _measured(
    seen: list[tuple[int, float]], cost: tuple[float, ...], k: int, prior_slope: float
) -> float:
    if k < len(cost) and not math.isnan(cost[k]):
        return cost[k]
    lo = max(((i, c) for i, c in seen if i < k), default=None)
    hi = min(((i, c) for i, c in seen if i > k), default=None)
    if lo is None:
        return seen[0][1]
    if hi is None:
        return lo[1] * (1 + prior_slope * (k - lo[0]))
    return lo[1] + (hi[1] - lo[1]) * (k - lo[0]) / (hi[0] - lo[0])


def choose_k(cfg: LengthConfig, s: LengthState) -> int:
    """best_k, except every explore_every-th step: twice that (within max_k)."""
    k = best_k(cfg, s)
    if cfg.explore_every and s.steps % cfg.explore_every == cfg.explore_every - 1:
        return min(cfg.max_k, 2 * k)
    return k


def reach(cfg: LengthConfig, s: LengthState) -> int:
    """The longest length best_k may pick: twice the longest drafted length whose cost was
    measured (max_k while none was), so an extrapolated cost is never trusted far."""
    longest = max((i for i, c in enumerate(s.cost) if i > 0 and not math.isnan(c)), default=0)
    return cfg.max_k if longest == 0 else max(cfg.min_k, min(cfg.max_k, 2 * longest))


def best_k(cfg: LengthConfig, s: LengthState) -> int:
    """The draft length in [min_k, reach] with the most expected tokens per second."""
    return _best(cfg, s, s.accept)[0]


def best_rate(cfg: LengthConfig, s: LengthState, slow: bool = False) -> float | None:
    """Expected committed tokens per second at the best length; None while nothing was timed.
    slow: from the slow acceptance EMAs (whether the arm pays at all)."""
    return _best(cfg, s, s.slow if slow else s.accept)[1]


def _best(cfg: LengthConfig, s: LengthState, accept: tuple[float, ...]) -> tuple[int, float | None]:
    best, rate = cfg.max_k, None
    for k in range(cfg.min_k, reach(cfg, s) + 1):
        c = step_cost(s.cost, k, cfg.prior_slope, s.draft_cost)
        if c is None:
            return cfg.max_k, None  # nothing timed yet: start long and learn
        r = expected_tokens(accept, k, cfg.prior_accept) / c
        if rate is None or r > rate:
            best, rate = k, r
    return best, rate


def _ema(old: float, new: float, w: float) -> float:
    return new if math.isnan(old) else (1 - w) * old + w * new


def observe(
    cfg: LengthConfig,
    s: LengthState,
    drafted: int,
    accepted: int,
    step_s: float,
    draft_s: float = 0.0,
) -> LengthState:
    """Learn from one step: positions before `accepted` were accepted, position `accepted`
    (if drafted) was rejected, later ones were never judged; the step's time is cost[drafted],
    and draft_s / drafted the draft cost per token. The first step of a generation runs cold, so
    its time is not learnt."""
    accept = _accepts(cfg, s.accept, drafted, accepted, cfg.weight)
    slow = _accepts(cfg, s.slow, drafted, accepted, cfg.slow_weight)
    grow = max(0, drafted + 1 - len(s.cost))
    cost, timed_at = s.cost + (math.nan,) * grow, list(s.timed_at) + [0] * grow
    per_token = s.draft_cost
    if s.steps > 0:
        stale = s.steps - timed_at[drafted] > cfg.stale_after
        cost = observe_cost(cost, drafted, step_s, cfg.weight, fresh=stale)
        timed_at[drafted] = s.steps
        if drafted > 0:
            per_token = _ema(per_token, draft_s / drafted, cfg.weight)
    return replace(
        s,
        accept=accept,
        slow=slow,
        cost=cost,
        draft_cost=per_token,
        steps=s.steps + 1,
        timed_at=tuple(timed_at),
    )


def _accepts(
    cfg: LengthConfig, old: tuple[float, ...], drafted: int, accepted: int, weight: float
) -> tuple[float, ...]:
    """Acceptance EMAs after positions < accepted were accepted and position `accepted` (if
    drafted) rejected; a position judged for the first time starts from what was assumed for it
    (the deepest position's estimate, or the prior)."""
    beyond = old[-1] if old else cfg.prior_accept
    accept = list(old) + [beyond] * max(0, drafted - len(old))
    for i in range(min(drafted, accepted + 1)):
        accept[i] = _ema(accept[i], 1.0 if i < accepted else 0.0, weight)
    return tuple(accept)


def observe_draft_cost(
    cfg: LengthConfig, s: LengthState, drafted: int, seconds: float
) -> LengthState:
    """Learn the draft cost per token from a draft that was made but not verified (a peek)."""
    return replace(s, draft_cost=_ema(s.draft_cost, seconds / max(drafted, 1), cfg.weight))
