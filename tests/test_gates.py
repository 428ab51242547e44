"""Tier 1: gate state machines (lucebox's scenarios + hypothesis properties) and the policy's
floor / re-probe schedule, driven with synthetic step timings."""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaspec.errors import SettingsError
from adaspec.loop.stats import StepStats
from adaspec.policy import floor, gates
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.policy.clock import ArClock, ClockConfig
from adaspec.settings import from_env

C = gates.CommitConfig()
W5 = gates.CommitConfig(weight=0.5)  # lucebox's EMA weight: the hand-computed scenarios
E = gates.EntropyConfig()
T_AR = 0.010


def one_arm(cfg):
    """A GatedPolicy over a single drafter."""
    pol = GatedPolicy(cfg)
    pol.start(["d"])
    return pol


def run_commit(ratios, cfg=C):
    """Feed steps with the given commit ratios; return the index of the first floor or None."""
    s = gates.CommitState()
    for i, r in enumerate(ratios):
        s, fire = gates.commit_step(cfg, s, committed=1, step_s=T_AR / r, t_ar=T_AR)
        if fire:
            return i
    return None


def test_warmup_is_silent_even_at_ratio_zero():
    cfg = gates.CommitConfig(warmup=5)
    assert run_commit([1e-6] * 4, cfg) is None
    assert run_commit([1e-6] * 5, cfg) == 4


def test_streak_reaching_sustain_floors():
    # ema: 1.45, 1.175, 1.0375, 0.96875 (streak 1), 0.934 (2), 0.917 (3) -> floor at step 5
    assert run_commit([0.9] * 10, W5) == 5
    # the default slow EMA: 0.9 + 1.1 * 0.9^n falls under 1 at n = 23 (step 22): floor at 24
    assert run_commit([0.9] * 40) == 24


def test_hard_floor_below_half_the_margin():
    # ema 1.05, 0.575 (streak 1), 0.3375 (streak 2 < sustain, but < 0.5 * margin): floor
    assert run_commit([0.1] * 10, W5) == 2
    # by default the fast EMA (weight 0.5) takes that path while the slow one is still > 1
    assert run_commit([0.1] * 10) == 2


def test_a_good_step_resets_the_streak():
    s = gates.CommitState()
    for r in [0.9] * 4:
        s, _ = gates.commit_step(W5, s, 1, T_AR / r, T_AR)
    assert s.streak == 1
    s, fire = gates.commit_step(W5, s, 5, T_AR, T_AR)
    assert s.streak == 0 and not fire


def test_zero_times_are_guarded():
    assert math.isfinite(gates.commit_ratio(3, 0.0, 0.0, C.min_t_ar))
    assert gates.commit_ratio(1, 1e-3, 0.0, C.min_t_ar) == pytest.approx(0.5)


def test_sustained_two_times_slower_drafter_floors():
    assert run_commit([0.5] * 10, W5) is not None
    # slow EMA 0.5 + 1.5 * 0.9^n under 1 at n = 11, streak 3 two steps later; the fast one
    # approaches 0.5 from above and never fires
    assert run_commit([0.5] * 40) == 12


def test_ratio_around_9_6_never_floors():
    assert run_commit([9.6, 9.3, 9.9] * 400) is None


def test_slow_warmup_then_tau_14_does_not_floor():
    assert run_commit([0.1, 0.1] + [14 / 1.5] * 50) is None


def test_disabled_gates_never_fire():
    pol = one_arm(PolicyConfig(gates=(), clock=None, holds=None))
    for i in range(200):
        assert not pol.plan().plain
        pol.observe(
            StepStats(
                drafted=8, committed=1, arm=0, draft_s=0.1, verify_s=1.0, context=i + 10, p1=0.01
            )
        )
    assert pol.floor.floors == 0


def test_entropy_tie_floors_at_once_and_confidence_never_does():
    s, fire = gates.entropy_step(E, gates.EntropyState(), 0.3)
    assert fire
    s = gates.EntropyState()
    for _ in range(100):
        s, fire = gates.entropy_step(E, s, 0.97)
        assert not fire


def test_entropy_sustained_low_confidence_floors():
    s, f1 = gates.entropy_step(E, gates.EntropyState(), 0.7)  # ema 0.85 < 0.9: streak 1
    s, f2 = gates.entropy_step(E, s, 0.7)  # streak 2 = sustain
    assert (f1, f2) == (False, True)


def plain(ctx, t=T_AR):
    return StepStats(committed=1, verify_s=t, context=ctx)


def spec(ctx, committed, t, p1=0.99):
    return StepStats(
        drafted=8,
        accepted=committed - 1,
        committed=committed,
        arm=0,
        verify_s=t,
        context=ctx,
        p1=p1,
    )


def drive(pol, n_steps, spec_step):
    """Run the policy for n steps; record 'A' (plain) or 'S' (speculative) per step."""
    trace, ctx = [], 100
    for _ in range(n_steps):
        if pol.plan().plain:
            pol.observe(plain(ctx))
            trace.append("A")
        else:
            pol.observe(spec_step(ctx))
            trace.append("S")
        ctx += 1
    return "".join(trace)


@given(
    warmup=st.integers(0, 5),
    sustain=st.integers(1, 5),
    slow=st.floats(1.25, 20),
    entropy=st.booleans(),
    p1=st.floats(0, 1),
    weight=st.sampled_from([0.1, 0.5]),
)
def test_always_wrong_drafter_floors_within_warmup_plus_sustain_plus_one(
    warmup, sustain, slow, entropy, p1, weight
):
    commit = gates.CommitConfig(sustain=sustain, warmup=warmup, weight=weight)
    cfg = PolicyConfig(
        gates=(E, commit) if entropy else (commit,),
        probe=floor.ProbeConfig(backoff=1000, max_backoff=1000),
    )
    pol = one_arm(cfg)
    trace = drive(pol, 80, lambda ctx: spec(ctx, 1, T_AR * slow, p1))
    first_spec = trace.index("S")
    n_spec = trace[first_spec:].index("A")  # speculative steps until the first floor
    assert trace[:2] == "AA"  # t_ar is measured on warm plain steps first
    # The EMA starts at 2.0; at ratio <= 0.8 it falls under the margin within `cross` steps
    # (3 at weight 0.5, 18 at 0.1), so the bound is max(warmup, cross + sustain - 1): within
    # warmup + cross + sustain - 2 whenever warmup >= 1.
    cross = math.ceil(math.log(0.2 / 1.2) / math.log(1 - weight))
    assert n_spec <= max(warmup, cross + sustain - 1)
    if warmup >= 1:
        assert n_spec <= warmup + cross + sustain - 2


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, [8, 16, 32, 64, 128, 256, 256]),  # the documented defaults: 8, x2, capped at 256
        ({"BACKOFF": "5", "GROWTH": "3", "MAX_BACKOFF": "100"}, [5, 15, 45, 100, 100]),
        ({"BACKOFF": "4", "GROWTH": "1"}, [4, 4, 4, 4]),
    ],
)
def test_probes_follow_the_backoff_schedule(env, want):
    probe = {f"ADASPEC_PROBE_{k}": v for k, v in env.items()}
    cfg = PolicyConfig.from_settings(from_env({"ADASPEC_GATE": "commit", **probe}))
    pol = one_arm(replace(cfg, clock=ClockConfig(refresh=1e6)))
    trace = drive(pol, 1000, lambda ctx: spec(ctx, 1, T_AR * 4))  # always losing
    runs = [len(r) for r in trace.strip("A").split("S") if r]  # plain runs between probes
    assert runs[: len(want)] == want
    assert pol.floor.probes_lost == pol.floor.floors - 1


def test_a_winning_probe_resets_the_backoff():
    probe = floor.ProbeConfig(backoff=2, growth=2, max_backoff=64, probe_len=3)
    pol = one_arm(PolicyConfig(probe=probe, clock=ClockConfig(refresh=1e6)))
    drive(pol, 40, lambda ctx: spec(ctx, 1, T_AR * 4))
    assert pol.floor.backoff > 2
    drive(pol, 200, lambda ctx: spec(ctx, 6, T_AR * 1.5))  # now speculation wins
    assert pol.floor.probes_won >= 1 and pol.floor.backoff == 2 and not pol.floor.floored


def test_t_ar_is_remeasured_as_the_context_grows():
    pol = one_arm(PolicyConfig(clock=ClockConfig(refresh=0.25, refresh_min=16)))
    trace = drive(pol, 400, lambda ctx: spec(ctx, 4, T_AR * 1.5))
    # each (re)measurement is a burst of 4 plain steps; 100 -> 500 tokens: re-measured
    assert trace.startswith("AAAAS") and trace.count("AAAA") >= 2
    assert pol.floor.floors == 0


@pytest.mark.parametrize("at_least, bursts", [(0, 3), (150, 2), (512, 1)])
def test_t_ar_waits_for_the_context_to_grow_by_both_the_fraction_and_the_tokens(at_least, bursts):
    """From 100 tokens, doubling: re-measured at ~200 and ~400 with no minimum; a minimum of
    150 tokens moves the first to ~250, whose double is past the end; 512: measured once."""
    pol = one_arm(PolicyConfig(clock=ClockConfig(refresh=1.0, refresh_min=at_least)))
    trace = drive(pol, 350, lambda ctx: spec(ctx, 4, T_AR * 1.5))
    assert trace.count("AAAA") == bursts and trace.startswith("AAAAS")


@pytest.mark.parametrize(
    "env, match",
    [
        (
            {"ADASPEC_GATE": "maybe"},
            "ADASPEC_GATE='maybe' is invalid.*list of commit, entropy.*or off",
        ),
        ({"ADASPEC_GATE_TIE_P1": "0.95"}, "TIE_P1=0.95 is larger than ADASPEC_GATE_AR_P1=0.9"),
        ({"ADASPEC_GATE_MARGIN": "-1"}, "ADASPEC_GATE_MARGIN='-1' is invalid"),
        ({"ADASPEC_GATE_WARMUP": "two"}, "ADASPEC_GATE_WARMUP='two' is invalid"),
        ({"ADASPEC_PROBE_BACKOFF": "500"}, "PROBE_BACKOFF=500 is larger"),
        ({"ADASPEC_GATE_EMA_WEIGHT": "0"}, "ADASPEC_GATE_EMA_WEIGHT='0' is invalid"),
    ],
)
def test_bad_gate_settings_are_rejected(env, match):
    with pytest.raises(SettingsError, match=match):
        from_env(env)


def test_settings_map_onto_the_policy():
    cfg = PolicyConfig.from_settings(
        from_env({"ADASPEC_GATE": "commit", "ADASPEC_GATE_MARGIN": "1.2"})
    )
    assert [type(g) for g in cfg.gates] == [gates.CommitConfig] and cfg.gates[0].margin == 1.2


def test_a_losing_probe_refloors_after_one_speculative_step():
    probe = floor.ProbeConfig(backoff=3, growth=2, max_backoff=64, probe_len=4)
    pol = one_arm(PolicyConfig(probe=probe, clock=ClockConfig(refresh=1e6)))
    trace = drive(pol, 80, lambda ctx: spec(ctx, 1, T_AR * 1.5))  # ratio 0.67 < margin
    first_floor = trace.index("A", trace.index("S"))
    probes = trace[first_floor:].strip("A").split("A")
    assert all(p == "S" for p in probes if p)  # every probe is a single speculative step
    assert gates.probe_lost(gates.CommitConfig(), 1, 1.5 * T_AR, T_AR)
    assert not gates.probe_lost(gates.CommitConfig(), 3, 1.5 * T_AR, T_AR)


def test_a_strong_candidate_lifts_the_floor_into_a_probe():
    pol = one_arm(PolicyConfig(probe=floor.ProbeConfig(backoff=50)))
    drive(pol, 12, lambda ctx: spec(ctx, 1, T_AR * 4))
    assert pol.floor.floored and pol.plan().plain_ahead >= 1
    assert pol.lift() and not pol.floor.floored and pol.floor.probing
    assert pol.lifts == 1 and not pol.lift()  # nothing to lift when not floored
    off = one_arm(PolicyConfig(probe=floor.ProbeConfig(backoff=50), lift=False))
    drive(off, 12, lambda ctx: spec(ctx, 1, T_AR * 4))
    assert not off.lift() and off.floor.floored


@given(st.lists(st.sampled_from(["plain", "lift", "lose", "win"]), max_size=200))
def test_lost_lifts_back_off_and_a_won_lift_resets(events):
    """Pure FloorState: after a lost lift, no lift is possible for lift_backoff plain steps; the
    lift backoff grows (to the cap) with consecutive lost lifts and resets when a lift wins."""
    cfg = floor.ProbeConfig(backoff=4, growth=2, max_backoff=32, probe_len=3)
    s = floor.on_floor(cfg, floor.FloorState())
    since_lost, wait, lost_in_row = None, 0, 0
    for e in events:
        if e == "plain":
            s = floor.on_plain_step(s)
            since_lost = None if since_lost is None else since_lost + 1
        elif e == "lift":
            before = s
            s = floor.on_lift(s)
            lifted = s is not before and s.lifted
            if since_lost is not None and since_lost < wait:
                assert not lifted  # still backing off
            if lifted:
                assert s.probing and not s.floored
        elif s.probing and e == "lose":
            was_lift = s.lifted
            s = floor.on_floor(cfg, s)
            if was_lift:
                lost_in_row += 1
                wait = min(cfg.backoff * 2**lost_in_row, cfg.max_backoff)
                assert s.lift_wait == s.lift_backoff == wait
                since_lost = 0
        elif s.probing and e == "win":
            was_lift = s.lifted
            for _ in range(cfg.probe_len):
                s = floor.on_spec_step(cfg, s)
            assert not s.probing
            if was_lift:
                assert s.lift_backoff == 0
                lost_in_row = 0
            s = floor.on_floor(cfg, s)  # end the run of speculation for the next event


def test_ar_clock_reads_the_mean_rate_of_a_run():
    """In a run of plain steps (a synchronous head, then steps queued by the step before) the
    wait for a forward falls on whichever step reads it: t_ar is the run's mean once it has
    three steps. The generation's first plain step (cold) and speculative steps are not plain
    decoding; a speculative step ends the run."""
    clock = ArClock()
    for i, t in enumerate([0.9, 0.35, 0.2, 0.05]):  # cold first; head, queued, queued
        clock.observe(StepStats(committed=1, verify_s=t, context=100 + i, queued=i >= 2))
    assert clock.t_ar == pytest.approx(0.2) and clock.context == 103
    clock.observe(
        StepStats(drafted=3, accepted=3, committed=4, arm=0, draft_s=0.1, verify_s=0.5, context=110)
    )  # speculative: ignored, and the run is over
    assert clock.t_ar == pytest.approx(0.2) and clock.context == 103
    for i, t in enumerate([0.3, 0.3]):  # a new run: too short to read yet
        clock.observe(StepStats(committed=1, verify_s=t, context=111 + i, queued=i > 0))
    assert clock.t_ar == pytest.approx(0.2)
    clock.observe(StepStats(committed=1, verify_s=0.3, context=113, queued=True))
    assert clock.t_ar == pytest.approx(0.3) and clock.context == 113


def test_ar_clock_prefers_runs_to_lone_steps():
    """Once a run was seen, lone plain steps (a drafter with nothing to propose, a synchronous
    step) no longer move t_ar: a floor decodes in runs."""
    clock = ArClock()
    for i, t in enumerate([0.9, 0.05, 0.05]):  # cold, then lone synchronous steps
        clock.observe(StepStats(committed=1, verify_s=t, context=10 + i))
    assert clock.t_ar == 0.05 and not clock.from_runs
    for i, t in enumerate([0.03, 0.01]):  # the last lone step heads a run of three
        clock.observe(StepStats(committed=1, verify_s=t, context=13 + i, queued=True))
    assert clock.t_ar == pytest.approx(0.03) and clock.from_runs
    clock.observe(StepStats(committed=1, verify_s=0.5, context=15))
    assert clock.t_ar == pytest.approx(0.03) and clock.context == 14


def test_t_ar_is_measured_in_an_honest_pipelined_burst():
    """A (re)measurement plans 4 plain steps and says so: each plan's plain_ahead counts the
    plain steps still certain after it, so the controller may queue their forwards."""
    pol = one_arm(PolicyConfig())
    ahead = []
    for i in range(4):
        plan = pol.plan()
        assert plan.plain
        ahead.append(plan.plain_ahead)
        pol.observe(StepStats(committed=1, verify_s=T_AR, context=100 + i, queued=i > 0))
    assert ahead == [3, 2, 1, 0] and not pol.plan().plain


def test_one_time_drafter_setup_is_not_held_against_speculating():
    """A probe whose step spent most of its time catching the drafter up (Draft.setup_s) is
    judged by the rest of the step; the same time as a recurring cost loses the probe."""
    cfg = PolicyConfig(probe=floor.ProbeConfig(backoff=1, probe_len=2))

    def probe_result(setup_s):
        pol = one_arm(cfg)
        ctx = 100
        while pol.plan().plain:  # t_ar measurement
            pol.observe(plain(ctx))
            ctx += 1
        for _ in range(12):  # a hopeless drafter floors
            pol.observe(spec(ctx, 1, 3 * T_AR))
            ctx += 1
            if pol.floor.floored:
                break
        while pol.floor.floored:
            pol.observe(plain(ctx))
            ctx += 1
        s = StepStats(
            drafted=4,
            accepted=3,
            committed=4,
            arm=0,
            draft_s=2.5 * T_AR,
            verify_s=2.5 * T_AR,
            context=ctx,
            setup_s=setup_s,
        )
        pol.observe(s)  # the probe's first step: 4 tokens in 5 plain steps' time
        return pol.floor.probes_lost

    assert probe_result(setup_s=2.0 * T_AR) == 0
    assert probe_result(setup_s=0.0) == 1


def test_a_new_generation_keeps_what_was_measured_and_starts_gates_afresh():
    pol = one_arm(PolicyConfig())
    for _ in range(3):
        pol.observe(StepStats(committed=1, verify_s=T_AR))
    for _ in range(12):  # a losing drafter: floored, with its acceptance and costs measured
        pol.observe(StepStats(committed=1, verify_s=3 * T_AR, drafted=4, arm=0, draft_s=T_AR))
    assert pol.floor.floored and pol.floor.floors >= 1 and pol.estimates.length[0].accept
    learned, t_ar = pol.estimates.length[0], pol.clock.t_ar
    pol.start(["d"])  # the next turn, same arm
    assert pol.estimates.length[0] == learned and pol.clock.t_ar == t_ar
    assert pol.floor == floor.FloorState() and pol.arms.held == [floor.FloorState()]
    assert pol.gates[0].state == gates.CommitState() and pol.clock.plain_seen == 0
    pol.start(["other"])  # other arms: nothing carries
    assert pol.estimates.length[0] == type(learned)()
