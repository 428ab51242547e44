"""Tier 2: the "auto" drafter (PLD on a long enough match, DFlash otherwise) keeps both drafters
in sync and stays lossless."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import ar_greedy, tiny_model
from tiny_dflash import assert_context_matches_fresh_prefill, ctx, tiny_drafter

from adaspec import settings as settings_mod
from adaspec.drafters.auto import AutoDrafter
from adaspec.drafters.base import DraftModel
from adaspec.drafters.pld import PromptLookup
from adaspec.drafters.registry import make
from adaspec.errors import DrafterError
from adaspec.policy.controller import DecodeConfig, Decoder, decode
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget

V = 12
TARGETS = {a: tiny_model(a, vocab=V, seed=2) for a in ("llama", "qwen3")}
FEATS = np.random.default_rng(3).normal(size=(100, 128)).astype(np.float32)


def auto(target, seed=0, min_match=2, block=6):
    return AutoDrafter(
        PromptLookup(3, 1, 6), tiny_drafter(target, seed=seed, block=block), min_match
    )


@settings(max_examples=20)
@given(
    arch=st.sampled_from(sorted(TARGETS)),
    motif=st.lists(st.integers(0, V - 1), min_size=1, max_size=5),
    repeats=st.integers(1, 4),
    max_tokens=st.integers(1, 24),
    seed=st.integers(0, 999),
    min_match=st.integers(1, 3),
)
def test_greedy_output_equals_ar_and_states_stay_in_sync(
    arch, motif, repeats, max_tokens, seed, min_match
):
    target = TARGETS[arch]
    prompt = motif * repeats
    d = auto(target, seed, min_match)
    dec = Decoder(KVTarget(target), d, DecodeConfig(max_tokens=max_tokens))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, max_tokens)
    assert d.pld.tokens == d.fallback.tokens == dec.committed == prompt + out
    assert d.fallback.cache.length == len(dec.committed) - 1


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_both_drafters_are_used_and_dflash_context_follows_pld_steps(arch):
    target = TARGETS[arch]
    prompt = [1, 2, 3, 4, 5] * 3 + [7, 9, 11, 0, 6, 8, 10]
    d = auto(target, seed=1)
    dec = Decoder(KVTarget(target), d, DecodeConfig(max_tokens=40))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, 40)
    assert d.used["pld"] > 0 and d.used["dflash"] > 0, d.used
    assert_context_matches_fresh_prefill(target, d.fallback, dec.committed)


def test_choice_follows_the_match_length():
    target = TARGETS["llama"]
    d = auto(target, min_match=2)
    prompt = [1, 2, 3, 9, 1, 2]  # suffix "1 2" occurred before: PLD proposes "3 9 1 2"
    d.prefill(prompt, ctx(prompt, FEATS[:5]))
    assert d.draft(ctx(prompt, max_draft=4)).tokens == (3, 9, 1, 2) and d.last == "pld"
    d.min_match = 3  # a 2-token match is no longer enough
    draft = d.draft(ctx(prompt, max_draft=4))
    assert d.last == "dflash" and draft == d.fallback.draft(ctx(prompt, max_draft=4))
    assert d.needs_taps == d.fallback.needs_taps and d.vocab_size == V
    assert isinstance(d, DraftModel)


@settings(max_examples=20)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=12))
def test_advance_and_rollback_reach_both_drafters(ops):
    d = auto(TARGETS["qwen3"])
    model = [1, 2, 3]
    d.prefill(model, ctx(model, FEATS[:2]))
    for is_advance, n in ops:
        if is_advance:
            new = [(n + i) % V for i in range(n + 1)]
            d.advance(new, ctx(model + new, FEATS[len(model) - 1 : len(model) + n]))
            model += new
        else:
            n = min(n, len(model) - 1)
            d.rollback(n)
            del model[len(model) - n :]
        assert d.pld.tokens == d.fallback.tokens == model
        assert d.fallback.cache.length == len(model) - 1
    with pytest.raises(DrafterError, match="auto rollback"):
        d.rollback(len(model) + 1)


def test_factory(tmp_path):
    target = TARGETS["llama"]
    info = target_info(target)
    tiny_drafter(target, block=5).save(tmp_path / "ck")
    s = settings_mod.from_env({"ADASPEC_AUTO_PLD_MIN_MATCH": "3"})
    d = make(f"auto:{tmp_path / 'ck'}", info, s)
    assert isinstance(d, AutoDrafter) and d.min_match == 3 and d.fallback.block == 5
    d = make(f"auto:{tmp_path / 'ck'},min_match=1,block=3", info, s)
    assert d.min_match == 1 and d.fallback.block == 3
    with pytest.raises(DrafterError, match="auto needs a DFlash checkpoint folder"):
        make("auto", info, s)
    with pytest.raises(DrafterError, match="auto needs a DFlash checkpoint folder"):
        make("auto:min_match=2", info, s)
    with pytest.raises(DrafterError, match="'minmatch=2' is invalid; accepted: min_match=<int>"):
        make(f"auto:{tmp_path / 'ck'},minmatch=2", info, s)


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_a_floored_auto_lifts_on_a_strong_pld_match_without_running_the_model(arch):
    """While floored, auto is peeked with its PLD alone: a long prompt-lookup match lifts the
    floor (as for the pld drafter) and the model drafter is not run for the look."""
    from adaspec.policy import gates
    from adaspec.policy.adaptive import GatedPolicy, PolicyConfig

    target = TARGETS[arch]
    for prompt, strong in (([3, 1, 4, 1, 5, 9, 2, 6] * 3, True), (list(range(12)), False)):
        d = auto(target, seed=4)
        pol = GatedPolicy(PolicyConfig(entropy=None, probe=gates.ProbeConfig(backoff=1000)))
        pol.floor = gates.on_floor(pol.cfg.probe, pol.floor)
        dec = Decoder(KVTarget(target), d, DecodeConfig(max_tokens=8), policy=pol)
        dec.prefill(prompt)
        calls = []
        real = d.fallback.draft
        d.fallback.draft = lambda c, real=real, calls=calls: calls.append(c) or real(c)
        assert dec.strong_candidate() is strong
        assert pol.lifts == int(strong) and pol.floor.floored is not strong
        assert calls == []
