"""Gated-delta replay kernels: the plain-ops twin against mlx-lm's own recurrence, and the Metal
kernel against the plain ops (skipped without Metal)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.kernels import gated_delta as gd


def inputs(seed, B, T, Hk, rep, Dk, Dv, edges=False):
    """Unit-norm keys as the models make them; `edges`: gates and betas of exactly 0 and 1."""
    mx.random.seed(seed)
    Hv = Hk * rep
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    if edges:
        g, beta = mx.round(g), mx.round(beta)
    state = mx.random.normal((B, Hv, Dv, Dk))
    return k, v, g, beta, state


@settings(max_examples=25)
@given(
    seed=st.integers(0, 1 << 16),
    B=st.integers(1, 3),
    T=st.integers(0, 17),
    Hk=st.integers(1, 3),
    rep=st.integers(1, 3),
    Dk=st.sampled_from([4, 16, 32]),
    Dv=st.sampled_from([3, 8, 16]),
    edges=st.booleans(),
)
def test_ops_replay_is_mlx_lm_recurrence(seed, B, T, Hk, rep, Dk, Dv, edges):
    from mlx_lm.models.gated_delta import gated_delta_ops

    k, v, g, beta, state = inputs(seed, B, T, Hk, rep, Dk, Dv, edges)
    got = gd.gated_delta_replay(k, v, g, beta, state, use_kernel=True)  # CPU: the ops twin
    if T == 0:
        assert np.array_equal(np.array(got), np.array(state))
        return
    q = mx.zeros_like(k)
    _, want = gated_delta_ops(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)


def test_shapes_are_checked():
    k, v, g, beta, state = inputs(0, 1, 4, 2, 2, 16, 8)
    with pytest.raises(ValueError, match=r"g \(1, 3, 4\).*accepted: k \(B,T,Hk,Dk\)"):
        gd.replay_ops(k, v, g[:, :3], beta, state)


@pytest.mark.skipif(not mx.metal.is_available(), reason="the Metal kernel needs a Metal GPU")
@pytest.mark.parametrize("Dk, Dv, rep", [(32, 16, 1), (64, 64, 2), (128, 128, 4)])
def test_metal_kernel_matches_ops(Dk, Dv, rep):
    k, v, g, beta, state = inputs(1, 2, 7, 2, rep, Dk, Dv)
    with mx.stream(mx.gpu):
        assert gd.kernel_usable(k)
        got = gd.replay_kernel(k, v, g, beta, state)
        via_switch = gd.gated_delta_replay(k, v, g, beta, state, use_kernel=True)
    want = gd.gated_delta_replay(k, v, g, beta, state, use_kernel=False)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.array(via_switch), np.array(got))


def test_kernel_is_never_chosen_without_metal():
    k = mx.zeros((1, 2, 1, 128))
    assert gd.kernel_usable(k) == (mx.metal.is_available() and mx.default_device() == mx.gpu)
