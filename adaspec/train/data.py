"""Training sequences and what one target forward gives for each: the tap features and the
target's own predictions (greedy id, top-k log-probabilities) at every position, cached on disk
per sequence and resumed from what is there."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..kernels.blas import library_threads
from ..targets.base import layer_list, layer_output, spying
from .generate import cpu_streams
from .objective import TrainingError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSeq:
    """One training sequence: a chat-formatted prompt and, when the target answered it, the
    target's greedy response (prompt_len == len(tokens) when there is none)."""

    id: str
    heldout: bool
    tokens: np.ndarray  # (T,) int32
    prompt_len: int

    @cached_property
    def key(self) -> str:
        """File stem of the sequence's cache: its id and a hash of its tokens (a prompt that
        gains a response is a new sequence)."""
        digest = hashlib.sha256(np.asarray(self.tokens, np.int32).tobytes()).hexdigest()
        return f"{self.id}-{digest[:12]}"

    @property
    def has_response(self) -> bool:
        return self.prompt_len < len(self.tokens)


@dataclass(frozen=True)
class TargetLabels:
    """The target's predictions after each prefix tokens[:p+1] of a sequence."""

    greedy: np.ndarray  # (T,) int32 argmax
    top_ids: np.ndarray  # (T, k) int32, most likely first
    top_logprobs: np.ndarray  # (T, k) float32 log-softmax values of top_ids


def _forward_graph(model: Any, tokens: np.ndarray, taps: tuple[int, ...], k: int) -> tuple:
    """The lazy graph of one forward without a cache: (T, len(taps) * hidden) tap features, the
    target's greedy ids, and its top-k ids and log-probabilities (most likely first; (T, 0)
    when k is 0)."""
    layers = layer_list(model)
    with spying([(layers, i) for i in sorted(set(taps))]) as spies:
        logits = model(mx.array(tokens, dtype=mx.uint32)[None])[0].astype(mx.float32)
        by_layer = {i: layer_output(s) for i, s in zip(sorted(set(taps)), spies)}
    feats = mx.concatenate([by_layer[i] for i in taps], axis=-1)
    if k == 0:
        none = mx.zeros((logits.shape[0], 0))
        return feats, mx.argmax(logits, axis=-1), none.astype(mx.int32), none
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    k = min(k, logits.shape[-1])
    top = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logp, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    top, vals = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    return feats, mx.argmax(logits, axis=-1), top, vals


def _labels(greedy: mx.array, top: mx.array, vals: mx.array) -> TargetLabels:
    return TargetLabels(
        np.array(greedy).astype(np.int32), np.array(top).astype(np.int32), np.array(vals)
    )


def target_forward(
    model: Any, tokens: np.ndarray, taps: tuple[int, ...], k: int
) -> tuple[mx.array, TargetLabels]:
    """One forward without a cache: (T, len(taps) * hidden) tap-layer outputs (the values the
    adapter's chunked prefill and verify compute) and the target's predictions."""
    feats, *lab = _forward_graph(model, tokens, taps, k)
    mx.eval(feats, *lab)
    return feats, _labels(*lab)


def _paths(folder: Path, seq: TrainSeq, k: int) -> tuple[Path, Path]:
    return folder / f"{seq.key}.npy", folder / f"{seq.key}.top{k}.npz"


def _write(folder: Path, seq: TrainSeq, k: int, feats: mx.array, lab: TargetLabels) -> None:
    fpath, lpath = _paths(folder, seq, k)
    with open(lpath.with_suffix(".tmp"), "wb") as f:
        np.savez(
            f,
            greedy=lab.greedy,
            top_ids=lab.top_ids,
            top_logprobs=lab.top_logprobs.astype(np.float16),
        )
    np.save(fpath.with_suffix(".tmp.npy"), np.array(feats.astype(mx.float16)))
    # atomic renames: a cut-off write never looks complete
    lpath.with_suffix(".tmp").replace(lpath)
    fpath.with_suffix(".tmp.npy").replace(fpath)


def extract_features(
    model: Any,
    seqs: Sequence[TrainSeq],
    taps: tuple[int, ...],
    folder: Path,
    k: int,
    *,
    progress: bool = True,
) -> None:
    """Per sequence in `folder`: float16 features (.npy) and the target's labels (.npz, top-k
    log-probs as float16); sequences with both files are skipped (resume). Sequences go through
    the target a few at a time, each on its own CPU stream with the BLAS library on one thread,
    so both cores run mlx's single-threaded ops (softmax, SiLU) as well as the GEMMs."""
    folder.mkdir(parents=True, exist_ok=True)
    todo = [s for s in seqs if not all(p.is_file() for p in _paths(folder, s, k))]
    streams = cpu_streams()
    bar = tqdm(total=len(todo), disable=not progress, desc="target forward", unit="seq")
    with library_threads(1):
        for i in range(0, len(todo), len(streams)):
            group, graphs = todo[i : i + len(streams)], []
            for s, stream in zip(group, streams):
                with mx.stream(stream):
                    graphs.append(_forward_graph(model, s.tokens, taps, k))
            mx.eval(graphs)
            for s, (feats, *lab) in zip(group, graphs):
                _write(folder, s, k, feats, _labels(*lab))
            bar.update(len(group))
    bar.close()


def load_features(folder: Path, seq: TrainSeq, width: int, k: int) -> np.ndarray:
    path = _paths(folder, seq, k)[0]
    try:
        f = np.load(path)
    except (OSError, ValueError) as exc:
        raise TrainingError(f"cannot read features {str(path)!r}: {exc}") from None
    if f.shape != (len(seq.tokens), width):
        raise TrainingError(
            f"features {str(path)!r} have shape {f.shape}; accepted: "
            f"({len(seq.tokens)}, {width}) for this sequence and these taps"
        )
    return f


def load_labels(folder: Path, seq: TrainSeq, k: int) -> TargetLabels:
    path = _paths(folder, seq, k)[1]
    try:
        with np.load(path) as z:
            lab = TargetLabels(z["greedy"], z["top_ids"], z["top_logprobs"].astype(np.float32))
    except (OSError, ValueError, KeyError) as exc:
        raise TrainingError(f"cannot read labels {str(path)!r}: {exc}") from None
    if len(lab.greedy) != len(seq.tokens):
        raise TrainingError(
            f"labels {str(path)!r} cover {len(lab.greedy)} positions; accepted: "
            f"{len(seq.tokens)}, one per token of the sequence"
        )
    return lab
