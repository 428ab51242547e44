"""Tier 1/2: the adaptive policy's parts one by one (the plain-step clock, the draft est, the
arm scheduler, the gate list), what ADASPEC_GATE turns on and off, and a gate defined here,
chosen by ADASPEC_GATE and run in a real decode."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from drafters_for_tests import ScriptedDrafter
from tiny import ar_greedy

from adaspec import settings as settings_mod
from adaspec.errors import SettingsError
from adaspec.loop.controller import DecodeConfig, Decoder, decode
from adaspec.loop.plan import FLOOR, MEASURE, UNLIMITED
from adaspec.loop.stats import StepStats
from adaspec.policy import draft_length, floor, gates, tree_size
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.policy.arm_choice import ArmScheduler, HoldConfig
from adaspec.policy.clock import ArClock, ClockConfig
from adaspec.policy.estimates import ArmEstimates
from adaspec.settings import from_env
from adaspec.targets.kv import KVTarget

T_AR = 0.010


def plain(ctx=100, t=T_AR, queued=False):
    return StepStats(committed=1, verify_s=t, context=ctx, queued=queued)


def spec(arm=0, k=4, accepted=0, draft_s=0.0, verify_s=T_AR, ctx=100):
    return StepStats(
        drafted=k,
        accepted=accepted,
        committed=accepted + 1,
        arm=arm,
        draft_s=draft_s,
        verify_s=verify_s,
        context=ctx,
    )


# --- the plain-step clock


def test_the_clock_asks_for_a_burst_when_t_ar_is_missing_or_stale():
    clock = ArClock(ClockConfig(refresh=1.0, refresh_min=10, burst=4))
    ahead = []
    for i in range(4):
        ahead.append(clock.measure())
        clock.observe(plain(100 + i))
    assert ahead == [3, 2, 1, 0] and clock.measure() is None and clock.t_ar == T_AR
    clock.observe(spec(ctx=200))
    assert clock.measure() is None  # t_ar was measured at 103: 200 is not past 2 x 103
    clock.observe(spec(ctx=207))
    assert clock.measure() == 3  # stale: a new burst


def test_a_clock_without_a_config_never_asks_but_still_times_plain_steps():
    clock = ArClock()
    for i in range(3):
        assert clock.measure() is None
        clock.observe(plain(100 + i, t=0.02))
    assert clock.t_ar == 0.02  # the first (cold) step is not used
    clock.start()
    assert clock.t_ar == 0.02 and clock.plain_seen == 0


# --- the draft est


def test_the_estimates_learns_plain_steps_for_every_arm_and_a_draft_for_its_own():
    est = ArmEstimates(draft_length.LengthConfig(), tree_size.TreeSizeConfig())
    est.start(2, same_arms=False)
    est.observe(plain())
    est.observe(plain())
    assert [s.steps for s in est.length] == [2, 2]
    est.observe(spec(arm=1, k=4, accepted=4, draft_s=0.004))
    assert [s.steps for s in est.length] == [2, 3]
    assert est.judged(1) and not est.judged(0) and est.timed(1) and not est.timed(0)
    est.start(2, same_arms=True)
    assert est.length[1].steps == 3  # the same arms keep what was measured
    est.start(2, same_arms=False)
    assert est.length[1].steps == 0


def test_without_a_length_rule_the_estimates_cap_nothing_and_learns_nothing():
    est = ArmEstimates(None, tree_size.TreeSizeConfig())
    est.start(1, same_arms=False)
    est.observe(spec())
    assert est.choose_k(0) == UNLIMITED and est.length[0].steps == 0
    assert est.rate(0) is None


def test_the_tree_budget_is_credited_to_the_arm_it_was_planned_for():
    est = ArmEstimates(draft_length.LengthConfig(), tree_size.TreeSizeConfig(16, auto=True))
    est.start(2, same_arms=False)
    assert est.tree_nodes(1) == 0  # auto tries a chain first
    est.observe(spec(arm=0))  # another arm's step: not credited
    assert est.trees[1].seen == () and est.trees[0].seen == ()
    est.observe(spec(arm=1))
    assert est.trees[1].seen[0] == 1


# --- the arm scheduler


def losing_model_arm(holds):
    """A scheduler over one costly arm that commits 1 token per 22 ms against a 10 ms plain
    step."""
    est = ArmEstimates(draft_length.LengthConfig(), tree_size.TreeSizeConfig())
    est.start(1, same_arms=False)
    arms = ArmScheduler(est, holds, floor.ProbeConfig(backoff=4), free_cost=0.01)
    arms.start(1)
    for _ in range(3):
        est.observe(plain())
        arms.observe(plain(), T_AR)
    step = spec(k=2, accepted=0, draft_s=0.008, verify_s=0.014)
    est.observe(step)
    arms.observe(step, T_AR)
    return arms


def test_a_costly_losing_arm_is_held_and_without_holds_it_is_not():
    held = losing_model_arm(HoldConfig())
    assert held.held[0].floored and held.order() == [] and held.plain_ahead() == 3
    assert held.held_steps == [1]
    free = losing_model_arm(None)
    assert not free.held[0].floored and free.order() == [0]


def test_holds_follow_their_own_margin():
    assert losing_model_arm(HoldConfig(margin=0.5)).order() == [0]  # ~0.96 of plain is enough


# --- gates and ADASPEC_GATE


@pytest.mark.parametrize(
    "value, names",
    [
        ("commit", ("commit",)),
        (" Entropy , commit ", ("entropy", "commit")),
        ("commit,entropy,commit", ("commit", "entropy")),
        ("both", ("commit", "entropy")),
        ("off", ()),
    ],
)
def test_adaspec_gate_is_a_list(value, names):
    s = from_env({"ADASPEC_GATE": value})
    assert s.gate_names == names
    assert tuple(type(g) for g in gates.configs(s)) == tuple(
        {"commit": gates.CommitConfig, "entropy": gates.EntropyConfig}[n] for n in names
    )


@pytest.mark.parametrize("value", ["maybe", "commit,maybe", "off,commit", "", "commit,"])
def test_a_bad_gate_list_names_the_value_and_the_gates(value):
    with pytest.raises(SettingsError, match=f"ADASPEC_GATE='{value}' is invalid.*commit, entropy"):
        from_env({"ADASPEC_GATE": value})


def test_the_settings_know_every_registered_gate():
    assert list(settings_mod.GATE_NAMES) == list(gates.REGISTRY)


@pytest.mark.parametrize("name", ["off", "both", "Loud", "two words", "", "9lives"])
def test_a_gate_name_must_be_listable(name):
    with pytest.raises(SettingsError, match=f"gate name '{name}' is invalid; accepted: lower"):
        gates.register_gate(name, lambda s: gates.CommitConfig())
    assert name not in gates.REGISTRY


def drive(pol, steps):
    """Feed `steps()` (a speculative step) whenever the plan drafts, a plain step otherwise;
    return the trace ('A' plain, 'S' speculative)."""
    trace = ""
    for i in range(steps):
        if pol.plan().plain:
            pol.observe(plain(100 + i))
            trace += "A"
        else:
            pol.observe(spec(ctx=100 + i, draft_s=0.0, verify_s=4 * T_AR))
            trace += "S"
    return trace


def test_off_turns_off_the_gates_the_holds_and_the_clock_bursts():
    cfg = PolicyConfig.from_settings(from_env({"ADASPEC_GATE": "off"}))
    assert (cfg.gates, cfg.clock, cfg.holds) == ((), None, None)
    pol = GatedPolicy(cfg)
    pol.start(["d"])
    assert drive(pol, 100) == "S" * 100  # a hopeless drafter, every step
    assert pol.floor.floors == 0 and pol.arms.held[0].floors == 0


def test_one_gate_does_not_turn_the_clock_or_the_holds_off():
    """Choosing only the entropy gate keeps the plain-step clock (the first steps time plain
    decoding) and the arm holds (a costly arm that loses to plain steps is held back)."""
    cfg = PolicyConfig.from_settings(from_env({"ADASPEC_GATE": "entropy"}))
    assert cfg.clock is not None and cfg.holds is not None
    pol = GatedPolicy(cfg)
    pol.start(["model"])
    assert pol.needs_p1
    for _ in range(4):
        assert pol.plan().plain_reason == MEASURE
        pol.observe(plain())
    assert not pol.plan().plain
    pol.observe(spec(k=2, accepted=0, draft_s=0.008, verify_s=0.014))
    plan = pol.plan()  # every arm held: a plain step the stats count as floored
    assert pol.arms.held[0].floors == 1 and plan.plain and plan.plain_reason == FLOOR
    assert pol.floor.floors == 0


@dataclass(frozen=True)
class MissStreakConfig:
    """A gate defined outside the package: floor after `misses` speculative steps in a row
    with nothing accepted."""

    misses: int = 3

    def make(self) -> MissStreakGate:
        return MissStreakGate(self)


class MissStreakGate:
    needs_p1 = False

    def __init__(self, cfg: MissStreakConfig) -> None:
        self.cfg, self.streak = cfg, 0

    def observe(self, seen: gates.GateInput) -> bool:
        self.streak = self.streak + 1 if seen.step.accepted == 0 else 0
        return self.streak >= self.cfg.misses

    def reset(self) -> None:
        self.streak = 0


@pytest.fixture
def miss_streak():
    gates.register_gate("miss-streak", lambda s: MissStreakConfig(misses=3))
    yield
    del gates.REGISTRY["miss-streak"], settings_mod.GATE_NAMES["miss-streak"]


def test_a_new_gate_is_one_class_and_its_settings(miss_streak):
    s = from_env({"ADASPEC_GATE": "commit,miss-streak", "ADASPEC_PROBE_BACKOFF": "5"})
    cfg = PolicyConfig.from_settings(s)
    assert cfg.gates[1] == MissStreakConfig(misses=3)
    pol = GatedPolicy(replace(cfg, gates=cfg.gates[1:]))  # the new gate alone
    pol.start(["d"])
    trace = drive(pol, 40)
    # the clock's burst, 3 misses, a floor of 5 plain steps, then probes lost at their 3rd step
    assert trace.startswith("AAAA" + "SSS" + "AAAAA" + "SSS")
    assert pol.floor.floors >= 2 and pol.floor.probes_lost >= 1


def test_a_new_gate_runs_in_a_real_decode(miss_streak, tiny):
    """Chosen by ADASPEC_GATE, the gate floors a drafter of random tokens; the output is the
    target's."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    ref = ar_greedy(tiny, prompt, 40)
    drafter = ScriptedDrafter([("random", 4, i) for i in range(7)], ref, len(prompt), 260)
    cfg = PolicyConfig.from_settings(from_env({"ADASPEC_GATE": "miss-streak"}))
    pol = GatedPolicy(replace(cfg, holds=None))  # holds judge by timing; the gate must see it
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=40), pol)
    out = [e.token for e in decode(dec, prompt)]
    assert out == ref
    assert dec.stats.policy["floors"] >= 1 and dec.stats.floored_steps >= 8
    assert math.isclose(dec.stats.floored_fraction, dec.stats.floored_steps / dec.stats.steps)
