"""Requests the target writes itself: the chat template's opening of a user turn, continued by
the target with sampling, then answered greedily like any prompt. The requests are as varied
as what the target expects a user to ask (general topics, the kind a chat brings), and
no text comes from outside: both sides of the exchange are the target's own.

Request i is sampled with a generator seeded by (seed, i), so its draws do not depend on the
other rows of its batch; the request ends at the target's end of turn or after MAX_REQUEST
tokens (an empty one is dropped). Written requests are kept only with their answers, in the
response store, and a run knows which indices are done from the stored ids (`self-NNNNN-...`),
so a cut-off job writes only the missing ones."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..prompting import prompt_ids
from .corpus import PromptRecord
from .generate import PREFILL_CHUNK, answer_batch, prefill_batch
from .store import Answer, ResponseStore

SOURCE = "self"
MAX_REQUEST = 96  # tokens of a written request
TOP_K = 64  # a draw is from the TOP_K likeliest tokens ...
TOP_P = 0.95  # ... cut to the smallest set holding TOP_P of their probability
_MARK = "\u2063REQUEST\u2063"
_ID = re.compile(r"self-(\d{5,})-")


def user_opening(tokenizer: Any) -> list[int]:
    """The ids a user turn's text follows: the chat template up to the user's content (the
    default system turn included), or, without a template, the end-of-text token."""
    if getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False
        )
        return list(tokenizer.encode(text[: text.index(_MARK)], add_special_tokens=False))
    return [int(tokenizer.eos_token_id)]


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One token from softmax(logits) restricted to the TOP_K likeliest ids and then to the
    smallest prefix of them (by probability) whose mass reaches TOP_P."""
    k = min(TOP_K, len(logits))
    top = np.argpartition(-logits, k - 1)[:k]
    top = top[np.argsort(-logits[top], kind="stable")]
    p = np.exp(logits[top] - logits[top[0]])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), TOP_P)) + 1
    p = p[:keep] / p[:keep].sum()
    return int(top[min(int(np.searchsorted(np.cumsum(p), rng.random())), keep - 1)])


def sample_requests(
    model: Any, opening: Sequence[int], seeds: Sequence[int], eos: set[int]
) -> list[list[int]]:
    """One request per seed: the opening continued by sampling (each row its own generator),
    until an end-of-turn id (not kept) or MAX_REQUEST tokens."""
    cache, logits = prefill_batch(model, [list(opening)] * len(seeds), PREFILL_CHUNK)
    rngs = [np.random.default_rng(s) for s in seeds]
    out: list[list[int]] = [[] for _ in seeds]
    done = [False] * len(seeds)
    for _ in range(MAX_REQUEST):
        rows = np.array(logits.astype(mx.float32))
        step = []
        for i, (row, rng) in enumerate(zip(rows, rngs)):
            t = draw(row, rng)  # every row draws, so its generator's stream stays its own
            if not done[i]:
                done[i] = t in eos
                if not done[i]:
                    out[i].append(t)
            step.append(t)
        if all(done):
            break
        logits = model(mx.array(step)[:, None], cache=cache)[:, -1]
    return out


def request_record(index: int, text: str, seed: int, heldout: float) -> PromptRecord:
    """Request `index` as a prompt record: held out by a hash of its text (as corpus seeds are)."""
    digest = hashlib.sha256(f"{seed}:{text}".encode()).hexdigest()
    held = int(digest[:8], 16) / 2**32 < heldout
    msgs = ({"role": "user", "content": text},)
    return PromptRecord(f"self-{index:05d}-{digest[:12]}", SOURCE, held, msgs)


def missing(count: int, answers: Iterable[Answer]) -> list[int]:
    """Indices below `count` of the self-written requests without a stored answer."""
    done = {int(m[1]) for a in answers if (m := _ID.match(a.id))}
    return sorted(set(range(count)) - done)


def write_and_answer(
    model: Any,
    tokenizer: Any,
    store: ResponseStore,
    todo: Sequence[int],
    eos: set[int],
    *,
    seed: int,
    heldout: float,
    max_prompt: int,
    max_new: int,
    rows: int,
    progress: bool = True,
) -> int:
    """Requests `todo` (indices): written by the target `rows` at a time, answered greedily,
    each batch appended to the store as one shard. Returns response tokens made."""
    opening, made = user_opening(tokenizer), 0
    bar = tqdm(total=len(todo), disable=not progress, desc="self requests", unit="request")
    for at in range(0, len(todo), rows):
        batch = todo[at : at + rows]
        written = sample_requests(model, opening, [seed * 1_000_003 + i for i in batch], eos)
        texts = [tokenizer.decode(r).strip() for r in written]
        # an empty request (the target ended its turn at once) is not kept
        recs = [request_record(i, t, seed, heldout) for i, t in zip(batch, texts) if t]
        pairs = [(r, prompt_ids(tokenizer, list(r.messages))[-max_prompt:]) for r in recs]
        made += answer_batch(model, eos, pairs, store, max_new) if pairs else 0
        bar.update(len(batch))
        bar.set_postfix(tokens=made)
    bar.close()
    return made
