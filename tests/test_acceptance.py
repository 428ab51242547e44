"""Tier 1: the acceptance rules as pure functions (hypothesis + chi-square)."""

import numpy as np
import pytest
from distribution import assert_same
from hypothesis import given
from hypothesis import strategies as st

from adaspec.errors import DrafterError
from adaspec.loop.acceptance import (
    accept_greedy,
    accept_rejection,
    accept_sample_match,
    sample,
)


@given(st.lists(st.integers(0, 5), max_size=8), st.data())
def test_greedy_keeps_longest_matching_prefix_then_target_token(draft, data):
    target = data.draw(
        st.lists(st.integers(0, 5), min_size=len(draft) + 1, max_size=len(draft) + 1)
    )
    out = accept_greedy(draft, target)
    n = out.accepted
    assert list(out.tokens[:n]) == draft[:n] == target[:n]
    assert n == len(draft) or draft[n] != target[n]
    assert out.tokens[-1] == target[n] and len(out.tokens) == n + 1


@given(
    st.lists(st.floats(0, 1), min_size=1, max_size=6).filter(lambda p: sum(p) > 0),
    st.floats(0, 0.999999),
)
def test_sample_returns_index_with_positive_mass(p, u):
    i = sample(np.array(p), u)
    assert 0 <= i < len(p) and p[i] > 0


def _dist(rng, v):
    return rng.dirichlet(np.ones(v) * 0.7)


@pytest.mark.parametrize("stochastic", [False, True])
def test_emitted_tokens_follow_target_distribution(stochastic):
    v, n = 6, 20000
    rng = np.random.default_rng(1)
    p = np.stack([_dist(rng, v) for _ in range(3)])
    q = np.stack([_dist(rng, v) for _ in range(2)])
    first = np.zeros(v)
    second = np.zeros(v)  # second emitted token, given the first was the accepted d0
    draws = np.random.default_rng(2)
    for _ in range(n):
        if stochastic:
            d = [int(draws.choice(v, p=q[i])) for i in range(2)]
            out = accept_rejection(d, q, p, draws)
        else:
            d = [2, 4]
            out = accept_sample_match(d, p, draws)
        first[out.tokens[0]] += 1
        if out.accepted >= 1:
            second[out.tokens[1]] += 1
    assert_same(first, p[0])
    assert_same(second, p[1])


def test_rejection_refuses_draft_token_with_zero_drafter_probability():
    q = np.array([[0.0, 1.0]])
    p = [np.array([0.5, 0.5])] * 2
    with pytest.raises(DrafterError, match="drafter probability"):
        accept_rejection([0], q, p, np.random.default_rng(0))
