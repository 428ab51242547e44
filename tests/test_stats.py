"""Tier 1/2: what the stats say happened: floors apart from the plain steps that time plain
decoding, a line per arm, a warning for an arm that is never accepted, a readable summary."""

from __future__ import annotations

import logging

from drafters_for_tests import ScriptedDrafter
from tiny import ar_greedy

from adaspec.loop.controller import (
    AlwaysSpeculate,
    DecodeConfig,
    Decoder,
    NeverSpeculate,
    decode,
)
from adaspec.loop.stats import (
    NEVER_ACCEPTED_STEPS,
    GenerationStats,
    StepStats,
    arm_lines,
    describe,
)
from adaspec.policy import floor, gates
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.targets.kv import KVTarget

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def run(tiny, drafters, policy, n=40):
    dec = Decoder(KVTarget(tiny), drafters, DecodeConfig(max_tokens=n), policy)
    out = [e.token for e in decode(dec, PROMPT)]
    assert out == ar_greedy(tiny, PROMPT, n)
    return dec.stats


def oracle(tiny, n=40):
    ref = ar_greedy(tiny, PROMPT, n)
    return ScriptedDrafter([("oracle", 4, 0)], ref, len(PROMPT), 260)


def test_floors_are_counted_apart_from_timing_plain_steps(tiny):
    """The policy times plain steps first (the clock's burst); with no gate it never floors,
    and with a gate that fires at every speculative step it floors at once after them. What is
    judged by time (the commit gate, holds, lifts of free drafters, the length rule) is left
    out: the tiny model's timings are not what this checks."""
    s = run(tiny, oracle(tiny), GatedPolicy(PolicyConfig(gates=(), holds=None)))
    assert s.measure_steps == 4 and s.floored_steps == 0 and s.floored_fraction == 0
    summary = s.summary()
    assert (summary["floors"], summary["floored_fraction"], summary["measure_steps"]) == (0, 0, 4)
    always = gates.EntropyConfig(ar_p1=1.0, tie_p1=1.0)  # top-1 probability < 1: floor
    probe = floor.ProbeConfig(backoff=8)
    cfg = PolicyConfig((always,), probe, holds=None, length=None, lift=False)
    s = run(tiny, oracle(tiny), GatedPolicy(cfg))
    assert s.measure_steps == 4 and s.policy["floors"] >= 2 and s.floored_steps == 8 + 16
    plain = run(tiny, [], NeverSpeculate())
    assert plain.floored_steps == plain.measure_steps == 0 and plain.plain_fraction == 1


def test_record_counts_each_kind_of_plain_step():
    s = GenerationStats()
    s.record(StepStats(committed=1, verify_s=0.01, floored=True))
    s.record(StepStats(committed=1, verify_s=0.01, measuring=True))
    s.record(StepStats(committed=1, verify_s=0.01))  # the drafter had nothing
    s.record(StepStats(committed=3, verify_s=0.01, drafted=2, accepted=2))
    assert (s.floored_steps, s.measure_steps, s.spec_steps, s.steps) == (1, 1, 1, 4)
    assert s.floored_fraction == 0.25 and s.plain_fraction == 0.75
    assert describe(s.summary()).startswith(
        "steps 4: 1 drafted, 3 plain (floored 1, timing plain steps 1, no draft 1)"
    )


def test_an_arm_that_keeps_drafting_and_is_never_accepted_is_reported(tiny, caplog):
    ref = ar_greedy(tiny, PROMPT, 40)
    bad = ScriptedDrafter([("random", 4, i) for i in range(5)], ref, len(PROMPT), 260)
    with caplog.at_level(logging.WARNING, logger="adaspec.loop.controller"):
        s = run(tiny, bad, AlwaysSpeculate())
    row = s.by_arm["scripted"]
    assert row["accepted"] == 0 and row["steps"] == 39 > NEVER_ACCEPTED_STEPS  # the last: 1 room
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said == s.warnings == s.summary()["warnings"]
    assert f"'scripted' drafted {row['drafted']} tokens in 39 steps and none was" in said[0]
    assert "warning: arm 'scripted'" in describe(s.summary())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adaspec.loop.controller"):
        good = run(tiny, oracle(tiny), AlwaysSpeculate())
    assert not good.warnings and not caplog.records


def test_a_line_per_arm_says_what_each_did(tiny):
    """Two arms of the same name are told apart by their index; the one never asked says so."""
    arms = [oracle(tiny), oracle(tiny)]
    s = run(tiny, arms, GatedPolicy(PolicyConfig(gates=(), holds=None)))
    summary = s.summary()
    assert list(summary["by_arm"]) == list(summary["arm_floors"]) == ["scripted#0", "scripted#1"]
    first, second = arm_lines(summary)
    row = summary["by_arm"]["scripted#0"]
    share = row["steps"] / summary["steps"]
    assert first.startswith(
        f"arm scripted#0: drafted {row['drafted']} tokens in {row['steps']} steps ({share:.0%} "
        f"of steps), accepted {row['accepted']} (100%), tau {row['committed'] / row['steps']:.2f}"
    )
    assert first.endswith("held back 0 times (0 steps)")
    assert second.startswith("arm scripted#1: drafted 0 tokens in 0 steps (0% of steps)")


def test_describe_reads_as_lines():
    s = GenerationStats(arm_names=["pld"])
    s.record(StepStats(committed=4, verify_s=0.02, drafted=4, accepted=3, arm=0))
    s.policy = {"floors": 2, "probes_won": 1, "probes_lost": 1, "lifts": 0, "t_ar_ms": 30.0}
    s.policy |= {"arm_floors": {"pld": 1}, "arm_held_steps": {"pld": 9}}
    text = describe(s.summary()).splitlines()
    assert text[1] == (
        "tokens 4: tau 4.00 per drafted step; accepted 3 of 4 drafted (75%); by position "
        "1.00 1.00 1.00 0.00"
    )
    assert text[2] == "policy: floors 2 (probes won 1, lost 1), lifts 0, plain step 30.0 ms"
    assert text[3].endswith("held back 1 times (9 steps)")
    assert text[4].startswith("seconds: prefill 0.000, draft 0.000, verify 0.020")
    assert str(s) == s.describe() == "\n".join(text)
