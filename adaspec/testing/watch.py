"""A drafter under watch: every call goes through to it, and each of its drafts is compared with
the draft of a fresh drafter prefilled with the committed tokens (same random state)."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..drafters.base import Draft, DraftContext, DraftModel, LazyDrafter, Learner


class DrafterContractError(AssertionError):
    """A drafter broke the contract `check_drafter` runs; the message names the check, what
    the drafter did and what was expected."""


class Watched:
    """Forwards prefill/draft/advance/rollback to `inner`, keeps the committed view as a list
    (from the calls the controller made) and checks each draft against a reference drafter
    (`fresh()`, re-prefilled with the view before each comparison)."""

    def __init__(
        self, inner: DraftModel, fresh: Callable[[], DraftModel], features: Callable[..., Any]
    ):
        self.inner = inner
        self.name = inner.name
        self.needs_taps = tuple(inner.needs_taps)
        self.vocab_size = inner.vocab_size
        self.view: list[int] = []
        self.checks = 0
        self._fresh = fresh
        self._features = features  # (tokens, taps) -> tap features of tokens, or None
        self._reference: DraftModel | None = None
        self._calls: deque[str] = deque(maxlen=4)

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.view = [int(t) for t in prompt_tokens]
        self._calls.append(f"prefill({len(self.view)} tokens)")
        self.inner.prefill(prompt_tokens, ctx)

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.view += [int(t) for t in committed_tokens]
        self._calls.append(f"advance({list(committed_tokens)})")
        self.inner.advance(committed_tokens, ctx)

    def rollback(self, n: int) -> None:
        if n:
            del self.view[len(self.view) - n :]
        self._calls.append(f"rollback({n})")
        self.inner.rollback(n)

    def draft(self, ctx: DraftContext) -> Draft:
        rng = copy.deepcopy(ctx.rng)
        d = self.inner.draft(ctx)
        self.compare(d, ctx, rng, "draft")
        if d.probs is None and ctx.temperature > 0:
            self._deterministic(d, ctx)
        return d

    def compare(self, d: Draft, ctx: DraftContext, rng: np.random.Generator, how: str) -> None:
        """`d` must be what a fresh drafter prefilled with the view drafts with the same rng."""
        ref = self._reference_draft(ctx, rng)
        self.checks += 1
        if (d.tokens, d.parents) != (ref.tokens, ref.parents):
            raise DrafterContractError(
                f"drafter {self.name!r} after {len(self.view)} committed tokens (last calls: "
                f"{', '.join(self._calls)}) {how} {_show(d)}, but a fresh one prefilled with "
                f"the same tokens drafts {_show(ref)}: its state does not follow prefill, "
                "advance and rollback (or draft() changed it)"
            )

    def check_view(self, when: str, max_draft: int = 8) -> None:
        """Compare one greedy draft now (e.g. after a generation ended) with a fresh one's."""
        ctx = DraftContext(tokens=list(self.view), max_draft=max_draft)
        rng = copy.deepcopy(ctx.rng)
        self.compare(self.inner.draft(ctx), ctx, rng, f"{when} drafted")

    def _reference_draft(self, ctx: DraftContext, rng: np.random.Generator) -> Draft:
        if self._reference is None:
            self._reference = self._fresh()
        ref = self._reference
        view = list(self.view)
        feats = self._features(view[:-1], self.needs_taps) if self.needs_taps else None
        ref.prefill(view, DraftContext(tokens=view, max_draft=0, features=feats))
        args = dict(vars(ctx), tokens=view, rng=rng, features=None)
        return ref.draft(DraftContext(**args))

    def _deterministic(self, d: Draft, ctx: DraftContext) -> None:
        """A draft without q must not depend on the random state: else it was sampled and
        rejection sampling needs the q it was drawn from."""
        other = DraftContext(**dict(vars(ctx), rng=np.random.default_rng(len(self.view) + 7)))
        again = self._reference_draft(other, other.rng)
        if (again.tokens, again.parents) != (d.tokens, d.parents):
            raise DrafterContractError(
                f"drafter {self.name!r} returned a draft without probs (a deterministic draft) "
                f"at temperature {ctx.temperature}, but with another ctx.rng it drafts "
                f"{_show(again)} instead of {_show(d)}: a sampled draft must carry q, the "
                "(k, V) distributions its tokens were drawn from, in Draft.probs"
            )


class _WatchedLazy(Watched):
    def draft_ids(self, ctx: DraftContext) -> Any:
        rng = copy.deepcopy(ctx.rng)
        ids = self.inner.draft_ids(ctx)  # type: ignore[attr-defined]
        if ids is not None:
            self.compare(Draft(np.array(ids).tolist()), ctx, rng, "draft_ids gave")
        return ids


class _WatchedLearner(Watched):
    def finish(self) -> None:
        self._calls.append("finish()")
        self.inner.finish()  # type: ignore[attr-defined]


class _WatchedLazyLearner(_WatchedLazy, _WatchedLearner):
    pass


def watch(
    inner: DraftModel, fresh: Callable[[], DraftModel], features: Callable[..., Any]
) -> Watched:
    """`inner` under watch, with the optional capabilities it has (lazy drafts, learning)."""
    lazy, learner = isinstance(inner, LazyDrafter), isinstance(inner, Learner)
    cls = {
        (False, False): Watched,
        (True, False): _WatchedLazy,
        (False, True): _WatchedLearner,
        (True, True): _WatchedLazyLearner,
    }[(lazy, learner)]
    return cls(inner, fresh, features)


def _show(d: Draft) -> str:
    tree = "" if d.parents is None else f" (parents {list(d.parents)})"
    return f"{list(d.tokens)}{tree}"
