"""Tier 1: draft trees as values, and tree acceptance (greedy walk, recursive multi-candidate
rejection sampling) as pure functions, with a chi-square test."""

import numpy as np
import pytest
from distribution import assert_same
from hypothesis import given
from hypothesis import strategies as st
from strategies import token_trees

from adaspec.drafters.base import Draft
from adaspec.errors import DrafterError
from adaspec.loop.acceptance import (
    accept_greedy,
    accept_tree_greedy,
    accept_tree_sample,
    children,
    sample,
)


def test_illegal_trees_are_refused_by_name():
    with pytest.raises(DrafterError, match=r"parents\[1\] = 1"):
        Draft((3, 4), parents=(-1, 1))
    with pytest.raises(DrafterError, match=r"parents\[0\] = -2"):
        Draft((3,), parents=(-2,))
    with pytest.raises(DrafterError, match="2 entries for 3 tokens"):
        Draft((3, 4, 5), parents=(-1, 0))
    with pytest.raises(DrafterError, match="repeats token 4 under parent -1"):
        Draft((4, 4), parents=(-1, -1))
    q = np.full((2, 6), 1 / 6)
    assert Draft((4, 4), q, parents=(-1, -1)).is_tree  # i.i.d. draws may repeat


def test_chain_shaped_tree_is_a_chain_and_best_chain_follows_first_children():
    assert Draft((1, 2, 3), parents=(-1, 0, 1)).parents is None
    d = Draft((5, 6, 7, 8, 9), parents=(-1, -1, 0, 0, 2), strong=True)
    assert d.depths() == (1, 1, 2, 2, 3)
    best = d.best_chain()
    assert best.tokens == (5, 7, 9) and not best.is_tree and best.strong


@given(token_trees(vocab=4, max_nodes=10), st.data())
def test_greedy_tree_walk_is_the_longest_path_the_target_agrees_with(tree, data):
    tokens, parents = tree
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=len(tokens) + 1, max_size=11))
    out = accept_tree_greedy(tokens, parents, argmax)
    cur = -1
    for node in out.path:  # each step is a child of the previous one, equal to the argmax there
        assert parents[node] == cur and tokens[node] == argmax[cur + 1]
        cur = node
    assert out.tokens[-1] == argmax[cur + 1] and out.accepted == len(out.path)
    assert all(tokens[c] != argmax[cur + 1] for c in children(parents)[cur + 1])


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8), st.data())
def test_greedy_tree_on_a_chain_equals_chain_acceptance(draft, data):
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=len(draft) + 1, max_size=9))
    chain = list(range(-1, len(draft) - 1))
    assert accept_tree_greedy(draft, chain, argmax).tokens == accept_greedy(draft, argmax).tokens


V = 4


def _target(prefix: tuple[int, ...]) -> np.ndarray:
    """A fixed target: its next-token distribution after `prefix` (seeded by the prefix)."""
    seed = 7 + sum((t + 1) * 5**i for i, t in enumerate(prefix))
    return np.random.default_rng(seed).dirichlet(np.ones(V) * 0.8)


def _tree_draft(mode: str, rng: np.random.Generator):
    """Three root candidates, two children under the first and one under the second:
    i.i.d. draws from q, draws without replacement (q renormalized after each sibling), or a
    fixed deterministic tree (q None)."""
    base = [np.array([0.4, 0.3, 0.2, 0.1]), np.array([0.1, 0.2, 0.3, 0.4])]
    if mode == "fixed":
        return [1, 0, 3, 2, 1], [-1, -1, -1, 0, 1], None
    parents = [-1, -1, -1, 0, 0, 1]
    tokens, q = [], []
    for i, p in enumerate(parents):
        row = base[0] if p < 0 else base[1]
        if mode == "distinct":  # without replacement among siblings
            row = row.copy()
            for s in range(i):
                if parents[s] == p:
                    row[tokens[s]] = 0.0
            row /= row.sum()
        tokens.append(int(rng.choice(V, p=row)))
        q.append(row)
    return tokens, parents, np.stack(q)


@pytest.mark.parametrize("mode", ["iid", "distinct", "fixed"])
def test_tree_sampling_emits_the_targets_joint_distribution(mode):
    n = 12000
    rng = np.random.default_rng(4)
    counts = np.zeros(V * V)
    rows_cache: dict = {}
    for _ in range(n):
        tokens, parents, q = _tree_draft(mode, rng)
        prefixes = [()]
        for i, p in enumerate(parents):
            prefixes.append(prefixes[p + 1] + (tokens[i],))
        rows = [rows_cache.setdefault(x, _target(x)) for x in prefixes]
        out = accept_tree_sample(tokens, parents, rows, rng, q).tokens
        if len(out) < 2:  # the next token would come from the next step: the target itself
            out = (*out, sample(_target(out), rng.random()))
        counts[out[0] * V + out[1]] += 1
    joint = np.concatenate([_target(())[a] * _target((a,)) for a in range(V)])
    assert_same(counts, joint)


def test_tree_sampling_refuses_a_node_its_q_cannot_draw():
    q = np.array([[0.5, 0.5, 0.0, 0.0]])
    with pytest.raises(DrafterError, match="tree node 0"):
        accept_tree_sample([2], [-1], [_target(())] * 2, np.random.default_rng(0), q)
