"""The DFlash training objective as pure numpy: random anchors, the block attention mask, the
block labels and their position weights, and tau from predicted blocks (DESIGN §3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import AdaspecError

# The paper's decay constants; other block sizes interpolate (gamma ~ 0.44 * B).
_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


class TrainingError(AdaspecError):
    """Bad training input: arguments, data or a resumed run that does not match."""


def default_gamma(block: int) -> float:
    return _GAMMA.get(block, max(1.0, 0.44 * block))


def position_weights(block: int, gamma: float) -> np.ndarray:
    """(B-1,) weights exp(-(k-1)/gamma) of draft positions k = 1..B-1: early tokens matter more,
    because a draft is only accepted up to its first miss."""
    if block < 2 or gamma <= 0:
        raise TrainingError(
            f"block={block}, gamma={gamma} are invalid; accepted: block >= 2 and gamma > 0"
        )
    return np.exp(-np.arange(block - 1) / gamma)


def sample_anchors(rng: np.random.Generator, start: int, end: int, n: int) -> np.ndarray:
    """Up to n distinct sorted anchor positions a with start <= a < end - 1 (each anchor is
    followed by at least one label inside the sequence)."""
    lo, hi = max(start, 0), end - 1
    if hi <= lo or n <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.sort(rng.choice(np.arange(lo, hi), size=min(n, hi - lo), replace=False))


@dataclass(frozen=True)
class BlockBatch:
    """The blocks of one training sequence.

    inputs: (A, B) token ids [token[a], MASK, ..., MASK] per anchor a.
    labels: (A, B-1) token[a+1 .. a+B-1] (0 where past the end).
    valid: (A, B-1) bool, False past the end of the sequence.
    anchors: (A,) absolute positions of the blocks' first slot.
    """

    inputs: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    anchors: np.ndarray


def make_blocks(tokens: np.ndarray, anchors: np.ndarray, block: int, mask_id: int) -> BlockBatch:
    T = len(tokens)
    if len(anchors) and (anchors.min() < 0 or anchors.max() >= T - 1):
        raise TrainingError(
            f"anchors {anchors.min()}..{anchors.max()} are invalid for a sequence of {T} "
            f"tokens; accepted: 0..{T - 2}"
        )
    pos = anchors[:, None] + np.arange(1, block)[None]  # (A, B-1) label positions
    valid = pos < T
    labels = np.where(valid, tokens[np.minimum(pos, T - 1)], 0)
    inputs = np.full((len(anchors), block), mask_id, dtype=np.int64)
    inputs[:, 0] = tokens[anchors]
    return BlockBatch(inputs, labels, valid, anchors)


def block_mask(anchors: np.ndarray, ctx_len: int, block: int, causal: bool = False) -> np.ndarray:
    """(A, 1, B, ctx_len + B) bool: block i sees context rows p < anchors[i] (the positions
    committed before its first slot, exactly what inference caches) and its own B slots
    (all of them, or only earlier ones when causal)."""
    A = len(anchors)
    ctx = np.arange(ctx_len)[None, None, :] < anchors[:, None, None]  # (A, 1, S)
    own = np.tril(np.ones((block, block), bool)) if causal else np.ones((block, block), bool)
    m = np.concatenate(
        [np.broadcast_to(ctx, (A, block, ctx_len)), np.broadcast_to(own, (A, block, block))],
        axis=2,
    )
    return m[:, None]


def group_mask(anchors: np.ndarray, ctx_len: int, block: int, causal: bool = False) -> np.ndarray:
    """(S, 1, A*B, ctx_len + A*B) bool for anchors (S, A): the blocks of one sequence attend as
    one row of queries; each sees what block_mask gives it and none of the other blocks."""
    S, A = anchors.shape
    out = np.zeros((S, 1, A * block, ctx_len + A * block), bool)
    for s in range(S):
        m = block_mask(anchors[s], ctx_len, block, causal)[:, 0]  # (A, B, ctx_len + B)
        out[s, 0, :, :ctx_len] = m[:, :, :ctx_len].reshape(A * block, ctx_len)
        for i in range(A):
            rows = slice(i * block, (i + 1) * block)
            out[s, 0, rows, ctx_len + i * block : ctx_len + (i + 1) * block] = m[i, :, ctx_len:]
    return out


def accepted_lengths(pred: np.ndarray, labels: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """(A,) number of leading draft tokens equal to the labels: what greedy verification would
    accept. tau of a block = accepted + 1 (the bonus token)."""
    ok = (pred == labels) & valid
    return np.cumprod(ok, axis=1).sum(axis=1)
