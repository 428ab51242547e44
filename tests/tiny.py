"""The tiny random-weight models and tokenizer the tests use (they ship in adaspec.testing)."""

from adaspec.testing.models import (
    EOS,
    VOCAB,
    ar_greedy,
    byte_tokenizer,
    save_tiny,
    scale_weights,
    tiny_model,
)

_scale = scale_weights  # the name the tests import

__all__ = ["EOS", "VOCAB", "_scale", "ar_greedy", "byte_tokenizer", "save_tiny", "tiny_model"]
