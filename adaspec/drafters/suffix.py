"""Suffix decoding: propose what followed the context's longest suffix in text the target
generated before (a shipped data file, the responses of this process) or earlier in this
request, cut where the estimated probability of reaching a token falls below `min_prob`.

Training-free and model-free: a draft is a few numpy searches (docs/drafters.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import DrafterError
from ..settings import Settings
from ..targets.base import TargetInfo
from . import suffix_index as sx
from .base import Draft, DraftContext
from .spec import DrafterArgs, Entry
from .suffix_store import Library, library, shipped_data


class _View:
    """The committed tokens as a growing int32 buffer, and where the generated part starts."""

    def __init__(self) -> None:
        self.buf = np.zeros(256, np.int32)
        self.n = 0
        self.start = 0  # tokens before this were the prompt

    def extend(self, tokens: Sequence[int]) -> None:
        new = np.asarray(tokens, np.int64)
        if new.size and (new.min() < 0 or new.max() >= 2**31 - 1):
            raise DrafterError(f"suffix: token id {int(new.min())} is invalid; accepted: >= 0")
        while self.n + len(new) > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(len(self.buf), np.int32)])
        self.buf[self.n : self.n + len(new)] = new
        self.n += len(new)

    def generated(self) -> np.ndarray:
        return self.buf[self.start : self.n].copy()


def _join(lib: Library | None, view: _View) -> None:
    """The generated part of the view joins the library (once)."""
    if lib is not None and view.n - view.start >= 2:
        lib.join(view.generated())
    view.start = view.n


def context_match(tokens: np.ndarray, depth: int) -> tuple[int, np.ndarray]:
    """The longest suffix of `tokens` (up to `depth`) that occurred earlier in them: its
    length and the positions of the token after each earlier occurrence ((0, []) if none)."""
    n = len(tokens)
    if n < 2:
        return 0, np.zeros(0, np.int64)
    cand = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    length = 1
    for i in range(1, min(depth, n - 1)):
        if not len(cand):
            break
        ok = cand >= i
        keep = cand[ok][tokens[cand[ok] - i] == tokens[n - 1 - i]]
        if not len(keep):
            break
        cand, length = keep, i + 1
    return (length, cand + 1) if len(cand) else (0, cand)


class SuffixDrafter:
    """Deterministic drafter over a Library (shared) and the request's own tokens."""

    name = "suffix"
    needs_taps: tuple[int, ...] = ()
    vocab_size = None

    def __init__(
        self,
        lib: Library | None,
        *,
        depth: int = 32,
        min_match: int = 1,
        min_prob: float = 0.2,
        draft_len: int = 16,
        cap: int = 256,
        context: bool = True,
        learn: bool = True,
        prior: float = 1.0,
    ):
        if depth < 1 or not 1 <= min_match <= depth:
            raise DrafterError(
                f"suffix depth={depth}, min_match={min_match} are invalid; accepted: "
                "1 <= min_match <= depth"
            )
        if not 0.0 <= min_prob <= 1.0:
            raise DrafterError(f"suffix min_prob={min_prob} is invalid; accepted: 0..1")
        if prior < 0:
            raise DrafterError(f"suffix prior={prior} is invalid; accepted: >= 0")
        if draft_len < 1 or cap < 1:
            raise DrafterError(
                f"suffix draft_len={draft_len}, cap={cap} are invalid; accepted: both >= 1"
            )
        self.lib, self.depth, self.min_match, self.min_prob = lib, depth, min_match, min_prob
        self.draft_len, self.cap, self.context, self.learn = draft_len, cap, context, learn
        self.prior = prior  # pseudo-occurrences with no continuation: a lone match is not sure
        self.view = _View()
        self.last_match = 0  # length of the suffix behind the latest draft (0: none)
        self.last_source = ""  # "index" or "context"
        if lib is not None and learn:  # what this drafter saw joins when it is dropped
            weakref.finalize(self, _join, lib, self.view)

    @property
    def tokens(self) -> list[int]:
        return self.view.buf[: self.view.n].tolist()

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        if self.learn:
            _join(self.lib, self.view)  # the previous generation's output
        self.view.n = 0
        self.view.extend(prompt_tokens)
        self.view.start = self.view.n

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.view.extend(committed_tokens)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.view.n:
            raise DrafterError(f"suffix rollback({n}) out of range; accepted: 0..{self.view.n}")
        self.view.n -= n
        self.view.start = min(self.view.start, self.view.n)

    def draft(self, ctx: DraftContext) -> Draft:
        k = min(self.draft_len, ctx.max_draft)
        self.last_match, self.last_source = 0, ""
        if k <= 0 or self.view.n == 0:
            return Draft()
        best, best_score = sx.Walk(), 0.0
        for source, length, streams in self._sources():
            if length < self.min_match:
                continue
            w = sx.walk(streams, k, self.min_prob, ctx.tree_nodes, self.prior)
            score = sum(w.probs)
            if score > best_score:
                best, best_score = w, score
                self.last_match, self.last_source = length, source
        if not best.tokens:
            return Draft()
        return Draft(best.tokens, parents=best.parents if ctx.tree_nodes else None)

    def _sources(self):
        """(name, match length, streams) of the index's longest match and of the request's."""
        ctx_tokens = self.view.buf[max(0, self.view.n - self.depth) : self.view.n]
        if self.lib is not None:
            found = [(i, i.match(ctx_tokens)) for i in self.lib.indexes()]
            longest = max((m.length for _, m in found), default=0)
            streams = [
                (i.tokens, i.continuations(m, self.cap))
                for i, m in found
                if m.length == longest and m.count
            ]
            yield "index", longest, streams
        if self.context:
            tokens = np.append(self.view.buf[: self.view.n], sx.SEP).astype(np.int32)
            length, pos = context_match(tokens[:-1], self.depth)
            yield "context", length, [(tokens, pos[-self.cap :])] if len(pos) else []

    def finish(self) -> None:
        """A generation ended (Learner): what it generated joins the library now. Tokens a
        prompt cache adds to the view afterwards join with the next generation's output."""
        _join(self.lib if self.learn else None, self.view)


def factory(args: DrafterArgs, info: TargetInfo, settings: Settings) -> SuffixDrafter:
    depth = args.get("depth", 32)
    data: Path | None
    if args.path in (None, "shipped"):
        data = shipped_data(info)
    elif args.path == "none":
        data = None
    else:
        data = Path(args.path)
        if not data.is_file():
            raise DrafterError(
                f"suffix data {args.path!r} is not a file; accepted: a file from `adaspec "
                "build-suffix`, 'shipped' (the default) or 'none' (online only)"
            )
    max_online = args.get("max_online", settings.suffix_max_online)
    persist = args.get("persist", settings.suffix_persist)
    lib = library(info, data, depth, max_online, persist, settings.cache)
    return SuffixDrafter(
        lib,
        depth=depth,
        min_match=args.get("min_match", 1),
        min_prob=args.get("min_prob", 0.2),
        draft_len=args.get("draft_len", 16),
        cap=args.get("cap", 256),
        context=args.get("context", True),
        learn=max_online > 0,
        prior=args.get("prior", 1.0),
    )


ENTRY = Entry(
    factory,
    {
        "depth": int,
        "min_match": int,
        "min_prob": float,
        "draft_len": int,
        "cap": int,
        "context": bool,
        "prior": float,
        "max_online": int,
        "persist": bool,
    },
    path="data file",
)
