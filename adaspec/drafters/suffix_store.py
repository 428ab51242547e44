"""Where the `suffix` drafter's token sequences come from: a data file (shipped for a catalogue
model, or built with `adaspec build-suffix`), and what the process generated (online, bounded,
optionally persisted under ADASPEC_CACHE). One Library per target and configuration, shared by
every drafter of the process, so each finished response makes the next one faster."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import DrafterError
from ..targets.base import TargetInfo
from .suffix_index import SEP, SuffixIndex, pack

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "suffix_data"
FORMAT = 1
MERGE = 4  # an online segment is merged into the one before it once that one is < MERGE x it


def target_key(info: TargetInfo | None) -> dict:
    """What a data file must match: the target's architecture and shapes."""
    if info is None:
        return {}
    return {
        "model_type": info.model_type,
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "num_layers": info.num_layers,
    }


def save_data(path: str | Path, sequences: Iterable[Sequence[int] | np.ndarray], target: dict):
    """Write sequences as a data file: one compressed npz of the packed stream (uint16 where the
    ids fit, SEP stored as the type's largest value) and the target it was made for."""
    stream = pack(sequences)
    small = int(stream.max(initial=0)) < np.iinfo(np.uint16).max
    dtype = np.uint16 if small else np.int32
    stored = np.where(stream == SEP, np.iinfo(dtype).max, stream).astype(dtype)
    meta = json.dumps({"format": FORMAT, "target": target, "tokens": int(len(stream))})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, stream=stored, meta=np.array(meta))
    os.replace(tmp, path)
    return path


def load_data(path: str | Path, target: dict | None = None) -> np.ndarray:
    """The packed stream of a data file; refused when it was made for another target."""
    try:
        with np.load(path) as z:
            stored, meta = z["stream"], json.loads(str(z["meta"]))
    except (OSError, ValueError, KeyError) as exc:
        raise DrafterError(
            f"cannot read suffix data {str(path)!r}: {exc}; accepted: a file written by "
            "`adaspec build-suffix`"
        ) from None
    if target and meta.get("target") and meta["target"] != target:
        raise DrafterError(
            f"suffix data {str(path)!r} was made for {meta['target']}; the target is {target}; "
            "accepted: a file built from this target's outputs"
        )
    top = np.iinfo(stored.dtype).max
    return np.where(stored == top, SEP, stored.astype(np.int32)).astype(np.int32)


def shipped_data(info: TargetInfo | None) -> Path | None:
    """The data file shipped for this target, if any (matched on architecture and shapes)."""
    want = target_key(info)
    for path in sorted(SHIPPED.glob("*.npz")):
        with np.load(path) as z:
            if json.loads(str(z["meta"])).get("target") == want:
                return path
    return None


def index_file(path: Path, depth: int, cache: Path | None) -> SuffixIndex:
    """The index of a data file; its suffix array is kept under `cache` (keyed by the file's
    digest and the depth), so only the first use builds it."""
    stream = load_data(path)
    if cache is None:
        return SuffixIndex(stream, depth)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    saved = cache / "suffix" / f"{digest}-d{depth}.npy"
    if saved.is_file():
        sa = np.load(saved)
        if len(sa) == len(stream):
            return SuffixIndex(stream, depth, sa)
    index = SuffixIndex(stream, depth)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(f".{saved.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, index.sa)
    os.replace(tmp, saved)
    return index


class Library:
    """The indexes one target's suffix drafters search: a fixed one (from a data file, or None)
    and online segments of what the process generated, newest last, at most `max_online`
    tokens (the oldest segment is evicted past it). With `persist`, the online sequences are
    saved there after each join and loaded at start."""

    def __init__(
        self,
        fixed: SuffixIndex | None,
        depth: int,
        max_online: int,
        persist: Path | None = None,
    ):
        if max_online < 0:
            raise DrafterError(f"suffix max_online={max_online} is invalid; accepted: >= 0")
        self.fixed, self.depth, self.max_online, self.persist = fixed, depth, max_online, persist
        self.online: list[SuffixIndex] = []
        self.lock = threading.Lock()
        if persist is not None and persist.is_file():
            stream = load_data(persist)
            ends = np.flatnonzero(stream == SEP) + 1  # keep the newest sequences that fit
            starts = np.concatenate([[0], ends[:-1]])
            fits = starts[len(stream) - starts <= max_online]
            if len(stream) and len(fits):
                self.online = [SuffixIndex(stream[int(fits[0]) :], depth)]

    def indexes(self) -> list[SuffixIndex]:
        return ([self.fixed] if self.fixed is not None else []) + list(self.online)

    @property
    def online_tokens(self) -> int:
        return sum(len(s) for s in self.online)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.indexes())

    def join(self, sequence: Sequence[int] | np.ndarray) -> None:
        """Make `sequence` searchable (a finished response, or any text the target made)."""
        seq = np.asarray(sequence, np.int64)
        if self.max_online == 0 or len(seq) < 2:
            return
        with self.lock:
            segs = [*self.online, SuffixIndex(pack([seq]), self.depth)]
            cap = max(self.max_online // 4, 1)
            while len(segs) > 1 and len(segs[-2]) < MERGE * len(segs[-1]):
                if len(segs[-2]) + len(segs[-1]) > cap:
                    break
                b, a = segs.pop(), segs.pop()
                segs.append(SuffixIndex(np.concatenate([a.tokens, b.tokens]), self.depth))
            self.online = segs
            self._evict()
            if self.persist is not None:
                self._save()

    def _evict(self) -> None:
        while len(self.online) > 1 and self.online_tokens > self.max_online:
            self.online.pop(0)
        if self.online and len(self.online[0]) > self.max_online:  # one sequence too long
            self.online = []

    def _save(self) -> None:
        stream: np.ndarray | list[int] = (
            np.concatenate([s.tokens for s in self.online]) if self.online else []
        )
        seqs = np.split(np.asarray(stream), np.flatnonzero(np.asarray(stream) == SEP) + 1)
        assert self.persist is not None
        save_data(self.persist, [s[:-1] for s in seqs if len(s) > 1], {})


_LIBRARIES: dict[tuple, Library] = {}
_LIBRARIES_LOCK = threading.Lock()


def library(
    info: TargetInfo | None,
    data: Path | None,
    depth: int,
    max_online: int,
    persist: bool,
    cache: Path | None,
) -> Library:
    """The process's Library for this target and configuration (built at first use)."""
    target = target_key(info)
    name = "-".join(str(v) for v in target.values()) or "any"
    key = (name, str(data), depth, max_online, persist)
    with _LIBRARIES_LOCK:
        lib = _LIBRARIES.get(key)
        if lib is None:
            if data is not None:
                load_data(data, target)  # refuses another target's file before building
            fixed = index_file(data, depth, cache) if data is not None else None
            saved = cache / "suffix" / f"online-{name}.npz" if persist and cache else None
            lib = _LIBRARIES[key] = Library(fixed, depth, max_online, saved)
            log.info("suffix index for %s: %d tokens", name, sum(map(len, lib.indexes())))
        return lib


def libraries() -> list[Library]:
    """Every Library the process built (for reports)."""
    return list(_LIBRARIES.values())
