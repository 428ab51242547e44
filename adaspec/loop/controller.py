"""The decode loop. A step comes in two halves: `propose` (the policy's plan, the arms' draft:
what to verify) and `commit` (given the verify forward's output: accept, roll back, tell the
arms, account). `step` runs both on the decoder's own forwards; a batch runs one forward for
several decoders' proposals between the halves (serve/batch.py).

Holds no maths of its own; every token it emits was produced by the target's verify forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from ..drafters.base import Draft, DraftContext, DraftModel, LazyDrafter, Learner
from ..targets.base import Forward, Target
from . import sampling
from .judge import LazyDraft, Verified, check_draft, lazy_draft
from .plan import FLOOR, MEASURE, AlwaysSpeculate, NeverSpeculate, Plan, SpecPolicy
from .stats import GenerationStats, StepStats, arm_labels
from .verify import DecodeConfig, Verifier, tap_columns, tap_union

log = logging.getLogger(__name__)

__all__ = [
    "AlwaysSpeculate",
    "DecodeConfig",
    "Decoder",
    "NeverSpeculate",
    "Proposal",
    "TokenEvent",
    "decode",
]


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token; `step` is set on the last token of each controller step."""

    token: int
    logprobs: mx.array  # (V,) target log-probabilities (after logits processors)
    from_draft: bool
    step: StepStats | None = None


StepResult = tuple[list[int], list[bool], mx.array, StepStats]


@dataclass(frozen=True)
class Proposal:
    """A step's first half (`Decoder.propose`): the policy's plan, the arm that drafted (None:
    nothing was drafted) and its draft, read or still lazy."""

    plan: Plan
    room: int  # tokens the step may still emit
    arm: int | None
    draft: Draft | LazyDraft
    last: int  # the newest committed token: the verify forward's first row
    t0: float  # when drafting began

    @property
    def rows(self) -> list[int]:
        """The verify forward's rows: the newest committed token, then the (read) chain."""
        assert isinstance(self.draft, Draft) and self.draft.parents is None
        return [self.last, *self.draft.tokens]

    def cut(self, k: int) -> Proposal:
        """The same step with its chain cut to its first k tokens (a batch's budget)."""
        d = self.draft
        assert isinstance(d, Draft) and d.parents is None
        if k >= len(d):
            return self
        probs = None if d.probs is None else d.probs[:k]
        return replace(self, draft=Draft(d.tokens[:k], probs, None, d.strong, d.setup_s))


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
        self.taps = tap_union(self.arms)
        self.committed: list[int] = [int(t) for t in self.held]
        self.verifier = Verifier(self.target, self.taps, self.cfg, self.rng)
        self._pipelinable = self.cfg.sampling.greedy and not self.cfg.logits_processors
        self.pipelinable = self._pipelinable
        self.overlap = self.pipelinable and self.cfg.overlap_draft
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
            self.verifier.drop_queued()
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
        return tap_columns(feats, self.taps, arm.needs_taps)

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

    def propose(self, room: int, plan: Plan | None = None) -> Proposal:
        """A step's first half: the policy's plan (default; a floor lifted by a strong peeked
        draft) and its arms' draft, for a step that may emit up to `room` tokens."""
        if plan is None:
            plan = self.policy.plan()
            if plan.plain and plan.peek and self.peek(plan):
                plan = self.policy.plan()
        t0 = time.perf_counter()
        arm, draft = self.draft(plan, room)
        return Proposal(plan, room, arm, draft, self.committed[-1], t0)

    def step(self, room: int, plan: Plan | None = None) -> StepResult:
        """Emit 1..room tokens (fewer only at EOS), following `plan` (default: the policy's),
        on the decoder's own forwards."""
        return self.commit(self.propose(room, plan))

    def _verified(self, p: Proposal, fwd: Forward | None) -> tuple[Verified, Draft, bool]:
        """The step's verify (or plain forward): what it committed, the draft as read, and
        whether its forward had been queued by the step before."""
        v = self.verifier
        if isinstance(p.draft, LazyDraft):
            assert fwd is None, "a lazy draft is verified on the decoder's own forward"
            return *v.lazy(self.committed, p.draft), False
        if fwd is None and not p.draft.tokens and self.pipelinable:
            queued = v.queued is not None
            return v.plain(p.last, p.plan.plain_ahead > 0 and p.room > 1), p.draft, queued
        return v.chain(self.committed, p.draft, fwd), p.draft, False

    def commit(self, p: Proposal, fwd: Forward | None = None, forward_s: float = 0.0) -> StepResult:
        """A step's second half: judge the verify forward, commit, roll back, tell the arms,
        account. fwd: the forward over `p.rows` run by the caller beside other sequences' (a
        batch), its share of that forward's time `forward_s` counted as verify time; None: the
        decoder runs its own (pipelined plain steps, lazy drafts and trees among them)."""
        t1 = time.perf_counter()
        # 2. verify the newest committed token plus the draft in one forward, and accept
        v, draft, queued = self._verified(p, fwd)
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
        s = self._account(p, v, draft, queued, (t1 - p.t0, t2 - t1 + forward_s, t3 - t2))
        return v.tokens, [j < v.accepted for j in range(len(v.tokens))], v.logprobs, s

    def _account(
        self, p: Proposal, v: Verified, draft: Draft, queued: bool, times: tuple[float, ...]
    ) -> StepStats:
        """The step's stats, recorded and shown to the policy. times: draft, verify, rollback."""
        p1 = None
        if self.policy.needs_p1 and draft.tokens:
            p1 = sampling.top1_prob(v.logprobs[v.accepted])
        plan = p.plan
        s = StepStats(
            committed=len(v.tokens),
            verify_s=times[1],
            drafted=max(draft.depths(), default=0),
            nodes=len(draft) if draft.is_tree else 0,
            accepted=v.accepted,
            arm=p.arm,
            draft_s=times[0],
            rollback_s=times[2],
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
        return s

    def unwind(self, n: int) -> None:
        """Forget the newest n committed tokens everywhere (caller stopped mid-step), and any
        queued forward."""
        self.verifier.drop_queued()
        if n <= 0:
            return
        del self.committed[-n:]
        self.target.rollback(n)
        for a in self.arms:
            a.rollback(n)


def decode(
    decoder: Decoder,
    prompt: Sequence[int] | None,
    steps: Callable[[Decoder, int], StepResult] = Decoder.step,
) -> Generator[TokenEvent, None, None]:
    """Yield tokens one at a time; if the consumer stops early, the target's cache and every
    arm are rolled back to exactly the tokens it has received. prompt None: the decoder was
    prefilled already. steps(decoder, room): the next step's result (a batched server runs
    the step's halves around a forward shared with other sequences and hands the result in)."""
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
