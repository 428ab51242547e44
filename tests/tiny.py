"""The tiny random-weight models and tokenizer the tests use (they ship in adaspec.testing)."""

from adaspec.testing.models import EOS, VOCAB, ar_greedy, byte_tokenizer, save_tiny, tiny_model

__all__ = ["EOS", "VOCAB", "ar_greedy", "byte_tokenizer", "save_tiny", "tiny_model"]
