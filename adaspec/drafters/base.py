"""The DraftModel protocol (the plug-in seam) and the values that cross it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from ..errors import DrafterError

if TYPE_CHECKING:
    import mlx.core as mx

    from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of the committed sequence.

    tokens: (k,) token ids that would follow the last committed token; k may be 0 ("decode one
    token plainly"). probs: (k, V) the drafter's distribution q at each drafted position, only
    for stochastic drafters (rejection sampling needs it); None means the draft is deterministic.
    parents: a token tree instead of a chain: parents[i] is the node that tokens[i] follows
      (-1: the last committed token), every parent before its children. probs[i] is then the
      distribution tokens[i] was drawn from, given its parent and its earlier siblings. A
      chain-shaped tree is stored as a chain (parents None).
    """

    tokens: tuple[int, ...] = ()
    probs: np.ndarray | None = None
    parents: tuple[int, ...] | None = None
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
        if self.parents is not None:
            parents = tuple(int(p) for p in self.parents)
            _check_tree(self.tokens, parents, self.probs is None)
            chain = parents == tuple(range(-1, len(parents) - 1))
            object.__setattr__(self, "parents", None if chain else parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def depths(self) -> tuple[int, ...]:
        """Tokens on the path from the last committed token to each node, the node included."""
        if self.parents is None:
            return tuple(range(1, len(self.tokens) + 1))
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    def best_chain(self) -> Draft:
        """The chain a target that verifies chains only gets: the first child at each level
        (drafters put their likeliest child first)."""
        if self.parents is None:
            return self
        path, cur = [], -1
        for i, p in enumerate(self.parents):
            if p == cur:
                path.append(i)
                cur = i
        probs = None if self.probs is None else self.probs[path]
        toks = tuple(self.tokens[i] for i in path)
        return Draft(toks, probs, None, self.strong, self.setup_s)


def _check_tree(tokens: tuple[int, ...], parents: tuple[int, ...], deterministic: bool) -> None:
    if len(parents) != len(tokens):
        raise DrafterError(
            f"Draft.parents has {len(parents)} entries for {len(tokens)} tokens; accepted: one "
            "parent per token"
        )
    seen: set[tuple[int, int]] = set()
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise DrafterError(
                f"Draft.parents[{i}] = {p} is illegal; accepted: -1 (the last committed token) "
                f"or an earlier node 0..{i - 1} (parents before children)"
            )
        if deterministic and (p, tokens[i]) in seen:
            raise DrafterError(
                f"Draft node {i} repeats token {tokens[i]} under parent {p}; accepted: distinct "
                "siblings in a deterministic tree"
            )
        seen.add((p, tokens[i]))


@dataclass
class DraftContext:
    """What the controller shares with the drafter at each call.

    tokens: the committed sequence (prompt + generated), read-only.
    max_draft: most tokens the drafter may propose now (room left and the policy's cap for
      this drafter); for a tree, the most tokens on any path.
    tree_nodes: most nodes a tree draft may hold now; 0 means chains only.
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
    tree_nodes: int = 0
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


@runtime_checkable
class LazyDrafter(Protocol):
    """An optional capability: a greedy chain draft that can stay an unevaluated array.

    draft_ids(ctx) returns the (k,) int ids draft(ctx) would propose (1 <= k <= ctx.max_draft)
    as a lazy mx.array, or None when this call has no such draft (the controller then calls
    draft()). The controller builds the target's verify forward on those ids and evaluates
    drafting and verifying as one computation, so no sync sits between them; it reads the ids
    afterwards and holds them to the same checks as draft()'s. Called only for greedy chain
    steps (ctx.temperature == 0, ctx.tree_nodes == 0); the committed view is unchanged.
    """

    def draft_ids(self, ctx: DraftContext) -> mx.array | None: ...


@runtime_checkable
class Learner(Protocol):
    """An optional capability: learn from what the target generated. The controller calls
    finish() once a generation ends (finished, stopped or abandoned), with the drafter's view
    at the committed tokens; the view is unchanged, and the next generation may continue it
    (a prompt cache) or start afresh with prefill."""

    def finish(self) -> None: ...
