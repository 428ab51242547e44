"""Which rollback strategies fit each recurrent architecture: one table, read by `available`
(what fits, cheapest first) and `make_strategy`."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TargetError
from .base import model_type
from .recurrences import QWEN3_5, QWEN3_NEXT, GatedDeltaLayout, GatedDeltaReplay, SsmReplay
from .rollback import LayerReplay, Refeed, Replayed, Strategy


@dataclass(frozen=True)
class Recurrence:
    """How rollback reaches an architecture's recurrent layers."""

    mixer: str  # the decoder-layer attribute holding the recurrent mixer
    replay: str  # the strategy that replays the recurrence alone: "delta" or "ssm"
    layout: GatedDeltaLayout | None = None  # "delta": where the gate inputs are recorded


ARCHITECTURES = {
    "qwen3_next": Recurrence("linear_attn", "delta", QWEN3_NEXT),
    "qwen3_5": Recurrence("linear_attn", "delta", QWEN3_5),
    "qwen3_5_moe": Recurrence("linear_attn", "delta", QWEN3_5),
    "mamba2": Recurrence("mixer", "ssm"),
}
# cheapest first, from the rollback-cost measurements in docs/benchmarks.md; any other
# ArraysCache architecture gets "refeed", which needs nothing of the model
PREFERENCE = ("delta", "ssm", "layers", "refeed")


def available(target: Replayed) -> tuple[str, ...]:
    """The strategies that fit `target`'s architecture, cheapest first."""
    arch = ARCHITECTURES.get(model_type(target.model))
    plain = all("." not in label for label, _ in target.recurrent)  # no CacheList members
    ok = {"refeed"}
    if plain and arch is not None:
        ok.update({"layers", arch.replay})
    return tuple(s for s in PREFERENCE if s in ok)


def make_strategy(name: str, target: Replayed, *, use_kernel: bool = True) -> Strategy:
    """`name`: "delta", "ssm", "layers", "refeed", or "auto" (the cheapest that fits)."""
    fits = available(target)
    name = fits[0] if name == "auto" else name
    if name not in fits:
        raise TargetError(
            f"rollback strategy {name!r} is not available for {model_type(target.model)!r}; "
            f"accepted: auto, {', '.join(fits)}"
        )
    if name == "refeed":
        return Refeed(target)
    arch = ARCHITECTURES[model_type(target.model)]
    if name == "delta":
        assert arch.layout is not None  # every "delta" row of the table names its layout
        return GatedDeltaReplay(target, arch.mixer, arch.layout, use_kernel)
    if name == "ssm":
        return SsmReplay(target, arch.mixer)
    return LayerReplay(target, arch.mixer)
