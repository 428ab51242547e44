"""Training data stages, each resumable from what is already on disk: the frozen target answers
the prompts (batched greedy generation), then its tap features are extracted per sequence."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..prompting import prompt_ids
from ..targets.adapter import layer_list, layer_output, spying
from .corpus import PromptRecord
from .objective import TrainingError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSeq:
    """One training sequence: prompt + the target's own response, as token ids."""

    id: str
    heldout: bool
    tokens: np.ndarray  # (T,) int32
    prompt_len: int


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # a run cut off mid-write leaves a partial last line: drop it, redo that record
            log.warning("%s line %d is incomplete; it will be regenerated", path, n)
    return rows


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def generate_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[PromptRecord],
    out: Path,
    *,
    max_prompt: int,
    max_new: int,
    batch: int,
    progress: bool = True,
) -> list[dict]:
    """Greedy responses of the target, appended to `out` (JSONL) batch by batch; records
    already in `out` are kept, so a cut-off run resumes where it stopped."""
    from mlx_lm import batch_generate

    done = {r["id"]: r for r in read_jsonl(out)}
    todo = [p for p in prompts if p.id not in done]
    bar = tqdm(
        total=len(prompts),
        initial=len(prompts) - len(todo),
        disable=not progress,
        desc="responses",
        unit="prompt",
    )
    with out.open("a", encoding="utf-8") as f:
        for chunk in _batches(todo, batch):
            ids = [prompt_ids(tokenizer, list(p.messages))[-max_prompt:] for p in chunk]
            res = batch_generate(model, tokenizer, ids, max_tokens=max_new, return_token_ids=True)
            for p, prompt, resp in zip(chunk, ids, res.token_ids or []):
                rec = {"id": p.id, "heldout": p.heldout, "prompt": prompt, "response": resp}
                f.write(json.dumps(rec) + "\n")
                done[p.id] = rec
            f.flush()
            bar.update(len(chunk))
    bar.close()
    return [done[p.id] for p in prompts if p.id in done]


def to_sequences(records: Sequence[dict], min_response: int = 2) -> list[TrainSeq]:
    out = []
    for r in records:
        if len(r["response"]) < min_response:
            continue
        toks = np.array(r["prompt"] + r["response"], dtype=np.int32)
        out.append(TrainSeq(r["id"], bool(r["heldout"]), toks, len(r["prompt"])))
    return out


class _Done(Exception):
    """Raised after the deepest tap layer: the layers above it and the lm_head are not needed."""


class _Last:
    """Stands in for the deepest tap layer: runs it, keeps its output, ends the forward."""

    def __init__(self, layer: Any):
        self.layer = layer
        self.out: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.out = self.layer(*args, **kwargs)
        raise _Done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)


def tap_features(model: Any, tokens: np.ndarray, taps: tuple[int, ...]) -> mx.array:
    """(T, len(taps) * hidden) outputs of the tap layers over the whole sequence, one forward
    without a cache (the same values the adapter's chunked prefill and verify compute)."""
    layers = layer_list(model)
    last = max(taps)
    stop = _Last(layers[last])
    with spying([(layers, i) for i in taps if i != last]) as spies:
        layers[last] = stop
        try:
            model(mx.array(tokens, dtype=mx.uint32)[None])
        except _Done:
            pass
        finally:
            layers[last] = stop.layer
    found = iter(layer_output(s) for s in spies)
    out = stop.out[0] if isinstance(stop.out, tuple) else stop.out
    return mx.concatenate([out[0] if i == last else next(found) for i in taps], axis=-1)


def extract_features(
    model: Any,
    seqs: Sequence[TrainSeq],
    taps: tuple[int, ...],
    folder: Path,
    *,
    progress: bool = True,
) -> None:
    """One float16 .npy per sequence in `folder`; existing files are kept (resume)."""
    folder.mkdir(parents=True, exist_ok=True)
    todo = [s for s in seqs if not (folder / f"{s.id}.npy").is_file()]
    for s in tqdm(todo, disable=not progress, desc="features", unit="seq"):
        f = tap_features(model, s.tokens, taps).astype(mx.float16)
        tmp = folder / f"{s.id}.tmp.npy"
        np.save(tmp, np.array(f))
        tmp.replace(folder / f"{s.id}.npy")  # atomic: a cut-off write never looks complete


def load_features(folder: Path, seq: TrainSeq, width: int) -> np.ndarray:
    path = folder / f"{seq.id}.npy"
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
