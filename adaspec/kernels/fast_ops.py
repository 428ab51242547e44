"""The CPU fast paths of one model, each bit for bit stock mlx: attention on the vectorized
softmax (attention.py), RoPE and RMSNorm twins (layers.py), on top of mlx's JIT kernels built
for this CPU (jit.py). ADASPEC_FAST_OPS=off, another device or platform: nothing changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import attention, layers


@dataclass(frozen=True)
class Installed:
    attention_modules: list[str]  # mlx-lm model modules whose attention is routed
    layers: int  # nn.RoPE / nn.RMSNorm instances replaced by their twins


def install(model: Any) -> Installed:
    """Route `model` (an mlx-lm model or one of ours) through the fast paths where they are
    enabled (attention.enabled: the JIT wrapper is active and the device is the CPU)."""
    if not attention.enabled():
        return Installed([], 0)
    return Installed(attention.install(model), layers.install(model))
