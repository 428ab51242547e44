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
    draft[:accepted] followed by one target token (the correction or the bonus). path: for a
    tree, the accepted nodes from the root down (() for a chain: nodes 0..accepted-1)."""

    accepted: int
    tokens: tuple[int, ...]
    path: tuple[int, ...] = ()


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


def children(parents: Sequence[int]) -> list[list[int]]:
    """kids[p + 1]: the nodes whose parent is p (p = -1: the last committed token), in order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def _tree_outcome(tokens: Sequence[int], path: list[int], last: int) -> Outcome:
    return Outcome(len(path), (*(tokens[i] for i in path), int(last)), tuple(path))


def accept_tree_greedy(
    tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]
) -> Outcome:
    """T=0 over a tree: from the root, follow the child equal to the target's argmax at its
    parent; the argmax after the deepest accepted node is the step's last token.

    target_argmax: (n+1,) row 0 after the last committed token, row i+1 after node i.
    """
    kids, cur = children(parents), -1
    path: list[int] = []
    while True:
        t = int(target_argmax[cur + 1])
        nxt = next((c for c in kids[cur + 1] if tokens[c] == t), None)
        if nxt is None:
            return _tree_outcome(tokens, path, t)
        path.append(nxt)
        cur = nxt


def accept_tree_sample(
    tokens: Sequence[int],
    parents: Sequence[int],
    p: Sequence[np.ndarray],
    rng: np.random.Generator,
    q: np.ndarray | None = None,
) -> Outcome:
    """T>0 over a tree (SpecInfer's recursive multi-candidate rejection sampling): at each
    level try the children in order, child c with min(1, p(x)/q_c(x)); after a rejection the
    target row becomes norm(max(0, p - q_c)); if every child is rejected (or there is none)
    the step ends on a draw from what is left. Each emitted token ~ the target's row.

    p: (n+1, V) target rows as for accept_tree_greedy. q: (n, V) the distribution each node was
    drawn from (given its parent and earlier siblings); None: deterministic nodes (one-hot q).
    """
    kids, cur = children(parents), -1
    path: list[int] = []
    while True:
        row = np.asarray(p[cur + 1], dtype=np.float64)
        nxt = None
        for c in kids[cur + 1]:
            x = tokens[c]
            qc = _one_hot(x, row.shape[0]) if q is None else q[c]
            qx = float(qc[x])
            if not qx > 0:
                raise DrafterError(
                    f"tree node {c} (token {x}) has drafter probability {qx}; a stochastic "
                    "draft must only contain tokens its own q gives positive probability"
                )
            if rng.random() * qx < row[x]:
                nxt = c
                break
            residual = np.maximum(row - qc, 0.0)
            if residual.sum() > 0:  # zero only through rounding: keep the row
                row = residual / residual.sum()
        if nxt is None:
            return _tree_outcome(tokens, path, sample(row, rng.random()))
        path.append(nxt)
        cur = nxt


def _one_hot(x: int, n: int) -> np.ndarray:
    e = np.zeros(n)
    e[x] = 1.0
    return e
