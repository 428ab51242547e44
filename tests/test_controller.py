"""Tier 2: greedy speculative output == mlx-lm greedy AR for any draft, on tiny real models."""

import pytest
from drafters_for_tests import ScriptedDrafter, check_refusal, decode_until_refused
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompts, step_program
from tiny import VOCAB, ar_greedy

from adaspec.drafters.base import Draft, DraftContext
from adaspec.errors import DrafterError
from adaspec.policy import gates
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.policy.controller import (
    AlwaysSpeculate,
    DecodeConfig,
    Decoder,
    NeverSpeculate,
    decode,
)
from adaspec.policy.stats import StepStats
from adaspec.targets.kv import KVTarget


def run(model, drafter, prompt, max_tokens, eos=frozenset()):
    dec = Decoder(KVTarget(model), drafter, DecodeConfig(max_tokens=max_tokens, eos_ids=eos))
    return [e.token for e in decode(dec, prompt)], dec


@settings(max_examples=25)
@given(prompt=prompts(VOCAB), max_tokens=st.integers(1, 24), program=step_program)
def test_greedy_output_equals_ar_for_any_draft(tiny, prompt, max_tokens, program):
    """Any legal draft: AR's tokens. An over-long one: AR's tokens up to it, then refused."""
    ref = ar_greedy(tiny, prompt, max_tokens)
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=max_tokens))
    out, err = decode_until_refused(dec, prompt)
    assert out == (ref[: len(out)] if check_refusal(drafter, out, err) else ref)
    # invariants after the run: the cache holds all but the newest token; views agree
    assert dec.target.offset == len(prompt) + len(out) - 1
    assert drafter.tokens == prompt + out == dec.committed


@settings(max_examples=10)
@given(prompt=prompts(VOCAB), max_tokens=st.integers(2, 30), k=st.integers(1, 12))
def test_oracle_drafter_gets_every_draft_accepted(tiny, prompt, max_tokens, k):
    ref = ar_greedy(tiny, prompt, max_tokens)
    drafter = ScriptedDrafter([("oracle", k, 0)], ref, len(prompt), VOCAB)
    out, dec = run(tiny, drafter, prompt, max_tokens)
    assert out == ref
    assert dec.stats.drafted > 0 and dec.stats.accepted == dec.stats.drafted
    assert dec.stats.steps == -(-max_tokens // (k + 1))  # ceil: k+1 tokens per step


@settings(max_examples=10)
@given(prompt=prompts(VOCAB), program=step_program, cut=st.integers(1, 20))
def test_eos_ends_generation_where_ar_would(tiny, prompt, program, cut):
    ref = ar_greedy(tiny, prompt, 20)
    eos = ref[cut - 1]
    expected = ref[: ref.index(eos) + 1]
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=20, eos_ids=frozenset({eos})))
    out, err = decode_until_refused(dec, prompt)
    assert out == (expected[: len(out)] if check_refusal(drafter, out, err) else expected)
    assert dec.target.offset == len(prompt) + len(out) - 1


@settings(max_examples=10)
@given(
    prompt=prompts(VOCAB), program=step_program, stop_after=st.integers(1, 15), plain=st.booleans()
)
def test_consumer_stopping_early_leaves_caches_consistent(tiny, prompt, program, stop_after, plain):
    ref = ar_greedy(tiny, prompt, 16)
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    # plain=True: the policy never drafts, so the tokens come from pipelined plain bursts
    policy = NeverSpeculate() if plain else AlwaysSpeculate()
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=16), policy)
    got, err = decode_until_refused(dec, prompt, limit=stop_after)
    assert got == (ref[: len(got)] if check_refusal(drafter, got, err) else ref[:stop_after])
    assert dec.committed == drafter.tokens == prompt + got
    assert dec.target.offset == len(prompt) + len(got) - 1
    # the cache is usable (after a refused draft too): a plain step continues the AR sequence
    new, *_ = dec.step(1)
    assert new == [ref[len(got)]]


gate_configs = st.builds(
    lambda ar_p1, tie, margin, warmup, sustain, backoff, which: PolicyConfig(
        entropy=gates.EntropyConfig(ar_p1=ar_p1, tie_p1=min(tie, ar_p1), sustain=sustain)
        if which != "commit"
        else None,
        commit=gates.CommitConfig(margin=margin, warmup=warmup, sustain=sustain)
        if which != "entropy"
        else None,
        probe=gates.ProbeConfig(backoff=backoff, growth=2, max_backoff=16, probe_len=2),
        t_ar_refresh=0.1,
    ),
    st.floats(0.05, 1.0),
    st.floats(0, 1),
    st.floats(0.1, 5),
    st.integers(0, 3),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(["both", "entropy", "commit"]),
)


@settings(max_examples=20)
@given(prompt=prompts(VOCAB), max_tokens=st.integers(1, 30), program=step_program, cfg=gate_configs)
def test_gates_never_change_the_greedy_output(tiny, prompt, max_tokens, program, cfg):
    ref = ar_greedy(tiny, prompt, max_tokens)
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    dec = Decoder(
        KVTarget(tiny), drafter, DecodeConfig(max_tokens=max_tokens), policy=GatedPolicy(cfg)
    )
    out, err = decode_until_refused(dec, prompt)  # a floored policy's peeks are checked too
    assert out == (ref[: len(out)] if check_refusal(drafter, out, err) else ref)
    assert drafter.tokens == prompt + out


class _SplitBudget(AlwaysSpeculate):
    """Costly drafts capped at 1 token, cheap ones at 5."""

    def max_draft(self) -> int:
        return 1

    def max_cheap_draft(self) -> int:
        return 5


class _Fixed(ScriptedDrafter):
    def __init__(self, reference, n_prompt, cheap):
        super().__init__([("oracle", 5, 0)], reference, n_prompt, VOCAB)
        self.cheap = cheap

    def draft(self, ctx):
        assert ctx.max_draft <= 1 and ctx.cheap_cap <= 5
        d = super().draft(DraftContext(ctx.tokens, ctx.cheap_cap))
        return Draft(d.tokens, cheap=self.cheap)


def test_a_cheap_draft_gets_its_own_budget_and_a_costly_one_is_held_to_max_draft(tiny):
    prompt = [1, 2, 3]
    ref = ar_greedy(tiny, prompt, 12)
    dec = Decoder(KVTarget(tiny), _Fixed(ref, 3, True), DecodeConfig(max_tokens=12), _SplitBudget())
    assert [e.token for e in decode(dec, prompt)] == ref
    assert dec.stats.steps == 2  # 5 drafted + bonus, twice
    dec = Decoder(
        KVTarget(tiny), _Fixed(ref, 3, False), DecodeConfig(max_tokens=12), _SplitBudget()
    )
    with pytest.raises(DrafterError, match="proposed 5 tokens; at most 1 allowed"):
        list(decode(dec, prompt))


def test_the_policy_prices_cheap_and_costly_drafts_apart():
    pol = GatedPolicy(PolicyConfig(entropy=None, commit=None))
    for _ in range(3):
        pol.observe(StepStats(0, 0, 1, False, 0.0, 0.05, 0.0))
    for _ in range(10):  # free copies, all accepted
        pol.observe(StepStats(8, 8, 9, True, 1e-4, 0.09, 0.0, cheap=True))
    assert pol.length.accept == () and pol.cheap_length.accept[0] > 0.9
    for _ in range(10):  # a model drafter: 0.04 s per token, mostly rejected
        pol.observe(StepStats(2, 0, 1, True, 0.08, 0.06, 0.0))
    assert pol.max_draft() < pol.max_cheap_draft()
    assert pol.cheap_length.draft_cost < 1e-3 < pol.length.draft_cost


def test_cheap_drafts_give_way_when_the_costly_ones_commit_more_per_second():
    pol = GatedPolicy(PolicyConfig(entropy=None, commit=None))
    for _ in range(3):
        pol.observe(StepStats(0, 0, 1, False, 0.0, 0.05, 0.0))
    for _ in range(6):  # free copies, always rejected at once
        pol.observe(StepStats(3, 0, 1, True, 1e-4, 0.07, 0.0, cheap=True))
    assert pol.max_cheap_draft() > 0  # no costly draft judged yet: nothing to compare
    allowed = []
    for _ in range(16):  # a model drafter: 0.02 s per token, all accepted
        pol.observe(StepStats(3, 3, 4, True, 0.06, 0.07, 0.0))
        allowed.append(pol.max_cheap_draft())
    # cheap drafts only on exploration steps (every 8th), so their estimate stays fresh
    assert sum(a > 0 for a in allowed) == 2 and pol.max_draft() >= 3


def test_costly_drafts_are_held_back_while_plain_steps_beat_them_and_cheap_ones_go_on():
    """auto with a weak model drafter: once plain steps are expected to commit more per second
    than its drafts, costly drafts stop (cheap ones do not) and come back as probes on the
    floor's growing backoff; the drafter alone (no cheap drafts seen) is left to the gates."""
    probe = gates.ProbeConfig(backoff=4, growth=2.0, max_backoff=64, probe_len=2)
    pol = GatedPolicy(PolicyConfig(entropy=None, probe=probe))
    plain = StepStats(0, 0, 1, False, 0.0, 0.05, 0.0)
    for _ in range(3):
        pol.observe(plain)
    for _ in range(4):  # copies: good
        pol.observe(StepStats(4, 4, 5, True, 1e-4, 0.08, 0.0, cheap=True))
    weak = StepStats(2, 0, 1, True, 0.04, 0.07, 0.0)  # 1 token in 0.11 s: AR does 1 in 0.05
    pol.observe(weak)
    assert pol.max_draft() == 0 and pol.max_cheap_draft() > 0 and not pol.floor.floored
    waits = []
    for _ in range(4):  # each probe loses: 4, 8, 16, 32 non-costly steps before the next
        n = 0
        while pol.max_draft() == 0:
            pol.observe(plain)
            n += 1
        waits.append(n)
        pol.observe(weak)
    assert waits == [4, 8, 16, 32] and pol.costly_floor.floors == 5
    # the losing probes were judged by the costly floor alone: the copies were never floored
    assert pol.floor.floors == 0 and pol.max_cheap_draft() > 0
    alone = GatedPolicy(PolicyConfig(entropy=None, probe=probe))
    for _ in range(3):
        alone.observe(plain)
    alone.observe(weak)
    assert alone.max_draft() > 0 and alone.costly_floor.floors == 0  # the commit gate's call
