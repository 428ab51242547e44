"""Tier 2: prompt-cache reuse. A cache that held one generation, given the next prompt, leaves
the target and every arm exactly where a fresh prefill of that prompt would (next-token logits
within tolerance, drafter state and outputs equal), on KV and recurrent targets."""

import numpy as np
import pytest
from tiny import ar_greedy, byte_tokenizer, tiny_model
from tiny_dflash import assert_context_matches_fresh_prefill, tiny_drafter
from tiny_recurrent import tiny_hybrid

import adaspec
from adaspec.drafters.pld import PromptLookup
from adaspec.errors import GenerationArgumentError
from adaspec.loop.controller import AlwaysSpeculate, DecodeConfig, Decoder, decode
from adaspec.targets import make_target

TOK = byte_tokenizer()
MODELS = {"kv": tiny_model("qwen3"), "recurrent": tiny_hybrid("qwen3_next")}
FIRST = [int(t) for t in b"the cat sat on the mat; the cat sat on the "]


def arms(model):
    return [PromptLookup(), tiny_drafter(model)]


def decoder(model, target, drafters, held=(), max_tokens=12):
    cfg = DecodeConfig(max_tokens=max_tokens)
    return Decoder(target, drafters, cfg, AlwaysSpeculate(), held=held)


def first_turn(model):
    """A decoder after one generation over FIRST: (target, arms, committed tokens)."""
    target, drafters = make_target(model), arms(model)
    dec = decoder(model, target, drafters)
    list(decode(dec, FIRST))
    return target, drafters, dec.committed


def next_prompts(committed):
    return {
        "extends": committed + [int(t) for t in b" and the dog"],
        "diverges": committed[:20] + [int(t) for t in b"X dog ran off"],
        "same": list(committed),
    }


def assert_same_state(model, reused: Decoder, prompt):
    fresh = decoder(model, make_target(model), arms(model))
    fresh.prefill(prompt)
    assert reused.target.offset == fresh.target.offset == len(prompt) - 1
    a = reused.target.forward([prompt[-1]]).logits
    b = fresh.target.forward([prompt[-1]]).logits
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)
    reused.target.rollback(1)
    pld, dfl = reused.arms
    assert pld.tokens == fresh.arms[0].tokens == prompt
    assert pld._index == fresh.arms[0]._index
    assert dfl.tokens == prompt and dfl.cache.length == len(prompt) - 1
    assert_context_matches_fresh_prefill(model, dfl, prompt)


@pytest.mark.parametrize("kind", ["kv", "recurrent"])
@pytest.mark.parametrize("case", ["extends", "diverges", "same"])
def test_reused_state_equals_fresh_prefill(kind, case):
    model = MODELS[kind]
    target, drafters, committed = first_turn(model)
    prompt = next_prompts(committed)[case]
    dec = decoder(model, target, drafters, held=committed)
    dec.prefill(prompt)
    kept = dec.stats.cached_tokens
    if case == "extends":  # everything the cache held but the newest token is kept
        assert kept == len(committed) - 1
    elif kind == "kv":
        assert kept == (19 if case == "diverges" else len(prompt) - 2)
    else:  # recurrent state is never rolled back: start afresh
        assert kept == 0
    assert_same_state(model, dec, prompt)


@pytest.mark.parametrize("kind", ["kv", "recurrent"])
def test_multi_turn_output_equals_fresh(kind):
    """Three turns through one cache, the second abandoned mid-stream: every turn's text equals
    a fresh generation's, and mlx-lm's greedy AR."""
    model = MODELS[kind]
    cache = adaspec.make_prompt_cache(model, TOK, drafter=arms(model))
    prompt, held = list(FIRST), []
    for turn in range(3):
        stream = adaspec.stream_generate(model, TOK, prompt, prompt_cache=cache, max_tokens=10)
        got = []
        for r in stream:
            got.append(r.token)
            if turn == 1 and len(got) == 4:
                stream.close()
                break
        fresh = adaspec.stream_generate(model, TOK, prompt, drafter=arms(model), max_tokens=10)
        want = [r.token for r in fresh][: len(got)]
        assert got == want == ar_greedy(model, prompt, len(got))
        assert r.stats.cached_tokens == max(len(held) - 1, 0)
        held = cache.tokens
        assert held == prompt + got
        prompt = prompt + got + [int(t) for t in b" so"]


def test_cache_refuses_another_model_or_a_second_drafter():
    model = MODELS["kv"]
    cache = adaspec.make_prompt_cache(model, TOK, drafter="pld")
    with pytest.raises(GenerationArgumentError, match="another model"):
        next(adaspec.stream_generate(MODELS["recurrent"], TOK, FIRST, prompt_cache=cache))
    with pytest.raises(GenerationArgumentError, match="drafter='pld' given with a prompt_cache"):
        next(adaspec.stream_generate(model, TOK, FIRST, prompt_cache=cache, drafter="pld"))


def test_error_mid_generation_resets_the_cache():
    model = MODELS["kv"]

    class Broken(PromptLookup):
        def draft(self, ctx):
            raise RuntimeError("drafter broke")

    cache = adaspec.make_prompt_cache(model, TOK, drafter=[Broken()])
    with pytest.raises(RuntimeError):
        list(adaspec.stream_generate(model, TOK, FIRST, prompt_cache=cache, max_tokens=8))
    assert cache.tokens == [] and cache.target.offset == 0


def test_a_cache_keeps_its_policy_and_what_it_measured_across_turns():
    model = MODELS["kv"]
    pc = adaspec.make_prompt_cache(model, TOK, drafter="pld")
    prompt = list(FIRST)
    for _ in range(2):
        out = [
            r.token
            for r in adaspec.stream_generate(model, TOK, prompt, prompt_cache=pc, max_tokens=8)
        ]
        assert out == ar_greedy(model, prompt, len(out))
        prompt = prompt + out + [int(t) for t in b" the cat"]
    assert pc.policy.names == ["pld"] and pc.policy.estimates.length[0].steps > 0
