"""A drafter's output head (DFlash's and the draft-model drafter's): the target's lm_head,
optionally restricted to a set of frequent token ids (FR-Spec style), and how that set is
chosen, checked and stored."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import DrafterError
from ..kernels import stored

log = logging.getLogger(__name__)

HEAD_KEY = "head_token_ids"  # optional int32 (n,) tensor in model.safetensors, most frequent first


def select_head_tokens(
    token_counts: np.ndarray, size: int, always: Iterable[int] = ()
) -> np.ndarray:
    """The `size` ids with the highest counts, most frequent first, as int32. Ties (and unseen
    ids) go by id, lower first: byte-level BPE vocabularies number earlier, more frequent merges
    lower. `always` ids (e.g. EOS, rare in counted text but ending every response) come first.

    token_counts: (V,) count per token id, e.g. np.bincount(ids, minlength=V) over the target's
    own argmax predictions or the responses it generated."""
    counts = np.asarray(token_counts)
    V = counts.shape[0] if counts.ndim == 1 else 0
    if counts.ndim != 1 or V == 0 or not np.issubdtype(counts.dtype, np.number):
        raise DrafterError(
            f"token_counts of shape {counts.shape} and dtype {counts.dtype} are invalid; "
            "accepted: a non-empty 1-D array of counts, one per token id"
        )
    if not 1 <= size <= V:
        raise DrafterError(f"head size={size} is invalid; accepted: 1..{V} (the vocabulary)")
    first = list(dict.fromkeys(int(i) for i in always))
    bad = [i for i in first if not 0 <= i < V]
    if bad:
        raise DrafterError(f"always ids {bad} are out of range; accepted: 0..{V - 1}")
    order = np.lexsort((np.arange(V), -counts.astype(np.float64)))
    rest = order[~np.isin(order, first)]
    return np.concatenate([np.array(first, dtype=np.int64), rest])[:size].astype(np.int32)


def check_head_tokens(ids: Any, vocab_size: int, where: str) -> np.ndarray:
    """`ids` as an int32 numpy array if it is a valid head set for `vocab_size`, else a
    DrafterError naming the bad value; `where` says whose set it is (e.g. the checkpoint)."""
    dtype = ids.dtype if hasattr(ids, "dtype") else np.asarray(ids).dtype
    if isinstance(dtype, mx.Dtype):
        integer = mx.issubdtype(dtype, mx.integer)
    else:
        integer = np.issubdtype(dtype, np.integer)
    if not integer:
        name = str(dtype).rpartition(".")[2]  # mlx.core.float16 -> float16
        raise DrafterError(
            f"{where}: {HEAD_KEY} has dtype {name}; accepted: an integer dtype (int32)"
        )
    arr = np.array(ids, dtype=np.int64)
    if arr.ndim != 1 or not 1 <= arr.shape[0] <= vocab_size:
        raise DrafterError(
            f"{where}: {HEAD_KEY} has shape {arr.shape}; accepted: (n,) with 1 <= n <= "
            f"{vocab_size} (the vocabulary)"
        )
    out = arr[(arr < 0) | (arr >= vocab_size)]
    if out.size:
        raise DrafterError(
            f"{where}: {HEAD_KEY} holds {_some(out)} out of range; "
            f"accepted: ids 0..{vocab_size - 1}"
        )
    uniq, counts = np.unique(arr, return_counts=True)
    if uniq.size < arr.size:
        raise DrafterError(
            f"{where}: {HEAD_KEY} holds {_some(uniq[counts > 1])} more than once; "
            "accepted: distinct ids"
        )
    return arr.astype(np.int32)


def _some(values: np.ndarray) -> str:
    shown = ", ".join(str(int(v)) for v in values[:5])
    return (
        f"id {shown}"
        if values.size == 1
        else f"ids {shown}" + (f" (+{values.size - 5} more)" if values.size > 5 else "")
    )


def head_subset(stored: np.ndarray | None, head: int | None) -> np.ndarray | None:
    """The ids a drafter's head keeps: None -> the stored set as it is (None: the full
    vocabulary), 0 -> the full vocabulary, N -> the stored set's first (most frequent) N."""
    if head is None or head == 0:
        return stored if head is None else None
    if stored is None or not 0 < head <= len(stored):
        have = "none" if stored is None else f"{len(stored)} ids"
        raise DrafterError(
            f"dflash head={head} is invalid for a checkpoint whose {HEAD_KEY} holds {have}; "
            "accepted: 0 (the full vocabulary)"
            + ("" if stored is None else f" or 1..{len(stored)}")
        )
    return stored[:head]


def restricted_projection(project: Callable, ids: np.ndarray, vocab_size: int) -> Callable:
    """h -> project(h)[..., ids], computed from the kept rows of the projection's weight only
    (plain or quantized, tied or not); any other head is applied whole, then sliced."""
    # a bound method's module (a tied head is embed.as_linear), else `project` itself; either
    # may be any object: what it holds is probed below
    owner: Any = getattr(project, "__self__", project)
    rows = mx.array(ids.astype(np.int32))
    has = getattr(owner, "__contains__", None)
    if not (has and "weight" in owner and owner["weight"].shape[0] == vocab_size):
        log.warning("restricted head on %s: computed whole, then sliced", type(owner).__name__)
        return lambda h: mx.take(project(h), rows, axis=-1)
    if stored.lookup(owner["weight"]) is not None:  # the kept rows stay at their stored bits
        w, keep = stored.take_rows(owner["weight"], ids)
        bias = owner["bias"][rows] if "bias" in owner else None
        return KeptRows(w, bias, keep)
    w = owner["weight"][rows]
    bias = owner["bias"][rows] if "bias" in owner else None
    if "scales" in owner:
        scales = owner["scales"][rows]
        biases = owner["biases"][rows] if owner.get("biases") is not None else None
        kw = dict(group_size=owner.group_size, bits=owner.bits, mode=owner.mode)
        mx.eval(w, scales, *(a for a in (bias, biases) if a is not None))

        def quantized(h: mx.array) -> mx.array:
            y = mx.quantized_matmul(h, w, scales=scales, biases=biases, transpose=True, **kw)
            return y if bias is None else y + bias

        return quantized
    mx.eval(w, *(() if bias is None else (bias,)))
    return KeptRows(w, bias)


class KeptRows:
    """h -> h @ weight.T (+ bias): a projection onto the kept rows, whose `weight` is an
    array of its own (a drafter may give it a bf16 shadow, adaspec/kernels/shadow.py)."""

    def __init__(self, weight: mx.array, bias: mx.array | None, keep: Any = None):
        self.weight, self.bias = weight, bias
        self.keep = keep  # what keeps a stored weight readable (kernels/stored.py)

    def __call__(self, h: mx.array) -> mx.array:
        y = h @ self.weight.T
        return y if self.bias is None else y + self.bias


class DraftHead:
    """Hidden states of drafted positions -> tokens (greedy) or draws with their q. With `ids`,
    only those tokens can be proposed; q stays a distribution over the whole vocabulary (zero
    outside the set), so rejection sampling against the target stays exact."""

    def __init__(self, project: Callable, vocab_size: int, ids: np.ndarray | None = None):
        self.vocab_size = vocab_size
        self.ids = ids
        if ids is None:
            self.projection = project
        else:
            self.projection = restricted_projection(project, ids, vocab_size)
            self._ids = mx.array(ids.astype(np.int32))

    @property
    def size(self) -> int:
        return self.vocab_size if self.ids is None else len(self.ids)

    def logits(self, h: mx.array) -> mx.array:
        """(k, size) float32 logits; column j is token j, or ids[j] with a restricted head."""
        return self.projection(h).astype(mx.float32)

    def greedy_ids(self, h: mx.array) -> mx.array:
        """(k,) the likeliest token of each row, as vocabulary ids, unevaluated."""
        best = mx.argmax(self.logits(h), axis=-1)
        return best if self.ids is None else self._ids[best]

    def greedy(self, h: mx.array) -> tuple[int, ...]:
        return tuple(np.array(self.greedy_ids(h)).tolist())

    def sample(
        self, h: mx.array, temperature: float, rng: np.random.Generator
    ) -> tuple[tuple[int, ...], np.ndarray]:
        """One draw per row from softmax(logits / temperature) and q: (k, vocab_size) float64."""
        p = np.array(mx.softmax(self.logits(h) / temperature, axis=-1), dtype=np.float64)
        p /= p.sum(axis=1, keepdims=True)
        c = np.cumsum(p, axis=1)
        u = rng.random(p.shape[0]) * c[:, -1]
        j = [
            min(int(np.searchsorted(c[i], u[i], side="right")), p.shape[1] - 1)
            for i in range(len(u))
        ]
        if self.ids is None:
            return tuple(j), p
        q = np.zeros((p.shape[0], self.vocab_size))
        q[:, self.ids] = p
        return tuple(int(t) for t in self.ids[j]), q
