"""Rollback strategies for recurrent layers behind one interface. The replay adapter restores
the recurrent arrays to their snapshot and trims the KV layers; a strategy then brings the
recurrent state forward over the m accepted tokens of the last forward.

Which strategy an architecture uses by default is the cheapest one measured for it
(docs/benchmarks.md, "Recurrent targets"); every strategy gives the same state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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


class Recorded:
    """Base of the strategies that spy on modules of each recurrent layer during a forward:
    `slots[j]` lists the (container, key) pairs of layer j, the same number for every layer."""

    def __init__(self, target: ReplayTarget, slots: list[list[tuple[Any, Any]]]):
        self.target = target
        self.width = len(slots[0])
        self.slots = [s for layer in slots for s in layer]

    @contextmanager
    def recording(self, n: int) -> Iterator[list[Spy] | None]:
        if n == 1:  # a rollback into a 1-token forward keeps nothing of it: no replay
            yield None
            return
        with spying(self.slots) as spies:
            yield spies

    def calls(self, pending: Pending, i: int) -> list[tuple[tuple, Any]]:
        """(positional args, output) of the last call to slot i, one per recurrent layer."""
        spies = pending.record[i :: self.width]
        return [spy.calls[-1] for spy in spies]

    def stacked(
        self, pending: Pending, i: int, rows: slice, *, arg: int | None = None, axis: int = 0
    ) -> mx.array:
        """Slot i's output (or positional argument `arg`), time steps `rows`, every layer
        concatenated along `axis` (layers share shapes, so they replay as one batch)."""
        picked = [out if arg is None else args[arg] for args, out in self.calls(pending, i)]
        return mx.concatenate([x[:, rows] for x in picked], axis=axis)


class LayerReplay(Recorded):
    """(b) Run only the recurrent layers' mixers again, on the inputs they received during the
    forward: no attention, no MLP; the mixers' output projections are never evaluated."""

    name = "layers"

    def __init__(self, target: ReplayTarget, attr: str):
        self.layers = _recurrent_layers(target)
        self.attr = attr
        super().__init__(target, [[(layer, attr)] for layer in self.layers])

    def replay(self, pending: Pending, m: int) -> None:
        for layer, (args, _), (_, c) in zip(
            self.layers, self.calls(pending, 0), self.target.recurrent
        ):
            layer[self.attr](args[0][:, :m], None, c)


def _recurrent_layers(target: ReplayTarget) -> list[Any]:
    layers = layer_list(target.model)
    return [layers[int(label)] for label, _ in target.recurrent]


# the decoder-layer attribute holding each architecture's recurrent mixer
MIXERS = {
    "qwen3_next": "linear_attn",
    "qwen3_5": "linear_attn",
    "qwen3_5_moe": "linear_attn",
    "mamba2": "mixer",
}
# cheapest first, from the rollback-cost measurements in docs/benchmarks.md
PREFERENCE = ("delta", "ssm", "layers", "refeed")


def available(target: ReplayTarget) -> tuple[str, ...]:
    """The strategies that fit `target`'s architecture, cheapest first."""
    from .recurrences import GATED_DELTA, SSM
    from .recurrent import model_type

    arch = model_type(target.model)
    plain = all("." not in label for label, _ in target.recurrent)  # no CacheList members
    ok = {"refeed"}
    if plain and arch in MIXERS:
        ok.add("layers")
        ok.update({"delta"} if arch in GATED_DELTA else {"ssm"} if arch in SSM else set())
    return tuple(s for s in PREFERENCE if s in ok)


def make_strategy(name: str, target: ReplayTarget, *, use_kernel: bool = True) -> Strategy:
    """`name`: "delta", "ssm", "layers", "refeed", or "auto" (the cheapest that fits)."""
    from .recurrent import model_type

    fits = available(target)
    name = fits[0] if name == "auto" else name
    if name not in fits:
        raise TargetError(
            f"rollback strategy {name!r} is not available for {model_type(target.model)!r}; "
            f"accepted: auto, {', '.join(fits)}"
        )
    from . import recurrences

    arch = model_type(target.model)
    if name == "delta":
        return recurrences.GatedDeltaReplay(target, recurrences.GATED_DELTA[arch], use_kernel)
    if name == "ssm":
        return recurrences.SsmReplay(target)
    if name == "layers":
        return LayerReplay(target, MIXERS[arch])
    return Refeed(target)
