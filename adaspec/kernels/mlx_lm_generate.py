"""mlx-lm's own decoding loop on the vectorized logsumexp, with the same bits.

`mlx_lm.generate` turns each step's logits into log-probabilities with `mx.logsumexp`, whose
CPU op evaluates `exp` one element at a time (~0.4 ms per row on a 49k vocabulary). adaspec's
loop uses `softmax.logsumexp`, which gives the same bits faster; so that a ratio against
mlx-lm's AR in the same process measures speculation alone, `install` gives `mlx_lm.generate`
a view of `mlx.core` whose `logsumexp` takes the same path where it applies (fp32, the CPU,
the JIT wrapper active, a reduction over the last axis kept as a dimension) and calls mlx's op
everywhere else. Only the `mx` name inside `mlx_lm.generate` changes; `uninstall` puts
mlx.core back."""

from __future__ import annotations

import sys
import types
from typing import Any

import mlx.core as mx

from . import jit
from .softmax import logsumexp as _fast


def _last_axis(a: mx.array, axis: Any) -> bool:
    """Whether reducing `a` over `axis` reduces its last axis alone (None: every axis, which
    is the last alone when all others have length 1)."""
    if a.ndim == 0:
        return False
    if axis is None:
        return all(d == 1 for d in a.shape[:-1])
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            return False
        axis = axis[0]
    return isinstance(axis, int) and axis in (-1, a.ndim - 1)


def logsumexp(a: mx.array, axis: Any = None, keepdims: bool = False, **kwargs: Any) -> mx.array:
    """mx.logsumexp, on the vectorized kernel where it gives the same bits (see above)."""
    st = jit.status()
    if (
        keepdims
        and not kwargs
        and isinstance(a, mx.array)
        and a.dtype == mx.float32
        and _last_axis(a, axis)
        and st is not None
        and st.active
        and mx.default_device() == mx.cpu
    ):
        return _fast(a)
    return mx.logsumexp(a, axis=axis, keepdims=keepdims, **kwargs)


class _Core(types.ModuleType):
    """`mlx.core` with `logsumexp` above; every other name is mlx.core's."""

    logsumexp = staticmethod(logsumexp)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)


_CORE = _Core("mlx.core")


def install() -> bool:
    """Point `mlx_lm.generate`'s `mx` at the view above (once; idempotent). Returns whether
    mlx-lm's loop now runs the fast path; nothing changes when the JIT wrapper is off."""
    st = jit.status()
    if st is None or not st.active:
        return False
    import mlx_lm.generate  # noqa: F401

    module = sys.modules["mlx_lm.generate"]
    if module.mx is mx:
        vars(module)["mx"] = _CORE  # a module's attributes are its __dict__
    return module.mx is _CORE


def installed() -> bool:
    module = sys.modules.get("mlx_lm.generate")
    return module is not None and getattr(module, "mx", None) is _CORE


def uninstall() -> bool:
    """Give `mlx_lm.generate` mlx.core back; returns whether the view was in place."""
    if not installed():
        return False
    vars(sys.modules["mlx_lm.generate"])["mx"] = mx
    return True
