"""Helpers for testing drafters, shipped with the package: a tiny target whose text is
predictable, mlx-lm's greedy AR as a reference, hypothesis strategies, and `check_drafter`, the
contract every drafter must pass (hypothesis comes with `pip install 'adaspec[testing]'`).

    from adaspec.testing import check_drafter
    report = check_drafter(lambda: MyDrafter())   # raises DrafterContractError if broken
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "check_drafter": ("adaspec.testing.contract", "check_drafter"),
    "DrafterReport": ("adaspec.testing.contract", "DrafterReport"),
    "DrafterContractError": ("adaspec.testing.watch", "DrafterContractError"),
    "tiny_target": ("adaspec.testing.target", "tiny_target"),
    "tiny_tokenizer": ("adaspec.testing.target", "tiny_tokenizer"),
    "encode": ("adaspec.testing.target", "encode"),
    "decode": ("adaspec.testing.target", "decode"),
    "CYCLES": ("adaspec.testing.target", "CYCLES"),
    "ALPHABET": ("adaspec.testing.target", "ALPHABET"),
    "ar_greedy": ("adaspec.testing.models", "ar_greedy"),
    "tiny_model": ("adaspec.testing.models", "tiny_model"),
    "byte_tokenizer": ("adaspec.testing.models", "byte_tokenizer"),
    "save_tiny": ("adaspec.testing.models", "save_tiny"),
    "exact_sequences": ("adaspec.testing.distribution", "exact_sequences"),
    "assert_same": ("adaspec.testing.distribution", "assert_same"),
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'adaspec.testing' has no attribute {name!r}")
