"""mlx-lm modules whose projections of one input run in one graph node (kernels/native.py,
`linears`): the MLP's gate and up projections. `install` changes the class of each covered
instance (llama, qwen2, qwen3 `MLP`) to a subclass made once per class, whose `__call__` runs
the module's own arithmetic (`down_proj(swiglu(gate, up))`, the same `swiglu` the module's
source calls) with gate and up from one native node, and the module's own `__call__` wherever
the native path does not apply (no extension, a sharded or quantized projection, an input
other than fp32 [1, M, K]). `uninstall` gives the instances their classes back.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import native
from .layers import ExactLinear

COVERED = {("mlx_lm.models.llama", "MLP"), ("mlx_lm.models.qwen2", "MLP"),
           ("mlx_lm.models.qwen3", "MLP")}  # fmt: skip
PLAIN = (nn.Linear, ExactLinear)


def _plain(m: Any) -> bool:
    w = m.get("weight") if type(m) in PLAIN else None
    return w is not None and w.dtype == mx.float32 and w.ndim == 2


def _pair(mlp: Any, x: mx.array) -> list[mx.array] | None:
    """gate and up projections of x in one node, or None where that does not apply"""
    gate, up = mlp.gate_proj, mlp.up_proj
    if x.ndim != 3 or x.shape[0] != 1 or x.dtype != mx.float32:
        return None
    if not (_plain(gate) and _plain(up)):
        return None
    core = native.get()
    if core is None:
        return None
    return core.linears(x, [gate["weight"], up["weight"]], [gate.get("bias"), up.get("bias")])


_twins: dict[type, type] = {}


def _twin_class(cls: type) -> type:
    hit = _twins.get(cls)
    if hit is None:
        swiglu = sys.modules[cls.__module__].swiglu

        def __call__(self, x: mx.array) -> mx.array:  # noqa: N807
            pair = _pair(self, x)
            if pair is None:
                return cls.__call__(self, x)
            return self.down_proj(swiglu(*pair))

        hit = _twins[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_native": cls})
    return hit


def install(model: Any) -> int:
    """Give each covered MLP of `model` its twin class (native extension permitting); returns
    how many were changed."""
    if native.get() is None:
        return 0
    changed = 0
    for _, m in model.named_modules():
        cls = type(m)
        if (cls.__module__, cls.__name__) in COVERED and "_native" not in cls.__dict__:
            m.__class__ = _twin_class(cls)
            changed += 1
    return changed


def uninstall(model: Any) -> int:
    changed = 0
    for _, m in model.named_modules():
        base = type(m).__dict__.get("_native")
        if base is not None:
            m.__class__ = base
            changed += 1
    return changed
