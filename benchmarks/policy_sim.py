"""Policy settings compared on a virtual clock: real decoding (the real target, drafter and
acceptance), but every time the controller reads comes from a cost model, so two policies'
speeds differ only by their decisions, never by timing noise. A forward of n tokens costs
COST[n] plain steps (pipelined plain step = 1), a plain step after a non-plain one 1 + LONE,
one DFlash draft DRAFT; PLD drafts are free. Speed = tokens after the first / virtual time of
the same steps, i.e. x AR under the model. The default costs are SmolLM2-135M's measured live
step costs on this machine (docs/benchmarks.md).

    python benchmarks/policy_sim.py [--drafter dflash] [--prompts open|grounded|all]
        [--max-tokens 128] --variant NAME=KEY:VALUE,KEY:VALUE [--variant ...]

A variant's keys are Settings fields (e.g. gate_commit_ema_weight:0.5); no keys = defaults.
"""

import argparse
import statistics
import types

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.api import stream_generate
from adaspec.bench.suite import load_suite
from adaspec.drafters import dflash
from adaspec.loop import controller
from adaspec.prompting import prompt_ids
from adaspec.settings import from_env
from adaspec.targets.kv import KVTarget
from adaspec.targets.loader import load

SUITE = "benchmarks/prompts/dev.jsonl"
COST = {1: 1.0, 2: 1.12, 3: 1.15, 4: 1.27, 5: 1.33, 6: 1.40, 7: 1.46, 8: 1.52}
LONE, DRAFT, PER_ROW = 0.25, 0.19, 0.06
clock = types.SimpleNamespace(now=0.0, last_n=0)


def install() -> None:
    """The controller's clock reads `clock.now`; forwards and DFlash drafts advance it."""
    controller.time = types.SimpleNamespace(perf_counter=lambda: clock.now)  # type: ignore
    forward = KVTarget.forward

    def timed_forward(self, tokens, taps=()):
        n = len(tokens)
        c = COST.get(n, COST[8] + PER_ROW * (n - 8))
        clock.now += c + (LONE if n == 1 and clock.last_n != 1 else 0.0)
        clock.last_n = n
        return forward(self, tokens, taps)

    KVTarget.forward = timed_forward  # type: ignore[method-assign]
    for name in ("draft", "draft_ids"):
        method = getattr(dflash.DFlashDrafter, name)

        def timed(self, ctx, method=method):
            clock.now += DRAFT
            return method(self, ctx)

        setattr(dflash.DFlashDrafter, name, timed)


def speed(model, tok, ids, drafter: str, n: int, settings: dict) -> tuple[float, float]:
    """(x AR under the cost model, fraction of steps floored)."""
    count, t0, last = 0, 0.0, None
    s = from_env({}, **settings)
    for r in stream_generate(model, tok, ids, drafter=drafter, max_tokens=n, settings=s):
        count += 1
        if count == 1:
            t0 = clock.now
        last = r
    floored = last.stats.floored_steps / last.stats.steps
    return (count - 1) * COST[1] / (clock.now - t0), floored


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--prompts", choices=["open", "grounded", "all"], default="open")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--variant", action="append", default=[])
    args = ap.parse_args()
    variants = {}
    for v in args.variant or ["defaults="]:
        name, _, kv = v.partition("=")
        variants[name] = dict(item.split(":", 1) for item in kv.split(",") if item)
    install()
    model, tok = load(args.model)
    prompts = [
        p
        for p in load_suite(SUITE)
        if args.prompts == "all" or p.grounded == (args.prompts == "grounded")
    ]
    got: dict[str, list[float]] = {v: [] for v in variants}
    for p in prompts:
        ids = prompt_ids(tok, p.messages)
        row = []
        for name, settings in variants.items():
            x, floored = speed(model, tok, ids, args.drafter, args.max_tokens, settings)
            got[name].append(x)
            row.append(f"{name} {x:.2f} ({floored:.0%} floored)")
        print(p.id, " | ".join(row), flush=True)
    cats = sorted({p.category for p in prompts})
    print("\n| variant | median | geometric mean | " + " | ".join(cats) + " |")
    print("|---" * (len(cats) + 3) + "|")
    for name, xs in got.items():
        by = [statistics.median(x for x, p in zip(xs, prompts) if p.category == c) for c in cats]
        mid, geo = statistics.median(xs), statistics.geometric_mean(xs)
        print(f"| {name} | {mid:.3f} | {geo:.3f} | " + " | ".join(f"{b:.2f}" for b in by) + " |")


if __name__ == "__main__":
    main()
