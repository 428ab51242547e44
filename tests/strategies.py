"""The shared hypothesis strategies (they ship in adaspec.testing.strategies)."""

from adaspec.testing.strategies import (
    LEGAL_MODES,
    mode,
    prob_rows,
    prompts,
    step_program,
    token_trees,
    tree_program,
)

__all__ = [
    "LEGAL_MODES",
    "mode",
    "prob_rows",
    "prompts",
    "step_program",
    "token_trees",
    "tree_program",
]
