"""One forward over several sequences' token rows, each against its own KV cache.

The rows of every sequence are laid side by side as one sequence of M rows: embeddings,
norms, the q/k/v/o projections, the MLP and the head run once over all M rows (the costly
part: it streams the weights), while attention runs per sequence, on its own rows against its
own cache, exactly as a forward of that sequence alone would: where the native extension runs
a llama / qwen2 layer, the whole layer in one node for all sequences
(kernels/native_layers.layer_rows); else, with the layer twins on the routed kernel, the
attention of all sequences in two native nodes (native_layers.attend_rows); else (no native
extension, a cache without room for its rows) through mlx-lm's attention module per sequence.
With the routed small-M kernel a GEMM row's result is the same for every M up to its row
limit, so each sequence's logits equal its solo forward's bit for bit while M stays within
`MAX_ROWS`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..errors import TargetError
from ..kernels import blas, native_fit, native_layers
from ..kernels.layers import ExactRoPE
from .base import Forward, layer_list, layer_output, model_type, spying
from .kv import KVTarget

MAX_ROWS = 32  # the routed kernel's row limit (kernels/blas.py KERNEL_ROWS): exact up to here
# model types whose decoder computes one mask from a layer's cache and passes it to every
# attention layer, which reads q_proj, k_proj, v_proj and o_proj once each
BATCHABLE = ("llama", "qwen2", "qwen3", "mistral")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
# hand each layer's attention output to mlx's stream as it is built (off: the forward stays one
# lazy graph, as counting its nodes needs)
EVAL_EACH_LAYER = True


def batch_unsupported(target: Any) -> str:
    """Why `target` cannot share a batched forward ("" when it can)."""
    if not isinstance(target, KVTarget):
        return f"{type(target).__name__} (accepted: KVTarget, caches all trimmable)"
    kind = model_type(target.model)
    if kind not in BATCHABLE:
        return f"model type {kind!r} (accepted: {', '.join(BATCHABLE)})"
    for i, layer in enumerate(layer_list(target.model)):
        attn = getattr(layer, "self_attn", None)
        if attn is None or any(getattr(attn, p, None) is None for p in PROJ):
            return f"layer {i} has no self_attn with {', '.join(PROJ)}"
        if getattr(layer, "use_sliding", False):
            return f"layer {i} uses a sliding window"
    return ""


class _Rows:
    """Stands in for a projection whose output over all rows was computed already."""

    def __init__(self, out: mx.array):
        self.out = out

    def __call__(self, x: mx.array) -> mx.array:
        return self.out


def _identity(x: mx.array) -> mx.array:
    return x


class _SplitAttention:
    """One layer's attention over the rows of several sequences: the projections once over
    all rows, the attention itself per sequence with that sequence's cache of this layer."""

    def __init__(self, attn: Any, caches: list[Any], spans: list[tuple[int, int]]):
        self.attn, self.caches, self.spans = attn, caches, spans

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        a = self.attn
        q, k, v, o_proj = a.q_proj(x), a.k_proj(x), a.v_proj(x), a.o_proj
        outs = []
        saved = [a[p] for p in PROJ]
        try:
            a["o_proj"] = _identity
            for (s, n), c in zip(self.spans, self.caches):
                a["q_proj"], a["k_proj"], a["v_proj"] = (
                    _Rows(q[:, s : s + n]),
                    _Rows(k[:, s : s + n]),
                    _Rows(v[:, s : s + n]),
                )
                xs = x[:, s : s + n]
                outs.append(a(xs, create_attention_mask(xs, c), c))
        finally:
            for p, m in zip(PROJ, saved):
                a[p] = m
        return o_proj(mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0])


@dataclass
class RowPlan:
    """What every layer of one batched forward shares: each sequence's rows and cache offset,
    and RoPE's angles for all rows (row r's at its own sequence's position)."""

    spans: list[tuple[int, int]]  # (first row, rows) per sequence
    offsets: list[int]  # each sequence's cache offset before this forward
    cos: mx.array  # [rows, dims / 2]
    sin: mx.array


def row_plan(attn: Any, spans: list[tuple[int, int]], offsets: list[int]) -> RowPlan:
    """The shared part of a batched forward, from its first layer's attention."""
    rope: ExactRoPE = attn.rope
    angles = [rope._cos_sin(o, n) for o, (_, n) in zip(offsets, spans)]
    cos = mx.concatenate([c for c, _ in angles]) if len(angles) > 1 else angles[0][0]
    sin = mx.concatenate([s for _, s in angles]) if len(angles) > 1 else angles[0][1]
    return RowPlan(spans, offsets, cos, sin)


def unsupported(attn: Any, caches: list[Any]) -> str:
    """Why this layer's attention cannot take the native nodes ("" when it can); the caller
    then runs mlx-lm's attention once per sequence."""
    from mlx_lm.models.cache import KVCache

    rope = getattr(attn, "rope", None)
    if type(rope) is not ExactRoPE or rope.traditional:
        return f"RoPE {type(rope).__name__} (accepted: ExactRoPE, not traditional)"
    if not blas.routed():
        return "the routed GEMM kernel is not loaded"
    if any(type(c) is not KVCache for c in caches):
        return "a cache is not a plain KVCache"
    if not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "scale")):
        return f"{type(attn).__name__} lacks n_heads, n_kv_heads or scale"
    proj = attn.q_proj
    dtype = proj["scales"].dtype if "scales" in proj else proj["weight"].dtype
    if dtype != mx.float32:  # ExactRoPE and the native nodes take fp32 arithmetic only
        return f"q_proj computes in {dtype} (accepted: float32)"
    return ""


class _SharedAttention:
    """One layer's attention over the rows of several sequences in two native nodes
    (native_layers.attend_rows: q/k/v, then RoPE, every sequence's cache write and attention);
    where that does not apply to a call (a cache without room for its rows, which mlx-lm's
    update_and_fetch grows), mlx-lm's attention per sequence. Its output is handed to mlx's
    stream at once (async_eval), so the stream computes this layer while Python builds the
    next (the values are the same whenever they are computed)."""

    def __init__(self, attn: Any, caches: list[Any], plan: RowPlan):
        self.attn, self.caches, self.plan = attn, caches, plan

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        p = self.plan
        for c, o in zip(self.caches, p.offsets):
            if c.offset != o:
                raise TargetError(f"cache offset {c.offset} != the plan's {o}")
        rows = [n for _, n in p.spans]
        out = native_layers.attend_rows(self.attn, x, self.caches, rows, p.cos, p.sin)
        if out is None:
            out = _SplitAttention(self.attn, self.caches, p.spans)(x)
        if EVAL_EACH_LAYER:
            mx.async_eval(out)
        return out


class _SharedLayer:
    """One decoder layer over the rows of several sequences as one native node
    (native_layers.layer_rows: each sequence's rows against its own cache, with the bits of its
    solo forward); where that does not apply to a call, the block with its attention shared
    (_SharedAttention). Its output is handed to mlx's stream at once, as _SharedAttention's."""

    def __init__(self, block: Any, caches: list[Any], plan: RowPlan):
        self.block, self.caches, self.plan = block, caches, plan

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        p = self.plan
        rows = [n for _, n in p.spans]
        out = native_layers.layer_rows(self.block, x, self.caches, rows, p.cos, p.sin)
        if out is None:
            attn = self.block["self_attn"]
            self.block["self_attn"] = _SharedAttention(attn, self.caches, p)
            try:
                out = self.block(x, mask, cache)
            finally:
                self.block["self_attn"] = attn
        if EVAL_EACH_LAYER:
            mx.async_eval(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


def shared_unsupported(model: Any, targets: Sequence[KVTarget]) -> str:
    """Why a batched forward over `targets` runs attention through mlx-lm's module per
    sequence rather than the native nodes' shared path ("" when it takes the shared path)."""
    layers = layer_list(model)
    keys = set()
    for i, layer in enumerate(layers):
        attn = layer["self_attn"]
        why = unsupported(attn, [t.cache[i] for t in targets])
        if why:
            return f"layer {i}: {why}"
        keys.add((attn.rope.dims, attn.rope.base, attn.rope.scale))
    return "" if len(keys) == 1 else f"layers' RoPEs differ: {sorted(keys)}"


@contextmanager
def _split(model: Any, targets: Sequence[KVTarget], spans: list[tuple[int, int]]) -> Iterator:
    layers = layer_list(model)
    blocks = list(layers)
    slots = [(layer, "self_attn") for layer in layers]
    originals = [layer["self_attn"] for layer in layers]
    plan = None
    if not shared_unsupported(model, targets):
        plan = row_plan(originals[0], spans, [t.cache[0].offset for t in targets])
    try:
        for i, layer in enumerate(blocks):
            caches = [t.cache[i] for t in targets]
            if plan is None:
                layer["self_attn"] = _SplitAttention(originals[i], caches, spans)
            elif native_fit.layer_fits(layer):  # the whole layer in one node
                layers[i] = _SharedLayer(layer, caches, plan)
            else:
                layer["self_attn"] = _SharedAttention(originals[i], caches, plan)
        yield
    finally:
        layers[:] = blocks
        for (c, k), o in zip(slots, originals):
            c[k] = o


def forward_rows(
    targets: Sequence[KVTarget], rows: Sequence[Sequence[int]], taps: tuple[int, ...] = ()
) -> list[Forward]:
    """Feed rows[i] to targets[i] (all over one model) in one forward; Forward i is what
    targets[i].forward(rows[i], taps) returns, and each target's offset moves the same way."""
    if not targets or len(targets) != len(rows):
        raise TargetError(
            f"forward_rows got {len(targets)} targets and {len(rows)} row lists; accepted: "
            "one non-empty row list per target, at least one target"
        )
    model = targets[0].model
    total = sum(len(r) for r in rows)
    if any(t.model is not model for t in targets) or any(not r for r in rows):
        raise TargetError("forward_rows: accepted: targets of one model, each fed >= 1 row")
    if total > MAX_ROWS:
        raise TargetError(f"forward_rows got {total} rows; accepted: at most {MAX_ROWS}")
    spans, start = [], 0
    for r in rows:
        spans.append((start, len(r)))
        start += len(r)
    x = mx.array([int(t) for r in rows for t in r], dtype=mx.uint32)[None]
    layers = layer_list(model)
    with _split(model, targets, spans), spying([(layers, i) for i in taps]) as spies:
        logits = model(x)[0].astype(mx.float32)
    feats = mx.concatenate([layer_output(s) for s in spies], axis=-1) if taps else None
    out = []
    for t, (s, n) in zip(targets, spans):
        t._offset += n
        out.append(Forward(logits[s : s + n], None if feats is None else feats[s : s + n]))
    return out
