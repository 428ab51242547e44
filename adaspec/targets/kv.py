"""The adapter for targets whose caches can all be trimmed: rollback moves every offset back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import TargetError
from .base import CacheTarget, Forward, layer_list, model_type
from .tree import keep_path, tree_attention, tree_unsupported


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
        self.tree_unsupported = tree_unsupported(model_type(model), layer_list(model), self.cache)
        self._tree_base = -1  # the root's slot of the latest tree forward

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

    def forward_tree(
        self, tokens: Sequence[int], parents: Sequence[int], taps: tuple[int, ...] = ()
    ) -> Forward:
        if self.tree_unsupported:
            raise TargetError(f"this target verifies chains only: {self.tree_unsupported}")
        if len(tokens) != len(parents) + 1:
            raise TargetError(
                f"forward_tree got {len(tokens)} tokens for {len(parents)} nodes; accepted: "
                "the last committed token followed by one token per node"
            )
        self._tree_base = self._offset
        with tree_attention(layer_list(self.model), parents, self._offset):
            return self.forward(tokens, taps)

    def keep_path(self, path: Sequence[int]) -> None:
        base = self._tree_base
        keep = base + 1 + len(path)
        if base < 0 or keep > self._offset:
            raise TargetError(
                f"keep_path({list(path)}) does not fit the latest tree forward; accepted: "
                "a path of the tree just fed, once"
            )
        keep_path(self.cache, base, path)
        self._tree_base = -1
        self.rollback(self._offset - keep)
