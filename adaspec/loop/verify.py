"""The verify half of a step: the target's forward over the newest committed token and a draft
(a chain, a tree, a lazy chain, or nothing: a plain step, pipelined as mlx-lm's), judged
(judge.py); and the tap features each arm asked for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..drafters.base import Draft, DraftModel
from ..errors import TargetError
from ..targets.base import Forward, Target
from . import sampling
from .judge import LazyDraft, Verified, check_draft, judge


@dataclass(frozen=True)
class DecodeConfig:
    max_tokens: int
    sampling: sampling.SamplingParams = sampling.SamplingParams()
    eos_ids: frozenset[int] = frozenset()
    logits_processors: tuple = ()
    max_draft: int = 64  # hard cap on drafted tokens per step
    tree_nodes: int = 0  # most nodes of a draft tree (0: chains only)
    # greedy chains from a LazyDrafter: verify on the unevaluated ids (no sync between them)
    overlap_draft: bool = True


def tap_union(arms: Sequence[DraftModel]) -> tuple[int, ...]:
    """Every tap the arms asked for, each once, in the order first asked."""
    taps: list[int] = []
    for a in arms:
        taps += [t for t in a.needs_taps if t not in taps]
    return tuple(taps)


def tap_columns(
    feats: mx.array | None, union: tuple[int, ...], taps: tuple[int, ...]
) -> mx.array | None:
    """The columns of the union's tap features that `taps` asks for, in its order."""
    if feats is None or not taps:
        return None
    if taps == union:
        return feats
    h = feats.shape[-1] // len(union)
    cols = [union.index(t) for t in taps]
    return mx.concatenate([feats[..., c * h : (c + 1) * h] for c in cols], axis=-1)


@dataclass(frozen=True)
class _Queued:
    """A plain forward queued before the token it follows was read, as mlx-lm pipelines."""

    token: mx.array  # () the lazy argmax
    logprobs: mx.array  # (V,)
    features: mx.array | None


class Verifier:
    """Runs and judges one sequence's verify forwards on `target`. Holds at most one plain
    forward queued ahead (greedy plain steps); every other forward starts by dropping it."""

    def __init__(
        self, target: Target, taps: tuple[int, ...], cfg: DecodeConfig, rng: np.random.Generator
    ) -> None:
        self.target, self.taps, self.cfg, self.rng = target, taps, cfg, rng
        self.queued: _Queued | None = None

    def drop_queued(self) -> None:
        if self.queued is not None:
            self.target.rollback(1)  # the queued forward of the newest token is fed again
            self.queued = None

    def _queue(self, token: list[int] | mx.array) -> _Queued:
        fwd = self.target.forward(token, self.taps)
        lp = sampling.logprobs(fwd.logits[-1])
        y = mx.argmax(lp, axis=-1)
        mx.async_eval(y, lp)
        return _Queued(y, lp, fwd.features)

    def plain(self, last: int, queue_next: bool) -> Verified:
        """A greedy plain step; the next one's forward is queued (on the lazy token) before this
        token is read, which hides graph-building time as mlx-lm's decoding does."""
        q = self.queued or self._queue([last])
        self.queued = self._queue(q.token[None]) if queue_next else None
        token: int = q.token.item()  # type: ignore[assignment]
        return Verified([token], 0, q.logprobs[None], q.features)

    def chain(self, committed: list[int], draft: Draft, fwd: Forward | None = None) -> Verified:
        """A chain (or nothing) verified: by the target's own forward, or by `fwd`, the same
        rows' forward run beside other sequences' (a batch)."""
        self.drop_queued()
        fed = [committed[-1], *draft.tokens]
        if draft.parents is not None:
            return self._tree(committed, fed, draft)
        if fwd is None:
            fwd = self.target.forward(fed, self.taps)
        elif fwd.logits.shape[0] != len(fed):
            raise TargetError(
                f"the handed forward has {fwd.logits.shape[0]} rows, the step verifies "
                f"{len(fed)}; accepted: a forward over the proposal's rows"
            )
        return self._verdict(fwd, committed, fed, draft)

    def _verdict(
        self, fwd: Forward, committed: list[int], fed: list[int], draft: Draft
    ) -> Verified:
        """What the verify forward over `fed` (the newest committed token, then the chain)
        commits of `draft`."""
        logits = sampling.apply_processors(fwd.logits, committed, fed, self.cfg.logits_processors)
        outcome, lp = judge(logits, draft, self.cfg.sampling, self.rng)
        new = sampling.cut_at_eos(outcome.tokens, self.cfg.eos_ids)
        return Verified(new, min(outcome.accepted, len(new)), lp, fwd.features)

    def lazy(self, committed: list[int], lazy: LazyDraft) -> tuple[Verified, Draft]:
        """The verify forward built on the draft's unevaluated ids; one evaluation computes the
        draft and the target's judgement of it; then the ids are read and checked."""
        self.drop_queued()
        last = mx.array([committed[-1]], dtype=mx.uint32)
        # clipped for the forward only: an id outside the vocabulary is refused once read
        ids = mx.clip(lazy.ids, 0, self.target.info.vocab_size - 1).astype(mx.uint32)
        fwd = self.target.forward(mx.concatenate([last, ids]), self.taps)
        mx.eval(lazy.ids, fwd.logits)
        draft = Draft(lazy.ids.tolist())  # type: ignore[arg-type]
        check_draft(draft, lazy.cap, self.target.info.vocab_size, lazy.name)
        return self._verdict(fwd, committed, [committed[-1], *draft.tokens], draft), draft

    def _tree(self, committed: list[int], fed: list[int], draft: Draft) -> Verified:
        """One forward over the tree; the cache keeps the accepted path, and the rows returned
        are the ones the committed tokens came from."""
        assert draft.parents is not None
        fwd = self.target.forward_tree(fed, draft.parents, self.taps)
        outcome, lp = judge(fwd.logits, draft, self.cfg.sampling, self.rng)
        self.target.keep_path(outcome.path)
        rows = mx.array([0, *(1 + i for i in outcome.path)])
        feats = None if fwd.features is None else fwd.features[rows]
        new = sampling.cut_at_eos(outcome.tokens, self.cfg.eos_ids)
        return Verified(new, min(outcome.accepted, len(new)), lp[rows], feats)
