"""`train_dflash`: corpus -> prompts -> the target's responses (kept in a response store) ->
one target forward per sequence (tap features + the target's labels) -> trained drafter in
z-lab's format with a model card. Every stage resumes from what is on disk."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..drafters.dflash_checkpoint import save_model
from ..drafters.dflash_model import DFlashModel
from ..drafters.restricted_head import select_head_tokens
from ..prompting import prompt_ids
from ..targets.base import TargetInfo, embedding_and_head, target_info
from . import card
from .corpus import SOURCES, PromptRecord, build_prompts
from .data import TrainSeq, extract_features, load_labels
from .generate import answer_prompts, default_rows
from .objective import TrainingError
from .recipe import Recipe
from .requests import missing, write_and_answer
from .start import (  # noqa: F401  (default_taps is part of this module's interface)
    choose_mask_token,
    default_taps,
    drafter_config,
    init_from_checkpoint,
    init_from_target,
)
from .store import Answer, ResponseStore, shown_path
from .trainer import Trainer

log = logging.getLogger(__name__)


def _build(recipe: Recipe) -> list[PromptRecord]:
    return build_prompts(
        Path(recipe.corpus),
        n_news=recipe.n_news,
        n_code=recipe.n_code,
        n_open=recipe.n_open,
        n_brief=recipe.n_brief,
        n_topic=recipe.n_topic,
        seed=recipe.hyper.seed,
        heldout=recipe.heldout,
    )


def _prompts(work: Path, recipe: Recipe) -> list[PromptRecord]:
    built = _build(recipe)
    path = work / "prompts.jsonl"
    if path.is_file():
        # growing a source's count (--n-news, ...) keeps the earlier prompts and their responses
        new = {p.id: p for p in built}
        old = [PromptRecord.from_json(json.loads(x)) for x in path.read_text().splitlines()]
        if any(p.id in new and new[p.id] != p for p in old):
            raise TrainingError(
                f"{str(path)!r} holds prompts of another recipe; accepted: the same corpus "
                "and seed to resume (counts may change), or a new --out folder"
            )
    path.write_text("".join(json.dumps(p.to_json()) + "\n" for p in built))
    return built


def fingerprint(info: TargetInfo, tokenizer: Any) -> dict:
    """What a response store must match: the target's shape, its tokenizer (ids of a probe text
    and of the chat template) and a digest of some embedding rows (its weights)."""
    probe = [int(t) for t in tokenizer.encode("Hello, world.\ndef f(x):\n    return x\n")]
    probe += prompt_ids(tokenizer, [{"role": "user", "content": "x"}])
    embed, _ = embedding_and_head(info.model)
    rows = np.round(np.array(embed(mx.arange(8)).astype(mx.float32)), 2)
    return {
        "model_type": info.model_type,
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "num_layers": info.num_layers,
        "tokenizer": hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:16],
        "weights": hashlib.sha256(rows.tobytes()).hexdigest()[:16],
    }


def respond_order(prompts: Sequence[PromptRecord]) -> list[PromptRecord]:
    """The order prompts are answered in: news, code, open, brief and topic taking turns, each
    in its own order (so a prefix stays a prefix when one source's count grows)."""
    groups = [[p for p in prompts if p.source == s] for s in SOURCES]
    out = []
    for i in range(max(map(len, groups))):
        out += [g[i] for g in groups if i < len(g)]
    return out


def _answered(a: Answer) -> TrainSeq:
    return TrainSeq(a.id, a.heldout, np.concatenate([a.prompt, a.response]), len(a.prompt))


def sequences(
    prompts: Sequence[PromptRecord], ids: Sequence[list[int]], answers: dict[str, Answer]
) -> list[TrainSeq]:
    """Every prompt as a sequence (prompt + stored response, or the prompt alone), then every
    stored answer to a prompt this recipe does not build (the store is data in its own right)."""
    out, seen = [], set()
    for p, pid in zip(prompts, ids):
        if p.key in answers:
            out.append(_answered(answers[p.key]))
            seen.add(p.key)
        elif len(pid) >= 2:
            out.append(TrainSeq(p.id, p.heldout, np.array(pid, np.int32), len(pid)))
    out += [_answered(a) for k, a in sorted(answers.items()) if k not in seen]
    return out


def make_data(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[PromptRecord],
    store: ResponseStore,
    recipe: Recipe,
    *,
    progress: bool = True,
) -> list[TrainSeq]:
    """Answer the prompts the recipe asks for that the store lacks, then build the sequences."""
    ids = [prompt_ids(tokenizer, list(p.messages))[-recipe.max_prompt :] for p in prompts]
    answers = store.load()
    by_key = {p.key: pid for p, pid in zip(prompts, ids)}
    order = respond_order(prompts)[: recipe.respond]
    todo = [(p, by_key[p.key]) for p in order if p.key not in answers]
    rows = recipe.gen_batch or default_rows()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    if todo:
        log.info("answering %d prompts (%d already in %s)", len(todo), len(answers), store.folder)
        answer_prompts(
            model, eos, todo, store, max_new=recipe.max_new, rows=rows, progress=progress
        )
    unwritten = missing(recipe.n_self, answers.values())
    if unwritten:
        write_and_answer(
            model,
            tokenizer,
            store,
            unwritten,
            eos,
            seed=recipe.hyper.seed,
            heldout=recipe.heldout,
            max_prompt=recipe.max_prompt,
            max_new=recipe.max_new,
            rows=rows,
            progress=progress,
        )
    if todo or unwritten or recipe.shard_range is not None:  # new answers, or shards to train
        answers = store.load(recipe.shard_range)
    return sequences(prompts, ids, answers)


def data_summary(seqs: Sequence[TrainSeq]) -> dict:
    train = [s for s in seqs if not s.heldout]
    return {
        "train_sequences": len(train),
        "heldout_sequences": len(seqs) - len(train),
        "answered_train_sequences": sum(s.has_response for s in train),
        "train_prompt_tokens": int(sum(s.prompt_len for s in train)),
        "train_response_tokens": int(sum(len(s.tokens) - s.prompt_len for s in train)),
        # every position after the first has a first-draft-position label
        "train_first_labels": int(sum(len(s.tokens) - 1 for s in train)),
    }


def plan(model: Any, tokenizer: Any, recipe: Recipe, data: str | Path) -> dict:
    """What a run of `recipe` would train on, read from the corpus and the store in `data`,
    without generating, computing features or training."""
    prompts = _build(recipe)
    store = ResponseStore(data, fingerprint(target_info(model, tokenizer), tokenizer))
    answers = store.load()
    ids = [prompt_ids(tokenizer, list(p.messages))[-recipe.max_prompt :] for p in prompts]
    order = respond_order(prompts)[: recipe.respond]
    trained = answers if recipe.shard_range is None else store.load(recipe.shard_range)
    return {
        "store": str(store.folder),
        "prompts": len(prompts),
        "stored_answers": len(answers),
        "to_answer": sum(p.key not in answers for p in order),
        "self_requests_to_write": len(missing(recipe.n_self, answers.values())),
        **data_summary(sequences(prompts, ids, trained)),
    }


def grow(
    model: Any, tokenizer: Any, recipe: Recipe, data: str | Path, progress: bool = True
) -> dict:
    """Answer the prompts `recipe` asks for that the store in `data` lacks (the generation stage
    alone); returns the store's index."""
    store = ResponseStore(data, fingerprint(target_info(model, tokenizer), tokenizer))
    make_data(model, tokenizer, _build(recipe), store, recipe, progress=progress)
    return store.write_index() if store.shards() else {"sequences": 0}


def _drafter(model: Any, cfg: Any, info: TargetInfo, recipe: Recipe) -> DFlashModel:
    mx.random.seed(recipe.hyper.seed)
    drafter = DFlashModel(cfg)
    if recipe.init == "target":
        init_from_target(drafter, model)
    elif recipe.warm_start is not None:
        init_from_checkpoint(drafter, recipe.warm_start, info)
    return drafter


def head_set(
    seqs: list, features: Path, recipe: Recipe, vocab_size: int, tokenizer: Any
) -> np.ndarray | None:
    """The draft head's ids: the target's most frequent predictions over the training
    sequences' labels, EOS first; None for the full vocabulary (recipe.head 0 or >= V)."""
    if not 0 < recipe.head < vocab_size:
        return None
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in seqs:
        if not s.heldout:
            greedy = load_labels(features, s, recipe.hyper.label_k).greedy
            counts += np.bincount(greedy, minlength=vocab_size)[:vocab_size]
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
    return select_head_tokens(counts, recipe.head, always=[i for i in eos if i < vocab_size])


def _mask_token(tokenizer: Any, vocab_size: int, recipe: Recipe) -> tuple[int, str]:
    """The drafter's mask token id and why it was chosen."""
    if recipe.mask_token_id is None:
        return choose_mask_token(tokenizer, vocab_size)
    return recipe.mask_token_id, "given by the caller (--mask-token-id)"


def _record(recipe: Recipe) -> dict:
    """The recipe as metrics.json keeps it (the store's path relative to the checkout)."""
    data = recipe.data and shown_path(recipe.data)
    return {**asdict(recipe), "data": data, "hyper": asdict(recipe.hyper)}


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
    mask_id, why = _mask_token(tokenizer, info.vocab_size, recipe)
    cfg = drafter_config(model, info, recipe, mask_id)
    # which target the drafter was trained for: lets adaspec pick a shipped drafter by default
    # in_auto: set to true by hand once `pld+dflash:OUT` beats `pld` on the dev suite
    cfg.extra["adaspec_target"] = dict(name=target_name, model_type=info.model_type, in_auto=False)
    prompts = _prompts(work, recipe)
    store = ResponseStore(recipe.data or work / "responses", fingerprint(info, tokenizer))
    seqs = make_data(model, tokenizer, prompts, store, recipe, progress=progress)
    k = recipe.hyper.label_k
    extract_features(model, seqs, cfg.target_layer_ids, work / "features", k, progress=progress)
    drafter = _drafter(model, cfg, info, recipe)
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
    head = head_set(seqs, work / "features", recipe, info.vocab_size, tokenizer)
    save_model(drafter, out, dtype="float16", head_token_ids=head)
    metrics = {
        "recipe": _record(recipe),
        "mask_token": {"id": mask_id, "why": why},
        "data": {
            "prompts": len(prompts),
            "store": shown_path(store.folder),
            **data_summary(seqs),
            "labels_by_depth": trainer.label_counts(),
        },
        "head_tokens": 0 if head is None else len(head),
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
