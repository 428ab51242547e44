"""The decode loop: ask the policy, draft, verify, accept, roll back, account.

Holds no maths of its own; every token it emits was produced by the target's verify forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..drafters.base import Draft, DraftContext, DraftModel
from ..errors import DrafterError
from ..targets.base import Forward, Target
from . import acceptance, sampling
from .stats import GenerationStats, StepStats


@dataclass(frozen=True)
class DecodeConfig:
    max_tokens: int
    sampling: sampling.SamplingParams = sampling.SamplingParams()
    eos_ids: frozenset[int] = frozenset()
    logits_processors: tuple = ()
    max_draft: int = 64  # hard cap on drafted tokens per step


class SpecPolicy(Protocol):
    """Decides, from past steps only, how many tokens may be drafted next (0 = plain AR).
    needs_p1: whether `observe` wants StepStats.p1 (costs one reduction per step)."""

    needs_p1: bool

    def max_draft(self) -> int: ...

    def max_cheap_draft(self) -> int:
        """How many tokens a draft that costs next to nothing (Draft.cheap) may hold; it may be
        > 0 while max_draft() is 0 (costly drafts held back, cheap ones wanted)."""
        ...

    def observe(self, step: StepStats) -> None: ...

    def plain_ahead(self) -> int:
        """How many of the next steps are certainly plain (no draft whatever happens), so the
        controller may pipeline them; 0 if unknown."""
        ...

    def lift(self) -> bool:
        """A strong candidate was seen while floored: end the floor now if allowed."""
        ...

    def summary(self) -> dict: ...


class AlwaysSpeculate:
    needs_p1 = False

    def max_draft(self) -> int:
        return 1 << 30

    def max_cheap_draft(self) -> int:
        return self.max_draft()

    def observe(self, step: StepStats) -> None:
        pass

    def plain_ahead(self) -> int:
        return 0

    def lift(self) -> bool:
        return False

    def summary(self) -> dict:
        return {}


class NeverSpeculate(AlwaysSpeculate):
    def max_draft(self) -> int:
        return 0

    def plain_ahead(self) -> int:
        return 1 << 30


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token; `step` is set on the last token of each controller step."""

    token: int
    logprobs: mx.array  # (V,) target log-probabilities (after logits processors)
    from_draft: bool
    step: StepStats | None = None


@dataclass
class _Verdict:
    outcome: acceptance.Outcome
    logprobs: mx.array  # (k+1, V)


def _check_draft(d: Draft, cap: int, cheap_cap: int, vocab: int, name: str) -> None:
    allowed = cheap_cap if d.cheap else cap
    if len(d) > allowed:
        raise DrafterError(
            f"drafter {name!r} proposed {len(d)} {'cheap ' if d.cheap else ''}tokens; at most "
            f"{allowed} allowed"
        )
    bad = [t for t in d.tokens if not 0 <= t < vocab]
    if bad:
        raise DrafterError(
            f"drafter {name!r} proposed token ids {bad[:5]} outside the target's vocabulary "
            f"(accepted: 0..{vocab - 1})"
        )
    if d.probs is not None and d.probs.shape[1] != vocab:
        raise DrafterError(
            f"drafter {name!r} returned q with {d.probs.shape[1]} columns; the target's "
            f"vocabulary has {vocab}"
        )


def _judge(
    fwd: Forward,
    fed: list[int],
    draft: Draft,
    history: Sequence[int],
    cfg: DecodeConfig,
    rng: np.random.Generator,
) -> _Verdict:
    logits = sampling.apply_processors(fwd.logits, history, fed, cfg.logits_processors)
    lp = sampling.logprobs(logits)
    if cfg.sampling.greedy:
        argmax = mx.argmax(logits, axis=-1).tolist()
        return _Verdict(acceptance.accept_greedy(draft.tokens, argmax), lp)
    p = sampling.LazyRows(sampling.probs(lp, cfg.sampling))
    if draft.probs is not None:
        out = acceptance.accept_rejection(draft.tokens, draft.probs, p, rng)
    else:
        out = acceptance.accept_sample_match(draft.tokens, p, rng)
    return _Verdict(out, lp)


@dataclass
class Decoder:
    """Runs one generation. Invariant between steps: the target's cache holds every committed
    token but the newest, and the drafter's committed view equals `self.committed`."""

    target: Target
    drafter: DraftModel | None
    cfg: DecodeConfig
    policy: SpecPolicy = field(default_factory=AlwaysSpeculate)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self) -> None:
        self.taps = self.drafter.needs_taps if self.drafter else ()
        self.committed: list[int] = []

    def _ctx(
        self, max_draft: int = 0, features: mx.array | None = None, max_cheap: int | None = None
    ) -> DraftContext:
        return DraftContext(
            tokens=self.committed,
            max_draft=max_draft,
            max_cheap=max_cheap,
            features=features,
            temperature=self.cfg.sampling.temp,
            rng=self.rng,
            sampling=self.cfg.sampling,
        )

    def prefill(self, prompt: Sequence[int]) -> None:
        t0 = time.perf_counter()
        self.committed = [int(t) for t in prompt]
        feats = self.target.prefill(self.committed[:-1], self.taps)
        if self.drafter is not None:
            self.drafter.prefill(self.committed, self._ctx(features=feats))
        self.stats.prompt_tokens = len(self.committed)
        self.stats.prefill_s = time.perf_counter() - t0

    def step(self, room: int) -> tuple[list[int], list[bool], mx.array, StepStats]:
        """Emit 1..room tokens (fewer only at EOS)."""
        # 1. how much may we draft? (never past the room left before max_tokens)
        # (a costly budget of 0 with a cheap one left: only a cheap draft is wanted)
        budget = min(self.policy.max_draft(), self.cfg.max_draft)
        cheap_budget = min(self.policy.max_cheap_draft(), self.cfg.max_draft)
        t0 = time.perf_counter()
        draft = Draft()
        if self.drafter is not None and max(budget, cheap_budget) > 0 and room > 1:
            cap, cheap_cap = min(budget, room - 1), min(cheap_budget, room - 1)
            draft = self.drafter.draft(self._ctx(max_draft=cap, max_cheap=cheap_cap))
            _check_draft(draft, cap, cheap_cap, self.target.info.vocab_size, self.drafter.name)
        t1 = time.perf_counter()
        # 2. verify the pending token plus the draft in one forward, then accept
        fed = [self.committed[-1], *draft.tokens]
        fwd = self.target.forward(fed, self.taps)
        verdict = _judge(fwd, fed, draft, self.committed, self.cfg, self.rng)
        new = list(verdict.outcome.tokens)
        for j, t in enumerate(new):
            if t in self.cfg.eos_ids:
                new = new[: j + 1]
                break
        t2 = time.perf_counter()
        # 3. drop what was not committed: the cache keeps all committed tokens but the newest
        self.committed += new
        self.target.rollback(self.target.offset - (len(self.committed) - 1))
        if self.drafter is not None:
            feats = fwd.features[: len(new)] if fwd.features is not None else None
            self.drafter.advance(new, self._ctx(features=feats))
        t3 = time.perf_counter()
        p1 = None
        if self.policy.needs_p1 and len(draft) > 0:
            p1 = float(mx.exp(mx.max(verdict.logprobs[verdict.outcome.accepted])).item())
        s = StepStats(
            len(draft),
            verdict.outcome.accepted,
            len(new),
            len(draft) > 0,
            t1 - t0,
            t2 - t1,
            t3 - t2,
            len(self.committed),
            p1,
            max(budget, cheap_budget) <= 0,
            draft.setup_s,
            draft.cheap,
        )
        self.stats.record(s)
        self.policy.observe(s)
        self.stats.policy = self.policy.summary()
        from_draft = [j < verdict.outcome.accepted for j in range(len(new))]
        return new, from_draft, verdict.logprobs, s

    def strong_candidate(self) -> bool:
        """While floored: does a cheap drafter have a strong draft right now? (lifts the floor)"""
        d = self.drafter
        if d is None:
            return False
        peek = getattr(d, "peek", None) or (d.draft if d.cheap_draft else None)
        if peek is None:
            return False
        ctx = self._ctx(max_draft=self.cfg.max_draft)
        draft = peek(ctx)
        # held to the same rules as a verified draft, so a broken drafter fails the same way
        _check_draft(draft, ctx.max_draft, ctx.cheap_cap, self.target.info.vocab_size, d.name)
        return draft.strong and self.policy.lift()

    def unwind(self, n: int) -> None:
        """Forget the newest n committed tokens everywhere (caller stopped mid-step)."""
        if n <= 0:
            return
        del self.committed[-n:]
        self.target.rollback(n)
        if self.drafter is not None:
            self.drafter.rollback(n)


def _plain_burst(decoder: Decoder, n: int) -> Iterator[TokenEvent]:
    """Up to n greedy plain steps, pipelined as mlx-lm does: the forward for token i+1 is queued
    (on the lazy argmax) before token i is read, hiding graph-building time. The drafter still
    sees every token (with its tap features) and the policy every step; a strong candidate ends
    the burst (its queued forward is rolled back)."""
    dec, target, taps = decoder, decoder.target, decoder.taps

    def queue(tok: mx.array | list[int]) -> tuple[mx.array, mx.array, mx.array | None]:
        fwd = target.forward(tok, taps)
        lp = sampling.logprobs(fwd.logits[-1])
        y = mx.argmax(lp, axis=-1)
        mx.async_eval(y, lp)
        return y, lp, fwd.features

    t0 = time.perf_counter()  # before the first queue: mlx runs part of a queued forward at once
    y, lp, feats = queue([dec.committed[-1]])
    for i in range(n):
        nxt = queue(y[None]) if i + 1 < n else None
        tok = int(y.item())
        dec.committed.append(tok)
        t1 = time.perf_counter()
        if dec.drafter is not None:
            dec.drafter.advance([tok], dec._ctx(features=feats))
        t2 = time.perf_counter()
        s = StepStats(0, 0, 1, False, 0.0, t1 - t0, t2 - t1, len(dec.committed), None, True)
        dec.stats.record(s)
        dec.policy.observe(s)
        t0 = t2
        yield TokenEvent(tok, lp, False, s)
        if tok in dec.cfg.eos_ids or nxt is None:
            return
        if dec.strong_candidate():
            target.rollback(1)  # the queued forward of `tok` is fed again by the next step
            return
        y, lp, feats = nxt


def _pipelinable(decoder: Decoder) -> bool:
    # a lazy token can feed the next forward only if nothing on the host must see it first
    return decoder.cfg.sampling.greedy and not decoder.cfg.logits_processors


def decode(decoder: Decoder, prompt: Sequence[int]) -> Iterator[TokenEvent]:
    """Yield tokens one at a time; if the consumer stops early, both caches are rolled back to
    exactly the tokens it has received."""
    decoder.prefill(prompt)
    max_tokens = decoder.cfg.max_tokens
    pipelinable = _pipelinable(decoder)
    emitted = 0
    pending = 0  # committed in the current step but not yet received by the consumer
    try:
        while emitted < max_tokens:
            room = max_tokens - emitted
            ahead = room if decoder.drafter is None else decoder.policy.plain_ahead()
            if ahead > 0 and decoder.strong_candidate():
                ahead = 0
            if pipelinable and ahead > 1:
                for ev in _plain_burst(decoder, min(ahead, room)):
                    emitted += 1
                    yield ev
                    if ev.token in decoder.cfg.eos_ids:
                        return
                continue
            new, from_draft, lp, s = decoder.step(room)
            pending = len(new)
            for j, tok in enumerate(new):
                pending -= 1
                emitted += 1
                last = j == len(new) - 1
                yield TokenEvent(tok, lp[j], from_draft[j], s if last else None)
            if new[-1] in decoder.cfg.eos_ids:
                return
    finally:
        decoder.unwind(pending)
        # a queued forward may sit past the newest committed token
        decoder.target.rollback(decoder.target.offset - (len(decoder.committed) - 1))
