"""mlx-lm's decoding loop on the vectorized logsumexp: the same bits as mlx's op for every call
it takes, mlx's op for every other call, and mlx-lm's tokens and log-probabilities unchanged."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from tiny import tiny_model

from adaspec.kernels import jit, mlx_lm_generate

pytestmark = pytest.mark.skipif(
    not (jit.status() and jit.status().active), reason="the fast paths are off here"
)


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a.view(mx.uint32), b.view(mx.uint32)))


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((1, 49152), None), ((1, 49152), -1), ((3, 1000), -1), ((3, 1000), 1), ((2, 1, 77), [2])],
)
def test_last_axis_reductions_take_the_fast_path_with_mlx_bits(shape, axis, monkeypatch):
    calls = []
    monkeypatch.setattr(mlx_lm_generate, "_fast", lambda a: calls.append(1) or mx.zeros(1))
    x = mx.random.normal(shape, key=mx.random.key(len(shape)))
    mlx_lm_generate.logsumexp(x, axis=axis, keepdims=True)
    assert calls  # routed
    monkeypatch.undo()
    for scale in (1.0, 30.0):
        y = x * scale
        got = mlx_lm_generate.logsumexp(y, axis=axis, keepdims=True)
        assert same_bits(got, mx.logsumexp(y, axis=axis, keepdims=True))


def test_special_values_keep_mlx_bits():
    x = np.random.default_rng(0).standard_normal((6, 300)).astype(np.float32)
    x[1, 5], x[2, :], x[3, 7], x[4, :] = np.inf, -np.inf, np.nan, 0.0
    x[5, 3] = -np.inf
    y = mx.array(x)
    assert same_bits(mlx_lm_generate.logsumexp(y, -1, True), mx.logsumexp(y, -1, keepdims=True))


@pytest.mark.parametrize(
    ("shape", "axis", "keepdims"),
    [((3, 50), None, True), ((3, 50), 0, True), ((3, 50), -1, False), ((4,), None, False)],
)
def test_other_calls_are_mlx_op(shape, axis, keepdims, monkeypatch):
    monkeypatch.setattr(mlx_lm_generate, "_fast", lambda a: pytest.fail("took the fast path"))
    x = mx.random.normal(shape, key=mx.random.key(3))
    got = mlx_lm_generate.logsumexp(x, axis=axis, keepdims=keepdims)
    assert same_bits(got, mx.logsumexp(x, axis=axis, keepdims=keepdims))


def test_mlx_lm_generate_step_is_unchanged():
    from mlx_lm.generate import generate_step

    assert mlx_lm_generate.install() and mlx_lm_generate.installed()
    module = sys.modules["mlx_lm.generate"]
    assert module.mx.array is mx.array and module.mx.float32 == mx.float32  # the rest is mx
    model = tiny_model(vocab=512)
    prompt = mx.array([3, 17, 17, 42, 5, 9, 17, 42])

    def run():
        return [
            (t, lp) for (t, lp), _ in zip(generate_step(prompt, model, max_tokens=12), range(12))
        ]

    fast = run()
    module.mx = mx
    try:
        stock = run()
    finally:
        mlx_lm_generate.install()
    assert [t for t, _ in fast] == [t for t, _ in stock]
    assert all(same_bits(a, b) for (_, a), (_, b) in zip(fast, stock))
