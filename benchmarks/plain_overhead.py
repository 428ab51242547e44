"""What a drafter costs on steps where it does not draft: adaspec with a never-speculate policy
(every step plain, but the drafter still sees each token and its tap features) against mlx-lm's
own AR and adaspec without a drafter, interleaved, on one open prompt.

    python benchmarks/plain_overhead.py [--drafter dflash:DIR] [--drafter auto:DIR] [--reps 3]
"""

import argparse
import time

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.api import stream_generate
from adaspec.loop.controller import NeverSpeculate
from adaspec.prompting import messages_for, prompt_ids
from adaspec.targets.loader import load

PROMPT = "Write a short story about a robot learning to bake bread."


def decode_rate(events) -> float:
    """Tokens per second after the first token (the prefill is not part of it)."""
    n, t0 = 0, 0.0
    for _ in events:
        n += 1
        if n == 1:
            t0 = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", default=[])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import mlx_lm  # after adaspec: the fast BLAS is loaded before mlx

    model, tok = load(args.model)
    ids = prompt_ids(tok, messages_for(PROMPT))
    n = args.max_tokens

    def never(spec: str):
        return lambda: stream_generate(
            model, tok, ids, drafter=spec, max_tokens=n, policy=NeverSpeculate()
        )

    arms = {
        "mlx-lm AR": lambda: mlx_lm.stream_generate(model, tok, ids, max_tokens=n),
        "adaspec, no drafter": lambda: stream_generate(
            model, tok, ids, drafter="none", max_tokens=n
        ),
        **{f"{d}, never drafting": never(d) for d in args.drafter or ["pld"]},
    }
    rates: dict[str, list[float]] = {k: [] for k in arms}
    for f in arms.values():  # warm-up
        decode_rate(f())
    for _ in range(args.reps):
        for k, f in arms.items():
            rates[k].append(decode_rate(f()))
    best = max(rates["mlx-lm AR"])
    print(f"{args.model}, {n} tokens, {args.reps} interleaved runs each (tok/s)")
    print("| arm | runs | best | best vs mlx-lm |")
    print("|---|---|---|---|")
    for k, v in rates.items():
        runs = " / ".join(f"{x:.1f}" for x in v)
        print(f"| {k} | {runs} | {max(v):.1f} | {max(v) / best:.2f}x |")


if __name__ == "__main__":
    main()
