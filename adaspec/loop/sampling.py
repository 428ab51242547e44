"""What the decode loop does with the target's logits beside the distributions themselves
(adaspec.distributions): logits processors, lazily read rows, p1, the end-of-sequence cut."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..distributions import logprobs, probs  # noqa: F401  (the loop's distributions)
from ..sampling_params import SamplingParams  # noqa: F401

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def apply_processors(
    logits: mx.array, history: Sequence[int], fed: Sequence[int], processors: Sequence
) -> mx.array:
    """Run mlx-lm logits processors row by row, each row seeing the tokens before it.

    logits: (n, V), row i predicts the token after fed[i]; history ends with fed[0].
    """
    if not processors:
        return logits
    rows = []
    base = list(history)
    for i in range(logits.shape[0]):
        tokens = mx.array(base + list(fed[1 : i + 1]), dtype=mx.uint32)
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


class LazyRows(Sequence[np.ndarray]):
    """Rows of an (n, V) mx array, converted to float64 numpy only when first read."""

    def __init__(self, matrix: mx.array):
        self._m = matrix
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self._m.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        if i not in self._rows:
            self._rows[i] = np.asarray(self._m[i], dtype=np.float64)
        return self._rows[i]


def top1_prob(logprobs_row: mx.array) -> float:
    """The target's top-1 probability from one row of log-probabilities (the entropy gate's p1)."""
    p1: float = mx.exp(mx.max(logprobs_row)).item()  # type: ignore[assignment]
    return float(p1)


def cut_at_eos(tokens: Sequence[int], eos_ids: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first end-of-sequence id: nothing after it is emitted."""
    out = list(tokens)
    for j, t in enumerate(out):
        if t in eos_ids:
            return out[: j + 1]
    return out
