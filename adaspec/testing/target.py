"""A tiny target whose text is predictable, and its character tokenizer.

The target is a real mlx-lm llama model (attention, KV cache, rollback all as usual) with 32
tokens: 31 characters and <eos>. Its embeddings are orthonormal and its output head maps each
character to the next one in a short word-shaped cycle ("the ", "quick,", ...), so its greedy
text is those words repeated: a drafter that copies earlier text, learns bigrams or runs a copy
of the target gets drafts accepted. The attention and MLP layers keep a small random part, so
the sampled distribution depends on the context (the next cycle character has probability
~0.35 at temperature 1, the other tokens share the rest).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, cast

import mlx.core as mx
import numpy as np

CYCLES = ("the ", "quick,", "brown.", "fly!", "jam\n", "dgpsvxz")
ALPHABET = "".join(CYCLES)  # token id i is ALPHABET[i]
TINY_EOS = len(ALPHABET)  # 31: <eos>, never the greedy choice
TINY_VOCAB = TINY_EOS + 1
_HIDDEN = 64


def next_char_id(token: int) -> int | None:
    """The greedy successor of `token` (None for <eos>)."""
    if not 0 <= token < len(ALPHABET):
        return None
    ch = ALPHABET[token]
    word = next(w for w in CYCLES if ch in w)
    return ALPHABET.index(word[(word.index(ch) + 1) % len(word)])


@lru_cache(maxsize=4)
def tiny_target(seed: int = 0, peak: float = 3.0, mix: float = 0.2) -> Any:
    """The predictable target: an mlx-lm llama model over the 32-token vocabulary (the same
    object for the same arguments, so a drafter built on it and check_drafter share it).

    peak: the logit of the cycle's next character (3.0: probability ~0.35 at temperature 1);
    mix: the scale of the random attention and MLP outputs (the context's pull on the logits).
    """
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=_HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=TINY_VOCAB,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    model = llama.Model(args)
    # mlx types tree_flatten's result as a list or a dict; it is the list without destination
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    outputs = [(k, p * mix) for k, p in params if k.endswith(("o_proj.weight", "down_proj.weight"))]
    model.update(tree_unflatten(outputs))
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((_HIDDEN, TINY_VOCAB)))
    embed = q.T.astype(np.float32)  # (V, H), orthonormal rows
    head = np.zeros_like(embed)
    for x in range(len(ALPHABET)):
        # the final norm scales a unit row to length sqrt(H): this row's logit becomes `peak`
        head[next_char_id(x)] = embed[x] * peak / np.sqrt(_HIDDEN)
    model.model.embed_tokens.weight = mx.array(embed)
    model.lm_head.weight = mx.array(head)
    mx.eval(model.parameters())
    return model


def tiny_tokenizer() -> Any:
    """One token per character of ALPHABET, <eos> = 31, no BOS; mlx-lm wrapped."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(ALPHABET)}
    vocab["<eos>"] = TINY_EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"))


def encode(text: str) -> list[int]:
    """Token ids of `text` (characters of ALPHABET only)."""
    bad = sorted({c for c in text if c not in ALPHABET})
    if bad:
        raise ValueError(
            f"characters {bad!r} are not in the tiny vocabulary; accepted: {ALPHABET!r}"
        )
    return [ALPHABET.index(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(ALPHABET[i] if i < len(ALPHABET) else "" for i in ids)
