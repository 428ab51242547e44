"""Requests decoded together. Each step: every active request's decoder proposes (its own
policy and drafters: `Decoder.propose`); the drafts are cut to what pays in the shared forward
(policy/batch_budget.py); ONE forward runs over every request's rows (its newest token and its
draft, targets/batch.py); then each decoder commits from its own rows as it would alone
(`Decoder.commit`). A request's tokens at T=0 are therefore the ones it gets alone."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..api import kept, texts
from ..errors import TargetError
from ..loop.controller import Decoder, Proposal, StepResult, decode
from ..loop.verify import tap_columns
from ..policy.batch_budget import observe_rows, row_curve, split
from ..targets.base import Forward
from ..targets.batch import MAX_ROWS, batch_unsupported, forward_rows
from ..targets.kv import KVTarget


@dataclass
class Member:
    """One request in the batch. `emit(response)` hands a response on and says whether the
    request is done (its stop sequence matched, its client went away, or it finished)."""

    decoder: Decoder
    emit: Callable[[Any], bool]
    cancelled: Callable[[], bool] = lambda: False  # the client went away: leave at once
    inbox: deque = field(default_factory=deque)
    responses: Iterator[Any] | None = None  # api.texts over decode(decoder, None, self.take)
    emitted: int = 0
    done: bool = False
    error: Exception | None = None  # what ended it early (its own drafter, say), if anything
    steps: int = 0  # batch steps this request took part in
    shared: int = 0  # the requests in those steps' forwards, summed
    proposal: Proposal | None = None  # the step under way: its first half

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


def _shares(rows: list[int], curve: list[float]) -> list[float]:
    """Each request's share of a shared forward: what its rows would cost alone (the curve's
    growth per row over one row), over the sum of those; a plain request pays as much as a
    plain step alone would, relative to a drafting one, as it would alone."""
    m = sum(rows)
    slope = (curve[m] / curve[1] - 1) / (m - 1) if m > 1 else 0.0
    alone = [1 + slope * (r - 1) for r in rows]
    return [a / sum(alone) for a in alone]


def _kv_target(decoder: Decoder) -> KVTarget:
    """The decoder's target, which a shared forward feeds (the server admits only these)."""
    target = decoder.target
    if not isinstance(target, KVTarget):
        raise TargetError(f"a shared forward cannot feed {batch_unsupported(target)}")
    return target


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


def _gains(m: Member) -> tuple[float, ...]:
    p = m.proposal
    if p is None or not len(p.draft) or p.arm is None:
        return ()
    return m.decoder.policy.gains(p.arm, len(p.draft))


@dataclass
class Batch:
    """The active requests and the forward cost by rows they are budgeted against."""

    max_rows: int = MAX_ROWS
    members: list[Member] = field(default_factory=list)
    cost: tuple[float, ...] = ()  # seconds of a forward by its rows (batch_budget.row_curve)
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

    def _propose(self, m: Member) -> None:
        m.decoder.share(True)
        m.proposal = m.decoder.propose(m.room)

    def _budget(self, live: list[Member]) -> None:
        """Cut each draft to the length the batch's expected tokens per second picks."""
        ks = split([_gains(m) for m in live], row_curve(self.cost, self.max_rows), self.max_rows)
        for m, k in zip(live, ks):
            assert m.proposal is not None
            m.proposal = m.proposal.cut(k)

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
            _guarded(m, self._propose, m)
        live = [m for m in live if not m.done]
        if not live:
            return self.drop_done()
        # 2. cut the drafts to what pays in the shared forward
        self._budget(live)
        # 3. one forward over every request's newest token and draft
        rows = [m.proposal.rows for m in live if m.proposal is not None]
        union: tuple[int, ...] = ()
        for m in live:
            union += tuple(t for t in m.decoder.taps if t not in union)
        t0 = time.perf_counter()
        fwds = forward_rows([_kv_target(m.decoder) for m in live], rows, union)
        mx.eval([f.logits for f in fwds])
        spent = time.perf_counter() - t0
        total = sum(len(r) for r in rows)
        self.cost = observe_rows(self.cost, total, spent)
        self.steps, self.rows_fed = self.steps + 1, self.rows_fed + total
        shares = _shares([len(r) for r in rows], row_curve(self.cost, self.max_rows))
        # 4. each request commits from its rows, charged its rows' share of the forward
        for m, f, share in zip(live, fwds, shares):
            m.steps, m.shared = m.steps + 1, m.shared + len(live)
            fwd = Forward(f.logits, tap_columns(f.features, union, m.decoder.taps))
            _guarded(m, self._commit, m, fwd, spent * share)
        return self.drop_done()

    def _commit(self, m: Member, fwd: Forward, forward_s: float) -> None:
        assert m.proposal is not None
        result = m.decoder.commit(m.proposal, fwd, forward_s)
        m.proposal = None
        m.inbox.append(result)
        self._hand_on(m, len(result[0]))

    def _alone(self, live: list[Member]) -> list[Member]:
        for m in live:
            _guarded(m, self._step_alone, m)
        return self.drop_done()

    def _step_alone(self, m: Member) -> None:
        m.decoder.share(False)
        result = m.decoder.step(m.room)
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
    decoder.prefill(ids)
    m = Member(decoder, emit, cancelled)
    framed = texts(decoder, ids, tokenizer, decoder.cfg.max_tokens, stop, m.events())
    m.responses = kept(prompt_cache, decoder, framed) if prompt_cache else framed
    return m
