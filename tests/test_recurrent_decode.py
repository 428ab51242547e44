"""Tier 2: speculative decoding on tiny recurrent / hybrid targets (qwen3_next, qwen3_5,
mamba2) with every rollback strategy: greedy output == mlx-lm AR for any draft, early stops,
DFlash drafting from hybrid taps, and the sampling distribution."""

import numpy as np
import pytest
from distribution import assert_same, exact_sequences
from drafters_for_tests import (
    FixedDrafter,
    ScriptedDrafter,
    StochasticDrafter,
    check_refusal,
    decode_until_refused,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompts, step_program
from tiny import VOCAB, ar_greedy
from tiny_dflash import assert_context_matches_fresh_prefill, tiny_drafter
from tiny_recurrent import HYBRIDS, OTHER_CONFIGS, tiny_hybrid, tiny_other

from adaspec.drafters.base import Draft
from adaspec.loop import sampling
from adaspec.loop.controller import AlwaysSpeculate, DecodeConfig, Decoder, NeverSpeculate, decode
from adaspec.targets import make_target
from adaspec.targets.architectures import available
from adaspec.targets.replay import ReplayTarget

MODELS = {arch: tiny_hybrid(arch) for arch in HYBRIDS}
PLANS = [(arch, s) for arch in HYBRIDS for s in available(ReplayTarget(MODELS[arch]))]


def run(plan, drafter, prompt, max_tokens, policy=None):
    arch, strategy = plan
    target = ReplayTarget(MODELS[arch], strategy=strategy)
    dec = Decoder(target, drafter, DecodeConfig(max_tokens=max_tokens), policy or AlwaysSpeculate())
    return [e.token for e in decode(dec, prompt)], dec


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(p))
@settings(max_examples=6)
@given(prompt=prompts(VOCAB, max_len=16), max_tokens=st.integers(1, 20), program=step_program)
def test_greedy_output_equals_ar_for_any_draft(plan, prompt, max_tokens, program):
    model = MODELS[plan[0]]
    ref = ar_greedy(model, prompt, max_tokens)
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    target = ReplayTarget(model, strategy=plan[1])
    dec = Decoder(target, drafter, DecodeConfig(max_tokens=max_tokens))
    out, err = decode_until_refused(dec, prompt)
    assert out == (ref[: len(out)] if check_refusal(drafter, out, err) else ref)
    assert dec.target.offset == len(prompt) + len(out) - 1
    assert drafter.tokens == prompt + out == dec.committed
    assert dec.target.rebuilds == 0  # every rollback stayed within the last forward


@pytest.mark.parametrize("arch", sorted(set(OTHER_CONFIGS) - {"recurrent_gemma"}))
def test_other_architectures_decode_like_ar(arch):
    model = tiny_other(arch)
    prompt, n = [3, 1, 4, 1, 5], 16
    ref = ar_greedy(model, prompt, n)
    program = [("corrupt", 4, 1), ("oracle", 3, 0), ("random", 5, 2), ("empty", 0, 0)]
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    dec = Decoder(make_target(model), drafter, DecodeConfig(max_tokens=n))
    assert [e.token for e in decode(dec, prompt)] == ref
    assert dec.stats.drafted > dec.stats.accepted > 0


class WrongFirst(ScriptedDrafter):
    """Drafts k tokens whose first is never the AR token: every draft is rejected whole."""

    def draft(self, ctx):
        d = super().draft(ctx)
        if not d.tokens:
            return d
        done = len(self.tokens) - self.n_prompt
        return Draft(((self.reference[done] + 1) % self.vocab, *d.tokens[1:]))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(p))
@pytest.mark.parametrize("k", [1, 4, 9])
def test_all_accepted_and_all_rejected_drafts(plan, k):
    prompt, n = [3, 1, 4, 1, 5], 18
    ref = ar_greedy(MODELS[plan[0]], prompt, n)
    out, dec = run(plan, ScriptedDrafter([("oracle", k, 0)], ref, len(prompt), VOCAB), prompt, n)
    assert out == ref and dec.stats.accepted == dec.stats.drafted > 0
    out, dec = run(plan, WrongFirst([("oracle", k, 0)], ref, len(prompt), VOCAB), prompt, n)
    assert out == ref and dec.stats.accepted == 0 < dec.stats.drafted


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(p))
@settings(max_examples=4)
@given(
    prompt=prompts(VOCAB, max_len=12),
    program=step_program,
    stop_after=st.integers(1, 12),
    plain=st.booleans(),
)
def test_consumer_stopping_early_leaves_caches_consistent(plan, prompt, program, stop_after, plain):
    model = MODELS[plan[0]]
    ref = ar_greedy(model, prompt, 14)
    drafter = ScriptedDrafter(program, ref, len(prompt), VOCAB)
    # plain=True: the tokens come from pipelined plain bursts (lazy token forwards)
    policy = NeverSpeculate() if plain else AlwaysSpeculate()
    dec = Decoder(ReplayTarget(model, strategy=plan[1]), drafter, DecodeConfig(14), policy)
    got, err = decode_until_refused(dec, prompt, limit=stop_after)
    assert got == (ref[: len(got)] if check_refusal(drafter, got, err) else ref[:stop_after])
    assert dec.committed == drafter.tokens == prompt + got
    assert dec.target.offset == len(prompt) + len(got) - 1
    assert dec.target.rebuilds == 0
    new, *_ = dec.step(1)  # the cache is usable (after a refused draft too): AR continues
    assert new == [ref[len(got)]]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "mamba2"])
@settings(max_examples=5)
@given(prompt=prompts(VOCAB, max_len=12), max_tokens=st.integers(1, 16), seed=st.integers(0, 99))
def test_dflash_drafts_for_hybrid_targets(arch, prompt, max_tokens, seed):
    """DFlash reads the hybrid's tap features; its output is still exactly AR."""
    target = MODELS[arch]
    drafter = tiny_drafter(target, seed=seed, block=4, taps=(0, 2))
    dec = Decoder(ReplayTarget(target), drafter, DecodeConfig(max_tokens=max_tokens))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, max_tokens)
    assert drafter.tokens == dec.committed == prompt + out
    assert drafter.cache.length == len(dec.committed) - 1
    assert_context_matches_fresh_prefill(target, drafter, dec.committed)


V = 8
SAMPLE_MODEL = tiny_hybrid("qwen3_5", vocab=V, seed=3, scale=0.5)
PROMPT = [1, 2, 3]
Q = np.random.default_rng(5).dirichlet(np.ones(V), size=2)


@pytest.mark.parametrize(
    "make", [lambda: FixedDrafter([4, 4]), lambda: StochasticDrafter(Q)], ids=["fixed", "q"]
)
def test_sampling_on_a_hybrid_matches_the_target_distribution(make):
    params = sampling.SamplingParams(temp=1.0)
    counts = np.zeros(V * V)
    for s in range(1200):
        dec = Decoder(
            ReplayTarget(SAMPLE_MODEL),
            make(),
            DecodeConfig(max_tokens=2, sampling=params),
            rng=np.random.default_rng(s),
        )
        a, b = [e.token for e in decode(dec, PROMPT)]
        counts[a * V + b] += 1
    assert dec.stats.drafted > 0
    assert_same(counts, exact_sequences(SAMPLE_MODEL, PROMPT, V, 2, params))
