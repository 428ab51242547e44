"""CPU attention in one native node, bit for bit `mx.fast.scaled_dot_product_attention`.

On the CPU mlx always runs the fallback of fast.cpp (scale, matmul, mask, softmax, matmul) as
separate graph nodes, its softmax evaluating `exp` one element at a time. `sdpa` runs the same
arithmetic as one node of adaspec's native extension (kernels/native_attention.cpp) where that
is built and the routed kernel serves its GEMMs, and mlx's own function everywhere else: two
tiers, the same bits (tests/test_ops_attention.py, tests/test_native.py). `install` routes the
mlx-lm model modules a model is built from through it (kernels/fast_ops.py).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from . import blas, jit


def fold(rep: int, rows: int, k_len: int, head_dim: int) -> int:
    """How many of a KV head's `rep` query heads (each `rows` query rows) one GEMM may take as
    its rows with the same bits as one GEMM per query head: on the routed kernel, whose result
    for a row is the same whatever the number of rows within the rows it serves
    (blas.KERNEL_ROWS; for scores @ V also within the size of B it keeps on its non-transposed
    path), as many as fit in those rows; elsewhere 1."""
    if rows > blas.KERNEL_ROWS or k_len * head_dim > blas.NN_MAX_ELEMENTS or not blas.routed():
        return 1
    return max(1, min(rep, blas.KERNEL_ROWS // rows))


def enabled() -> bool:
    """The fast paths are on: the JIT wrapper is active (ADASPEC_FAST_OPS, Linux x86-64) and
    the default device is the CPU."""
    status = jit.status()
    return bool(status and status.active) and mx.default_device() == mx.cpu


def _masks(queries: mx.array, keys: mx.array, mask: Any) -> bool:
    if mask is None:
        return True
    if isinstance(mask, str):  # causal, with at least as many keys as query rows
        return mask == "causal" and queries.shape[-2] <= keys.shape[-2]
    return isinstance(mask, mx.array) and mask.ndim <= 4 and mask.dtype in (mx.bool_, mx.float32)


def native_core(queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> Any:
    """The native extension when it computes this call (fp32 arrays of rank 4 on the CPU, a
    mask it applies, the routed kernel, whose GEMMs it calls as mlx's Matmul does); else None."""
    if not all(a.dtype == mx.float32 and a.ndim == 4 for a in (queries, keys, values)):
        return None
    if not (_masks(queries, keys, mask) and enabled() and blas.routed()):
        return None
    from . import native

    return native.get()


def sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """mx.fast.scaled_dot_product_attention ([B, heads, L, D], GQA included; `mask` None,
    "causal", a bool array or an additive array), in one native node where `native_core`
    covers the call, else mlx's own."""
    core = native_core(queries, keys, values, mask)
    if core is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    n_q, n_kv, rows = queries.shape[1], keys.shape[1], queries.shape[2]
    heads = fold(n_q // n_kv, rows, keys.shape[-2], keys.shape[-1])
    array_mask = mask if isinstance(mask, mx.array) else None
    return core.attention_core(queries, keys, values, scale, mask == "causal", heads, array_mask)


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx_lm.models.base.scaled_dot_product_attention, running `sdpa`'s native node where it
    applies (no attention sinks, no quantized KV cache)."""
    if sinks is None and not hasattr(cache, "bits"):
        if native_core(queries, keys, values, mask) is not None:
            return sdpa(queries, keys, values, scale=scale, mask=mask)
    return _original()(queries, keys, values, cache, scale, mask, sinks)


def _original() -> Any:
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


_installed: list[str] = []


def installed() -> list[str]:
    """The mlx-lm model modules whose attention is routed here."""
    ours = scaled_dot_product_attention
    return [
        n
        for n in _installed
        if getattr(sys.modules.get(n), "scaled_dot_product_attention", None) is ours
    ]


def install(model: Any) -> list[str]:
    """Point the mlx-lm model modules `model` is built from at `scaled_dot_product_attention`
    above, where they call mlx-lm's (a module attribute: mlx-lm's own generate on any model of
    those architectures in this process takes the same path; it gives the same bits). Returns
    the modules changed; nothing when `enabled()` is false. `uninstall` puts mlx-lm's back."""
    if not enabled():
        return []
    original, changed = _original(), []
    for name in sorted({type(m).__module__ for m in _modules(model)}):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is original:
            vars(module)["scaled_dot_product_attention"] = scaled_dot_product_attention
            changed.append(name)
    _installed.extend(n for n in changed if n not in _installed)
    return changed


def uninstall() -> list[str]:
    """Give every module `install` changed mlx-lm's own function back; returns their names."""
    restored = installed()
    for name in restored:
        vars(sys.modules[name])["scaled_dot_product_attention"] = _original()
    _installed.clear()
    return restored


def _modules(model: Any) -> list[Any]:
    mods = getattr(model, "modules", None)
    return [model, *(mods() if callable(mods) else [])]
