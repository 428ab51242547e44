"""A forward read at once, handed to mlx's stream whole or in pieces as its graph is built
(ADASPEC_FORWARD_PIECES): ms per synchronous forward (build, compute, read the greedy token) of
1, 3 and 8 token rows through adaspec's target, each piece count taking turns in rounds, and
the ratio of each to one piece (docs/speed.md, "A forward in pieces").

    python benchmarks/forward_pieces.py [--model smollm2-135m] [--context 200]
        [--rows 1,3,8] [--pieces 1,2,3,5,10] [--rounds 5] [--steps 60] [--json out.json]
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import statistics
import time
from datetime import date

import adaspec  # noqa: F401  (loads the BLAS before mlx)

import mlx.core as mx

from adaspec.targets import make_target
from adaspec.targets.loader import load


def ms_per_forward(target, tokens: list[int], steps: int) -> float:
    """Mean ms of a forward over `tokens` read at once (the cache rolled back after each)."""
    t = time.perf_counter()
    for _ in range(steps):
        fwd = target.forward(tokens)
        mx.argmax(fwd.logits[-1]).item()
        target.rollback(len(tokens))
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rows", default="1,3,8")
    p.add_argument("--pieces", default="1,2,3,5,10")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", default=None, help="write the numbers here")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    pieces = [int(k) for k in a.pieces.split(",")]
    if 1 not in pieces or min(pieces) < 1:
        p.error(f"--pieces {a.pieces}: counts >= 1, including 1 (the ratios are to it)")
    model, _ = load(a.model)
    target = make_target(model)
    target.prefill([10 + i % 900 for i in range(a.context)])
    times: dict[tuple[int, int], list[float]] = {(r, k): [] for r in rows for k in pieces}
    for _ in range(a.rounds):
        for r in rows:
            tokens = [11 + i for i in range(r)]
            for k in pieces:
                target.pieces = k
                ms_per_forward(target, tokens, 5)  # warm
                times[r, k].append(ms_per_forward(target, tokens, a.steps))
    table = []
    print(f"{a.model}, context {a.context}: ms per forward read at once (median of rounds)")
    print("rows | " + " | ".join(f"{k} piece{'s' * (k > 1)}" for k in pieces))
    for r in rows:
        ms = {k: statistics.median(times[r, k]) for k in pieces}
        table.append({"rows": r, "ms": ms, "ratio_to_whole": {k: ms[k] / ms[1] for k in pieces}})
        print(f"{r:4d} | " + " | ".join(f"{ms[k]:.2f} ({ms[k] / ms[1]:.2f}x)" for k in pieces))
    if a.json:
        out = {
            "date": date.today().isoformat(),
            "config": vars(a),
            "table": table,
            "rounds": {f"{r}x{k}": v for (r, k), v in times.items()},
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
