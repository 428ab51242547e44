"""Target adapters over mlx-lm models (verify, taps, rollback) and model loaders.

Layers, each importing only those before it: `base` (the Target protocol, TargetInfo, taps),
`kv` (trim rollback), `rollback` and `recurrences` (strategies for recurrent state),
`architectures` (which strategy fits which model), `replay` (the recurrent adapter), and
`make_target` here, which picks the adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TargetError

if TYPE_CHECKING:  # the loaders import this package: it stays free of mlx until a target is made
    from ..settings import Settings
    from .base import Target


def make_target(
    model: Any,
    tokenizer: Any = None,
    *,
    prefill_step: int = 2048,
    rollback: str = "auto",
    pieces: int = 10,
) -> Target:
    """Pick the adapter for `model` from its cache types: trim for KV caches, replay for
    recurrent state (`rollback` names the replay strategy; "auto" picks it per architecture).
    pieces: how many pieces a forward's graph is handed to mlx in (CacheTarget). The model
    runs as it is: `adaspec.load` puts it on the fast paths (kernels/fast_ops.install)."""
    target = _adapter(model, tokenizer, prefill_step, rollback)
    target.pieces = pieces  # type: ignore[attr-defined]
    return target


def target_for(model: Any, tokenizer: Any, settings: Settings) -> Target:
    """`make_target` with the prefill chunk, rollback strategy and pieces of `settings`."""
    return make_target(
        model,
        tokenizer,
        prefill_step=settings.prefill_step,
        rollback=settings.rollback,
        pieces=settings.forward_pieces,
    )


def _adapter(model: Any, tokenizer: Any, prefill_step: int, rollback: str) -> Target:
    from mlx_lm.models.cache import make_prompt_cache

    from .kv import KVTarget
    from .replay import ReplayTarget, has_recurrent_state

    if getattr(model, "adaspec_sharding", None) is not None:  # split over ranks (distributed/)
        raise TargetError(
            "this model is split over ranks; accepted: adaspec.distributed.target_for, which "
            "builds rank 0's mirrored target"
        )
    if has_recurrent_state(make_prompt_cache(model)):
        return ReplayTarget(model, tokenizer, prefill_step=prefill_step, strategy=rollback)
    return KVTarget(model, tokenizer, prefill_step=prefill_step)


__all__ = ["make_target"]
