"""Tree verify on attention targets: one forward over [last committed token, nodes...] where
each node sees the cached prefix, the root and its own ancestors, at position offset + depth;
then the accepted path's keys/values are moved to consecutive slots and the rest is trimmed.

The attention modules are wrapped for the one forward (restored in `finally`); mlx-lm's
classes are never patched."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from ..kernels.attention import scaled_dot_product_attention

# mlx-lm attention modules this wrapper knows (their q/k/v/o projections, optional q/k norms,
# rope module and head counts); GGUF conversions load as these model types
TREE_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def tree_unsupported(model_type: str, layers: Sequence[Any], cache: Sequence[Any]) -> str:
    """Why this target verifies chains only ("" when it can verify trees)."""
    if model_type not in TREE_MODEL_TYPES:
        return f"model type {model_type or '?'} (trees: {', '.join(TREE_MODEL_TYPES)})"
    kinds = sorted({type(c).__name__ for c in cache} - {"KVCache"})
    if kinds:
        return f"cache layers {', '.join(kinds)} (trees: KVCache only)"
    if not all(hasattr(getattr(layer, "self_attn", None), "q_proj") for layer in layers):
        return "a decoder layer without a q/k/v attention module"
    return ""


def depths(parents: Sequence[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def tree_mask(parents: Sequence[int], offset: int) -> mx.array:
    """(n+1, offset+n+1) bool: row 0 is the root (the last committed token), row i+1 node i;
    every row sees the cached prefix, the root, and its ancestors and itself."""
    n = len(parents)
    rows = [[True] + [False] * n]
    for i, p in enumerate(parents):
        row = list(rows[p + 1])
        row[i + 1] = True
        rows.append(row)
    tree = mx.array(rows)
    return mx.concatenate([mx.ones((n + 1, offset), dtype=mx.bool_), tree], axis=1)


class TreeAttention:
    """Stands in for one mlx-lm attention module during a tree forward: the module's own
    projections, norms and rope, at per-node positions, with the tree mask."""

    def __init__(self, attn: Any, positions: mx.array, mask: mx.array):
        self.attn, self.positions, self.mask = attn, positions, mask

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        a = self.attn
        B, L, _ = x.shape
        q = a.q_proj(x).reshape(B, L, a.n_heads, -1)
        k = a.k_proj(x).reshape(B, L, a.n_kv_heads, -1)
        v = a.v_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in a:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = self._rope(q), self._rope(k)
        k, v = cache.update_and_fetch(k, v)
        # the native node where it applies (kernels/attention.py), else mlx-lm's own function
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=a.scale, mask=self.mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _rope(self, x: mx.array) -> mx.array:
        # (1, L, H, D): each node on the batch axis with its own offset, back to (1, H, L, D)
        return self.attn.rope(x.transpose(1, 2, 0, 3), offset=self.positions).transpose(2, 1, 0, 3)


@contextmanager
def tree_attention(layers: Sequence[Any], parents: Sequence[int], offset: int) -> Iterator[None]:
    """Inside the block every layer's self_attn verifies the tree `parents` fed after `offset`
    cached positions."""
    positions = mx.array([offset] + [offset + d for d in depths(parents)])
    mask = tree_mask(parents, offset)
    originals = [layer.self_attn for layer in layers]
    try:
        for layer, attn in zip(layers, originals):
            layer["self_attn"] = TreeAttention(attn, positions, mask)
        yield
    finally:
        for layer, attn in zip(layers, originals):
            layer["self_attn"] = attn


def keep_path(cache: Sequence[Any], base: int, path: Sequence[int]) -> None:
    """After a tree fed at slots base (root), base+1+i (node i): move the path's nodes to
    base+1.. in order. The caller trims what lies after them."""
    src = [base + 1 + i for i in path]
    if src == list(range(base + 1, base + 1 + len(path))):
        return
    idx = mx.array(src)
    end = base + 1 + len(path)
    for c in cache:
        c.keys[..., base + 1 : end, :] = mx.take(c.keys, idx, axis=2)
        c.values[..., base + 1 : end, :] = mx.take(c.values, idx, axis=2)
