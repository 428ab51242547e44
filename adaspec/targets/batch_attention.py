"""One attention layer over the rows of several sequences in few graph nodes, each sequence's
rows bit for bit what its solo forward computes.

A solo forward's attention (mlx-lm's Attention on the RoPE twin and kernels/attention.sdpa)
is about thirty graph nodes, and on the CPU mlx spends microseconds scheduling each one,
whatever it computes. Here everything that is per row runs once over all rows: the q/k/v
reshapes and transposes, RoPE (one table of angles for every row, made once per forward from
each sequence's own angles), the query scale, the split into sequences (one node) and the
output's reshape. Per sequence remain only its KV cache update and the attention core:
scores, causal mask, softmax, times V, with the query heads of a KV head folded into the
rows of one GEMM as sdpa folds them. Every op is elementwise or a GEMM row whose result the
routed kernel makes independent of the number of rows, so the bits are the solo path's
(tests/test_batch_forward.py proves it against solo forwards).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx

from ..errors import TargetError
from ..kernels import blas, native_layers
from ..kernels.layers import ExactRoPE
from ..kernels.softmax import softmax


@partial(mx.compile, shapeless=True)
def _rotate(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array):
    """ExactRoPE's rotation (kernels/layers.py), the same ops on the same values"""
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@partial(mx.compile, shapeless=True)
def _scaled(scale: mx.array, x: mx.array) -> mx.array:
    """sdpa's query scale (kernels/attention.py): fast.cpp's `multiply(array(scale), q)`"""
    return scale * x


@partial(mx.compile, shapeless=True)
def _causal(scores: mx.array, q_idx: mx.array, k_idx: mx.array) -> mx.array:
    """sdpa's causal mask: fast.cpp's mask and `where` in one kernel"""
    return mx.where(q_idx >= k_idx, scores, mx.array(mx.finfo(mx.float32).min, mx.float32))


@dataclass
class RowPlan:
    """What every layer of one batched forward shares: each sequence's rows and cache offset,
    RoPE's angles for all rows and each sequence's causal positions."""

    spans: list[tuple[int, int]]  # (first row, rows) per sequence
    offsets: list[int]  # each sequence's cache offset before this forward
    cos: mx.array  # [rows, dims / 2]: row r's angles, at its own sequence's position
    sin: mx.array
    causal: list[tuple[mx.array, mx.array] | None]  # (query, key) positions; None: one row
    rep: int  # query heads per KV head
    # by (KV heads, head dims): which sequences fold, the row orders between layouts
    folds: dict[tuple[int, int], _Folds] = field(default_factory=dict)


@dataclass(frozen=True)
class _Folds:
    """Which sequences run the folded core, and (when all do, and there are several) the
    query rows' order for all of them at once: `gather` takes [1, kv, rep * rows, d] (query
    head r of row j at r * rows + j) to each sequence's folded block in turn (sequence i's
    head r, row l at rep * first_i + r * n_i + l); `scatter` takes them back. Both are
    take_along_axis indices of that full shape: one graph node each."""

    each: list[bool]
    gather: mx.array | None = None
    scatter: mx.array | None = None


def _fold_plan(p: RowPlan, kv: int, d: int) -> _Folds:
    each = [p.rep == 1 or _folds(p.rep * n, o + n, d) for o, (_, n) in zip(p.offsets, p.spans)]
    if p.rep == 1 or len(p.spans) == 1 or not all(each):
        return _Folds(each)
    m = sum(n for _, n in p.spans)
    order = [r * m + s + j for s, n in p.spans for r in range(p.rep) for j in range(n)]
    back = [0] * len(order)
    for i, src in enumerate(order):
        back[src] = i
    shape = (1, kv, len(order), d)
    idx = [
        mx.broadcast_to(mx.array(o, mx.int32)[None, None, :, None], shape) for o in (order, back)
    ]
    return _Folds(each, *idx)


def _positions(offset: int, n: int, rep: int) -> tuple[mx.array, mx.array]:
    """sdpa's causal positions: query rows offset..offset+n-1 (tiled over the query heads
    folded into rows), keys 0..offset+n-1"""
    rows = mx.arange(offset, offset + n)
    return (mx.tile(rows, rep) if rep > 1 else rows)[:, None], mx.arange(0, offset + n)[None]


def _folds(rows: int, keys: int, dims: int) -> bool:
    """sdpa's condition for folding the query heads into the rows of one GEMM (the routed
    kernel gives a row the same bits whatever the rows; scores @ V stays on its kernel)"""
    return rows <= blas.KERNEL_ROWS and keys * dims <= blas.NN_MAX_ELEMENTS and blas.routed()


def unsupported(attn: Any, caches: list[Any]) -> str:
    """Why this layer's attention cannot take the shared path ("" when it can); the caller
    then runs mlx-lm's attention once per sequence."""
    from mlx_lm.models.cache import KVCache

    rope = getattr(attn, "rope", None)
    if type(rope) is not ExactRoPE or rope.traditional or not hasattr(rope, "_cos_sin"):
        return f"RoPE {type(rope).__name__} (accepted: ExactRoPE, not traditional)"
    if not blas.routed():
        return "the routed GEMM kernel is not loaded"
    if any(type(c) is not KVCache for c in caches):
        return "a cache is not a plain KVCache"
    if not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "scale")):
        return f"{type(attn).__name__} lacks n_heads, n_kv_heads or scale"
    proj = attn.q_proj
    dtype = proj["scales"].dtype if "scales" in proj else proj["weight"].dtype
    if dtype != mx.float32:  # ExactRoPE and sdpa take their fp32 arithmetic only
        return f"q_proj computes in {dtype} (accepted: float32)"
    return ""


def plan(attn: Any, spans: list[tuple[int, int]], offsets: list[int]) -> RowPlan:
    """The shared part of a batched forward, from its first layer's attention."""
    rope: ExactRoPE = attn.rope
    angles = [rope._cos_sin(o, n) for o, (_, n) in zip(offsets, spans)]
    cos = mx.concatenate([c for c, _ in angles]) if len(angles) > 1 else angles[0][0]
    sin = mx.concatenate([s for _, s in angles]) if len(angles) > 1 else angles[0][1]
    rep = attn.n_heads // attn.n_kv_heads
    causal = [None if n == 1 else _positions(o, n, rep) for o, (_, n) in zip(offsets, spans)]
    return RowPlan(spans, offsets, cos, sin, causal, rep)


def _rope(x: mx.array, rope: ExactRoPE, p: RowPlan) -> mx.array:
    """ExactRoPE over [1, heads, rows, dims], each row at its own sequence's position"""
    half = rope.dims // 2
    if rope.dims == x.shape[-1]:
        x1, x2 = mx.split(x, [half], -1)
        return mx.concatenate(_rotate(x1, x2, p.cos, p.sin), -1)
    outs = list(_rotate(x[..., :half], x[..., half : rope.dims], p.cos, p.sin))
    return mx.concatenate([*outs, x[..., rope.dims :]], -1)


def _heads(attn: Any, x: mx.array, p: RowPlan) -> tuple[mx.array, mx.array, mx.array]:
    """queries, keys, values of all rows as [1, heads, rows, head_dim], RoPE applied"""
    _, m, _ = x.shape
    q = attn.q_proj(x).reshape(1, m, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(1, m, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(1, m, attn.n_kv_heads, -1)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    if k_norm is not None:
        k = k_norm(k)
    q, k, v = (mx.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))
    return _rope(q, attn.rope, p), _rope(k, attn.rope, p), v


def _core(q: mx.array, keys: mx.array, values: mx.array, causal: Any, rep: int) -> mx.array:
    """sdpa's folded path for one sequence: scaled queries [1, kv, rep * n, d] (query head r
    of row l at r * n + l) -> [1, kv, rep * n, d]"""
    scores = q @ mx.swapaxes(keys, -1, -2)
    if causal is not None:
        scores = _causal(scores, *causal)
    return softmax(scores) @ values


def _fold(q: mx.array, rep: int) -> mx.array:
    return mx.reshape(q, (1, q.shape[1] // rep, rep * q.shape[2], q.shape[3])) if rep > 1 else q


def _unfold(out: mx.array, rep: int) -> mx.array:
    """[1, kv, rep * n, d] -> [1, kv * rep, n, d]"""
    return mx.reshape(out, (1, out.shape[1] * rep, -1, out.shape[3])) if rep > 1 else out


def _queries(qs: mx.array, p: RowPlan, f: _Folds) -> list[mx.array]:
    """each sequence's scaled queries, folded: one gather and one split for all when
    `f.gather` says how, else a split and a fold per sequence"""
    cuts = [s for s, _ in p.spans[1:]]
    if f.gather is None:
        parts = mx.split(qs, cuts, axis=2) if cuts else [qs]
        return [_fold(q, p.rep) if ok else q for q, ok in zip(parts, f.each)]
    _, h, m, d = qs.shape
    rows = mx.take_along_axis(mx.reshape(qs, (1, h // p.rep, p.rep * m, d)), f.gather, axis=2)
    # mlx's stub types split() as returning one array; it returns a list of them
    return mx.split(rows, [p.rep * s for s in cuts], axis=2)  # type: ignore[return-value]


def _outputs(outs: list[mx.array], p: RowPlan, f: _Folds) -> mx.array:
    """the sequences' attention outputs as [1, rows, heads * d], o_proj's input"""
    if f.scatter is None:  # set together with f.gather
        outs = [_unfold(o, p.rep) if ok else o for o, ok in zip(outs, f.each)]
        out = mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    else:
        out = mx.take_along_axis(mx.concatenate(outs, axis=2), f.scatter, axis=2)
        out = _unfold(out, p.rep)
    _, h, m, d = out.shape
    return mx.transpose(out, (0, 2, 1, 3)).reshape(1, m, h * d)


def _module_sdpa(attn: Any) -> Any:
    """the attention function of the mlx-lm module attn's class comes from (a twin subclass
    of adaspec's lives elsewhere: its first base with one)"""
    for cls in type(attn).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "scaled_dot_product_attention", None)
        if fn is not None:
            return fn
    raise TargetError(f"{type(attn).__name__}: no mlx-lm module with scaled_dot_product_attention")


def attend(attn: Any, x: mx.array, caches: list[Any], p: RowPlan) -> mx.array:
    """attn over x's rows [1, rows, hidden], sequence i's rows against caches[i]; o_proj's
    output for all rows. A sequence whose attention sdpa would not fold (a long context, a
    query wider than the kernel's rows) runs the model module's own attention function."""
    if x.dtype != mx.float32:
        raise TargetError(f"batched attention got {x.dtype} rows; accepted: float32")
    for i, c in enumerate(caches):
        if c.offset != p.offsets[i]:
            raise TargetError(f"cache offset {c.offset} != the plan's {p.offsets[i]}")
    # the whole layer in two native nodes where the extension is built and every cache has
    # room (kernels/native_layers.py); else the mlx ops below
    out = native_layers.attend_rows(attn, x, caches, [n for _, n in p.spans], p.cos, p.sin)
    if out is not None:
        return out
    q, k, v = _heads(attn, x, p)
    kv, d = k.shape[1], q.shape[-1]
    f = p.folds.get((kv, d)) or p.folds.setdefault((kv, d), _fold_plan(p, kv, d))
    qs = _queries(_scaled(mx.array(attn.scale, q.dtype), q), p, f)
    cuts = [s for s, _ in p.spans[1:]]
    ks, vs = (mx.split(a, cuts, axis=2) if cuts else [a] for a in (k, v))
    q_parts = (mx.split(q, cuts, axis=2) if cuts else [q]) if not all(f.each) else None
    outs = []
    for i, ((_, n), c) in enumerate(zip(p.spans, caches)):
        if c.offset != p.offsets[i]:
            raise TargetError(f"cache offset {c.offset} != the plan's {p.offsets[i]}")
        keys, values = c.update_and_fetch(ks[i], vs[i])
        if f.each[i]:
            outs.append(_core(qs[i], keys, values, p.causal[i], p.rep))
        else:
            assert q_parts is not None  # a sequence that does not fold: split above
            mask = None if n == 1 else "causal"
            sdpa = _module_sdpa(attn)
            outs.append(sdpa(q_parts[i], keys, values, cache=c, scale=attn.scale, mask=mask))
    return attn.o_proj(_outputs(outs, p, f))
