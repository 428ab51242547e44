"""Pure tests of the DFlash training objective: anchors, block mask, labels, weights, tau."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaspec.train.objective import (
    TrainingError,
    accepted_lengths,
    block_mask,
    default_gamma,
    group_mask,
    label_counts,
    make_blocks,
    position_weights,
    sample_anchors,
)


@given(st.integers(0, 50), st.integers(0, 80), st.integers(0, 40), st.integers(0, 2**32 - 1))
def test_anchors_are_distinct_sorted_and_in_range(start, length, n, seed):
    end = start + length
    a = sample_anchors(np.random.default_rng(seed), start, end, n)
    assert len(a) == min(n, max(end - start, 0))
    assert np.all(np.diff(a) > 0)
    if len(a):
        assert a.min() >= start and a.max() <= end - 1


@given(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True), st.integers(2, 9))
def test_block_mask_sees_exactly_the_committed_context_and_its_own_block(anchors, B):
    a = np.array(sorted(anchors))
    S = 31
    m = block_mask(a, S, B)
    assert m.shape == (len(a), 1, B, S + B)
    for i, ai in enumerate(a):
        # context rows p < a_i: the positions before the block's first slot, as at inference
        assert np.array_equal(m[i, 0, :, :S], np.broadcast_to(np.arange(S) < ai, (B, S)))
        assert m[i, 0, :, S:].all()  # bidirectional inside the block
    causal = block_mask(a, S, B, causal=True)
    assert np.array_equal(causal[0, 0, :, S:], np.tril(np.ones((B, B), bool)))


@given(st.integers(3, 40), st.integers(2, 9), st.data())
def test_on_greedy_text_every_position_is_labelled_with_the_next_token(T, B, data):
    tokens = np.arange(100, 100 + T)
    greedy = tokens + 1  # the text is the target's greedy chain throughout
    a = np.array(sorted(data.draw(st.sets(st.integers(0, T - 1), min_size=1, max_size=5))))
    b = make_blocks(tokens, greedy, a, B, mask_id=7)
    assert np.array_equal(b.inputs[:, 0], tokens[a])
    assert (b.inputs[:, 1:] == 7).all()
    for i, ai in enumerate(a):
        for k in range(1, B):
            # the prediction after the last token labels one position past the text
            assert b.valid[i, k - 1] == (ai + k - 1 < T)
            if ai + k - 1 < T:
                assert b.labels[i, k - 1] == 100 + ai + k


@given(st.lists(st.integers(0, 3), min_size=2, max_size=30), st.integers(2, 9), st.data())
def test_labels_follow_the_greedy_chain_and_stop_where_the_text_leaves_it(text, B, data):
    tokens = np.array(text)
    greedy = np.array(
        data.draw(st.lists(st.integers(0, 3), min_size=len(text), max_size=len(text)))
    )
    T = len(tokens)
    a = np.arange(T)
    b = make_blocks(tokens, greedy, a, B, mask_id=9)
    for i in a:
        for j in range(1, B):
            inside = i + j - 1 < T
            chain = inside and all(tokens[i + m] == greedy[i + m - 1] for m in range(1, j))
            assert b.valid[i, j - 1] == chain
            if b.valid[i, j - 1]:
                assert b.labels[i, j - 1] == greedy[i + j - 1] and b.source[i, j - 1] == i + j - 1
    counts = label_counts(tokens, greedy, B)
    np.testing.assert_array_equal(counts, b.valid[1:].sum(0))


def test_bad_anchor_is_refused():
    with pytest.raises(TrainingError, match="anchors"):
        make_blocks(np.arange(5), np.arange(5), np.array([5]), 4, 0)
    with pytest.raises(TrainingError, match="greedy"):
        make_blocks(np.arange(5), np.arange(4), np.array([1]), 4, 0)


def test_position_weights_follow_the_paper():
    w = position_weights(16, default_gamma(16))
    assert w[0] == 1.0 and np.all(np.diff(w) < 0)
    assert np.isclose(w[7], np.exp(-7 / 7))
    assert default_gamma(8) == 4 and default_gamma(10) == 5
    with pytest.raises(TrainingError, match="gamma"):
        position_weights(8, 0)


@given(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=8))
def test_accepted_length_counts_leading_matches_only(rows):
    ok = np.array(rows)
    labels = np.zeros(ok.shape, dtype=int)
    pred = np.where(ok, 0, 1)
    got = accepted_lengths(pred, labels, np.ones(ok.shape, bool))
    for r, n in zip(rows, got):
        want = next((i for i, x in enumerate(r) if not x), len(r))
        assert n == want


@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=4), min_size=1, max_size=3))
def test_group_mask_is_each_blocks_mask_and_keeps_blocks_apart(rows):
    A, S, B = max(len(r) for r in rows), 31, 3
    a = np.array([sorted(r) + [0] * (A - len(r)) for r in rows])
    g = group_mask(a, S, B)
    assert g.shape == (len(rows), 1, A * B, S + A * B)
    for s in range(len(rows)):
        single = block_mask(a[s], S, B)
        for i in range(A):
            q = slice(i * B, (i + 1) * B)
            assert np.array_equal(g[s, 0, q, :S], single[i, 0, :, :S])
            own = g[s, 0, q, S:].reshape(B, A, B)
            assert own[:, i].all() and own.sum() == B * B  # its own slots, no other block's
