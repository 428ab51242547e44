"""The sampler's knobs and its inverse-CDF draw, which targets, drafters and the policy all
use, so they sit below the three of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GenerationArgumentError


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


def sample(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from an unnormalized non-negative vector p with uniform u in [0, 1)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(p) - 1))


def mlx_lm_sampler(kw: Mapping[str, Any]) -> Any:
    """mlx-lm's sampler for sampling flags given as keywords (`temp`, `top_p`, `min_p`,
    `top_k`; each absent one off, greedy at temp 0)."""
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(
        temp=kw.get("temp", 0.0),
        top_p=kw.get("top_p", 0.0),
        min_p=kw.get("min_p", 0.0),
        top_k=kw.get("top_k", 0),
    )
