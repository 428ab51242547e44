"""Twins of mlx-lm's Llama and Qwen2 attention and decoder block: their arithmetic in fewer nodes.

mlx schedules every graph node on Python's thread, a few microseconds each whatever it computes
(docs/fast_ops.md, "Cost"), and at one token row that is most of a forward's time outside the
GEMMs. mlx-lm's attention at one row spends 36 nodes per layer, many of them views: a reshape
and a transpose per projection, RoPE's two slices, two kernels and a concatenation per call,
the query scale, the fold of the query heads, and a transpose and two reshapes back. The twin of
one decoding row (`DecodeAttention`) views each projection's heads as [..., 2, D/2] halves
(one reshape, one split), rotates them in one compiled kernel that also applies the query scale
and writes both halves, and reshapes the result straight into the layout `attention.sdpa` folds
to and back into o_proj's input: 25 nodes. The block twin (`FusedBlock`) forms the residual sum
and its square (the post-attention RMSNorm's first op) in one kernel. Every op sees the values
stock mlx's op sees, so the bits are stock mlx's (tests/test_ops_blocks.py).

`install` changes the class of each instance of the covered mlx-lm classes to a subclass whose
`__call__` takes the short path where it applies (one token row, fp32 projections, an
`ExactRoPE` over the full head, a plain `KVCache`, no mask, attention routed to
`attention.sdpa` and folding there) and calls mlx-lm's own `__call__` otherwise; `uninstall`
restores the classes. No mlx-lm class or module attribute is changed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from . import attention, layers, native_layers

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache

# mlx-lm modules whose Attention and TransformerBlock have the code the twins reproduce
COVERED = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")

_first: list[mx.array] = []  # [[True], [False]]: selects the first half's formula


def _first_half() -> mx.array:
    if not _first:
        _first.append(mx.array([[True], [False]]))
    return _first[0]


@partial(mx.compile, shapeless=True)
def _rope(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array, first: mx.array):
    """ExactRoPE's `x1 * cos - x2 * sin`, `x1 * sin + x2 * cos`, written to one [..., 2, D/2]"""
    return mx.where(first, x1 * cos - x2 * sin, x1 * sin + x2 * cos)


@partial(mx.compile, shapeless=True)
def _rope_scaled(x1, x2, cos, sin, first, scale):
    """the same, then sdpa's query scale (`scale * q`)"""
    return scale * mx.where(first, x1 * cos - x2 * sin, x1 * sin + x2 * cos)


@partial(mx.compile, shapeless=True)
def _add_square(x: mx.array, r: mx.array) -> tuple[mx.array, mx.array]:
    """the residual `x + r` and its square, RMSNorm's first op, in one kernel"""
    h = x + r
    return h, mx.square(h)


def _kv_cache() -> type[KVCache]:
    from mlx_lm.models.cache import KVCache

    return KVCache


def _decodes(attn: Any, x: mx.array, mask: Any, cache: Any) -> bool:
    """Whether `DecodeAttention` may take a short path, before the projections: rows with no
    mask or the causal one, through an ExactRoPE over the whole head (D = its dims, checked
    against the projections by `_projects`), on a plain KVCache, on the CPU, with mlx-lm's
    attention routed to `attention.scaled_dot_product_attention`."""
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return False
    if x.ndim != 3 or type(cache) is not _kv_cache() or type(cache.offset) is not int:
        return False
    rope = attn.rope
    if type(rope) is not layers.ExactRoPE or rope.traditional or rope.dims % 2:
        return False
    home = sys.modules.get(type(attn).__bases__[1].__module__)
    routed = getattr(home, "scaled_dot_product_attention", None)
    return routed is attention.scaled_dot_product_attention and mx.default_device() == mx.cpu


def _native(x: mx.array) -> Any:
    """the native extension where attention uses it (`attention._native`, which benchmarks
    may switch off; with no mask it looks at nothing but the routed kernel and the build)"""
    return attention._native(x, x, None)


def _folds_in_ops(attn: Any, rows: int, cache: Any) -> bool:
    """sdpa's mlx-op path (no native extension) that the short path reproduces: past
    MIN_SCORES and, with GQA, the query heads folded into rows"""
    k_len, rep = cache.offset + rows, attn.n_heads // attn.n_kv_heads
    return rows * k_len >= attention.MIN_SCORES and (
        rep == 1 or attention.folds(rep * rows, k_len, attn.rope.dims)
    )


def _plain(m: Any) -> bool:
    """a Linear whose fp32 weight (and bias) the native `linears` takes as nn.Linear does"""
    if type(m) not in (nn.Linear, layers.ExactLinear):
        return False
    w, b = m.get("weight"), m.get("bias")
    return (
        w is not None
        and w.dtype == mx.float32
        and w.ndim == 2
        and (b is None or (b.dtype == mx.float32 and b.ndim == 1))
    )


def _project(attn: Any, x: mx.array, core: Any) -> list[mx.array]:
    """q, k and v: in one native node (each projection through the BLAS call nn.Linear's
    Matmul or AddMM makes) where that applies, else the projections' own calls"""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    if core is not None and x.shape[0] == 1 and x.dtype == mx.float32 and all(map(_plain, projs)):
        return core.linears(x, [p["weight"] for p in projs], [p.get("bias") for p in projs])
    return [p(x) for p in projs]


def _projects(attn: Any, q: mx.array, k: mx.array, v: mx.array) -> bool:
    """the projections are fp32 (sdpa's fast path) and their heads are RoPE's dims wide"""
    d = attn.rope.dims
    return (
        q.dtype == k.dtype == v.dtype == mx.float32
        and q.shape[-1] == attn.n_heads * d
        and k.shape[-1] == v.shape[-1] == attn.n_kv_heads * d
    )


def _heads(x: mx.array, heads: int, half: int) -> mx.array:
    """a projection [B, L, heads * D] as [B, heads, L, 2, D/2] (the transpose of mlx-lm's
    reshape, with D split in its halves)"""
    b, rows = x.shape[:2]
    if rows == 1:
        return mx.reshape(x, (b, heads, 1, 2, half))
    return mx.transpose(mx.reshape(x, (b, rows, heads, 2, half)), (0, 2, 1, 3, 4))


def _values(v: mx.array, heads: int, d: int) -> mx.array:
    """mlx-lm's values layout [B, heads, L, D] (at one row a reshape alone)"""
    b, rows = v.shape[:2]
    if rows == 1:
        return mx.reshape(v, (b, heads, 1, d))
    return mx.swapaxes(mx.reshape(v, (b, rows, heads, d)), 1, 2)


class DecodeAttention:
    """mlx-lm's Llama / Qwen2 Attention.__call__ in fewer nodes where `_decodes` and
    `_projects` accept the call: with the native extension (kernels/native.py) the
    projections in one node and attention in one node laid out for o_proj; without it,
    sdpa's mlx ops where they fold."""

    # set by the mlx-lm Attention this mixes into
    n_heads: int
    n_kv_heads: int
    scale: float
    rope: Any  # nn.RoPE, or its ExactRoPE twin (`_decodes` admits the short path with that)
    o_proj: Callable[[mx.array], mx.array]

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if _decodes(self, x, mask, cache):
            core = _native(x)
            if core is not None or _folds_in_ops(self, x.shape[1], cache):
                q, k, v = _project(self, x, core)
                if _projects(self, q, k, v):
                    return self._attend(q, k, v, mask, cache, core)
        return super().__call__(x, mask, cache)  # type: ignore[misc]

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Any, cache: Any, core: Any):
        (b, rows, _), n_q, n_kv = q.shape, self.n_heads, self.n_kv_heads
        d, rep = self.rope.dims, n_q // n_kv
        cos, sin = self.rope.cos_sin_by_row(cache.offset, rows)  # [L, 1, D/2]
        first = _first_half()
        k1, k2 = mx.split(_heads(k, n_kv, d // 2), 2, axis=-2)
        k = mx.reshape(_rope(k1, k2, cos, sin, first), (b, n_kv, rows, d))
        keys, values = cache.update_and_fetch(k, _values(v, n_kv, d))
        q1, q2 = mx.split(_heads(q, n_q, d // 2), 2, axis=-2)
        causal = mask is not None
        if core is not None:  # sdpa's native call, the query scale inside it
            q = mx.reshape(_rope(q1, q2, cos, sin, first), (b, n_q, rows, d))
            fold = rep > 1 and attention.folds(rep * rows, keys.shape[-2], d)
            if b == 1 and causal == (rows > 1):  # attention_rows: causal exactly when rows > 1
                out = core.attention_rows(q, [keys], [values], [rows], [fold], self.scale)
                return self.o_proj(out)
            out = core.attention_core(q, keys, values, self.scale, causal, fold)
        else:  # sdpa's fold: a KV head's query heads as rows (rep == 1: MHA)
            q = _rope_scaled(q1, q2, cos, sin, first, self._scale_array())
            q = mx.reshape(q, (b, n_kv, rep * rows, d))
            out = attention.attend(q, keys, values, (rows, rep) if causal else None)
        if rows > 1:
            out = mx.swapaxes(mx.reshape(out, (b, n_q, rows, d)), 1, 2)
        return self.o_proj(mx.reshape(out, (b, rows, n_q * d)))

    def _scale_array(self) -> mx.array:
        """sdpa's `mx.array(scale, float32)`, kept (not module state)"""
        hit = self.__dict__.get("_scale_fp32")
        if hit is None or hit[0] != self.scale:
            hit = (self.scale, mx.array(self.scale, mx.float32))
            object.__setattr__(self, "_scale_fp32", hit)
        return hit[1]


class FusedBlock:
    """mlx-lm's Llama / Qwen2 TransformerBlock.__call__ with the first residual sum and its
    square in one kernel, where the post-attention norm is an ExactRMSNorm that fuses."""

    # set by the mlx-lm TransformerBlock this mixes into
    self_attn: Callable[[mx.array, Any, Any], mx.array]
    input_layernorm: Callable[[mx.array], mx.array]
    post_attention_layernorm: nn.Module
    mlp: Callable[[mx.array], mx.array]

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        out = native_layers.decode_layer(self, x, mask, cache)
        if out is not None:  # the whole layer in one native node
            return out
        norm = self.post_attention_layernorm
        if not (isinstance(norm, layers.ExactRMSNorm) and norm.fuses(x)):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h, square = _add_square(x, r)
        r = self.mlp(norm.from_square(h, square))
        out, square = _add_square(h, r)
        layers.keep_square(out, square)  # the next block's (or the model's) RMSNorm takes it
        return out


_TWINS: dict[type, type] = {}


def _twin_class(cls: type) -> type | None:
    """the twin subclass of a covered mlx-lm class, made once"""
    if cls.__module__ not in COVERED or cls.__name__ not in ("Attention", "TransformerBlock"):
        return None
    twin = _TWINS.get(cls)
    if twin is None:
        mixin = DecodeAttention if cls.__name__ == "Attention" else FusedBlock
        twin = type(cls.__name__, (mixin, cls), {"__module__": __name__})
        _TWINS[cls] = twin
    return twin


def install(model: Any) -> int:
    """Give each covered Attention and TransformerBlock instance of `model` its twin class;
    returns how many changed."""
    n = 0
    for _, m in model.named_modules():
        twin = _twin_class(type(m))
        if twin is not None:
            m.__class__ = twin
            n += 1
    return n


def uninstall(model: Any) -> int:
    """Give the instances `install` changed their mlx-lm class back; returns how many."""
    stock = {v: k for k, v in _TWINS.items()}
    n = 0
    for _, m in model.named_modules():
        if type(m) in stock:
            m.__class__ = stock[type(m)]
            n += 1
    return n
