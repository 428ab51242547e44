"""The DraftModel protocol (the plug-in seam) and the values that cross it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx

    from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of the committed sequence.

    tokens: (k,) token ids that would follow the last committed token; k may be 0 ("decode one
    token plainly"). probs: (k, V) the drafter's distribution q at each drafted position, only
    for stochastic drafters (rejection sampling needs it); None means the draft is deterministic.
    """

    tokens: tuple[int, ...] = ()
    probs: np.ndarray | None = None
    strong: bool = False  # the drafter is confident (e.g. a long exact match): may lift a floor
    # seconds of one-time work inside draft() that the next step will not repeat (a draft model
    # catching up on tokens committed while floored): counted in the stats, not held against
    # speculation by the gates and the draft-length rule
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.probs is not None and (
            self.probs.ndim != 2 or self.probs.shape[0] != len(self.tokens)
        ):
            raise ValueError(
                f"Draft.probs must have shape (k, V) with k={len(self.tokens)} drafted tokens; "
                f"got {self.probs.shape}"
            )

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DraftContext:
    """What the controller shares with the drafter at each call.

    tokens: the committed sequence (prompt + generated), read-only.
    max_draft: most tokens the drafter may propose now (room left and the policy's cap for
      this drafter).
    features: (m, F) target tap features for the m newly cached positions, or None when the
      drafter declares no taps. In `prefill` the rows are prompt_tokens[:-1]; in `advance` row i
      is the position whose logits predicted committed_tokens[i].
    temperature: 0 means greedy; stochastic drafters sample (and return q) only when > 0.
    rng: the generation's random source, so a fixed seed reproduces the text.
    sampling: the target's sampler knobs (temperature, top-p, min-p, top-k), so a drafter can
      filter q the way the target's p is filtered; None means temperature only.
    """

    tokens: Sequence[int]
    max_draft: int
    features: mx.array | None = None
    temperature: float = 0.0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    sampling: SamplingParams | None = None


@runtime_checkable
class DraftModel(Protocol):
    """A drafter proposes tokens; the controller verifies them against the target.

    Capabilities are declared attributes, read once by the controller:
      name: registry name, for stats and errors.
      needs_taps: target layer ids whose hidden states (outputs of decoder layer i) the drafter
        wants in `ctx.features`; () for none.
      vocab_size: size of the vocabulary the drafter emits ids from, or None if it only copies
        ids it has seen (checked against the target's at start).
    Nothing else: what a draft costs and how often it is accepted, the policy measures. Several
    drafters may run side by side (arms); each sees every prefill/advance/rollback.

    State contract: after prefill(prompt) the drafter's committed view is the prompt; draft()
    never changes that view; advance(t) appends t; rollback(n) drops the last n (0 is a no-op).
    """

    name: str
    needs_taps: tuple[int, ...]
    vocab_size: int | None

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None: ...

    def draft(self, ctx: DraftContext) -> Draft: ...

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None: ...

    def rollback(self, n: int) -> None: ...
