"""Record every call the default policy gets during a CLI run, and replay recorded calls through
the current policy: a change to the policy's code that keeps its decisions gives the same plan,
and the same answer to every lift, at every step of every recorded generation.

    PYTHONPATH=. python benchmarks/policy_replay.py record TRACE.jsonl bench --suite ... [CLI args]
    PYTHONPATH=. python benchmarks/policy_replay.py replay TRACE.jsonl

(PYTHONPATH: the adaspec of the tree it is run from, not an installed one.) TRACE may be
gzipped; tests/data holds two, which tests/test_policy_replay.py replays.
The replay feeds the policy the recorded steps (their times included), so decisions depend on
nothing but the code; it runs under the settings of the environment it is started in, which
should be the recording's.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import sys
from typing import Any

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec import api
from adaspec.loop.stats import StepStats
from adaspec.settings import from_env


def _plain(value: Any) -> Any:
    """A JSON-ready copy (tuples as lists), so recorded and replayed values compare equal."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value))


class Recorder:
    """A policy that forwards to `inner` and keeps each call and its answer; `flush` writes them
    as one line (one policy, which may run several generations)."""

    def __init__(self, inner: Any, out: Any) -> None:
        self.inner, self.out, self.calls = inner, out, []
        self.needs_p1 = inner.needs_p1

    def _call(self, name: str, args: Any, result: Any = None) -> Any:
        self.calls.append([name, _plain(args), _plain(result)])
        return result

    def start(self, arms):
        self.inner.start(arms)
        return self._call("start", list(arms))

    def plan(self):
        return self._call("plan", None, self.inner.plan())

    def observe(self, step):
        self.inner.observe(step)
        self._call("observe", step)

    def observe_peek(self, arm, drafted, seconds):
        self.inner.observe_peek(arm, drafted, seconds)
        self._call("observe_peek", [arm, drafted, seconds])

    def lift(self):
        return self._call("lift", None, self.inner.lift())

    def gains(self, arm, k):
        return self.inner.gains(arm, k)  # a read of the estimates: not a decision to record

    def summary(self):
        return self.inner.summary()

    def flush(self) -> None:
        if self.calls:
            self.out.write(json.dumps(self.calls) + "\n")
        self.calls = []


def record(path: str, cli_args: list[str]) -> int:
    from adaspec.cli import main

    recorders: list[Recorder] = []
    real = api.default_policy
    with open(path, "w") as out:

        def recording(arms, settings):
            pol = real(arms, settings)
            if not arms:
                return pol
            recorders.append(Recorder(pol, out))
            return recorders[-1]

        api.default_policy = recording
        try:
            return main(cli_args)
        finally:
            for r in recorders:
                r.flush()


def replay(path: str) -> int:
    fields = {f.name for f in dataclasses.fields(StepStats)}
    settings = from_env()
    policies = steps = 0
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line_no, line in enumerate(f, 1):
            calls = json.loads(line)
            pol = api.default_policy([object()], settings)
            for i, (name, args, want) in enumerate(calls):
                if name == "start":
                    got = pol.start(args)
                elif name == "plan":
                    got, steps = pol.plan(), steps + 1
                elif name == "observe":
                    got = pol.observe(StepStats(**{k: v for k, v in args.items() if k in fields}))
                elif name == "observe_peek":
                    got = pol.observe_peek(*args)
                else:
                    got = pol.lift()
                got = _plain(got)
                if isinstance(got, dict) and isinstance(want, dict):  # fields both know
                    got = {k: v for k, v in got.items() if k in want}
                    want = {k: v for k, v in want.items() if k in got}
                if got != want:
                    print(f"line {line_no}, call {i} ({name}): recorded {want}, now {got}")
                    return 1
            policies += 1
    where = adaspec.__file__
    print(f"{policies} policies, {steps} plans: every plan and lift as recorded ({where})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "replay"):
        sys.exit(__doc__)
    if sys.argv[1] == "record":
        sys.exit(record(sys.argv[2], sys.argv[3:]))
    sys.exit(replay(sys.argv[2]))
