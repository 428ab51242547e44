"""What adaspec's native decoder layer (kernels/native_decoder_layer.cpp) computes exactly: a
llama / qwen2 TransformerBlock of mlx-lm's Attention and MLP on the twins of kernels/layers.py
with plain fp32 projections. native_layers.py runs such a layer in one node, native_stack.py
a model of them in one call."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import native
from .layers import ExactLinear, ExactRMSNorm
from .layers import ExactRoPE as ExactRope

MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
PLAIN = (nn.Linear, ExactLinear)


def plain(m: Any) -> bool:
    """a projection whose weight is an fp32 matrix the routed kernel reads (nn.Linear or the
    Linear twin)"""
    w = m.get("weight") if type(m) in PLAIN else None
    return w is not None and w.dtype == mx.float32 and w.ndim == 2


PROJECTIONS = (
    ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
    ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
)  # fmt: skip


def block_parts(block: Any) -> list[Any] | None:
    """The seven projections (PROJECTIONS' order) of a llama / qwen2 TransformerBlock of
    mlx-lm's Attention (no q/k norms) and MLP, with fp32 ExactRMSNorms, an ExactRoPE (not
    traditional) and plain fp32 projections; None for any other block"""
    attn, mlp = block.get("self_attn"), block.get("mlp")
    mods = (sys.modules.get(m) for m in MODULES[:2])
    if not any(m and isinstance(attn, m.Attention) and isinstance(mlp, m.MLP) for m in mods):
        return None
    norms = (block.get("input_layernorm"), block.get("post_attention_layernorm"))
    rope = getattr(attn, "rope", None)
    if not (
        all(type(n) is ExactRMSNorm and n.weight.dtype == mx.float32 for n in norms)
        and "q_norm" not in attn
        and type(rope) is ExactRope
        and not rope.traditional
    ):
        return None
    projs = [block[a][p] for a, p in PROJECTIONS]
    return projs if all(plain(p) for p in projs) else None


def layer_fits(block: Any) -> bool:
    """Whether `layer_rows` may run `block` (given fp32 rows and caches with room): a llama or
    qwen2 block of the twins it stands for, and the native extension built."""
    return block_parts(block) is not None and native.get() is not None
