"""Requests decoded together. Each step: every active request plans and drafts with its own
drafters and policy; the drafts are cut to what pays in the shared forward
(policy/batch_budget.py); ONE forward runs over every request's rows (its newest token and
its draft, targets/batch.py); then each request accepts, rolls back and accounts from its own
rows as it would alone. A request's tokens at T=0 are therefore the ones it gets alone."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..drafters.base import Draft
from ..errors import TargetError
from ..loop.controller import Decoder, StepResult, decode, planned_step
from ..loop.plan import Plan
from ..policy.batch_budget import RowCost, split
from ..targets.base import Forward
from ..targets.batch import MAX_ROWS, forward_rows


@dataclass
class Member:
    """One request in the batch. `emit(response)` hands a response on and says whether the
    request is done (its stop sequence matched, its client went away, or it finished)."""

    decoder: Decoder
    emit: Callable[[Any], bool]
    cancelled: Callable[[], bool] = lambda: False  # the client went away: leave at once
    inbox: deque = field(default_factory=deque)
    responses: Iterator[Any] | None = None  # api._texts over decode(decoder, None, self.take)
    emitted: int = 0
    done: bool = False
    error: Exception | None = None  # what ended it early (its own drafter, say), if anything
    steps: int = 0  # batch steps this request took part in
    shared: int = 0  # the requests in those steps' forwards, summed
    # the step under way: plan, arm, draft, start time
    plan: Plan = field(default_factory=Plan)
    arm: int | None = None
    draft: Draft = field(default_factory=Draft)
    t0: float = 0.0

    def events(self) -> Generator[Any, None, None]:
        """The request's token events, each step's result handed in by the batch."""
        return decode(self.decoder, None, self.take)

    def take(self, decoder: Decoder, room: int) -> StepResult:
        return self.inbox.popleft()

    @property
    def room(self) -> int:
        return self.decoder.cfg.max_tokens - self.emitted

    def close(self) -> None:
        """Stop here: the decoder rolls back to the tokens handed on (decode's `finally`)."""
        self.done = True
        responses, self.responses = self.responses, None
        # no reference cycles left (request <-> member, member <-> its generators): a finished
        # request's caches are freed when it is dropped, not at the next cyclic collection
        self.emit, self.cancelled = _finished, _finished
        self.inbox.clear()
        if responses is not None:
            responses.close()  # type: ignore[attr-defined]


def _finished(*_: Any) -> bool:
    return True


class SharedTarget:
    """A request's target inside a batch: its verify forward was run beside the others' and
    is handed in (`hand`) before the decoder asks for it; everything else is the target's."""

    def __init__(self, target: Any):
        self.inner = target
        self.handed: Forward | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def offset(self) -> int:
        return self.inner.offset

    def hand(self, fwd: Forward) -> None:
        self.handed = fwd

    def forward(self, tokens: Any, taps: tuple[int, ...] = ()) -> Forward:
        f, self.handed = self.handed, None
        if f is None:
            return self.inner.forward(tokens, taps)
        if f.logits.shape[0] != len(tokens):
            raise TargetError(
                f"the batched forward fed {f.logits.shape[0]} rows, the decoder verifies "
                f"{len(tokens)}; accepted: the rows the batch drafted"
            )
        return f


def _columns(feats: mx.array | None, union: tuple[int, ...], taps: tuple[int, ...]) -> Any:
    """The columns of the union's tap features that `taps` asked for, in its order."""
    if feats is None or not taps:
        return None
    if taps == union:
        return feats
    h = feats.shape[-1] // len(union)
    cols = [union.index(t) for t in taps]
    return mx.concatenate([feats[..., c * h : (c + 1) * h] for c in cols], axis=-1)


def _shares(rows: list[int], curve: list[float]) -> list[float]:
    """Each request's share of a shared forward: what its rows would cost alone (the curve's
    growth per row over one row), over the sum of those; a plain request pays as much as a
    plain step alone would, relative to a drafting one, as it would alone."""
    m = sum(rows)
    slope = (curve[m] / curve[1] - 1) / (m - 1) if m > 1 else 0.0
    alone = [1 + slope * (r - 1) for r in rows]
    return [a / sum(alone) for a in alone]


def _guarded(m: Member, fn: Callable[..., None], *args: Any) -> None:
    """Run one request's part of a step; an error ends that request only (`m.error`)."""
    try:
        fn(*args)
    except Exception as e:
        m.error = e
        try:
            m.close()
        except Exception:
            pass  # its caches are dropped by whoever reads m.error


def _gains(member: Member) -> tuple[float, ...]:
    k = len(member.draft)
    if not k or member.arm is None:
        return ()
    gains = getattr(member.decoder.policy, "gains", None)  # only the adaptive policy learns
    return gains(member.arm, k) if gains is not None else (1.0,) * k


@dataclass
class Batch:
    """The active requests and the forward cost by rows they are budgeted against."""

    max_rows: int = MAX_ROWS
    members: list[Member] = field(default_factory=list)
    cost: RowCost = field(default_factory=lambda: RowCost(MAX_ROWS))
    steps: int = 0
    rows_fed: int = 0

    def add(self, member: Member) -> None:
        if len(self.members) >= self.max_rows:
            raise ValueError(f"a batch holds at most {self.max_rows} requests (one row each)")
        self.members.append(member)

    def drop_done(self) -> list[Member]:
        done = [m for m in self.members if m.done]
        self.members = [m for m in self.members if not m.done]
        return done

    def _draft(self, m: Member) -> None:
        d = m.decoder
        d.share(True)
        m.plan = d.policy.plan()
        if m.plan.plain and m.plan.peek and d.peek(m.plan):
            m.plan = d.policy.plan()
        m.t0 = time.perf_counter()
        m.arm, draft = d.draft(m.plan, m.room)
        assert isinstance(draft, Draft), "a shared decoder's drafts are read before the verify"
        m.draft = draft

    def _budget(self) -> None:
        """Cut each draft to the length the batch's expected tokens per second picks."""
        ks = split([_gains(m) for m in self.members], self.cost.curve(), self.max_rows)
        for m, k in zip(self.members, ks):
            if k < len(m.draft):
                assert isinstance(m.draft, Draft) and m.draft.parents is None
                probs = None if m.draft.probs is None else m.draft.probs[:k]
                m.draft = Draft(m.draft.tokens[:k], probs, None, m.draft.strong, m.draft.setup_s)

    def step(self) -> list[Member]:
        """One step for every active request; returns the requests that finished."""
        for m in self.members:
            if m.cancelled():
                m.close()
        live = [m for m in self.members if not m.done]
        if len(live) <= 1:  # alone: its own forwards, pipelined as stream_generate's
            return self._alone(live)
        # 1. plan and draft, each request with its own policy and drafters
        for m in live:
            _guarded(m, self._draft, m)
        live = [m for m in live if not m.done]
        if not live:
            return self.drop_done()
        # 2. cut the drafts to what pays in the shared forward
        self._budget()
        # 3. one forward over every request's newest token and draft
        rows = [[m.decoder.committed[-1], *m.draft.tokens] for m in live]
        union: tuple[int, ...] = ()
        for m in live:
            union += tuple(t for t in m.decoder.taps if t not in union)
        t0 = time.perf_counter()
        targets = [m.decoder.target.inner for m in live]  # type: ignore[attr-defined]
        fwds = forward_rows(targets, rows, union)
        mx.eval([f.logits for f in fwds])
        spent = time.perf_counter() - t0
        total = sum(len(r) for r in rows)
        self.cost.observe(total, spent)
        self.steps, self.rows_fed = self.steps + 1, self.rows_fed + total
        shares = _shares([len(r) for r in rows], self.cost.curve())
        # 4. each request accepts and rolls back from its rows, charged its rows' share
        for m, f, share in zip(live, fwds, shares):
            m.steps, m.shared = m.steps + 1, m.shared + len(live)
            feats = _columns(f.features, union, m.decoder.taps)
            m.decoder.target.hand(Forward(f.logits, feats))  # type: ignore[attr-defined]
            _guarded(m, self._complete, m, spent * share)
        return self.drop_done()

    def _complete(self, m: Member, forward_s: float) -> None:
        result = m.decoder.complete(m.plan, m.room, m.arm, m.draft, m.t0, forward_s)
        m.inbox.append(result)
        self._hand_on(m, len(result[0]))

    def _alone(self, live: list[Member]) -> list[Member]:
        for m in live:
            _guarded(m, self._step_alone, m)
        return self.drop_done()

    def _step_alone(self, m: Member) -> None:
        m.decoder.share(False)
        result = planned_step(m.decoder, m.room)
        m.steps, m.shared = m.steps + 1, m.shared + 1
        m.inbox.append(result)
        self._hand_on(m, len(result[0]))

    def _hand_on(self, m: Member, n: int) -> None:
        """Pull one response per committed token (n) through the request's text framing."""
        assert m.responses is not None
        for _ in range(n):
            r = next(m.responses, None)
            m.emitted += 1
            if r is None or m.emit(r):
                m.close()
                return


def join(
    decoder: Decoder,
    ids: list[int],
    tokenizer: Any,
    emit: Callable[[Any], bool],
    prompt_cache: Any = None,
    stop: tuple[str, ...] = (),
    cancelled: Callable[[], bool] = lambda: False,
) -> Member:
    """A request ready for the batch: its decoder (from api.start_decoder with
    shared_forward=True) prefilled alone, its responses framed as stream_generate's."""
    from .. import api

    decoder.target = SharedTarget(decoder.target)
    decoder.prefill(ids)
    m = Member(decoder, emit, cancelled)
    texts = api._texts(decoder, ids, tokenizer, decoder.cfg.max_tokens, stop, m.events())
    m.responses = api._kept(prompt_cache, decoder, texts) if prompt_cache else texts
    return m
