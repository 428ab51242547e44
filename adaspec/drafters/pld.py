"""Prompt lookup decoding: propose what followed the latest earlier occurrence of the suffix
(with a node budget for trees: the distinct continuations of its latest occurrences).

The n-gram index grows by one position per committed token and shrinks on rollback, so a draft
never rescans the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import DrafterError
from ..settings import Settings
from ..targets.base import TargetInfo
from .base import Draft, DraftContext
from .spec import DrafterArgs, Entry


class PromptLookup:
    """Deterministic drafter; longest n-gram first, most recent occurrence wins."""

    name = "pld"
    needs_taps: tuple[int, ...] = ()
    vocab_size = None

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 1, draft_len: int = 10, strong_match: int = 6
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise DrafterError(
                f"pld n-gram sizes min={min_ngram}, max={max_ngram} are invalid; "
                "accepted: 1 <= min <= max"
            )
        if draft_len < 1:
            raise DrafterError(f"pld draft_len={draft_len} is invalid; accepted: >= 1")
        self.max_ngram, self.min_ngram, self.draft_len = max_ngram, min_ngram, draft_len
        self.strong_match = strong_match
        self.tokens: list[int] = []
        # n-gram -> start positions of the token that followed it, oldest first
        self._index: dict[tuple[int, ...], list[int]] = {}
        self.last_match = 0  # length of the n-gram behind the latest draft (0: none)

    # The n-grams ending at position p are indexed once position p+1 exists, so the current
    # suffix never matches itself.
    def _index_end(self, p: int) -> None:
        for n in range(self.min_ngram, self.max_ngram + 1):
            if p - n + 1 < 0:
                break
            key = tuple(self.tokens[p - n + 1 : p + 1])
            self._index.setdefault(key, []).append(p + 1)

    def _unindex_end(self, p: int) -> None:
        for n in range(self.min_ngram, self.max_ngram + 1):
            if p - n + 1 < 0:
                break
            key = tuple(self.tokens[p - n + 1 : p + 1])
            starts = self._index[key]
            starts.pop()
            if not starts:
                del self._index[key]

    def _append(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.tokens:
                self._index_end(len(self.tokens) - 1)
            self.tokens.append(int(t))

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.tokens, self._index = [], {}
        self._append(prompt_tokens)

    def draft(self, ctx: DraftContext) -> Draft:
        k = min(self.draft_len, ctx.max_draft)
        self.last_match = 0
        if k <= 0:
            return Draft()
        L = len(self.tokens)
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            starts = self._index.get(tuple(self.tokens[L - n :]))
            if starts:
                s = starts[-1]
                self.last_match = n
                toks = tuple(self.tokens[s : s + k])
                # text being copied: the match runs on well past the n-gram
                strong = len(toks) >= 2 and self._match_len(s, n) >= self.strong_match
                if ctx.tree_nodes > len(toks) and len(starts) > 1:
                    return self._branches(starts, k, ctx.tree_nodes, strong)
                return Draft(toks, strong=strong)
        return Draft()

    BRANCH_MATCHES = 16  # latest occurrences whose continuations a tree may hold

    def _branches(self, starts: list[int], k: int, budget: int, strong: bool) -> Draft:
        """The continuations of the latest occurrences as a trie, the latest one first (so
        the tree's best chain is the chain draft), within `budget` nodes."""
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}
        for s in reversed(starts[-self.BRANCH_MATCHES :]):
            cur = -1
            for t in self.tokens[s : s + k]:
                nxt = node_of.get((cur, t))
                if nxt is None:
                    if len(tokens) >= budget:
                        break
                    nxt = node_of[(cur, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(cur)
                cur = nxt
        return Draft(tuple(tokens), parents=tuple(parents), strong=strong)

    def _match_len(self, s: int, n: int) -> int:
        """How far the suffix matched at start s (n tokens known) really extends backwards."""
        t, L, m = self.tokens, len(self.tokens), n
        while m < self.strong_match and s - m - 1 >= 0 and t[s - m - 1] == t[L - m - 1]:
            m += 1
        return m

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self._append(committed_tokens)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.tokens):
            raise DrafterError(f"pld rollback({n}) out of range; accepted: 0..{len(self.tokens)}")
        for _ in range(n):
            self.tokens.pop()
            if self.tokens:
                self._unindex_end(len(self.tokens) - 1)


def factory(args: DrafterArgs, info: TargetInfo, settings: Settings) -> PromptLookup:
    return PromptLookup(
        args.get("max_ngram", settings.pld_max_ngram),
        args.get("min_ngram", settings.pld_min_ngram),
        args.get("draft_len", settings.pld_draft_len),
        args.get("strong_match", settings.pld_strong_match),
    )


ENTRY = Entry(
    factory,
    {"max_ngram": int, "min_ngram": int, "draft_len": int, "strong_match": int},
    path=None,
)
