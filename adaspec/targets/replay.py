"""Replay adapter for targets with recurrent state (mlx-lm `ArraysCache`, alone or beside KV
caches): KV layers are trimmed; recurrent layers go back to a snapshot taken before the last
forward and a rollback strategy brings them forward over the accepted tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from ..errors import TargetError
from .architectures import make_strategy
from .base import CacheTarget, Forward
from .rollback import Pending

log = logging.getLogger(__name__)

ACCEPTED_CACHES = (
    "ArraysCache (recurrent state) and trimmable KV caches (KVCache, QuantizedKVCache, "
    "RotatingKVCache before it wraps), alone or inside a CacheList"
)


def cache_leaves(cache: Sequence[Any]) -> list[tuple[str, Any]]:
    """(label, cache) for every layer cache, CacheList members labelled "layer.member"."""
    from mlx_lm.models.cache import CacheList

    out: list[tuple[str, Any]] = []
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            out += [(f"{i}.{j}", member) for j, member in enumerate(c.caches)]
        else:
            out.append((str(i), c))
    return out


def has_recurrent_state(cache: Sequence[Any]) -> bool:
    from mlx_lm.models.cache import ArraysCache

    return any(isinstance(c, ArraysCache) for _, c in cache_leaves(cache))


class ReplayTarget(CacheTarget):
    """Adapter for targets whose caches include recurrent state. rollback(n) within the last
    forward is exact and cheap; deeper rollbacks re-prefill the kept tokens (exact, slow)."""

    rollback_kind = "replay"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        prefill_step: int = 2048,
        strategy: str = "auto",
        use_kernel: bool = True,
    ):
        super().__init__(model, tokenizer, prefill_step=prefill_step)
        self._classify()
        self.strategy = make_strategy(strategy, self, use_kernel=use_kernel)
        self._pending: Pending | None = None
        self._log: list[int] = []  # tokens in the cache before the pending forward
        self.rebuilds = 0  # rollbacks that reached before the last forward

    def _classify(self) -> None:
        from mlx_lm.models.cache import ArraysCache

        self.recurrent: list[tuple[str, Any]] = []
        self.kv: list[tuple[str, Any]] = []
        for label, c in cache_leaves(self.cache):
            if isinstance(c, ArraysCache):
                self.recurrent.append((label, c))
            elif c.is_trimmable():
                self.kv.append((label, c))
            else:
                raise TargetError(
                    f"cache layer {label} is a {type(c).__name__}, which can be neither "
                    f"trimmed nor replayed; accepted: {ACCEPTED_CACHES}"
                )

    def _snapshot(self) -> list[list[Any]]:
        """The recurrent arrays as they are now: a list copy is enough, because mlx-lm's
        recurrent layers assign new arrays to their cache slots instead of writing into them."""
        for label, c in self.recurrent:
            if c.lengths is not None or c.left_padding is not None:
                raise TargetError(
                    f"cache layer {label} ({type(c).__name__}) is batched with padding or "
                    "lengths; accepted: a single unpadded sequence"
                )
            for j, a in enumerate(c.cache):
                if a is not None and not (
                    isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)
                ):
                    kind = a.dtype if isinstance(a, mx.array) else type(a).__name__
                    raise TargetError(
                        f"cache layer {label} ({type(c).__name__}) holds a {kind} in slot {j}, "
                        "e.g. a quantized recurrent state, which cannot be restored exactly; "
                        "accepted: floating-point mx.arrays"
                    )
        return [list(c.cache) for _, c in self.recurrent]

    def _settle(self) -> None:
        """Move the pending forward's kept tokens into the log (they are known by now)."""
        p, self._pending = self._pending, None
        if p is not None and p.kept:
            toks = p.tokens[: p.kept]
            ids = toks.reshape(-1).tolist() if isinstance(toks, mx.array) else list(toks)
            self._log += [int(t) for t in cast(list, ids)]

    def prefill(self, tokens: Sequence[int], taps: tuple[int, ...] = ()) -> mx.array | None:
        self._settle()
        feats = super().prefill(tokens, taps)
        self._log += [int(t) for t in tokens]
        return feats

    def forward(self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...] = ()) -> Forward:
        self._settle()
        snapshot = self._snapshot()
        with self.strategy.recording(len(tokens)) as record:
            fwd = super().forward(tokens, taps)
        self._pending = Pending(tokens, snapshot, record, len(tokens))
        return fwd

    def rollback(self, n: int) -> None:
        if n < 0 or n > self._offset:
            raise TargetError(f"rollback({n}) is out of range; accepted: 0..{self._offset}")
        if n == 0:
            return
        p = self._pending
        if p is None or n > p.kept:
            self._rebuild(self._offset - n)
            return
        self._check_trimmable(n)
        for (_, c), arrays in zip(self.recurrent, p.snapshot):
            c.cache = list(arrays)
        for _, c in self.kv:
            c.trim(n)
        m = p.kept - n
        if m:
            self.strategy.replay(p, m)
        p.kept = m
        self._offset -= n
        # queue the replay's evaluation now; the next forward builds on these arrays anyway
        mx.async_eval([a for _, c in self.recurrent for a in c.cache if a is not None])

    def _check_trimmable(self, n: int) -> None:
        # checked before anything changes, so a refused rollback leaves the cache as it was
        for label, c in self.kv:
            if not c.is_trimmable() or getattr(c, "offset", n) < n:
                raise TargetError(
                    f"cache layer {label} ({type(c).__name__}) cannot drop its last {n} "
                    f"positions (a rotating cache that has wrapped); accepted: {ACCEPTED_CACHES}"
                )

    def _rebuild(self, keep: int) -> None:
        """Exact but slow: start from empty caches and prefill the first `keep` tokens."""
        from mlx_lm.models.cache import make_prompt_cache

        self._settle()
        tokens = self._log[:keep]
        log.debug("rollback reaches before the last forward: re-prefilling %d tokens", keep)
        self.rebuilds += 1
        self.cache[:] = make_prompt_cache(self.model)
        self._classify()
        self._offset, self._log = 0, []
        self.prefill(tokens)
