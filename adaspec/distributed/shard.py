"""Split a loaded model over the ranks: pipeline (each rank runs a slice of the decoder layers,
split and connected as mlx-lm's PipelineMixin does) or tensor (mlx-lm's own `shard()`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import DistributedError
from ..targets.base import inner_model
from .world import World

KINDS = ("pipeline", "tensor")


@dataclass(frozen=True)
class Sharding:
    """How the target is split; every rank holds one (the same but for `start`/`end`)."""

    kind: str  # "pipeline" | "tensor"
    rank: int
    size: int
    backend: str
    start: int  # this rank's first decoder layer (pipeline), 0 for tensor
    end: int  # one past its last
    num_layers: int  # the whole model's

    def local(self, layer: int) -> int | None:
        """This rank's index of global decoder layer `layer`, None where another rank runs it."""
        return layer - self.start if self.start <= layer < self.end else None

    def owner(self, layer: int) -> int:
        """The rank that runs global decoder layer `layer`."""
        if self.kind == "tensor":
            return self.rank
        starts, _ = pipeline_split(self.num_layers, self.size)  # decreasing with the rank
        return min(r for r in range(self.size) if starts[r] <= layer)

    def describe(self) -> str:
        where = (
            f"layers {self.start}-{self.end - 1} of {self.num_layers} on rank {self.rank}"
            if self.kind == "pipeline"
            else f"every layer's heads and MLP split {self.size} ways"
        )
        return f"{self.kind} over {self.size} ranks ({self.backend}): {where}"


def pipeline_split(num_layers: int, size: int) -> tuple[list[int], list[int]]:
    """(first layer, layer count) per rank, as mlx-lm's PipelineMixin splits: rank 0 runs the
    last layers, the low ranks take the extra layers."""
    base, extra = divmod(num_layers, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    starts = [sum(counts[r + 1 :]) for r in range(size)]
    return starts, counts


class _Stage(nn.Module):
    """A decoder layer at one end of a rank's slice: the first receives the hidden state from
    the rank before it in the pipeline; the last sends its output on and gathers the final
    hidden state from rank 0, so every rank computes the same logits."""

    def __init__(self, layer: Any, world: World, first: bool, last: bool):
        super().__init__()
        self.layer = layer
        self._world, self._first, self._last = world, first, last

    def __getattr__(self, name: str) -> Any:  # use_sliding, self_attn, ...: the layer's
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self:
                raise
            return getattr(self["layer"], name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> Any:
        w = self._world
        g, rank, size = w.group, w.rank, w.size
        if self._first and rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1, group=g)
            w.collectives += 1
        out = self.layer(h, *args, **kwargs)
        if not self._last:
            return out
        w.collectives += 1  # the all_gather below (and the send before it on rank > 0)
        if rank != 0:
            out = mx.distributed.send(out, rank - 1, group=g)
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            if cache is not None and getattr(cache, "keys", None) is not None:
                cache.keys = mx.depends(cache.keys, out)  # a prefill that reads only caches
        return mx.distributed.all_gather(out, group=g)[: out.shape[0]]


def pipeline(model: Any, world: World) -> Sharding:
    """Keep this rank's slice of the decoder layers (the others are dropped, their memory
    freed with them), ends wrapped to pass the hidden state along."""
    inner = inner_model(model)
    layers = list(inner.layers)
    n = len(layers)
    if n < world.size:
        raise DistributedError(
            f"{type(model).__name__} has {n} decoder layers, fewer than the {world.size} "
            "ranks; accepted: a pipeline of at most one rank per layer"
        )
    if getattr(inner, "swa_idx", None) is not None or getattr(inner, "fa_idx", 0) != 0:
        raise DistributedError(
            f"{type(model).__name__} mixes sliding-window and full attention layers, whose "
            "masks index the whole layer list; accepted for pipeline: uniform attention layers"
        )
    starts, counts = pipeline_split(n, world.size)
    start, end = starts[world.rank], starts[world.rank] + counts[world.rank]
    mine = layers[start:end]
    mine[0] = _Stage(mine[0], world, first=True, last=len(mine) == 1)
    if len(mine) > 1:
        mine[-1] = _Stage(mine[-1], world, first=False, last=True)
    inner.layers = mine
    registry = getattr(model, "adaspec_stored", None)
    if registry is not None:  # stored weights: the other ranks' matrices are released too
        registry.drop_unused(model)
    return Sharding("pipeline", world.rank, world.size, world.backend, start, end, n)


def tensor(model: Any, world: World) -> Sharding:
    """mlx-lm's tensor parallelism: attention heads and MLP columns split over the ranks,
    the partial sums added across them (so the sums differ from one process's)."""
    if not callable(getattr(model, "shard", None)):
        raise DistributedError(
            f"mlx-lm offers no tensor sharding for {type(model).__name__}; accepted: "
            "ADASPEC_SHARD=pipeline, or a model type with shard() (llama, qwen2, qwen3, ...)"
        )
    registry = getattr(model, "adaspec_stored", None)
    if registry is not None and getattr(registry, "nbytes", 0) > 0:
        raise DistributedError(
            "tensor sharding slices the weight matrices, and this model reads them at their "
            "stored bits, which cannot be sliced; accepted: ADASPEC_STORED_WEIGHTS=off with "
            "ADASPEC_SHARD=tensor, or ADASPEC_SHARD=pipeline"
        )
    _check_heads(model, world.size)
    n = len(inner_model(model).layers)
    model.shard(world.group)
    return Sharding("tensor", world.rank, world.size, world.backend, 0, n, n)


def _check_heads(model: Any, size: int) -> None:
    args = getattr(model, "args", None)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(args, name, None)
        if v is not None and v % size:
            raise DistributedError(
                f"{type(model).__name__} has {name}={v}, which does not split over {size} "
                "ranks; accepted: counts divisible by the ranks, or ADASPEC_SHARD=pipeline"
            )


def shard(model: Any, world: World, kind: str = "auto") -> Sharding:
    """Split `model` over `world` (kind: auto = pipeline, pipeline, tensor); the sharding is
    kept on the model as `adaspec_sharding` for target_for (__init__.py), -v and doctor."""
    kind = "pipeline" if kind == "auto" else kind
    if kind not in KINDS:
        raise DistributedError(f"sharding {kind!r} is unknown; accepted: auto, pipeline, tensor")
    if getattr(model, "adaspec_sharding", None) is not None:
        raise DistributedError("this model is already sharded; accepted: a model loaded afresh")
    from mlx_lm.models.cache import make_prompt_cache

    from ..targets.replay import has_recurrent_state

    if has_recurrent_state(make_prompt_cache(model)):
        raise DistributedError(
            f"{type(model).__name__} holds recurrent state; accepted sharded: models whose "
            "caches are all trimmable KV caches (llama, qwen2, qwen3, mistral, ...)"
        )
    s = pipeline(model, world) if kind == "pipeline" else tensor(model, world)
    model.adaspec_sharding = s
    mx.eval(model.parameters())
    with world.guard("joining the other ranks after sharding"):
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=world.group))
    return s


def sharding(model: Any) -> Sharding | None:
    """The sharding `shard` recorded on `model`, if any."""
    return getattr(model, "adaspec_sharding", None)
