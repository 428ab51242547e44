"""nn.RoPE, nn.RMSNorm and nn.Linear twins for the CPU: mlx's own arithmetic in fewer graph nodes.

On the CPU `mx.fast.rope` and `mx.fast.rms_norm` run their fallbacks (fast.cpp): about twenty
and seven small ops per call, each dispatched on its own, so at one token row their cost is
dispatch. These twins evaluate the same ops on the same values in fewer kernels (elementwise
chains fused by the JIT, which adds no contraction; kernels/jit.py), and RoPE's angles are
computed once per position range and shared by every layer. nn.Linear's `x @ weight.T` is four
nodes (transpose, flatten, matmul, unflatten); its twin is one, the same GEMM call. Every node
costs mlx a few microseconds to schedule whatever it computes (docs/fast_ops.md, "Cost").
Bits equal stock mlx (tests/test_ops_layers.py). `install` swaps the instances inside one model.
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
# (dims, base, scale, offset, rows) -> (cos, sin), shared by every twin of the same RoPE
_SHARED: OrderedDict[tuple, tuple[mx.array, mx.array]] = OrderedDict()
# RMSNorm up to RMS_ROWS rows: one kernel after the sum (rsqrt per element); up to
# RMS_MAX_ROWS: the rows' factors rsqrt(mean + eps) in one kernel, then x * factor * weight in
# another (a kernel broadcasting two operands with runtime strides falls behind mlx's separate
# ops as rows grow, docs/fast_ops.md); beyond: mx.fast.rms_norm. Same bits throughout.
RMS_ROWS = 3
RMS_MAX_ROWS = 32


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
        # plain attributes, not module state (no parameters, nothing saved)
        object.__setattr__(self, "_inv_freqs", inv_freqs)
        object.__setattr__(self, "_scale", mx.array(scale, mx.float32))
        object.__setattr__(self, "_key", (dims, float(base), float(scale)))

    def _fallback(self, x: mx.array, offset: Any) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
            offset=offset,
        )  # fmt: skip

    def _cos_sin(self, offset: int, n: int) -> tuple[mx.array, mx.array]:
        """The angles' cosines and sines at positions offset..offset+n-1, made once for all
        the model's layers (twins of equal dims, base and scale hold equal inverse
        frequencies, so they share them)."""
        key = (*self._key, offset, n)
        hit = _SHARED.get(key)
        if hit is None:
            pos = mx.arange(n, dtype=mx.float32)
            hit = _angles(pos, mx.array(offset, mx.int32), self._scale, self._inv_freqs)
            _SHARED[key] = hit
            if len(_SHARED) > _ANGLES:
                _SHARED.popitem(last=False)
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
def _normalize(
    x: mx.array, total: mx.array, inv_n: mx.array, eps: mx.array, weight: mx.array
) -> mx.array:
    """mean(x^2) as mx.mean forms it (the sum times float32(1 / n)), then fast.cpp's
    x * rsqrt(mean + eps) * weight, all in one kernel"""
    return x * mx.rsqrt(total * inv_n + eps) * weight


@partial(mx.compile, shapeless=True)
def _row_factor(total: mx.array, inv_n: mx.array, eps: mx.array) -> mx.array:
    """`_normalize`'s rsqrt(mean + eps), once per row"""
    return mx.rsqrt(total * inv_n + eps)


@partial(mx.compile, shapeless=True)
def _scale_rows(x: mx.array, factor: mx.array, weight: mx.array) -> mx.array:
    """`_normalize`'s products, given the rows' factors"""
    return x * factor * weight


def _rows(x: mx.array) -> int:
    return x.size // max(x.shape[-1], 1)


class ExactRMSNorm(nn.Module):
    """nn.RMSNorm for fp32 inputs with mx.fast.rms_norm's CPU fallback arithmetic."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        if not (
            _rows(x) <= RMS_MAX_ROWS and x.dtype == mx.float32 and self.weight.dtype == mx.float32
        ):
            return mx.fast.rms_norm(x, self.weight, self.eps)
        total = mx.sum(mx.square(x), -1, keepdims=True)
        inv_n, eps = self._constants(x.shape[-1])
        if _rows(x) <= RMS_ROWS:
            return _normalize(x, total, inv_n, eps, self.weight)
        return _scale_rows(x, _row_factor(total, inv_n, eps), self.weight)

    def _constants(self, n: int) -> tuple[mx.array, mx.array]:
        """(mx.mean's normalizer float32(1 / n), made from the double as mlx does; eps), kept"""
        hit = self.__dict__.get("_const")
        if hit is None or hit[0] != (n, self.eps):
            one_over_n, eps = mx.array(1.0 / n, mx.float32), mx.array(self.eps, mx.float32)
            hit = ((n, self.eps), one_over_n, eps)
            object.__setattr__(self, "_const", hit)  # not module state
        return hit[1], hit[2]


class ExactLinear(nn.Linear):
    """nn.Linear with the transposed weight made once (a view of the weight, no copy) and,
    for an fp32 batch of one, multiplied as a batch of one matrix: mlx's Matmul then makes the
    same BLAS call as nn.Linear's `x @ weight.T` (transpose, flatten, matmul, unflatten) in
    one node. A new weight (an update, a gradient's tracer) is transposed anew."""

    def _transposed(self) -> tuple[mx.array, mx.array, mx.array]:
        w = self["weight"]
        hit = self.__dict__.get("_t")
        if hit is None or hit[0] is not w:
            t = w.T
            hit = (w, t, mx.expand_dims(t, 0))
            object.__setattr__(self, "_t", hit)  # not module state
        return hit

    def __call__(self, x: mx.array) -> mx.array:
        _, t, t3 = self._transposed()
        if "bias" in self:
            return mx.addmm(self["bias"], x, t)
        if x.ndim == 3 and x.shape[0] == 1 and x.dtype == t.dtype == mx.float32:
            return x @ t3
        return x @ t


def stock(m: Any) -> Any:
    """The stock nn module a twin stands in for, holding the same arrays (None for anything
    else): what benchmarks and tests compare the twins against."""
    if isinstance(m, ExactRoPE):
        return nn.RoPE(m.dims, m.traditional, m.base, m.scale)
    ref: nn.Module
    if isinstance(m, ExactLinear):
        ref = nn.Linear(1, 1, bias="bias" in m)
    elif isinstance(m, ExactRMSNorm):
        ref = nn.RMSNorm(1, eps=m.eps)
    else:
        return None
    for key, value in m.items():
        ref[key] = value
    return ref


def _twin(m: Any) -> Any:
    if type(m) is nn.RoPE:
        return ExactRoPE(m.dims, m.traditional, m.base, m.scale)
    if type(m) is nn.RMSNorm:
        norm = ExactRMSNorm(m.weight.shape[0], m.eps)
        norm.weight = m.weight
        return norm
    if type(m) is nn.Linear:
        out_dims, in_dims = m.weight.shape
        linear = ExactLinear(in_dims, out_dims, bias="bias" in m)  # its own init stays lazy
        for key, value in m.items():  # the same arrays: nothing copied or converted
            linear[key] = value
        return linear
    return None


def install(model: Any) -> int:
    """Replace every nn.RoPE, nn.RMSNorm and nn.Linear held by `model` (its own instances, no
    class is touched) with the twins above; returns how many were replaced."""
    swaps = []
    for _, parent in model.named_modules():
        for key, child in parent.items():
            twin = _twin(child)
            if twin is not None:
                swaps.append((parent, key, twin))
    for parent, key, twin in swaps:
        parent[key] = twin
    return len(swaps)


def uninstall(model: Any) -> int:
    """Put the stock nn module back for every twin `install` placed in `model` (holding the
    same arrays); returns how many."""
    swaps = []
    for _, parent in model.named_modules():
        for key, child in parent.items():
            if isinstance(child, (ExactRoPE, ExactRMSNorm, ExactLinear)):
                swaps.append((parent, key, stock(child)))
    for parent, key, module in swaps:
        parent[key] = module
    return len(swaps)
