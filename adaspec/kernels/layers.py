"""nn.RoPE and nn.RMSNorm twins for the CPU: mlx's own fallback arithmetic, fused by mx.compile.

On the CPU `mx.fast.rope` and `mx.fast.rms_norm` run their fallbacks (fast.cpp): about twenty
and seven small ops per call, each dispatched on its own, so at one token row their cost is
dispatch. These twins evaluate the same ops on the same values in fewer kernels (elementwise
chains fused by the JIT, which adds no contraction; kernels/jit.py), and RoPE's angles are
computed once per position range and shared by every layer. Bits equal stock mlx
(tests/test_ops_layers.py). `install` swaps the instances inside one model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import OrderedDict
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_ANGLES = 8  # (cos, sin) pairs kept: a step's q and k of every layer share one
# the fused RMSNorm kernel broadcasts two operands with runtime strides: from 8 rows on mlx's
# separate ops are faster (same bits either way)
RMS_ROWS = 3


def _logf(x: float) -> float:
    """glibc's logf, as fast.cpp's `std::log(base)` on a float (numpy's log may differ)"""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.logf.restype, libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]
    return float(libm.logf(x))


@partial(mx.compile, shapeless=True)
def _angles(pos: mx.array, offset: mx.array, scale: mx.array, inv_freqs: mx.array):
    theta = mx.expand_dims((pos + offset) * scale, -1) * inv_freqs
    return mx.cos(theta), mx.sin(theta)


@partial(mx.compile, shapeless=True)
def _rotate(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array):
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


class ExactRoPE(nn.Module):
    """nn.RoPE (not traditional, fp32, a scalar integer offset) with mx.fast.rope's CPU
    fallback arithmetic; anything else goes to mx.fast.rope."""

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale=1.0):
        super().__init__()
        self.dims, self.traditional, self.base, self.scale = dims, traditional, base, scale
        half = dims // 2
        # fast.cpp: exp(arange(0, -half, -1) * (std::log(base) / half)), in float32
        step = mx.array(_logf(base), mx.float32) / mx.array(half, mx.float32)
        inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        cache: OrderedDict[tuple[int, int], tuple[mx.array, mx.array]] = OrderedDict()
        # plain attributes, not module state (no parameters, nothing saved)
        object.__setattr__(self, "_inv_freqs", inv_freqs)
        object.__setattr__(self, "_scale", mx.array(scale, mx.float32))
        object.__setattr__(self, "_cache", cache)

    def _fallback(self, x: mx.array, offset: Any) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
            offset=offset,
        )  # fmt: skip

    def _cos_sin(self, offset: int, n: int) -> tuple[mx.array, mx.array]:
        key = (offset, n)
        hit = self._cache.get(key)
        if hit is None:
            pos = mx.arange(n, dtype=mx.float32)
            hit = _angles(pos, mx.array(offset, mx.int32), self._scale, self._inv_freqs)
            self._cache[key] = hit
            if len(self._cache) > _ANGLES:
                self._cache.popitem(last=False)
        return hit

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.traditional or x.ndim != 4 or x.dtype != mx.float32 or type(offset) is not int:
            return self._fallback(x, offset)
        cos, sin = self._cos_sin(offset, x.shape[2])
        half = self.dims // 2
        outs = list(_rotate(x[..., :half], x[..., half : self.dims], cos, sin))
        if self.dims < x.shape[-1]:
            outs.append(x[..., self.dims :])
        return mx.concatenate(outs, -1)


@partial(mx.compile, shapeless=True)
def _normalize(x: mx.array, mean_sq: mx.array, eps: mx.array, weight: mx.array) -> mx.array:
    return x * mx.rsqrt(mean_sq + eps) * weight


class ExactRMSNorm(nn.Module):
    """nn.RMSNorm for fp32 inputs with mx.fast.rms_norm's CPU fallback arithmetic."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // max(x.shape[-1], 1)
        if rows > RMS_ROWS or x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        mean_sq = mx.mean(mx.square(x), -1, keepdims=True)
        return _normalize(x, mean_sq, mx.array(self.eps, mx.float32), self.weight)


def _twin(m: Any) -> Any:
    if type(m) is nn.RoPE:
        return ExactRoPE(m.dims, m.traditional, m.base, m.scale)
    if type(m) is nn.RMSNorm:
        twin = ExactRMSNorm(m.weight.shape[0], m.eps)
        twin.weight = m.weight
        return twin
    return None


def install(model: Any) -> int:
    """Replace every nn.RoPE and nn.RMSNorm held by `model` (its own instances, no class is
    touched) with the twins above; returns how many were replaced."""
    swaps = []
    for _, parent in model.named_modules():
        for key, child in parent.items():
            twin = _twin(child)
            if twin is not None:
                swaps.append((parent, key, twin))
    for parent, key, twin in swaps:
        parent[key] = twin
    return len(swaps)
