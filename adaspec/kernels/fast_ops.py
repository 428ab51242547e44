"""The CPU fast paths of one model, each bit for bit stock mlx: attention on the vectorized
softmax (attention.py), RoPE, RMSNorm and Linear twins (layers.py), Llama / Qwen2 attention and
decoder blocks in fewer graph nodes (blocks.py), mlx-lm's decoding loop on the
vectorized logsumexp (mlx_lm_generate.py), on top of mlx's JIT kernels built
for this CPU (jit.py). ADASPEC_FAST_OPS=off, another device or platform: nothing changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import attention, blas, blocks, layers, mlx_lm_generate, native_layers


@dataclass(frozen=True)
class Installed:
    attention_modules: list[str]  # mlx-lm model modules whose attention is routed
    layers: int  # nn.RoPE / nn.RMSNorm / nn.Linear instances replaced by their twins
    generate_logsumexp: bool = False  # mlx_lm.generate's logsumexp on the vectorized kernel
    native_mlps: int = 0  # MLPs whose gate and up projections run in one native node
    blocks: int = 0  # Attention / TransformerBlock instances given blocks.py's twin class


def install(model: Any) -> Installed:
    """Route `model` (an mlx-lm model or one of ours) through the fast paths where they are
    enabled (attention.enabled: the JIT wrapper is active and the device is the CPU)."""
    if not attention.enabled():
        return Installed([], 0)
    routed = attention.install(model)
    twins = layers.install(model)
    loop = mlx_lm_generate.install()
    mlps = native_layers.install(model) if blas.routed() else 0
    # after native_layers: its one-node attention keeps the Attention instances it takes
    return Installed(routed, twins, loop, mlps, blocks.install(model))
