"""The DFlash training objective as pure numpy (docs/training.md): random anchors, the block
labels from the target's greedy predictions, the block attention mask, position weights, tau."""

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
    """Up to n distinct sorted anchor positions a with start <= a < end."""
    lo, hi = max(start, 0), end
    if hi <= lo or n <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.sort(rng.choice(np.arange(lo, hi), size=min(n, hi - lo), replace=False))


def on_chain(tokens: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """(T,) bool: token p equals the target's greedy prediction after tokens[:p] (greedy[p-1]);
    position 0 is never on the chain."""
    on = np.zeros(len(tokens), bool)
    on[1:] = tokens[1:] == greedy[:-1]
    return on


@dataclass(frozen=True)
class BlockBatch:
    """The blocks of one training sequence, labelled by the target's own greedy predictions.

    inputs: (A, B) token ids [token[a], MASK, ..., MASK] per anchor a.
    labels: (A, B-1) greedy[a+j-1] for draft position j = 1..B-1 (0 where not valid).
    valid: (A, B-1) bool: the label is what greedy decoding would produce there.
    source: (A, B-1) the position whose target prediction is the label (clipped to T-1).
    anchors: (A,) absolute positions of the blocks' first slot.
    """

    inputs: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    source: np.ndarray
    anchors: np.ndarray


def make_blocks(
    tokens: np.ndarray, greedy: np.ndarray, anchors: np.ndarray, block: int, mask_id: int
) -> BlockBatch:
    """Blocks at `anchors` over any text. greedy[p] is the target's argmax after tokens[:p+1].
    Draft position j of the block at a is labelled greedy[a+j-1], valid while that position
    exists and tokens a+1..a+j-1 are all on the greedy chain: the first position is exact on
    any text, deeper ones only where the text is what greedy decoding would have written."""
    T = len(tokens)
    if len(greedy) != T:
        raise TrainingError(f"greedy has {len(greedy)} entries; accepted: {T}, one per token")
    if len(anchors) and (anchors.min() < 0 or anchors.max() >= T):
        raise TrainingError(
            f"anchors {anchors.min()}..{anchors.max()} are invalid for a sequence of {T} "
            f"tokens; accepted: 0..{T - 1}"
        )
    source = anchors[:, None] + np.arange(block - 1)[None]  # (A, B-1): a + j - 1
    inside = source < T
    on = np.append(on_chain(tokens, greedy), False)  # one False past the end
    steps = on[np.minimum(source[:, 1:], T)]  # on[a+1 .. a+B-2]
    chain = np.cumprod(np.concatenate([np.ones((len(anchors), 1), bool), steps], 1), 1)
    valid = inside & chain.astype(bool)
    source = np.minimum(source, T - 1)
    labels = np.where(valid, greedy[source], 0)
    inputs = np.full((len(anchors), block), mask_id, dtype=np.int64)
    inputs[:, 0] = tokens[anchors]
    return BlockBatch(inputs, labels, valid, source, anchors)


def label_counts(tokens: np.ndarray, greedy: np.ndarray, block: int) -> np.ndarray:
    """(B-1,) how many anchors 1..T-1 of a sequence have a valid label at each draft depth."""
    if len(tokens) < 2:
        return np.zeros(block - 1, dtype=np.int64)
    return make_blocks(tokens, greedy, np.arange(1, len(tokens)), block, 0).valid.sum(0)


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
