"""`train_dflash`: corpus -> prompts -> the target's responses -> tap features -> trained drafter
in z-lab's format with a model card. Every stage keeps its output in OUT/work and resumes."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..drafters.base import TargetInfo
from ..drafters.dflash_checkpoint import load_model, save_model
from ..drafters.dflash_model import DFlashConfig, DFlashModel
from ..prompting import prompt_ids
from ..targets.adapter import inner_model, layer_list, target_info
from . import card
from .corpus import PromptRecord, build_prompts
from .data import extract_features, generate_responses, to_sequences
from .objective import TrainingError
from .recipe import Recipe
from .trainer import Trainer

log = logging.getLogger(__name__)


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
                copied.append((f"layers.{j}.{k}", theirs[k].astype(mx.float32)))
    norm = getattr(inner_model(target), "norm", None)
    if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
        copied.append(("norm.weight", norm.weight.astype(mx.float32)))
    drafter.load_weights(copied, strict=False)
    return len(copied)


# what a warm start's checkpoint must share with the drafter being trained
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
)


def init_from_checkpoint(drafter: DFlashModel, folder: Path, info: TargetInfo) -> None:
    """Start from a trained drafter's weights (a warm start); its shape, block, taps and mask
    token must be the recipe's."""
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
            + "; accepted: a checkpoint of the same shape, block, taps and mask token"
        )
    drafter.load_weights(_flat(old.parameters()), strict=True)


def _flat(params: Any) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def _prompts(work: Path, recipe: Recipe) -> list[PromptRecord]:
    built = build_prompts(
        Path(recipe.corpus),
        n_news=recipe.n_news,
        n_code=recipe.n_code,
        seed=recipe.hyper.seed,
        heldout=recipe.heldout,
    )
    path = work / "prompts.jsonl"
    if path.is_file():
        # growing --n-news/--n-code keeps the earlier prompts (and their responses)
        new = {p.id: p for p in built}
        old = [PromptRecord.from_json(json.loads(x)) for x in path.read_text().splitlines()]
        if any(p.id in new and new[p.id] != p for p in old):
            raise TrainingError(
                f"{str(path)!r} holds prompts of another recipe; accepted: the same corpus "
                "and seed to resume (counts may change), or a new --out folder"
            )
    path.write_text("".join(json.dumps(p.to_json()) + "\n" for p in built))
    return built


def train_dflash(
    model: Any,
    tokenizer: Any,
    out: str | Path,
    recipe: Recipe,
    *,
    target_name: str = "",
    progress: bool = True,
) -> dict:
    """Run (or resume) every stage; returns the metrics written to OUT/metrics.json."""
    out = Path(out).expanduser()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    info = target_info(model, tokenizer)
    if recipe.mask_token_id is None:
        mask_id, why = choose_mask_token(tokenizer, info.vocab_size)
    else:
        mask_id, why = recipe.mask_token_id, "given by the caller (--mask-token-id)"
    cfg = drafter_config(model, info, recipe, mask_id)
    # which target the drafter was trained for: lets adaspec pick a shipped drafter by default
    cfg.extra["adaspec_target"] = {"name": target_name, "model_type": info.model_type}
    prompts = _prompts(work, recipe)
    records = generate_responses(
        model,
        tokenizer,
        prompts,
        work / "responses.jsonl",
        max_prompt=recipe.max_prompt,
        max_new=recipe.max_new,
        batch=recipe.gen_batch,
        progress=progress,
    )
    seqs = to_sequences(records)
    extract_features(model, seqs, cfg.target_layer_ids, work / "features", progress=progress)
    mx.random.seed(recipe.hyper.seed)
    drafter = DFlashModel(cfg)
    if recipe.init == "target":
        init_from_target(drafter, model)
    elif recipe.warm_start is not None:
        init_from_checkpoint(drafter, recipe.warm_start, info)
    trainer = Trainer(
        drafter,
        model,
        [s for s in seqs if not s.heldout],
        [s for s in seqs if s.heldout],
        work / "features",
        work / "state",
        recipe.hyper,
    )
    history = trainer.run(progress=progress)
    save_model(drafter, out, dtype="float16")
    metrics = {
        "recipe": {**asdict(recipe), "hyper": asdict(recipe.hyper)},
        "mask_token": {"id": mask_id, "why": why},
        "data": {
            "prompts": len(prompts),
            "train_sequences": sum(not s.heldout for s in seqs),
            "heldout_sequences": sum(s.heldout for s in seqs),
            "train_response_tokens": int(
                sum(len(s.tokens) - s.prompt_len for s in seqs if not s.heldout)
            ),
        },
        "steps": history.step,
        "loss": history.loss,
        "evals": history.evals,
        "drafter": cfg.to_dict(),
        "final_train_loss": float(np.mean([x[1] for x in history.loss[-20:]])),
    }
    if recipe.warm_start is not None and (recipe.warm_start / "metrics.json").is_file():
        metrics["warm_start"] = json.loads((recipe.warm_start / "metrics.json").read_text())
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    card.write(out, metrics)
    return metrics
