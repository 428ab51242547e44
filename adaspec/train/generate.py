"""Batched greedy decoding of many prompts by the target: prompts of equal length are prefilled
together in large chunks, two such groups at a time on two CPU streams, the caches are merged
into one left-padded batch, and each decoding step is one GEMM of `rows` tokens (the small-M
kernel's size), so a step costs about what a few tokens do."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..kernels.blas import KERNEL_ROWS, library_threads
from ..targets.base import inner_model
from .store import Answer, ResponseStore

log = logging.getLogger(__name__)

MAX_ROWS = 32
PREFILL_CHUNK = 2048  # prompt tokens per prefill forward and row
PREFILL_TOKENS = 8192  # most tokens (rows x chunk) in one prefill forward
PREFILL_STREAMS = 2  # prefill groups run at once, each on its own thread (one BLAS thread each)


def default_rows() -> int:
    """Decoding rows per batch: what the routed BLAS kernel takes in one pass, at most 32."""
    return max(1, min(MAX_ROWS, KERNEL_ROWS))


def prefill_groups(lengths: Sequence[int], chunk: int) -> list[list[int]]:
    """Indices of prompts of equal length, each group small enough for one prefill forward:
    a row's keys and values are then bit for bit those of the prompt prefilled alone."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    out = []
    for n, idx in by_len.items():
        size = max(1, PREFILL_TOKENS // max(1, min(n, chunk)))
        out += [idx[k : k + size] for k in range(0, len(idx), size)]
    return out


def _prefill_group(model: Any, rows: Sequence[Sequence[int]], chunk: int) -> list:
    """The rows (equal lengths) but their last token through the decoder, without the output
    projection: one cache of len(rows) rows (lazy; the caller evaluates)."""
    from mlx_lm.models.cache import make_prompt_cache

    inner, cache = inner_model(model), make_prompt_cache(model)
    n = len(rows[0]) - 1
    for s in range(0, n, chunk):
        inner(mx.array([r[s : min(s + chunk, n)] for r in rows]), cache=cache)
    return cache


def _split_rows(cache: list, count: int) -> list[list]:
    """A cache of `count` rows as `count` one-row caches (views, no copy)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for i in range(count):
        row = []
        for c in cache:
            r = KVCache()
            if c.keys is not None:
                r.keys, r.values, r.offset = c.keys[i : i + 1], c.values[i : i + 1], c.offset
            row.append(r)
        out.append(row)
    return out


def prefill_batch(
    model: Any, prompts: Sequence[Sequence[int]], chunk: int
) -> tuple[list, mx.array]:
    """Every prompt but its last token through the decoder (groups of equal length together,
    PREFILL_STREAMS groups at once on their own threads); the caches merged into one
    left-padded batch cache; then the last tokens through the whole model: (cache, logits)."""
    groups = prefill_groups([len(p) for p in prompts], chunk)
    groups.sort(key=lambda g: -len(g) * len(prompts[g[0]]))  # groups run at once: alike
    per_prompt: list = [None] * len(prompts)
    streams = cpu_streams()
    with library_threads(1):
        for k in range(0, len(groups), len(streams)):
            done = []
            for g, stream in zip(groups[k : k + len(streams)], streams):
                with mx.stream(stream):
                    done.append((g, _prefill_group(model, [prompts[i] for i in g], chunk)))
            mx.eval([[c.state for c in cache if not c.empty()] for _, cache in done])
            for g, cache in done:
                for i, row in zip(g, _split_rows(cache, len(g))):
                    per_prompt[i] = row
    merged = [type(layer[0]).merge(list(layer)) for layer in zip(*per_prompt)]
    last = mx.array([[p[-1]] for p in prompts])
    return merged, model(last, cache=merged)[:, -1]


_STREAMS: list = []


def cpu_streams() -> list:
    """PREFILL_STREAMS CPU streams, made once per process (each has its own thread)."""
    while len(_STREAMS) < PREFILL_STREAMS:
        _STREAMS.append(mx.new_stream(mx.cpu))
    return _STREAMS


def greedy_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    eos: set[int],
    prefill_chunk: int = PREFILL_CHUNK,
) -> list[list[int]]:
    """The greedy continuation of every prompt, up to max_new tokens or the first EOS (kept),
    decoded together; finished rows leave the batch once a quarter of it has finished. Each
    step is queued before the previous one's tokens are read, so building a step's graph and
    the bookkeeping overlap the computing."""
    cache, logits = prefill_batch(model, prompts, prefill_chunk)
    tok = mx.argmax(logits, axis=-1)
    out: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # the prompt index of each cache row
    for t in range(max_new):
        nxt = None
        if t + 1 < max_new:  # rows that have just finished compute one token too many
            nxt = mx.argmax(model(tok[:, None], cache=cache)[:, -1], axis=-1)
            mx.async_eval(nxt)
        step = cast(list[int], tok.tolist())  # tok is (rows,) ids; mlx types tolist() loosely
        for r, i in enumerate(rows):
            if not out[i] or out[i][-1] not in eos:
                out[i].append(int(step[r]))
        live = [r for r, i in enumerate(rows) if out[i][-1] not in eos]
        if not live or nxt is None:
            break
        if len(rows) - len(live) >= max(1, len(rows) // 4):
            keep = mx.array(live)
            for c in cache:
                c.filter(keep)
            rows, nxt = [rows[r] for r in live], nxt[keep]
        tok = nxt
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
        made += answer_batch(model, eos, batch, store, max_new)
        bar.update(len(batch))
        bar.set_postfix(tokens=made)
    bar.close()
    return made


def answer_batch(
    model: Any,
    eos: set[int],
    batch: Sequence[tuple[Any, list[int]]],
    store: ResponseStore,
    max_new: int,
) -> int:
    """Answer (PromptRecord, prompt ids) pairs together, greedily, and append them to the store
    as one shard. Returns the response tokens made."""
    resp = greedy_batch(model, [ids for _, ids in batch], max_new, eos)
    store.append(
        [
            Answer(p.key, p.id, p.heldout, np.array(ids, np.int32), np.array(r, np.int32))
            for (p, ids), r in zip(batch, resp)
        ],
        max_new,
    )
    return sum(len(r) for r in resp)
