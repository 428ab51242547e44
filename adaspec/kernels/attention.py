"""CPU attention with a vectorized softmax, bit for bit `mx.fast.scaled_dot_product_attention`.

On the CPU mlx always runs the fallback of fast.cpp (scale, matmul, mask, softmax, matmul), and
its softmax evaluates `exp` one element at a time. `sdpa` is the same fallback with
kernels/softmax.py's softmax (the same arithmetic, `exp` vectorized). Tests in
tests/test_ops_attention.py prove equal bits; `install` routes mlx-lm's models through it.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from functools import partial
from typing import Any

import mlx.core as mx

from . import blas, jit
from .softmax import softmax


@partial(mx.compile, shapeless=True)
def _causal(scores: mx.array, q_idx: mx.array, k_idx: mx.array) -> mx.array:
    """fast.cpp's causal mask and `where` in one kernel (a mask computed, then selected)"""
    return mx.where(q_idx >= k_idx, scores, mx.array(mx.finfo(mx.float32).min, mx.float32))


@partial(mx.compile, shapeless=True)
def _scaled(scale: mx.array, x: mx.array) -> mx.array:
    """fast.cpp's `multiply(array(scale), queries)` in one node (no broadcast node)"""
    return scale * x


_INDICES = 4  # causal masks' position pairs kept: every layer of a forward shares one
_index_cache: OrderedDict[tuple[int, int, int], tuple[mx.array, mx.array]] = OrderedDict()


def _causal_indices(q_len: int, k_len: int, rep: int) -> tuple[mx.array, mx.array]:
    """fast.cpp's causal positions: query rows offset..offset+q_len-1 (repeated `rep` times
    for the query heads folded into rows), keys 0..k_len-1; made once per forward shape"""
    key = (q_len, k_len, rep)
    hit = _index_cache.get(key)
    if hit is None:
        offset = k_len - q_len
        rows = mx.arange(offset, q_len + offset)
        hit = ((mx.tile(rows, rep) if rep > 1 else rows)[:, None], mx.arange(0, k_len)[None])
        _index_cache[key] = hit
        if len(_index_cache) > _INDICES:
            _index_cache.popitem(last=False)
    return hit


def sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """fast.cpp's CPU fallback for fp32 inputs of rank 4 ([B, heads, L, D]), GQA included,
    with `softmax` above; `mask` None, "causal", a bool array or an additive array. With
    no mask or the causal one on the routed kernel, the same arithmetic in one graph node
    (kernels/native.py) when that extension is built."""
    n_q, n_kv, q_len = queries.shape[1], keys.shape[1], queries.shape[2]
    core = _native(queries, keys, mask)
    if core is not None:
        fold = n_q > n_kv and _folds(n_q // n_kv * q_len, keys)
        return core.attention_core(queries, keys, values, scale, mask == "causal", fold)
    q = _scaled(mx.array(scale, queries.dtype), queries)
    k, v, rep = keys, values, n_q // n_kv
    fold = rep > 1 and _folds(rep * q_len, keys)
    if fold:  # the query heads of a KV head as rows of one GEMM: K and V read once, not copied
        q = mx.reshape(q, (q.shape[0], n_kv, rep * q_len, q.shape[-1]))
    elif rep > 1:
        q = mx.unflatten(q, 1, (n_kv, rep))
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    # an array mask is laid out by query head: the folded rows are unfolded to meet it
    unfold = fold and isinstance(mask, mx.array)
    if unfold:
        scores = mx.unflatten(scores, 2, (rep, q_len))
    if isinstance(mask, str):
        q_idx, k_idx = _causal_indices(q_len, scores.shape[-1], rep if fold else 1)
        scores = _causal(scores, q_idx, k_idx)
    elif mask is not None:
        m = mx.broadcast_to(mask, (*queries.shape[:-1], keys.shape[-2]))
        if rep > 1:
            m = mx.unflatten(m, -3, (n_kv, rep))
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + m
    probs = softmax(scores)
    if fold:
        out = (mx.flatten(probs, 2, 3) if unfold else probs) @ v
        return mx.reshape(out, queries.shape[:-1] + (values.shape[-1],))
    out = probs @ v
    return mx.flatten(out, 1, 2) if rep > 1 else out


def _native(queries: mx.array, keys: mx.array, mask: Any) -> Any:
    """The native extension when it covers this call (no mask, or causal with at least as
    many keys as query rows; the routed kernel, whose GEMMs it calls as mlx's Matmul does)."""
    if not (mask is None or (isinstance(mask, str) and queries.shape[-2] <= keys.shape[-2])):
        return None
    if not blas.routed():
        return None
    from . import native

    return native.get()


def _folds(rows: int, keys: mx.array) -> bool:
    return folds(rows, keys.shape[-2], keys.shape[-1])


def folds(rows: int, k_len: int, head_dim: int) -> bool:
    """Whether a GQA call may run its query heads as the rows of one GEMM per KV head with the
    same bits as one GEMM per query head: only on the routed kernel, whose result for a row is
    the same whatever the number of rows, within the rows it serves (blas.KERNEL_ROWS; for
    scores @ V also within the size of B it keeps on its non-transposed path)."""
    return rows <= blas.KERNEL_ROWS and k_len * head_dim <= blas.NN_MAX_ELEMENTS and blas.routed()


def attend(
    q: mx.array, keys: mx.array, values: mx.array, causal: tuple[int, int] | None = None
) -> mx.array:
    """`sdpa`'s steps after the scale and the fold (q: [B, KV heads, rep x rows, D], rep query
    heads per KV head, rep = 1 for MHA) with no mask or, given causal = (rows, rep), the
    causal mask: softmax(q @ K^T) @ V"""
    scores = q @ mx.swapaxes(keys, -1, -2)
    if causal is not None:
        q_idx, k_idx = _causal_indices(causal[0], scores.shape[-1], causal[1])
        scores = _causal(scores, q_idx, k_idx)
    return softmax(scores) @ values


# below this many scores per head (query rows x keys) mlx's one softmax op beats four cheaper
# ones (benchmarks/attention_ab.py); both give the same bits, so the choice is speed alone
MIN_SCORES = 128


def pays(queries: mx.array, keys: mx.array) -> bool:
    return queries.shape[-2] * keys.shape[-2] >= MIN_SCORES


def handles(queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> bool:
    """Whether `sdpa` covers this call (else mlx's own kernel runs): fp32, rank 4, CPU,
    and a mask it knows."""
    if not all(a.dtype == mx.float32 and a.ndim == 4 for a in (queries, keys, values)):
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    if isinstance(mask, mx.array) and (mask.ndim > 4 or mask.dtype not in (mx.bool_, mx.float32)):
        return False
    return mx.default_device() == mx.cpu


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx_lm.models.base.scaled_dot_product_attention, running `sdpa` where it applies."""
    if (
        sinks is None
        and not hasattr(cache, "bits")
        and (pays(queries, keys) or _native(queries, keys, mask) is not None)
        and handles(queries, keys, values, mask)
    ):
        return sdpa(queries, keys, values, scale=scale, mask=mask)
    return _original()(queries, keys, values, cache, scale, mask, sinks)


def fast_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """mx.fast.scaled_dot_product_attention, running `sdpa` where `enabled()` and it applies
    (for models of our own, such as the DFlash drafter)."""
    if (
        enabled()
        and (pays(queries, keys) or _native(queries, keys, mask) is not None)
        and handles(queries, keys, values, mask)
    ):
        return sdpa(queries, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _original() -> Any:
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def enabled() -> bool:
    """The fast path is on: the JIT wrapper is active (ADASPEC_FAST_OPS, Linux x86-64) and
    the default device is the CPU."""
    status = jit.status()
    return bool(status and status.active) and mx.default_device() == mx.cpu


_installed: list[str] = []


def installed() -> list[str]:
    """The mlx-lm model modules routed here."""
    ours = scaled_dot_product_attention
    return [
        n
        for n in _installed
        if getattr(sys.modules.get(n), "scaled_dot_product_attention", None) is ours
    ]


def install(model: Any) -> list[str]:
    """Point the mlx-lm model modules `model` is built from at `scaled_dot_product_attention`
    above, where they call mlx-lm's (a module attribute, so mlx-lm's own generate on any model
    of those architectures takes the same path; it gives the same bits). Returns the modules
    changed; nothing when `enabled()` is false."""
    if not enabled():
        return []
    original, changed = _original(), []
    for name in sorted({type(m).__module__ for m in _modules(model)}):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is original:
            vars(module)["scaled_dot_product_attention"] = scaled_dot_product_attention
            changed.append(name)
    _installed.extend(changed)
    return changed


def _modules(model: Any) -> list[Any]:
    mods = getattr(model, "modules", None)
    return [model, *(mods() if callable(mods) else [])]
