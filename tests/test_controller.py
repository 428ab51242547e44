"""Tier 2: greedy speculative output == mlx-lm greedy AR for any draft, on tiny real models."""

import mlx.core as mx
import pytest
from drafters_for_tests import (
    LazyScriptedDrafter,
    ScriptedDrafter,
    check_refusal,
    decode_until_refused,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import LEGAL_MODES, prompts, step_program
from tiny import VOCAB, ar_greedy

from adaspec.drafters.base import Draft
from adaspec.errors import DrafterError, TargetError
from adaspec.loop.controller import (
    AlwaysSpeculate,
    DecodeConfig,
    Decoder,
    NeverSpeculate,
    decode,
)
from adaspec.loop.plan import Plan
from adaspec.policy import floor, gates
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.policy.arm_choice import HoldConfig
from adaspec.policy.clock import ClockConfig
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


@settings(max_examples=25)
@given(
    prompt=prompts(VOCAB),
    max_tokens=st.integers(1, 24),
    program=step_program,
    overlap=st.booleans(),
)
def test_lazy_drafts_verify_like_read_ones(tiny, prompt, max_tokens, program, overlap):
    """A LazyDrafter's chains, verified on their unevaluated ids (overlap on) or read first
    (off): AR's tokens either way, the same refusals; draft() is asked only when there are
    no lazy ids (overlap on) or always (off)."""
    ref = ar_greedy(tiny, prompt, max_tokens)
    drafter = LazyScriptedDrafter(program, ref, len(prompt), VOCAB)
    cfg = DecodeConfig(max_tokens=max_tokens, overlap_draft=overlap)
    dec = Decoder(KVTarget(tiny), drafter, cfg)
    out, err = decode_until_refused(dec, prompt)
    assert out == (ref[: len(out)] if check_refusal(drafter, out, err) else ref)
    assert dec.target.offset == len(prompt) + len(out) - 1
    assert drafter.tokens == prompt + out == dec.committed
    calls = drafter.calls
    if overlap:
        assert calls["draft"] == calls["no_ids"] and (calls["draft_ids"] or len(out) <= 1)
    else:
        assert calls["draft_ids"] == 0


class OutOfVocabLazy(LazyScriptedDrafter):
    def draft_ids(self, ctx):
        return mx.array([1, VOCAB + 3], dtype=mx.int32)[: ctx.max_draft] * 1


def test_lazy_ids_outside_the_vocabulary_are_refused_after_the_verify(tiny):
    prompt = [1, 2, 3]
    drafter = OutOfVocabLazy([("oracle", 2, 0)], ar_greedy(tiny, prompt, 8), 3, VOCAB)
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=8))
    out, err = decode_until_refused(dec, prompt)
    assert out == [] and err is not None
    assert f"token ids [{VOCAB + 3}] outside the target's vocabulary" in str(err)
    # nothing unverified emitted; the cache back to the prompt (all but its newest token)
    assert dec.target.offset == len(prompt) - 1 and dec.committed == prompt


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


def test_steps_of_a_pipelined_burst_are_marked_queued(tiny):
    """A plain burst: the first step has nothing queued before it; each later one's forward
    was queued by the step before (the last queues nothing)."""
    dec = Decoder(KVTarget(tiny), [], DecodeConfig(max_tokens=6), NeverSpeculate())
    dec.prefill([1, 2, 3])
    marks = [dec.step(6 - i, Plan((), 5 - i - 1))[3].queued for i in range(5)]
    assert marks == [False, True, True, True, True]


gate_configs = st.builds(
    lambda ar_p1, tie, margin, warmup, sustain, backoff, which: PolicyConfig(
        gates=(
            *(
                [gates.EntropyConfig(ar_p1=ar_p1, tie_p1=min(tie, ar_p1), sustain=sustain)]
                * (which != "commit")
            ),
            *(
                [gates.CommitConfig(margin=margin, warmup=warmup, sustain=sustain)]
                * (which != "entropy")
            ),
        ),
        probe=floor.ProbeConfig(backoff=backoff, growth=2, max_backoff=16, probe_len=2),
        clock=ClockConfig(refresh=0.1) if which != "entropy" else None,
        holds=HoldConfig(margin=margin) if which != "entropy" else None,
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


class _Caps(AlwaysSpeculate):
    """Arm 0 may draft 1 token, arm 1 five, asked in that order."""

    def plan(self) -> Plan:
        return Plan(((0, 1), (1, 5)))


class _Empty(ScriptedDrafter):
    def draft(self, ctx):
        assert ctx.max_draft <= 1
        return Draft()


def test_arms_are_asked_in_order_each_within_its_own_cap(tiny):
    prompt = [1, 2, 3]
    ref = ar_greedy(tiny, prompt, 12)
    first = _Empty([("oracle", 5, 0)], ref, 3, VOCAB)
    second = ScriptedDrafter([("oracle", 5, 0)], ref, 3, VOCAB)
    dec = Decoder(KVTarget(tiny), [first, second], DecodeConfig(max_tokens=12), _Caps())
    assert [e.token for e in decode(dec, prompt)] == ref
    assert dec.stats.steps == 2  # arm 1: 5 drafted + bonus, twice
    assert dec.stats.by_arm["scripted#1"]["drafted"] == 10 and "scripted#0" not in dec.stats.by_arm
    assert first.tokens == second.tokens == prompt + ref  # both arms saw every commit
    greedy = ScriptedDrafter([("overlong", 3, 0)], ref, 3, VOCAB)  # 1 + 1 + 3 tokens
    dec = Decoder(KVTarget(tiny), [greedy, second], DecodeConfig(max_tokens=12), _Caps())
    with pytest.raises(DrafterError, match="proposed 5 tokens; at most 1 allowed"):
        list(decode(dec, prompt))


LEGAL_PROGRAM = st.lists(
    st.tuples(st.sampled_from(LEGAL_MODES), st.integers(0, 12), st.integers(0, 1 << 30)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=20)
@given(
    prompt=prompts(VOCAB),
    max_tokens=st.integers(1, 24),
    program=LEGAL_PROGRAM,
    cut=st.integers(0, 12),
)
def test_a_step_committed_from_a_forward_run_by_the_caller_is_the_decoders_own(
    tiny, prompt, max_tokens, program, cut
):
    """The seam a batch uses: propose, run the verify forward over the proposal's rows outside
    the decoder (the draft cut to any length first), commit it: AR's tokens, and the cache and
    the arm hold exactly the committed ones."""
    ref = ar_greedy(tiny, prompt, max_tokens)
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=max_tokens))
    dec.share(True)
    dec.prefill(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        p = dec.propose(max_tokens - len(out)).cut(cut)
        assert p.rows == [dec.committed[-1], *p.draft.tokens] and len(p.draft) <= cut
        new, from_draft, _, step = dec.commit(p, dec.target.forward(p.rows), forward_s=0.5)
        assert 1 <= len(new) <= len(p.rows) and sum(from_draft) == step.accepted
        assert step.verify_s >= 0.5  # the caller's forward counts as verify time
        out += new
    assert out == ref
    assert dec.target.offset == len(prompt) + len(out) - 1
    assert drafter.tokens == prompt + out == dec.committed


def test_commit_refuses_a_forward_over_other_rows(tiny):
    dec = Decoder(KVTarget(tiny), None, DecodeConfig(max_tokens=4))
    dec.share(True)
    dec.prefill([1, 2, 3])
    p = dec.propose(4)
    with pytest.raises(TargetError, match="rows"):
        dec.commit(p, dec.target.forward([*p.rows, 5]))
