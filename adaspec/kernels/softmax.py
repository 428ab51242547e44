"""logsumexp over the last axis with a vectorized `exp`, bit for bit mlx's CPU op.

mlx's CPU logsumexp (backend/cpu/logsumexp.cpp) evaluates `exp` one element at a time. Here
the same arithmetic runs as mlx ops: the row max, `exp(x - max)` in a compiled kernel
(vectorized by kernels/jit.py), the row sum from the left (mlx's reduction on x86 adds one
element at a time from 0, as that file does), then `log(sum) + max` (`max` itself where it is
infinite). Attention's softmax runs inside the native node (kernels/native_attention.cpp).
Tests: tests/test_ops_attention.py.
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
def _log_total(total: mx.array, maximum: mx.array) -> mx.array:
    return mx.where(mx.isinf(maximum), maximum, mx.log(total) + maximum)


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
