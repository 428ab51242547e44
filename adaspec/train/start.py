"""What a trained drafter starts from: its shape for a target (taps by z-lab's rule, a mask
token the chat never uses) and its first weights (the target's last layers, or a checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from ..drafters.dflash_checkpoint import load_model
from ..drafters.dflash_model import DFlashConfig, DFlashModel
from ..kernels import stored
from ..prompting import prompt_ids
from ..targets.base import TargetInfo, inner_model, layer_list
from .objective import TrainingError
from .recipe import Recipe


def default_taps(num_layers: int, n: int) -> tuple[int, ...]:
    """n layers spread evenly from layer 1 to layer L-3 (z-lab's rule); fewer on small targets."""
    lo, hi = (1, num_layers - 3) if num_layers >= 5 else (0, num_layers - 1)
    if n == 1:
        return (hi,)
    return tuple(sorted({int(lo + i * (hi - lo) / (n - 1)) for i in range(n)}))


def choose_mask_token(tokenizer: Any, vocab_size: int) -> tuple[int, str]:
    """An id the drafter's MASK slots embed with, and why it was chosen: the last added special
    token that is neither BOS/EOS/PAD nor used by the chat template."""
    reserved = set(getattr(tokenizer, "eos_token_ids", None) or ())
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, attr, None) is not None:
            reserved.add(int(getattr(tokenizer, attr)))
    if getattr(tokenizer, "has_chat_template", False):
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        reserved.update(int(t) for t in prompt_ids(tokenizer, probe))
    specials = sorted(
        int(i) for i in getattr(tokenizer, "all_special_ids", []) or [] if 0 <= i < vocab_size
    )
    added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", {}) or {}
    candidates = sorted({*specials, *(int(i) for i in added if int(i) < vocab_size)} - reserved)
    if candidates:
        tid = candidates[-1]
        name = (
            tokenizer.convert_ids_to_tokens(tid)
            if hasattr(tokenizer, "convert_ids_to_tokens")
            else tid
        )
        return tid, (
            f"the vocabulary has no mask token; id {tid} ({name}) is a special token that is "
            "neither BOS, EOS nor PAD and never appears in chat-formatted text, so its "
            "embedding is free to serve as the MASK input"
        )
    return vocab_size - 1, (
        f"the vocabulary has no mask token and no unused special token; the last id "
        f"{vocab_size - 1} is used as the MASK input (it only ever sits in draft slots)"
    )


def drafter_config(model: Any, info: TargetInfo, recipe: Recipe, mask_id: int) -> DFlashConfig:
    args = vars(getattr(model, "args", object()))
    heads = int(args.get("num_attention_heads") or 8)
    return DFlashConfig(
        hidden_size=info.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=heads,
        num_key_value_heads=int(args.get("num_key_value_heads") or heads),
        head_dim=int(args.get("head_dim") or info.hidden_size // heads),
        intermediate_size=int(args.get("intermediate_size") or 4 * info.hidden_size),
        vocab_size=info.vocab_size,
        target_layer_ids=default_taps(info.num_layers, recipe.n_taps),
        mask_token_id=mask_id,
        block_size=recipe.block,
        rms_norm_eps=float(args.get("rms_norm_eps") or 1e-6),
        rope_theta=float(args.get("rope_theta") or 10000.0),
        max_position_embeddings=int(args.get("max_position_embeddings") or 32768),
        num_target_layers=info.num_layers,
    )


def init_from_target(drafter: DFlashModel, target: Any) -> int:
    """Copy the target's last decoder layers (and final norm) into the drafter where shapes
    agree; returns how many weights were copied."""
    layers = layer_list(target)
    src = layers[len(layers) - len(drafter.layers) :]
    copied = []
    for j, layer in enumerate(src):
        theirs = dict(_flat(layer.parameters()))
        for k, v in _flat(drafter.layers[j].parameters()):
            if k in theirs and theirs[k].shape == v.shape:
                copied.append((f"layers.{j}.{k}", stored.dense(theirs[k]).astype(mx.float32)))
    norm = getattr(inner_model(target), "norm", None)
    if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
        copied.append(("norm.weight", stored.dense(norm.weight).astype(mx.float32)))
    drafter.load_weights(copied, strict=False)
    return len(copied)


# what a warm start's checkpoint must share with the drafter being trained (not the block
# size: no weight depends on it, so a drafter may go on training at another block)
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "target_layer_ids",
    "mask_token_id",
)


def init_from_checkpoint(drafter: DFlashModel, folder: Path, info: TargetInfo) -> None:
    """Start from a trained drafter's weights (a warm start); its shape, taps and mask token
    must be the recipe's, its block size may differ."""
    old = load_model(folder, info)
    diff = {
        k: (getattr(old.cfg, k), getattr(drafter.cfg, k))
        for k in _SHAPE_KEYS
        if getattr(old.cfg, k) != getattr(drafter.cfg, k)
    }
    if diff:
        raise TrainingError(
            f"init checkpoint {str(folder)!r} does not match the recipe: "
            + ", ".join(f"{k} is {a}, the recipe gives {b}" for k, (a, b) in diff.items())
            + "; accepted: a checkpoint of the same shape, taps and mask token"
        )
    drafter.load_weights(_flat(old.parameters()), strict=True)


def _flat(params: Any) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(params)  # type: ignore[return-value]  # mlx: a list without destination
