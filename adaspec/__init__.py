"""adaspec: adaptive, lossless speculative decoding for mlx-lm models.

Importing this package loads a fast BLAS on Linux before mlx does; everything heavy (mlx-lm,
transformers) is imported lazily on first use.
"""

from __future__ import annotations

from typing import Any

from .errors import SettingsError as _SettingsError
from .kernels import blas as _blas
from .kernels import jit as _jit
from .settings import get as _get_settings

try:
    _blas.ensure()
    _jit.install(_get_settings().cache, _get_settings().fast_ops)
except _SettingsError:
    # importing stays possible and silent: every call that reads the settings raises this
    # error (the CLI prints it in one line), so nothing runs on bad settings
    pass

__version__ = "0.1.0"

_LAZY = {
    "stream_generate": ("adaspec.api", "stream_generate"),
    "generate": ("adaspec.api", "generate"),
    "make_prompt_cache": ("adaspec.api", "make_prompt_cache"),
    "PromptCache": ("adaspec.api", "PromptCache"),
    "compare_to_ar": ("adaspec.compare", "compare_to_ar"),
    "load": ("adaspec.api", "load"),
    "warm_up": ("adaspec.warmup", "warm_up"),
    "register_drafter": ("adaspec.drafters.registry", "register"),
    "make_drafter": ("adaspec.drafters.arms", "make"),
    "Draft": ("adaspec.drafters.base", "Draft"),
    "DraftModel": ("adaspec.drafters.base", "DraftModel"),
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'adaspec' has no attribute {name!r}")
