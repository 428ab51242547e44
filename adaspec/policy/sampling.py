"""Target distributions as mlx-lm's AR path builds them: processors, filters, temperature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import GenerationArgumentError

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler knobs; temp 0 is greedy. top_p applies when 0 < top_p < 1."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def check(self, vocab_size: int) -> SamplingParams:
        def bad(name: str, value: object, accepted: str) -> GenerationArgumentError:
            return GenerationArgumentError(f"{name}={value!r} is invalid; accepted: {accepted}")

        if not (np.isfinite(self.temp) and self.temp >= 0):
            raise bad("temp", self.temp, "a finite number >= 0 (0 = greedy)")
        if not 0 <= self.top_p <= 1:
            raise bad("top_p", self.top_p, "0 <= top_p <= 1 (0 or 1 = off)")
        if not (isinstance(self.top_k, int) and 0 <= self.top_k < vocab_size):
            raise bad("top_k", self.top_k, f"an integer in 0..{vocab_size - 1} (0 = off)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "0 <= min_p <= 1 (0 = off)")
        if not (isinstance(self.min_tokens_to_keep, int) and self.min_tokens_to_keep >= 1):
            raise bad("min_tokens_to_keep", self.min_tokens_to_keep, "an integer >= 1")
        return self


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


def logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filtered(lp: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's make_sampler filter chain, in its order (top-p, min-p, top-k)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if 0 < params.top_p < 1.0:
        lp = apply_top_p(lp, params.top_p)
    if params.min_p != 0.0:
        lp = apply_min_p(lp, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        lp = apply_top_k(lp, params.top_k)
    return lp


def probs(lp: mx.array, params: SamplingParams) -> mx.array:
    """The distribution mlx-lm's categorical sampler draws from: softmax(filtered / temp)."""
    return mx.softmax(filtered(lp, params) * (1.0 / params.temp), axis=-1)


class LazyRows:
    """Rows of an (n, V) mx array, converted to float64 numpy only when first read."""

    def __init__(self, matrix: mx.array):
        self._m = matrix
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self._m.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._rows:
            self._rows[i] = np.asarray(self._m[i], dtype=np.float64)
        return self._rows[i]
