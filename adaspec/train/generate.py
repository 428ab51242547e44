"""Batched greedy decoding of many prompts by the target: each prompt is prefilled alone in
large chunks, the caches are merged into one left-padded batch, and each decoding step is one
GEMM of `rows` tokens (the small-M kernel's size), so a step costs about what one token does."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..kernels.blas import KERNEL_ROWS
from ..targets.base import inner_model
from .store import Answer, ResponseStore

log = logging.getLogger(__name__)

MAX_ROWS = 32
PREFILL_CHUNK = 2048  # prompt tokens per prefill forward


def default_rows() -> int:
    """Decoding rows per batch: what the routed BLAS kernel takes in one pass, at most 32."""
    return max(1, min(MAX_ROWS, KERNEL_ROWS))


def _prefill(model: Any, prompts: Sequence[Sequence[int]], chunk: int) -> tuple[list, mx.array]:
    """Each prompt but its last token through the decoder alone (its own cache, `chunk` tokens
    per forward, no padding and no output projection); the caches merged into one left-padded
    batch cache; then the last tokens through the whole model: (cache, (rows, V) logits)."""
    from mlx_lm.models.cache import make_prompt_cache

    inner = inner_model(model)
    per_prompt = []
    for p in prompts:
        cache = make_prompt_cache(model)
        for s in range(0, len(p) - 1, chunk):
            inner(mx.array(p[s : min(s + chunk, len(p) - 1)])[None], cache=cache)
            mx.eval([c.state for c in cache if not c.empty()])
        per_prompt.append(cache)
    merged = [type(layer[0]).merge(list(layer)) for layer in zip(*per_prompt)]
    last = mx.array([[p[-1]] for p in prompts])
    return merged, model(last, cache=merged)[:, -1]


def greedy_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    eos: set[int],
    prefill_chunk: int = PREFILL_CHUNK,
) -> list[list[int]]:
    """The greedy continuation of every prompt, up to max_new tokens or the first EOS (kept),
    decoded together; finished rows leave the batch once a quarter of it has finished."""
    cache, logits = _prefill(model, prompts, prefill_chunk)
    tok = mx.argmax(logits, axis=-1)
    out: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # the prompt index of each cache row
    for _ in range(max_new):
        step = np.array(tok).tolist()
        for r, i in enumerate(rows):
            if len(out[i]) < max_new and (not out[i] or out[i][-1] not in eos):
                out[i].append(int(step[r]))
        live = [r for r, i in enumerate(rows) if len(out[i]) < max_new and out[i][-1] not in eos]
        if not live:
            break
        if len(rows) - len(live) >= max(1, len(rows) // 4):
            keep = mx.array(live)
            for c in cache:
                c.filter(keep)
            rows, step = [rows[r] for r in live], [step[r] for r in live]
        tok = mx.argmax(model(mx.array(step)[:, None], cache=cache)[:, -1], axis=-1)
    return out


def by_length(items: Sequence[tuple[Any, list[int]]], rows: int) -> list[list]:
    """Batches of up to `rows` items of similar prompt length (less padding), longest first."""
    order = sorted(items, key=lambda it: -len(it[1]))
    return [order[i : i + rows] for i in range(0, len(order), rows)]


def answer_prompts(
    model: Any,
    eos: set[int],
    todo: Sequence[tuple[Any, list[int]]],
    store: ResponseStore,
    *,
    max_new: int,
    rows: int,
    progress: bool = True,
) -> int:
    """Answer (PromptRecord, prompt ids) pairs greedily, `rows` at a time; each finished batch
    is appended to the store at once, so a cut-off run keeps it. Returns response tokens made."""
    made = 0
    bar = tqdm(total=len(todo), disable=not progress, desc="responses", unit="prompt")
    for batch in by_length(todo, rows):
        resp = greedy_batch(model, [ids for _, ids in batch], max_new, eos)
        store.append(
            [
                Answer(p.key, p.id, p.heldout, np.array(ids, np.int32), np.array(r, np.int32))
                for (p, ids), r in zip(batch, resp)
            ],
            max_new,
        )
        made += sum(len(r) for r in resp)
        bar.update(len(batch))
        bar.set_postfix(tokens=made)
    bar.close()
    return made
