"""Scripted drafters that exercise the controller: oracle, adversarial, stochastic."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from adaspec.drafters.base import Draft, DraftContext
from adaspec.errors import DrafterError
from adaspec.loop.controller import Decoder, decode


class ListDrafter:
    """Keeps the committed view as a list; subclasses decide what to propose."""

    name = "scripted"
    needs_taps: tuple[int, ...] = ()
    vocab_size = None

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def prefill(self, prompt_tokens, ctx: DraftContext) -> None:
        self.tokens = list(prompt_tokens)

    def advance(self, committed_tokens, ctx: DraftContext) -> None:
        self.tokens += list(committed_tokens)

    def rollback(self, n: int) -> None:
        assert 0 <= n <= len(self.tokens)
        del self.tokens[len(self.tokens) - n :]


class ProgramDrafter(ListDrafter):
    """Follows a program of (mode, size, seed) per step against `reference`, the AR
    continuation of the prompt."""

    def __init__(self, program, reference, n_prompt: int, vocab: int):
        super().__init__()
        self.program, self.reference, self.n_prompt, self.vocab = (
            program,
            reference,
            n_prompt,
            vocab,
        )
        self.step = 0


class ScriptedDrafter(ProgramDrafter):
    """Follows a program of (mode, length, seed) per step; `reference` is the AR continuation
    of the prompt, so "oracle" drafts are exactly right and "corrupt" ones wrong at one place.
    "overlong" drafts are right as far as `reference` goes but 1 + length tokens longer than
    ctx.max_draft; `overlong` records the first: (its length, ctx.max_draft, tokens committed)."""

    def __init__(self, program, reference, n_prompt: int, vocab: int):
        super().__init__(program, reference, n_prompt, vocab)
        self.overlong: tuple[int, int, int] | None = None

    def draft(self, ctx: DraftContext) -> Draft:
        mode, k, seed = self.program[self.step % len(self.program)]
        self.step += 1
        assert list(ctx.tokens) == self.tokens, "drafter view diverged from the controller's"
        rng = np.random.default_rng(seed)
        k = ctx.max_draft + 1 + k if mode == "overlong" else min(k, ctx.max_draft)
        done = len(self.tokens) - self.n_prompt
        truth = list(self.reference[done : done + k])
        truth += list(rng.integers(0, self.vocab, k - len(truth)))
        if mode == "overlong" and self.overlong is None:
            self.overlong = (k, ctx.max_draft, len(self.tokens))
        if mode == "oracle" or mode == "overlong":
            return Draft(tuple(truth), strong=True)  # may lift a floor (its drafts are free)
        if mode == "random":
            return Draft(tuple(int(x) for x in rng.integers(0, self.vocab, k)))
        if mode == "corrupt" and k:
            j = int(rng.integers(0, k))
            truth[j] = (truth[j] + 1 + int(rng.integers(0, self.vocab - 1))) % self.vocab
            return Draft(tuple(truth))
        return Draft()


class FixedDrafter(ListDrafter):
    """Always proposes the same deterministic tokens (up to the budget)."""

    def __init__(self, tokens):
        super().__init__()
        self.fixed = tuple(tokens)

    def draft(self, ctx: DraftContext) -> Draft:
        return Draft(self.fixed[: ctx.max_draft])


class StochasticDrafter(ListDrafter):
    """Samples each draft token from fixed rows q (k, V) with the generation's rng."""

    def __init__(self, q: np.ndarray):
        super().__init__()
        self.q = q / q.sum(axis=1, keepdims=True)

    def draft(self, ctx: DraftContext) -> Draft:
        k = min(len(self.q), ctx.max_draft)
        toks = tuple(int(ctx.rng.choice(self.q.shape[1], p=self.q[i])) for i in range(k))
        return Draft(toks, self.q[:k])


def decode_until_refused(dec: Decoder, prompt, limit: int | None = None):
    """(tokens received from decode(dec, prompt), at most `limit`; the DrafterError that ended
    the generation early, or None)."""
    out: list[int] = []
    events = decode(dec, prompt)
    try:
        for ev in events:
            out.append(ev.token)
            if len(out) == limit:
                break
    except DrafterError as exc:
        return out, exc
    finally:
        events.close()
    return out, None


def check_refusal(drafter: ScriptedDrafter, out: list[int], err: DrafterError | None) -> bool:
    """Whether an over-long draft ended the generation; if so, it was refused by name before
    any of it was verified or emitted. Any other refusal fails."""
    if drafter.overlong is None:
        assert err is None, f"a legal draft was refused: {err}"
        return False
    n, cap, committed = drafter.overlong
    assert err is not None, f"an over-long draft ({n} tokens, {cap} allowed) was not refused"
    assert f"drafter 'scripted' proposed {n} tokens; at most {cap} allowed" in str(err)
    assert committed == drafter.n_prompt + len(out)  # nothing after the over-long draft
    return True


class TreeDrafter(ProgramDrafter):
    """Follows a program of (mode, nodes, seed): a random tree of up to `nodes` nodes within
    ctx's budget, with one root-to-leaf branch set to the AR continuation ("oracle"), to it with
    one token changed ("corrupt"), or left random ("random"); siblings stay distinct."""

    def __init__(self, program, reference, n_prompt: int, vocab: int):
        super().__init__(program, reference, n_prompt, vocab)
        self.branches: list[int] = []  # length of the branch each tree hid the reference in

    def draft(self, ctx: DraftContext) -> Draft:
        mode, n, seed = self.program[self.step % len(self.program)]
        self.step += 1
        assert list(ctx.tokens) == self.tokens, "drafter view diverged from the controller's"
        rng = np.random.default_rng(seed)
        n = min(n, max(ctx.tree_nodes, 1), ctx.max_draft if ctx.tree_nodes == 0 else n)
        if n <= 0 or ctx.max_draft <= 0:
            return Draft()
        parents, depth = [], []
        for i in range(n):
            ok = [p for p in range(-1, i) if (1 if p < 0 else depth[p] + 1) <= ctx.max_draft]
            parents.append(int(rng.choice(ok)) if ctx.tree_nodes else i - 1)
            depth.append(1 if parents[-1] < 0 else depth[parents[-1]] + 1)
        done = len(self.tokens) - self.n_prompt
        truth = list(self.reference[done:]) + [int(x) for x in rng.integers(0, self.vocab, n)]
        chain, cur = [], -1
        while kids := [i for i, p in enumerate(parents) if p == cur]:
            cur = int(rng.choice(kids))
            chain.append(cur)
        self.branches.append(len(chain))
        tokens = [-1] * n
        if mode != "random":
            for j, node in enumerate(chain):
                tokens[node] = truth[j]
            if mode == "corrupt":
                j = chain[int(rng.integers(0, len(chain)))]
                tokens[j] = (tokens[j] + 1 + int(rng.integers(0, self.vocab - 1))) % self.vocab
        for i in range(n):  # fill the rest with tokens distinct from their siblings
            taken = {tokens[j] for j in range(n) if parents[j] == parents[i] and j != i}
            while tokens[i] < 0 or tokens[i] in taken:
                tokens[i] = int(rng.integers(0, self.vocab))
        return Draft(tuple(tokens), parents=tuple(parents))


class LazyScriptedDrafter(ScriptedDrafter):
    """A ScriptedDrafter that is also a LazyDrafter: its chain as unevaluated ids (None for an
    empty one); counts the calls of each kind."""

    def __init__(self, program, reference, n_prompt: int, vocab: int):
        super().__init__(program, reference, n_prompt, vocab)
        self.calls = {"draft": 0, "draft_ids": 0, "no_ids": 0}

    def draft(self, ctx: DraftContext) -> Draft:
        self.calls["draft"] += 1
        return super().draft(ctx)

    def draft_ids(self, ctx: DraftContext):
        self.calls["draft_ids"] += 1
        d = super().draft(ctx)
        self.calls["no_ids"] += not d.tokens
        return mx.array(d.tokens, dtype=mx.int32) + 0 if d.tokens else None
