"""Rollback strategies for recurrent layers behind one interface, and the generic ones. The
replay adapter restores the recurrent arrays to their snapshot and trims the KV layers; a
strategy then brings the recurrent state forward over the m accepted tokens of the last forward.
Every strategy gives the same state; `architectures` says which fit which model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .base import Spy, layer_list, spying


@dataclass
class Pending:
    """The last forward, kept so that a rollback into it can be undone exactly."""

    tokens: Sequence[int] | mx.array  # the L tokens fed (may be a lazy array)
    snapshot: list[list[Any]]  # per recurrent leaf: its arrays before the forward
    record: Any  # what the strategy recorded during the forward
    kept: int  # how many of the L tokens are still in the cache


class Replayed(Protocol):
    """What a strategy uses of the replay adapter it serves (`replay.ReplayTarget`)."""

    model: Any
    recurrent: list[tuple[str, Any]]  # (layer label, ArraysCache)
    kv: list[tuple[str, Any]]  # (layer label, trimmable cache)

    def run(
        self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...]
    ) -> tuple[mx.array, list]: ...


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

    def __init__(self, target: Replayed):
        self.target = target

    @contextmanager
    def recording(self, n: int) -> Iterator[None]:
        yield None

    def replay(self, pending: Pending, m: int) -> None:
        for _, c in self.target.kv:
            c.trim(m)
        toks = pending.tokens
        # the logits are never evaluated: mlx computes only what the caches depend on
        self.target.run(toks[:m] if isinstance(toks, mx.array) else list(toks)[:m], ())


class Recorded:
    """Base of the strategies that spy on modules of each recurrent layer during a forward:
    `slots[j]` lists the (container, key) pairs of layer j, the same number for every layer."""

    def __init__(self, target: Replayed, slots: list[list[tuple[Any, Any]]]):
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

    def __init__(self, target: Replayed, attr: str):
        self.layers = recurrent_layers(target)
        self.attr = attr
        super().__init__(target, [[(layer, attr)] for layer in self.layers])

    def replay(self, pending: Pending, m: int) -> None:
        for layer, (args, _), (_, c) in zip(
            self.layers, self.calls(pending, 0), self.target.recurrent
        ):
            layer[self.attr](args[0][:, :m], None, c)


def recurrent_layers(target: Replayed) -> list[Any]:
    """The decoder layers that hold the recurrent caches, in cache order."""
    layers = layer_list(target.model)
    return [layers[int(label)] for label, _ in target.recurrent]
