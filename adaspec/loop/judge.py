"""What a draft must satisfy and how the target's verify forward judges it: the checks every
draft passes before anything of it is emitted, and the acceptance rule for chains and trees."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..drafters.base import Draft
from ..errors import DrafterError
from . import acceptance, sampling


@dataclass(frozen=True)
class Verified:
    """What one verify (or plain) forward committed."""

    tokens: list[int]  # committed by this step (accepted drafts + one target token)
    accepted: int
    logprobs: mx.array  # (len(tokens) or more, V): row j is the distribution tokens[j] came from
    features: mx.array | None  # (>= len(tokens), F) tap features of the positions fed


@dataclass(frozen=True)
class LazyDraft:
    """A LazyDrafter's chain, not read yet: the verify forward is built on `ids`."""

    ids: mx.array  # (k,) int, unevaluated
    cap: int  # the most tokens this step allowed
    name: str  # the arm's, for errors

    def __len__(self) -> int:
        return self.ids.shape[0]


def check_draft(d: Draft, cap: int, vocab: int, name: str, nodes: int = 0) -> None:
    """Refuse, naming the drafter and the value, a draft longer than `cap`, a tree of more than
    `nodes` nodes, ids outside the vocabulary or q of the wrong width."""
    deep = max(d.depths(), default=0)
    if deep > cap:
        raise DrafterError(f"drafter {name!r} proposed {deep} tokens; at most {cap} allowed")
    if d.is_tree and len(d) > nodes:
        raise DrafterError(
            f"drafter {name!r} proposed a tree of {len(d)} nodes; at most {nodes} allowed"
        )
    bad = [t for t in d.tokens if not 0 <= t < vocab]
    if bad:
        raise DrafterError(
            f"drafter {name!r} proposed token ids {bad[:5]} outside the target's vocabulary "
            f"(accepted: 0..{vocab - 1})"
        )
    if d.probs is not None and d.probs.shape[1] != vocab:
        raise DrafterError(
            f"drafter {name!r} returned q with {d.probs.shape[1]} columns; the target's "
            f"vocabulary has {vocab}"
        )


def judge(
    logits: mx.array, draft: Draft, params: sampling.SamplingParams, rng: np.random.Generator
) -> tuple[acceptance.Outcome, mx.array]:
    """The target's verdict on `draft` from its verify logits (greedy or sampled, chain or
    tree) and the log-probabilities the committed tokens come from."""
    lp = sampling.logprobs(logits)
    if draft.parents is not None:
        if params.greedy:
            top: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
            return acceptance.accept_tree_greedy(draft.tokens, draft.parents, top), lp
        rows = sampling.LazyRows(sampling.probs(lp, params))
        return acceptance.accept_tree_sample(
            draft.tokens, draft.parents, rows, rng, draft.probs
        ), lp
    if params.greedy:
        argmax: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
        return acceptance.accept_greedy(draft.tokens, argmax), lp
    p = sampling.LazyRows(sampling.probs(lp, params))
    if draft.probs is not None:
        return acceptance.accept_rejection(draft.tokens, draft.probs, p, rng), lp
    return acceptance.accept_sample_match(draft.tokens, p, rng), lp


def lazy_draft(ids: mx.array, cap: int, name: str) -> LazyDraft:
    """A LazyDrafter's ids, their shape checked, their computation started (the verify graph is
    built while they compute)."""
    if ids.ndim != 1 or not mx.issubdtype(ids.dtype, mx.integer):
        raise DrafterError(
            f"drafter {name!r} returned lazy ids of shape {tuple(ids.shape)} and dtype "
            f"{ids.dtype}; accepted: (k,) integer ids, or None for no lazy draft"
        )
    if not 1 <= ids.shape[0] <= cap:
        raise DrafterError(
            f"drafter {name!r} proposed {ids.shape[0]} tokens; at most {cap} allowed"
            + (" and at least 1 (None for no lazy draft)" if ids.shape[0] == 0 else "")
        )
    mx.async_eval(ids)
    return LazyDraft(ids, cap, name)
