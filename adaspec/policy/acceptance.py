"""Lossless acceptance rules as pure functions over token ids and probability rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import DrafterError
from ..sampling_params import sample


@dataclass(frozen=True)
class Outcome:
    """accepted: drafted tokens kept (0..k); tokens: what the step commits, i.e.
    draft[:accepted] followed by one target token (the correction or the bonus)."""

    accepted: int
    tokens: tuple[int, ...]


def accept_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> Outcome:
    """T=0: keep the longest prefix equal to the target's argmax, then its next argmax.

    target_argmax: (k+1,) argmax of the target at each fed position.
    """
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return Outcome(n, (*draft[:n], int(target_argmax[n])))


def accept_sample_match(
    draft: Sequence[int], p: Sequence[np.ndarray], rng: np.random.Generator
) -> Outcome:
    """T>0, deterministic draft: sample the target at each position, keep while it matches.

    Equivalent to rejection sampling with one-hot q, so each emitted token ~ p. p: (k+1, V) rows.
    """
    for i, d in enumerate(draft):
        x = sample(p[i], rng.random())
        if x != d:
            return Outcome(i, (*draft[:i], x))
    return Outcome(len(draft), (*draft, sample(p[len(draft)], rng.random())))


def accept_rejection(
    draft: Sequence[int],
    q: np.ndarray,
    p: Sequence[np.ndarray],
    rng: np.random.Generator,
) -> Outcome:
    """T>0, stochastic draft (Leviathan/Chen): accept d_i w.p. min(1, p_i(d)/q_i(d)); on the
    first rejection emit a draw from norm(max(0, p_i - q_i)); if all pass, a bonus draw from p_k.

    q: (k, V) the drafter's distributions (each draft[i] ~ q[i]); p: (k+1, V) target rows.
    """
    for i, d in enumerate(draft):
        qd = float(q[i, d])
        if not qd > 0:
            raise DrafterError(
                f"draft token {d} at position {i} has drafter probability {qd}; a stochastic "
                "draft must only contain tokens its own q gives positive probability"
            )
        pi = p[i]
        if rng.random() * qd < pi[d]:
            continue
        residual = np.maximum(pi - q[i], 0.0)
        if not residual.sum() > 0:  # only reachable through rounding: fall back to p itself
            residual = pi
        return Outcome(i, (*draft[:i], sample(residual, rng.random())))
    return Outcome(len(draft), (*draft, sample(p[len(draft)], rng.random())))
