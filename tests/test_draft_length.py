"""Tier 1: the adaptive draft-length rule (pure)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaspec.policy.draft_length import (
    LengthConfig,
    LengthState,
    best_k,
    best_rate,
    choose_k,
    expected_tokens,
    observe,
    reach,
    step_cost,
)

CFG = LengthConfig(min_k=1, max_k=16)
T = 0.05


def cost_line(k):
    return T * (1 + 0.1 * k)  # a verify of k+1 tokens: +10% of a plain step per token


# a state past the first (cold, unlearnt) step of a generation
WARM = observe(CFG, LengthState(), 0, 0, 1.0)


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
    s = feed(WARM, [(0, 0), (16, 16), (8, 8)])
    start = best_k(CFG, s)
    s = feed(s, [(best_k(CFG, s), 0) for _ in range(30)])
    assert best_k(CFG, s) < start and best_k(CFG, s) == CFG.min_k


def test_grows_under_full_acceptance():
    s = feed(WARM, [(0, 0), (2, 0), (2, 0), (2, 0), (1, 0)])
    low = best_k(CFG, s)
    for _ in range(40):
        k = choose_k(CFG, s)  # lengths past twice the longest measured are reached by exploring
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


# ---- with a drafter that costs time per token (a draft model) --------------------------------


def feed_costly(s, steps, per_token):
    for drafted, accepted in steps:
        draft_s = per_token * drafted
        s = observe(CFG, s, drafted, accepted, cost_line(drafted) + draft_s, draft_s)
    return s


@given(events, st.floats(0.0, 2.0), st.integers(1, 8), st.integers(8, 32))
def test_never_leaves_the_bounds_with_draft_cost(steps, per_token_ar, lo, hi):
    cfg = LengthConfig(min_k=lo, max_k=hi)
    s = LengthState()
    for d, a in steps:
        assert lo <= best_k(cfg, s) <= hi
        s = observe(cfg, s, d, a, cost_line(d) + per_token_ar * T * d, per_token_ar * T * d)


def test_a_step_is_priced_with_its_drafting_and_extrapolated_per_token_beyond_the_measured():
    s = feed_costly(WARM, [(0, 0), (4, 2)], per_token=0.4 * T)
    assert math.isclose(s.draft_cost, 0.4 * T)
    assert math.isclose(s.cost[4], cost_line(4) + 4 * 0.4 * T)
    # beyond the longest measured length: its cost grown as a verify, plus the extra drafting
    want = s.cost[4] * (1 + 0.1 * 4) + 4 * 0.4 * T
    assert math.isclose(step_cost(s.cost, 8, 0.1, s.draft_cost), want)
    # between measured lengths: a drafter costing per token is priced per token
    assert math.isclose(step_cost(s.cost, 2, 0.1, s.draft_cost), cost_line(2) + 2 * 0.4 * T)


def test_a_draft_that_costs_the_same_at_every_length_is_not_priced_per_token():
    """One block drafted whatever k (DFlash): 0.4 plain steps per draft. Dividing by k made
    short drafts look cheap; measured step costs price k = 1 and 3 as what they cost."""
    s = WARM
    for k in (0, 1, 3, 1, 3):
        s = observe(CFG, s, k, 0, cost_line(k) + (0.4 * T if k else 0.0), 0.4 * T if k else 0.0)
    for k in (1, 2, 3):
        assert math.isclose(step_cost(s.cost, k, 0.1, s.draft_cost), cost_line(k) + 0.4 * T)


@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=12), st.sets(st.integers(1, 12)))
def test_measured_cost_interpolates_and_keeps_the_measured_order(costs, holes):
    """Measured costs that grow with k give unseen lengths costs that grow too, between the
    measured neighbours."""
    from adaspec.policy.draft_length import measured_cost

    costs = sorted(costs)
    cost = tuple(math.nan if i in holes else c for i, c in enumerate(costs))
    prev = 0.0
    for k in range(len(cost) + 6):
        c = measured_cost(cost, k, 0.08)
        assert c >= prev - 1e-12
        prev = c
        if k < len(cost) and k not in holes:
            assert c == cost[k]


def test_a_step_shaped_verify_cost_does_not_hide_long_drafts():
    """MKL here: verifying 3+ tokens costs ~2.8 plain steps whatever the count, a draft token
    0.47. With every draft accepted, long drafts pay (16 tokens: 17 in 11.2 plain steps) though
    short ones do not (3 tokens: 4 in 4.2); a line through the short lengths hides that. (Ten
    fully accepted steps: acceptance starts from the prior, so five would not yet pay.)"""
    step = {0: 1.0, 1: 1.7, 2: 2.8}
    s = observe(CFG, LengthState(), 0, 0, T)
    for k in (3, 1, 2, 3, 3) * 2:  # what the rule tried first on the real pair, twice
        s = observe(CFG, s, k, k, T * (step.get(k, 2.8) + 0.47 * k), T * 0.47 * k)
    assert best_k(CFG, s) > 3


def test_flat_verify_cost_with_high_acceptance_gets_near_the_best_fixed_length():
    """A verify costs 3 plain steps from 2 tokens on, drafting 0.4 of a plain step per token,
    90% of positions are accepted: the rule, learning as it goes, commits at least 80% of the
    tokens per second of the best fixed draft length (over seeds 0-9, after 50 steps each)."""
    import random

    flat = lambda k: T if k == 0 else 3 * T  # noqa: E731
    best = max(sum(0.9**j for j in range(k + 1)) / (flat(k) + 0.4 * T * k) for k in range(17))
    tokens, spent = 0, 0.0
    for seed in range(10):
        rng = random.Random(seed)
        s = observe(CFG, LengthState(), 0, 0, T)
        for i in range(150):
            k = best_k(CFG, s)
            a = next((j for j in range(k) if rng.random() > 0.9), k)
            s = observe(CFG, s, k, a, flat(k) + 0.4 * T * k, 0.4 * T * k)
            if i >= 50:
                tokens, spent = tokens + a + 1, spent + flat(k) + 0.4 * T * k
    assert tokens / spent > 0.8 * best


def test_costly_drafts_shrink_under_rejections_and_grow_under_full_acceptance():
    s = feed_costly(LengthState(), [(0, 0), (16, 16), (8, 8)], per_token=0.3 * T)
    start = best_k(CFG, s)
    for _ in range(30):
        s = feed_costly(s, [(best_k(CFG, s), 0)], per_token=0.3 * T)
    assert best_k(CFG, s) < start and best_k(CFG, s) == CFG.min_k
    low = best_k(CFG, s)
    for _ in range(60):
        k = choose_k(CFG, s)
        s = feed_costly(s, [(k, k)], per_token=0.3 * T)
    assert best_k(CFG, s) > low and best_k(CFG, s) == CFG.max_k


def test_one_accepted_draft_is_not_taken_for_certainty():
    """The Qwen pair (a traced run): plain step 206 ms, a 0.5B draft token 90 ms, a 3-token
    verify 277 ms, all 3 accepted once. The rule must not jump to 16 tokens (2.3 s, rejected at
    the first token on the real run): it stays within twice the measured length."""
    ms = 1e-3
    s = observe(CFG, LengthState(), 0, 0, 240 * ms)  # cold
    s = observe(CFG, s, 0, 0, 206 * ms)
    s = observe(CFG, s, 3, 3, (277 + 285) * ms, 285 * ms)
    assert s.accept[0] < 1.0
    assert 1 <= best_k(CFG, s) <= 6 and choose_k(CFG, s) <= 12


@given(st.integers(1, 15))
def test_reach_is_twice_the_longest_measured_length(k):
    s = observe(CFG, observe(CFG, LengthState(), 0, 0, T), k, k, cost_line(k))
    assert reach(CFG, s) == min(CFG.max_k, 2 * k)
    assert best_k(CFG, s) <= reach(CFG, s)
    assert reach(CFG, observe(CFG, LengthState(), 0, 0, T)) == CFG.max_k


def test_a_costlier_drafter_gets_shorter_drafts():
    history = [(0, 0)] + [(6, 3), (6, 4), (6, 2), (3, 3), (3, 2)] * 4
    cheap = best_k(CFG, feed_costly(LengthState(), history, per_token=0.0))
    costly = best_k(CFG, feed_costly(LengthState(), history, per_token=0.5 * T))
    assert costly < cheap


# ---- one bad measurement must not pin the rule to short drafts --------------------------------


def test_a_cold_first_step_is_not_learnt():
    s = observe(CFG, LengthState(), 4, 0, 10 * T)
    assert all(math.isnan(c) for c in s.cost) and math.isnan(s.draft_cost)
    assert s.accept[0] < CFG.prior_accept  # acceptance is still learnt


def test_an_outlier_on_a_long_length_is_measured_again_and_long_drafts_return():
    """A contended 4-token verify (3x its true cost) and then short drafts only: exploration
    re-measures the longer lengths, and full acceptance takes the rule to max_k."""
    s = feed(WARM, [(0, 0), (1, 1)])
    s = observe(CFG, s, 4, 0, 3 * cost_line(4))
    for _ in range(60):
        k = choose_k(CFG, s)
        s = observe(CFG, s, k, k, cost_line(k))
    assert best_k(CFG, s) == CFG.max_k


@given(st.integers(0, 200))
def test_exploration_only_lengthens_and_stays_in_bounds(steps):
    s = LengthState(steps=steps, cost=tuple(cost_line(k) for k in range(17)), accept=(0.5,) * 16)
    k = choose_k(CFG, s)
    assert best_k(CFG, s) <= k <= CFG.max_k
    if CFG.explore_every and steps % CFG.explore_every != CFG.explore_every - 1:
        assert k == best_k(CFG, s)


def test_a_stale_cost_is_replaced_not_blended():
    s = feed(WARM, [(0, 0), (4, 4)])
    s = observe(CFG, s, 4, 4, 10 * T)  # outlier blended in
    s = feed(s, [(1, 1)] * (CFG.stale_after + 1))
    s = observe(CFG, s, 4, 4, cost_line(4))
    assert math.isclose(s.cost[4], cost_line(4))


def test_the_slow_acceptance_behind_holding_an_arm_moves_less_than_the_length_rule():
    """Three misses in a row at the first position: the length rule's EMA (weight 0.3) falls
    to 0.6 * 0.7^3, the slow one (0.1) only to 0.6 * 0.9^3, and the rate it prices is higher."""
    cfg = LengthConfig(min_k=1, max_k=2)
    s = LengthState()
    for _ in range(3):
        s = observe(cfg, s, drafted=2, accepted=0, step_s=1.0)
    assert s.accept[0] == pytest.approx(0.6 * 0.7**3)
    assert s.slow[0] == pytest.approx(0.6 * 0.9**3)
    assert best_rate(cfg, s, slow=True) > best_rate(cfg, s)
