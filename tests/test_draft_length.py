"""Tier 1: the adaptive draft-length rule (pure)."""

import math

from hypothesis import given
from hypothesis import strategies as st

from adaspec.policy.draft_length import (
    LengthConfig,
    LengthState,
    best_k,
    expected_tokens,
    observe,
    step_cost,
)

CFG = LengthConfig(min_k=1, max_k=16)
T = 0.05


def cost_line(k):
    return T * (1 + 0.1 * k)  # a verify of k+1 tokens: +10% of a plain step per token


def feed(s, steps):
    for drafted, accepted in steps:
        s = observe(CFG, s, drafted, accepted, cost_line(drafted))
    return s


events = st.lists(
    st.tuples(st.integers(0, 16), st.integers(0, 16)).map(lambda t: (t[0], min(t[0], t[1]))),
    max_size=60,
)


@given(events, st.integers(1, 8), st.integers(8, 32))
def test_never_leaves_the_bounds(steps, lo, hi):
    cfg = LengthConfig(min_k=lo, max_k=hi)
    s = LengthState()
    for d, a in steps:
        assert lo <= best_k(cfg, s) <= hi
        s = observe(cfg, s, d, a, cost_line(d))


def test_shrinks_under_repeated_rejections():
    s = feed(LengthState(), [(0, 0), (16, 16), (8, 8)])
    start = best_k(CFG, s)
    s = feed(s, [(best_k(CFG, s), 0) for _ in range(30)])
    assert best_k(CFG, s) < start and best_k(CFG, s) == CFG.min_k


def test_grows_under_full_acceptance():
    s = feed(LengthState(), [(0, 0), (2, 0), (2, 0), (2, 0), (1, 0)])
    low = best_k(CFG, s)
    for _ in range(40):
        k = best_k(CFG, s)
        s = observe(CFG, s, k, k, cost_line(k))
    assert best_k(CFG, s) > low and best_k(CFG, s) == CFG.max_k


def test_expected_tokens_counts_the_bonus_and_the_accepted_prefix():
    assert expected_tokens((), 0, 0.5) == 1
    assert math.isclose(expected_tokens((1.0, 0.5), 2, 0.0), 1 + 1 + 0.5)
    assert math.isclose(expected_tokens((0.5,), 3, 1.0), 1 + 0.5 + 0.25 + 0.125)
    assert math.isclose(expected_tokens((), 2, 0.5), 1 + 0.5 + 0.25)


@given(st.lists(st.floats(0.01, 1.0), min_size=2, max_size=10), st.integers(0, 30))
def test_cost_fit_is_positive_and_matches_measured_points(costs, k):
    cost = tuple(costs)
    c = step_cost(cost, k, 0.1)
    assert c > 0
    if k < len(cost):
        assert c == cost[k]
