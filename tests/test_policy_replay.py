"""Tier 1: the policy decides as recorded. Every call the default policy got in two dev-suite
runs (SmolLM2-135M, `--drafter auto`, 128 tokens; default gates, and `both` with
`ADASPEC_TREE_NODES=auto`), recorded by `benchmarks/policy_replay.py record`, is replayed with
the recorded steps and their times: every plan and every answer to a lift must be the same. A
change that means to change decisions re-records them."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from adaspec.api import default_policy
from adaspec.loop.stats import StepStats
from adaspec.settings import from_env

DATA = Path(__file__).parent / "data"
FIELDS = {f.name for f in dataclasses.fields(StepStats)}


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value))


def replay(calls, settings) -> int:
    """Feed one recorded policy's calls to a fresh policy; return the plans compared."""
    pol, plans = default_policy([object()], settings), 0
    for i, (name, args, want) in enumerate(calls):
        if name == "start":
            got = pol.start(args)
        elif name == "plan":
            got, plans = pol.plan(), plans + 1
        elif name == "observe":
            got = pol.observe(StepStats(**{k: v for k, v in args.items() if k in FIELDS}))
        elif name == "observe_peek":
            got = pol.observe_peek(*args)
        else:
            got = pol.lift()
        got = _plain(got)
        if isinstance(got, dict):  # fields a plan gained since the recording carry no decision
            got = {k: v for k, v in got.items() if k in want}
        assert got == want, f"call {i} ({name})"
    return plans


@pytest.mark.parametrize(
    "name, env, plans",
    [
        ("policy-calls-auto-smollm2-dev-128.jsonl.gz", {}, 2364),
        (
            "policy-calls-auto-smollm2-dev-128-both-tree-auto.jsonl.gz",
            {"ADASPEC_GATE": "both", "ADASPEC_TREE_NODES": "auto"},
            3122,
        ),
    ],
)
def test_the_policy_decides_as_recorded(name, env, plans):
    settings = from_env(env)
    with gzip.open(DATA / name, "rt") as f:
        assert sum(replay(json.loads(line), settings) for line in f) == plans


def test_a_replay_catches_a_changed_decision():
    with gzip.open(DATA / "policy-calls-auto-smollm2-dev-128.jsonl.gz", "rt") as f:
        runs = [json.loads(line) for line in f]
    with pytest.raises(AssertionError, match=r"call \d+ \(plan\)"):
        for calls in runs:
            replay(calls, from_env({"ADASPEC_PROBE_BACKOFF": "9"}))
