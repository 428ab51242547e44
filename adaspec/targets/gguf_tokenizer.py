"""Rebuild a Hugging Face `tokenizer.json` (byte-level BPE) from GGUF tokenizer metadata."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ModelLoadError

log = logging.getLogger(__name__)

# gguf.TokenType values (kept here so this module does not import gguf).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the original Hugging Face tokenizers, by GGUF `tokenizer.ggml.pre`.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_SPLIT = {"qwen2": _QWEN2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "smaug-bpe": _LLAMA3}
_GPT2 = {"default", "gpt-2", "gpt2", "olmo", "jais"}

# Tokens llama.cpp also treats as end-of-generation when the vocabulary marks them CONTROL.
_END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def _pre_tokenizer(pre: str) -> tuple[Any, Any]:
    """(normalizer, pre_tokenizer) reproducing the GGUF pre-tokenizer type `pre`."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return None, pre_tokenizers.Sequence([digits, byte_level])
    if pre in _SPLIT:
        split = pre_tokenizers.Split(Regex(_SPLIT[pre]), behavior="isolated", invert=False)
        raw = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        normalizer = normalizers.NFC() if pre == "qwen2" else None
        return normalizer, pre_tokenizers.Sequence([split, raw])
    if pre not in _GPT2:
        log.warning("unknown GGUF pre-tokenizer %r; using GPT-2 byte-level splitting", pre)
    return None, byte_level


def eos_ids(meta: dict[str, Any]) -> list[int]:
    """Every token id that ends generation: eos/eot/eom ids plus known end-of-turn controls."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens", [])
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    ids = [
        meta[f"tokenizer.ggml.{k}_token_id"]
        for k in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{k}_token_id" in meta
    ]
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL and tok in _END_OF_TURN:
            ids.append(i)
    return sorted(set(ids))


def _special(meta: dict[str, Any], key: str) -> str | None:
    """Text of the `key` (bos, eos, unknown, padding) token, if the GGUF names one."""
    tokens = meta["tokenizer.ggml.tokens"]
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def _config(meta: dict[str, Any], add_bos: bool, context_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS policy and the chat template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _special(meta, "bos"),
        "eos_token": _special(meta, "eos"),
        "unk_token": _special(meta, "unknown"),
        "pad_token": _special(meta, "padding"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return {k: v for k, v in config.items() if v is not None}


def build(meta: dict[str, Any], context_length: int) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) for GGUF metadata `meta`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {kind!r} is not supported; accepted: 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if vocab.setdefault(tok, i) != i:
            log.warning("GGUF vocabulary repeats token %r (ids %d and %d)", tok, vocab[tok], i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    normalizer, pre = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.pre_tokenizer = pre
    tk.decoder = decoders.ByteLevel()
    # Control tokens are special (skipped when decoding with skip_special_tokens); user-defined
    # ones are plain added tokens; both are matched whole before BPE, as in llama.cpp.
    added = [
        AddedToken(tok, special=types[i] == CONTROL, normalized=False)
        for i, tok in enumerate(tokens)
        if types[i] in (CONTROL, USER_DEFINED)
    ]
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])
    bos = _special(meta, "bos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos and bos is not None:  # add_bos implies bos; restated for the type checker
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk, _config(meta, add_bos, context_length)
