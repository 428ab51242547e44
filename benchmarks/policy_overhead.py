"""Share of each step spent in the adaptive policy (gates, floor state, draft-length rule) and
in reading p1 for the entropy gate, on the real default model with PLD.

    python benchmarks/policy_overhead.py [--prompts N] [--max-tokens M]
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import time
from pathlib import Path

import adaspec  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx

from adaspec.api import stream_generate
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.prompting import prompt_ids
from adaspec.settings import get
from adaspec.targets.loader import load

SUITE = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"


class Timed(GatedPolicy):
    spent = 0.0

    def plan(self):
        t = time.perf_counter()
        try:
            return super().plan()
        finally:
            Timed.spent += time.perf_counter() - t

    def observe(self, step) -> None:
        t = time.perf_counter()
        super().observe(step)
        Timed.spent += time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model, tok = load("smollm2-135m")
    recs = [json.loads(line) for line in SUITE.read_text().splitlines()][:: 39 // args.prompts]
    steps, step_s, p1_s = 0, 0.0, 0.0
    for r in recs[: args.prompts]:
        ids = prompt_ids(tok, r["messages"])
        pol = Timed(PolicyConfig.from_settings(get()))
        for resp in stream_generate(
            model, tok, ids, drafter="pld", max_tokens=args.max_tokens, policy=pol
        ):
            if resp.step is not None:
                steps += 1
                step_s += resp.step.total_s
                if resp.step.p1 is not None:  # time the same read on this token's row again
                    t = time.perf_counter()
                    mx.exp(mx.max(resp.logprobs)).item()
                    p1_s += time.perf_counter() - t
    print(
        f"steps {steps}, mean step {step_s / steps * 1e3:.2f} ms, policy "
        f"{Timed.spent / steps * 1e6:.1f} us/step ({Timed.spent / step_s:.3%} of step time), "
        f"p1 read {p1_s / steps * 1e6:.1f} us/step ({p1_s / step_s:.3%})"
    )


if __name__ == "__main__":
    main()
