"""Softmax and logsumexp over the last axis with a vectorized `exp`, bit for bit mlx's CPU ops.

mlx's CPU softmax and logsumexp (backend/cpu/softmax.cpp, logsumexp.cpp) evaluate `exp` one
element at a time. Here the same arithmetic runs as mlx ops: the row max, `exp(x - max)` in a
compiled kernel (vectorized by kernels/jit.py), the row sum from the left (mlx's reduction on
x86 adds one element at a time from 0, as those files do), then softmax's multiply by `1 / sum`
or logsumexp's `log(sum) + max` (`max` itself where it is infinite). Tests:
tests/test_ops_attention.py.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from . import jit


# shapeless: one trace serves every length (a shaped compile would trace again, and keep
# another entry, at every decode step)
@partial(mx.compile, shapeless=True)
def exp_shifted(x: mx.array, maximum: mx.array) -> mx.array:
    return mx.exp(x - maximum)


@partial(mx.compile, shapeless=True)
def normalize(e: mx.array, total: mx.array) -> mx.array:
    return e * (1 / total)


@partial(mx.compile, shapeless=True)
def _log_total(total: mx.array, maximum: mx.array) -> mx.array:
    return mx.where(mx.isinf(maximum), maximum, mx.log(total) + maximum)


def softmax(x: mx.array) -> mx.array:
    """mx.softmax(x, axis=-1, precise=True) for fp32 x, with the same bits."""
    maximum = mx.max(x, axis=-1, keepdims=True)
    e = exp_shifted(x, maximum)
    return normalize(e, mx.sum(e, axis=-1, keepdims=True))


def logsumexp(x: mx.array) -> mx.array:
    """mx.logsumexp(x, axis=-1, keepdims=True) for fp32 x, with the same bits."""
    maximum = mx.max(x, axis=-1, keepdims=True)
    total = mx.sum(exp_shifted(x, maximum), axis=-1, keepdims=True)
    return _log_total(total, maximum)


def fast_logsumexp(x: mx.array) -> mx.array:
    """mx.logsumexp(x, axis=-1, keepdims=True), on `logsumexp` above where the JIT wrapper is
    active, x is fp32 and the device is the CPU."""
    st = jit.status()
    if st and st.active and x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return logsumexp(x)
    return mx.logsumexp(x, axis=-1, keepdims=True)
