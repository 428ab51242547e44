"""The adapter for targets whose caches can all be trimmed: rollback moves every offset back."""

from __future__ import annotations

from typing import Any

from ..errors import TargetError
from .base import CacheTarget


class KVTarget(CacheTarget):
    """Adapter for targets whose every cache layer can be trimmed (attention KV caches)."""

    rollback_kind = "trim"

    def __init__(self, model: Any, tokenizer: Any = None, *, prefill_step: int = 2048):
        super().__init__(model, tokenizer, prefill_step=prefill_step)
        bad = [
            f"{i} ({type(c).__name__})" for i, c in enumerate(self.cache) if not c.is_trimmable()
        ]
        if bad:
            raise TargetError(
                f"{type(model).__name__} has cache layers that cannot be trimmed: "
                f"{', '.join(bad)}; accepted here: models whose caches are all trimmable "
                "(KVCache, ...); recurrent targets (ArraysCache) go through make_target"
            )

    def rollback(self, n: int) -> None:
        if n < 0 or n > self._offset:
            raise TargetError(f"rollback({n}) is out of range; accepted: 0..{self._offset}")
        if n == 0:
            return
        for i, c in enumerate(self.cache):
            got = c.trim(n)
            if got != n:
                raise TargetError(
                    f"cache layer {i} ({type(c).__name__}) trimmed {got} of {n} positions; "
                    "a rotating cache cannot be rolled back after it wraps"
                )
        self._offset -= n
