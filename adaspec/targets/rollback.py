"""Rollback strategies for recurrent layers behind one interface. The replay adapter restores
the recurrent arrays to their snapshot and trims the KV layers; a strategy then brings the
recurrent state forward over the m accepted tokens of the last forward.

Which strategy an architecture uses by default is the cheapest one measured for it
(docs/benchmarks.md, "Recurrent targets"); every strategy gives the same state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from ..errors import TargetError
from .adapter import Spy, layer_list, spying

if TYPE_CHECKING:
    from .recurrent import Pending, ReplayTarget


class Strategy(Protocol):
    name: str

    def recording(self, n: int) -> Any:
        """Context manager around a forward of n tokens; yields what replay will need."""
        ...

    def replay(self, pending: Pending, m: int) -> None:
        """Advance the restored recurrent state over the first m (>= 1) tokens of `pending`."""
        ...


class Refeed:
    """(a) Run the whole model again over the accepted tokens, KV layers included (they are
    trimmed back first). Needs no recording and works for any architecture; costs about one
    target forward of m tokens."""

    name = "refeed"

    def __init__(self, target: ReplayTarget):
        self.target = target

    @contextmanager
    def recording(self, n: int) -> Iterator[None]:
        yield None

    def replay(self, pending: Pending, m: int) -> None:
        for _, c in self.target.kv:
            c.trim(m)
        toks = pending.tokens
        # the logits are never evaluated: mlx computes only what the caches depend on
        self.target._run(toks[:m] if isinstance(toks, mx.array) else list(toks)[:m], ())


class LayerReplay:
    """(b) Run only the recurrent layers' mixers again, on the inputs they received during the
    forward: no attention, no MLP; the mixers' output projections are never evaluated."""

    name = "layers"

    def __init__(self, target: ReplayTarget, attr: str):
        self.target, self.attr = target, attr
        self.layers = _recurrent_layers(target)

    @contextmanager
    def recording(self, n: int) -> Iterator[list[Spy] | None]:
        if n == 1:  # a rollback into a 1-token forward keeps nothing of it: no replay
            yield None
            return
        with spying([(layer, self.attr) for layer in self.layers]) as spies:
            yield spies

    def replay(self, pending: Pending, m: int) -> None:
        for layer, spy, (_, c) in zip(self.layers, pending.record, self.target.recurrent):
            x = spy.calls[-1][0][0]
            layer[self.attr](x[:, :m], None, c)


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


class GatedDeltaReplay:
    """(b) Record the Gated-DeltaNet inputs (conv input and output, gate projections) during
    the forward; replay only the delta-rule recurrence over the accepted steps, all recurrent
    layers stacked into one call (`adaspec.kernels.gated_delta`). No matmul at all."""

    name = "delta"

    def __init__(self, target: ReplayTarget, layout: GatedDeltaLayout, use_kernel: bool = True):
        self.target, self.layout, self.use_kernel = target, layout, use_kernel
        self.mixers = [layer["linear_attn"] for layer in _recurrent_layers(target)]
        names = ("conv1d", *layout.projections)
        self.slots = [(mixer, name) for mixer in self.mixers for name in names]

    @contextmanager
    def recording(self, n: int) -> Iterator[list[Spy] | None]:
        if n == 1:
            yield None
            return
        with spying(self.slots) as spies:
            yield spies

    def replay(self, pending: Pending, m: int) -> None:
        from mlx_lm.models.gated_delta import compute_g, normalize_qk

        from ..kernels.gated_delta import gated_delta_replay

        width = 1 + len(self.layout.projections)
        ks, vs, gs, betas, states = [], [], [], [], []
        for j, mixer in enumerate(self.mixers):
            conv, *proj = pending.record[j * width : (j + 1) * width]
            q, k, v = _qkv(mixer, conv.calls[-1][1][:, :m])
            q, k = normalize_qk(q, k, inv_scale=mixer.head_k_dim**-0.5, eps=1e-6)
            a, b = self.layout.gates(mixer, [s.calls[-1][1][:, :m] for s in proj])
            ks.append(k)
            vs.append(v)
            gs.append(compute_g(mixer.A_log, a, mixer.dt_bias))
            betas.append(mx.sigmoid(b))
            state = self.target.recurrent[j][1].cache[1]
            states.append(state if state is not None else _zero_state(mixer))
        # every linear layer of a model has the same shapes: one stacked replay for all
        new = gated_delta_replay(
            mx.concatenate(ks),
            mx.concatenate(vs),
            mx.concatenate(gs),
            mx.concatenate(betas),
            mx.concatenate(states),
            use_kernel=self.use_kernel,
        )
        keep = self.mixers[0].conv_kernel_size - 1
        for j, (_, c) in enumerate(self.target.recurrent):
            conv_in = pending.record[j * width].calls[-1][0][0]
            c.cache[0] = mx.contiguous(conv_in[:, m : m + keep])
            c.cache[1] = new[j : j + 1]


def _qkv(mixer: Any, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The mixer's q, k, v from its (pre-activation) conv output, shaped per head."""
    import mlx.nn as nn

    B, L, _ = conv_out.shape
    x = nn.silu(conv_out)
    kd = mixer.key_dim
    q = x[..., :kd].reshape(B, L, mixer.num_k_heads, mixer.head_k_dim)
    k = x[..., kd : 2 * kd].reshape(B, L, mixer.num_k_heads, mixer.head_k_dim)
    v = x[..., 2 * kd :].reshape(B, L, mixer.num_v_heads, mixer.head_v_dim)
    return q, k, v


def _zero_state(mixer: Any) -> mx.array:
    return mx.zeros((1, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim), mx.float32)


def _recurrent_layers(target: ReplayTarget) -> list[Any]:
    layers = layer_list(target.model)
    return [layers[int(label)] for label, _ in target.recurrent]


_QWEN3_5 = GatedDeltaLayout(("in_proj_a", "in_proj_b"), _gates_qwen3_5)
_QWEN3_NEXT = GatedDeltaLayout(("in_proj_ba",), _gates_qwen3_next)
GATED_DELTA = {"qwen3_next": _QWEN3_NEXT, "qwen3_5": _QWEN3_5, "qwen3_5_moe": _QWEN3_5}
MIXERS = {"qwen3_next": "linear_attn", "qwen3_5": "linear_attn", "qwen3_5_moe": "linear_attn"}
MIXERS["mamba2"] = "mixer"
# cheapest first, from the rollback-cost measurements in docs/benchmarks.md
PREFERENCE = ("delta", "layers", "refeed")


def available(target: ReplayTarget) -> tuple[str, ...]:
    """The strategies that fit `target`'s architecture, cheapest first."""
    from .recurrent import model_type

    arch = model_type(target.model)
    plain = all("." not in label for label, _ in target.recurrent)  # no CacheList members
    ok = {"refeed"}
    if plain and arch in MIXERS:
        ok.add("layers")
    if plain and arch in GATED_DELTA:
        ok.add("delta")
    return tuple(s for s in PREFERENCE if s in ok)


def make_strategy(name: str, target: ReplayTarget, *, use_kernel: bool = True) -> Strategy:
    """`name`: one of STRATEGIES or "auto" (the cheapest available for the architecture)."""
    from .recurrent import model_type

    fits = available(target)
    name = fits[0] if name == "auto" else name
    if name not in fits:
        raise TargetError(
            f"rollback strategy {name!r} is not available for {model_type(target.model)!r}; "
            f"accepted: auto, {', '.join(fits)}"
        )
    if name == "delta":
        return GatedDeltaReplay(target, GATED_DELTA[model_type(target.model)], use_kernel)
    if name == "layers":
        return LayerReplay(target, MIXERS[model_type(target.model)])
    return Refeed(target)
