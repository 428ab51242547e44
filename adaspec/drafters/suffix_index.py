"""A suffix array over token sequences, for the `suffix` drafter: where the context's longest
suffix occurred before, and what followed it, with counts.

The array sorts the suffixes of the *reversed* token stream to a bounded depth, so matching
the context backwards from its last token narrows one range per token; the occurrences of the
match then give the continuations in the forward stream. Pure numpy; no clocks, no logging.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import DrafterError

SEP = -1  # ends every sequence: no match or continuation crosses it
SMALL = 256  # a range this small is narrowed by one vectorized search instead of bisection
KEY_TOKENS = 3  # the first tokens of each sorted suffix, packed in one int64 for searchsorted


def pack(sequences: Iterable[Sequence[int] | np.ndarray]) -> np.ndarray:
    """Sequences as one int32 stream, each followed by SEP."""
    parts: list[np.ndarray] = []
    for s in sequences:
        a = np.asarray(s, dtype=np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= 2**31 - 1):
            raise DrafterError(
                f"suffix index: token ids {int(a.min())}..{int(a.max())} are invalid; "
                "accepted: ids in 0..2**31-2"
            )
        parts += [a.astype(np.int32), np.array([SEP], np.int32)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def suffix_array(rev: np.ndarray, depth: int) -> np.ndarray:
    """Start positions of the suffixes of `rev`, sorted by their first `depth` tokens (ties in
    any order): prefix doubling, stopped once `depth` tokens are compared."""
    n = len(rev)
    if n == 0:
        return np.zeros(0, np.int32)
    rank = np.unique(rev, return_inverse=True)[1].astype(np.int64).reshape(-1)  # dense, SEP first
    order = np.argsort(rank, kind="stable")
    h = 1
    while h < min(depth, n):
        nxt = np.zeros(n, np.int64)
        nxt[: n - h] = rank[h:] + 1
        key = rank * (n + 2) + nxt
        order = np.argsort(key, kind="stable")
        k = key[order]
        new = np.empty(n, np.int64)
        new[order] = np.concatenate([[0], np.cumsum(k[1:] != k[:-1])])
        rank = new
        if rank[order[-1]] == n - 1:  # every suffix already distinct
            break
        h *= 2
    return order.astype(np.int32)


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context found in one index: its length and its sorted range."""

    length: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


class SuffixIndex:
    """An immutable index over `tokens` (a SEP-separated stream, see `pack`): matches of up to
    `depth` tokens. `bits` packs KEY_TOKENS token ids per int64 key (ids < 2**bits - 1)."""

    def __init__(self, tokens: np.ndarray, depth: int = 32, sa: np.ndarray | None = None):
        if depth < 1:
            raise DrafterError(f"suffix index depth={depth} is invalid; accepted: >= 1")
        tokens = np.asarray(tokens, dtype=np.int32)
        self.depth = depth
        n = len(tokens)
        self.rev = np.concatenate([tokens[::-1], np.full(depth + 1, SEP, np.int32)])
        self.tokens = self.rev[:n][::-1]  # the forward stream, a view: no second copy
        self.sa = (
            suffix_array(self.rev[:n], max(depth, KEY_TOKENS))
            if sa is None
            else sa.astype(np.int32)
        )
        if len(self.sa) != n:
            raise DrafterError(f"suffix index: {len(self.sa)} array entries for {n} tokens")
        top = int(self.tokens.max()) + 2 if n else 2
        self.bits = max(1, int(top - 1).bit_length())
        if KEY_TOKENS * self.bits > 62:
            raise DrafterError(f"suffix index: token ids up to {top - 2} do not pack in a key")
        self.keys = self._keys()

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int] | np.ndarray], depth: int = 32):
        return cls(pack(sequences), depth)

    def _keys(self) -> np.ndarray:
        key = np.zeros(len(self.sa), np.int64)
        for j in range(KEY_TOKENS):
            key = (key << self.bits) | (self.rev[self.sa.astype(np.int64) + j] + 1)
        return key

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.rev.nbytes + self.sa.nbytes + self.keys.nbytes

    def match(self, context: Sequence[int], depth: int | None = None) -> Match:
        """The longest suffix of `context` (up to `depth` tokens) that occurs in the index;
        Match(0, 0, 0) when even its last token does not. (Every occurrence is followed by a
        token or by SEP, as the stream ends with SEP.)"""
        depth = min(depth or self.depth, self.depth, len(context))
        best = Match(0, 0, 0)
        if depth == 0 or len(self.sa) == 0:
            return best
        lo, hi, key = 0, len(self.sa), 0
        for j in range(depth):
            x = int(context[-1 - j])
            if x < 0 or x >= (1 << self.bits) - 1:
                return best
            if j < KEY_TOKENS:
                key = (key << self.bits) | (x + 1)
                shift = (KEY_TOKENS - 1 - j) * self.bits
                lo = int(np.searchsorted(self.keys, key << shift, "left"))
                hi = int(np.searchsorted(self.keys, (key + 1) << shift, "left"))
            elif hi - lo <= SMALL:
                return self._finish(context, lo, hi, j, depth) or best
            else:
                lo, hi = self._narrow(lo, hi, j, x)
            if lo >= hi:
                break
            best = Match(j + 1, lo, hi)
        return best

    def _finish(self, context: Sequence[int], lo: int, hi: int, j: int, depth: int) -> Match | None:
        """Match offsets j..depth-1 for the few suffixes in [lo, hi) at once (they share the
        first j tokens): the longest common run, and the (contiguous) rows that reach it."""
        want = np.asarray(context[len(context) - depth : len(context) - j][::-1], np.int64)
        rows = self.rev[self.sa[lo:hi, None].astype(np.int64) + np.arange(j, depth)]
        same = rows == want
        run = np.where(same.all(1), depth - j, np.argmin(same, axis=1))
        longest = int(run.max())
        if longest == 0:
            return None
        at = np.flatnonzero(run == longest)
        return Match(j + longest, lo + int(at[0]), lo + int(at[-1]) + 1)

    def _narrow(self, lo: int, hi: int, j: int, x: int) -> tuple[int, int]:
        """The part of [lo, hi) whose suffixes have token x at offset j (sorted there)."""
        sa, rev = self.sa, self.rev
        if hi - lo <= SMALL:
            col = rev[sa[lo:hi] + j]
            return lo + int(np.searchsorted(col, x, "left")), lo + int(
                np.searchsorted(col, x, "right")
            )
        a, b = lo, hi
        while a < b:  # first entry >= x
            m = (a + b) // 2
            if rev[sa[m] + j] < x:
                a = m + 1
            else:
                b = m
        c, b = a, hi
        while c < b:  # first entry > x
            m = (c + b) // 2
            if rev[sa[m] + j] <= x:
                c = m + 1
            else:
                b = m
        return a, c

    def continuations(self, m: Match, cap: int = 0) -> np.ndarray:
        """Forward positions of the token after each occurrence of match m (int64); with cap >
        0, at most `cap` of them, evenly spread over the range."""
        idx = np.arange(m.lo, m.hi)
        if cap and len(idx) > cap:
            idx = np.linspace(m.lo, m.hi - 1, cap).astype(np.int64)
        return len(self.tokens) - self.sa[idx].astype(np.int64)


@dataclass(frozen=True)
class Walk:
    """A drafted continuation: tokens, parents (-1: the context's last token) and each node's
    estimated probability of being reached (the product of frequencies along its path)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()


def _children(streams: Sequence[tuple[np.ndarray, np.ndarray]], prior: float):
    """The distinct next tokens after the positions, likeliest first, with their frequency
    (count / (total + prior)) and their positions advanced by one. SEP is not a child but
    counts in the total (a sequence that ended)."""
    nxt = np.concatenate([tok[pos] for tok, pos in streams])
    total = len(nxt) + prior
    vals, counts = np.unique(nxt, return_counts=True)
    keep = vals != SEP
    vals, counts = vals[keep], counts[keep]
    order = np.lexsort((vals, -counts))
    out = []
    for i in order:
        t = int(vals[i])
        sub = [(tok, pos[tok[pos] == t] + 1) for tok, pos in streams]
        out.append((t, counts[i] / total, [(tok, p) for tok, p in sub if len(p)]))
    return out


def walk(
    streams: Sequence[tuple[np.ndarray, np.ndarray]],
    max_len: int,
    min_prob: float,
    nodes: int = 0,
    prior: float = 1.0,
) -> Walk:
    """Follow the continuations: from `streams` ((tokens, positions) pairs: the tokens that
    follow each occurrence of the match), the likeliest next token while the path's estimated
    probability stays >= min_prob, up to max_len tokens. nodes > 0: a tree of up to `nodes`
    nodes, expanded best-first by path probability (a child is listed after its parent, the
    likeliest child first, so the tree's first-child chain is the chain draft)."""
    if max_len <= 0 or not streams:
        return Walk()
    if nodes <= 0:
        return _chain(streams, max_len, min_prob, prior)
    toks: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    heap = [(-1.0, 0, -1, 0, list(streams))]  # (-prob, tie, node, depth, streams)
    tie = 1
    while heap and len(toks) < nodes:
        negp, _, node, d, st = heapq.heappop(heap)
        if d >= max_len:
            continue
        for t, f, sub in _children(st, prior):
            p = -negp * f
            if p < min_prob or len(toks) >= nodes:
                break
            toks.append(t)
            parents.append(node)
            probs.append(p)
            heapq.heappush(heap, (-p, tie, len(toks) - 1, d + 1, sub))
            tie += 1
    return Walk(tuple(toks), tuple(parents), tuple(probs))


def _chain(streams, max_len: int, min_prob: float, prior: float) -> Walk:
    toks: list[int] = []
    probs: list[float] = []
    p = 1.0
    while len(toks) < max_len:
        nxts = [tok[pos] for tok, pos in streams]
        total = sum(len(a) for a in nxts)
        if total == 1:  # one occurrence left: copy it until SEP or the cut
            tok, pos = streams[0]
            f = 1.0 / (1.0 + prior)
            start = int(pos[0])
            for t in tok[start : start + max_len - len(toks)].tolist():
                if t == SEP or p * f < min_prob:
                    break
                p *= f
                toks.append(t)
                probs.append(p)
            break
        t, count = _top(nxts)
        f = count / (total + prior)
        if count == 0 or p * f < min_prob:
            break
        p *= f
        toks.append(t)
        probs.append(p)
        streams = [(tok, pos[a == t] + 1) for (tok, pos), a in zip(streams, nxts)]
        streams = [(tok, pos) for tok, pos in streams if len(pos)]
    return Walk(tuple(toks), tuple(range(-1, len(toks) - 1)), tuple(probs))


def _top(nxts: list[np.ndarray]) -> tuple[int, int]:
    """The most frequent token other than SEP (ties: the smallest id) and its count; (SEP, 0)
    when there is none. Few values are counted in Python (numpy's overhead dominates there)."""
    if sum(len(a) for a in nxts) <= 64:
        counts: dict[int, int] = {}
        for a in nxts:
            for t in a.tolist():
                counts[t] = counts.get(t, 0) + 1
        counts.pop(SEP, None)
        if not counts:
            return SEP, 0
        return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    vals, freq = np.unique(np.concatenate(nxts), return_counts=True)
    freq = np.where(vals == SEP, 0, freq)
    i = int(np.argmax(freq))  # ties: the smallest id
    return int(vals[i]), int(freq[i])
