"""Several drafters side by side (arms): the policy picks one per step, every arm stays in sync
with the committed sequence, the output stays the target's; `auto` is PLD then a model drafter."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from drafters_for_tests import ListDrafter
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import ar_greedy, tiny_model
from tiny_dflash import assert_context_matches_fresh_prefill, tiny_drafter

from adaspec import settings as settings_mod
from adaspec.drafters import dflash, shipped
from adaspec.drafters.arms import default_spec, make, make_arms
from adaspec.drafters.base import Draft
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.drafters.pld import PromptLookup
from adaspec.drafters.suffix import SuffixDrafter
from adaspec.errors import DrafterError
from adaspec.loop.controller import AlwaysSpeculate, DecodeConfig, Decoder, decode
from adaspec.loop.stats import StepStats
from adaspec.policy import floor
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget

V = 12
TARGETS = {a: tiny_model(a, vocab=V, seed=2) for a in ("llama", "qwen3")}


def pld_then_dflash(target, seed=0, min_match=2, block=6):
    return [PromptLookup(3, min_match, 6), tiny_drafter(target, seed=seed, block=block)]


@settings(max_examples=20)
@given(
    arch=st.sampled_from(sorted(TARGETS)),
    motif=st.lists(st.integers(0, V - 1), min_size=1, max_size=5),
    repeats=st.integers(1, 4),
    max_tokens=st.integers(1, 24),
    seed=st.integers(0, 999),
    min_match=st.integers(1, 3),
    gated=st.booleans(),
    short=st.booleans(),
)
def test_greedy_output_equals_ar_and_every_arm_stays_in_sync(
    arch, motif, repeats, max_tokens, seed, min_match, gated, short
):
    target = TARGETS[arch]
    prompt = motif * repeats
    pld, dfl = pld_then_dflash(target, seed, min_match)
    # auto's shape: a second prompt-lookup arm for the short matches, before the model
    lookups = [pld, PromptLookup(3, 1, 6)] if short else [pld]
    policy = GatedPolicy(PolicyConfig()) if gated else AlwaysSpeculate()
    dec = Decoder(KVTarget(target), [*lookups, dfl], DecodeConfig(max_tokens=max_tokens), policy)
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, max_tokens)
    assert all(a.tokens == dec.committed == prompt + out for a in lookups)
    assert dfl.cache.length == len(dec.committed) - 1


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_both_arms_draft_and_the_model_context_follows_the_copies(arch):
    target = TARGETS[arch]
    prompt = [1, 2, 3, 4, 5] * 3 + [7, 9, 11, 0, 6, 8, 10]
    pld, dfl = pld_then_dflash(target, seed=1)
    dec = Decoder(KVTarget(target), [pld, dfl], DecodeConfig(max_tokens=40))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, 40)
    by_arm = dec.stats.by_arm
    assert by_arm["pld"]["steps"] > 0 and by_arm["dflash"]["steps"] > 0, by_arm
    assert sum(r["steps"] for r in by_arm.values()) == dec.stats.spec_steps
    assert_context_matches_fresh_prefill(target, dfl, dec.committed)


class TapRecorder(ListDrafter):
    """Proposes nothing; records the tap features it is given."""

    name = "recorder"

    def __init__(self, taps):
        super().__init__()
        self.needs_taps = taps
        self.rows: list[np.ndarray] = []

    def prefill(self, prompt_tokens, ctx):
        super().prefill(prompt_tokens, ctx)
        self.rows = [np.array(ctx.features)]

    def advance(self, committed_tokens, ctx):
        super().advance(committed_tokens, ctx)
        self.rows.append(np.array(ctx.features))

    def draft(self, ctx):
        return Draft()


def test_each_arm_gets_the_tap_features_it_asked_for():
    """Arms with different tap layers: the target computes the union once and each arm gets
    its own layers' columns, in its own order, as if it were alone."""
    target = TARGETS["llama"]
    dfl = tiny_drafter(target, taps=(0, 1))
    rec = TapRecorder((1,))
    alone = TapRecorder((1,))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    dec = Decoder(KVTarget(target), [dfl, rec], DecodeConfig(max_tokens=10))
    out = [e.token for e in decode(dec, prompt)]
    ref = Decoder(KVTarget(target), [alone], DecodeConfig(max_tokens=10))
    assert [e.token for e in decode(ref, prompt)] == out
    got, want = np.concatenate(rec.rows), np.concatenate(alone.rows)
    assert got.shape == want.shape == (len(prompt) + 9, target.args.hidden_size)
    np.testing.assert_allclose(got, want, atol=1e-5)


def plain(t=0.05):
    return StepStats(committed=1, verify_s=t)


def drafted(arm, k, accepted, draft_s, verify_s):
    return StepStats(
        drafted=k,
        accepted=accepted,
        committed=accepted + 1,
        arm=arm,
        draft_s=draft_s,
        verify_s=verify_s,
    )


def two_arms(**cfg):
    pol = GatedPolicy(PolicyConfig(**cfg))
    pol.start(["pld", "model"])
    return pol


def test_the_policy_prices_each_arm_apart():
    pol = two_arms(gates=(), clock=None, holds=None)
    for _ in range(3):
        pol.observe(plain())
    for _ in range(10):  # free copies, all accepted
        pol.observe(drafted(0, 8, 8, 1e-4, 0.09))
    copies, model = pol.estimates.length
    assert model.accept == () and copies.accept[0] > 0.9
    for _ in range(10):  # a model drafter: 0.04 s per token, mostly rejected
        pol.observe(drafted(1, 2, 0, 0.08, 0.06))
    plan = dict(pol.plan().arms)
    assert plan[1] < plan[0]
    assert pol.estimates.length[0].draft_cost < 1e-3 < pol.estimates.length[1].draft_cost


def test_an_arm_gives_way_when_a_later_one_commits_more_per_second():
    pol = two_arms(gates=(), clock=None, holds=None)
    for _ in range(3):
        pol.observe(plain())
    for _ in range(6):  # free copies, always rejected at once
        pol.observe(drafted(0, 3, 0, 1e-4, 0.07))
    assert [a for a, _ in pol.plan().arms] == [0, 1]  # the model is not judged yet
    asked = []
    for _ in range(16):  # a model drafter: 0.02 s per token, all accepted
        pol.observe(drafted(1, 3, 3, 0.06, 0.07))
        asked.append([a for a, _ in pol.plan().arms])
    # copies only on exploration steps (every 8th), so their estimate stays fresh
    assert sum(0 in a for a in asked) == 2 and all(1 in a for a in asked)


def test_a_costly_arm_is_held_back_while_plain_steps_beat_it_and_a_free_one_goes_on():
    """PLD + a weak model drafter: once plain steps are expected to commit more per second
    than the model's drafts, the model stops (PLD does not) and comes back as probes on the
    floor's growing backoff; an arm alone is held back by the same rule."""
    probe = floor.ProbeConfig(backoff=4, growth=2.0, max_backoff=64, probe_len=2)
    pol = two_arms(probe=probe)
    for _ in range(3):
        pol.observe(plain())
    for _ in range(4):  # copies: good
        pol.observe(drafted(0, 4, 4, 1e-4, 0.08))
    weak = drafted(1, 2, 0, 0.04, 0.07)  # 1 token in 0.11 s: AR does 1 in 0.05
    pol.observe(weak)
    assert [a for a, _ in pol.plan().arms] == [0] and not pol.floor.floored
    waits = []
    for _ in range(4):  # each probe loses: 4, 8, 16, 32 other steps before the next
        n = 0
        while 1 not in dict(pol.plan().arms):
            pol.observe(plain())
            n += 1
        waits.append(n)
        pol.observe(weak)
    assert waits == [4, 8, 16, 32] and pol.arms.held[1].floors == 5
    # the losing probes were judged by the model's own floor: the copies were never floored
    assert pol.floor.floors == 0 and pol.arms.held[0].floors == 0 and 0 in dict(pol.plan().arms)
    alone = GatedPolicy(PolicyConfig(probe=probe))
    alone.start(["model"])
    for _ in range(3):
        alone.observe(plain())
    alone.observe(drafted(0, 2, 0, 0.04, 0.07))
    # a lone arm is held back the same way; the plain steps until its probe are pipelined
    plan = alone.plan()
    assert plan.plain and plan.plain_ahead == 3 and alone.arms.held[0].floors == 1
    for _ in range(4):
        alone.observe(plain())
    assert not alone.plan().plain and alone.arms.held[0].probing


MISS = drafted(0, 2, 0, 0.02, 0.06)  # 1 token in 0.08 s: commit ratio 0.625 (plain: 1 in 0.05)
HIT = drafted(0, 2, 2, 0.02, 0.06)  # 3 tokens in 0.08 s: 1.875
SLOW_MISS = drafted(0, 2, 0, 0.04, 0.07)  # 1 token in 0.11 s: 0.45, below half the margin


def held_lone_arm() -> GatedPolicy:
    """A lone model arm whose slow estimate says plain steps beat it, held back and probing
    again after the backoff (4 plain steps); probes last 3 steps."""
    probe = floor.ProbeConfig(backoff=4, growth=2.0, max_backoff=64, probe_len=3)
    pol = GatedPolicy(PolicyConfig(probe=probe))
    pol.start(["model"])
    for _ in range(3):
        pol.observe(plain())
    for _ in range(4):
        pol.observe(HIT)
    pol.estimates.length[0] = replace(
        pol.estimates.length[0], slow=(0.05, 0.05)
    )  # stale: learnt before a floor
    assert pol.arms.loses_to_plain(0, pol.clock.t_ar)
    pol.arms.held[0] = floor.on_floor(probe, pol.arms.held[0])
    for _ in range(4):
        pol.observe(plain())
    assert pol.arms.held[0].probing and not pol.plan().plain
    return pol


@pytest.mark.parametrize(
    "probe, lost_at",
    [
        ((SLOW_MISS, HIT, HIT), 0),  # far below break-even: lost at once
        ((MISS, MISS, MISS), 2),  # mean ratio 0.625 at its end: lost
        ((MISS, MISS, HIT, HIT), None),  # mean 1.04 at its end: won
        ((HIT, HIT, HIT), None),
    ],
)
def test_a_held_arms_probe_is_judged_on_its_own_steps(probe, lost_at):
    """A held arm's probe is a test on its own steps, not on the estimate that held the arm
    back (which the plain steps since did not refresh): lost at once by a step below half the
    margin, else by the mean commit ratio of its steps at its end; a won probe replaces the
    arm's slow estimate by what the probe taught, so the arm is not held back again at once."""
    pol = held_lone_arm()
    for i, s in enumerate(probe[:3]):
        pol.observe(s)
        h = pol.arms.held[0]
        if i == lost_at:
            assert h.floored and h.probes_lost == 1 and h.ar_left == 8
            return
        assert not h.floored
    assert pol.arms.held[0].probes_won == 1 and not pol.arms.held[0].probing
    assert pol.estimates.length[0].slow == pol.estimates.length[0].accept
    for s in probe[3:]:  # after a won probe the arm is judged by its estimate again
        pol.observe(s)
    assert not pol.arms.loses_to_plain(0, pol.clock.t_ar) and not pol.arms.held[0].floored


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_a_floor_is_lifted_by_a_strong_copy_and_costly_arms_are_not_peeked(arch):
    """While floored, the arms measured as free (PLD) are asked for a strong draft before each
    plain step; a long prompt-lookup match lifts the floor. An arm measured as costly is not
    asked; one never measured is asked once, which measures it."""
    target = TARGETS[arch]
    for prompt, strong in (([3, 1, 4, 1, 5, 9, 2, 6] * 3, True), (list(range(12)), False)):
        pld, dfl = pld_then_dflash(target, seed=4)
        pol = GatedPolicy(PolicyConfig(probe=floor.ProbeConfig(backoff=1000)))
        dec = Decoder(KVTarget(target), [pld, dfl], DecodeConfig(max_tokens=8), policy=pol)
        dec.prefill(prompt)
        pol.clock.t_ar = 0.05
        pol.floor = floor.on_floor(pol.cfg.probe, pol.floor)
        calls = []
        real = dfl.draft
        dfl.draft = lambda c, real=real, calls=calls: calls.append(c) or real(c)
        plan = pol.plan()
        assert plan.plain and plan.peek == (0, 1)  # neither measured yet
        assert dec.peek(plan) is strong
        assert pol.lifts == int(strong) and pol.floor.floored is not strong
        assert len(calls) == int(not strong)  # PLD came first; a lift ends the look
        if not strong:
            pol.estimates.length[1] = pol.estimates.length[1].__class__(
                draft_cost=0.01
            )  # 20% of a plain step
            assert pol.plan().peek == (0,)
    assert not math.isnan(pol.estimates.length[0].draft_cost)


def test_specs_with_several_arms_and_auto(tmp_path):
    target = TARGETS["llama"]
    info = target_info(target)
    tiny_drafter(target, block=5).save(tmp_path / "ck")
    s = settings_mod.from_env({"ADASPEC_AUTO_PLD_MIN_MATCH": "3"})
    pld, short, dfl = make_arms(f"auto:{tmp_path / 'ck'}", info, s)
    assert isinstance(pld, PromptLookup) and pld.min_ngram == 3 and dfl.block == 5
    assert isinstance(short, PromptLookup) and short.min_ngram == 1  # its own estimates
    longer = settings_mod.from_env({"ADASPEC_PLD_MIN_NGRAM": "2"})  # a plain `pld` arm's default
    assert make_arms(f"auto:{tmp_path / 'ck'}", info, longer)[1].min_ngram == 1
    got = [type(a) for a in make_arms(f"auto:dflash:{tmp_path / 'ck'}", info, s)]
    assert got == [PromptLookup, PromptLookup, DFlashDrafter]
    pld, dfl = make_arms(f"auto:{tmp_path / 'ck'},min_match=01,block=3", info, s)
    assert pld.min_ngram == 1 and dfl.block == 3
    # the suffix arm in front of DFlash only when asked for
    pld, sfx, short, dfl = make_arms(f"auto:{tmp_path / 'ck'},suffix=true", info, s)
    assert isinstance(sfx, SuffixDrafter) and not sfx.context  # PLD covers the request's text
    assert isinstance(short, PromptLookup) and isinstance(dfl, DFlashDrafter)
    # no drafter ships for this target: the lookups alone (suffix learns online)
    assert [type(a) for a in make_arms("auto", info, s)] == [
        PromptLookup,
        SuffixDrafter,
        PromptLookup,
    ]
    (only,) = make_arms("auto:suffix=0", info, s)
    assert isinstance(only, PromptLookup) and only.min_ngram == 1
    assert default_spec(info) == "auto"
    arms = make_arms(f"pld:max_ngram=4+dflash:{tmp_path / 'ck'},block=4", info, s)
    assert [type(a) for a in arms] == [PromptLookup, DFlashDrafter]
    assert arms[0].max_ngram == 4 and arms[1].block == 4
    assert make_arms("none", info, s) == [] and make("none", info, s) is None
    with pytest.raises(DrafterError, match="names 2 drafters; accepted here: one"):
        make("pld+pld", info, s)


@pytest.mark.parametrize("marked", [None, False, True])
def test_auto_takes_a_shipped_drafter_only_when_marked_as_paying(tmp_path, monkeypatch, marked):
    target = TARGETS["llama"]
    info = target_info(target)
    folder = tmp_path / "shipped" / "tiny"
    tiny_drafter(target, block=5).save(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["adaspec_target"] = {"model_type": info.model_type}
    if marked is not None:
        cfg["adaspec_target"]["in_auto"] = marked
    (folder / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(shipped, "CHECKPOINTS", tmp_path / "shipped")
    s = settings_mod.from_env({})
    assert dflash.default_checkpoint(info) == folder  # `dflash` finds it either way
    got = [type(a) for a in make_arms("auto", info, s)]
    want = [PromptLookup, PromptLookup, DFlashDrafter]  # no suffix arm in front of DFlash
    assert got == (want if marked else [PromptLookup, SuffixDrafter, PromptLookup])
    assert default_spec(info) == "auto"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("pld+nope", "unknown drafter 'nope'; accepted: none, auto, dflash, draft-model, .*pld"),
        ("pld+none", "'none' cannot be an arm"),
        ("pld+", "has an arm without a name"),
        ("pld:max_ngram=x", "pld argument max_ngram='x' is not an integer"),
        ("pld:maxngram=2", "pld argument maxngram='2' is invalid; accepted: max_ngram=<int>"),
        ("pld:somewhere", "pld takes no positional argument, got 'somewhere'"),
        ("pld:max_ngram=2,max_ngram=3", "pld argument max_ngram is given twice"),
        ("draft-model:m,q=maybe", "draft-model argument q='maybe' is not a bool"),
        ("pld:,x", "pld argument 'x' is invalid; accepted: KEY=VALUE"),
        ("auto:pld", "PLD and suffix lookup already come first"),
        ("auto:suffix", "PLD and suffix lookup already come first"),
        ("auto:dflash,suffix=maybe", "suffix='maybe' is invalid; accepted: true or false"),
        ("auto:dflash,min_match=x", "min_match='x' is invalid; accepted: an integer 1..64"),
        ("auto:draft-model:m,min_match=0", "min_match='0' is invalid; accepted: an integer 1..64"),
        ("", "drafter spec '' is empty"),
    ],
)
def test_bad_specs_are_refused_naming_the_part(spec, match):
    info = target_info(TARGETS["llama"])
    with pytest.raises(DrafterError, match=match):
        make(spec, info, settings_mod.from_env({}))
