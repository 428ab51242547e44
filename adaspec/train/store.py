"""The target's generated responses as token ids, kept where they outlive a machine: a folder of
compressed npz shards (one per generation batch, written atomically) and a small JSON index.
A cut-off job keeps every finished shard; the shards are the truth, the index a summary."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np

from .objective import TrainingError

log = logging.getLogger(__name__)

FORMAT = 1
INDEX = "index.json"


def checkout_root() -> Path | None:
    """The repository the adaspec package sits in, when it is a checkout (pyproject.toml next
    to the package); None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def shown_path(path: str | Path) -> str:
    """`path` as a record shows it: relative to the checkout when it lies inside one (a card
    or metrics file must not name this machine's folders), else as given."""
    root, full = checkout_root(), Path(path).resolve()
    return str(full.relative_to(root)) if root and full.is_relative_to(root) else str(path)


class ShardArrays(TypedDict):
    """The arrays of one npz shard, by name."""

    tokens: np.ndarray  # every sequence's prompt then response, back to back
    lengths: np.ndarray  # (N,) int64, each sequence's length
    prompt_lens: np.ndarray  # (N,) int64
    keys: np.ndarray  # (N,) str
    ids: np.ndarray  # (N,) str
    heldout: np.ndarray  # (N,) bool
    max_new: np.ndarray  # () the generation's max_new


class ShardSummary(TypedDict):
    """One shard's entry in the index."""

    file: str
    sequences: int
    prompt_tokens: int
    response_tokens: int
    max_new: int


@dataclass(frozen=True)
class Answer:
    """One prompt (as the target saw it, chat-formatted and cut) and its greedy response."""

    key: str  # hash of the prompt's messages (corpus.PromptRecord.key)
    id: str
    heldout: bool
    prompt: np.ndarray  # (P,) int32
    response: np.ndarray  # (R,) int32, the EOS included when the target emitted it


class ResponseStore:
    """`folder` holds responses of one target; `fingerprint` (JSON-able) names the target and
    tokenizer, and a folder made for another one is refused."""

    def __init__(self, folder: str | Path, fingerprint: dict):
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        index = self.folder / INDEX
        if index.is_file():
            old = json.loads(index.read_text()).get("target")
            if old != fingerprint:
                raise TrainingError(
                    f"response store {str(self.folder)!r} holds another target's data ({old}); "
                    f"accepted: a store made for {fingerprint}, or another --data folder"
                )

    def shards(self) -> list[Path]:
        return sorted(self.folder.glob("responses-*.npz"))

    @staticmethod
    def number(shard: Path) -> int:
        """A shard's number: NNNNN of responses-NNNNN.npz."""
        return int(shard.stem.split("-")[1])

    def load(self, only: range | None = None) -> dict[str, Answer]:
        """Every stored answer by key (a later shard wins on a repeated key); with `only`, the
        answers in the shards of those numbers."""
        out: dict[str, Answer] = {}
        for path in self.shards():
            if only is not None and self.number(path) not in only:
                continue
            for a in _read_shard(path):
                out[a.key] = a
        return out

    def append(self, answers: Sequence[Answer], max_new: int) -> Path:
        """Write `answers` as a new shard, then refresh the index."""
        self.folder.mkdir(parents=True, exist_ok=True)
        last = self.shards()
        n = self.number(last[-1]) + 1 if last else 0
        path = self.folder / f"responses-{n:05d}.npz"
        tmp = self.folder / f".responses-{n:05d}.tmp"
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **_arrays(answers, self.fingerprint["vocab_size"], max_new))
        os.replace(tmp, path)
        self.write_index()
        return path

    def write_index(self) -> dict:
        shards: list[ShardSummary] = []
        for path in self.shards():
            with np.load(path) as z:
                plen, total = z["prompt_lens"], z["lengths"]
                shards.append(
                    {
                        "file": path.name,
                        "sequences": int(len(total)),
                        "prompt_tokens": int(plen.sum()),
                        "response_tokens": int((total - plen).sum()),
                        "max_new": int(z["max_new"]),
                    }
                )
        index = {
            "format": FORMAT,
            "target": self.fingerprint,
            "sequences": sum(s["sequences"] for s in shards),
            "prompt_tokens": sum(s["prompt_tokens"] for s in shards),
            "response_tokens": sum(s["response_tokens"] for s in shards),
            "shards": shards,
        }
        tmp = self.folder / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tmp, self.folder / INDEX)
        return index


def _arrays(answers: Sequence[Answer], vocab_size: int, max_new: int) -> ShardArrays:
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    parts = [np.concatenate([a.prompt, a.response]) for a in answers]
    return {
        "tokens": np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype),
        "lengths": np.array([len(p) for p in parts], np.int64),
        "prompt_lens": np.array([len(a.prompt) for a in answers], np.int64),
        "keys": np.array([a.key for a in answers], dtype=str),
        "ids": np.array([a.id for a in answers], dtype=str),
        "heldout": np.array([a.heldout for a in answers], bool),
        "max_new": np.array(max_new),
    }


def _read_shard(path: Path) -> list[Answer]:
    try:
        with np.load(path) as z:
            tokens = z["tokens"].astype(np.int32)
            lengths = z["lengths"]
            plen, keys, ids, held = z["prompt_lens"], z["keys"], z["ids"], z["heldout"]
    except (OSError, ValueError, KeyError) as exc:
        raise TrainingError(
            f"cannot read response shard {str(path)!r}: {exc}; accepted: a shard written by "
            "ResponseStore (delete a damaged one to regenerate its answers)"
        ) from None
    out = []
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(len(lengths)):
        seq = tokens[starts[i] : starts[i + 1]]
        out.append(Answer(str(keys[i]), str(ids[i]), bool(held[i]), seq[: plen[i]], seq[plen[i] :]))
    return out
