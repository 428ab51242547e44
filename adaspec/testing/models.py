"""Tiny random-weight mlx-lm models, a byte-level tokenizer, mlx-lm's greedy AR as a reference,
and a writer for model folders: the building blocks of the contract tests."""

from __future__ import annotations

from typing import Any

# isort: off
import adaspec  # noqa: F401  (must come first: loads the fast BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

# isort: on

VOCAB = 260  # 256 bytes + <eos> (256) + spare ids
EOS = 256


def scale_weights(model: nn.Module, scale: float) -> None:
    # Larger random weights spread the logits, so near-ties between batched and single-token
    # forwards (which reduce in different orders) are vanishingly rare.
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))


def tiny_model(
    arch: str = "llama", vocab: int = VOCAB, seed: int = 0, layers: int = 2, scale: float = 4.0
):
    mx.random.seed(seed)
    model: nn.Module
    common: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        from mlx_lm.models import llama

        model = llama.Model(llama.ModelArgs(model_type="llama", **common))
    elif arch == "qwen3":
        from mlx_lm.models import qwen3

        model = qwen3.Model(
            qwen3.ModelArgs(
                model_type="qwen3",
                head_dim=16,
                max_position_embeddings=4096,
                rope_theta=10000.0,
                **common,
            )
        )
    else:
        raise ValueError(arch)
    scale_weights(model, scale)
    mx.eval(model.parameters())
    return model


def byte_tokenizer():
    """A byte-level BPE with no merges (ids 0..255 are bytes) and <eos>=256, mlx-lm wrapped."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    return TokenizerWrapper(fast)


def _byte_of(ch: str) -> int:
    # GPT-2's byte->unicode table: printable bytes map to themselves, the rest to 256+n.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(cs, bs))[ord(ch)]


def ar_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: mlx-lm's own greedy AR (generate_step), first n tokens."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out


def save_tiny(model, tokenizer, folder):
    """Write `model` and `tokenizer` as an mlx-lm model folder (config, weights, tokenizer)."""
    from dataclasses import asdict

    from mlx_lm.utils import save_config, save_model

    folder.mkdir(parents=True)
    save_model(folder, model)
    save_config(asdict(model.args), folder / "config.json")
    tokenizer._tokenizer.save_pretrained(str(folder))
    return folder
