"""Exact target distributions and a chi-square check (they ship in adaspec.testing)."""

from adaspec.testing.distribution import (
    assert_same,
    exact_sequences,
    speculative_counts,
    target_dist,
)

__all__ = ["assert_same", "exact_sequences", "speculative_counts", "target_dist"]
