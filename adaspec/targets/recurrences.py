"""Rollback by replaying only a recurrence: during the verify forward the recurrent mixers'
internal inputs are recorded; a rollback feeds the accepted steps of them to the recurrence
alone (no projection matmul), all layers stacked into one call.

- Gated-DeltaNet (qwen3_next, qwen3_5): conv input/output and the gate projections are
  recorded; the delta rule runs in `adaspec.kernels.gated_delta` (plain ops or Metal).
- Mamba2: the input projection and conv input/output are recorded; mlx-lm's own SSM update
  runs with the layers folded into heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .rollback import Pending, Recorded, Replayed, recurrent_layers


@dataclass(frozen=True)
class GatedDeltaLayout:
    """Where a Gated-DeltaNet mixer's gate inputs come from: the projections whose outputs
    are recorded, and how (a, b) are read from them."""

    projections: tuple[str, ...]
    gates: Callable[[Any, list[mx.array]], tuple[mx.array, mx.array]]


def _gates_qwen3_5(mixer: Any, outs: list[mx.array]) -> tuple[mx.array, mx.array]:
    a, b = outs
    return a, b


def _gates_qwen3_next(mixer: Any, outs: list[mx.array]) -> tuple[mx.array, mx.array]:
    # in_proj_ba interleaves b and a per key-head group
    (ba,) = outs
    B, L, _ = ba.shape
    nk, nv = mixer.num_k_heads, mixer.num_v_heads
    ba = ba.reshape(B, L, nk, -1)
    b, a = ba[..., : nv // nk], ba[..., nv // nk :]
    return a.reshape(B, L, nv), b.reshape(B, L, nv)


QWEN3_5 = GatedDeltaLayout(("in_proj_a", "in_proj_b"), _gates_qwen3_5)
QWEN3_NEXT = GatedDeltaLayout(("in_proj_ba",), _gates_qwen3_next)


def _conv_states(strategy: Recorded, pending: Pending, slot: int, m: int, keep: int) -> None:
    """Each layer's conv state after m steps: the last `keep` rows of the input that the
    conv recorded in `slot` saw (its previous state, then the new steps)."""
    conv = mx.contiguous(strategy.stacked(pending, slot, slice(m, m + keep), arg=0))
    for j, (_, c) in enumerate(strategy.target.recurrent):
        c.cache[0] = conv[j : j + 1]


class GatedDeltaReplay(Recorded):
    """(b) for Gated-DeltaNet: replay the delta rule over the accepted steps."""

    name = "delta"

    def __init__(
        self, target: Replayed, attr: str, layout: GatedDeltaLayout, use_kernel: bool = True
    ):
        self.layout, self.use_kernel = layout, use_kernel
        self.mixers = [layer[attr] for layer in recurrent_layers(target)]
        names = ("conv1d", *layout.projections)
        super().__init__(target, [[(mixer, n) for n in names] for mixer in self.mixers])

    def replay(self, pending: Pending, m: int) -> None:
        from mlx_lm.models.gated_delta import compute_g, normalize_qk

        from ..kernels.gated_delta import gated_delta_replay

        mixer = self.mixers[0]
        steps = slice(0, m)
        q, k, v = _qkv(mixer, self.stacked(pending, 0, steps))
        q, k = normalize_qk(q, k, inv_scale=mixer.head_k_dim**-0.5, eps=1e-6)
        outs = [self.stacked(pending, i, steps) for i in range(1, self.width)]
        a, b = self.layout.gates(mixer, outs)
        A_log = mx.stack([x.A_log for x in self.mixers])[:, None]
        dt_bias = mx.stack([x.dt_bias for x in self.mixers])[:, None]
        zero = mx.zeros((1, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim))
        states = [c.cache[1] for _, c in self.target.recurrent]
        new = gated_delta_replay(
            k,
            v,
            compute_g(A_log, a, dt_bias),
            mx.sigmoid(b),
            mx.concatenate([s if s is not None else zero for s in states]),
            use_kernel=self.use_kernel,
        )
        for j, (_, c) in enumerate(self.target.recurrent):
            c.cache[1] = new[j : j + 1]
        _conv_states(self, pending, 0, m, mixer.conv_kernel_size - 1)


def _qkv(mixer: Any, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The mixer's q, k, v from its (pre-activation) conv output, shaped per head."""
    B, L, _ = conv_out.shape
    x = nn.silu(conv_out)
    kd = mixer.key_dim
    q = x[..., :kd].reshape(B, L, mixer.num_k_heads, mixer.head_k_dim)
    k = x[..., kd : 2 * kd].reshape(B, L, mixer.num_k_heads, mixer.head_k_dim)
    v = x[..., 2 * kd :].reshape(B, L, mixer.num_v_heads, mixer.head_v_dim)
    return q, k, v


class SsmReplay(Recorded):
    """(b) for Mamba2: the selective-state-space update over the accepted steps in closed form,
    S_m = exp(sum_t dt_t A) S_0 + sum_t exp(sum_{s>t} dt_s A) dt_t x_t B_t^T, with one matmul
    per layer and group (the heads of a group share B) instead of one per head."""

    name = "ssm"

    def __init__(self, target: Replayed, attr: str):
        self.mixers = [layer[attr] for layer in recurrent_layers(target)]
        super().__init__(target, [[(x, "in_proj"), (x, "conv1d")] for x in self.mixers])

    def replay(self, pending: Pending, m: int) -> None:
        from mlx_lm.models.ssm import compute_dt

        mx0 = self.mixers[0]
        n, H, P = len(self.mixers), mx0.num_heads, mx0.head_dim
        G, N, inner = mx0.n_groups, mx0.ssm_state_size, mx0.intermediate_size
        raw = self.stacked(pending, 0, slice(0, m))[..., inner + mx0.conv_dim :]  # (n, m, H)
        dt = compute_dt(
            raw, mx.stack([x.dt_bias for x in self.mixers])[:, None], mx0.time_step_limit
        )
        A = -mx.exp(mx.stack([x.A_log for x in self.mixers])[:, None]).astype(dt.dtype)
        logdecay = mx.cumsum(dt * A, axis=1)  # (n, m, H)
        weight = dt * mx.exp(logdecay[:, -1:] - logdecay)  # dt_t exp(sum_{s>t} dt_s A)
        conv = nn.silu(self.stacked(pending, 1, slice(0, m)))  # (n, m, conv_dim)
        x = conv[..., :inner].reshape(n, m, H, P) * weight[..., None]
        x = x.reshape(n, m, G, (H // G) * P).transpose(0, 2, 3, 1)  # (n, G, H/G*P, m)
        B = conv[..., inner : inner + G * N].reshape(n, m, G, N).transpose(0, 2, 1, 3)
        zero = mx.zeros((1, H, P, N))
        state = mx.concatenate(
            [c.cache[1] if c.cache[1] is not None else zero for _, c in self.target.recurrent]
        )
        new = mx.exp(logdecay[:, -1])[..., None, None] * state + (x @ B).reshape(n, H, P, N)
        for j, (_, c) in enumerate(self.target.recurrent):
            c.cache[1] = new[j : j + 1]
        _conv_states(self, pending, 1, m, mx0.conv_kernel_size - 1)
