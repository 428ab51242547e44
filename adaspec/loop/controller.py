"""The decode loop: ask the policy for a plan, draft, verify, accept, roll back, account.

Holds no maths of its own; every token it emits was produced by the target's verify forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..drafters.base import Draft, DraftContext, DraftModel, LazyDrafter, Learner
from ..targets.base import Forward, Target
from . import sampling
from .judge import LazyDraft, Verified, check_draft, judge, lazy_draft
from .plan import FLOOR, MEASURE, AlwaysSpeculate, NeverSpeculate, Plan, SpecPolicy
from .stats import GenerationStats, StepStats, arm_labels

log = logging.getLogger(__name__)

__all__ = ["AlwaysSpeculate", "DecodeConfig", "Decoder", "NeverSpeculate", "TokenEvent", "decode"]


@dataclass(frozen=True)
class DecodeConfig:
    max_tokens: int
    sampling: sampling.SamplingParams = sampling.SamplingParams()
    eos_ids: frozenset[int] = frozenset()
    logits_processors: tuple = ()
    max_draft: int = 64  # hard cap on drafted tokens per step
    tree_nodes: int = 0  # most nodes of a draft tree (0: chains only)
    # greedy chains from a LazyDrafter: verify on the unevaluated ids (no sync between them)
    overlap_draft: bool = True


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token; `step` is set on the last token of each controller step."""

    token: int
    logprobs: mx.array  # (V,) target log-probabilities (after logits processors)
    from_draft: bool
    step: StepStats | None = None


@dataclass(frozen=True)
class _Queued:
    """A plain forward queued before the token it follows was read, as mlx-lm pipelines."""

    token: mx.array  # () the lazy argmax
    logprobs: mx.array  # (V,)
    features: mx.array | None


def _tap_union(arms: Sequence[DraftModel]) -> tuple[int, ...]:
    taps: list[int] = []
    for a in arms:
        taps += [t for t in a.needs_taps if t not in taps]
    return tuple(taps)


@dataclass
class Decoder:
    """Runs one generation over zero or more drafters (arms). Invariant between steps: the
    target's cache holds every committed token but the newest (plus, while plain steps are
    pipelined, the queued forward of the newest), and every arm's committed view equals
    `self.committed`."""

    target: Target
    drafters: DraftModel | Sequence[DraftModel] | None
    cfg: DecodeConfig
    policy: SpecPolicy = field(default_factory=AlwaysSpeculate)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    stats: GenerationStats = field(default_factory=GenerationStats)
    # tokens the target and the arms already hold, as a finished decode left them (a reused
    # prompt cache); prefill feeds only what the next prompt adds past their common prefix
    held: Sequence[int] = ()

    def __post_init__(self) -> None:
        d = self.drafters
        one = d is not None and not isinstance(d, (list, tuple))
        self.arms: tuple[DraftModel, ...] = (d,) if one else tuple(d or ())  # type: ignore
        self.taps = _tap_union(self.arms)
        self.committed: list[int] = [int(t) for t in self.held]
        self._pipelinable = self.cfg.sampling.greedy and not self.cfg.logits_processors
        self.pipelinable = self._pipelinable
        self.overlap = self.pipelinable and self.cfg.overlap_draft
        self._queued: _Queued | None = None
        # why drafts are chains here whatever the drafters would propose ("" = trees verified)
        self.chains_only = (
            "ADASPEC_TREE_NODES=0"
            if self.cfg.tree_nodes <= 0
            else "logits processors"
            if self.cfg.logits_processors
            else self.target.tree_unsupported
        )
        self.stats.chains_only = self.chains_only
        names = [a.name for a in self.arms]
        self.stats.arm_names = arm_labels(names)
        self.policy.start(names)

    def share(self, shared: bool) -> None:
        """shared: the verify forwards run beside other sequences' (serve/batch.py), so no
        plain forward is queued ahead and every draft is read before its verify; else what the
        config allows."""
        if shared:
            self._drop_queued()
        self.pipelinable = self._pipelinable and not shared
        self.overlap = self.pipelinable and self.cfg.overlap_draft

    def _ctx(
        self, max_draft: int = 0, features: mx.array | None = None, tree_nodes: int = 0
    ) -> DraftContext:
        return DraftContext(
            tokens=self.committed,
            max_draft=max_draft,
            features=features,
            tree_nodes=tree_nodes,
            temperature=self.cfg.sampling.temp,
            rng=self.rng,
            sampling=self.cfg.sampling,
        )

    def _features(self, arm: DraftModel, feats: mx.array | None) -> mx.array | None:
        """The columns of the union's tap features that `arm` asked for, in its order."""
        if feats is None or not arm.needs_taps:
            return None
        if arm.needs_taps == self.taps:
            return feats
        h = feats.shape[-1] // len(self.taps)
        cols = [self.taps.index(t) for t in arm.needs_taps]
        return mx.concatenate([feats[..., c * h : (c + 1) * h] for c in cols], axis=-1)

    def _reusable(self, prompt: list[int]) -> int:
        """Cached positions `prompt` can keep: its common prefix with the held tokens, less one
        (the arms are told the rest as committed tokens, each with the features of the position
        before it). Recurrent state is never rolled back: all of it is kept, or nothing."""
        held, n = self.committed, 0
        while n < min(len(held), len(prompt)) and held[n] == prompt[n]:
            n += 1
        keep = min(n - 1, len(prompt) - 2, self.target.offset)
        if keep <= 0 or (self.target.rollback_kind != "trim" and keep < self.target.offset):
            return 0
        return keep

    def prefill(self, prompt: Sequence[int]) -> None:
        t0 = time.perf_counter()
        ids = [int(t) for t in prompt]
        keep = self._reusable(ids) if self.committed else 0
        if self.committed:  # a reused cache: back to the shared prefix, or to empty
            self.target.rollback(self.target.offset - keep)
            for arm in self.arms if keep else ():
                arm.rollback(len(self.committed) - keep - 1)
        self.committed = ids
        feats = self.target.prefill(ids[keep:-1], self.taps)
        for arm in self.arms:
            ctx = self._ctx(features=self._features(arm, feats))
            if keep:
                arm.advance(ids[keep + 1 :], ctx)
            else:
                arm.prefill(ids, ctx)
        self.stats.prompt_tokens = len(ids)
        self.stats.cached_tokens = keep
        self.stats.prefill_s = time.perf_counter() - t0

    def peek(self, plan: Plan) -> bool:
        """Before a plain step: a strong draft from one of the plan's peek arms lifts the floor
        if the policy allows (True). The draft itself is not verified; its time is measured."""
        for a in plan.peek:
            arm, t0 = self.arms[a], time.perf_counter()
            d = arm.draft(self._ctx(max_draft=self.cfg.max_draft))
            self.policy.observe_peek(a, len(d), time.perf_counter() - t0)
            # held to the same rules as a verified draft, so a broken drafter fails the same way
            check_draft(
                d, self.cfg.max_draft, self.target.info.vocab_size, arm.name, self.cfg.tree_nodes
            )
            if d.strong and self.policy.lift():
                return True
        return False

    def draft(self, plan: Plan, room: int) -> tuple[int | None, Draft | LazyDraft]:
        """Ask the plan's arms in order; the first non-empty draft is the step's."""
        nodes = 0 if self.chains_only else min(self.cfg.tree_nodes, plan.tree_nodes)
        for a, cap in plan.arms:
            cap = min(cap, self.cfg.max_draft, room - 1)
            if cap <= 0:
                break
            arm, ctx = self.arms[a], self._ctx(max_draft=cap, tree_nodes=nodes)
            ids = arm.draft_ids(ctx) if self._lazy_ok(arm, nodes) else None  # type: ignore
            if ids is not None:
                return a, lazy_draft(ids, cap, arm.name)
            d = arm.draft(ctx)
            if d.is_tree and not nodes:  # the drafter ignored ctx.tree_nodes == 0
                d = d.best_chain()
                self.stats.count_chained(self.chains_only or "the policy chose a chain")
            check_draft(d, cap, self.target.info.vocab_size, arm.name, nodes)
            if len(d):
                return a, d
        return None, Draft()

    def _lazy_ok(self, arm: DraftModel, nodes: int) -> bool:
        """Whether this step's draft from `arm` may stay lazy into the verify."""
        return self.overlap and not nodes and isinstance(arm, LazyDrafter)

    def _queue(self, token: list[int] | mx.array) -> _Queued:
        fwd = self.target.forward(token, self.taps)
        lp = sampling.logprobs(fwd.logits[-1])
        y = mx.argmax(lp, axis=-1)
        mx.async_eval(y, lp)
        return _Queued(y, lp, fwd.features)

    def _drop_queued(self) -> None:
        if self._queued is not None:
            self.target.rollback(1)  # the queued forward of the newest token is fed again
            self._queued = None

    def _plain(self, queue_next: bool) -> Verified:
        """A greedy plain step; the next one's forward is queued (on the lazy token) before this
        token is read, which hides graph-building time as mlx-lm's decoding does."""
        q = self._queued or self._queue([self.committed[-1]])
        self._queued = self._queue(q.token[None]) if queue_next else None
        token: int = q.token.item()  # type: ignore[assignment]
        return Verified([token], 0, q.logprobs[None], q.features)

    def _verify(self, draft: Draft) -> Verified:
        self._drop_queued()
        fed = [self.committed[-1], *draft.tokens]
        if draft.parents is not None:
            return self._verify_tree(fed, draft)
        return self._verdict(self.target.forward(fed, self.taps), fed, draft)

    def _verdict(self, fwd: Forward, fed: list[int], draft: Draft) -> Verified:
        """What the verify forward over `fed` (the newest committed token, then the chain)
        commits of `draft`."""
        logits = sampling.apply_processors(
            fwd.logits, self.committed, fed, self.cfg.logits_processors
        )
        outcome, lp = judge(logits, draft, self.cfg.sampling, self.rng)
        new = sampling.cut_at_eos(outcome.tokens, self.cfg.eos_ids)
        return Verified(new, min(outcome.accepted, len(new)), lp, fwd.features)

    def _verify_lazy(self, lazy: LazyDraft) -> tuple[Verified, Draft]:
        """The verify forward built on the draft's unevaluated ids; one evaluation computes the
        draft and the target's judgement of it; then the ids are read and checked."""
        self._drop_queued()
        last = mx.array([self.committed[-1]], dtype=mx.uint32)
        # clipped for the forward only: an id outside the vocabulary is refused once read
        ids = mx.clip(lazy.ids, 0, self.target.info.vocab_size - 1).astype(mx.uint32)
        fwd = self.target.forward(mx.concatenate([last, ids]), self.taps)
        mx.eval(lazy.ids, fwd.logits)
        draft = Draft(lazy.ids.tolist())  # type: ignore[arg-type]
        check_draft(draft, lazy.cap, self.target.info.vocab_size, lazy.name)
        return self._verdict(fwd, [self.committed[-1], *draft.tokens], draft), draft

    def _verify_tree(self, fed: list[int], draft: Draft) -> Verified:
        """One forward over the tree; the cache keeps the accepted path, and the rows returned
        are the ones the committed tokens came from."""
        assert draft.parents is not None
        fwd = self.target.forward_tree(fed, draft.parents, self.taps)
        outcome, lp = judge(fwd.logits, draft, self.cfg.sampling, self.rng)
        self.target.keep_path(outcome.path)
        rows = mx.array([0, *(1 + i for i in outcome.path)])
        feats = None if fwd.features is None else fwd.features[rows]
        new = sampling.cut_at_eos(outcome.tokens, self.cfg.eos_ids)
        return Verified(new, min(outcome.accepted, len(new)), lp[rows], feats)

    def _judge_step(
        self, draft: Draft | LazyDraft, plan: Plan, room: int
    ) -> tuple[Verified, Draft, bool]:
        """The step's verify (or plain forward): what it committed, the draft as read, and
        whether its forward had been queued by the step before."""
        if isinstance(draft, LazyDraft):
            return *self._verify_lazy(draft), False
        if not draft.tokens and self.pipelinable:
            queued = self._queued is not None
            return self._plain(plan.plain_ahead > 0 and room > 1), draft, queued
        return self._verify(draft), draft, False

    def step(
        self, room: int, plan: Plan | None = None
    ) -> tuple[list[int], list[bool], mx.array, StepStats]:
        """Emit 1..room tokens (fewer only at EOS), following `plan` (default: the policy's)."""
        plan = self.policy.plan() if plan is None else plan
        t0 = time.perf_counter()
        # 1. draft: the plan's arms in order (none for a plain step)
        arm, draft = self.draft(plan, room)
        return self.complete(plan, room, arm, draft, t0)

    def complete(
        self,
        plan: Plan,
        room: int,
        arm: int | None,
        draft: Draft | LazyDraft,
        t0: float,
        forward_s: float = 0.0,
    ) -> tuple[list[int], list[bool], mx.array, StepStats]:
        """The rest of a step whose draft (from `arm`, begun at `t0`) is given. forward_s:
        seconds of a verify forward run beforehand for this step (a shared batched forward's
        share), counted as verify time."""
        t1 = time.perf_counter()
        # 2. verify the newest committed token plus the draft in one forward, and accept
        v, draft, queued = self._judge_step(draft, plan, room)
        t2 = time.perf_counter()
        # 3. commit; the cache keeps every committed token but the newest; tell every arm
        self.committed += v.tokens
        if draft.tokens:
            self.target.rollback(self.target.offset - (len(self.committed) - 1))
        feats = v.features[: len(v.tokens)] if v.features is not None else None
        for a in self.arms:
            a.advance(v.tokens, self._ctx(features=self._features(a, feats)))
        t3 = time.perf_counter()
        # 4. account
        p1 = None
        if self.policy.needs_p1 and draft.tokens:
            p1 = sampling.top1_prob(v.logprobs[v.accepted])
        s = StepStats(
            committed=len(v.tokens),
            verify_s=t2 - t1 + forward_s,
            drafted=max(draft.depths(), default=0),
            nodes=len(draft) if draft.is_tree else 0,
            accepted=v.accepted,
            arm=arm,
            draft_s=t1 - t0,
            rollback_s=t3 - t2,
            context=len(self.committed),
            p1=p1,
            floored=plan.plain and plan.plain_reason == FLOOR,
            measuring=plan.plain and plan.plain_reason == MEASURE,
            setup_s=draft.setup_s,
            queued=queued,
        )
        self.stats.record(s)
        self.policy.observe(s)
        if draft.tokens:
            self.stats.policy = self.policy.summary()
        return v.tokens, [j < v.accepted for j in range(len(v.tokens))], v.logprobs, s

    def unwind(self, n: int) -> None:
        """Forget the newest n committed tokens everywhere (caller stopped mid-step), and any
        queued forward."""
        self._drop_queued()
        if n <= 0:
            return
        del self.committed[-n:]
        self.target.rollback(n)
        for a in self.arms:
            a.rollback(n)


StepResult = tuple[list[int], list[bool], mx.array, StepStats]


def planned_step(decoder: Decoder, room: int) -> StepResult:
    """The policy's next step (a floor lifted by a strong peeked draft), run alone."""
    plan = decoder.policy.plan()
    if plan.plain and plan.peek and decoder.peek(plan):
        plan = decoder.policy.plan()
    return decoder.step(room, plan)


def decode(
    decoder: Decoder,
    prompt: Sequence[int] | None,
    steps: Callable[[Decoder, int], StepResult] = planned_step,
) -> Generator[TokenEvent, None, None]:
    """Yield tokens one at a time; if the consumer stops early, the target's cache and every
    arm are rolled back to exactly the tokens it has received. prompt None: the decoder was
    prefilled already. steps(decoder, room): the next step's result (a batched server runs
    the step beside other sequences' and hands its result in)."""
    if prompt is not None:
        decoder.prefill(prompt)
    emitted = pending = 0  # pending: committed in the current step, not yet received
    try:
        while emitted < decoder.cfg.max_tokens:
            new, from_draft, lp, s = steps(decoder, decoder.cfg.max_tokens - emitted)
            pending = len(new)
            for j, tok in enumerate(new):
                pending -= 1
                emitted += 1
                yield TokenEvent(tok, lp[j], from_draft[j], s if j == len(new) - 1 else None)
            if new[-1] in decoder.cfg.eos_ids:
                return
    finally:
        decoder.unwind(pending)
        # after an error mid-step the cache may hold fed tokens past the newest committed one
        decoder.target.rollback(decoder.target.offset - (len(decoder.committed) - 1))
        for arm in decoder.arms:
            if isinstance(arm, Learner):
                arm.finish()
        decoder.stats.policy = decoder.policy.summary()
        for w in decoder.stats.warnings:
            log.warning(w)
